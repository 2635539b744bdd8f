"""Reshapes, relayouts, array ops along split dims, embeddings, cross entropy,
dropout and slicewise, on drawn meshes, against dense torch."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, aten_ops, check_op, meshes, rand, rules_for
from meshtorch.ops.array import add_rows, embedding_range

SET = settings(max_examples=10, deadline=None)


@given(data=st.data())
@SET
def test_rename_relayout_transpose(data):
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "q", "u", "v"]))
    x = rand(a, b)
    check_op(lambda x: mt.rename(x, "q", "v"), lambda t: t, [(x, f"p:{a},q:{b}")], mesh, rules)
    check_op(lambda x: mt.relayout(x, f"u:{a},v:{b}"), lambda t: t, [(x, f"p:{a},q:{b}")], mesh, rules)
    check_op(lambda x: mt.transpose(x, ["q", "p"]), lambda t: t.T, [(x, f"p:{a},q:{b}")], mesh, rules)


@given(data=st.data())
@SET
def test_reshape_merge_and_split(data):
    mesh = data.draw(meshes())
    a, b, c = (data.draw(SIZES) for _ in range(3))
    rules = data.draw(rules_for(mesh, ["p", "q", "r", "qr", "s"]))
    x = rand(a, b, c)
    check_op(lambda x: mt.replace_dims(x, ["q", "r"], f"qr:{b * c}"), lambda t: t.reshape(a, b * c),
             [(x, f"p:{a},q:{b},r:{c}")], mesh, rules)
    check_op(lambda x: mt.reshape(x, f"s:{a * b // 4},q:4,r:{c}"), lambda t: t.reshape(-1, 4, c),
             [(x, f"p:{a},q:{b},r:{c}")], mesh, rules)


def test_reshape_keeps_aligned_split_dim_local():
    def prog():
        x = mt.from_global(rand(8, 4, 6), "batch:8,h:4,d:6")
        mt.reset_comm_stats()
        y = mt.reshape(x, "batch:8,hd:24")
        return mt.comm_stats().bytes(), y.to_global()

    for nbytes, y in mt.launch(prog, mesh="b:4", rules="batch:b"):
        assert nbytes == 0
        assert torch.equal(y, rand(8, 4, 6).reshape(8, 24))


@given(data=st.data())
@SET
def test_slice_concat_pad(data):
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "t"]))
    x, y = rand(a, b, seed=1), rand(a, 4, seed=2)
    check_op(lambda x: mt.slice(x, "t", 1, b - 1 - (b - 1) % 4), lambda t: t[:, 1:1 + b - 1 - (b - 1) % 4],
             [(x, f"p:{a},t:{b}")], mesh, rules)
    check_op(lambda x, y: mt.concat([x, y], "t"), lambda x, y: torch.cat([x, y], 1),
             [(x, f"p:{a},t:{b}"), (y, f"p:{a},t:4")], mesh, rules)
    check_op(lambda x: mt.pad(x, "t", 1, 3, value=2.0), lambda t: F.pad(t, (1, 3), value=2.0),
             [(x, f"p:{a},t:{b}")], mesh, rules)


def _shift_ref(t, k, wrap):
    # out[:, i] = t[:, i - k], by explicit index arithmetic
    n = t.shape[1]
    cols = []
    for i in range(n):
        j = i - k
        if wrap:
            cols.append(t[:, j % n])
        else:
            cols.append(t[:, j] if 0 <= j < n else torch.zeros_like(t[:, 0]))
    return torch.stack(cols, 1)


@given(data=st.data(), k=st.integers(-13, 13), wrap=st.booleans())
@settings(max_examples=25, deadline=None)
def test_shift_including_split_dim_halo(data, k, wrap):
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "t"]))
    check_op(lambda x: mt.shift(x, "t", k, wrap=wrap), lambda t: _shift_ref(t, k, wrap),
             [(rand(a, b), f"p:{a},t:{b}")], mesh, rules)


def test_shift_by_one_sends_only_the_halo():
    def prog():
        x = mt.from_global(rand(2, 16), "p:2,t:16")
        mt.reset_comm_stats()
        mt.shift(x, "t", 1)
        return mt.comm_stats().as_dict()

    stats = mt.launch(prog, mesh="x:4", rules="t:x")
    # one column of 2 float64 per boundary; the last processor sends nothing
    assert [s.get("permute@x", {}).get("bytes") for s in stats] == [16, 16, 16, 0]


@given(data=st.data())
@SET
def test_one_hot_gather_cross_entropy_with_split_vocab(data):
    mesh = data.draw(meshes())
    b, v, d = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "vocab", "d_model"]))
    ids = torch.randint(0, v, (b,), generator=torch.Generator().manual_seed(3))
    table = rand(v, d, seed=4)
    check_op(lambda i: mt.one_hot(i, mt.Dim("vocab", v), dtype=torch.float64),
             lambda i: F.one_hot(i, v).double(), [(ids, f"batch:{b}")], mesh, rules, grad=False)
    check_op(lambda w, i: mt.embedding(w, i, "vocab"), lambda w, i: w[i],
             [(table, f"vocab:{v},d_model:{d}"), (ids, f"batch:{b}")], mesh, rules)
    check_op(lambda z, i: mt.cross_entropy(z, i, "vocab"),
             lambda z, i: F.cross_entropy(z, i, reduction="none"),
             [(rand(b, v, seed=5) * 2, f"batch:{b},vocab:{v}"), (ids, f"batch:{b}")], mesh, rules)


@given(data=st.data(), extra=st.integers(0, 5))
@SET
def test_embedding_range_is_the_lookup_of_its_ids_bitwise_with_the_same_collectives(data, extra):
    """Learned positions: rows offset.. of the table (a view where the table's dim is whole) are
    mt.embedding of the ids offset.. on every layout: values and gradients bitwise, the same
    collectives (calls and bytes, forward and backward; less the gather of the ids where the lookup
    moves them), and dense torch's ``table[offset:]``. An uneven split leaves a processor no rows."""
    mesh = data.draw(meshes())
    n, d = data.draw(SIZES), data.draw(SIZES)
    rows = n + extra
    off = data.draw(st.integers(0, extra))
    rules = data.draw(rules_for(mesh, ["positions", "length", "d_model"]))
    table, probe = rand(rows, d, seed=6), rand(n, d, seed=7)

    def prog():
        p = mt.from_global(probe, f"length:{n},d_model:{d}")
        got = []
        for lookup in (lambda w: mt.embedding(w, mt.from_global(torch.arange(off, off + n), f"length:{n}"),
                                              "positions"),
                       lambda w: embedding_range(w, "positions", mt.Dim("length", n), off)):
            w = mt.from_global(table, f"positions:{rows},d_model:{d}", requires_grad=True)
            mt.reset_comm_stats()
            y = lookup(w)
            mt.reduce_sum(y * p).backward()
            got.append((y.to_global().detach(), w.grad.to_global(), mt.comm_stats().as_dict()))
        return got

    results = mt.launch(prog, mesh=mesh, rules=rules)
    total = [{}, {}]  # bytes of each collective kind over all processors, lookup and range
    for (y0, g0, s0), (y1, g1, s1) in results:
        assert torch.equal(y1, y0) and torch.equal(g1, g0), (mesh, rules)
        if "length:" not in rules:  # whole ids: the lookup moves none of them
            assert s1 == s0, (mesh, rules, s0, s1)
        else:  # the same collectives, or fewer: no ids to gather where the table's plan needs them whole
            assert all(k in s0 and s1[k]["calls"] <= s0[k]["calls"] for k in s1), (mesh, rules, s0, s1)
            for t, s in zip(total, (s0, s1)):
                for k, v in s.items():
                    t[k] = t.get(k, 0) + v["bytes"]
    # (in bytes over all processors: over uneven pieces the lookup's gather of the ids sends nothing
    # from a processor whose piece of them is empty, where the range's gather of the gradient does)
    assert all(b <= total[0][k] for k, b in total[1].items()), (mesh, rules, total)
    for _, (y1, g1, _) in results:
        assert torch.equal(y1, table[off:off + n])
        want = torch.zeros_like(table)
        want[off:off + n] = probe
        torch.testing.assert_close(g1, want, rtol=0, atol=0)


@given(data=st.data(), extra=st.integers(0, 3))
@SET
def test_add_rows_is_the_sum_of_x_and_the_rows_bitwise(data, extra):
    """Learned positions added in one op: values and both gradients bitwise those of
    ``x + embedding_range(...)`` on every layout (a split position dim takes that path itself),
    and dense torch's ``x + table[offset:]``."""
    mesh = data.draw(meshes())
    b, n, d = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    rows = n + extra
    off = data.draw(st.integers(0, extra))
    rules = data.draw(rules_for(mesh, ["batch", "positions", "length", "d_model"]))
    table, xs, probe = rand(rows, d, seed=8), rand(b, n, d, seed=9), rand(b, n, d, seed=10)
    shape = f"batch:{b},length:{n},d_model:{d}"

    def prog():
        got = []
        for add in (lambda x, w: x + embedding_range(w, "positions", mt.Dim("length", n), off),
                    lambda x, w: add_rows(x, w, "positions", mt.Dim("length", n), off)):
            w = mt.from_global(table, f"positions:{rows},d_model:{d}", requires_grad=True)
            x = mt.from_global(xs, shape, requires_grad=True)
            y = add(x, w)
            mt.reduce_sum(y * mt.from_global(probe, shape)).backward()
            got.append((y.to_global().detach(), x.grad.to_global(), w.grad.to_global()))
        return got

    for (y0, gx0, gw0), (y1, gx1, gw1) in mt.launch(prog, mesh=mesh, rules=rules):
        assert torch.equal(y1, y0) and torch.equal(gx1, gx0) and torch.equal(gw1, gw0), (mesh, rules)
        assert torch.equal(y1, xs + table[off:off + n])
        want = torch.zeros_like(table)
        want[off:off + n] = probe.sum(0)
        torch.testing.assert_close(gw1, want, rtol=1e-12, atol=1e-12)


def data_parallel_lm_calls() -> tuple:
    from meshtorch.models import DecoderLM, TransformerConfig

    lm = DecoderLM(TransformerConfig(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=6,
                                     positions="learned"), seed=0)
    data = torch.randint(0, 32, (4, 7), generator=torch.Generator().manual_seed(0))
    ids, targets = (mt.from_global(t, "batch:4,length:6") for t in (data[:, :-1], data[:, 1:]))
    with mt.overlap():
        for _ in range(2):  # the second step: buckets cut by the first
            lm.zero_grad(set_to_none=True)
            mt.reset_comm_stats()
            lm.loss(ids, targets).backward()
    return mt.comm_stats().calls(kind="all_reduce"), lm.decoder.pos.table.grad.clone()  # replicated


def test_learned_positions_gradient_goes_into_the_data_parallel_buckets():
    # one all_reduce a step for the loss, one for the one bucket of every gradient (a tiny model):
    # the position table's gradient is summed there, not by a call of its own in backward
    (calls, g0), (_, g1) = mt.launch(data_parallel_lm_calls, mesh="b:2", rules="batch:b")
    ((_, dense),) = mt.launch(data_parallel_lm_calls, mesh="b:1", rules="")
    assert calls == 2
    assert torch.equal(g0, g1)
    torch.testing.assert_close(g0, dense, rtol=1e-5, atol=1e-6)


def test_embedding_range_outside_the_table_raises():
    table = mt.from_global(torch.zeros(4, 2), "positions:4,d:2")
    with pytest.raises(mt.errors.ArgumentError, match="rows 2..4 are outside dim 'positions' of size 4"):
        embedding_range(table, "positions", mt.Dim("length", 3), offset=2)


@pytest.mark.parametrize("rules", ["batch:b", "vocab:b"])
def test_bf16_logits_give_torch_s_fp32_loss_whole_or_split_vocab(rules):
    """As F.cross_entropy under autocast: bf16 logits, an fp32 loss (a bf16 loss near 5 nats
    would move in steps of 1/32), whether the vocabulary is whole on a processor or split."""
    logits = (rand(4, 64, seed=7) * 4).bfloat16()
    ids = torch.randint(0, 64, (4,), generator=torch.Generator().manual_seed(8))

    def loss():
        per = mt.cross_entropy(mt.from_global(logits, "batch:4,vocab:64"), mt.from_global(ids, "batch:4"))
        return per.dtype, per.to_global()

    want = F.cross_entropy(logits.float(), ids, reduction="none")
    for dtype, got in mt.launch(loss, mesh="b:2", rules=rules):
        assert dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@given(data=st.data(), reduction=st.sampled_from(["none", "mean", "sum"]))
@SET
def test_cross_entropy_ignore_index_is_torch_s_on_any_layout(data, reduction):
    mesh = data.draw(meshes())
    b, n, v = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "length", "vocab"]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    ids = torch.randint(0, v, (b, n), generator=gen)
    ignore = data.draw(st.sampled_from([-100, 0, v - 1]))  # also an id inside the vocabulary
    ids[torch.rand(b, n, generator=gen) < 0.3] = ignore
    ids[0, 0] = (ignore + 1) % v  # at least one position counts, so the mean is a number
    check_op(lambda z, i: mt.cross_entropy(z, i, "vocab", ignore_index=ignore, reduction=reduction),
             lambda z, i: F.cross_entropy(z.permute(0, 2, 1), i, ignore_index=ignore, reduction=reduction),
             [(rand(b, n, v, seed=6) * 2, f"batch:{b},length:{n},vocab:{v}"), (ids, f"batch:{b},length:{n}")],
             mesh, rules)


@pytest.mark.parametrize("mesh, rules", [("b:1", ""), ("b:2,m:2", "batch:b; vocab:m"), ("m:4", "vocab:m")])
@pytest.mark.parametrize("bad", [8, -1, 1000])
def test_ids_outside_the_vocabulary_raise_as_in_torch(mesh, rules, bad):
    # torch raises for both; a masked lookup over a split vocabulary would give zeros / logsumexp
    ids = torch.tensor([[1, 2], [3, bad]])
    with pytest.raises(IndexError):
        F.embedding(ids, torch.zeros(8, 4))
    with pytest.raises(IndexError):
        F.cross_entropy(torch.zeros(4, 8), ids.reshape(4))

    def lookup():
        table = mt.from_global(torch.zeros(8, 4), "vocab:8,d_model:4")
        return mt.embedding(table, mt.from_global(ids, "batch:2,length:2"), "vocab")

    def loss():
        logits = mt.from_global(torch.zeros(2, 2, 8), "batch:2,length:2,vocab:8")
        return mt.cross_entropy(logits, mt.from_global(ids, "batch:2,length:2"), "vocab")

    with pytest.raises(mt.errors.ArgumentError, match=rf"embedding: ids hold {bad}, outside dim 'vocab' "
                       r"of size 8 \(0..7\)"):
        mt.launch(lookup, mesh=mesh, rules=rules)
    with pytest.raises(mt.errors.ArgumentError, match=rf"cross_entropy: targets hold {bad}, .*ignore_index="):
        mt.launch(loss, mesh=mesh, rules=rules)
    with pytest.raises(mt.errors.ArgumentError, match="reduction='avg'"):
        mt.cross_entropy(mt.zeros("v:2"), mt.from_global(torch.tensor(0), ""), "v", reduction="avg")


def test_id_check_on_the_host_is_a_clamp_and_a_compare_and_reads_no_value():
    """check_ids on the CPU: two ATen ops (issue 27: each a Python call paid cold between large
    kernels), no value read into Python (``_local_scalar_dense``) while the ids are in range; the
    bad id still named when one is not (negative or too large)."""
    from meshtorch.ops.array import check_ids

    vocab = mt.Dim("vocab", 8)
    ids = mt.from_global(torch.tensor([[0, 7], [3, 5]]), "batch:2,length:2")
    names, _ = aten_ops(lambda: check_ids(ids, vocab, "embedding"))
    assert names == ["clamp.default", "equal.default"], names
    for bad in (-1, 8):
        with pytest.raises(mt.errors.ArgumentError, match=f"embedding: ids hold {bad}, outside dim 'vocab'"):
            check_ids(mt.from_global(torch.tensor([2, bad]), "batch:2"), vocab, "embedding")


def test_cross_entropy_on_the_host_leaves_the_target_check_to_gather():
    """On one processor, hard targets and no ignore_index: gather bounds-checks every target, so
    no clamp/equal runs first (issue 27); a bad target still raises check_ids' error, alone
    (no gather error chained to it), and the loss is F.cross_entropy's."""
    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 7, 0], [3, 5, 2]])
    lm, tm = mt.from_global(logits, "batch:2,length:3,vocab:8"), mt.from_global(ids, "batch:2,length:3")
    names, per = aten_ops(lambda: mt.cross_entropy(lm, tm, "vocab"))
    assert "clamp.default" not in names and "equal.default" not in names, names
    torch.testing.assert_close(per.to_global(), F.cross_entropy(logits.reshape(6, 8), ids.reshape(6),
                                                                reduction="none").reshape(2, 3))
    for bad in (-1, 8):
        with pytest.raises(mt.errors.ArgumentError, match=rf"targets hold {bad}, outside dim 'vocab'") as e:
            mt.cross_entropy(lm, mt.from_global(torch.tensor([[1, bad, 0], [3, 5, 2]]), "batch:2,length:3"))
        assert e.value.__suppress_context__


@given(data=st.data(), rate=st.sampled_from([0.1, 0.5]))
@settings(max_examples=6, deadline=None)
def test_dropout_mask_is_layout_invariant(data, rate):
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, ["p", "q"]))
    mask = mt.random.bernoulli("p:8,q:12", 1 - rate, seed=11, dtype=torch.float64).to_global()
    assert 0 < mask.mean() < 1
    check_op(lambda x: mt.dropout(x, rate, seed=11), lambda t: t * mask / (1 - rate),
             [(rand(8, 12), "p:8,q:12")], mesh, rules)


def test_dropout_without_seed_differs_per_call_but_not_per_layout():
    def prog():
        x = mt.ones("p:8,q:8")
        return mt.dropout(x, 0.5).to_global(), mt.dropout(x, 0.5).to_global()

    (a1, b1), = mt.launch(prog)
    outs = mt.launch(prog, mesh="x:2,y:2", rules="p:x; q:y")
    assert not torch.equal(a1, b1)
    assert all(torch.equal(a, a1) and torch.equal(b, b1) for a, b in outs)


@given(data=st.data())
@SET
def test_slicewise_with_whole_dim(data):
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, ["p", "t"]))
    check_op(lambda x: mt.slicewise(lambda t: torch.cumsum(t, 1), x, whole=["t"]),
             lambda t: torch.cumsum(t, 1), [(rand(4, 8), "p:4,t:8")], mesh, rules)


def test_slicewise_reduced_partial_sums():
    check_op(lambda x: mt.slicewise(lambda t: (t * t).sum(1), x, output_shape="p:4", reduced={"t": "sum"}),
             lambda t: (t * t).sum(1), [(rand(4, 8), "p:4,t:8")], "x:2,y:2", "p:x; t:y")


def test_embedding_rejects_float_ids():
    with pytest.raises(mt.errors.ShapeError, match="ids must be integers"):
        mt.embedding(mt.ones("vocab:4,d:2"), mt.ones("batch:2"), "vocab")


@pytest.mark.parametrize("mesh, rules", [
    ("x:2,y:2", "p:y; u:x"),              # position 0 moves from axis y to axis x
    ("x:4,y:2", "p:y; u:x"),
    ("x:2,y:2", "p:x; q:y; u:y; v:x"),    # two positions swap axes
    ("x:2,y:2", "p:x; v:x; u:y"),         # x moves from position 0 to 1, y arrives at 0
])
def test_relayout_moving_positions_between_axes(mesh, rules):
    x = rand(4, 4)
    check_op(lambda x: mt.relayout(x, "u:4,v:4"), lambda t: t, [(x, "p:4,q:4")], mesh, rules)
