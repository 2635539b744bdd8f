"""Decoder-only Transformer language model over named dims (GPT style, pre-norm).

Inputs are token ids ``[batch, length]``; logits are ``[batch, length, vocab]``.
Every parameter is named by dims, so one rules string lays the model out:
``"batch:b; heads:m; d_ff:m; vocab:m"`` is the Mesh-TensorFlow paper's data ×
model parallelism. The same seed gives the same model on any mesh.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.models import DecoderLM, TransformerConfig
    >>> cfg = TransformerConfig(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
    >>> def f():
    ...     model = DecoderLM(cfg, seed=0)
    ...     ids = mt.from_global(torch.arange(12).reshape(2, 6) % 32, "batch:2,length:6")
    ...     return round(model.loss(ids, ids).item(), 4)
    >>> one, = mt.launch(f)
    >>> mt.launch(f, mesh="b:2,m:2", rules="batch:b; heads:m; vocab:m") == [one] * 4
    True
"""

from __future__ import annotations

import functools

import torch

from meshtorch import nn
from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.models.config import TransformerConfig
from meshtorch.models.layers import (
    LENGTH,
    MEMORY,
    Attention,
    FeedForward,
    make_norm,
    rotary_tables,
)
from meshtorch.ops.elementwise import add, equal, where
from meshtorch.ops.nn import cross_entropy, dropout
from meshtorch.ops.reduce import reduce_mean
from meshtorch.random import normal
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor, as_mesh_tensor, zeros


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` [``+ cross(norm(x), memory)``] ``+ ffn(norm(x))``.

    The feed-forward layer is an MoE layer when ``cfg.is_moe_layer(index)``;
    then ``forward`` also returns its load-balancing loss (else ``None``).
    """

    def __init__(self, cfg: TransformerConfig, index: int, cross: bool = False):
        super().__init__()
        self.rate = cfg.dropout
        self.ln_attn = make_norm(cfg)
        self.attn = Attention(cfg)
        if cross:
            self.ln_cross = make_norm(cfg)
            self.cross = Attention(cfg)
        self.ln_ffn = make_norm(cfg)
        if cfg.is_moe_layer(index):
            from meshtorch.models.moe import MoE

            self.ffn = MoE(cfg)
        else:
            self.ffn = FeedForward(cfg)

    def _drop(self, x: MeshTensor) -> MeshTensor:
        return dropout(x, self.rate) if self.training and self.rate else x

    def forward(self, x: MeshTensor, bias: MeshTensor | None = None, rotary=None, cache: dict | None = None,
                memory: MeshTensor | None = None, memory_bias: MeshTensor | None = None, ring: bool = False,
                causal: bool = False):
        # _drop called only where it drops (a Python call per residual, cold between large
        # kernels, issue 27)
        drop = self.training and self.rate
        a = self.attn(self.ln_attn(x), bias=bias, rotary=rotary, cache=cache, ring=ring,
                      causal=causal and not ring)
        x = x + (self._drop(a) if drop else a)
        if memory is not None:
            a = self.cross(self.ln_cross(x), memory=memory, bias=memory_bias)
            x = x + (self._drop(a) if drop else a)
        y = self.ffn(self.ln_ffn(x))
        aux = None
        if isinstance(y, tuple):
            y, aux = y
        return x + (self._drop(y) if drop else y), aux


class KVCache:
    """Keys and values of every block for incremental decoding.

    ``offset`` is the number of positions already written; each block's entry
    holds ``k`` and ``v`` of shape ``[batch, memory_length:length, heads, d_kv]``
    (``kv_heads`` in place of ``heads`` under grouped-query attention), ``length`` the positions
    the cache holds: ``cfg.max_length`` unless given (at most that). A decode sizes it to its
    request, a prompt and the tokens it adds: a Llama 3.1's ``max_length`` of 131072 positions
    would cost GiBs a row and a write over all of them for every token.
    """

    def __init__(self, cfg: TransformerConfig, batch: Dim, layers: int, dtype: torch.dtype = torch.float32,
                 length: int | None = None):
        length = cfg.max_length if length is None else length
        if not 1 <= length <= cfg.max_length:
            raise ShapeError(f"a KV cache of length={length} positions: it holds 1 to max_length="
                             f"{cfg.max_length} (the model's positions)")
        self.max_length, self.model_length = length, cfg.max_length
        shape = [batch, Dim(MEMORY, length), cfg.key_heads(), cfg.dim("d_kv")]
        self.entries = [{"k": zeros(shape, dtype), "v": zeros(shape, dtype), "offset": 0}
                        for _ in range(layers)]
        self.offset = 0

    def check(self, n: int) -> None:
        if self.offset + n > self.max_length:
            fix = ("raise TransformerConfig.max_length" if self.max_length == self.model_length else
                   f"make the cache longer (new_cache(batch, length=...), up to max_length="
                   f"{self.model_length})")
            raise ShapeError(f"KV cache holds {self.max_length} positions; {self.offset} are used and {n} "
                             f"more do not fit — {fix}")

    def advance(self, n: int) -> None:
        self.offset += n
        for e in self.entries:
            e["offset"] = self.offset


class Stack(nn.Module):
    """Token (+ learned position) embedding, blocks, and a final norm; shared by LM and seq2seq."""

    def __init__(self, cfg: TransformerConfig, layers: int, cross: bool, embed: nn.Embedding | None):
        super().__init__()
        self.cfg = cfg
        if embed is None:
            embed = token_table(cfg)
            self.embed = embed
        self._shared = [embed]  # a list keeps a shared table from being registered twice
        if cfg.positions == "learned":
            self.pos = nn.Embedding(Dim("positions", cfg.max_length), cfg.dim("d_model"),
                                    init="normal", std=0.01)
        self.blocks = torch.nn.ModuleList([Block(cfg, i, cross) for i in range(layers)])
        self.ln_f = make_norm(cfg)

    def uses_ring(self, ids: MeshTensor) -> bool:
        """Whether causal self-attention over ``ids`` runs as ring attention (``cfg.attention``)."""
        how = self.cfg.attention
        dropping = self.training and self.cfg.dropout > 0
        if how == "ring" and dropping:
            raise ShapeError(f"attention='ring' never forms the attention weights, so it cannot drop them "
                             f"out (dropout={self.cfg.dropout}); set dropout=0 or attention='auto'")
        if how == "auto":
            return not dropping and ids.layout.axis_of(LENGTH) is not None
        return how == "ring"

    @property
    def table(self) -> nn.Embedding:
        return self._shared[0]

    def forward(self, ids: MeshTensor, causal: bool, cache: KVCache | None = None,
                memory: MeshTensor | None = None, memory_bias: MeshTensor | None = None,
                self_bias: MeshTensor | None = None) -> tuple[MeshTensor, MeshTensor | None]:
        ids = as_mesh_tensor(ids)
        if LENGTH not in ids.shape:
            raise ShapeError(f"token ids need a {LENGTH!r} dim, got [{ids.shape}]")
        cfg = self.cfg
        n = ids.shape[LENGTH].size
        offset = 0 if cache is None else cache.offset
        if cache is not None:
            cache.check(n)
        elif n > cfg.max_length:
            raise ShapeError(f"sequence length {n} exceeds max_length={cfg.max_length}; raise "
                             "TransformerConfig.max_length or pass shorter sequences")
        x = embed_ids(self.table, ids, cfg)
        if cfg.positions == "learned":
            # rows offset.. of the table (a view where it is whole), not a lookup of made ids,
            # added in the same op (the table's gradient then goes into overlap's buckets)
            x = self.pos.add_rows(x, Dim(LENGTH, n), offset)
        rotary = rotary_of(cfg, n, offset)
        ring = causal and cache is None and self_bias is None and self.uses_ring(ids)
        # causal masking is a flag of the fused attention (no [length, memory_length] bias tensor)
        bias = self_bias
        if self.training and cfg.dropout:
            x = dropout(x, cfg.dropout)
        aux = None
        # recomputation keeps a block's input only; decoding (a cache) keeps nothing anyway
        remat = cfg.recompute and self.training and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            entry = None if cache is None else cache.entries[i]
            run = functools.partial(nn.checkpoint, block) if remat else block
            x, a = run(x, bias=bias, rotary=rotary, cache=entry, memory=memory, memory_bias=memory_bias,
                       ring=ring, causal=causal)
            if a is not None:
                aux = a if aux is None else add(aux, a)
        if cache is not None:
            cache.advance(n)
        return self.ln_f(x), aux


def embed_ids(table: nn.Embedding, ids: MeshTensor, cfg: TransformerConfig) -> MeshTensor:
    """The embeddings of token ``ids`` from ``table``; lookups of ``cfg.padding_id`` send the
    table no gradient (transformers' ``padding_idx``), its other uses (a tied output layer) do.
    :class:`Stack` and the pipeline's first stage both embed with it."""
    x = table(ids)
    if cfg.padding_id >= 0:
        x = where(equal(ids, cfg.padding_id), x.detach(), x)
    return x


def rotary_of(cfg: TransformerConfig, n: int, offset: int = 0) -> tuple[MeshTensor, ...] | None:
    """The rotary tables ``(cos_q, sin_q, cos_k, sin_k)`` of ``n`` positions from ``offset`` at
    ``cfg.rotary_base``, rescaled by ``cfg.rope_scaling`` (``None`` without rotary positions):
    queries on ``length``, keys on ``memory_length``, computed for the new positions only, also
    when they go into a cache.
    :class:`Stack` and the pipeline's stages both take them from here.

    Example:
        >>> from meshtorch.models import TransformerConfig
        >>> from meshtorch.models.lm import rotary_of
        >>> cfg = TransformerConfig(d_model=8, heads=2, d_kv=4, positions="rotary", rotary_base=50.0)
        >>> [t.shape.names for t in rotary_of(cfg, 3)]
        [('length', 'd_kv'), ('length', 'd_kv'), ('memory_length', 'd_kv'), ('memory_length', 'd_kv')]
    """
    if cfg.positions != "rotary":
        return None
    return (rotary_tables(n, cfg.d_kv, LENGTH, offset, cfg.rotary_base, cfg.rope_scaling)
            + rotary_tables(n, cfg.d_kv, MEMORY, offset, cfg.rotary_base, cfg.rope_scaling))


def token_table(cfg: TransformerConfig) -> nn.Embedding:
    """The token embedding ``[vocab, d_model]``, drawn from N(0, 0.02²), with the row of
    ``cfg.padding_id`` zero as transformers' ``nn.Embedding(padding_idx)`` draws it (each
    processor zeroes its part of that row, wherever the rules split ``vocab`` and ``d_model``).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.models import TransformerConfig
        >>> cfg = TransformerConfig(vocab=8, d_model=4, heads=1, d_kv=4, d_ff=8, layers=1, padding_id=5)
        >>> def rows():
        ...     table = token_table(cfg).table.mesh_tensor.to_global()
        ...     return table[5].abs().sum().item(), bool(table[4].abs().sum() > 0)
        >>> mt.launch(rows, mesh="m:2", rules="vocab:m")
        [(0.0, True), (0.0, True)]
    """
    if cfg.padding_id < 0:
        return nn.Embedding(cfg.dim("vocab"), cfg.dim("d_model"), init="normal", std=0.02)
    pad = cfg.padding_id

    def init(shape: Shape, seed: int, stream: str) -> MeshTensor:
        table = normal(shape, 0.0, 0.02, seed=seed, stream=stream)
        axis = table.shape.index("vocab")
        start, size = table.layout.slices(current().coords)[axis]
        if start <= pad < start + size:
            table.local.select(axis, pad - start).zero_()
        return table

    return nn.Embedding(cfg.dim("vocab"), cfg.dim("d_model"), init=init)


def output_layer(cfg: TransformerConfig) -> nn.Dense:
    """The output layer ``d_model -> vocab`` of a model whose embeddings are not tied."""
    return nn.Dense(cfg.dim("d_model"), cfg.dim("vocab"), bias=False, init="normal", std=cfg.d_model ** -0.5)


class DecoderLM(nn.Module):
    """GPT-style decoder-only LM: ``logits = head(norm(blocks(embed(ids) + pos)))``.

    Args:
        cfg: sizes and options (:class:`TransformerConfig`).
        seed: parameters are a pure function of ``seed`` and their names.
    """

    def __init__(self, cfg: TransformerConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = token_table(cfg)
        self.decoder = Stack(cfg, cfg.layers, cross=False, embed=self.embed)
        if not cfg.tie_embeddings:
            self.head = output_layer(cfg)
        self.reset_parameters(seed)
        self.last_aux: MeshTensor | None = None

    def logits_of(self, h: MeshTensor) -> MeshTensor:
        """Logits over ``vocab`` from final hidden states."""
        return self.embed.attend(h) if self.cfg.tie_embeddings else self.head(h)

    def forward(self, ids: MeshTensor, cache: KVCache | None = None) -> MeshTensor:
        """Logits ``[batch, length, vocab]`` for token ids ``[batch, length]`` (causal).

        With ``cache`` (from :meth:`new_cache`), ``ids`` are the next positions
        after those already in the cache, and the cache is extended.
        """
        h, aux = self.decoder(ids, causal=True, cache=cache)
        self.last_aux = aux
        return self.logits_of(h)

    def new_cache(self, batch: Dim, dtype: torch.dtype = torch.float32, length: int | None = None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``length`` tokens (default and at most:
        ``max_length``); :func:`~meshtorch.models.generate` makes one of its prompt's and new
        tokens' length.

        Example:
            >>> import meshtorch as mt
            >>> from meshtorch.models import DecoderLM, TransformerConfig
            >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1,
            ...                         max_length=64)
            >>> mt.launch(lambda: DecoderLM(cfg).new_cache(mt.shape.Dim("batch", 1), length=8)
            ...           .entries[0]["k"].shape["memory_length"].size)
            [8]
        """
        return KVCache(self.cfg, batch, self.cfg.layers, dtype, length)

    def loss(self, ids: MeshTensor, targets: MeshTensor, weights: MeshTensor | None = None) -> MeshTensor:
        """Mean next-token cross-entropy (nats) of ``targets`` given ``ids``, plus the
        weighted MoE load-balancing loss if the model has experts.

        ``weights`` (same dims as ``targets``, 0/1) masks positions out of the mean.
        """
        ce = cross_entropy(self(ids), targets, "vocab")
        loss = weighted_mean(ce, weights)
        if self.last_aux is not None:
            loss = loss + self.last_aux * self.cfg.aux_loss
        return loss


def weighted_mean(x: MeshTensor, weights: MeshTensor | None) -> MeshTensor:
    """Mean of ``x`` over all its dims, counting only positions where ``weights`` is 1."""
    if weights is None:
        return reduce_mean(x)
    from meshtorch.ops.reduce import reduce_sum

    w = weights if weights.dtype == x.dtype else weights * 1.0
    return reduce_sum(x * w) / reduce_sum(w)
