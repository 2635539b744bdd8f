"""Mesh-TF parity fixes: reduce_max/min gradients with ties do not depend on the layout (torch.amax's
rule), reductions honour output_shape's order, and einsum promotes mixed dtypes as elementwise ops do."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, check_op, fwd_bwd_counts, meshes, multi_rules_for, rand, rules_for

SET = settings(max_examples=8, deadline=None)


def _tied(*sizes: int, seed: int) -> torch.Tensor:
    # three values only: most rows hold ties, often spread over several processors
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, sizes, generator=g).double()


@pytest.mark.parametrize("how", ["max", "min"])
@given(data=st.data(), over=st.sampled_from([("q",), ("p", "q"), ("p",)]))
@SET
def test_extreme_gradient_with_ties_is_torch_amax_on_every_mesh(how, data, over):
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(multi_rules_for(mesh, ["p", "q"]))
    mt_fn = mt.reduce_max if how == "max" else mt.reduce_min
    torch_fn = torch.amax if how == "max" else torch.amin
    dims = [{"p": 0, "q": 1}[n] for n in over]
    check_op(lambda x: mt_fn(x, list(over)), lambda x: torch_fn(x, dims),
             [(_tied(a, b, seed=data.draw(st.integers(0, 99))), f"p:{a},q:{b}")], mesh, rules)


@pytest.mark.parametrize("mesh", ["m:1", "m:2", "m:4"])
def test_the_issue_row_gives_thirds_on_every_mesh(mesh):
    def prog():
        x = mt.from_global(torch.tensor([5.0, 5.0, 5.0, 1.0]), "t:4", requires_grad=True)
        mt.reduce_max(x).backward()
        return x.grad.to_global()

    for g in mt.launch(prog, mesh=mesh, rules="t:m"):
        torch.testing.assert_close(g, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))


def test_split_max_communicates_a_max_and_a_count_forward_and_nothing_backward():
    # the minimum: the max itself, and the tie count torch.amax's gradient needs (as before the fix,
    # when the count was all-reduced in backward)
    prog = fwd_bwd_counts(lambda: [mt.from_global(rand(3, 8), "p:3,t:8", requires_grad=True)],
                          lambda x: mt.reduce_max(x, "t"))
    for fwd, bwd in mt.launch(prog, mesh="x:4", rules="t:x"):
        assert fwd == {"all_reduce@x": {"calls": 2, "bytes": 2 * 3 * 8}}
        assert bwd == {}


def test_extreme_without_grad_is_one_all_reduce():
    def prog():
        x = mt.from_global(rand(3, 8), "p:3,t:8")
        mt.reset_comm_stats()
        mt.reduce_max(x, "t")
        return mt.comm_stats().calls(kind="all_reduce")

    assert mt.launch(prog, mesh="x:4", rules="t:x") == [1] * 4


REDUCERS = [
    (lambda x, o: mt.reduce_sum(x, output_shape=o), lambda x: x.sum(1)),
    (lambda x, o: mt.reduce_mean(x, output_shape=o), lambda x: x.mean(1)),
    (lambda x, o: mt.reduce_max(x, output_shape=o), lambda x: x.amax(1)),
    (lambda x, o: mt.reduce_min(x, output_shape=o), lambda x: x.amin(1)),
    (lambda x, o: mt.reduce_logsumexp(x, output_shape=o), lambda x: x.logsumexp(1)),
]


@pytest.mark.parametrize("i", range(len(REDUCERS)))
@given(data=st.data())
@settings(max_examples=5, deadline=None)
def test_output_shape_order_is_honoured(i, data):
    mt_fn, torch_fn = REDUCERS[i]
    mesh = data.draw(meshes())
    a, b, c = data.draw(SIZES), 4, data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["a", "b", "c"]))
    ys = check_op(lambda x: mt_fn(x, ["c", "a"]), lambda x: torch_fn(x).T,
                  [(rand(a, b, c, seed=i), f"a:{a},b:{b},c:{c}")], mesh, rules)
    assert ys[0][0].shape == (c, a)


def test_output_shape_order_in_fused_reductions():
    def prog():
        x = mt.from_global(torch.arange(24.0).reshape(2, 3, 4), "a:2,b:3,c:4")
        batch = mt.Reductions()
        s, m = batch.sum(x, output_shape=["c", "a"]), batch.mean(x, output_shape="c:4,a:2")
        out = batch.run()
        return out[s].shape, out[s].to_global(), out[m].to_global()

    ref = torch.arange(24.0).reshape(2, 3, 4)
    for shape, s, m in mt.launch(prog, mesh="x:2", rules="c:x; b:x"):
        assert shape == mt.Shape("c:4,a:2")
        torch.testing.assert_close(s, ref.sum(1).T)
        torch.testing.assert_close(m, ref.mean(1).T)


@given(data=st.data(), wide=st.sampled_from([0, 1]))
@SET
def test_einsum_promotes_mixed_dtypes_as_elementwise_ops_do(data, wide):
    mesh = data.draw(meshes())
    a, b, c = data.draw(SIZES), data.draw(SIZES), 4
    rules = data.draw(rules_for(mesh, ["p", "q", "r"]))
    x, w = rand(a, b, seed=1), rand(b, c, seed=2).float()
    inputs = [(x, f"p:{a},q:{b}"), (w, f"q:{b},r:{c}")]
    if wide:  # the float64 operand second
        inputs = inputs[::-1]
    # torch.result_type: float64 wins, and each input's gradient keeps the input's dtype
    ys = check_op(lambda u, v: mt.einsum(u, v, output_shape=["p", "r"]),
                  lambda u, v: (u.double() @ v.double()) if not wide else (v.double() @ u.double()),
                  inputs, mesh, rules, atol=1e-5, rtol=1e-5)
    y, grads = ys[0]
    assert y.dtype == torch.result_type(x, w) == torch.float64
    assert [g.dtype for g in grads] == [t.dtype for t, _ in inputs]


def test_float64_input_to_float32_dense_promotes_like_addition():
    dense = mt.nn.Dense(mt.Dim("d", 3), mt.Dim("h", 2))
    x = mt.from_global(torch.ones(2, 3, dtype=torch.float64), "batch:2,d:3")
    y = dense(x)
    want = torch.ones(2, 3, dtype=torch.float64) @ dense.kernel.mesh_tensor.to_global().double()
    assert y.dtype == (x + mt.ones("d:3")).dtype == torch.float64
    torch.testing.assert_close(y.to_global(), want)


@given(data=st.data(), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
@SET
def test_sample_with_temperature_is_gumbel_max_of_the_same_noise_on_every_mesh(data, temperature):
    mesh = data.draw(meshes())
    a, v = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(multi_rules_for(mesh, ["p", "v"]))
    logits = rand(a, v, seed=3).float()
    # the dense reference: Gumbel noise from the same layout-free uniform numbers, computed apart
    u = mt.random.uniform(f"p:{a},v:{v}", seed=7, dtype=torch.float32).to_global()
    g = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
    want = (logits + temperature * g).argmax(1)

    def prog():
        x = mt.from_global(logits, f"p:{a},v:{v}")
        mt.reset_comm_stats()
        mt.argmax(x, "v")
        argmax_calls = mt.comm_stats().as_dict()
        mt.reset_comm_stats()
        ids = mt.sample_with_temperature(x, "v", temperature, seed=7)
        calls = mt.comm_stats().as_dict()
        return ids.to_global(), calls, argmax_calls

    for ids, calls, argmax_calls in mt.launch(prog, mesh=mesh, rules=rules):
        assert torch.equal(ids, want)
        # the noise is drawn locally: argmax's communication, nothing more
        assert calls == argmax_calls


def test_sample_with_temperature_follows_the_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    rows = 20000

    def prog():
        x = mt.from_global(logits.repeat(rows, 1), f"p:{rows},v:4")
        return mt.sample_with_temperature(x, "v", 0.7, seed=11).to_global()

    ids = mt.launch(prog, mesh="x:4", rules="v:x")[0]
    freq = torch.bincount(ids, minlength=4).double() / rows
    want = torch.softmax(logits.double() / 0.7, 0)
    # four binomial standard deviations at most
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / rows).sqrt()).all(), (freq, want)


def test_sample_with_temperature_rejects_negative_temperature():
    with pytest.raises(mt.errors.ArgumentError, match="temperature"):
        mt.sample_with_temperature(mt.ones("v:3"), "v", -1.0)
