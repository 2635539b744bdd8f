"""``ring_attention``: softmax attention over a sequence dim, also when a mesh axis splits it.

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

import math

import torch

from meshtorch.context import current
from meshtorch.errors import LayoutError, ShapeError
from meshtorch.lowering.lower import lower
from meshtorch.lowering.ring import ring_attention as ring_slices
from meshtorch.ops.array import shift
from meshtorch.shape import Dim, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def ring_attention(q: MeshTensor, k: MeshTensor, v: MeshTensor, *, causal: bool = False,
                   scale: float | None = None, dim: str | Dim = "length", features: str | Dim = "d_kv",
                   balance: bool = True, name: str | None = None) -> MeshTensor:
    """``softmax(q·kᵀ·scale [+ causal mask]) · v`` along ``dim``, contracting ``features``.

    ``q``, ``k`` and ``v`` have the same shape: self-attention, queries and keys at the same
    positions of ``dim``. Every other dim (``batch``, ``heads``, ...) is independent. ``scale``
    defaults to ``features ** -0.5``. When the rules split ``dim`` over an axis, this runs as
    ring attention: ``(n - 1)`` point-to-point shifts of the local keys and values along the
    axis, no all-gather. With ``causal`` and ``balance`` (and an even local length) the work is
    balanced over the axis by computing in zigzag order; the result's layout is the usual one.
    """
    q, k, v = as_mesh_tensor(q), as_mesh_tensor(k), as_mesh_tensor(v)
    seq, feat = dim_name(dim), dim_name(features)
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

    def local_fn(view, ql, kl, vl):
        axis = None
        if view.size(seq) != full:
            axis = current().rules.axis_of(seq)
            if not isinstance(axis, str):
                raise LayoutError(f"ring_attention: dim {seq!r} is split over {axis!r}; ring attention runs "
                                  "along one mesh axis — give the rule one axis")
        flat = [t.permute(perm) for t in (ql, kl, vl)]
        lead = flat[0].shape[:-2]
        flat = [t.reshape(math.prod(lead), *t.shape[-2:]) for t in flat]
        out = ring_slices(*flat, axis, causal=causal, scale=scale, balance=balance)
        return out.reshape(*lead, *out.shape[-2:]).permute(back)

    return lower("ring_attention", [q, k, v], q.shape, local_fn, whole={feat}, name=name)


def local_attention(q: MeshTensor, k: MeshTensor, v: MeshTensor, block: int, *, scale: float | None = None,
                    dim: str | Dim = "length", features: str | Dim = "d_kv",
                    name: str | None = None) -> MeshTensor:
    """Causal local (blocked) attention, Mesh-TF's ``local_attention_1d``: the query at position
    ``i`` of ``dim`` attends to the keys at ``i - block < j <= i``.

    Computed by blocks of ``block`` positions, each attending to itself and the previous block.
    With ``dim`` split, the previous block of the first local block lives on the left neighbour:
    it comes with one point-to-point shift of ``block`` positions of the keys and one of the
    values (``mt.shift``'s halo), and nothing else moves; backward sends the same back. ``block``
    must divide each processor's piece of ``dim``. Other dims (``batch``, ``heads``) are
    independent; ``q``, ``k`` and ``v`` have one shape.

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
    seq, feat = dim_name(dim), dim_name(features)
    for what, x in (("keys", k), ("values", v)):
        if x.shape != q.shape:
            raise ShapeError(f"local_attention: {what} [{x.shape}] must have the queries' shape [{q.shape}]")
    for d in (seq, feat):
        if d not in q.shape:
            raise ShapeError(f"local_attention: queries [{q.shape}] have no dim {d!r}; name the sequence "
                             "dim with dim= and the contracted dim with features=")
    axes = q.layout.axes_of(seq)
    pieces = math.prod(current().mesh.axis_size(a) for a in axes)
    length = q.shape[seq].size
    if block < 1 or length % pieces or (length // pieces) % block:
        raise ShapeError(
            f"local_attention: block={block} must divide each processor's piece of dim {seq!r} "
            f"({length} positions in {pieces} pieces, split over axes {list(axes)}); choose a block "
            f"dividing {length // pieces}, or split {seq!r} over fewer processors")
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
