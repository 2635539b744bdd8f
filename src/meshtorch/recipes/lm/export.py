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
from meshtorch.recipes.lm.generate import checkpoint_dir, has_init_froms_tokenizer, load_lm, run_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model")


def token_ids(path: str, tok: Tokenizer) -> dict[str, int] | None:
    """The ``bos/eos_token_id`` the export of checkpoint ``path`` writes (``export_hf``'s
    ``token_ids``): ``None``, those ``--init-from``'s ``config.json`` named, for a fine-tune with
    that model's own tokenizer; else (another tokenizer: ``--tokenizer bytes`` or ``bpe:N``, or a
    run from scratch) the run's tokenizer ``tok``'s end-of-text id for both, as GPT-2's
    ``<|endoftext|>`` is: it ends each text the run trained on and starts the next (the config's ids
    are another vocabulary's, or transformers' class defaults: a Llama's 1 and 2, two bytes)."""
    if has_init_froms_tokenizer(path):
        return None
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
