"""einsum, reductions, softmax and norms on drawn meshes equal dense torch."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, check_op, meshes, rand, rules_for

SET = settings(max_examples=12, deadline=None)


@given(data=st.data())
@SET
def test_einsum_matmul(data):
    mesh = data.draw(meshes())
    b, d, f = (data.draw(SIZES) for _ in range(3))
    rules = data.draw(rules_for(mesh, ["batch", "d_model", "d_ff"]))
    check_op(lambda x, w: mt.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w),
             lambda x, w: x @ w,
             [(rand(b, d, seed=1), f"batch:{b},d_model:{d}"), (rand(d, f, seed=2), f"d_model:{d},d_ff:{f}")],
             mesh, rules)


@given(data=st.data(), equation=st.sampled_from(["d h, d h ->", "d h, h d ->", "d h, d h -> h",
                                                  "d h, d ->", "b d h, d h -> b"]))
@SET
def test_einsum_contracting_several_dims_at_once(data, equation):
    # a contraction of two or more dims of both operands (down to a scalar): one mm of the
    # flattened dims (a full contraction of two 2-d operands once kept w 2-d: a shape error)
    mesh = data.draw(meshes())
    sizes = {n: data.draw(SIZES) for n in "bdh"}
    rules = data.draw(rules_for(mesh, ["b", "d", "h"]))
    specs = [part.split() for part in equation.split("->")[0].split(",")]
    ins = [(rand(*[sizes[n] for n in spec], seed=i + 1), ",".join(f"{n}:{sizes[n]}" for n in spec))
           for i, spec in enumerate(specs)]
    torch_eq = equation.replace(" ", "")
    check_op(lambda x, y: mt.einsum(equation, x, y), lambda x, y: torch.einsum(torch_eq, x, y), ins, mesh,
             rules)


@given(data=st.data())
@SET
def test_einsum_three_operands_and_output_shape_form(data):
    mesh = data.draw(meshes())
    a, b, c, e = (data.draw(SIZES) for _ in range(4))
    rules = data.draw(rules_for(mesh, ["a", "b", "c", "e"]))
    ins = [(rand(a, b, seed=1), f"a:{a},b:{b}"), (rand(c, b, seed=2), f"c:{c},b:{b}"),
           (rand(e, c, seed=3), f"e:{e},c:{c}")]
    check_op(lambda x, y, z: mt.einsum(x, y, z, output_shape=["e", "a"]),
             lambda x, y, z: torch.einsum("ab,cb,ec->ea", x, y, z), ins, mesh, rules)


def test_einsum_equation_errors():
    x = mt.ones("a:2,b:3")
    with pytest.raises(mt.errors.ShapeError, match="operand 0 is named 'a c'"):
        mt.einsum("a c -> a", x)
    with pytest.raises(mt.errors.ShapeError, match="no '->'"):
        mt.einsum("a b", x)


@pytest.mark.parametrize("form", ["equation", "output_shape"])
def test_einsum_names_an_operand_that_is_no_mesh_tensor(form):
    # the form without an equation once read the second operand's .shape.names: a bare
    # AttributeError for a MeshParameter or a torch tensor; both forms now name the operand
    d, h = mt.Dim("d", 8), mt.Dim("h", 6)
    x = mt.from_global(torch.randn(6, 8), "batch:6,d:8")
    w = mt.nn.MeshParameter(mt.Shape([d, h]), "normal")

    def call(*xs):
        if form == "equation":
            return mt.einsum("batch d, d h -> batch h", *xs)
        return mt.einsum(*xs, output_shape=["batch", "h"])

    for bad, kind in [(w, "MeshParameter"), (torch.randn(8, 6), "Tensor")]:
        with pytest.raises(mt.errors.ShapeError, match=f"einsum operand 1 is a {kind}, not a MeshTensor"):
            call(x, bad)
    with pytest.raises(mt.errors.ShapeError, match="operand 0 is a Tensor.*mt.from_global"):
        call(torch.randn(6, 8), w.mesh_tensor)
    torch.testing.assert_close(call(x, w.mesh_tensor).to_global(), x.to_global() @ w.mesh_tensor.to_global())


REDUCE = [
    (mt.reduce_sum, lambda t, i: t.sum(i)),
    (mt.reduce_mean, lambda t, i: t.mean(i)),
    (mt.reduce_max, lambda t, i: t.amax(i)),
    (mt.reduce_min, lambda t, i: t.amin(i)),
    (mt.reduce_logsumexp, lambda t, i: torch.logsumexp(t, i)),
]


@pytest.mark.parametrize("k", range(len(REDUCE)))
@given(data=st.data())
@SET
def test_reductions(k, data):
    mt_fn, torch_fn = REDUCE[k]
    mesh = data.draw(meshes())
    sizes = [data.draw(SIZES) for _ in range(3)]
    names = ["p", "q", "r"]
    rules = data.draw(rules_for(mesh, names))
    which = data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=3, unique=True))
    spec = ",".join(f"{n}:{s}" for n, s in zip(names, sizes))
    check_op(lambda x: mt_fn(x, [names[i] for i in which]), lambda t: torch_fn(t, sorted(which)),
             [(rand(*sizes, seed=5), spec)], mesh, rules)


def test_reduce_output_shape_form():
    x = rand(4, 8)
    check_op(lambda x: mt.reduce_sum(x, output_shape=["q"]), lambda t: t.sum(0),
             [(x, "p:4,q:8")], "x:2,y:2", "p:x; q:y")


@pytest.mark.parametrize("mt_fn, torch_fn", [(mt.softmax, F.softmax), (mt.log_softmax, F.log_softmax)])
@given(data=st.data())
@SET
def test_softmax(mt_fn, torch_fn, data):
    mesh = data.draw(meshes())
    b, v = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "vocab"]))
    check_op(lambda x: mt_fn(x, "vocab"), lambda t: torch_fn(t, -1),
             [(rand(b, v, seed=6) * 3, f"batch:{b},vocab:{v}")], mesh, rules)


@given(data=st.data())
@SET
def test_layer_norm_with_affine(data):
    mesh = data.draw(meshes())
    b, d = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "d_model"]))
    check_op(lambda x, w, c: mt.layer_norm(x, "d_model", w, c, eps=1e-5),
             lambda x, w, c: F.layer_norm(x, (d,), w, c, eps=1e-5),
             [(rand(b, d, seed=7), f"batch:{b},d_model:{d}"), (rand(d, seed=8), f"d_model:{d}"),
              (rand(d, seed=9), f"d_model:{d}")], mesh, rules)


@given(data=st.data())
@SET
def test_rms_norm(data):
    mesh = data.draw(meshes())
    b, d = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "d_model"]))

    def ref(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    check_op(lambda x, w: mt.rms_norm(x, "d_model", w), ref,
             [(rand(b, d, seed=7), f"batch:{b},d_model:{d}"), (rand(d, seed=8), f"d_model:{d}")],
             mesh, rules)


def test_reduce_max_gradient_with_cross_processor_tie():
    # both halves of a split dim hold the maximum: the gradient is shared, as torch.amax does
    x = torch.tensor([1.0, 5.0, 0.0, 5.0], dtype=torch.float64)
    check_op(lambda x: mt.reduce_max(x, "t"), lambda t: t.amax(0), [(x, "t:4")], "x:2", "t:x")
