"""Hugging Face causal LMs in and out: :func:`from_hf` and :func:`export_hf`.

One loader and one exporter for every architecture; what differs per
architecture (``gpt2``, ``llama``) is only its config translation and its map
of weight names (:mod:`.gpt2`, :mod:`.llama`). Loading from a directory reads
``config.json`` and the safetensors files (one ``model.safetensors`` or shards
with ``model.safetensors.index.json``), and each processor reads only its own
slices of each weight (``safe_open(...).get_slice``), never a whole tensor.

``transformers`` is never imported: a model object is read through
``.state_dict()`` and ``.config`` only, and an export is plain files that
``AutoModelForCausalLM.from_pretrained`` loads.

Example:
    >>> import tempfile, torch, meshtorch as mt
    >>> from meshtorch.models import DecoderLM, TransformerConfig, export_hf, from_hf
    >>> cfg = TransformerConfig(vocab=32, d_model=8, heads=2, kv_heads=1, d_kv=4, d_ff=16, layers=1,
    ...                         max_length=8, positions="rotary", norm="rms", activation="silu", gated=True)
    >>> path = tempfile.mkdtemp()
    >>> ids = mt.from_global(torch.tensor([[1, 2, 3]]), "batch:1,length:3")
    >>> def roundtrip():
    ...     model = DecoderLM(cfg, seed=1)
    ...     export_hf(path, model)
    ...     back = from_hf(path)
    ...     return bool((back(ids).to_global() == model(ids).to_global()).all())
    >>> mt.launch(roundtrip, mesh="m:2", rules="heads:m; d_ff:m")
    [True, True]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from meshtorch.checkpoint.consolidated import HF_INDEX, SINGLE, write_consolidated
from meshtorch.checkpoint.writer import agree
from meshtorch.comm.base import all_texts
from meshtorch.context import current
from meshtorch.errors import ArgumentError, CheckpointError, LayoutError
from meshtorch.layout import format_axes
from meshtorch.models import gpt2, llama
from meshtorch.models.config import HF_EXTRA, TransformerConfig
from meshtorch.models.hf_map import Piece, Source, assemble, config_dict, read_slice
from meshtorch.models.lm import DecoderLM

ARCHITECTURES: dict[str, ModuleType] = {gpt2.MODEL_TYPE: gpt2, llama.MODEL_TYPE: llama}
CONFIG = "config.json"
# where transformers keeps generate's settings beside config.json; its eos_token_id, where it names
# one, is where transformers' generate stops (instruct models list their end-of-turn ids there)
GENERATION_CONFIG = "generation_config.json"
# TransformerConfig fields a loaded model may set freely: how it runs, not what its weights mean
RUN_OPTIONS = ("dropout", "attention")
# HF config fields the model does not use but its users do (transformers' generate stops at
# eos_token_id): from_hf keeps them in TransformerConfig.extra[HF_EXTRA], export_hf writes them
# back, so that a fine-tune's export is not given transformers' class defaults (a Llama's eos=2)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _architecture(config: Mapping[str, Any] | None, src: Source) -> ModuleType:
    if config is not None and "model_type" in config:
        kind = config["model_type"]
        if kind not in ARCHITECTURES:
            raise CheckpointError(f"model_type={kind!r} is not supported by from_hf; supported: "
                                  f"{sorted(ARCHITECTURES)}")
        return ARCHITECTURES[kind]
    keys = src.keys()
    if any(k.endswith("wte.weight") for k in keys):
        return gpt2
    if any(k.endswith("embed_tokens.weight") for k in keys):
        return llama
    raise CheckpointError(f"cannot tell the architecture of weights with keys e.g. {sorted(keys)[:4]}; "
                          f"pass config= (model_type one of {sorted(ARCHITECTURES)})")


def _check_layout(cfg: TransformerConfig, arch: ModuleType) -> None:
    """A model's sizes are fixed by its weights: name the rule to change when one cannot split them."""
    ctx = current()
    for dim, field in arch.FIELDS.items():
        size = cfg.max_length if dim == "positions" else cfg.dim(dim).size
        axes = ctx.rules.axes_of(dim)
        if not axes or any(a not in ctx.mesh for a in axes):
            continue
        axis, n = format_axes(axes), ctx.rules.pieces(dim, ctx.mesh)
        if size % n:
            rule = f"'{dim}:{axis}'"
            raise LayoutError(f"{arch.MODEL_TYPE} dim {dim!r} ({field}={size}) cannot be split over axis "
                              f"{axis!r} of size {n} (rule {rule}): {n} does not divide {size}; drop or "
                              f"change the rule {rule}, or use a mesh whose axis {axis!r} divides {size}")


def _hf_shapes(pieces: Mapping[str, Piece], model: DecoderLM) -> dict[str, list[int]]:
    """The shape each HF tensor must have for ``model``'s parameters to fit in it."""
    sizes = {n: dict(zip(v.shape.names, v.shape.sizes)) for n, v in model.named_mesh_parameters()}
    out: dict[str, list[int]] = {}
    for name, p in pieces.items():
        dims = [p.offsets.get(i, 0) + math.prod(sizes[name][d] for d in g) for i, g in enumerate(p.groups)]
        old = out.get(p.key, [0] * len(dims))
        out[p.key] = [max(a, b) for a, b in zip(old, dims)]
    return out


# the type of each HF config field a DecoderLM is built from (GPT-2's and Llama's names)
_SIZES = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "hidden_size", "intermediate_size",
          "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
_OPTIONAL_SIZES = ("n_inner", "num_key_value_heads", "head_dim")  # null: derived from the others
_NUMBERS = ("layer_norm_epsilon", "rms_norm_eps", "rope_theta")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "scale_attn_by_inverse_layer_idx",
          "scale_attn_weights", "add_cross_attention")
_NAMES = ("model_type", "activation_function", "hidden_act")


def _config_file(cfile: str, must_be: str = "the model's config.json as save_pretrained writes it"
                 ) -> dict[str, Any]:
    """The JSON object in ``cfile``; a ``CheckpointError`` saying it ``must_be`` where it is none."""
    try:
        with open(cfile) as f:
            config = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{cfile} is not valid JSON ({e}); it must be {must_be}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfile} holds a JSON {type(config).__name__}, not an object; it must be "
                              f"{must_be}")
    return config


def _check_types(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config field of the wrong type (``"hidden_size": "4096"``) by name, before it
    meets arithmetic deep inside the model."""

    def bad(field: str, want: str, example: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field} is {config[field]!r} ({type(config[field]).__name__}), "
                               f"it must be {want}, e.g. \"{field}\": {example}; fix the file")

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    for field in _SIZES + _OPTIONAL_SIZES:
        optional = field in _OPTIONAL_SIZES and config.get(field) is None
        if field in config and not (whole(config[field]) or optional):
            raise bad(field, "a whole number > 0" + (" or null" if field in _OPTIONAL_SIZES else ""), "64")
    for field in _NUMBERS:
        x = config.get(field, 1.0)
        if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0):
            raise bad(field, "a finite number > 0", "1e-05")
    for field in _FLAGS:
        if field in config and not isinstance(config[field], bool):
            raise bad(field, "true or false", "true")
    for field in _NAMES:
        if field in config and not isinstance(config[field], str):
            raise bad(field, "a string", '"gelu"')
    for field in ("rope_parameters", "rope_scaling"):
        if config.get(field) is not None and not isinstance(config[field], dict):
            raise bad(field, "an object or null", '{"rope_type": "default", "rope_theta": 10000.0}')


def _check_directory(path: str) -> None:
    """Name what a directory that from_hf cannot read is, and what to do with it."""
    if not os.path.exists(path):
        raise CheckpointError(f"from_hf: no such directory {path!r}; pass a directory save_pretrained wrote "
                              "(config.json + model.safetensors), or a model object")
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, f)) for f in (SINGLE, HF_INDEX)):
        return
    names = sorted(os.listdir(path))
    pickles = [f for f in names if f.startswith("pytorch_model") and f.endswith(".bin")]
    if not pickles:  # nothing transformers could re-save either: say what is there instead
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} entries)" if len(names) > 6 else "")
        raise CheckpointError(f"{path!r} holds no model weights (no {SINGLE}, {HF_INDEX} or pytorch_model"
                              f"*.bin; {f'it holds {shown}' if names else 'it is empty'}): pass the "
                              f"directory save_pretrained wrote ({CONFIG} + {SINGLE}), or a model object")
    raise CheckpointError(f"{path!r} holds {pickles[0]} (a PyTorch pickle), and from_hf reads safetensors "
                          "only: load it with transformers and re-save it, "
                          "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path) (which writes "
                          f"{SINGLE}), or pass that model object to from_hf")


def _read(source: Any, config: Any, heads: int | None) -> tuple[ModuleType, TransformerConfig, Source]:
    """The architecture, our config and the weights of ``source`` (see :func:`from_hf`)."""
    where, path = "the config", None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        _check_directory(path)
        cfile = os.path.join(path, CONFIG)
        if config is None and os.path.isfile(cfile):
            config, where = _config_file(cfile), cfile
        src = Source.of(path)
    elif isinstance(source, Mapping):
        src = Source.of(source)
    else:
        src = Source.of(source.state_dict())
        config = getattr(source, "config", None) if config is None else config
    hf_config = config_dict(config)
    if hf_config is not None:
        _check_types(hf_config, where)
    arch = _architecture(hf_config, src)
    src.strip = arch.PREFIX
    if hf_config is None and path is not None and arch is llama:
        raise CheckpointError(f"{path!r} has no {CONFIG}, where alone a Llama records num_attention_heads, "
                              f"num_key_value_heads and rope_theta: put the model's {CONFIG} beside its "
                              "weights, or pass config=")
    named = arch.FIELDS["heads"]
    if heads is not None and hf_config is not None and hf_config.get(named, heads) != heads:
        raise CheckpointError(f"from_hf(heads={heads}) but {where} has {named}={hf_config[named]}: the "
                              "weights were made for the config's heads; drop heads= (it is for a GPT-2 "
                              "state dict without a config)")
    cfg = arch.config_from_hf(hf_config, src, heads)
    if not cfg.tie_embeddings and not src.has(arch.HEAD):
        raise CheckpointError(f"{where} has tie_word_embeddings=False, so the output layer is its own "
                              f"weight {arch.HEAD!r}, which {src.where} lacks (a bare {arch.BARE_CLASS} "
                              f"holds none); pass the {arch.LM_CLASS}, its state dict or its directory")
    kept = {k: hf_config[k] for k in TOKEN_IDS if hf_config is not None and hf_config.get(k) is not None}
    kept.update(_generation_ids(source, path))
    if kept:
        cfg = dataclasses.replace(cfg, extra={**cfg.extra, HF_EXTRA: kept})
    return arch, cfg, src


def _generation_ids(source: Any, path: str | None) -> dict[str, int | list[int]]:
    """The token ids (:data:`TOKEN_IDS`) transformers' ``generate`` takes before config.json's:
    those ``generation_config.json`` beside it names (a directory), or the model object's
    ``generation_config`` (which transformers loaded from that file); only the fields it names,
    not null (a file without ``eos_token_id`` leaves config.json's, where transformers' generate
    would not stop at all)."""
    if path is not None:
        gfile = os.path.join(path, GENERATION_CONFIG)
        if not os.path.isfile(gfile):
            return {}
        generation = _config_file(gfile, "transformers' generation config as save_pretrained writes it "
                                         "(read for its token ids), or be removed")
        where = gfile
    else:
        config = getattr(source, "generation_config", None)
        generation = {k: getattr(config, k, None) for k in TOKEN_IDS}
        where = f"{type(source).__name__}.generation_config"
    out: dict[str, int | list[int]] = {}
    for name in TOKEN_IDS:
        value = generation.get(name)
        if value is None:
            continue
        one = isinstance(value, int) and not isinstance(value, bool)
        many = name == "eos_token_id"  # (one id or a list: Llama 3 lists its end-of-turn ids)
        if not (one or many and isinstance(value, list) and value
                and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
            shape = "a token id or a list of them" if many else "a token id"
            example = "[128001, 128009]" if many else "0"
            raise CheckpointError(f"{where}: {name} is {value!r}; it must be {shape}, e.g. "
                                  f'"{name}": {example}; fix it or remove the field')
        out[name] = value if one else list(value)
    return out


def hf_config(path: str | os.PathLike) -> tuple[str, TransformerConfig, dict[str, str]]:
    """What :func:`from_hf` would build from the directory ``path``, without building it: the
    ``model_type``, our :class:`TransformerConfig`, and for each of its fields the HF config
    field that sets it (for messages).

    Example:
        >>> import tempfile, meshtorch as mt
        >>> from meshtorch.models import DecoderLM, TransformerConfig, export_hf, hf_config
        >>> path = tempfile.mkdtemp()
        >>> cfg = TransformerConfig(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8,
        ...                         bias=True)
        >>> _ = mt.launch(lambda: export_hf(path, DecoderLM(cfg)))
        >>> kind, back, fields = hf_config(path)
        >>> kind, back.d_model, fields["d_model"]
        ('gpt2', 8, 'n_embd')
    """
    cfile = os.path.join(os.fspath(path), CONFIG)
    if os.path.isfile(cfile):
        config = _config_file(cfile)
        _check_types(config, cfile)
        if config.get("model_type") == llama.MODEL_TYPE:
            # a Llama config.json records every size: read it alone, so that a directory holding only
            # it plans (meshtorch plan --init-from); GPT-2's sizes come from its weights' shapes
            return llama.MODEL_TYPE, llama.config_from_hf(config), dict(llama.CONFIG_FIELDS)
    arch, cfg, _ = _read(path, None, None)
    return arch.MODEL_TYPE, cfg, dict(arch.CONFIG_FIELDS)


def from_hf(source: Any, *, config: Any = None, heads: int | None = None,
            options: Mapping[str, Any] | None = None) -> DecoderLM:
    """A :class:`DecoderLM` holding a Hugging Face causal LM's weights (GPT-2 or Llama family),
    laid out by the current rules.

    Call it inside the SPMD program (``mt.launch``) or on one processor; each
    processor reads only its slices. Its logits equal the HF model's (in eval
    mode) up to float rounding.

    Args:
        source: a directory written by ``save_pretrained`` (``config.json`` and
            safetensors, sharded or not), a ``GPT2LMHeadModel`` / ``LlamaForCausalLM``
            (or, with tied embeddings, their bare ``*Model``), or a state dict of one.
        config: the HF config (object or dict); by default from the directory or the
            model object. A GPT-2 state dict without one has its sizes inferred
            (see :func:`meshtorch.models.gpt2.gpt2_config`).
        heads: number of attention heads, for a GPT-2 state dict without config
            (default ``d_model / 64``); one that contradicts the config is an error.
        options: :class:`TransformerConfig` fields that do not change what the weights
            compute, to set on the model (:data:`RUN_OPTIONS`: ``dropout``, ``attention``).

    Parameters are float32 (whatever the source dtype); train or run in bf16
    with :func:`meshtorch.autocast`. The config's token ids (:data:`TOKEN_IDS`) are kept in
    ``model.cfg.extra`` for :func:`export_hf` and generation; each is the one a directory's
    ``generation_config.json`` (a model object's ``generation_config``) names where it names one,
    as transformers' ``generate`` takes them (an instruct model's end-of-turn ids), also over a
    ``config=`` given.

    Every processor reads the files itself (each host its own copy), and they agree before
    going on: where one fails (a missing or unreadable file, a bad config), every processor
    raises (it its own error, the others a :class:`CheckpointError` naming it), and a config
    that differs between processors is refused on all of them, naming the field.

    Raises:
        LayoutError: the rules split a dim its axis does not divide (e.g. ``n_head=12``
            over an axis of size 5), naming the rule to change.
        CheckpointError: a weight or config.json is missing, or the config is not one
            DecoderLM can express (named), or processors read different configs.
    """
    what = repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else type(source).__name__
    arch = cfg = src = error = None
    try:
        arch, cfg, src = _read(source, config, heads)
        if options:
            bad = sorted(set(options) - set(RUN_OPTIONS))
            if bad:
                raise CheckpointError(f"from_hf options {bad} would change the weights' meaning; only "
                                      f"{list(RUN_OPTIONS)} may be set")
            cfg = dataclasses.replace(cfg, **options)
        _check_layout(cfg, arch)
    except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
        error = e
    _agree(error, f"from_hf({what}) failed on {{why}}; no model was built")
    _same_config(cfg, what)
    model = None
    try:  # (building the model too: a processor out of memory there must not leave the others waiting)
        model = DecoderLM(cfg)
        pieces = arch.pieces(cfg)
        for key, shape in _hf_shapes(pieces, model).items():
            if list(src.shape(key)) != shape:
                raise CheckpointError(f"{arch.MODEL_TYPE} weight {key!r} has shape {list(src.shape(key))}, "
                                      f"the config needs {shape}; are the config and the weights from one "
                                      "model?")
        coords = current().coords
        with torch.no_grad():
            for name, view in model.named_mesh_parameters():
                sizes = dict(zip(view.shape.names, view.shape.sizes))
                region = dict(zip(view.shape.names, view.layout.slices(coords)))
                view.local.copy_(read_slice(src, pieces[name], sizes, region).to(view.dtype))
    except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
        error = e
    _agree(error, f"from_hf({what}): reading the weights failed on {{why}}; no model was returned")
    _check_finite(model, pieces, src)
    return model


def _agree(error: BaseException | None, message: str) -> None:
    """:func:`meshtorch.checkpoint.writer.agree` (every processor raises where one failed), but on
    the meta backend, where this processor runs alone, its own error only."""
    if current().comm.backend == "meta":
        if error is not None:
            raise error
        return
    agree(error, message)


def _same_config(cfg: TransformerConfig, what: str) -> None:
    """Refuse, on every processor, configs that differ between processors (each read its own
    copy of the files): their models would compute differently, silently."""
    comm = current().comm
    if comm.mesh.size == 1 or comm.backend == "meta":
        return
    texts = all_texts(comm, json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str))
    other = next((r for r, t in enumerate(texts) if t != texts[0]), None)
    if other is None:
        return
    first, theirs = json.loads(texts[0]), json.loads(texts[other])
    field = next(k for k in first if first[k] != theirs.get(k))
    raise CheckpointError(f"from_hf({what}): the processors read different configs, {field}="
                          f"{first[field]!r} on processor 0 and {theirs[field]!r} on processor {other}: "
                          "each reads the files itself, so every host needs the same copy of them")


def _check_finite(model: DecoderLM, pieces: Mapping[str, Piece], src: Source) -> None:
    """Refuse weights holding NaN or infinity at load, naming them: training from them fails at
    its first step with a NaN loss that looks like the learning rate's fault. Every processor
    checks its slices; one all_reduce makes them all raise alike."""
    views = [(name, view.local) for name, view in model.named_mesh_parameters() if not view.local.is_meta]
    if not views:
        return
    bad = torch.stack([~torch.isfinite(t).all() for _, t in views]).to(torch.float64)
    comm = current().comm
    bad = comm.all_reduce(bad, comm.mesh.axis_names, "sum")  # per weight: every processor names them all
    if bad.sum().item():
        keys = [pieces[name].key for (name, _), n in zip(views, bad.tolist()) if n]
        here = f" ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})"
        raise CheckpointError(f"the weights in {src.where} hold NaN or infinity{here}; a model cannot train "
                              "or run from them: re-export or re-download the model")


def train_flags(cfg: TransformerConfig, arch: ModuleType) -> list[str]:
    """The ``meshtorch train`` flags that make ``cfg`` a model of ``arch`` (:data:`ARCHITECTURES`),
    for the export error: each field of ``arch.WANT`` that differs, as its flag (the recipe's
    flags are the config's fields, ``--d-kv`` for ``d_kv``; experts and encoder blocks come from
    ``--model``), and GPT-2's shape (no grouped-query attention, ``heads · d_kv = d_model``).

    Example:
        >>> from meshtorch.models import TransformerConfig, gpt2, llama
        >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
        >>> train_flags(cfg, gpt2), train_flags(cfg, llama)
        (['--bias'], ['--positions rotary', '--norm rms', '--gated'])
    """
    flags: list[str] = []
    for field, want in arch.WANT.items():
        if getattr(cfg, field) == want:
            continue
        if field in ("experts", "encoder_layers"):  # --model moe / seq2seq made them
            flag = "--model lm"
        elif isinstance(want, bool):
            flag = f"--{'' if want else 'no-'}{field.replace('_', '-')}"
        else:
            flag = f"--{field.replace('_', '-')} {want}"
        if flag not in flags:
            flags.append(flag)
    if arch is gpt2:
        if cfg.grouped:
            flags.append("--kv-heads 0")
        if cfg.heads * cfg.d_kv != cfg.d_model:
            flags.append(f"--d-kv {cfg.d_model // cfg.heads}" if cfg.d_model % cfg.heads == 0 else
                         f"--heads and --d-kv whose product is --d-model {cfg.d_model}")
    return flags


def export_hf(path: str | os.PathLike, model: DecoderLM, *, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30,
              token_ids: Mapping[str, int | Sequence[int] | None] | None = None) -> list[str]:
    """Write ``model`` as a Hugging Face directory (``config.json`` + safetensors in HF's names)
    that ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads with equal logits.

    Every processor calls it; processor 0 writes. The architecture is GPT-2 if the
    config is GPT-2's (learned positions, LayerNorm, biases, ungated), else Llama
    (rotary, RMSNorm, gated feed-forward, optional grouped-query attention); any other
    config is an error naming the fields that fit neither. ``dtype`` casts on export;
    above ``max_shard_bytes`` the weights are sharded with an index. Unlike
    :func:`meshtorch.export_hf` (our own names, for :func:`meshtorch.import_hf`),
    this writes the names and layout transformers expects.

    ``config.json``'s ``bos/eos/pad_token_id`` are those the model's config kept from its source
    (:func:`from_hf`), or with ``token_ids`` (a model trained with another tokenizer than its
    source's) those given, the source's all dropped; either way a field the architecture ties to
    the model is the model's (a Llama's ``pad_token_id`` is its ``padding_id``).

    Returns the safetensors file names written (on processor 0; ``[]`` elsewhere).

    Example:
        >>> import json, os, tempfile
        >>> import meshtorch as mt
        >>> from meshtorch.models import DecoderLM, TransformerConfig, export_hf
        >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8,
        ...                         positions="rotary", norm="rms", gated=True, activation="silu",
        ...                         bias=False, extra={"hf_config": {"bos_token_id": 1, "eos_token_id": 2}})
        >>> out = tempfile.mkdtemp()
        >>> _ = mt.launch(lambda: export_hf(out, DecoderLM(cfg), token_ids={"eos_token_id": 9}))
        >>> config = json.load(open(os.path.join(out, "config.json")))
        >>> config["eos_token_id"], "bos_token_id" in config
        (9, False)
    """
    if not isinstance(model, DecoderLM):
        raise CheckpointError(f"export_hf writes a DecoderLM as a Hugging Face causal LM, got "
                              f"{type(model).__name__}; use mt.export_hf for other modules")
    cfg = model.cfg
    reasons = {kind: arch.misfits(cfg) for kind, arch in ARCHITECTURES.items()}
    kind = next((k for k, r in reasons.items() if not r), None)
    if kind is None:
        why = "; ".join(f"not {k}: {', '.join(r)}" for k, r in reasons.items())
        fixes = " or ".join(f"{' '.join(train_flags(cfg, arch))} for a {k}"
                            for k, arch in ARCHITECTURES.items())
        raise CheckpointError(f"this model has no Hugging Face architecture to export to ({why}); a "
                              f"meshtorch train run with {fixes} makes one (train it again with them)")
    arch = ARCHITECTURES[kind]
    config = arch.config_to_hf(cfg)
    # a token id the architecture has a field for is the model's (a Llama's pad_token_id is its
    # padding_id); the source's ids kept in extra fill in only the others (bos, eos; GPT-2's pad)
    kept = cfg.extra.get(HF_EXTRA, {}) if token_ids is None else _token_ids(token_ids, config, arch)
    rank0 = current().rank == 0
    params = {}
    with torch.no_grad():
        for name, view in model.named_mesh_parameters():
            full = view.detach().to_global()  # every processor takes part in the gather
            if rank0:
                params[name] = (list(view.shape.names), full.to(dtype) if dtype is not None else full)
    tensors = assemble(arch.pieces(cfg), params) if rank0 else {}
    config.update({k: v for k, v in kept.items() if k in TOKEN_IDS and k not in arch.CONFIG_FIELDS.values()})
    raw = kept.get("pad_token_id")
    if isinstance(raw, int) and config.get("pad_token_id") == raw % cfg.vocab:
        config["pad_token_id"] = raw  # spelled as the source spelled it (-1: the last id)
    config["torch_dtype"] = str(dtype or torch.float32).removeprefix("torch.")
    return write_consolidated(path, tensors, max_shard_bytes=max_shard_bytes,
                              files={CONFIG: json.dumps(config, indent=2)})


def _token_ids(token_ids: Mapping[str, int | Sequence[int] | None], config: dict, arch) -> dict:
    """``export_hf``'s ``token_ids``, checked: only :data:`TOKEN_IDS`, and none that contradicts a
    field the architecture ties to the model."""
    unknown = sorted(set(token_ids) - set(TOKEN_IDS))
    if unknown:
        raise ArgumentError(f"export_hf(token_ids=): {', '.join(unknown)} is no token id field; "
                            f"it takes {', '.join(TOKEN_IDS)}")
    for k, v in token_ids.items():
        if k in arch.CONFIG_FIELDS.values() and v != config.get(k):
            raise ArgumentError(f"export_hf(token_ids={{{k!r}: {v}}}): a {arch.MODEL_TYPE}'s {k} is the "
                                f"model's ({config.get(k)}: its padding_id), which the weights were "
                                f"trained with; leave {k} out")
    return {k: v if v is None or isinstance(v, int) else list(v) for k, v in token_ids.items()}
