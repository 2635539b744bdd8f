"""The on-disk format of a checkpoint directory (see docs/design.md, Checkpoints).

::

    ckpt/
      latest                       # the pointer: which step directories are kept, newest first
      step-000300/                 # one complete checkpoint per save
        index.json                 # shapes, dims, pieces, per-file sha256, step, RNG, data, own sha256
        slices-00000.safetensors   # the pieces processor 0 wrote
        slices-00003.safetensors   # ... one file per processor that owns a region
      step-000200/

A tensor is stored as *pieces*: each processor whose coordinate is 0 along
every axis the tensor is replicated on writes its slice once, under the key
``"<tensor>@<start>,<start>,..."``. The index lists each piece's file, key,
start and size, so a loader on any mesh reads only the overlap with its slice.

Example:
    >>> from meshtorch.checkpoint.format import piece_key, overlap
    >>> piece_key("model/0.kernel", (0, 4))
    'model/0.kernel@0,4'
    >>> overlap((0, 4), (4, 4), (2, 0), (4, 8))
    ((2, 4), (4, 8))
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch

from meshtorch.shape import Shape

INDEX = "index.json"
FORMAT = "meshtorch-checkpoint"
# version 2: the index records its own sha256 (``index_sha256``); version 1 indexes load without it
# version 3: each processor's own data position (``data_per_processor``), where they differ; an index
# without them is still written as version 2, which meshtorch before version 3 reads alike
VERSION = 3
SHARED_DATA_VERSION = 2

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slice_file(rank: int) -> str:
    return f"slices-{rank:05d}.safetensors"


def piece_key(tensor: str, start: Sequence[int]) -> str:
    return f"{tensor}@{','.join(str(s) for s in start)}"


def shape_json(shape: Shape) -> list[list]:
    return [[d.name, d.size] for d in shape]


def shape_from_json(dims: list) -> Shape:
    return Shape([(n, int(s)) for n, s in dims])


def overlap(a_start, a_size, b_start, b_size) -> tuple[tuple[int, int], ...] | None:
    """Per dim ``(lo, hi)`` of the intersection of two boxes, or ``None`` if empty."""
    out = []
    for s0, n0, s1, n1 in zip(a_start, a_size, b_start, b_size):
        lo, hi = max(s0, s1), min(s0 + n0, s1 + n1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_fd(fd: int) -> str:
    """The sha256 of the whole file open as descriptor ``fd`` (read from its start)."""
    h = hashlib.sha256()
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
