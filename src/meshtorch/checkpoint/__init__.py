"""Resharding checkpoints (see docs/design.md, Checkpoints) and Hugging Face-style consolidated export.

``mt.save`` / ``mt.load`` write and read a checkpoint path: one directory of
safetensors slices plus ``index.json`` per save, behind the atomically
replaced pointer ``latest`` (:func:`latest` names the directory ``mt.load``
reads); ``mt.save(..., background=True)`` writes the files on a thread while
training goes on, and :func:`wait` waits for it. ``mt.export_consolidated`` /
``mt.import_consolidated`` write and read one consolidated
``model.safetensors`` (sharded with an index when large).

Example:
    >>> import tempfile, os, meshtorch as mt
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2))
    >>> _ = mt.save(path, model=model, step=1, extra={"note": "hi"})
    >>> mt.load(path, model=model)["extra"]
    {'note': 'hi'}
"""

from meshtorch.checkpoint.consolidated import export_consolidated, export_hf, import_consolidated, import_hf
from meshtorch.checkpoint.reader import load
from meshtorch.checkpoint.versions import latest
from meshtorch.checkpoint.writer import save, wait

__all__ = ["save", "wait", "load", "latest", "export_consolidated", "import_consolidated"]
