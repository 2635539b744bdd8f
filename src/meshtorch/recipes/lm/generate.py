"""Text generation from a ``meshtorch train`` checkpoint, on any mesh.

Example:
    $ meshtorch generate --checkpoint runs/20250101-120000 --prompt "import "
    $ meshtorch generate --checkpoint runs/20250101-120000 --prompt "import " --beams 4
    $ meshtorch generate --checkpoint runs/llama-fine-tune --prompt "def " --ignore-eos
"""

from __future__ import annotations

import math
import os

from meshtorch.checkpoint.format import INDEX
from meshtorch.checkpoint.versions import POINTER
from meshtorch.data import ByteTokenizer
from meshtorch.data.tokenizer import Tokenizer
from meshtorch.errors import ArgumentError, CheckpointError
from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate
from meshtorch.models.decode import room, stop_ids, until_eos
from meshtorch.recipes.lm.guards import checkpoint_extra
from meshtorch.recipes.lm.run_files import TOKENIZER_DIR, is_init_froms_tokenizer, sample_eos


def checkpoint_dir(path: str) -> str:
    """``path`` itself if it is a checkpoint (a run's ``checkpoint/``, or one version in it), else its
    ``checkpoint/`` subdirectory."""
    for d in (path, os.path.join(path, "checkpoint")):
        if any(os.path.exists(os.path.join(d, f)) for f in (POINTER, INDEX)):
            return d
    raise CheckpointError(f"{path!r} holds no checkpoint (no {POINTER} or {INDEX} in it or in its "
                          "checkpoint/); pass the --out directory of a meshtorch train run")


def run_directory(path: str) -> str:
    """The run directory of checkpoint ``path``: the parent of the run's ``checkpoint/``, which is
    ``path`` itself or, for one version of it (``checkpoint/step-000200``), ``path``'s parent.

    Example:
        >>> run_directory("runs/a/checkpoint") == os.path.abspath("runs/a")
        True
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.exists(os.path.join(path, POINTER)) and os.path.exists(os.path.join(parent, POINTER)):
        path = parent
    return os.path.dirname(path)


def model_config(path: str) -> tuple[str, TransformerConfig]:
    """The model kind and config a training run stored in its checkpoint."""
    extra = checkpoint_extra(path)
    if "model_config" not in extra:
        raise CheckpointError(f"checkpoint {path!r} does not record its model config; it was not written "
                              "by meshtorch train")
    return extra.get("model", "lm"), TransformerConfig.from_dict(extra["model_config"])


def run_tokenizer(path: str) -> Tokenizer:
    """The tokenizer the run of checkpoint ``path`` trained with (its ``--tokenizer``, else bytes)."""
    extra = checkpoint_extra(path)
    where = (extra.get("train_config") or {}).get("tokenizer")
    kept = extra.get("tokenizer")  # the run's own copy, in the run directory (wherever it was moved)
    if kept and kept.get("path") in ("bytes", "tokenizer"):  # never a path out of the run directory
        where = kept["path"] if kept["path"] == "bytes" else os.path.join(run_directory(path), kept["path"])
    if not where or where == "bytes":
        return ByteTokenizer()
    from meshtorch.data.hf_tokenizer import HFTokenizer

    beside = os.path.join(run_directory(path), "tokenizer")
    if not os.path.exists(where) and os.path.basename(where) == "tokenizer" and os.path.isdir(beside):
        where = beside  # a BPE fitted by the run, in a run directory that was moved
    if not os.path.exists(where):
        raise CheckpointError(f"checkpoint {path!r} was trained with --tokenizer {where!r}, which is gone; "
                              "put the tokenizer back there")
    return HFTokenizer(where)


def run_eos(path: str, model: DecoderLM, tok: Tokenizer) -> list[int] | None:
    """The ``eos=`` the run of checkpoint ``path`` samples with (:func:`run_files.sample_eos
    <meshtorch.recipes.lm.run_files.sample_eos>`): its tokenizer's end-of-text id for a fine-tune
    with another tokenizer than ``--init-from``'s, else ``None`` (the model config's eos ids)."""
    return sample_eos(model, tok, init_from_of(path), has_init_froms_tokenizer(path))


def init_from_of(path: str) -> str:
    """The ``--init-from`` the run of checkpoint ``path`` started from ("" for a run from scratch)."""
    return _init_from(checkpoint_extra(path))


def _init_from(extra: dict) -> str:
    return (extra.get("train_config") or {}).get("init_from") or ""


def has_init_froms_tokenizer(path: str) -> bool:
    """Whether the run of checkpoint ``path`` is a fine-tune that trained with ``--init-from``'s own
    tokenizer, so that the token ids its ``config.json`` names (kept in the model config) are the
    run's tokenizer's (false for a run from scratch). A checkpoint from before the run recorded
    which tokenizer it had is told by comparing the tokenizers, where ``--init-from`` is still
    there (else the config's ids are taken for the run's unless it trained on bytes, as then)."""
    extra = checkpoint_extra(path)
    init_from = _init_from(extra)
    if not init_from:
        return False
    kept = extra.get("tokenizer") or {}
    own = kept.get("init_from")
    if own is None:
        if kept.get("path") == "bytes" or not os.path.isdir(init_from):
            own = kept.get("path") != "bytes"
        else:
            tokenizer = os.path.join(run_directory(path), TOKENIZER_DIR)
            own = os.path.isdir(tokenizer) and is_init_froms_tokenizer(init_from, tokenizer)
    return bool(own)


def prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids a sample starts from: end-of-text, then ``prompt``. With a BPE, ``prompt``'s trailing
    spaces are left to the model: its words' tokens carry their leading space (``" name"``), so
    a prompt ending in a lone space token starts it where the training text never was.

    Example:
        >>> from meshtorch.data import ByteTokenizer
        >>> prompt_ids(ByteTokenizer(), "def ")[1:]
        [100, 101, 102, 32]
    """
    text = prompt if tok.name == "bytes" else prompt.rstrip(" ") or prompt
    return [tok.eos] + tok.encode(text)


def load_lm(path: str) -> DecoderLM:
    """The LM of checkpoint ``path`` (a run directory or its checkpoint/), on the current mesh."""
    from meshtorch.checkpoint import load

    path = checkpoint_dir(path)
    kind, cfg = model_config(path)
    if kind == "seq2seq":
        raise CheckpointError(f"checkpoint {path!r} is a seq2seq model; only LM checkpoints hold a DecoderLM")
    model = DecoderLM(cfg)
    # strict=False: a 2BW run's checkpoint also holds W(t-1) (model/previous.*); the model is built
    # from the run's own config, so the rest are its tensors
    load(path, model=model, restore_rng_state=False, strict=False)
    return model


def check_request(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int = 40, beams: int = 0) -> int:
    """Raise :class:`ArgumentError` naming the ``meshtorch generate`` flag unless the request can run
    on the LM of checkpoint ``path``; the number of tokens it will add: ``max_new_tokens``, or fewer
    where the model's context (``max_length``: its run's ``--length``, or ``config.json``'s for
    ``--init-from``) ends first (:func:`~meshtorch.models.decode.room`).
    A prompt that leaves no room is refused, rather than answered with the prompt alone."""
    for flag, value in (("--tokens", max_new_tokens), ("--top-k", top_k), ("--beams", beams)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArgumentError(f"{flag} {value!r} is out of range: it must be a whole number >= 0")
    if not 0 <= temperature < math.inf:  # nan too
        raise ArgumentError(f"--temperature {temperature!r} is out of range: it must be >= 0 (0: greedy)")
    path = checkpoint_dir(path)
    kind, cfg = model_config(path)
    if kind == "seq2seq":
        raise CheckpointError(f"checkpoint {path!r} is of a --model seq2seq run, which spells numbers (its "
                              "run prints its held-out exact match); meshtorch generate continues text "
                              "with the LM of a --model lm or moe run")
    tok = run_tokenizer(path)
    if beams > tok.sample_limit:
        raise ArgumentError(f"--beams {beams} exceeds the {tok.sample_limit} tokens the model may emit: "
                            f"pass --beams {tok.sample_limit} or fewer")
    n = len(prompt_ids(tok, prompt))
    if room(cfg.max_length, n) == 0:
        raise ArgumentError(f"--prompt is {n - 1} tokens (plus the end-of-text token that starts it), more "
                            f"than the model's context of {cfg.max_length} positions holds (max_length: the "
                            f"run's --length, or config.json's for --init-from): shorten it to at most "
                            f"{cfg.max_length - 1} tokens")
    return min(max_new_tokens, room(cfg.max_length, n))


def generate_from_checkpoint(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                             top_k: int = 40, seed: int = 0, mesh: str = "", rules: str = "",
                             beams: int = 0, ignore_eos: bool = False, checked: bool = False) -> str:
    """Load the LM at ``path`` on ``mesh`` and return ``prompt`` plus its continuation (sampled,
    or with ``beams >= 1`` the best of a beam search of that width). Both end at the model's
    end-of-sequence id (its eos included) where its config knows one (a fine-tune of a Hugging
    Face model with that model's tokenizer; with another, ``--tokenizer bytes`` or ``bpe:N``, at
    that tokenizer's end-of-text id: :func:`run_eos`), unless ``ignore_eos``: a beam search keeps
    the hypotheses that end there, as transformers' ``generate(num_beams=)`` does. Of
    ``max_new_tokens`` it writes fewer where the model's context ends (:func:`check_request` says
    how many). ``checked``: the caller has passed the request through :func:`check_request` already
    (``meshtorch generate`` does, to say how many tokens it writes), which reads the checkpoint's
    config and tokenizer: it is not checked again."""
    from meshtorch.launcher import launch

    if not checked:
        check_request(path, prompt, max_new_tokens, temperature, top_k, beams)
    path = checkpoint_dir(path)
    tok = run_tokenizer(path)

    def prog() -> str:
        model = load_lm(path)
        ids = prompt_ids(tok, prompt)
        eos = run_eos(path, model, tok)
        if beams:
            new = beam_search(model, [ids], max_new_tokens, beams, limit=tok.sample_limit, eos=eos,
                              ignore_eos=ignore_eos)[0]
        else:
            new = generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                           limit=tok.sample_limit, eos=eos, ignore_eos=ignore_eos)[0]
        return tok.decode(ids + until_eos(new, stop_ids(model, eos, ignore_eos)[0]))

    return launch(prog, mesh=mesh, rules=rules)[0]
