"""Dims, shapes, meshes and layout rules (docs/design.md, "Vocabulary"), checked by hand and by
an independent re-statement of the layout rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.errors import LayoutError, MeshError, ShapeError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh


def test_shape_parse_and_access():
    s = mt.Shape("batch:8, seq:16")
    assert s.names == ("batch", "seq") and s.sizes == (8, 16) and s.numel == 128
    assert s == mt.Shape([mt.Dim("batch", 8), ("seq", 16)])
    assert s["seq"] == mt.Dim("seq", 16) and s.index("seq") == 1
    assert str(s.without(["batch"])) == "seq:16"
    assert mt.Shape("") == mt.Shape([]) and mt.Shape("").numel == 1


@pytest.mark.parametrize(
    "spec, match",
    [
        ("batch:8,batch:4", "repeats dim name"),
        ("batch", "cannot parse"),
        ("batch:x", "cannot parse"),
        ("9lives:3", "not an identifier"),
    ],
)
def test_shape_errors(spec, match):
    with pytest.raises(ShapeError, match=match):
        mt.Shape(spec)


def test_shape_unknown_dim_names_shape():
    with pytest.raises(ShapeError, match=r"dim 'd' is not in shape \[a:2,b:3\]"):
        mt.Shape("a:2,b:3").index("d")


def test_mesh_row_major():
    m = Mesh("b:2,m:4")
    assert m.size == 8 and m.axis_names == ("b", "m")
    assert [m.coords(r) for r in (0, 3, 4, 7)] == [
        {"b": 0, "m": 0}, {"b": 0, "m": 3}, {"b": 1, "m": 0}, {"b": 1, "m": 3}]
    assert all(m.rank(m.coords(r)) == r for r in range(8))
    assert m.group(6, ["m"]) == (4, 5, 6, 7) and m.group(6, ["b"]) == (2, 6)
    assert Mesh("b:2;m:4") == m


@pytest.mark.parametrize("spec, match", [("b:0", "sizes are ints >= 1"), ("b", "cannot parse"),
                                         ("b:2,b:2", "repeats an axis")])
def test_mesh_errors(spec, match):
    with pytest.raises(MeshError, match=match):
        Mesh(spec)


@pytest.mark.parametrize("kind, make, error", [("shape", mt.Shape, ShapeError), ("mesh", Mesh, MeshError)])
@pytest.mark.parametrize("size", ["--3", "²", "3.5", "", "0x2", "1e2"])
def test_a_size_that_is_no_whole_number_is_named_alike_in_a_shape_and_a_mesh(kind, make, error, size):
    """Shapes and meshes are read by one parser (meshtorch.shape.named_sizes): a size that is not a
    whole number of ASCII digits is the user's error naming the part, never a ValueError of int()."""
    with pytest.raises(error, match=f"cannot parse 'a:{size}' in {kind} 'x:2,a:{size}'"):
        make(f"x:2,a:{size}")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), st.integers(1, 99)),
                max_size=4, unique_by=lambda p: p[0]),
       st.lists(st.sampled_from([",", ";", " , ", "; "]), min_size=4, max_size=4))
def test_a_shape_and_a_mesh_read_the_same_text_as_the_same_pairs(pairs, seps):
    text = "".join(f"{name}:{size}{sep}" for (name, size), sep in zip(pairs, seps))
    assert mt.Shape(text) == mt.Shape(pairs) and mt.Shape(text).sizes == tuple(s for _, s in pairs)
    assert Mesh(text).axes == tuple(pairs)


def test_rules_errors():
    with pytest.raises(LayoutError, match=r"'batch' has two rules, 'batch:b' and 'batch:m'.*'batch:\(a,b\)'"):
        LayoutRules("batch:b; batch:m")
    with pytest.raises(LayoutError, match="names an axis twice"):
        LayoutRules("batch:(b,b)")
    with pytest.raises(LayoutError, match="cannot parse the axes"):
        LayoutRules("batch:(b,)")
    with pytest.raises(LayoutError, match="names axis 'q', which mesh 'b:2' does not have"):
        mt.launch(lambda: None, mesh="b:2", rules="batch:q")
    with pytest.raises(LayoutError, match="cannot parse rule"):
        LayoutRules("batch")
    # a dim name no tensor can have would never apply: say so instead of ignoring the rule
    for spec, dim in (("batch:b; d ff:m", "d ff"), ("1st:b", "1st")):
        with pytest.raises(LayoutError, match=f"rule '{dim}:.' names dim '{dim}', which is not a dim name"):
            LayoutRules(spec)
    with pytest.raises(LayoutError, match="rule 'd-ff:m' names dim 'd-ff'"):
        LayoutRules({"d-ff": "m"})


def test_an_undivided_dim_is_split_in_torch_chunk_pieces():
    # 6 over 4 processors: torch.chunk's pieces 2, 2, 2 and an empty one, as DTensor's Shard
    def prog():
        x = mt.from_global(torch.arange(24.0).reshape(6, 4), "batch:6,d:4", name="activations")
        return tuple(x.local.shape), x.to_global()

    outs = mt.launch(prog, mesh="b:4", rules="batch:b")
    assert [o[0] for o in outs] == [(2, 4), (2, 4), (2, 4), (0, 4)]
    for _, whole in outs:
        assert torch.equal(whole, torch.arange(24.0).reshape(6, 4))
    lay = LayoutRules("batch:b").layout(mt.Shape("batch:6,d:4"), Mesh("b:4"))
    assert not lay.even and lay.local_sizes_at({"b": 3}) == (0, 4)
    with pytest.raises(LayoutError, match="local_sizes_at"):
        _ = lay.local_sizes


def test_earlier_dim_takes_shared_axis():
    rules = LayoutRules("batch:b; d_model:b; d_ff:m")
    mesh = Mesh("b:2,m:2")
    assert rules.layout(mt.Shape("batch:4,d_model:4"), mesh).split == {"batch": ("b",)}
    assert rules.layout(mt.Shape("d_model:4,d_ff:4"), mesh).split == {"d_model": ("b",), "d_ff": ("m",)}
    assert rules.layout(mt.Shape("d_model:4,batch:4"), mesh).split == {"d_model": ("b",)}


def test_unused_names_the_rules_no_tensor_of_a_model_has():
    """A rule for a dim no tensor has (a typo: dff for d_ff) splits nothing, silently; unused() is how
    to see it: over a module's parameters, an input's shape, a MeshTensor."""
    d, f = mt.Dim("d_model", 8), mt.Dim("d_ff", 16)

    def step(rules):
        ff = mt.nn.Sequential(mt.nn.Dense(d, f), mt.nn.Dense(f, d))
        x = mt.ones("batch:4,d_model:8")
        ff(x)
        r = LayoutRules(rules)
        kernel = next(iter(ff.mesh_parameters()))  # the first Dense's [d_model, d_ff]
        return r.unused(ff), r.unused(ff, x), r.unused(ff, "batch:4"), str(kernel.layout)

    typo = "batch:b; dff:m; heads:m"
    params, with_x, with_text, kernel = mt.launch(step, typo, mesh="b:2,m:2", rules=typo)[0]
    assert kernel == "replicated"  # the typo split nothing, and raised nothing
    assert params == ["batch:b", "dff:m", "heads:m"]  # parameters have no batch
    assert with_x == with_text == ["dff:m", "heads:m"]
    right = "batch:b; d_ff:m"
    assert mt.launch(step, right, mesh="b:2,m:2", rules=right)[0][1:] == ([], [], "d_ff:m")
    assert LayoutRules("").unused("a:2") == [] and LayoutRules("a:(x,y)").unused() == ["a:(x,y)"]
    with pytest.raises(ShapeError, match="unused.. takes Shapes"):
        LayoutRules("a:x").unused(torch.ones(2))


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(["x", "y"])),
       st.lists(st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=3, unique=True), max_size=3))
@settings(max_examples=30, deadline=None)
def test_unused_is_the_rules_whose_dim_no_shape_has(rule_map, shapes):
    used = {n for names in shapes for n in names}
    got = LayoutRules(rule_map).unused(*(mt.Shape([(n, 2) for n in names]) for names in shapes))
    assert got == [f"{k}:{v}" for k, v in rule_map.items() if k not in used]


@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True),
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(["x", "y"])),
)
@settings(max_examples=50, deadline=None)
def test_layout_rule_matches_statement(names, rule_map):
    # the layout rule of docs/design.md stated independently: walk dims in order, take the axis if still free
    mesh = Mesh("x:2,y:2")
    shape = mt.Shape([(n, 4) for n in names])
    lay = LayoutRules(rule_map).layout(shape, mesh)
    free, expect = {"x", "y"}, {}
    for n in names:
        if n in rule_map and rule_map[n] in free:
            expect[n] = (rule_map[n],)
            free.discard(rule_map[n])
    assert lay.split == expect
    assert lay.local_sizes == tuple(2 if n in expect else 4 for n in names)
    for axis in ("x", "y"):
        assert (lay.dim_of(axis) is None) == ((axis,) not in expect.values())


def test_local_slices_tile_the_tensor():
    rules = LayoutRules("a:x; b:y")
    mesh = Mesh("x:2,y:4")
    lay = rules.layout(mt.Shape("a:4,b:8,c:3"), mesh)
    seen = set()
    for r in range(mesh.size):
        (a0, an), (b0, bn), (c0, cn) = lay.slices(mesh.coords(r))
        cells = {(i, j) for i in range(a0, a0 + an) for j in range(b0, b0 + bn)}
        assert not cells & seen
        seen |= cells
    assert len(seen) == 32
