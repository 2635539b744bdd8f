"""Mesh-TF parity, elementwise and nn ops: on drawn meshes and rules, values and gradients equal
dense torch (torch.nn.functional where it has the op, hand formulas where only Mesh-TF does)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, check_op, meshes, rand, rules_for
from meshtorch.errors import ArgumentError, ShapeError

SET = settings(max_examples=6, deadline=None)

def _divisors(n: int, seed: int) -> torch.Tensor:
    # both signs, kept away from 0 so that floor(x / y) is far from its jumps
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return sign * (0.5 + 2 * torch.rand(n, generator=g, dtype=torch.float64))


@given(data=st.data())
@SET
def test_mod_values_and_grads_broadcast_by_name(data):
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "q"]))
    x, y = 5 * rand(a, b), _divisors(b, 1)
    # the remainder has the divisor's sign (Python %, tf.math.floormod), unlike torch.fmod
    check_op(mt.mod, lambda x, y: x - y * torch.floor(x / y).detach(),
             [(x, f"p:{a},q:{b}"), (y, f"q:{b}")], mesh, rules)
    check_op(lambda x, y: x % y, torch.remainder, [(x, f"p:{a},q:{b}"), (y, f"q:{b}")], mesh, rules)


@given(data=st.data())
@SET
def test_floordiv_values_and_no_gradient(data):
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "q"]))
    x, y = 5 * rand(a, b), _divisors(a, 2)
    check_op(mt.floordiv, lambda x, y: torch.floor(x / y[:, None]),
             [(x, f"p:{a},q:{b}"), (y, f"p:{a}")], mesh, rules, grad=False)

    def prog():
        t = mt.from_global(x, f"p:{a},q:{b}", requires_grad=True)
        loss = mt.reduce_sum(t // 2.0 + t * 3.0)  # floordiv adds nothing to the gradient
        loss.backward()
        return (7 // mt.from_global(torch.tensor([2.0, -2.0]), "r:2")).to_global(), t.grad.to_global()

    for q, g in mt.launch(prog, mesh=mesh, rules=rules):
        assert q.tolist() == [3.0, -4.0]
        assert torch.equal(g, torch.full((a, b), 3.0, dtype=torch.float64))


@given(data=st.data(), how=st.sampled_from(["any", "all"]), density=st.sampled_from([0.05, 0.5, 0.95]))
@SET
def test_reduce_any_all_along_split_dims(data, how, density):
    mesh = data.draw(meshes())
    a, b, c = data.draw(SIZES), data.draw(SIZES), 3  # c: 3 does not divide the axes: uneven pieces
    rules = data.draw(rules_for(mesh, ["p", "q", "r"]))
    reduced = data.draw(st.sampled_from([None, "p", ["q", "r"], ["p", "r"]]))
    g = torch.Generator().manual_seed(a * b)
    x = torch.rand(a, b, c, generator=g) < density
    names = ["p", "q", "r"] if reduced is None else [reduced] if isinstance(reduced, str) else reduced
    dims = tuple("pqr".index(n) for n in names)
    mt_fn = mt.reduce_any if how == "any" else mt.reduce_all
    torch_fn = torch.any if how == "any" else torch.all

    def ref(t):
        for d in sorted(dims, reverse=True):
            t = torch_fn(t, d)
        return t

    check_op(lambda t: mt_fn(t, reduced), ref, [(x, f"p:{a},q:{b},r:{c}")], mesh, rules, grad=False)
    # numbers count as their truth (non-zero), as torch.any
    check_op(lambda t: mt_fn(t, reduced), ref, [(x.to(torch.int64) * 7, f"p:{a},q:{b},r:{c}")], mesh, rules,
             grad=False)


def test_bool_error_points_to_reduce_any_which_gives_the_truth():
    x = mt.from_global(torch.tensor([0.0, 2.0]), "a:2")
    with pytest.raises(ShapeError, match="reduce_any"):
        bool(x)
    assert mt.reduce_any(x > 1).item() is True and mt.reduce_all(x > 1).item() is False


def _softmax_extra(x: torch.Tensor, e, dim: int) -> torch.Tensor:
    # Mesh-TF: one more logit of value e in the denominator (a number e in x's dtype: a float32
    # exp(2.0) alone is 1e-8 off, more than the float64 tolerance)
    return x.exp() / (x.exp().sum(dim, keepdim=True) + torch.as_tensor(e, dtype=x.dtype).exp())


@given(data=st.data(), extra=st.sampled_from([0.0, -1.5, 2.0]))
@SET
def test_softmax_extra_logit_number(data, extra):
    mesh = data.draw(meshes())
    a, v = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "vocab"]))
    x = rand(a, v)
    check_op(lambda t: mt.softmax(t, "vocab", extra_logit=extra), lambda t: _softmax_extra(t, extra, 1),
             [(x, f"batch:{a},vocab:{v}")], mesh, rules)
    check_op(lambda t: mt.log_softmax(t, "vocab", extra_logit=extra),
             lambda t: _softmax_extra(t, extra, 1).log(), [(x, f"batch:{a},vocab:{v}")], mesh, rules)


@given(data=st.data())
@SET
def test_softmax_extra_logit_tensor_gets_its_gradient(data):
    mesh = data.draw(meshes())
    a, v = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "vocab"]))
    # vocab first: the extra logit's dims are the trailing dims of the result
    check_op(lambda t, e: mt.softmax(t, "vocab", extra_logit=e),
             lambda t, e: _softmax_extra(t, e[None, :], 0),
             [(rand(v, a), f"vocab:{v},batch:{a}"), (rand(a, seed=3), f"batch:{a}")], mesh, rules)
    check_op(lambda t, e: mt.reduce_logsumexp(t, "vocab", extra_logit=e),
             lambda t, e: torch.logsumexp(torch.cat([t, e[None, :]], 0), 0),
             [(rand(v, a), f"vocab:{v},batch:{a}"), (rand(a, seed=3), f"batch:{a}")], mesh, rules)


def test_extra_logit_with_a_dim_the_result_lacks_is_an_error():
    x = mt.zeros("batch:2,vocab:4")
    with pytest.raises(ShapeError, match="extra_logit"):
        mt.softmax(x, "vocab", extra_logit=mt.zeros("vocab:4"))


def _soft_ce(logits, targets, z):
    lse = torch.logsumexp(logits, -1)
    return -(targets * (logits - lse[..., None])).sum(-1) + z * lse ** 2


@given(data=st.data(), z=st.sampled_from([0.0, 1e-4, 0.5]),
       reduction=st.sampled_from(["none", "mean", "sum"]))
@SET
def test_cross_entropy_soft_targets_and_z_loss(data, z, reduction):
    mesh = data.draw(meshes())
    a, b, v = data.draw(SIZES), 3, data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "seq", "vocab"]))
    logits = 3 * rand(a, b, v)
    targets = torch.softmax(rand(a, b, v, seed=5), -1)
    red = {"none": lambda t: t, "mean": torch.mean, "sum": torch.sum}[reduction]
    # targets in another dim order than the logits: matched by name; they get a gradient too
    check_op(lambda lg, t: mt.cross_entropy(lg, t, "vocab", z_loss=z, reduction=reduction),
             lambda lg, t: red(_soft_ce(lg, t.permute(1, 2, 0), z)),
             [(logits, f"batch:{a},seq:{b},vocab:{v}"), (targets.permute(2, 0, 1).contiguous(),
                                                       f"vocab:{v},batch:{a},seq:{b}")], mesh, rules)


@given(data=st.data(), z=st.sampled_from([1e-4, 0.5]))
@SET
def test_cross_entropy_hard_targets_z_loss_and_ignore_index(data, z):
    mesh = data.draw(meshes())
    a, v = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["batch", "vocab"]))
    logits = 3 * rand(a, v)
    ids = torch.arange(a) % v
    ids[1] = -100

    def ref(lg, t):
        keep = t != -100
        ce = F.cross_entropy(lg, t, ignore_index=-100, reduction="none")
        return torch.where(keep, ce + z * torch.logsumexp(lg, -1) ** 2, 0.0)

    check_op(lambda lg, t: mt.cross_entropy(lg, t, "vocab", ignore_index=-100, z_loss=z), ref,
             [(logits, f"batch:{a},vocab:{v}"), (ids, f"batch:{a}")], mesh, rules)


def test_cross_entropy_soft_targets_hand_value():
    # uniform logits over 4 classes: CE = log 4 whatever the targets; z-loss adds z (log 4)^2
    logits = mt.zeros("b:1,v:4")
    targets = mt.from_global(torch.tensor([[0.7, 0.1, 0.1, 0.1]]), "b:1,v:4")
    got = mt.cross_entropy(logits, targets, "v", z_loss=0.25, reduction="sum").item()
    assert got == pytest.approx(math.log(4) + 0.25 * math.log(4) ** 2, rel=1e-6)


def test_cross_entropy_soft_target_errors_name_the_fix():
    logits = mt.zeros("b:2,v:4")
    with pytest.raises(ShapeError, match="soft"):
        mt.cross_entropy(logits, mt.zeros("b:2"), "v")
    with pytest.raises(ArgumentError, match="ignore_index"):
        mt.cross_entropy(logits, mt.zeros("b:2,v:4"), "v", ignore_index=-100)


@given(data=st.data(), noise=st.sampled_from([["d"], ["b", "d"], "t,d", "b:8"]))
@SET
def test_dropout_noise_shape_broadcasts_one_mask_on_any_layout(data, noise):
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, ["b", "t", "d"]))
    x = rand(8, 4, 8).abs() + 0.5  # no zeros, so a zero in the output is a dropped element
    rate = 0.5

    def prog():
        t = mt.from_global(x, "b:8,t:4,d:8", requires_grad=True)
        y = mt.dropout(t, rate, seed=11, noise_shape=noise)
        mt.reduce_sum(y).backward()
        return y.to_global().detach(), t.grad.to_global()

    (y1, g1), = mt.launch(prog, mesh="x:1")
    kept = y1 != 0
    names = noise.split(",") if isinstance(noise, str) and ":" not in noise else [noise.split(":")[0]] \
        if isinstance(noise, str) else noise
    for i, n in enumerate(["b", "t", "d"]):
        if n not in names:  # the mask is the same along a dim outside noise_shape
            assert torch.equal(kept, kept.select(i, 0).unsqueeze(i).expand_as(kept))
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(y1, torch.where(kept, x / (1 - rate), 0.0))
    torch.testing.assert_close(g1, kept.double() / (1 - rate))
    for y, g in mt.launch(prog, mesh=mesh, rules=rules):  # bitwise the same on every layout
        assert torch.equal(y, y1) and torch.equal(g, g1)


def test_dropout_noise_shape_must_be_dims_of_x():
    with pytest.raises(ShapeError, match="noise_shape dim q"):
        mt.dropout(mt.ones("t:3,d:4"), 0.5, seed=0, noise_shape=["q"])
    with pytest.raises(ShapeError, match="d:5"):
        mt.dropout(mt.ones("t:3,d:4"), 0.5, seed=0, noise_shape="d:5")


def test_communication_is_the_analytic_minimum():
    # elementwise ops on split dims talk not at all; any/all over a dim split on one axis is
    # one all_reduce there
    def prog():
        x = mt.from_global(rand(8, 4), "p:8,q:4")
        mt.reset_comm_stats()
        ys = [mt.elu(x), mt.leaky_relu(x), mt.softplus(x), mt.sign(x), mt.reciprocal(x), x // 2, x % 2]
        quiet = mt.comm_stats().calls()
        mt.reset_comm_stats()
        mt.reduce_any(x > 1, "p")
        return quiet, mt.comm_stats().calls(kind="all_reduce"), mt.comm_stats().calls(), len(ys)

    for quiet, reduces, total, n in mt.launch(prog, mesh="x:4", rules="p:x"):
        assert (quiet, reduces, total, n) == (0, 1, 1, 7)
