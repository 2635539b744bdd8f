"""Text generation from a ``meshtorch train`` checkpoint, on any mesh.

Example:
    $ meshtorch generate --checkpoint runs/20250101-120000 --prompt "import "
    $ meshtorch generate --checkpoint runs/20250101-120000 --prompt "import " --beams 4
    $ meshtorch generate --checkpoint runs/llama-fine-tune --prompt "def " --ignore-eos
"""

from __future__ import annotations

import os

from meshtorch.checkpoint.format import INDEX
from meshtorch.checkpoint.index import read_index
from meshtorch.checkpoint.state import from_json
from meshtorch.checkpoint.versions import POINTER
from meshtorch.data import ByteTokenizer
from meshtorch.data.tokenizer import Tokenizer
from meshtorch.errors import CheckpointError
from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate
from meshtorch.models.decode import stop_ids, until_eos


def checkpoint_dir(path: str) -> str:
    """``path`` itself if it is a checkpoint, else its ``checkpoint/`` subdirectory."""
    for d in (path, os.path.join(path, "checkpoint")):
        if any(os.path.exists(os.path.join(d, f)) for f in (POINTER, INDEX)):
            return d
    raise CheckpointError(f"{path!r} holds no checkpoint (no {POINTER} or {INDEX} in it or in its "
                          "checkpoint/); pass the --out directory of a meshtorch train run")


def model_config(path: str) -> tuple[str, TransformerConfig]:
    """The model kind and config a training run stored in its checkpoint."""
    extra = from_json(read_index(path).get("extra")) or {}
    if "model_config" not in extra:
        raise CheckpointError(f"checkpoint {path!r} does not record its model config; it was not written "
                              "by meshtorch train")
    return extra.get("model", "lm"), TransformerConfig.from_dict(extra["model_config"])


def run_tokenizer(path: str) -> Tokenizer:
    """The tokenizer the run of checkpoint ``path`` trained with (its ``--tokenizer``, else bytes)."""
    extra = from_json(read_index(path).get("extra")) or {}
    where = (extra.get("train_config") or {}).get("tokenizer")
    kept = extra.get("tokenizer")  # the run's own copy, in the run directory (wherever it was moved)
    if kept and kept.get("path") in ("bytes", "tokenizer"):  # never a path out of the run directory
        where = kept["path"] if kept["path"] == "bytes" else os.path.join(
            os.path.dirname(os.path.abspath(path)), kept["path"])
    if not where or where == "bytes":
        return ByteTokenizer()
    from meshtorch.data.hf_tokenizer import HFTokenizer

    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer")
    if not os.path.exists(where) and os.path.basename(where) == "tokenizer" and os.path.isdir(beside):
        where = beside  # a BPE fitted by the run, in a run directory that was moved
    if not os.path.exists(where):
        raise CheckpointError(f"checkpoint {path!r} was trained with --tokenizer {where!r}, which is gone; "
                              "put the tokenizer back there")
    return HFTokenizer(where)


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


def generate_from_checkpoint(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                             top_k: int = 40, seed: int = 0, mesh: str = "", rules: str = "",
                             beams: int = 0, ignore_eos: bool = False) -> str:
    """Load the LM at ``path`` on ``mesh`` and return ``prompt`` plus its continuation (sampled,
    or with ``beams >= 1`` the best of a beam search of that width). Sampling ends at the model's
    end-of-sequence id (its eos included) where its config knows one (a fine-tune of a Hugging
    Face model), unless ``ignore_eos``; a beam search runs ``max_new_tokens`` whatever it emits."""
    from meshtorch.launcher import launch

    path = checkpoint_dir(path)
    tok = run_tokenizer(path)

    def prog() -> str:
        model = load_lm(path)
        ids = prompt_ids(tok, prompt)
        if beams:
            new = beam_search(model, [ids], max_new_tokens, beams, limit=tok.sample_limit)[0]
        else:
            new = generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                           limit=tok.sample_limit, ignore_eos=ignore_eos)[0]
            new = until_eos(new, stop_ids(model, ignore_eos=ignore_eos)[0])
        return tok.decode(ids + new)

    return launch(prog, mesh=mesh, rules=rules)[0]
