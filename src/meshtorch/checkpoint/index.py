"""``index.json``: read it, check every field, and check its own sha256.

The index records ``index_sha256``, the sha256 of its canonical JSON without
that field, so an edited or damaged index (two piece keys swapped, a size
changed) is caught like a damaged slice file. Each field is also checked for
its type and range, so a malformed index raises
:class:`~meshtorch.errors.CheckpointError` naming the file and the field
instead of a ``KeyError`` later. Piece files must be plain names inside the
checkpoint directory.

Example:
    >>> from meshtorch.checkpoint.index import index_checksum
    >>> index_checksum({"step": 1}) == index_checksum({"step": 1, "index_sha256": "ignored"})
    True
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from typing import Any

import torch

from meshtorch.checkpoint.format import DTYPES, FORMAT, INDEX, VERSION, piece_key
from meshtorch.checkpoint.versions import ATTEMPTS, OpenVersion, open_latest
from meshtorch.errors import CheckpointError, MeshTorchError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

CHECKSUM = "index_sha256"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE = re.compile(r"^slices-\d{5,}\.safetensors$")


def index_checksum(index: dict) -> str:
    """The sha256 of ``index``'s canonical JSON, without its own ``index_sha256`` field."""
    body = {k: v for k, v in index.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_index(path: str | os.PathLike) -> dict:
    """The checked ``index.json`` of the checkpoint that ``mt.load(path)`` reads.

    ``path`` is a checkpoint path (its ``latest`` version is read) or one version's directory.
    A version pruned by a newer save while it is read makes it read the newer one.
    """
    for _ in range(ATTEMPTS):
        version = open_latest(path)
        try:
            return read_version_index(version)
        except FileNotFoundError:
            if not version.pruned():
                raise missing_index(version) from None
        finally:
            version.close()
    raise CheckpointError(f"the checkpoint at {os.fspath(path)!r} got {ATTEMPTS} newer versions while its "
                          "index was being read; read it again, or save with a larger keep=")


def read_version_index(version: OpenVersion) -> dict:
    """The checked ``index.json`` of the open ``version``; ``FileNotFoundError`` if it was pruned."""
    ipath = os.path.join(version.dir, INDEX)
    try:
        with os.fdopen(version.open(INDEX), "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint index {ipath} cannot be read as JSON ({e}); the checkpoint "
                              "is corrupt — load an older one") from e
    check_index(index, ipath)
    return index


def missing_index(version: OpenVersion) -> CheckpointError:
    ipath = os.path.join(version.dir, INDEX)
    return CheckpointError(f"checkpoint index {ipath} cannot be read as JSON ([Errno 2] No such file or "
                           "directory); the checkpoint is corrupt — load an older one")


class _Checker:
    def __init__(self, ipath: str):
        self.ipath = ipath

    def fail(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint index {self.ipath}: field {field} {problem}; the index is "
                               "corrupt — load an older checkpoint")

    def get(self, obj: dict, key: str, field: str, kinds: tuple[type, ...], what: str) -> Any:
        if key not in obj:
            raise self.fail(field, "is missing")
        return self.of(obj[key], field, kinds, what)

    def of(self, value: Any, field: str, kinds: tuple[type, ...], what: str) -> Any:
        # bool is an int to Python, never to the index
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(field, f"must be {what}, got {json.dumps(value)[:80]}")
        return value

    def ints(self, value: Any, field: str, n: int, low: int) -> list[int]:
        self.of(value, field, (list,), f"a list of {n} integers")
        if len(value) != n or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in value):
            raise self.fail(field, f"must be a list of {n} integers >= {low}, got {json.dumps(value)[:80]}")
        return value


def check_index(index: Any, ipath: str) -> None:
    """Raise :class:`CheckpointError` naming ``ipath`` and the field unless ``index`` is well formed."""
    c = _Checker(ipath)
    c.of(index, "(the whole index)", (dict,), "a JSON object")
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{ipath} is not a meshtorch checkpoint index (format "
                              f"{index.get('format')!r}); for a consolidated model.safetensors use "
                              "mt.import_consolidated")
    version = c.get(index, "version", "'version'", (int,), "an integer")
    if version < 1:
        raise c.fail("'version'", f"must be >= 1, got {version}")
    if version > VERSION:
        raise CheckpointError(f"{ipath} has format version {version}, newer than this meshtorch reads "
                              f"({VERSION}); upgrade meshtorch")
    for key in ("mesh", "rules"):
        text = c.get(index, key, repr(key), (str,), "a string")
        try:
            Mesh(text) if key == "mesh" else LayoutRules(text)
        except MeshTorchError as e:
            raise c.fail(repr(key), f"is not a valid {key} ({e})") from None
    step = c.get(index, "step", "'step'", (int, type(None)), "an integer or null")
    if step is not None and step < 0:
        raise c.fail("'step'", f"must be >= 0, got {step}")
    for key in ("data", "extra"):
        if key not in index:
            raise c.fail(repr(key), "is missing")
    if "data_per_processor" in index:
        positions = c.get(index, "data_per_processor", "'data_per_processor'", (list,), "a list")
        size = Mesh(index["mesh"]).size
        if len(positions) != size:
            raise c.fail("'data_per_processor'", f"must hold one position per processor of the mesh "
                         f"{index['mesh']} ({size}), got {len(positions)}")
    c.get(index, "scheduler", "'scheduler'", (dict, type(None)), "an object or null")
    _check_rng(c, c.get(index, "rng", "'rng'", (dict,), "an object"))
    opt = c.get(index, "optimizer", "'optimizer'", (dict, type(None)), "an object or null")
    if opt is not None:
        _check_optimizer(c, opt)
    files = c.get(index, "files", "'files'", (dict,), "an object")
    for fname, meta in files.items():
        field = f"files[{fname!r}]"
        if not _FILE.match(fname):
            raise c.fail(field, "must name a file 'slices-NNNNN.safetensors' in the checkpoint directory "
                         "(no directories, '..' or absolute paths)")
        c.of(meta, field, (dict,), "an object")
        if not _HEX64.match(str(c.get(meta, "sha256", f"{field}.sha256", (str,), "a string"))):
            raise c.fail(f"{field}.sha256", "must be 64 lowercase hex digits")
    tensors = c.get(index, "tensors", "'tensors'", (dict,), "an object")
    for name, entry in tensors.items():
        _check_tensor(c, name, entry, files)
    if version >= 2:
        recorded = c.get(index, CHECKSUM, repr(CHECKSUM), (str,), "a string")
        got = index_checksum(index)
        if recorded != got:
            raise CheckpointError(f"checksum mismatch in checkpoint index {ipath}: its contents hash to "
                                  f"sha256 {got} but it records {CHECKSUM} {recorded}; the index was "
                                  "modified or damaged — load an older checkpoint")


def _check_rng(c: _Checker, rng: dict) -> None:
    calls = c.get(rng, "random_calls", "rng.random_calls", (int,), "an integer")
    if calls < 0:
        raise c.fail("rng.random_calls", f"must be >= 0, got {calls}")
    states = c.get(rng, "torch_cpu", "rng.torch_cpu", (list,), "a list of base64 strings")
    if not states:
        raise c.fail("rng.torch_cpu", "must hold one state per processor, got none")
    size = torch.get_rng_state().numel()
    for i, s in enumerate(states):
        c.of(s, f"rng.torch_cpu[{i}]", (str,), "a base64 string")
        try:
            n = len(base64.b64decode(s, validate=True))
        except (binascii.Error, ValueError):
            raise c.fail(f"rng.torch_cpu[{i}]", "is not base64") from None
        if n != size:
            raise c.fail(f"rng.torch_cpu[{i}]", f"holds {n} bytes, not a torch CPU generator state "
                         f"({size} bytes)")


def _check_optimizer(c: _Checker, opt: dict) -> None:
    c.get(opt, "class", "optimizer.class", (str,), "a string")
    groups = c.get(opt, "param_groups", "optimizer.param_groups", (list,), "a list")
    for gi, group in enumerate(groups):
        field = f"optimizer.param_groups[{gi}]"
        c.of(group, field, (dict,), "an object")
        params = c.get(group, "params", f"{field}.params", (list,), "a list of parameter names")
        for pi, p in enumerate(params):
            c.of(p, f"{field}.params[{pi}]", (str,), "a parameter name")
    scalars = c.get(opt, "scalars", "optimizer.scalars", (dict,), "an object")
    for pname, states in scalars.items():
        c.of(states, f"optimizer.scalars[{pname!r}]", (dict,), "an object")
        for key, val in states.items():
            field = f"optimizer.scalars[{pname!r}][{key!r}]"
            c.of(val, field, (dict,), "an object")
            if "json" in val:
                continue
            c.get(val, "value", f"{field}.value", (int, float, bool), "a number")
            dtype = c.get(val, "dtype", f"{field}.dtype", (str,), "a torch dtype name")
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise c.fail(f"{field}.dtype", f"is {dtype!r}, not a torch dtype name")


def _check_tensor(c: _Checker, name: str, entry: Any, files: dict) -> None:
    field = f"tensors[{name!r}]"
    c.of(entry, field, (dict,), "an object")
    dims = c.get(entry, "dims", f"{field}.dims", (list,), "a list of [name, size] pairs")
    seen = set()
    for i, d in enumerate(dims):
        ok = (isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and d[0]
              and isinstance(d[1], int) and not isinstance(d[1], bool) and d[1] >= 1 and d[0] not in seen)
        if not ok:
            raise c.fail(f"{field}.dims[{i}]", f"must be a [name, size >= 1] pair with a new name, got "
                         f"{json.dumps(d)[:80]}")
        seen.add(d[0])
    sizes = [s for _, s in dims]
    dtype = c.get(entry, "dtype", f"{field}.dtype", (str,), "a dtype name")
    if dtype not in DTYPES:
        raise c.fail(f"{field}.dtype", f"is {dtype!r}, not one of {sorted(DTYPES)}")
    pieces = c.get(entry, "pieces", f"{field}.pieces", (list,), "a list")
    for pi, piece in enumerate(pieces):
        pf = f"{field}.pieces[{pi}]"
        c.of(piece, pf, (dict,), "an object")
        fname = c.get(piece, "file", f"{pf}.file", (str,), "a file name")
        if fname not in files:
            raise c.fail(f"{pf}.file", f"names {fname!r}, which is not among the index's files "
                         f"{sorted(files)[:4]} (pieces are read only from files inside the checkpoint)")
        start = c.ints(c.get(piece, "start", f"{pf}.start", (list,), "a list"), f"{pf}.start", len(dims), 0)
        size = c.ints(c.get(piece, "size", f"{pf}.size", (list,), "a list"), f"{pf}.size", len(dims), 0)
        if any(s + n > total for s, n, total in zip(start, size, sizes)):
            raise c.fail(pf, f"covers start {start} size {size}, beyond the tensor's sizes {sizes}")
        key = c.get(piece, "key", f"{pf}.key", (str,), "a string")
        if key != piece_key(name, start):
            raise c.fail(f"{pf}.key", f"is {key!r} but the piece of {name!r} at {start} is stored as "
                         f"{piece_key(name, start)!r}")
