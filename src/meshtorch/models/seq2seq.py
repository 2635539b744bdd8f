"""Encoder-decoder Transformer over named dims (self-, cross-attention, shared embeddings).

Encoder and decoder share one embedding table; the output layer is that table
too (``tie_embeddings=True``) or a separate ``d_model -> vocab`` layer.

The encoder reads ``src [batch, length]`` without a causal mask (padding keys
are masked); the decoder attends causally to its own prefix and, through
cross-attention, to the encoder output renamed to ``memory_length``.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.models import EncoderDecoder, TransformerConfig
    >>> cfg = TransformerConfig(vocab=264, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1,
    ...                         encoder_layers=1, max_length=8)
    >>> model = EncoderDecoder(cfg)
    >>> src = mt.from_global(torch.tensor([[49, 50, 256]]), "batch:1,length:3")
    >>> tgt = mt.from_global(torch.tensor([[257, 111]]), "batch:1,length:2")
    >>> model(src, tgt).shape
    Shape('batch:1,length:2,vocab:264')
"""

from __future__ import annotations

import torch

from meshtorch import nn
from meshtorch.context import processor_device
from meshtorch.errors import ArgumentError
from meshtorch.models.config import TransformerConfig
from meshtorch.models.decode import length_whole
from meshtorch.models.layers import LENGTH, MEMORY, padding_bias
from meshtorch.models.lm import Stack, output_layer, token_table, weighted_mean
from meshtorch.ops.elementwise import not_equal
from meshtorch.ops.nn import cross_entropy
from meshtorch.ops.reshape import rename
from meshtorch.shape import Dim
from meshtorch.tensor import MeshTensor, from_global

PAD = 256  # the source padding id without cfg.padding_id: the bytes tokenizer's pad


class EncoderDecoder(nn.Module):
    """Transformer encoder-decoder with one embedding table shared by encoder and decoder
    (and by the output layer when ``cfg.tie_embeddings``).

    Args:
        cfg: sizes; ``encoder_layers`` encoder blocks and ``layers`` decoder blocks.
        seed: parameters are a pure function of ``seed`` and their names.
        pad: the source padding id (masked out of attention); default ``cfg.padding_id`` where
            it is set (its lookups also train nothing), else 256 (the bytes tokenizer's pad).
    """

    def __init__(self, cfg: TransformerConfig, seed: int = 0, pad: int | None = None):
        super().__init__()
        if pad is not None and cfg.padding_id >= 0 and pad != cfg.padding_id:
            raise ArgumentError(f"EncoderDecoder(pad={pad}) but cfg.padding_id={cfg.padding_id}: the source "
                                "padding the encoder masks out is the id whose lookups train nothing; pass "
                                "one of them (drop pad=, or set padding_id to the same id)")
        self.cfg = cfg
        self.pad = (cfg.padding_id if cfg.padding_id >= 0 else PAD) if pad is None else pad
        self.embed = token_table(cfg)
        self.encoder = Stack(cfg, max(cfg.encoder_layers, 1), cross=False, embed=self.embed)
        self.decoder = Stack(cfg, cfg.layers, cross=True, embed=self.embed)
        if not cfg.tie_embeddings:
            self.head = output_layer(cfg)
        self.reset_parameters(seed)
        self.last_aux: MeshTensor | None = None

    def encode(self, src: MeshTensor) -> tuple[MeshTensor, MeshTensor]:
        """Encoder output as ``memory [batch, memory_length, d_model]`` and its key mask bias."""
        keep = rename(not_equal(src, self.pad), LENGTH, MEMORY)
        bias = padding_bias(keep)
        h, aux = self.encoder(src, causal=False, self_bias=bias)
        self.last_aux = aux
        return rename(h, LENGTH, MEMORY), bias

    def forward(self, src: MeshTensor, tgt_in: MeshTensor) -> MeshTensor:
        """Logits ``[batch, length, vocab]`` of the next target token at each target position."""
        memory, bias = self.encode(src)
        enc_aux = self.last_aux
        h, aux = self.decoder(tgt_in, causal=True, memory=memory, memory_bias=bias)
        if enc_aux is not None:
            aux = enc_aux if aux is None else aux + enc_aux
        self.last_aux = aux
        return self.logits_of(h)

    def logits_of(self, h: MeshTensor) -> MeshTensor:
        """Logits over ``vocab`` from final decoder states."""
        return self.embed.attend(h) if self.cfg.tie_embeddings else self.head(h)

    def loss(self, src: MeshTensor, tgt_in: MeshTensor, tgt_out: MeshTensor,
             weights: MeshTensor | None = None) -> MeshTensor:
        """Mean cross-entropy of ``tgt_out`` over positions where ``weights`` is 1 (+ MoE loss)."""
        loss = weighted_mean(cross_entropy(self(src, tgt_in), tgt_out, "vocab"), weights)
        if self.last_aux is not None:
            loss = loss + self.last_aux * self.cfg.aux_loss
        return loss

    @torch.no_grad()
    def greedy(self, src: MeshTensor, bos: int, steps: int) -> torch.Tensor:
        """Greedy decoding of ``steps`` tokens after ``bos``: a ``[batch, steps]`` torch tensor
        (the same on every processor)."""
        was = self.training
        self.eval()
        memory, bias = self.encode(src)
        b = src.shape["batch"]
        seq = torch.full((b.size, 1), bos, dtype=torch.int64, device=processor_device())
        with length_whole():
            for _ in range(steps):
                ids = from_global(seq, [b, Dim(LENGTH, seq.shape[1])])
                h, _ = self.decoder(ids, causal=True, memory=memory, memory_bias=bias)
                last = self.logits_of(h).to_global()[:, -1]
                seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
        self.train(was)
        return seq[:, 1:]
