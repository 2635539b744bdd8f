"""Text generation from a ``meshtorch train`` checkpoint, on any mesh.

Example:
    $ meshtorch generate --checkpoint runs/20250101-120000 --prompt "import "
    $ meshtorch generate --checkpoint runs/20250101-120000 --prompt "import " --beams 4
"""

from __future__ import annotations

import os

from meshtorch.checkpoint.format import INDEX
from meshtorch.checkpoint.index import read_index
from meshtorch.checkpoint.state import from_json
from meshtorch.checkpoint.versions import POINTER
from meshtorch.data import ByteTokenizer
from meshtorch.errors import CheckpointError
from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate


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


def generate_from_checkpoint(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                             top_k: int = 40, seed: int = 0, mesh: str = "", rules: str = "",
                             beams: int = 0) -> str:
    """Load the LM at ``path`` on ``mesh`` and return ``prompt`` plus its continuation (sampled,
    or with ``beams >= 1`` the best of a beam search of that width)."""
    from meshtorch.checkpoint import load
    from meshtorch.launch import launch

    path = checkpoint_dir(path)
    kind, cfg = model_config(path)
    if kind == "seq2seq":
        raise CheckpointError(f"checkpoint {path!r} is a seq2seq model; generate continues LM text only")
    tok = ByteTokenizer()

    def prog() -> str:
        model = DecoderLM(cfg)
        load(path, model=model, restore_rng_state=False)
        ids = [tok.eos] + tok.encode(prompt)
        if beams:
            new = beam_search(model, [ids], max_new_tokens, beams, limit=tok.eos + 1)[0]
        else:
            new = generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                           limit=tok.eos + 1)[0]
        return tok.decode(ids + new)

    return launch(prog, mesh=mesh, rules=rules)[0]
