"""Transformer building blocks over named dims: attention, feed-forward, positions.

Attention contracts ``d_model`` into ``heads, d_kv``. Keys and values live on
``memory_length`` (a renamed ``length``), and attention is one fused op
(:func:`meshtorch.attention`: ``scaled_dot_product_attention`` on each
processor, causal by a flag, no score tensor). With rules ``heads:m`` the
whole attention computation is local to each processor's heads; only the
output projection sums over them.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.models import TransformerConfig
    >>> from meshtorch.models.layers import Attention, causal_bias
    >>> cfg = TransformerConfig(d_model=8, heads=2, d_kv=4, d_ff=16, vocab=32)
    >>> x = mt.random.normal("batch:2,length:3,d_model:8", seed=0)
    >>> attn = Attention(cfg)
    >>> fused = attn(x, causal=True)                 # scaled_dot_product_attention(is_causal=True)
    >>> fused.shape
    Shape('batch:2,length:3,d_model:8')
    >>> torch.allclose(fused.to_global(), attn(x, bias=causal_bias(3)).to_global(), atol=1e-6)
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from meshtorch import caching, nn
from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.models.config import TransformerConfig
from meshtorch.models.rope import inverse_frequencies
from meshtorch.ops.attention import attention, ring_attention
from meshtorch.ops.einsum import einsum
from meshtorch.ops.elementwise import cast, gelu, gelu_tanh, relu, silu
from meshtorch.ops.nn import dropout, softmax
from meshtorch.ops.reshape import rename
from meshtorch.ops.slicewise import slicewise
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor, layout_for, local_slices

LENGTH, MEMORY = "length", "memory_length"
NEG = -1e9  # large finite: exp() underflows to exactly 0 and fully-masked rows stay finite
ACTIVATIONS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "silu": silu}


def causal_bias(length: int, memory: int | None = None, offset: int = 0,
                dtype: torch.dtype = torch.float32) -> MeshTensor:
    """``[length, memory_length]`` additive mask: 0 where key ``j <= offset + i``, else −1e9.

    ``offset`` is the position of the first query (decoding with a KV cache). Attention takes
    ``causal=True`` instead (no score-sized tensor at all); this bias is for the scores formed by
    hand, e.g. :class:`Attention`'s dropout path. The whole mask is made once per (sizes, offset,
    dtype, device) and each processor views its slice of it: no copy per call.

    Example:
        >>> from meshtorch.models.layers import causal_bias
        >>> causal_bias(2, 3, offset=1).to_global().tolist()
        [[0.0, 0.0, -1000000000.0], [0.0, 0.0, 0.0]]
    """
    memory = length if memory is None else memory
    # Dynamo traces the memo's function itself (it would bypass the lru_cache anyway, warning)
    bias = _causal_bias.__wrapped__ if caching.compiling() else _causal_bias
    t = bias(length, memory, offset, dtype, current().device)
    return _constant(t, Shape([Dim(LENGTH, length), Dim(MEMORY, memory)]))


@functools.lru_cache(maxsize=64)
def _causal_bias(length: int, memory: int, offset: int, dtype: torch.dtype,
                 device: torch.device | None) -> torch.Tensor:
    # NEG strictly above diagonal `offset` (key j > query i + offset), 0 elsewhere
    return torch.full((length, memory), NEG, dtype=dtype, device=device).triu_(offset + 1)


def _constant(t: torch.Tensor, shape: Shape) -> MeshTensor:
    """A cached whole tensor as a MeshTensor: this processor's slice is a view of it (never
    written to: these are constants, and no gradient flows into them)."""
    layout = layout_for(shape)
    return MeshTensor(t[local_slices(layout)] if layout.split else t, shape, layout)


def padding_bias(mask: MeshTensor) -> MeshTensor:
    """Additive mask over keys from a 0/1 ``mask`` with a ``memory_length`` dim (1 = keep).

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.models.layers import padding_bias
        >>> m = mt.from_global(torch.tensor([[1, 0]]), "batch:1,memory_length:2")
        >>> padding_bias(m).to_global().tolist()
        [[0.0, -1000000000.0]]
    """
    return (cast(mask, torch.float32) - 1.0) * -NEG


def rotary_tables(positions: int, d_kv: int, dim: str, offset: int = 0, base: float = 10000.0,
                  scaling: Mapping[str, Any] | None = None) -> tuple[MeshTensor, MeshTensor]:
    """``cos`` and ``sin`` tables ``[dim, d_kv]`` for rotary positions ``offset ..``.

    The two halves of ``d_kv`` rotate as pairs (GPT-NeoX layout), at the inverse frequencies of
    :func:`~meshtorch.models.rope.inverse_frequencies` (``base``, rescaled by ``scaling``, a
    ``TransformerConfig.rope_scaling``). Computed once per (sizes, offset, base, scaling, device)
    on the processor's device; each call views its slice.

    Example:
        >>> from meshtorch.models.layers import rotary_tables
        >>> cos, sin = rotary_tables(3, 4, "length")
        >>> cos.shape, round(sin.to_global()[1, 0].item(), 4)
        (Shape('length:3,d_kv:4'), 0.8415)
        >>> round(rotary_tables(3, 4, "length", scaling={"rope_type": "linear", "factor": 2.0})[1]
        ...       .to_global()[2, 0].item(), 4)
        0.8415
    """
    tables = _rotary_tables.__wrapped__ if caching.compiling() else _rotary_tables  # as in causal_bias
    key = None if scaling is None else tuple(sorted(scaling.items()))  # hashable, for the memo
    cos, sin = tables(positions, d_kv, offset, base, key, current().device)
    shape = Shape([Dim(dim, positions), Dim("d_kv", d_kv)])
    return _constant(cos, shape), _constant(sin, shape)


@functools.lru_cache(maxsize=64)
def _rotary_tables(positions: int, d_kv: int, offset: int, base: float, scaling: tuple | None,
                   device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = inverse_frequencies(d_kv, base, None if scaling is None else dict(scaling))
    # float64 angles on the host (exact positions), moved to the device once
    ang = (torch.arange(positions, dtype=torch.float64) + offset).unsqueeze(1) * inv
    ang = torch.cat([ang, ang], 1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rotary(x: MeshTensor, cos: MeshTensor, sin: MeshTensor) -> MeshTensor:
    """Rotate each pair ``(x_i, x_{i+d_kv/2})`` of ``x`` by its position's angle."""
    i = x.shape.index("d_kv")
    half = x.shape["d_kv"].size // 2

    def rotate_half(t: torch.Tensor) -> torch.Tensor:
        a, b = t.narrow(i, 0, half), t.narrow(i, half, half)
        return torch.cat([-b, a], i)

    if cos.dtype != x.dtype and x.dtype in (torch.float16, torch.bfloat16):
        # the tables in x's dtype (as transformers does), so bf16 queries are not promoted to float32
        cos, sin = cast(cos, x.dtype), cast(sin, x.dtype)
    return x * cos + slicewise(rotate_half, x, whole=["d_kv"]) * sin


class Attention(nn.Module):
    """Multi-head attention: ``d_model → heads, d_kv → d_model``.

    ``forward(x, memory=None, bias=None, rotary=None, cache=None, ring=False, causal=False)``:
    self-attention over ``x`` (with ``memory=None``) or cross-attention to
    ``memory`` (which has a ``memory_length`` dim). ``causal`` masks later keys (with ``cache``,
    relative to the cache's offset); ``bias`` is added to the scores (e.g. a padding mask; a
    boolean one is a mask, True where a key takes part, as :func:`meshtorch.attention` takes it),
    ``rotary`` is ``(cos_q, sin_q, cos_k, sin_k)``. ``cache`` (a :class:`KVCache` entry) makes
    self-attention write this call's keys and values into the cache and attend to all of it.

    The scores are never formed: attention is :func:`meshtorch.attention`, one fused
    ``scaled_dot_product_attention`` per processor (grouped-query attention included), except
    in training with ``dropout > 0``: dropping attention weights must give the same mask on every
    layout (meshtorch's random numbers are a function of the element's global index, SDPA's are
    not), so there the weights are formed with ``mt.einsum``, ``mt.softmax`` and ``mt.dropout``.
    ``ring=True`` runs causal self-attention as :func:`meshtorch.ring_attention`
    (keys stay on ``length``; with ``length`` split they go around the axis
    instead of being gathered); it takes no ``memory``, ``bias`` or ``cache``,
    and no attention-weight dropout.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d_model, heads, d_kv = cfg.dim("d_model"), cfg.dim("heads"), cfg.dim("d_kv")
        kv = cfg.key_heads()
        init = {"init": "normal", "std": cfg.d_model ** -0.5}
        self.q = nn.Dense(d_model, [heads, d_kv], bias=cfg.bias, **init)
        self.k = nn.Dense(d_model, [kv, d_kv], bias=cfg.bias, **init)
        self.v = nn.Dense(d_model, [kv, d_kv], bias=cfg.bias, **init)
        self.grouped = cfg.grouped
        self.heads, self.kv = heads, kv
        self.o = nn.Dense([heads, d_kv], d_model, bias=cfg.bias, init="normal",
                          std=(cfg.heads * cfg.d_kv) ** -0.5 / math.sqrt(2 * max(cfg.layers, 1)))
        self.scale = cfg.d_kv ** -0.5
        self.rate = cfg.dropout

    def forward(self, x: MeshTensor, memory: MeshTensor | None = None, bias: MeshTensor | None = None,
                rotary: tuple[MeshTensor, ...] | None = None, cache: dict | None = None,
                ring: bool = False, causal: bool = False) -> MeshTensor:
        q = self.q(x)
        if ring:
            return self._ring(x, q, memory, bias, rotary, cache)
        src = rename(x, LENGTH, MEMORY) if memory is None else memory
        k, v = self.k(src), self.v(src)
        if rotary is not None:
            q = apply_rotary(q, rotary[0], rotary[1])
            k = apply_rotary(k, rotary[2], rotary[3])
        offset = 0
        if cache is not None:
            offset = cache["offset"]
            k, v = cache_write(cache, k, v)
        if self.training and self.rate:
            return self.o(self._dropped(q, k, v, bias, causal, offset))
        ctx = attention(q, k, v, causal=causal, offset=offset, bias=bias, scale=self.scale, dim=LENGTH,
                        memory=MEMORY, heads=self.heads, kv_heads=self.kv if self.grouped else None)
        return self.o(ctx)

    def _dropped(self, q, k, v, bias, causal, offset) -> MeshTensor:
        """Attention with dropout on its weights: the scores formed with einsum (layout-invariant
        dropout masks, DESIGN §5)."""
        k, v = self._expand(k), self._expand(v)
        others = [n for n in q.names if n not in (LENGTH, "heads", "d_kv")]
        scores = einsum(q * self.scale, k, output_shape=others + ["heads", LENGTH, MEMORY])
        if causal:
            scores = scores + causal_bias(q.shape[LENGTH].size, k.shape[MEMORY].size, offset, scores.dtype)
        if bias is not None:
            # a boolean bias is a mask (True: attend), as meshtorch.attention takes it
            scores = scores + (cast(padding_bias(bias), scores.dtype) if bias.dtype == torch.bool else bias)
        w = dropout(softmax(scores, MEMORY), self.rate)
        ctx = einsum(w, v, output_shape=others + [LENGTH, "heads", "d_kv"])
        return ctx

    def _ring(self, x, q, memory, bias, rotary, cache) -> MeshTensor:
        if memory is not None or bias is not None or cache is not None:
            raise ShapeError("ring attention is causal self-attention over x: it takes no memory, bias or "
                             "KV cache; call Attention with ring=False for those")
        k, v = self.k(x), self.v(x)
        if rotary is not None:  # keys at the queries' positions: the query tables serve both
            q = apply_rotary(q, rotary[0], rotary[1])
            k = apply_rotary(k, rotary[0], rotary[1])
        k, v = self._expand(k), self._expand(v)
        return self.o(ring_attention(q, k, v, causal=True, scale=self.scale, dim=LENGTH))

    def _expand(self, t: MeshTensor) -> MeshTensor:
        """Grouped-query attention for the paths that need one key head per query head (ring
        attention, the dropout path): ``kv_heads -> heads``, query head ``h`` reading key/value head
        ``h // (heads / kv_heads)`` (transformers' ``repeat_kv``). A one-hot einsum rather than a
        reshape keeps the result on the ``heads`` dim, so ``heads:m`` splits it like the queries
        and each processor forms only its own heads. (:func:`meshtorch.attention` needs none of
        this: SDPA's ``enable_gqa``.)"""
        if not self.grouped:
            return t
        onehot = _group_onehot(self.kv.size, self.heads.size, t.dtype, current().device)
        out = [self.heads.name if n == self.kv.name else n for n in t.names]
        return einsum(t, _constant(onehot, Shape([self.kv, self.heads])), output_shape=out)


@functools.lru_cache(maxsize=16)
def _group_onehot(kv: int, heads: int, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    group = heads // kv
    onehot = torch.zeros(kv, heads, dtype=dtype, device=device)
    onehot[torch.arange(heads, device=device) // group, torch.arange(heads, device=device)] = 1.0
    return onehot


def cache_write(entry: dict, k: MeshTensor, v: MeshTensor) -> tuple[MeshTensor, MeshTensor]:
    """Add this call's keys/values (positions ``entry['offset'] ..``) into the cache entry.

    The cache holds ``[batch, memory_length:max_length, heads, d_kv]`` zeros
    where nothing is written yet; new rows are placed with a one-hot einsum, so
    the write works under any layout without indexing a split dim.
    """
    n, offset = k.shape[MEMORY].size, entry["offset"]
    size = entry["k"].shape[MEMORY].size
    dev = current().device
    place = torch.zeros(n, size, dtype=k.dtype, device=dev)   # made where it is used: no host copy
    rows = torch.arange(n, device=dev)
    place[rows, rows + offset] = 1.0
    p = _constant(place, Shape([Dim("new_length", n), Dim(MEMORY, size)]))
    out = entry["k"].names
    k_new, v_new = rename(k, MEMORY, "new_length"), rename(v, MEMORY, "new_length")
    entry["k"] = entry["k"] + einsum(k_new, p, output_shape=out)
    entry["v"] = entry["v"] + einsum(v_new, p, output_shape=out)
    return entry["k"], entry["v"]


class FeedForward(nn.Module):
    """``d_model → d_ff → d_model`` with an elementwise activation; with ``cfg.gated``,
    ``wo(act(wg(x)) * wi(x))`` (SwiGLU when the activation is ``silu``)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d_model, d_ff = cfg.dim("d_model"), cfg.dim("d_ff")
        self.wi = nn.Dense(d_model, d_ff, bias=cfg.bias, init="normal", std=cfg.d_model ** -0.5)
        self.gated = cfg.gated
        if cfg.gated:
            self.wg = nn.Dense(d_model, d_ff, bias=cfg.bias, init="normal", std=cfg.d_model ** -0.5)
        self.wo = nn.Dense(d_ff, d_model, bias=cfg.bias, init="normal",
                           std=cfg.d_ff ** -0.5 / math.sqrt(2 * max(cfg.layers, 1)))
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: MeshTensor) -> MeshTensor:
        if self.gated:
            return self.wo(self.act(self.wg(x)) * self.wi(x))
        return self.wo(self.act(self.wi(x)))


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """The configured normalisation over ``d_model``."""
    if cfg.norm == "rms":
        return nn.RMSNorm(cfg.dim("d_model"), eps=cfg.eps)
    return nn.LayerNorm(cfg.dim("d_model"), eps=cfg.eps, bias=True)
