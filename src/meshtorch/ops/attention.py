"""Softmax attention as one op: ``attention`` (fused, keys whole on a processor) and
``ring_attention`` (keys go around the axis that splits the sequence), plus ``local_attention``.

:func:`attention` lowers to ``torch.nn.functional.scaled_dot_product_attention`` (flash /
cuDNN / memory-efficient kernels on GPUs, the fused CPU kernel on CPUs) on every processor: the
lowering keeps the keys' sequence dim whole (gathering it where the rules split it), and splits
batch, heads and queries like any other op. For ring attention:

With ``length`` split (rules ``"length:m"``), the keys and values are never gathered: they go
around the axis, one chunk per step, and the softmax accumulates online
(:mod:`meshtorch.lowering.ring`). Peak memory per processor then falls with the axis size.

Example:
    >>> import torch, meshtorch as mt
    >>> q, k, v = (mt.random.normal("batch:2,length:8,heads:2,d_kv:4", seed=s) for s in range(3))
    >>> out = mt.ring_attention(q, k, v, causal=True)
    >>> def dense(q, k, v):   # [batch, heads, length, d_kv] for torch
    ...     t = [x.to_global().transpose(1, 2) for x in (q, k, v)]
    ...     return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2)
    >>> torch.allclose(out.to_global(), dense(q, k, v), atol=1e-6)
    True
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from meshtorch.caching import BoundedCache
from meshtorch.context import current
from meshtorch.errors import LayoutError, ShapeError
from meshtorch.layout import format_axes, lengths
from meshtorch.lowering.lower import align, is_dynamo_compiling, lower
from meshtorch.lowering.ring import ring_attention as ring_slices
from meshtorch.ops.array import shift
from meshtorch.shape import Dim, Shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor, layout_for

# SDPA's enable_gqa= (torch >= 2.5); without it the processor's key/value heads are repeated locally
HAS_ENABLE_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"


@functools.lru_cache(maxsize=256)
def causal_mask(queries: int, keys: int, offset: int, device: torch.device | None) -> torch.Tensor:
    """Boolean ``[queries, keys]``: True where key ``j <= offset + i`` (query ``i`` sits at position
    ``offset + i``). Made once per (sizes, offset, device): no per-call host-to-device copy.

    Example:
        >>> from meshtorch.ops.attention import causal_mask
        >>> causal_mask(2, 3, 1, None).tolist()
        [[True, True, False], [True, True, True]]
    """
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril_(offset)


def _sdpa_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for query ``t``: autocast's where it is on for ``t``'s device."""
    kind = t.device.type
    if kind in ("cuda", "cpu") and t.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


def attention(q: MeshTensor, k: MeshTensor, v: MeshTensor, *, causal: bool = False, offset: int = 0,
              bias: MeshTensor | None = None, scale: float | None = None, dim: str | Dim = "length",
              memory: str | Dim = "memory_length", features: str | Dim = "d_kv", heads: str | Dim = "heads",
              kv_heads: str | Dim | None = None, name: str | None = None) -> MeshTensor:
    """``softmax(q·kᵀ·scale + bias [+ causal mask]) · v``, fused: one
    ``torch.nn.functional.scaled_dot_product_attention`` call per processor.

    ``q`` has dims ``dim`` (query positions), ``heads`` and ``features``; ``k`` and ``v`` have
    ``memory`` (key positions), ``kv_heads`` (default: ``heads``) and ``features``; every other dim
    (``batch``, ...) is shared by the three and independent. With ``kv_heads`` (grouped-query
    attention), query head ``h`` reads key/value head ``h // (heads / kv_heads)``.

    ``causal``: query ``i`` (at position ``offset + i``; ``offset`` > 0 when decoding with a KV
    cache) sees keys ``j <= offset + i``. Queries at the keys' positions use ``is_causal=True``;
    split queries or an offset use a boolean lower-right mask, made once per device, and keys past
    the last local query are not computed at all. ``bias`` (dims among ``q``'s and ``memory``, e.g.
    a padding mask) is added to the scores, cast to the compute dtype (never promoting to float32);
    a boolean ``bias`` is a mask, as SDPA's boolean ``attn_mask``: keys where it is False take no
    part.

    Layouts: any rules for the batch dims, ``heads`` and ``dim``. ``memory``, ``features`` and
    ``kv_heads`` are kept whole on a processor: where the rules split them, the lowering gathers
    them (forward all-gather, backward reduce-scatter). To keep a split sequence from being
    gathered use :func:`ring_attention`. There is no attention-weight dropout here: SDPA's
    ``dropout_p`` draws from the device generator, which depends on the layout, while meshtorch's
    random numbers must not (DESIGN §5); layers that drop attention weights in training form them
    with ``mt.einsum`` and ``mt.softmax``.

    Example:
        >>> import torch, meshtorch as mt
        >>> q = mt.random.normal("batch:2,length:4,heads:4,d_kv:8", seed=0)
        >>> k, v = (mt.random.normal("batch:2,memory_length:4,kv_heads:2,d_kv:8", seed=s) for s in (1, 2))
        >>> out = mt.attention(q, k, v, causal=True, kv_heads="kv_heads")
        >>> t = lambda x: x.to_global().transpose(1, 2)        # [batch, heads, length, d_kv]
        >>> kk, vv = (t(x).repeat_interleave(2, 1) for x in (k, v))
        >>> ref = torch.nn.functional.scaled_dot_product_attention(t(q), kk, vv, is_causal=True)
        >>> torch.allclose(out.to_global(), ref.transpose(1, 2), atol=1e-6)
        True
    """
    if not (isinstance(q, MeshTensor) and isinstance(k, MeshTensor) and isinstance(v, MeshTensor)):
        q, k, v = as_mesh_tensor(q), as_mesh_tensor(k), as_mesh_tensor(v)  # (raises, naming the type)
    if bias is not None and not isinstance(bias, MeshTensor):
        as_mesh_tensor(bias)
    # the checks and orders are a function of the shapes and dim names: made once per signature
    # (a model's attention has one; building them is about a hundred Python calls, paid cold
    # between large kernels, issue 27), kept under the shapes' names and sizes and the dim
    # arguments as given (hashed in C where they are strings: no Shape.__hash__ or dim_name frame)
    compiled = is_dynamo_compiling()
    qs, ks, vs, bs = q.shape, k.shape, v.shape, None if bias is None else bias.shape
    # (a Dim as it is, its size checked against the shapes when the plan is made: its dataclass
    # __hash__ is a Python call, paid only where a Dim is passed; a name hashes in C)
    key = (qs.names, qs.sizes, ks.names, ks.sizes, vs.names, vs.sizes,
           None if bs is None else (bs.names, bs.sizes), dim, memory, features, heads, kv_heads)
    plan = None if compiled else _PLANS.get(key)
    if plan is None:
        seq, hd, feat = (dim_name(d, qs, "attention", "the queries") for d in (dim, heads, features))
        mem, kvh = (dim_name(d, ks, "attention", "the keys")
                    for d in (memory, hd if kv_heads is None else kv_heads))
        plan = _attention_plan(qs, ks, vs, bs, seq, mem, feat, hd, kvh)
        if not compiled:
            _PLANS.put(key, plan)
    others, q_perm, k_perm, back, target, whole, feat_size, grouped, group, seq, hd = plan
    scale = feat_size ** -0.5 if scale is None else scale

    def local_fn(view, ql, kl, vl, bl=None):
        qs, ks, vs = ql.permute(q_perm), kl.permute(k_perm), vl.permute(k_perm)
        one = len(others) == 1  # one other dim (the batch) is the rows already: no view to make
        if not one or bl is not None:
            lead = [view.size(d) for d in others]
            rows = math.prod(lead)
        if not one:
            qs, ks, vs = (t.reshape(rows, *t.shape[-3:]) for t in (qs, ks, vs))
        n, keys = qs.shape[-2], ks.shape[-2]
        mask, is_causal = None, False
        if causal:
            first = offset + view.slices[seq][0]  # (view.start's frame saved)
            # keys after the last local query are never seen: leave them out
            if first + n < keys:
                keys = max(0, first + n)
                ks, vs = ks[..., :keys, :], vs[..., :keys, :]
            if first == 0:
                is_causal = True
            elif not (n == 1 and first >= keys - 1):
                mask = causal_mask(n, keys, first, ql.device)
        if bl is not None:
            b = align(bl, bias.names, target)
            b = b.expand(*lead, *b.shape[len(lead):]).reshape(rows, *b.shape[len(lead):])[..., :keys]
            if is_causal:   # is_causal and attn_mask do not combine: the causal mask joins the bias
                mask, is_causal = causal_mask(n, keys, 0, ql.device), False
            if b.dtype == torch.bool:  # a mask, as SDPA's boolean attn_mask: True takes part
                mask = b if mask is None else mask & b
            else:
                b = b.to(_sdpa_dtype(qs))
                mask = b if mask is None else torch.where(mask, b, b + NEG)
        gqa = False
        if grouped:
            start, size = view.slices[hd]
            if group > 1 and start % group == 0 and size % group == 0 and HAS_ENABLE_GQA:
                # the kv heads of this processor's query heads, shared by SDPA's GQA kernel
                mine = slice(start // group, (start + size) // group)
                ks, vs = ks[:, mine], vs[:, mine]
                gqa = True
            else:
                pick = torch.arange(start, start + size, device=ql.device) // group
                ks, vs = ks.index_select(1, pick), vs.index_select(1, pick)
        if 0 in qs.shape or 0 in ks.shape:  # (empty: asked of the sizes, no numel() calls into C)
            # an empty slice (uneven pieces): SDPA's result would hang off none of the inputs, and
            # every processor needs a gradient (zeros here) for the same tensors
            zero = sum(t.sum() for t in (qs, ks, vs) + (() if mask is None or mask.dtype == torch.bool
                                                         else (mask,))) * 0
            out = zero + qs.new_zeros(*qs.shape[:-1], vs.shape[-1])
        else:
            out = _sdpa(qs, ks, vs, mask, is_causal, scale, gqa)
        return (out if one else out.reshape(*lead, *out.shape[-3:])).permute(back)

    inputs = [q, k, v] + ([bias] if bias is not None else [])
    return lower("attention", inputs, q.shape, local_fn, whole=whole, name=name, compiled=compiled)


_PLANS = BoundedCache(256)  # attention's signatures (shapes, dim arguments) -> _attention_plan's


def _attention_plan(qs: Shape, ks: Shape, vs: Shape, bs: Shape | None, seq: str, mem: str, feat: str,
                    hd: str, kvh: str) -> tuple:
    """:func:`attention`'s checks of its operands' shapes (raising :class:`ShapeError`) and what
    its local function needs of them: the dims other than heads, sequence and features, the
    permutations to SDPA's order and back, the bias's target order, the whole dims, the
    features' size and the query heads per key head."""
    if vs != ks:
        raise ShapeError(f"attention: values [{vs}] must have the keys' shape [{ks}]")
    for what, x, need in (("queries", qs, (seq, hd, feat)), ("keys", ks, (mem, kvh, feat))):
        for d in need:
            if d not in x:
                raise ShapeError(f"attention: {what} [{x}] have no dim {d!r}; name the dims with "
                                 "dim=, memory=, heads=, kv_heads= and features=")
    if seq == mem:
        raise ShapeError(f"attention: queries and keys both on {seq!r}; give the keys their own dim "
                         f"(mt.rename(k, {seq!r}, 'memory_length')) or use mt.ring_attention")
    if ks[feat].size != qs[feat].size:
        raise ShapeError(f"attention: {feat!r} is {qs[feat].size} in the queries [{qs}] and "
                         f"{ks[feat].size} in the keys [{ks}]")
    others = [d for d in qs.names if d not in (seq, hd, feat)]
    k_others = [d for d in ks.names if d not in (mem, kvh, feat)]
    if sorted(others) != sorted(k_others):
        raise ShapeError(f"attention: queries [{qs}] and keys [{ks}] must share their other "
                         f"dims (queries have {others}, keys {k_others})")
    n_heads, n_kv = qs[hd].size, ks[kvh].size
    if n_heads % n_kv:
        raise ShapeError(f"attention: {kvh!r} ({n_kv}) must divide {hd!r} ({n_heads})")
    if bs is not None:
        extra = [d for d in bs.names if d not in others + [hd, seq, mem]]
        if extra:
            raise ShapeError(f"attention: bias [{bs}] has dims {extra} that are not the "
                             f"queries' or {mem!r}")
    grouped = kvh != hd
    q_order = others + [hd, seq, feat]
    k_order = others + [kvh, mem, feat]
    q_perm = tuple(qs.names.index(d) for d in q_order)
    k_perm = tuple(ks.names.index(d) for d in k_order)
    back = tuple(q_order.index(d) for d in qs.names)
    target = tuple(others + [hd, seq, mem])
    whole = frozenset({mem, feat} | ({kvh} if grouped else set()))
    # tuples: every call shares them
    return (tuple(others), q_perm, k_perm, back, target, whole, qs[feat].size, grouped,
            n_heads // n_kv, seq, hd)


def _sdpa(q, k, v, mask, is_causal, scale, gqa) -> torch.Tensor:
    """``scaled_dot_product_attention``; on ``meta`` tensors (the planner) the fused CPU kernel
    itself, which SDPA would run on a CPU: SDPA picks its math path for ``meta``, which would count
    a ``[.., length, memory_length]`` score tensor that no fused kernel ever holds."""
    fused = _op("_scaled_dot_product_flash_attention_for_cpu") if q.device.type == "meta" else None
    if fused is not None and (mask is None or not mask.requires_grad):
        if mask is not None and mask.dtype == torch.bool:   # as SDPA hands it over
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        return fused(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
    kw = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **kw)


def _op(name: str):
    """The aten op ``name``, or ``None`` where this torch has none (private kernels)."""
    return getattr(torch.ops.aten, name, None)


def _count_cpu_flops() -> None:
    """Teach ``torch.utils.flop_counter`` the fused CPU kernels SDPA runs on CPUs (it knows the
    CUDA ones): the same formulas, so a CPU step (and the planner's meta trace, which runs the CPU
    kernel) counts attention's FLOPs like a GPU step. Grouped-query keys are counted as the
    query heads they serve (torch's formulas before 2026-03 refuse fewer key heads)."""
    from torch.utils import flop_counter

    flash = "_scaled_dot_product_flash_attention"
    for cpu, gpu, query in ((f"{flash}_for_cpu", _op(flash), 0),
                            (f"{flash}_for_cpu_backward", _op(f"{flash}_backward"), 1)):
        op = _op(cpu)
        if op is not None and op not in flop_counter.flop_registry and gpu in flop_counter.flop_registry:
            formula = flop_counter.flop_registry[gpu]
            flop_counter.flop_registry[op] = functools.partial(_heads_as_queries, formula, query)


def _heads_as_queries(formula, query: int, *args, **kwargs) -> int:
    args = list(args)
    heads = args[query].shape[1]
    for i in (query + 1, query + 2):   # keys and values: broadcast views (only shapes count)
        t = args[i]
        if t.dim() == 4 and t.shape[1] != heads:
            args[i] = t[:, :1].expand(t.shape[0], heads, *t.shape[2:])
    return formula(*args, **kwargs)


_count_cpu_flops()


# a large finite negative bias (the models' NEG): exp() underflows to 0, fully masked rows stay finite
NEG = -1e9


def ring_attention(q: MeshTensor, k: MeshTensor, v: MeshTensor, *, causal: bool = False,
                   scale: float | None = None, dim: str | Dim = "length", features: str | Dim = "d_kv",
                   balance: bool = True, name: str | None = None) -> MeshTensor:
    """``softmax(q·kᵀ·scale [+ causal mask]) · v`` along ``dim``, contracting ``features``.

    ``q``, ``k`` and ``v`` have the same shape: self-attention, queries and keys at the same
    positions of ``dim``. Every other dim (``batch``, ``heads``, ...) is independent. ``scale``
    defaults to ``features ** -0.5``. When the rules split ``dim`` over an axis, this runs as
    ring attention: ``(n - 1)`` point-to-point shifts of the local keys and values along the
    axis, no all-gather. With ``causal`` and ``balance`` (and an even largest piece,
    ``ceil(length / n)``) the work is balanced over the axis by computing in zigzag order; the
    result's layout is the usual one.
    """
    q, k, v = as_mesh_tensor(q), as_mesh_tensor(k), as_mesh_tensor(v)
    seq = dim_name(dim, q, "ring_attention", "the queries")
    feat = dim_name(features, q, "ring_attention", "the queries")
    for what, x in (("keys", k), ("values", v)):
        if x.shape != q.shape:
            raise ShapeError(f"ring_attention: {what} [{x.shape}] must have the queries' shape "
                             f"[{q.shape}] (self-attention over one sequence); for other keys use "
                             "mt.einsum and mt.softmax")
    for d in (seq, feat):
        if d not in q.shape:
            raise ShapeError(f"ring_attention: queries [{q.shape}] have no dim {d!r}; name the sequence "
                             "dim with dim= and the contracted dim with features=")
    if seq == feat:
        raise ShapeError(f"ring_attention: dim and features are both {seq!r}")
    scale = q.shape[feat].size ** -0.5 if scale is None else scale
    order = [d for d in q.names if d not in (seq, feat)] + [seq, feat]
    perm = [q.names.index(d) for d in order]
    back = [order.index(d) for d in q.names]
    full = q.shape[seq].size
    # the axes that split the sequence in the result (the computation's layout): decided from
    # the layout, the same on every processor, never from a slice's size (uneven pieces differ)
    axes = layout_for(q.shape, name).axes_of(seq)
    if len(axes) > 1:
        raise LayoutError(
            f"ring_attention: dim {seq!r} is split over axes {format_axes(axes)}; ring attention runs "
            f"along one mesh axis: give {seq!r} a rule of one axis (e.g. '{seq}:{axes[0]}'), or use "
            "mt.attention, which gathers the keys (TransformerConfig(attention=\"gather\"))")
    axis = axes[0] if axes else None

    def local_fn(view, ql, kl, vl):
        flat = [t.permute(perm) for t in (ql, kl, vl)]
        lead = flat[0].shape[:-2]
        flat = [t.reshape(math.prod(lead), *t.shape[-2:]) for t in flat]
        out = ring_slices(*flat, axis, causal=causal, scale=scale, balance=balance, length=full)
        return out.reshape(*lead, *out.shape[-2:]).permute(back)

    return lower("ring_attention", [q, k, v], q.shape, local_fn, whole={feat}, name=name)


# (length, axis sizes) -> the distinct lengths of its pieces: asked by every local_attention call
def local_attention(q: MeshTensor, k: MeshTensor, v: MeshTensor, block: int, *, scale: float | None = None,
                    dim: str | Dim = "length", features: str | Dim = "d_kv",
                    name: str | None = None) -> MeshTensor:
    """Causal local (blocked) attention, Mesh-TF's ``local_attention_1d``: the query at position
    ``i`` of ``dim`` attends to the keys at ``i - block < j <= i``.

    Computed by blocks of ``block`` positions, each attending to itself and the previous block.
    With ``dim`` split, the previous block of the first local block lives on the left neighbour:
    it comes with one point-to-point shift of ``block`` positions of the keys and one of the
    values (``mt.shift``'s halo), and nothing else moves; backward sends the same back. ``block``
    must divide each processor's piece of ``dim`` (uneven ``torch.chunk`` pieces too). Other dims
    (``batch``, ``heads``) are independent; ``q``, ``k`` and ``v`` have one shape.

    Example:
        >>> import torch, meshtorch as mt
        >>> q, k, v = (mt.random.normal("batch:1,length:8,d_kv:4", seed=s) for s in range(3))
        >>> out = mt.local_attention(q, k, v, block=2)
        >>> i = torch.arange(8)
        >>> mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 2)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q.to_global(), k.to_global(), v.to_global(), attn_mask=mask)
        >>> torch.allclose(out.to_global(), ref, atol=1e-6)
        True
    """
    q, k, v = as_mesh_tensor(q), as_mesh_tensor(k), as_mesh_tensor(v)
    seq = dim_name(dim, q, "local_attention", "the queries")
    feat = dim_name(features, q, "local_attention", "the queries")
    for what, x in (("keys", k), ("values", v)):
        if x.shape != q.shape:
            raise ShapeError(f"local_attention: {what} [{x.shape}] must have the queries' shape [{q.shape}]")
    for d in (seq, feat):
        if d not in q.shape:
            raise ShapeError(f"local_attention: queries [{q.shape}] have no dim {d!r}; name the sequence "
                             "dim with dim= and the contracted dim with features=")
    axes = q.layout.axes_of(seq)
    mesh = current().mesh
    length = q.shape[seq].size
    pieces = lengths(mesh, axes, length)  # (kept per mesh, axes and length: None where all are equal)
    sizes = [length // math.prod(mesh.axis_size(a) for a in axes)] if pieces is None else sorted(set(pieces))
    if block < 1 or any(n % block for n in sizes):
        fit = functools.reduce(math.gcd, sizes)
        raise ShapeError(
            f"local_attention: block={block} must divide each processor's piece of dim {seq!r} "
            f"({length} positions in pieces of {sizes} over axes {list(axes)}); "
            + (f"choose a block dividing {fit}" if fit > 1 else f"make {seq!r} a multiple of "
               f"{math.prod(mesh.axis_size(a) for a in axes) * block}")
            + f", or split {seq!r} over fewer processors")
    scale = q.shape[feat].size ** -0.5 if scale is None else scale
    # the previous block of every position: the halo of the first local block from the left
    k_prev, v_prev = shift(k, seq, block), shift(v, seq, block)
    order = [d for d in q.names if d not in (seq, feat)] + [seq, feat]
    perm = [q.names.index(d) for d in order]
    back = [order.index(d) for d in q.names]

    def local_fn(view, ql, kl, vl, kp, vp):
        start, n = view.slices[seq]
        qs, ks, vs, kps, vps = (t.permute(perm) for t in (ql, kl, vl, kp, vp))
        lead, f = qs.shape[:-2], qs.shape[-1]
        nb = n // block

        def blocks(t):
            return t.reshape(*lead, nb, block, f)

        keys = torch.cat([blocks(kps), blocks(ks)], -2)          # [..., nb, 2·block, f]
        values = torch.cat([blocks(vps), blocks(vs)], -2)
        scores = torch.matmul(blocks(qs), keys.transpose(-1, -2)) * scale
        p = torch.arange(block, device=ql.device)[:, None]
        j = torch.arange(2 * block, device=ql.device)[None, :]
        allowed = (j > p) & (j <= p + block)                     # key j holds position j - block
        first = torch.arange(nb, device=ql.device)[:, None, None] + start // block == 0
        allowed = allowed & ~(first & (j < block))               # the sequence's first block has no previous
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores, -1), values)
        return out.reshape(*lead, n, f).permute(back)

    return lower("local_attention", [q, k, v, k_prev, v_prev], q.shape, local_fn, whole={feat}, name=name)
