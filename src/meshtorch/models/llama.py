"""Llama in Hugging Face's names: its config and where each weight lives (see :mod:`.hf_map`).

``LlamaForCausalLM`` is our :class:`DecoderLM` with rotary positions (the
halves of ``d_kv`` rotate as pairs, as transformers stores ``q_proj`` /
``k_proj``), RMSNorm, a gated SiLU feed-forward layer (SwiGLU: ``gate_proj``
is our ``wg``, ``up_proj`` our ``wi``, ``down_proj`` our ``wo``) and
grouped-query attention (``num_key_value_heads`` is our ``kv_heads``).

Example:
    >>> from meshtorch.models.llama import config_from_hf
    >>> cfg = config_from_hf({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    ...                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    >>> cfg.heads, cfg.kv_heads, cfg.d_kv, cfg.gated, cfg.norm, cfg.positions
    (4, 2, 8, True, 'rms', 'rotary')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshtorch.errors import ArgumentError, CheckpointError
from meshtorch.models.config import TransformerConfig
from meshtorch.models.hf_map import HF_ACTIVATIONS, OUR_ACTIVATIONS, Piece, Source
from meshtorch.models.rope import check_rope_scaling

MODEL_TYPE = "llama"
# the transformers class of the LM, the bare model below its head, and the head's weight
LM_CLASS, BARE_CLASS, HEAD = "LlamaForCausalLM", "LlamaModel", "lm_head.weight"
# LlamaForCausalLM's keys; a LlamaModel's lack this prefix
PREFIX = "model."
# our dim -> the LlamaConfig field that sizes it (for errors)
FIELDS = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
          "vocab": "vocab_size", "d_model": "hidden_size", "d_kv": "head_dim"}
# each TransformerConfig field -> the LlamaConfig field that sets it (for messages)
CONFIG_FIELDS = {**FIELDS, "layers": "num_hidden_layers", "max_length": "max_position_embeddings",
                 "tie_embeddings": "tie_word_embeddings", "activation": "hidden_act",
                 "bias": "attention_bias", "eps": "rms_norm_eps", "rotary_base": "rope_theta",
                 "rope_scaling": "rope_parameters",
                 "padding_id": "pad_token_id", "positions": "model_type", "norm": "model_type",
                 "gated": "model_type"}


def _rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``rope_theta`` and our ``rope_scaling`` (None: plain) of a LlamaConfig."""
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta / rope_scaling
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    if kind == "llama3":  # as transformers: the pretraining length defaults to max_position_embeddings
        scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
    try:
        check_rope_scaling(scaling, "LlamaConfig rope_parameters")
    except ArgumentError as e:
        raise CheckpointError(str(e)) from None
    return theta, scaling


def config_from_hf(config: Mapping[str, Any] | None, src: Source | None = None,
                   heads: int | None = None) -> TransformerConfig:
    """The :class:`TransformerConfig` of a ``LlamaConfig`` (as a dict); ``src`` and ``heads``
    are unused (a Llama config records every size)."""
    if config is None:
        raise CheckpointError("a Llama state dict does not record its head counts or rotary base; pass "
                              "config= (the LlamaConfig) or a directory with config.json")
    act = config.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise CheckpointError(f"LlamaConfig hidden_act={act!r} is not supported; supported: "
                              f"{sorted(HF_ACTIVATIONS)}")
    bias = bool(config.get("attention_bias", False))
    if bool(config.get("mlp_bias", False)) != bias:
        raise CheckpointError(f"LlamaConfig attention_bias={bias} but mlp_bias={not bias}: DecoderLM's dense "
                              "layers all have biases or none")
    pad, vocab = config.get("pad_token_id"), config["vocab_size"]
    # nn.Embedding(padding_idx) counts a negative id from the end (legacy LLaMA conversions have -1)
    if pad is not None and not (isinstance(pad, int) and not isinstance(pad, bool) and -vocab <= pad < vocab):
        raise CheckpointError(f"LlamaConfig pad_token_id={pad!r} is not an id of vocab_size={vocab} (nor "
                              "one counted from its end, -1 the last); transformers' embedding needs one "
                              "(or null)")
    n_heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or n_heads
    d_model = config["hidden_size"]
    theta, scaling = _rope(config)
    return TransformerConfig(
        vocab=config["vocab_size"], d_model=d_model, heads=n_heads,
        d_kv=config.get("head_dim") or d_model // n_heads,
        d_ff=config["intermediate_size"], layers=config["num_hidden_layers"],
        max_length=config.get("max_position_embeddings", 2048), positions="rotary",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), norm="rms",
        activation=HF_ACTIVATIONS[act], bias=bias, eps=config.get("rms_norm_eps", 1e-6),
        kv_heads=0 if kv == n_heads else kv, gated=True, rotary_base=theta, rope_scaling=scaling,
        padding_id=-1 if pad is None else pad % vocab)


# the TransformerConfig fields a Llama has these values of
WANT = {"positions": "rotary", "norm": "rms", "gated": True, "experts": 0, "encoder_layers": 0}


def misfits(cfg: TransformerConfig) -> list[str]:
    """Why ``cfg`` is not a Llama (empty if it is one)."""
    return [f"{k}={getattr(cfg, k)!r} (Llama: {v!r})" for k, v in WANT.items() if getattr(cfg, k) != v]


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a Llama that is ``cfg``."""
    rope = {"rope_theta": cfg.rotary_base, "rope_type": "default", **(cfg.rope_scaling or {})}
    # transformers 4.x reads its scaling from rope_scaling (5.x from rope_parameters)
    scaled = {"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}
    pad = {"pad_token_id": cfg.padding_id} if cfg.padding_id >= 0 else {}
    return {"model_type": MODEL_TYPE, "architectures": [LM_CLASS], "vocab_size": cfg.vocab,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.dim("kv_heads").size,
            "head_dim": cfg.d_kv, "max_position_embeddings": cfg.max_length,
            "hidden_act": OUR_ACTIVATIONS[cfg.activation], "rms_norm_eps": cfg.eps,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
            "attention_dropout": cfg.dropout, "rope_parameters": rope, "rope_theta": cfg.rotary_base,
            **scaled, **pad}


def pieces(cfg: TransformerConfig) -> dict[str, Piece]:
    """Our parameter name -> its place in LlamaForCausalLM's weights (``nn.Linear`` is (out, in))."""
    kv = cfg.key_heads().name
    out = {"embed.table": Piece(PREFIX + "embed_tokens.weight", (("vocab",), ("d_model",))),
           "decoder.ln_f.weight": Piece(PREFIX + "norm.weight", (("d_model",),))}
    if not cfg.tie_embeddings:
        out["head.kernel"] = Piece(HEAD, (("vocab",), ("d_model",)))
    dense = {"attn.q": ("self_attn.q_proj", ("heads", "d_kv"), ("d_model",)),
             "attn.k": ("self_attn.k_proj", (kv, "d_kv"), ("d_model",)),
             "attn.v": ("self_attn.v_proj", (kv, "d_kv"), ("d_model",)),
             "attn.o": ("self_attn.o_proj", ("d_model",), ("heads", "d_kv")),
             "ffn.wg": ("mlp.gate_proj", ("d_ff",), ("d_model",)),
             "ffn.wi": ("mlp.up_proj", ("d_ff",), ("d_model",)),
             "ffn.wo": ("mlp.down_proj", ("d_model",), ("d_ff",))}
    for i in range(cfg.layers):
        src, dst = f"{PREFIX}layers.{i}.", f"decoder.blocks.{i}."
        for ours, (theirs, dims_out, dims_in) in dense.items():
            out[dst + ours + ".kernel"] = Piece(src + theirs + ".weight", (dims_out, dims_in))
            if cfg.bias:
                out[dst + ours + ".bias"] = Piece(src + theirs + ".bias", (dims_out,))
        out[dst + "ln_attn.weight"] = Piece(src + "input_layernorm.weight", (("d_model",),))
        out[dst + "ln_ffn.weight"] = Piece(src + "post_attention_layernorm.weight", (("d_model",),))
    return out
