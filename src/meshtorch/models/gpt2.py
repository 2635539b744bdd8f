"""GPT-2 in Hugging Face's names: its config and where each weight lives (see :mod:`.hf_map`).

:func:`meshtorch.models.from_hf` reads a ``GPT2LMHeadModel`` / ``GPT2Model``,
its state dict or a saved directory through this map: learned positions,
biases everywhere, LayerNorm, tanh-approximated GELU, tied output layer.
GPT-2 stores its ``Conv1D`` weights as ``(in, out)`` and fuses query, key and
value into one ``c_attn``; the map places our named ``[d_model, heads, d_kv]``
kernels inside it, so the rules ``heads:m; d_ff:m`` split GPT-2 the Megatron
way without any GPT-2-specific code in the model.

``transformers`` is never imported by meshtorch: a model object is read
through ``.state_dict()`` and ``.config`` only.

Example:
    >>> import torch, meshtorch as mt
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> from meshtorch.models import from_hf
    >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
    ...                                 n_positions=16, bos_token_id=0, eos_token_id=0)).eval()
    >>> ids = torch.tensor([[5, 9, 2, 7], [1, 3, 3, 8]])
    >>> def logits():
    ...     model = from_hf(hf)
    ...     return model(mt.from_global(ids, "batch:2,length:4")).to_global()
    >>> ours = mt.launch(logits, mesh="b:2,m:2", rules="batch:b; heads:m; d_ff:m; vocab:m")[0]
    >>> with torch.no_grad():
    ...     bool((ours - hf(ids).logits).abs().max() < 1e-4)
    True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from meshtorch.errors import CheckpointError
from meshtorch.models.config import TransformerConfig
from meshtorch.models.hf_map import HF_ACTIVATIONS, OUR_ACTIVATIONS, Piece, Source, config_dict

MODEL_TYPE = "gpt2"
# the transformers class of the LM, the bare model below its head, and the head's weight
LM_CLASS, BARE_CLASS, HEAD = "GPT2LMHeadModel", "GPT2Model", "lm_head.weight"
# GPT2LMHeadModel's keys; a GPT2Model's lack this prefix
PREFIX = "transformer."
# our dim -> the GPT2Config field that sizes it (for errors)
FIELDS = {"heads": "n_head", "d_ff": "n_inner", "vocab": "vocab_size", "d_model": "n_embd",
          "positions": "n_positions"}
# each TransformerConfig field -> the GPT2Config field that sets it (for messages)
CONFIG_FIELDS = {**FIELDS, "layers": "n_layer", "max_length": "n_positions", "d_kv": "n_embd / n_head",
                 "tie_embeddings": "tie_word_embeddings", "activation": "activation_function",
                 "eps": "layer_norm_epsilon", "positions": "model_type", "norm": "model_type",
                 "bias": "model_type", "gated": "model_type", "kv_heads": "model_type",
                 "rotary_base": "model_type", "rope_scaling": "model_type",
                 "padding_id": "model_type"}
# released GPT-2 checkpoints (small .. xl) all have 64-dim heads
HEAD_SIZE = 64


def config_from_hf(config: Mapping[str, Any] | None, src: Source,
                   heads: int | None = None) -> TransformerConfig:
    """The :class:`TransformerConfig` of GPT-2 weights in ``src`` (sizes from the shapes; see
    :func:`gpt2_config`)."""
    src.strip = PREFIX
    vocab, d_model = src.shape(PREFIX + "wte.weight")
    max_length = src.shape(PREFIX + "wpe.weight")[0]
    blocks = {int(m.group(1)) for k in src.keys() if (m := re.match(r"(?:transformer\.)?h\.(\d+)\.", k))}
    layers = 1 + max(blocks, default=-1)
    if layers == 0:
        raise CheckpointError("the weights have no GPT-2 blocks (keys 'h.<i>.*')")
    d_ff = src.shape(PREFIX + "h.0.mlp.c_fc.weight")[1]
    activation, eps = "gelu_new", 1e-5
    if config is not None:
        activation = config.get("activation_function", "gelu_new")
        eps = config.get("layer_norm_epsilon", 1e-5)
        found = {"vocab_size": vocab, "n_embd": d_model, "n_positions": max_length, "n_layer": layers}
        for name, size in found.items():
            if config.get(name) != size:
                raise CheckpointError(f"GPT2Config.{name}={config.get(name)} but the weights have "
                                      f"{size}; pass the config that belongs to these weights")
        unsupported = [("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                       ("add_cross_attention", True)]
        for name, bad in unsupported:
            if config.get(name, not bad) == bad:
                raise CheckpointError(f"GPT2Config.{name}={bad} is not supported by DecoderLM; only the "
                                      f"standard GPT-2 attention ({name}={not bad}) can be imported")
        heads = config["n_head"] if heads is None else heads
        tie = config.get("tie_word_embeddings", True)
    else:
        tie = not src.has(HEAD) or torch.equal(
            src.read(HEAD, (slice(None),)), src.read(PREFIX + "wte.weight", (slice(None),)))
    if activation not in HF_ACTIVATIONS:
        raise CheckpointError(f"GPT-2 activation_function={activation!r} is not supported; "
                              f"supported: {sorted(HF_ACTIVATIONS)}")
    if heads is None:
        if d_model % HEAD_SIZE:
            raise CheckpointError(f"a state dict does not record the number of heads and d_model={d_model} "
                                  f"is not a multiple of {HEAD_SIZE}; pass heads= or config=")
        heads = d_model // HEAD_SIZE
    if d_model % heads:
        raise CheckpointError(f"n_head={heads} does not divide n_embd={d_model}")
    return TransformerConfig(vocab=vocab, d_model=d_model, heads=heads, d_kv=d_model // heads, d_ff=d_ff,
                             layers=layers, max_length=max_length, positions="learned", tie_embeddings=tie,
                             norm="layer", activation=HF_ACTIVATIONS[activation], bias=True, eps=eps)


def gpt2_config(state_dict: Mapping[str, torch.Tensor], config: Any = None,
                heads: int | None = None) -> TransformerConfig:
    """The :class:`TransformerConfig` of a GPT-2 state dict.

    Sizes come from the weight shapes; the number of heads, which no shape
    records, from ``heads``, else ``config.n_head``, else ``d_model / 64`` (as in
    every released GPT-2). ``config`` (a ``GPT2Config`` or its dict) also supplies
    the activation, LayerNorm epsilon and tying, and is checked against the shapes.

    Example:
        >>> import torch
        >>> from meshtorch.models.gpt2 import gpt2_config
        >>> sd = {"wte.weight": torch.zeros(50, 128), "wpe.weight": torch.zeros(32, 128),
        ...       "h.0.mlp.c_fc.weight": torch.zeros(128, 512)}
        >>> c = gpt2_config(sd)
        >>> c.vocab, c.d_model, c.heads, c.d_kv, c.d_ff, c.layers, c.max_length, c.activation
        (50, 128, 2, 64, 512, 1, 32, 'gelu_tanh')
    """
    return config_from_hf(config_dict(config), Source.of(state_dict), heads)


# the TransformerConfig fields a GPT-2 has these values of (besides misfits' shape checks); its
# embedding has no padding_idx (pad_token_id is only a config entry), so a padding_id could not train so
WANT = {"positions": "learned", "norm": "layer", "bias": True, "gated": False, "experts": 0,
        "encoder_layers": 0, "padding_id": -1}


def misfits(cfg: TransformerConfig) -> list[str]:
    """Why ``cfg`` is not a GPT-2 (empty if it is one)."""
    out = [f"{k}={getattr(cfg, k)!r} (GPT-2: {v!r})" for k, v in WANT.items() if getattr(cfg, k) != v]
    if cfg.grouped:
        out.append(f"kv_heads={cfg.kv_heads} (GPT-2 has no grouped-query attention)")
    if cfg.heads * cfg.d_kv != cfg.d_model:
        out.append(f"heads*d_kv={cfg.heads * cfg.d_kv} != d_model={cfg.d_model}")
    return out


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a GPT-2 that is ``cfg``."""
    return {"model_type": MODEL_TYPE, "architectures": [LM_CLASS], "vocab_size": cfg.vocab,
            "n_embd": cfg.d_model, "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.d_ff,
            "n_positions": cfg.max_length, "activation_function": OUR_ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": cfg.tie_embeddings,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout}


def pieces(cfg: TransformerConfig) -> dict[str, Piece]:
    """Our parameter name -> its place in GPT2LMHeadModel's weights."""
    d, t = cfg.d_model, PREFIX
    out = {"embed.table": Piece(t + "wte.weight", (("vocab",), ("d_model",))),
           "decoder.pos.table": Piece(t + "wpe.weight", (("positions",), ("d_model",))),
           "decoder.ln_f.weight": Piece(t + "ln_f.weight", (("d_model",),)),
           "decoder.ln_f.bias": Piece(t + "ln_f.bias", (("d_model",),))}
    if not cfg.tie_embeddings:
        out["head.kernel"] = Piece(HEAD, (("vocab",), ("d_model",)))  # nn.Linear is (out, in)
    for i in range(cfg.layers):
        src, dst = f"{t}h.{i}.", f"decoder.blocks.{i}."
        # Conv1D is (in, out); the fused out dim is [q | k | v], each head-major (heads, d_kv)
        for j, name in enumerate("qkv"):
            out[dst + f"attn.{name}.kernel"] = Piece(src + "attn.c_attn.weight",
                                                     (("d_model",), ("heads", "d_kv")), {1: j * d})
            out[dst + f"attn.{name}.bias"] = Piece(src + "attn.c_attn.bias", (("heads", "d_kv"),), {0: j * d})
        out[dst + "attn.o.kernel"] = Piece(src + "attn.c_proj.weight", (("heads", "d_kv"), ("d_model",)))
        out[dst + "attn.o.bias"] = Piece(src + "attn.c_proj.bias", (("d_model",),))
        out[dst + "ffn.wi.kernel"] = Piece(src + "mlp.c_fc.weight", (("d_model",), ("d_ff",)))
        out[dst + "ffn.wi.bias"] = Piece(src + "mlp.c_fc.bias", (("d_ff",),))
        out[dst + "ffn.wo.kernel"] = Piece(src + "mlp.c_proj.weight", (("d_ff",), ("d_model",)))
        out[dst + "ffn.wo.bias"] = Piece(src + "mlp.c_proj.bias", (("d_model",),))
        for ours, theirs in (("ln_attn", "ln_1"), ("ln_ffn", "ln_2")):
            for w in ("weight", "bias"):
                out[dst + f"{ours}.{w}"] = Piece(src + f"{theirs}.{w}", (("d_model",),))
    return out
