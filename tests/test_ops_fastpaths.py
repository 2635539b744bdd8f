"""The fused one-kernel paths of softmax, log_softmax, layer_norm, cross_entropy and logsumexp
(taken when the normalised dim is not split, always on one processor) against dense float64
torch, values and gradients, on one processor and on a 2x2 mesh where the dim is split (the
composed path), where only other dims are split, and where a LayerNorm weight is FSDP-split."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mt
from mesh_harness import aten_ops

B, T, D, V = 4, 6, 8, 12
X = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
W = 1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
BIAS = 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
LOGITS = torch.randn(B, T, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
TARGETS = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
TARGETS[0, 0] = -100  # ignored (ignore_index): loss and gradient 0 there, on every path
UPSTREAM = torch.randn(B, T, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
UP_V = torch.randn(B, T, V, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def _cases():
    """name -> (mesh fn of leaf MeshTensors, dense fn of leaf tensors, leaves as (tensor, shape))."""
    x, lg = (X, "batch:4,length:6,d:8"), (LOGITS, "batch:4,length:6,vocab:12")
    w, b = (W, "d:8"), (BIAS, "d:8")

    def dot(y, up, shape):  # a weighted sum makes every output element's gradient distinct
        return mt.reduce_sum(y * mt.from_global(up, shape))

    ln = F.layer_norm
    bt = "batch:4,length:6"
    return {
        "softmax": (lambda a: dot(mt.softmax(a, "vocab"), UP_V, lg[1]),
                    lambda a: (a.softmax(-1) * UP_V).sum(), [lg]),
        "log_softmax": (lambda a: dot(mt.log_softmax(a, "vocab"), UP_V, lg[1]),
                        lambda a: (a.log_softmax(-1) * UP_V).sum(), [lg]),
        "logsumexp": (lambda a: mt.reduce_sum(mt.reduce_logsumexp(a, "vocab") * mt.reduce_sum(a, "vocab")),
                      lambda a: (a.logsumexp(-1) * a.sum(-1)).sum(), [lg]),
        "logsumexp_two_dims": (lambda a: mt.reduce_sum(mt.reduce_logsumexp(a, ["length", "vocab"])),
                               lambda a: a.logsumexp((1, 2)).sum(), [lg]),
        "cross_entropy": (lambda a: mt.reduce_sum(mt.cross_entropy(a, mt.from_global(TARGETS, bt),
                                                                   ignore_index=-100)
                                                  * mt.from_global(UP_V[..., 0], bt)),
                          lambda a: (F.cross_entropy(a.permute(0, 2, 1), TARGETS, ignore_index=-100,
                                                     reduction="none") * UP_V[..., 0]).sum(), [lg]),
        "layer_norm_w_b": (lambda a, w_, b_: dot(mt.layer_norm(a, "d", w_, b_), UPSTREAM, x[1]),
                           lambda a, w_, b_: (ln(a, (D,), w_, b_) * UPSTREAM).sum(), [x, w, b]),
        "layer_norm_w": (lambda a, w_: dot(mt.layer_norm(a, "d", w_), UPSTREAM, x[1]),
                         lambda a, w_: (ln(a, (D,), w_) * UPSTREAM).sum(), [x, w]),
        "layer_norm_none": (lambda a: dot(mt.layer_norm(a, "d"), UPSTREAM, x[1]),
                            lambda a: (ln(a, (D,)) * UPSTREAM).sum(), [x]),
    }


def run_all():
    out = {}
    for name, (fn, _, leaves) in _cases().items():
        ts = [mt.from_global(t, s, requires_grad=True) for t, s in leaves]
        y = fn(*ts)
        y.backward()
        out[name] = (y.item(), [t.grad.to_global() for t in ts])
    return out


LAYOUTS = [
    ("b:1", "batch:b"),                                   # one processor: every fused path
    ("b:2,m:2", "batch:b; vocab:m; d:m"),                 # the normalised dim split: composed path
    ("b:2,m:2", "batch:b; length:m"),                     # only other dims split: fused path, sliced
    ("b:2,m:2", "batch:b; d:b; length:m"),                # FSDP: d whole in x, LayerNorm weight split
]


@pytest.mark.parametrize("mesh, rules", LAYOUTS)
def test_fast_and_composed_paths_match_dense_torch(mesh, rules):
    outs = mt.launch(run_all, mesh=mesh, rules=rules)
    for name, (_, dense, leaves) in _cases().items():
        ref_leaves = [t.clone().requires_grad_(True) for t, _ in leaves]
        ref = dense(*ref_leaves)
        ref.backward()
        for rank, out in enumerate(outs):
            value, grads = out[name]
            assert value == pytest.approx(ref.item(), rel=1e-10, abs=1e-10), (name, rank)
            for g, leaf in zip(grads, ref_leaves):
                torch.testing.assert_close(g, leaf.grad, rtol=1e-10, atol=1e-10, msg=f"{name} on {rank}")


def test_fused_paths_run_one_kernel_on_one_processor():
    """The fast paths are taken: one softmax / layer_norm kernel, not exp, sums and divisions."""
    from torch.profiler import ProfilerActivity, profile

    x = mt.from_global(X, "batch:4,length:6,d:8")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mt.softmax(x, "d")
        mt.layer_norm(x, "d")
    names = {e.key for e in prof.key_averages()}
    assert {"aten::_softmax", "aten::native_layer_norm"} <= names, names
    assert "aten::exp" not in names and "aten::rsqrt" not in names, names


def test_dense_and_tied_output_run_torchs_ops_on_one_processor():
    """A Dense layer and a tied output layer on one processor run what ``x @ W + b`` and
    ``x @ T.t()`` run in torch, op for op, with the same values: every Python call into torch
    around them is paid cold between a model's large kernels (issue 27)."""
    from meshtorch.nn import Dense, Embedding

    x32 = X.float()
    x = mt.from_global(x32, "batch:4,length:6,d:8")
    dense = Dense(mt.Dim("d", 8), mt.Dim("h", 5))
    dense.bias.data.normal_(generator=torch.Generator().manual_seed(7))
    w, b = dense.kernel.detach(), dense.bias.detach()
    ours, y = aten_ops(lambda: dense(x))
    theirs, ref = aten_ops(lambda: x32 @ w + b)
    assert ours == theirs, (ours, theirs)
    assert torch.equal(y.to_global(), ref)

    table = Embedding(mt.Dim("vocab", V), mt.Dim("d", 8))
    t = table.table.detach()
    ours, y = aten_ops(lambda: table.attend(x))
    theirs, ref = aten_ops(lambda: x32 @ t.t())
    assert ours == theirs, (ours, theirs)
    assert torch.equal(y.to_global(), ref)


def test_causal_attention_hands_sdpa_its_inputs_as_views_of_permutes_only():
    """Causal attention over [batch, length, heads, d_kv] on one processor: a permute of each
    input, SDPA and a permute back, as torch code does it with transposes (no reshape to the same
    shape, no no-op key slice), and SDPA's values bitwise."""
    import torch.nn.functional as F  # noqa: N812

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 5, 3, 4, generator=g) for _ in range(3))
    mq = mt.from_global(q, "batch:2,length:5,heads:3,d_kv:4")
    mk, mv = (mt.from_global(t, "batch:2,memory_length:5,heads:3,d_kv:4") for t in (k, v))
    names, out = aten_ops(lambda: mt.attention(mq, mk, mv, causal=True))
    assert names == ["permute.default"] * 3 + ["_scaled_dot_product_flash_attention_for_cpu.default",
                                                "permute.default"], names
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    assert torch.equal(out.to_global(), ref.transpose(1, 2))


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """The torch functions and methods a block calls from Python (attribute reads left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func.__name__ != "__get__":
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("autocast", [False, True])
def test_attention_projections_are_one_matmul_bitwise_as_the_mm_of_flattened_operands(autocast):
    """Dense layers whose kernel has several contracted or several free dims (attention's
    [d] -> [heads, d_kv] and [heads, d_kv] -> [d]; x · Tᵀ of a [heads, d_kv, d] table) on one
    processor: a flatten or two, torch.matmul and at most one view (issue 25: the spelled-out
    reshape, reshape, mm and view were four Python calls into torch, 48 of them a 124M forward),
    values and gradients bitwise those of the mm on the flattened operands, in float32 and bf16
    autocast."""
    from meshtorch.nn import Dense

    g = torch.Generator().manual_seed(9)
    x32 = torch.randn(B, T, D, generator=g)
    ctx32 = torch.randn(B, 3, T, 4, generator=g).transpose(1, 2)  # attention's output: a permute
    up = torch.randn(B, T, 3, 4, generator=g)
    heads, kv, d = mt.Dim("heads", 3), mt.Dim("d_kv", 4), mt.Dim("d", D)
    q, o = Dense(d, [heads, kv], bias=False), Dense([heads, kv], d, bias=False)
    table = mt.nn.MeshParameter([heads, kv, d], "normal")
    x = mt.from_global(x32.clone().requires_grad_(), "batch:4,length:6,d:8")
    ctx = mt.from_global(ctx32.clone().requires_grad_(), "batch:4,length:6,heads:3,d_kv:4")

    def mm(a, w, k, w_leading):  # the mm the old path ran, on leaves of their own
        a, w = a.detach().requires_grad_(), w.detach().requires_grad_()
        size_k = math.prod(w.shape[:k] if w_leading else w.shape[w.dim() - k:])
        w2 = w.reshape(size_k, -1) if w_leading else w.reshape(-1, size_k).t()
        return torch.mm(a.reshape(-1, size_k), w2), (a, w)

    # (meshtorch's call, the input leaf, the kernel, contracted dims, kernel's leading, torch calls)
    cases = [
        (lambda: q(x), x, q.kernel, 1, True, ["flatten", "matmul", "view"]),
        (lambda: o(ctx), ctx, o.kernel, 2, True, ["flatten", "flatten", "matmul"]),
        (lambda: mt.einsum(x, table.mesh_tensor, output_shape=["batch", "length", "heads", "d_kv"]),
         x, table, 1, False, ["flatten", "t", "matmul", "view"]),
    ]
    for run, a, w, k, w_leading, names in cases:
        run()  # (the first call draws the kernel's values and plans the op)
        calls = _TorchCalls()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with calls:
                y = run()
            ref, leaves = mm(a.local, w, k, w_leading)
        assert calls.names == names, calls.names
        out = y.local
        assert out.dtype == ref.dtype and torch.equal(out.reshape(ref.shape), ref)
        # distinct upstream values for every output element (the output has at most up's)
        upstream = up.reshape(-1)[: out.numel()].reshape(out.shape).to(out.dtype)
        ours = torch.autograd.grad(out, (a.local, w), upstream)
        theirs = torch.autograd.grad(ref, leaves, upstream.reshape(ref.shape))
        assert all(torch.equal(p, r) for p, r in zip(ours, theirs))


def test_dense_of_bf16_activations_under_autocast_calls_no_promotion():
    """Under torch's autocast a Dense layer of bf16 activations and a float32 kernel (every layer
    after the first of a bf16 step) hands both to torch, which casts them itself: no promotion's
    Python frames (``_promoted``, ``autocast_enabled``: issue 25), torch's autocast values; outside
    autocast the operands are promoted as elementwise ops promote them, as before."""
    import sys

    from meshtorch.nn import Dense

    dense = Dense(mt.Dim("d", D), mt.Dim("h", 5), bias=False)
    x16 = X.to(torch.bfloat16)
    x = mt.from_global(x16, "batch:4,length:6,d:8")
    w = dense.kernel.detach()
    dense(x)  # (draws the kernel, plans the op)
    called: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        sys.setprofile(profile)
        try:
            y = dense(x)
        finally:
            sys.setprofile(None)
        ref = x16 @ w
    assert not {"_promoted", "autocast_enabled"} & set(called), called
    assert y.dtype == torch.bfloat16 and torch.equal(y.to_global(), ref)
    y = dense(x)  # no autocast: bf16 and float32 promote to float32
    assert y.dtype == torch.float32 and torch.equal(y.to_global(), x16.float() @ w)
