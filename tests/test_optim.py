"""mt.optim: Adafactor's factored moments over named dims, clipping norms, decay groups."""

from __future__ import annotations

import math

import pytest
import torch

import meshtorch as mt

A, Bd = mt.Dim("rows", 8), mt.Dim("cols", 4)


def test_adafactor_first_step_hand_derived_and_factored_state_is_laid_out():
    """Step 1: decay = 0, so vr = vc = g² and the update is sign(g) (RMS 1, unclipped),
    times lr · RMS(param) = 0.1 · 1. Param ones, grad 3 → 0.9 everywhere."""
    def run():
        w = mt.ones([A, Bd], requires_grad=True)
        v = mt.ones([Bd], requires_grad=True)
        opt = mt.optim.Adafactor([w, v], lr=0.1, min_dim_size_to_factor=2)
        mt.reduce_sum((w + v) * 3.0).backward()  # dL/dw = 3, dL/dv = 3 * 8
        mt.reset_comm_stats()
        opt.step()
        st = opt.state[w.local]
        return (w.to_global(), v.to_global(), sorted(st), tuple(st["vr"].shape), tuple(st["vc"].shape),
                str(opt.state_shape(w.local, "vr")), mt.comm_stats().calls(kind="all_reduce"))

    for mesh, rules, vr_local, vc_local, reduces in [
        ("", "", (4,), (8,), 0),
        ("m:2", "rows:m", (4,), (4,), 1),  # mean over the split 'rows' is an all_reduce
        ("b:2,m:2", "rows:b; cols:m", (2,), (4,), 1),
    ]:
        for w, v, keys, vr_shape, vc_shape, shape, calls in mt.launch(run, mesh=mesh, rules=rules):
            torch.testing.assert_close(w, torch.full((8, 4), 0.9))
            torch.testing.assert_close(v, torch.full((4,), 0.9))
            assert keys == ["step", "vc", "vr"]
            assert shape == "cols:4"  # factored over the largest dim 'rows' first
            assert vr_shape == vr_local and vc_shape == vc_local
            assert calls >= reduces


def test_adafactor_relative_step_and_unfactored_small_dims():
    """Without lr, the step size is min(1e-2, 1/sqrt(t)) · RMS(param); dims below the
    factoring threshold keep a full second moment."""
    w = mt.full([A, Bd], 2.0, requires_grad=True)
    opt = mt.optim.Adafactor([w])  # min_dim_size_to_factor=128: not factored
    mt.reduce_sum(w * -1.0).backward()
    opt.step()
    assert sorted(opt.state[w.local]) == ["step", "v"]
    torch.testing.assert_close(w.to_global(), torch.full((8, 4), 2.0 + 1e-2 * 2.0))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_global_norm_matches_torch_on_the_dense_gradients(norm_type):
    g_w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    g_v = torch.randn(4, generator=torch.Generator().manual_seed(1))

    def run():
        w = mt.zeros([A, Bd], requires_grad=True)
        v = mt.zeros([Bd], requires_grad=True)
        loss = mt.reduce_sum(w * mt.from_global(g_w, [A, Bd])) + mt.reduce_sum(v * mt.from_global(g_v, [Bd]))
        loss.backward()
        norm = mt.optim.clip_grad_norm_([w, v], 0.5, norm_type=norm_type)
        return norm.item(), w.grad.to_global(), v.grad.to_global()

    ref_w, ref_v = g_w.clone().requires_grad_(), g_v.clone().requires_grad_()
    ref_w.grad, ref_v.grad = g_w.clone(), g_v.clone()
    want = torch.nn.utils.clip_grad_norm_([ref_w, ref_v], 0.5, norm_type=norm_type).item()
    for mesh, rules in [("", ""), ("b:2,m:2", "rows:b; cols:m"), ("b:2,m:2", "cols:b")]:
        for norm, gw, gv in mt.launch(run, mesh=mesh, rules=rules):
            assert math.isclose(norm, want, rel_tol=1e-6)
            torch.testing.assert_close(gw, ref_w.grad)
            torch.testing.assert_close(gv, ref_v.grad)


def test_nonfinite_norm_can_raise():
    w = mt.zeros([Bd], requires_grad=True)
    mt.reduce_sum(w * float("inf")).backward()
    with pytest.raises(mt.MeshTorchError, match="error_if_nonfinite=False"):
        mt.optim.clip_grad_norm_([w], 1.0, error_if_nonfinite=True)


def test_weight_decay_groups_by_dim_name():
    vocab, d, h = mt.Dim("vocab", 8), mt.Dim("d", 4), mt.Dim("h", 2)
    model = mt.nn.Sequential(mt.nn.Embedding(vocab, d), mt.nn.Dense(d, h), mt.nn.LayerNorm(h))
    groups = mt.optim.weight_decay_groups(model, 0.1, no_decay_dims=["vocab"], lr=0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [(g["weight_decay"], g["lr"], [names[id(p)] for p in g["params"]]) for g in groups] == [
        (0.1, 0.5, ["1.kernel"]), (0.0, 0.5, ["0.table", "1.bias", "2.weight", "2.bias"])]
    decayed = mt.optim.weight_decay_groups(model, 0.1, decay_vectors=True)
    assert len(decayed[0]["params"]) == 5
    # a bias of two dims (attention's [heads, d_kv]) is a bias too
    qkv = mt.nn.Sequential(mt.nn.Dense(d, [h, mt.Dim("d_kv", 3)]))
    names = {id(p): n for n, p in qkv.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in mt.optim.weight_decay_groups(qkv, 0.1)] == [
        ["0.kernel"], ["0.bias"]]


def _clip_reference(grads: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """clip_grad_norm_'s arithmetic on replicated gradients, written out: float64 norms per tensor,
    summed squares, the root in float32, each gradient scaled in its own dtype."""
    norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64))
    total = norms.pow(2.0).sum().pow(0.5).to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, [g * coef.to(g.dtype) for g in grads]


@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "mixed-dtypes"])
@pytest.mark.parametrize("listed", [False, True], ids=["module", "parameter-list"])
def test_clip_of_replicated_parameters_is_bitwise_the_reference(mixed, listed):
    """One processor: every gradient replicated, so the clip takes its fast path (no grouping by
    axes, no Fused); the gradients of a mixed-dtype model take the per-dtype fallback. Values
    bitwise those of the arithmetic written out; a module and its parameter list alike."""
    d, h = mt.Dim("d", 6), mt.Dim("h", 5)
    model = mt.nn.Sequential(mt.nn.Dense(d, h), mt.nn.LayerNorm(h), mt.nn.Dense(d, h))
    x = mt.random.normal([mt.Dim("batch", 3), d], seed=1)
    mt.reduce_sum(model[1](model[0](x)) ** 2).backward()
    if mixed:  # the second Dense in bf16
        model[2].to(torch.bfloat16)
        x = mt.cast(x, torch.bfloat16)
    mt.reduce_sum(model[2](x)).backward()
    params = list(model.parameters())
    assert len({p.grad.dtype for p in params}) == (2 if mixed else 1)
    want_norm, want = _clip_reference([p.grad.clone() for p in params], 0.25)
    norm = mt.optim.clip_grad_norm_(params if listed else model, 0.25)
    assert torch.equal(norm, want_norm) and norm.item() > 0.25
    for p, w in zip(params, want):
        assert p.grad.dtype == w.dtype and torch.equal(p.grad, w)


def test_clip_of_split_and_plain_tensors_takes_the_general_path():
    """A list mixing a MeshParameter with a MeshTensor (layouts_of's per-item path), split over an
    axis (grouping by axes, the all-reduce): the norm and gradients of the one-processor clip."""
    def run():
        d, h = mt.Dim("d", 4), mt.Dim("h", 2)
        dense = mt.nn.Dense(d, h, bias=False)
        extra = mt.ones([h], requires_grad=True)
        y = dense(mt.random.normal([mt.Dim("batch", 2), d], seed=1)) * extra
        mt.reduce_sum(y * y).backward()
        norm = mt.optim.clip_grad_norm_([dense.kernel, extra], 0.5)
        return norm.item(), dense.kernel.mesh_tensor.to_global(), extra.grad.to_global()

    (want, w0, e0), = mt.launch(run, mesh="", rules="")
    for norm, w, e in mt.launch(run, mesh="m:2", rules="d:m"):
        assert math.isclose(norm, want, rel_tol=1e-6) and want > 0.5
        torch.testing.assert_close(w, w0)
        torch.testing.assert_close(e, e0)
