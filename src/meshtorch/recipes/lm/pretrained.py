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
    >>> cfg = TrainConfig()
    >>> tok = tokenizer_of(cfg)
    >>> tok.name, model_vocab(cfg, tok)
    ('bytes', 264)
"""

from __future__ import annotations

import dataclasses
import os

from meshtorch.data import ByteTokenizer
from meshtorch.data.tokenizer import Tokenizer
from meshtorch.errors import ArgumentError
from meshtorch.models.hf import RUN_OPTIONS
from meshtorch.recipes.lm.config import ModelSection, TrainConfig


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
        wanted[f.name] = theirs
    if hf.positions == "learned" and cfg.run.length > hf.max_length:
        raise ArgumentError(f"--length {cfg.run.length} is longer than the {hf.max_length} positions of "
                            f"--init-from {path!r} ({fields['max_length']}={hf.max_length}); pass --length "
                            f"{hf.max_length} or less")
    return cfg.replace(**wanted)


def tokenizer_of(cfg: TrainConfig) -> Tokenizer:
    """``--tokenizer``'s Hugging Face tokenizer, else bytes."""
    if not cfg.run.tokenizer:
        return ByteTokenizer()
    from meshtorch.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(cfg.run.tokenizer)


def model_vocab(cfg: TrainConfig, tok: Tokenizer) -> int:
    """The model's vocabulary size: ``--init-from``'s, which the tokenizer's ids must fit in, or
    the tokenizer's (rounded up so mesh axes divide it)."""
    if not cfg.run.init_from:
        return tok.vocab_size
    kind, hf, fields = _hf(cfg.run.init_from)
    if tok.sample_limit > hf.vocab:
        what = f"--tokenizer {cfg.run.tokenizer!r}" if cfg.run.tokenizer else "the byte tokenizer"
        raise ArgumentError(f"{what} has {tok.sample_limit} ids but --init-from {cfg.run.init_from!r} has "
                            f"{fields['vocab']}={hf.vocab}; pass the tokenizer saved with that model "
                            "(--tokenizer DIR)")
    return hf.vocab
