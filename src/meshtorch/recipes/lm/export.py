"""``meshtorch export``: a ``meshtorch train`` checkpoint as a Hugging Face model directory.

The LM is loaded from the checkpoint and written by
:func:`meshtorch.models.export_hf` (``config.json`` + safetensors in
transformers' names: a Llama for rotary/RMSNorm/gated models, a GPT-2 for
GPT-2-style ones), with the run's ``--tokenizer`` files copied beside it, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
both read the directory.

Example:
    $ meshtorch train --init-from hf-model --tokenizer hf-model --steps 100 --out run
    $ meshtorch export --checkpoint run --out hf-finetuned
"""

from __future__ import annotations

import os
import shutil

import torch

from meshtorch.files import replacing
from meshtorch.recipes.lm.generate import checkpoint_dir, load_lm, run_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model")


def export_checkpoint(path: str, out: str, dtype: torch.dtype | None = None) -> list[str]:
    """Write the LM of checkpoint ``path`` (a run directory or its checkpoint/) to ``out`` as a
    Hugging Face directory; the names of the files written."""
    from meshtorch.launcher import launch
    from meshtorch.models import export_hf

    path = checkpoint_dir(path)
    tok = run_tokenizer(path)

    def prog() -> list[str]:
        return export_hf(out, load_lm(path), dtype=dtype)

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
