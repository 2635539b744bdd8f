"""``meshtorch export``: a ``meshtorch train`` checkpoint as a Hugging Face model directory.

The LM is loaded from the checkpoint and written by
:func:`meshtorch.models.export_hf` (``config.json`` + safetensors in
transformers' names: a Llama for rotary/RMSNorm/gated models, a GPT-2 for
GPT-2-style ones), with the run's ``--tokenizer`` files copied beside it, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
both read the directory. Its ``config.json`` names the run's tokenizer's
token ids (:func:`token_ids`).

Example:
    $ meshtorch train --init-from hf-model --tokenizer hf-model --steps 100 --out run
    $ meshtorch export --checkpoint run --out hf-finetuned
"""

from __future__ import annotations

import os
import shutil

import torch

from meshtorch.data.tokenizer import Tokenizer
from meshtorch.files import replacing
from meshtorch.recipes.lm.generate import (
    checkpoint_dir,
    has_init_froms_tokenizer,
    init_from_of,
    load_lm,
    run_tokenizer,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model")


def token_ids(path: str, tok: Tokenizer) -> dict[str, int | None] | None:
    """The ``bos/eos_token_id`` the export of checkpoint ``path`` writes (``export_hf``'s
    ``token_ids``), the ids ``meshtorch generate`` stops at on that run (:func:`run_eos
    <meshtorch.recipes.lm.generate.run_eos>`): ``None``, those ``--init-from``'s ``config.json``
    (or ``generation_config.json``) named, for a fine-tune with that model's own tokenizer; for a
    fine-tune with another tokenizer (``--tokenizer bytes`` or ``bpe:N``) its end-of-text id
    ``tok.eos`` for both, as GPT-2's ``<|endoftext|>`` is (the config's ids are another
    vocabulary's); for a run from scratch none, written as ``null`` (its samples run their length;
    without the fields transformers would take its class defaults, a Llama's 1 and 2: two bytes)."""
    if has_init_froms_tokenizer(path):
        return None
    if not init_from_of(path):
        return {"bos_token_id": None, "eos_token_id": None}
    return {"bos_token_id": tok.eos, "eos_token_id": tok.eos}


def export_checkpoint(path: str, out: str, dtype: torch.dtype | None = None) -> list[str]:
    """Write the LM of checkpoint ``path`` (a run directory or its checkpoint/) to ``out`` as a
    Hugging Face directory; the names of the files written."""
    from meshtorch.launcher import launch
    from meshtorch.models import export_hf

    path = checkpoint_dir(path)
    tok = run_tokenizer(path)

    def prog() -> list[str]:
        return export_hf(out, load_lm(path), dtype=dtype, token_ids=token_ids(path, tok))

    written = launch(prog)[0] + ["config.json"]
    where = getattr(tok, "path", None)
    if where:
        src = where if os.path.isdir(where) else os.path.dirname(where)
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, f)):
                with replacing(os.path.join(out, f)) as tmp:
                    shutil.copyfile(os.path.join(src, f), tmp)
                written.append(f)
    return written
