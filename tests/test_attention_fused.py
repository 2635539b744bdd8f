"""mt.attention: fused scaled_dot_product_attention against dense attention written out by hand, on
every layout hypothesis draws (values and gradients), and the Attention layer's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
import meshtorch.lowering.ring as ring
import meshtorch.ops.attention as attention_mod
from mesh_harness import check_op, meshes, rand, rules_for
from meshtorch.errors import ShapeError
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.models.layers import Attention, causal_bias, rotary_tables

Q = "batch:{b},length:{n},heads:{h},d_kv:{d}"
KV = "batch:{b},memory_length:{m},{kvh}:{hk},d_kv:{d}"


def dense(q, k, v, bias, causal, offset, scale):
    """Softmax attention on one processor, spelled out: q [b, n, h, d], k/v [b, m, hk, d]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias[:, None, None, :]
    if causal:
        i = torch.arange(q.shape[1])[:, None] + offset
        j = torch.arange(k.shape[1])[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


@st.composite
def cases(draw):
    mesh = draw(meshes(max_procs=4, max_axes=2))
    dims = ["batch", "heads", "length", "memory_length", "kv_heads", "d_kv"]
    return mesh, draw(rules_for(mesh, dims))


@settings(max_examples=25, deadline=None)
@given(case=cases(), causal=st.booleans(), kv=st.sampled_from([1, 2, 4]), offset=st.sampled_from([0, 1, 4]),
       with_bias=st.booleans(), seed=st.integers(0, 99))
def test_values_and_grads_equal_dense_attention(case, causal, kv, offset, with_bias, seed):
    mesh, rules = case
    b, n, h, d = 2, 4, 4, 4
    m = n + offset  # keys: the `offset` cached positions before the queries, and the queries'
    kvh = "heads" if kv == h else "kv_heads"
    scale = 0.6
    inputs = [(rand(b, n, h, d, seed=seed), Q.format(b=b, n=n, h=h, d=d))]
    inputs += [(rand(b, m, kv, d, seed=seed + i), KV.format(b=b, m=m, kvh=kvh, hk=kv, d=d)) for i in (1, 2)]
    if with_bias:  # padding-style: some keys masked per batch row (never all of a row's visible keys)
        keep = torch.ones(b, m, dtype=torch.float64)
        keep[0, m - 1] = 0.0
        keep[1, 1] = 0.0
        inputs.append(((keep - 1) * 1e9, f"batch:{b},memory_length:{m}"))

    def fn(q, k, v, bias=None):
        return mt.attention(q, k, v, causal=causal, offset=offset, bias=bias, scale=scale,
                            kv_heads=None if kvh == "heads" else kvh)

    def ref(q, k, v, bias=None):
        return dense(q, k, v, bias, causal, offset, scale)

    check_op(fn, ref, inputs, mesh, rules, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("mesh,rules", [("", ""), ("m:4", "heads:m"), ("m:2", "heads:m")])
def test_grouped_query_fallback_without_enable_gqa(monkeypatch, mesh, rules):
    """torch < 2.5 has no enable_gqa: the key/value heads are repeated locally instead."""
    monkeypatch.setattr(attention_mod, "HAS_ENABLE_GQA", False)
    calls = _count_sdpa(monkeypatch)
    inputs = [(rand(2, 4, 4, 4, seed=0), Q.format(b=2, n=4, h=4, d=4))]
    inputs += [(rand(2, 4, 2, 4, seed=i), KV.format(b=2, m=4, kvh="kv_heads", hk=2, d=4)) for i in (1, 2)]
    check_op(lambda q, k, v: mt.attention(q, k, v, causal=True, kv_heads="kv_heads"),
             lambda q, k, v: dense(q, k, v, None, True, 0, 0.5), inputs, mesh, rules)
    assert calls and not any(c.get("enable_gqa") for c in calls)


def _count_sdpa(monkeypatch) -> list[dict]:
    """Record the keyword arguments of every scaled_dot_product_attention call."""
    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        mask = kwargs.get("attn_mask")
        calls.append({**kwargs, "attn_mask": None if mask is None else mask.dtype, "query": args[0].dtype})
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_causal_self_attention_is_one_sdpa_call_with_is_causal(monkeypatch):
    cfg = TransformerConfig(d_model=16, heads=4, d_kv=4, d_ff=32, vocab=32, kv_heads=2)
    calls = _count_sdpa(monkeypatch)

    def f():
        attn = Attention(cfg)
        x = mt.random.normal("batch:2,length:6,d_model:16", seed=0)
        fused = attn(x, causal=True)
        by_bias = attn(x, bias=causal_bias(6))       # the old additive-bias spelling
        return torch.allclose(fused.to_global(), by_bias.to_global(), atol=1e-6)

    assert mt.launch(f) == [True]
    first = calls[0]
    assert first["is_causal"] and first["attn_mask"] is None
    assert first.get("enable_gqa", False) == attention_mod.HAS_ENABLE_GQA


def test_split_queries_use_a_lower_right_boolean_mask(monkeypatch):
    calls = _count_sdpa(monkeypatch)
    inputs = [(rand(1, 4, 2, 4, seed=0), Q.format(b=1, n=4, h=2, d=4))]
    inputs += [(rand(1, 4, 2, 4, seed=i), KV.format(b=1, m=4, kvh="heads", hk=2, d=4)) for i in (1, 2)]
    check_op(lambda q, k, v: mt.attention(q, k, v, causal=True),
             lambda q, k, v: dense(q, k, v, None, True, 0, 0.5), inputs, "m:2", "length:m")
    # processor 0 holds queries 0-1: is_causal over keys 0-1; processor 1 queries 2-3: a mask
    seen = sorted((bool(c["is_causal"]), c["attn_mask"]) for c in calls)
    assert seen == [(False, torch.bool), (True, None)]


def test_bf16_autocast_keeps_bf16_and_matches_fp32(monkeypatch):
    cfg = TransformerConfig(d_model=32, heads=4, d_kv=8, d_ff=64, vocab=64, layers=2, max_length=16,
                            positions="rotary")
    calls = _count_sdpa(monkeypatch)

    def f():
        model = DecoderLM(cfg, seed=0).eval()
        ids = mt.from_global(torch.arange(32).reshape(2, 16) % 64, "batch:2,length:16")
        ref = model(ids).to_global()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(ids).to_global()
        return ref, low

    (ref, low), = mt.launch(f)
    torch.testing.assert_close(low.float(), ref, atol=0.1, rtol=0.05)
    bf16 = [c for c in calls if c["query"] == torch.bfloat16]
    assert len(bf16) == cfg.layers and all(c["attn_mask"] is None for c in bf16)


def test_dropout_in_training_forms_the_weights_by_einsum(monkeypatch):
    """SDPA's dropout is not layout-invariant: training with dropout keeps the einsum path, and its
    loss is the same on every layout."""
    cfg = TransformerConfig(d_model=16, heads=4, d_kv=4, d_ff=32, vocab=32, layers=1, max_length=8,
                            dropout=0.2, attention="gather")
    calls = _count_sdpa(monkeypatch)

    def f():
        model = DecoderLM(cfg, seed=0).train()
        ids = mt.from_global(torch.arange(16).reshape(2, 8) % 32, "batch:2,length:8")
        return round(model.loss(ids, ids).item(), 5)

    one, = mt.launch(f)
    assert not calls
    assert mt.launch(f, mesh="b:2,m:2", rules="batch:b; heads:m") == [one] * 4


def test_decoding_with_a_cache_equals_the_full_forward():
    cfg = TransformerConfig(d_model=16, heads=4, d_kv=4, d_ff=32, vocab=32, layers=2, max_length=8,
                            kv_heads=2, positions="rotary")

    def f():
        model = DecoderLM(cfg, seed=1).eval()
        ids = mt.from_global(torch.tensor([[3, 1, 4, 1, 5, 9]]), "batch:1,length:6")
        full = model(ids).to_global()
        cache = model.new_cache(ids.shape["batch"])
        steps = [model(mt.from_global(ids.to_global()[:, :3], "batch:1,length:3"), cache=cache).to_global()]
        for i in range(3, 6):
            steps.append(model(mt.from_global(ids.to_global()[:, i:i + 1], "batch:1,length:1"),
                               cache=cache).to_global())
        return full, torch.cat(steps, 1)

    for full, inc in mt.launch(f, mesh="m:2", rules="heads:m; kv_heads:m; vocab:m"):
        torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


def test_masks_and_rotary_tables_are_made_once_per_device():
    def f():
        a, b = rotary_tables(6, 4, "length"), rotary_tables(6, 4, "length")
        c, d = causal_bias(6, dtype=torch.bfloat16), causal_bias(6, dtype=torch.bfloat16)
        return (a[0].local.data_ptr() == b[0].local.data_ptr(), c.local.data_ptr() == d.local.data_ptr(),
                c.local.dtype)

    assert mt.launch(f) == [(True, True, torch.bfloat16)]
    assert attention_mod.causal_mask(3, 5, 2, None) is attention_mod.causal_mask(3, 5, 2, None)


def test_mismatched_dims_are_named():
    def f():
        q = mt.random.normal("batch:2,length:4,heads:4,d_kv:4", seed=0)
        k = mt.random.normal("beam:2,memory_length:4,heads:4,d_kv:4", seed=1)
        mt.attention(q, k, k)

    with pytest.raises(ShapeError, match="share their other dims"):
        mt.launch(f)


# ---------------------------------------------------------------- ring attention's fused blocks

def _ring_case(monkeypatch, mesh, rules, causal, dtype=torch.float64, atol=1e-9, rtol=1e-7):
    """Ring attention against dense attention; returns the names of the aten kernels it called."""
    called: list[str] = []
    real = ring._op

    def spy(name):
        op = real(name)
        if op is None:
            return None

        def run(*args, **kwargs):
            called.append(name)
            return op(*args, **kwargs)
        return run

    monkeypatch.setattr(ring, "_op", spy)
    inputs = [(rand(2, 8, 2, 4, seed=i).to(dtype), Q.format(b=2, n=8, h=2, d=4)) for i in range(3)]
    check_op(lambda q, k, v: mt.ring_attention(q, k, v, causal=causal, scale=0.5),
             lambda q, k, v: dense(q, k, v, None, causal, 0, 0.5), inputs, mesh, rules,
             atol=atol, rtol=rtol)
    return called


@pytest.mark.parametrize("mesh,rules,causal", [("m:2", "length:m", True), ("m:4", "length:m", False),
                                               ("b:2,m:2", "length:m; batch:b", True)])
def test_ring_blocks_run_the_fused_kernel_with_its_logsumexp(monkeypatch, mesh, rules, causal):
    called = _ring_case(monkeypatch, mesh, rules, causal)
    fwd, bwd = ring.FUSED["cpu"]
    assert fwd in called and bwd in called


def test_ring_blocks_fall_back_to_the_math_without_the_private_kernels(monkeypatch):
    monkeypatch.setattr(ring, "FUSED", {"cpu": ("no_such_kernel", "no_such_kernel_backward")})
    assert _ring_case(monkeypatch, "m:2", "length:m", True) == []


def test_ring_blocks_fall_back_when_the_kernel_refuses(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("not for these inputs")

    monkeypatch.setattr(ring, "_op", lambda name: refuse)
    inputs = [(rand(1, 4, 2, 4, seed=i), Q.format(b=1, n=4, h=2, d=4)) for i in range(3)]
    check_op(lambda q, k, v: mt.ring_attention(q, k, v, causal=True, scale=0.5),
             lambda q, k, v: dense(q, k, v, None, True, 0, 0.5), inputs, "m:2", "length:m")


def test_ring_attention_in_bf16_matches_float32():
    def f(dtype):
        q, k, v = (mt.random.normal("batch:2,length:16,heads:2,d_kv:8", seed=s) for s in range(3))
        q, k, v = (mt.cast(x, dtype).detach().requires_grad_() for x in (q, k, v))
        out = mt.ring_attention(q, k, v, causal=True)
        mt.reduce_sum(out * out).backward()
        return [t.to_global().float() for t in (out, q.grad, k.grad, v.grad)]

    for ref, low in zip(*(mt.launch(f, dt, mesh="m:2", rules="length:m")[0]
                          for dt in (torch.float32, torch.bfloat16))):
        torch.testing.assert_close(low, ref, atol=0.05, rtol=0.05)


def test_flop_counter_counts_the_fused_cpu_kernels_with_grouped_keys():
    """Hand-derived: forward q·kᵀ and w·v, 2 matmuls; backward (torch's formula) recomputes q·kᵀ and
    forms dv, dw, dq, dk, 5 matmuls; each 2·b·h·n·m·d FLOPs, keys counted per query head."""
    from torch.utils.flop_counter import FlopCounterMode
    b, h, n, m, d = 2, 4, 6, 6, 8

    def f():
        q = mt.random.normal(f"batch:{b},length:{n},heads:{h},d_kv:{d}", seed=0).requires_grad_()
        k, v = (mt.random.normal(f"batch:{b},memory_length:{m},kv_heads:2,d_kv:{d}", seed=s) for s in (1, 2))
        with FlopCounterMode(display=False) as counter:
            out = mt.attention(q, k, v, causal=True, kv_heads="kv_heads")
            forward = counter.get_total_flops()
            mt.reduce_sum(out).backward()
        return forward, counter.get_total_flops()

    unit = 2 * b * h * n * m * d
    assert mt.launch(f) == [(2 * unit, 7 * unit)]


@pytest.mark.parametrize("mesh,rules", [("", ""), ("b:2,m:2", "batch:b; heads:m"), ("m:2", "length:m")])
def test_bf16_autocast_values_and_grads_follow_float32_on_any_layout(mesh, rules):
    """Under CPU bf16 autocast the kernel runs in bf16 (the inputs' float32 is cast by autocast),
    and values and gradients stay within bf16's precision of the float32 dense computation."""
    q0, k0, v0 = (torch.randn(2, 8, 4, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))

    def f():
        q = mt.from_global(q0, Q.format(b=2, n=8, h=4, d=16), requires_grad=True)
        kv = KV.format(b=2, m=8, kvh="kv_heads", hk=2, d=16)
        k, v = (mt.from_global(t[:, :, :2], kv, requires_grad=True) for t in (k0, v0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mt.attention(q, k, v, causal=True, kv_heads="kv_heads")
        wide = mt.cast(out, torch.float32)
        mt.reduce_sum(wide * wide).backward()
        return out.dtype, [t.to_global().float() for t in (out, q.grad, k.grad, v.grad)]

    ref = [t.requires_grad_() for t in (q0.clone(), k0[:, :, :2].clone(), v0[:, :, :2].clone())]
    out = dense(*ref, None, True, 0, 0.25)
    (out * out).sum().backward()
    for dtype, got in mt.launch(f, mesh=mesh, rules=rules):
        assert dtype == torch.bfloat16
        for a, b in zip(got, [out] + [t.grad for t in ref]):
            torch.testing.assert_close(a, b.detach(), atol=0.05, rtol=0.05)
