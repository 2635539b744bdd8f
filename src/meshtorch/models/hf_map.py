"""Where each parameter of a model lives in a Hugging Face checkpoint, and how to move it.

A :class:`Piece` says which HF tensor holds one of our parameters and how its
dims are arranged there: each HF dim is a group of our dims flattened
row-major (``q_proj.weight`` is ``[(heads, d_kv), (d_model,)]`` for our
``attn.q.kernel [d_model, heads, d_kv]``), and ``offsets`` place it inside a
fused HF dim (GPT-2's ``c_attn`` holds q, k and v side by side). The same
pieces serve both directions: :func:`read_slice` reads one processor's slice
of a parameter from a :class:`Source` (the safetensors files of a checkpoint
directory, through ``get_slice``, or an in-memory state dict), and
:func:`assemble` builds the HF tensors of an export from whole parameters.

Example:
    >>> import torch
    >>> from meshtorch.models.hf_map import Piece, Source, read_slice
    >>> src = Source.of({"w": torch.arange(12.0).reshape(3, 4)})   # HF [(heads, d_kv), d_model]
    >>> p = Piece("w", (("heads", "d_kv"), ("d_model",)))
    >>> read_slice(src, p, {"d_model": 4, "heads": 3, "d_kv": 1}, {"d_model": (0, 4), "heads": (1, 2),
    ...            "d_kv": (0, 1)}).shape   # our dims [d_model, heads, d_kv], heads 1..2
    torch.Size([4, 2, 1])
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtorch.checkpoint.consolidated import open_safetensors, weight_map
from meshtorch.errors import CheckpointError

# transformers' activation names -> ours; gelu_new / gelu_fast / gelu_pytorch_tanh are all
# 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), which is torch's gelu(approximate="tanh")
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}
OUR_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def config_dict(config: Any) -> dict[str, Any] | None:
    """An HF config (a ``PretrainedConfig``, or its dict) as a plain dict; ``None`` stays ``None``."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    return config.to_dict()


@dataclass(frozen=True)
class Piece:
    """One parameter's place in an HF tensor: its ``key``, the group of our dims (outermost
    first) each HF dim flattens, and the start of the parameter in fused HF dims
    (``offsets``: HF dim index -> start)."""

    key: str
    groups: tuple[tuple[str, ...], ...]
    offsets: Mapping[int, int] = field(default_factory=dict)


class Source:
    """HF tensors by key, read a region at a time: safetensors files (only the region is
    read, with ``safe_open(...).get_slice``) or an in-memory state dict.

    ``strip`` is a key prefix that may be absent (``transformer.`` in a ``GPT2Model``'s
    state dict but not a ``GPT2LMHeadModel``'s): a key is looked up as given, then without it.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, files: dict[str, str] | None = None,
                 where: str = "the state dict"):
        self.tensors = tensors or {}
        self.files = files or {}
        self.where = where
        self.strip = ""
        self._handles: dict[str, object] = {}

    @classmethod
    def of(cls, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> Source:
        """A source over a checkpoint directory (or one ``.safetensors`` file), or a state dict."""
        if isinstance(source, Mapping):
            return cls(tensors=source)
        path = os.fspath(source)
        return cls(files=weight_map(path), where=repr(path))

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.files)

    def has(self, key: str) -> bool:
        return self._resolve(key) is not None

    def _resolve(self, key: str) -> str | None:
        keys = self.tensors if self.tensors else self.files
        if key in keys:
            return key
        if self.strip and key.startswith(self.strip) and key[len(self.strip):] in keys:
            return key[len(self.strip):]
        return None

    def _need(self, key: str) -> str:
        found = self._resolve(key)
        if found is None:
            some = sorted(self.keys())[:4]
            raise CheckpointError(f"weight {key!r} is missing from {self.where} (it has e.g. {some}); "
                                  "are the config and the weights from one model?")
        return found

    def shape(self, key: str) -> tuple[int, ...]:
        key = self._need(key)
        if key in self.tensors:
            return tuple(self.tensors[key].shape)
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        key = self._need(key)
        if key in self.tensors:
            return self.tensors[key][region]
        return self._slice(key)[region]

    def _slice(self, key: str):
        fpath = self.files[key]
        if fpath not in self._handles:
            self._handles[fpath] = open_safetensors(fpath)
        return self._handles[fpath].get_slice(key)


def _flat_order(piece: Piece) -> list[str]:
    return [d for g in piece.groups for d in g]


def read_slice(src: Source, piece: Piece, sizes: Mapping[str, int],
               region: Mapping[str, tuple[int, int]]) -> torch.Tensor:
    """The ``region`` (our dim -> (start, length)) of a parameter whose dims have ``sizes``
    (in our dim order), read from ``src``. Along each HF dim the rows of the outermost dim of
    its group are read; an inner dim that is split (rare: ``d_kv``) is read whole, then cut."""
    names = list(sizes)
    if sorted(_flat_order(piece)) != sorted(names):
        raise CheckpointError(f"{piece.key!r}: the map covers dims {_flat_order(piece)}, the parameter has "
                              f"{names}")
    index, shape, cuts = [], [], []
    for i, group in enumerate(piece.groups):
        start, n = region[group[0]]
        inner = math.prod(sizes[d] for d in group[1:])
        off = piece.offsets.get(i, 0)
        index.append(slice(off + start * inner, off + (start + n) * inner))
        shape += [n] + [sizes[d] for d in group[1:]]
        cuts += [None] + [region[d] for d in group[1:]]
    t = src.read(piece.key, tuple(index)).reshape(shape)
    for axis, cut in enumerate(cuts):
        if cut is not None and cut != (0, shape[axis]):
            t = t.narrow(axis, cut[0], cut[1])
    order = _flat_order(piece)
    return t.permute([order.index(d) for d in names])


def assemble(pieces: Mapping[str, Piece], params: Mapping[str, tuple[list[str], torch.Tensor]]
             ) -> dict[str, torch.Tensor]:
    """HF tensors from whole parameters: ``params`` maps our name to (its dim names, tensor);
    each goes to its piece's place. A fused HF tensor (several pieces) is as large as its
    pieces reach."""
    by_key: dict[str, list[tuple[Piece, list[str], torch.Tensor]]] = {}
    for name, piece in pieces.items():
        dims, t = params[name]
        by_key.setdefault(piece.key, []).append((piece, dims, t))
    out = {}
    for key, parts in by_key.items():
        blocks = []
        for piece, dims, t in parts:
            order = _flat_order(piece)
            moved = t.permute([dims.index(d) for d in order])
            sizes = dict(zip(order, moved.shape))
            blocks.append((piece, moved.reshape([math.prod(sizes[d] for d in g) for g in piece.groups])))
        rank = len(blocks[0][1].shape)
        shape = [max(p.offsets.get(i, 0) + b.shape[i] for p, b in blocks) for i in range(rank)]
        full = torch.empty(shape, dtype=blocks[0][1].dtype)
        for piece, b in blocks:
            full[tuple(slice(piece.offsets.get(i, 0), piece.offsets.get(i, 0) + b.shape[i])
                       for i in range(rank))] = b
        out[key] = full
    return out
