"""``TransformerConfig``: the sizes and choices of every model in :mod:`meshtorch.models`.

The config is plain data (JSON-able with :meth:`TransformerConfig.to_dict`),
so a checkpoint can rebuild its model. Dims get the names layout rules use:
``batch, length, d_model, heads, d_kv, d_ff, vocab, experts``.

Example:
    >>> from meshtorch.models import TransformerConfig
    >>> cfg = TransformerConfig(d_model=8, heads=2, d_kv=4, d_ff=16, vocab=32)
    >>> cfg.dim("d_ff"), cfg.num_experts_layers()
    (Dim(name='d_ff', size=16), 0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshtorch.errors import ShapeError
from meshtorch.models.rope import check_rope_scaling
from meshtorch.shape import Dim

POSITIONS = ("learned", "rotary")
NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
ATTENTIONS = ("auto", "ring", "gather")
# the key of TransformerConfig.extra under which an imported model keeps its HF config's token ids
HF_EXTRA = "hf_config"


@dataclass
class TransformerConfig:
    """Sizes and options of a Transformer (decoder-only, encoder-decoder, MoE).

    Attributes:
        vocab, d_model, heads, d_kv, d_ff: dim sizes (``heads * d_kv`` need not
            equal ``d_model``).
        layers: decoder blocks; ``encoder_layers``: encoder blocks (seq2seq only).
        max_length: longest sequence (size of the learned position table and of
            a KV cache).
        positions: ``"learned"`` (a table added to the embeddings) or ``"rotary"``.
        tie_embeddings: the output layer reuses the embedding table.
        norm: ``"layer"`` or ``"rms"`` (pre-norm blocks and a final norm).
        activation: of the feed-forward layer.
        bias: dense layers have biases (GPT-2 does).
        dropout: rate after attention and feed-forward (layout-invariant masks).
        attention: how causal self-attention runs. ``"auto"``: as ring attention
            (``mt.ring_attention``: keys and values passed around the axis, never
            gathered) when the rules split ``length`` and no attention dropout is
            active, else as einsum + softmax over gathered keys; ``"ring"``: always
            ring attention; ``"gather"``: never.
        kv_heads: key/value heads (grouped-query attention: each of ``kv_heads``
            serves ``heads / kv_heads`` query heads, as in Llama); 0: ``heads``
            (plain multi-head attention). Keys and values then have a
            ``kv_heads`` dim, which a rule may split (``kv_heads:m``) or leave whole.
        gated: the feed-forward layer is gated, ``wo(act(wg(x)) * wi(x))``
            (SwiGLU with ``activation="silu"``, as in Llama).
        rotary_base: base of the rotary angles (Llama's ``rope_theta``).
        rope_scaling: the rotary frequencies rescaled, in transformers' names (a Llama 3.1+
            ``config.json``'s ``rope_parameters`` less ``rope_theta``): ``{"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}`` or ``{"rope_type": "linear", "factor": 2.0}``
            (see :mod:`meshtorch.models.rope`); ``None``: plain rotary positions. Only with
            ``positions="rotary"``.
        padding_id: an id whose embedding lookups send no gradient to the table (the row
            still trains through a tied output layer), as transformers' ``nn.Embedding``
            ``padding_idx`` (a Llama's ``pad_token_id``); -1: none.
        recompute: activation recomputation: in training, each block keeps only its
            input and runs its forward again during backward (``mt.nn.checkpoint``),
            trading one more forward's FLOPs (and collectives) for its activations.
        experts: number of experts of each MoE layer (0: no MoE).
        moe_every: every ``moe_every``-th block's feed-forward is an MoE layer.
        top_k: experts per token (1 or 2); ``capacity_factor``: an expert takes
            at most ``capacity_factor * tokens * top_k / experts`` tokens per group;
            ``aux_loss``: weight of the load-balancing loss.
        extra: what an imported model carries that the model itself does not use
            (:func:`~meshtorch.models.from_hf` keeps the HF config's token ids there under
            ``"hf_config"``, and :func:`~meshtorch.models.export_hf` writes them back).
    """

    vocab: int = 264
    d_model: int = 128
    heads: int = 4
    d_kv: int = 32
    d_ff: int = 512
    layers: int = 2
    encoder_layers: int = 0
    max_length: int = 256
    positions: str = "learned"
    tie_embeddings: bool = True
    norm: str = "layer"
    activation: str = "gelu"
    bias: bool = False
    dropout: float = 0.0
    attention: str = "auto"
    eps: float = 1e-5
    experts: int = 0
    moe_every: int = 2
    top_k: int = 2
    capacity_factor: float = 2.0
    aux_loss: float = 0.01
    kv_heads: int = 0
    gated: bool = False
    rotary_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    padding_id: int = -1
    recompute: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "heads", "d_kv", "d_ff", "max_length"):
            if getattr(self, name) < 1:
                raise ShapeError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.positions not in POSITIONS:
            raise ShapeError(f"positions={self.positions!r}; use one of {POSITIONS}")
        if self.positions == "rotary" and self.d_kv % 2:
            raise ShapeError(f"rotary positions rotate pairs of d_kv; d_kv={self.d_kv} must be even")
        check_rope_scaling(self.rope_scaling, "TransformerConfig.rope_scaling")
        if self.rope_scaling is not None and self.positions != "rotary":
            raise ShapeError(f"rope_scaling={self.rope_scaling} rescales rotary positions, but positions="
                             f"{self.positions!r}; set positions='rotary' or rope_scaling=None")
        if self.norm not in NORMS:
            raise ShapeError(f"norm={self.norm!r}; use one of {NORMS}")
        if self.activation not in ACTIVATIONS:
            raise ShapeError(f"activation={self.activation!r}; use one of {ACTIVATIONS}")
        if self.attention not in ATTENTIONS:
            raise ShapeError(f"attention={self.attention!r}; use one of {ATTENTIONS}")
        if not -1 <= self.padding_id < self.vocab:
            raise ShapeError(f"padding_id={self.padding_id} is not an id of vocab={self.vocab}; use -1 for "
                             "none")
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ShapeError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (each key/value head "
                             "serves heads/kv_heads query heads); use 0 for plain multi-head attention")
        if self.gated and self.experts:
            raise ShapeError("gated=True applies to dense feed-forward layers; MoE experts are not gated — "
                             "set gated=False or experts=0")
        if self.experts and self.top_k not in (1, 2):
            raise ShapeError(f"top_k={self.top_k}; MoE gating supports top_k 1 or 2")
        if self.experts and self.top_k > self.experts:
            raise ShapeError(f"top_k={self.top_k} needs at least as many experts, got {self.experts}")

    def dim(self, name: str) -> Dim:
        """The model dim ``name`` (``d_model``, ``heads``, ``kv_heads``, ``d_kv``, ``d_ff``, ``vocab``,
        ``experts``)."""
        if name == "kv_heads":
            return Dim(name, self.kv_heads or self.heads)
        if name not in ("vocab", "d_model", "heads", "d_kv", "d_ff", "experts"):
            raise ShapeError(f"{name!r} is not a model dim of TransformerConfig")
        return Dim(name, getattr(self, name))

    @property
    def grouped(self) -> bool:
        """Whether attention is grouped-query (fewer key/value heads than query heads)."""
        return 0 < self.kv_heads < self.heads

    def key_heads(self) -> Dim:
        """The heads dim of keys and values: ``kv_heads`` under grouped-query attention, else
        ``heads`` (so a model without grouping keeps its parameters' dims)."""
        return self.dim("kv_heads") if self.grouped else self.dim("heads")

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) uses an MoE feed-forward layer."""
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    def num_experts_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def token_ids(self, name: str) -> list[int]:
        """The ids of an imported model's HF config field ``name`` (``"eos_token_id"``: one id or a
        list, as Llama 3 lists its end-of-turn ids) kept in :attr:`extra`; ``[]`` if it has none.

        Example:
            >>> TransformerConfig(extra={"hf_config": {"eos_token_id": [1, 7]}}).token_ids("eos_token_id")
            [1, 7]
            >>> TransformerConfig().token_ids("eos_token_id")
            []
        """
        ids = self.extra.get(HF_EXTRA, {}).get(name)
        return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ShapeError(f"unknown TransformerConfig field(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)
