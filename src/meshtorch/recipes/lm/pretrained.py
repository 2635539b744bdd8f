"""``--init-from DIR`` and ``--tokenizer DIR``: fine-tune a Hugging Face model with its tokenizer.

With ``--init-from`` the model's architecture is the directory's
``config.json`` (read by :func:`meshtorch.models.hf_config`): the model flags
take its values, and a model flag set to something else is an error naming the
flag and the config field. Only ``--dropout`` and ``--attention``, which do not
change what the weights compute, stay free. The vocabulary is the model's; the
tokenizer (``--tokenizer``, else bytes) must fit in it.

Example:
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.pretrained import model_vocab, tokenizer_of
    >>> cfg = TrainConfig.of(tokenizer="bytes")
    >>> tok = tokenizer_of(cfg)
    >>> tok.name, model_vocab(cfg, tok)
    ('bytes', 264)
"""

from __future__ import annotations

import dataclasses
import json
import os

from meshtorch.data import ByteTokenizer
from meshtorch.data.corpus import DataError
from meshtorch.data.tokenizer import Tokenizer
from meshtorch.errors import ArgumentError
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.models.hf import RUN_OPTIONS
from meshtorch.recipes.lm.config import ModelSection, TrainConfig
from meshtorch.recipes.lm.run_files import TOKENIZER_DIR, keep_tokenizer, kept_on_resume, resumed_tokenizer

AUTO_BPE = 2048  # ids of the BPE that --tokenizer auto fits: measured best for the ~1 minute default run


def _hf(path: str) -> tuple:
    from meshtorch.models import hf_config

    if not os.path.isdir(path):
        raise ArgumentError(f"--init-from {path!r} is not a directory; pass a Hugging Face model "
                            "directory (config.json + safetensors, as save_pretrained writes)")
    return hf_config(path)


def with_pretrained_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its model flags set from ``--init-from``'s ``config.json`` (``cfg`` itself
    without ``--init-from``); a model flag that the config contradicts is an :class:`ArgumentError`."""
    path = cfg.run.init_from
    if not path:
        return cfg
    if cfg.model.name != "lm":
        raise ArgumentError(f"--init-from loads a decoder-only LM; got --model {cfg.model.name!r} "
                            "(drop --model or pass --model lm)")
    kind, hf, fields = _hf(path)
    defaults, wanted = ModelSection(), {}
    kept = kept_on_resume(cfg, hf)  # what a resumed run keeps as it trained it (resume_note says so)
    for f in dataclasses.fields(ModelSection):
        if f.name not in fields or f.name in RUN_OPTIONS:
            continue
        theirs, mine = getattr(hf, f.name), getattr(cfg.model, f.name)
        if mine != getattr(defaults, f.name) and mine != theirs:
            flag = "--" + f.name.replace("_", "-")
            field = fields.get(f.name, "model_type")
            raise ArgumentError(f"{flag} {mine!r} conflicts with --init-from {path!r}: its config.json "
                                f"({kind}) has {field} -> {f.name}={theirs!r}; drop {flag}, the model's "
                                "architecture comes from --init-from")
        wanted[f.name] = kept[f.name][0] if f.name in kept else theirs
    if cfg.run.length > hf.max_length:
        # learned positions have no row past the table; rotary ones would, but the model (and its
        # KV cache) is built for max_position_embeddings, which the run keeps for its export
        more = "" if hf.positions == "learned" else (
            f", or raise {fields['max_length']} in its config.json to train on longer sequences")
        raise ArgumentError(f"--length {cfg.run.length} is longer than the {hf.max_length} positions of "
                            f"--init-from {path!r} ({fields['max_length']}={hf.max_length}); pass --length "
                            f"{hf.max_length} or less{more}")
    return cfg.replace(**wanted)


def pretrained_model(cfg: TrainConfig, model: TransformerConfig) -> DecoderLM:
    """``--init-from``'s model (``from_hf``), with ``model``'s run options (dropout, attention) and
    the padding id a resumed run keeps (:func:`~meshtorch.recipes.lm.run_files.kept_on_resume`): on
    this processor, inside the run's launch."""
    from meshtorch.models import from_hf
    from meshtorch.models.hf import CONFIG

    path, config = cfg.run.init_from, None
    if model.padding_id != _hf(path)[1].padding_id:  # kept: the config read with the run's pad id
        with open(os.path.join(path, CONFIG)) as f:
            config = {**json.load(f), "pad_token_id": model.padding_id if model.padding_id >= 0 else None}
    return from_hf(path, config=config, options={o: getattr(model, o) for o in RUN_OPTIONS})


def resolve_tokenizer(cfg: TrainConfig, out: str, fit: bool = True) -> TrainConfig:
    """``cfg`` with ``--tokenizer`` made ``bytes`` or a directory: ``auto`` picks (``--init-from``'s
    own tokenizer when it has one, else bytes; without ``--init-from`` a BPE of 2048 ids when the
    tokenizers library is installed, else bytes), ``bpe:N`` is fitted to the training texts and
    saved in ``out/tokenizer/`` (with ``fit=False``, only named there: another process fitted it).
    A resumed run keeps the tokenizer it was trained with (:func:`resumed_tokenizer`). The tokenizer
    is part of the run: one from elsewhere is copied into ``out/tokenizer/`` (:func:`keep_tokenizer`),
    and the run uses that copy."""
    spec, run = cfg.run.tokenizer, cfg.run
    explicit = spec != "auto" and not spec.startswith("bpe:")
    if explicit and spec != "bytes" and cfg.model.name == "seq2seq":
        raise ArgumentError(f"--tokenizer {spec!r}: --model seq2seq spells numbers in bytes; drop "
                            "--tokenizer")
    if cfg.model.name == "seq2seq":
        return cfg.replace(tokenizer="bytes")
    if run.resume:
        return cfg.replace(tokenizer=keep_tokenizer(resumed_tokenizer(cfg), out, write=fit))
    if explicit:
        return cfg.replace(tokenizer=keep_tokenizer(spec, out, write=fit))
    if spec == "auto":
        if run.init_from:
            own = os.path.isfile(os.path.join(run.init_from, "tokenizer.json"))
            if not own:
                return cfg.replace(tokenizer="bytes")
            try:
                return cfg.replace(tokenizer=keep_tokenizer(run.init_from, out, write=fit))
            except DataError as e:  # its message names --tokenizer, which this user never passed
                raise DataError(f"--init-from {run.init_from!r}: its tokenizer.json cannot be read ({e}); "
                                "replace it with the model's own, or pass --tokenizer bytes") from None
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            return cfg.replace(tokenizer="bytes")
        spec = f"bpe:{AUTO_BPE}"
    size = bpe_size(spec)
    from meshtorch.data.corpus import train_texts
    from meshtorch.data.hf_tokenizer import train_bpe

    path = os.path.abspath(os.path.join(out, TOKENIZER_DIR))
    if fit:
        train_bpe(train_texts(run.data), size, path)
    return cfg.replace(tokenizer=path)


def resolve_tokenizer_once(cfg: TrainConfig, out: str) -> TrainConfig:
    """:func:`resolve_tokenizer` for every process of a ``torch.distributed`` world (torchrun): processor
    0 fits and writes ``out/tokenizer/``; the others wait for it at a collective, then read the same
    files, so every process encodes with the same ids and no two write the same file. Outside such
    a world (one process, threads) it is :func:`resolve_tokenizer`.

    Example:
        >>> from meshtorch.recipes.lm.config import TrainConfig
        >>> resolve_tokenizer_once(TrainConfig.of(tokenizer="bytes"), "unused").run.tokenizer
        'bytes'
    """
    from meshtorch.context import current

    comm = current().comm
    if comm.mesh.size == 1 or comm.backend != "torch":
        return resolve_tokenizer(cfg, out)
    import torch

    error: BaseException | None = None
    if comm.rank == 0:
        try:
            resolved = resolve_tokenizer(cfg, out)
        except BaseException as e:  # noqa: BLE001 - raised below, after the others are told
            error = e
    failed = comm.all_reduce(torch.tensor([float(error is not None)]), comm.mesh.axis_names, "max").item()
    if error is not None:
        raise error
    if failed:
        raise ArgumentError("processor 0 could not fit or read --tokenizer "
                            f"{cfg.run.tokenizer!r} (its error says why); fix that and rerun")
    return resolved if comm.rank == 0 else resolve_tokenizer(cfg, out, fit=False)


def planned_vocab(cfg: TrainConfig) -> int:
    """The model's vocabulary size before a tokenizer is fitted: at most this (for the checks that
    run before anything is written); :func:`model_vocab` once it is."""
    spec = cfg.run.tokenizer
    if cfg.run.init_from or cfg.model.name == "seq2seq" or not (spec == "auto" or spec.startswith("bpe:")):
        fitted = spec == "auto" or spec.startswith("bpe:")
        return model_vocab(cfg, ByteTokenizer() if fitted else tokenizer_of(cfg))
    size = AUTO_BPE if spec == "auto" else bpe_size(spec)
    return -(-size // 8) * 8


def bpe_size(spec: str) -> int:
    """The number of ids of ``--tokenizer bpe:N``; an :class:`ArgumentError` naming the flag unless N is
    a whole number of at least 260 (256 bytes, end-of-text and merges).

    Example:
        >>> bpe_size("bpe:1024")
        1024
    """
    try:
        size = int(spec.removeprefix("bpe:"))
    except ValueError:
        size = 0
    if size < 260:
        raise ArgumentError(f"--tokenizer {spec!r}: give the BPE's number of ids, at least 260 (256 bytes, "
                            "end-of-text, merges), e.g. bpe:1024")
    return size


def tokenizer_of(cfg: TrainConfig) -> Tokenizer:
    """``--tokenizer``'s tokenizer (after :func:`resolve_tokenizer`): bytes or a Hugging Face one."""
    if cfg.run.tokenizer == "bytes":
        return ByteTokenizer()
    if cfg.run.tokenizer == "auto" or cfg.run.tokenizer.startswith("bpe:"):
        raise ArgumentError(f"--tokenizer {cfg.run.tokenizer!r} is fitted by meshtorch train; pass bytes or "
                            "a directory here")
    from meshtorch.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(cfg.run.tokenizer)


def model_vocab(cfg: TrainConfig, tok: Tokenizer) -> int:
    """The model's vocabulary size: ``--init-from``'s, which the tokenizer's ids must fit in, or
    the tokenizer's (rounded up so mesh axes divide it)."""
    if not cfg.run.init_from:
        return tok.vocab_size
    kind, hf, fields = _hf(cfg.run.init_from)
    if tok.sample_limit > hf.vocab:
        what = "the byte tokenizer" if cfg.run.tokenizer == "bytes" else f"--tokenizer {cfg.run.tokenizer!r}"
        raise ArgumentError(f"{what} has {tok.sample_limit} ids but --init-from {cfg.run.init_from!r} has "
                            f"{fields['vocab']}={hf.vocab}; pass the tokenizer saved with that model "
                            "(--tokenizer DIR)")
    return hf.vocab
