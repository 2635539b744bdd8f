"""Ring attention: softmax attention over a sequence dim that a mesh axis splits.

:func:`ring_attention` is what ``mt.ring_attention`` lowers to. Each processor keeps its
queries; the keys and values travel around the axis with one point-to-point ``shift`` per step
(``n - 1`` steps on an axis of ``n`` processors), and the softmax is accumulated online
(running maximum and log-sum-exp per query), so the result equals softmax attention over the
whole sequence while no processor ever holds more than two key/value chunks, and no score
block larger than its own queries × one chunk.

The backward pass is a second trip around the ring: the key/value chunks travel again,
together with the gradients of those keys and values, which every processor adds to as they
pass and which arrive back at their owners after ``n`` shifts. From the forward pass only the
local queries, keys, values, output and log-sum-exp are kept, so memory stays bounded by the
local slices.

Bytes each processor sends, ``K`` and ``V`` being its local key and value slices:
forward ``(n - 1)·(|K| + |V|)``, backward ``(2n - 1)·(|K| + |V|)`` (``n - 1`` shifts of keys,
values and their gradients, one more to bring the gradients home). The softmax accumulates in
at least float32; in the backward pass bf16/fp16 keys and values travel as float32 with their
gradients, doubling those bytes.

**Balanced causal work.** With contiguous chunks, causal attention leaves processor 0 one
useful block and processor ``n - 1`` all ``n`` of them. With ``balance``, the sequence is cut
into ``2n`` chunks and processor ``p`` computes on chunks ``p`` and ``2n - 1 - p`` (the
"zigzag" order), so every processor does the same causal work at every step. The reordering
happens inside: the chunks move there and back with two ``permute`` calls each way (queries,
keys and values in one message; then the output), and the result has the caller's layout.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering.ring import ring_attention
    >>> q, k, v = (torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    >>> dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> def f():
    ...     p = mt.current().coords["m"]
    ...     part = [t[:, 4 * p: 4 * p + 4] for t in (q, k, v)]
    ...     return ring_attention(*part, "m", causal=True, scale=0.5)
    >>> torch.allclose(torch.cat(mt.launch(f, mesh="m:2"), 1), dense, atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from meshtorch.comm.base import Communicator
from meshtorch.context import current
from meshtorch.errors import MeshTorchError
from meshtorch.lowering import adapters as ca

# a masked score: exp() of it minus any real score is exactly 0, and no row goes NaN
MASKED = -1e9

Segments = list[tuple[int, int, int]]  # (offset in the local slice, global start, size)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str | None, *,
                   causal: bool, scale: float, balance: bool = True,
                   length: int | None = None) -> torch.Tensor:
    """``softmax(q kᵀ·scale [+ causal mask]) v`` on local ``[B, L, D]`` slices of a sequence
    split contiguously over ``axis`` (``None``: the sequence is whole here).

    ``q``, ``k`` and ``v`` hold the same positions. ``balance`` (used when ``causal`` and the
    largest piece, ``ceil(length / n)``, is even) computes in zigzag order; the result is this
    processor's slice either way. ``length``: the whole sequence's, cut in ``torch.chunk``
    pieces over ``axis`` (``None``: every processor holds as many positions). Uneven pieces
    travel padded to the largest one, and the padding takes no part: no query or key past
    ``length`` is computed.
    """
    comm = current().comm
    n = 1 if axis is None else comm.mesh.axis_size(axis)
    if n == 1:
        return _RingAttention.apply(q, k, v, comm, None, causal, scale, False, None)
    local = q.shape[1]
    piece = local if length is None else -(-length // n)
    if piece != local:  # a short (or empty) piece: every processor sends slices of one size
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, piece - local)) for t in (q, k, v))
    # (decided from the padded size, the same on every processor of the axis)
    zigzag = balance and causal and piece % 2 == 0
    if not zigzag:
        out = _RingAttention.apply(q, k, v, comm, axis, causal, scale, False, length)
    else:
        qkv = _to_zigzag(torch.stack([q, k, v]), comm, axis, 2)
        out = _RingAttention.apply(qkv[0], qkv[1], qkv[2], comm, axis, causal, scale, True, length)
        out = _from_zigzag(out, comm, axis, 1)
    return out if piece == local else out[:, :local]


def segments(p: int, n: int, length: int, zigzag: bool) -> Segments:
    """The global positions processor ``p`` of ``n`` holds in a local slice of ``length``.

    Example:
        >>> from meshtorch.lowering.ring import segments
        >>> segments(0, 2, 4, zigzag=False), segments(0, 2, 4, zigzag=True)
        ([(0, 0, 4)], [(0, 0, 2), (2, 6, 2)])
    """
    if not zigzag:
        return [(0, p * length, length)]
    c = length // 2
    return [(0, p * c, c), (c, (2 * n - 1 - p) * c, c)]


def _within(segs: Segments, total: int | None) -> Segments:
    """``segs`` cut to the positions before ``total`` (``None``: all of them): padding is never
    computed on."""
    if total is None:
        return segs
    return [(o, g, min(s, total - g)) for o, g, s in segs if g < total]


def _zigzag_sources(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Who sends member ``j`` its even and its odd chunk of ``2n`` (contiguous: ``p`` holds
    chunks ``2p, 2p+1``; zigzag: ``j`` holds ``j, 2n-1-j``, one of them even, one odd)."""
    even = tuple((j if j % 2 == 0 else 2 * n - 1 - j) // 2 for j in range(n))
    odd = tuple((2 * n - 1 - j if j % 2 == 0 else j) // 2 for j in range(n))
    return even, odd


def _to_zigzag(t: torch.Tensor, comm: Communicator, axis: str, dim: int) -> torch.Tensor:
    even_src, odd_src = _zigzag_sources(comm.mesh.axis_size(axis))
    lo, hi = t.chunk(2, dim)
    even, odd = ca.permute(lo, comm, axis, even_src), ca.permute(hi, comm, axis, odd_src)
    return torch.cat([even, odd] if comm.coords[axis] % 2 == 0 else [odd, even], dim)


def _from_zigzag(t: torch.Tensor, comm: Communicator, axis: str, dim: int) -> torch.Tensor:
    even_src, odd_src = _zigzag_sources(comm.mesh.axis_size(axis))
    first, second = t.chunk(2, dim)
    even, odd = (first, second) if comm.coords[axis] % 2 == 0 else (second, first)
    return torch.cat([ca.permute(even, comm, axis, ca.inverse_sources(even_src)),
                      ca.permute(odd, comm, axis, ca.inverse_sources(odd_src))], dim)


def _pairs(qs: Segments, ks: Segments, causal: bool):
    """The (query segment, key segment, needs a mask) pairs with any visible key."""
    for q in qs:
        for k in ks:
            if causal and k[1] > q[1] + q[2] - 1:
                continue  # every key comes after every query
            yield q, k, causal and k[1] + k[2] - 1 > q[1]


def _scores(q: torch.Tensor, k: torch.Tensor, qg: int, kg: int, masked: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if masked:
        qi = torch.arange(qg, qg + q.shape[-2], device=q.device)
        ki = torch.arange(kg, kg + k.shape[-2], device=q.device)
        s = s.masked_fill(ki[None, :] > qi[:, None], MASKED)
    return s


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    # at least float32: bf16/fp16 running sums would lose the softmax's small terms
    return torch.promote_types(t.dtype, torch.float32)


def _no_autocast(t: torch.Tensor):
    # the accumulation is float32 whatever autocast would pick for the matmuls
    kind = t.device.type if t.device.type in ("cuda", "cpu") else "cpu"
    return torch.autocast(kind, enabled=False)


# The fused kernels that return the log-sum-exp, by device: (forward, backward) names in
# torch.ops.aten. They are private: the same signatures from torch 2.3 through 2.15 (checked in
# aten's native_functions.yaml), and where one is missing or refuses its inputs the block runs
# the math below instead (tests/test_ring_attention.py takes that path by hiding them).
FUSED = {
    "cpu": ("_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "cuda": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
}
FUSED["meta"] = FUSED["cpu"]  # the planner's trace runs the kernels a CPU step runs (they have meta kernels)


def _op(name: str):
    """The aten op ``name``, or ``None`` where this torch has none."""
    return getattr(torch.ops.aten, name, None)


def _fused_kernels(q: torch.Tensor, k: torch.Tensor):
    """The (forward, backward) fused ops for these blocks, or ``None`` (then: the math path)."""
    names = FUSED.get(q.device.type)
    if names is None or q.numel() == 0 or k.numel() == 0:
        return None  # (the CPU kernel dies on empty blocks, so they never reach it)
    if q.device.type == "cuda" and (q.dtype not in (torch.float16, torch.bfloat16)
                                    or q.shape[-1] % 8 or q.shape[-1] > 256):
        return None  # flash's own limits
    fwd, bwd = _op(names[0]), _op(names[1])
    return None if fwd is None or bwd is None else (fwd, bwd)


def _block_forward(q, k, v, qg, kg, masked, scale, dt):
    """One block's normalised output and log-sum-exp per query, in ``dt``, and what its backward
    needs from the fused kernel (``None``: the math ran). The fused kernel takes the block where
    it can (a masked block is always a diagonal one: ``is_causal``); the math takes the rest."""
    kernels = _fused_kernels(q, k)
    if kernels is not None and (not masked or (qg == kg and q.shape[-2] == k.shape[-2])):
        try:
            res = kernels[0](q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), 0.0, masked, scale=scale)
            # CUDA's flash also returns its (unused here) varlen sizes and RNG state: its backward's
            return res[0].squeeze(1).to(dt), res[1].squeeze(1).to(dt), tuple(res[2:8])
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # a torch whose private kernel refuses these inputs or has another signature
    s = _scores(q.to(dt), k.to(dt), qg, kg, masked, scale)
    m = s.amax(-1, keepdim=True)
    w = torch.exp(s - m)
    total = w.sum(-1, keepdim=True)
    return (w @ v.to(dt)) / total, (m + torch.log(total)).squeeze(-1), None


def _block_backward(aux, g, q, k, v, out, lse, qg, kg, masked, scale, dt):
    """One block's ``(dq, dk, dv)`` in ``dt`` given the whole output and log-sum-exp of these
    queries (the softmax over every key block): the fused kernel's backward where its forward ran
    (``aux``: what that forward returned for it), else the math."""
    if aux is not None:
        res = _fused_backward(_fused_kernels(q, k)[1], aux, g, q, k, v, out, lse, masked, scale)
        if res is not None:
            return tuple(t.squeeze(1).to(dt) for t in res)
    qf, kf, vf, gf = q.to(dt), k.to(dt), v.to(dt), g.to(dt)
    w = torch.exp(_scores(qf, kf, qg, kg, masked, scale) - lse.unsqueeze(-1))
    dv = w.transpose(-1, -2) @ gf
    ds = w * (gf @ vf.transpose(-1, -2) - (gf * out.to(dt)).sum(-1, keepdim=True))
    return (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale, dv


def _fused_backward(op, aux, g, q, k, v, out, lse, causal, scale):
    g4, q4, k4, v4 = (t.unsqueeze(1) for t in (g.to(q.dtype), q, k, v))
    o4, l4 = out.to(q.dtype).unsqueeze(1), lse.unsqueeze(1).contiguous()
    try:
        if aux:  # CUDA flash: cum_seq_q, cum_seq_k, max_q, max_k, then the RNG state (seed, offset)
            cum_q, cum_k, max_q, max_k, seed, offset = aux
            return op(g4, q4, k4, v4, o4, l4, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset,
                      scale=scale)
        return op(g4, q4, k4, v4, o4, l4, 0.0, causal, scale=scale)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, axis, causal, scale, zigzag, total):
        n = 1 if axis is None else comm.mesh.axis_size(axis)
        p = 0 if axis is None else comm.coords[axis]
        length = q.shape[1]
        dt = _accumulation_dtype(q)
        fused = []  # per block, in order: what the fused kernel left for its backward, or None
        with _no_autocast(q):
            # the running output (normalised) and log-sum-exp of each query over the blocks so far
            lse = torch.full(q.shape[:2], float("-inf"), device=q.device, dtype=dt)
            acc = torch.zeros(q.shape, device=q.device, dtype=dt)
            qs = _within(segments(p, n, length, zigzag), total)
            kv = torch.stack([k, v])
            for step in range(n):
                ks = _within(segments((p - step) % n, n, length, zigzag), total)
                for (qo, qg, qn), (ko, kg, kn), masked in _pairs(qs, ks, causal):
                    o_b, lse_b, aux = _block_forward(q[:, qo:qo + qn], kv[0][:, ko:ko + kn],
                                                   kv[1][:, ko:ko + kn], qg, kg, masked, scale, dt)
                    fused.append(aux)
                    # merge by log-sum-exp: each part weighs exp(its lse - the new lse)
                    old = lse[:, qo:qo + qn]
                    new = torch.logaddexp(old, lse_b)
                    acc[:, qo:qo + qn] = (acc[:, qo:qo + qn] * torch.exp(old - new).unsqueeze(-1)
                                          + o_b * torch.exp(lse_b - new).unsqueeze(-1))
                    lse[:, qo:qo + qn] = new
                if step < n - 1:
                    kv = comm.shift(kv.contiguous(), axis, 1, wrap=True)
            out = acc
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.axis, ctx.causal, ctx.scale, ctx.zigzag = comm, axis, causal, scale, zigzag
        ctx.total = total
        ctx.fused = fused
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            # create_graph: this backward's kernels and shifts are not differentiable again
            raise MeshTorchError(
                "ring_attention has no second-order gradient (a backward with create_graph=True: a "
                "gradient penalty, a Hessian-vector product); use mt.attention there (attention=\"gather\" "
                "in TransformerConfig) under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), entered "
                "around mt.launch (its switch is process-wide): torch's fused attention kernels have no "
                "second-order gradient either")
        q, k, v, out, lse = ctx.saved_tensors
        comm, axis, causal, scale = ctx.comm, ctx.axis, ctx.causal, ctx.scale
        n = 1 if axis is None else comm.mesh.axis_size(axis)
        p = 0 if axis is None else comm.coords[axis]
        length = q.shape[1]
        dt = _accumulation_dtype(q)
        fused = iter(ctx.fused)
        with _no_autocast(q):
            dq = torch.zeros(q.shape, device=q.device, dtype=dt)
            # keys, values and their gradients travel as one message, in the accumulation dtype
            zeros = torch.zeros((2, *k.shape), device=q.device, dtype=dt)
            msg = torch.cat([torch.stack([k, v]).to(dt), zeros])
            qs = _within(segments(p, n, length, ctx.zigzag), ctx.total)
            for step in range(n):
                ks = _within(segments((p - step) % n, n, length, ctx.zigzag), ctx.total)
                kf, vf, dk, dv = msg[0], msg[1], msg[2], msg[3]
                for (qo, qg, qn), (ko, kg, kn), masked in _pairs(qs, ks, causal):
                    # the fused kernels take the inputs' own dtype: the travelling copies go back
                    kb, vb = kf[:, ko:ko + kn].to(k.dtype), vf[:, ko:ko + kn].to(v.dtype)
                    dq_b, dk_b, dv_b = _block_backward(
                        next(fused), g[:, qo:qo + qn], q[:, qo:qo + qn], kb, vb, out[:, qo:qo + qn],
                        lse[:, qo:qo + qn], qg, kg, masked, scale, dt)
                    dq[:, qo:qo + qn] += dq_b
                    dk[:, ko:ko + kn] += dk_b
                    dv[:, ko:ko + kn] += dv_b
                if step < n - 1:
                    msg = comm.shift(msg, axis, 1, wrap=True)
            dkv = msg[2:] if n == 1 else comm.shift(msg[2:].contiguous(), axis, 1, wrap=True)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None
