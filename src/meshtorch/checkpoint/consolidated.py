"""Consolidated export and import in meshtorch's own parameter names: ``model.safetensors``.

(The Hugging Face ``transformers`` format, with its names and ``config.json``, is
:func:`meshtorch.models.export_hf` / :func:`meshtorch.models.from_hf`.)
``export_consolidated`` gathers each parameter whole and processor 0 writes one
``model.safetensors`` keyed by parameter name (or, above ``max_shard_bytes``,
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
with a ``weight_map``, as ``transformers`` does). The named dims are kept in
the file's metadata. ``import_consolidated`` reads only each processor's slices.

Example:
    >>> import tempfile, os, meshtorch as mt
    >>> path = tempfile.mkdtemp()
    >>> model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 3))
    >>> _ = mt.export_consolidated(path, model)
    >>> sorted(os.listdir(path))
    ['model.safetensors']
    >>> fresh = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 3)).reset_parameters(seed=9)
    >>> mt.import_consolidated(path, fresh)
    ['kernel', 'bias']
    >>> bool((fresh.kernel == model.kernel).all())
    True
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable

import safetensors.torch
import torch
from safetensors import safe_open

from meshtorch.checkpoint.format import shape_from_json, shape_json
from meshtorch.checkpoint.writer import agree
from meshtorch.context import current
from meshtorch.errors import CheckpointError, MeshTorchError
from meshtorch.files import replacing, write_atomic
from meshtorch.nn.module import Module
from meshtorch.optim.params import view_of
from meshtorch.shape import Shape

SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def _views(model: torch.nn.Module):
    if isinstance(model, Module):
        return list(model.named_mesh_parameters())
    return [(n, view_of(p)) for n, p in model.named_parameters()]


def export_consolidated(path: str | os.PathLike, model: torch.nn.Module, *,
                        max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None) -> list[str]:
    """Write ``model`` as consolidated safetensors in directory ``path`` (every processor calls it).

    Returns the file names written. ``dtype`` casts on export (e.g. ``torch.bfloat16``).
    Files are written under a temporary name and renamed into place.
    """
    ctx = current()
    tensors: dict[str, torch.Tensor] = {}
    dims = {}
    with torch.no_grad():
        for name, view in _views(model):
            full = view.detach().to_global()  # every processor takes part in the gather
            if ctx.rank == 0:
                tensors[name] = full.to(dtype) if dtype is not None else full
                dims[name] = shape_json(view.shape)
    return write_consolidated(path, tensors, max_shard_bytes=max_shard_bytes,
                              metadata={"meshtorch_dims": json.dumps(dims)})


def write_consolidated(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *,
                       max_shard_bytes: int = 5 * 2**30, metadata: dict[str, str] | None = None,
                       files: dict[str, str] | None = None) -> list[str]:
    """Processor 0 writes ``tensors`` (whole, keyed by file name) into directory ``path`` as
    ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` plus a
    ``model.safetensors.index.json`` above ``max_shard_bytes``, and each text of ``files``
    (e.g. ``config.json``); every processor calls it, and all raise if the write failed.
    Each file is written under a temporary name and renamed into place.

    Returns the safetensors file names on processor 0, ``[]`` elsewhere.

    Example:
        >>> import tempfile, os, torch
        >>> from meshtorch.checkpoint.consolidated import write_consolidated
        >>> path = tempfile.mkdtemp()
        >>> write_consolidated(path, {"w": torch.ones(2)}, files={"config.json": "{}"})
        ['model.safetensors']
        >>> sorted(os.listdir(path))
        ['config.json', 'model.safetensors']
    """
    ctx = current()
    path = os.fspath(path)
    names: list[str] = []
    error = None
    if ctx.rank == 0:
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        for name, full in tensors.items():
            full = full.contiguous().cpu()
            nbytes = full.numel() * full.element_size()
            if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = full
            sizes[-1] += nbytes
        try:
            os.makedirs(path, exist_ok=True)
            n = len(shards)
            names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
            meta = {"format": "pt", **(metadata or {})}
            for fname, shard in zip(names, shards):
                with replacing(os.path.join(path, fname)) as tmp:
                    safetensors.torch.save_file(shard, tmp, metadata=meta)
            texts = dict(files or {})
            if n > 1:
                weight_map = {k: f for f, shard in zip(names, shards) for k in shard}
                index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
                texts[HF_INDEX] = json.dumps(index, indent=1)
            for fname, text in texts.items():
                write_atomic(os.path.join(path, fname), text.encode())
        except OSError as e:
            error = e
    comm = ctx.comm
    bad = comm.all_reduce(torch.tensor([0.0 if error is None else 1.0]), comm.mesh.axis_names, "max")
    if bad.item():
        raise CheckpointError(f"writing safetensors to {path!r} failed on processor 0: {error}") from error
    return names if ctx.rank == 0 else []


def open_safetensors(path: str):
    """``safe_open(path)``, or a :class:`CheckpointError` naming a file that is missing, truncated
    or not safetensors (the library's own error names no file and says "deserializing header")."""
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors' SafetensorError has no stable import path across versions
        what = ("is missing" if isinstance(e, FileNotFoundError)
                else f"is not a complete safetensors file ({e})")
        raise CheckpointError(f"{path} {what}: it was cut short or damaged (an interrupted download or "
                              "copy?); fetch or export it again") from None


def _index_map(path: str, ipath: str) -> dict[str, str]:
    """The ``weight_map`` of an index file, each file resolved inside ``path`` (as a checkpoint's
    own files are: an index must not make a reader open ``../x`` or ``/etc/...``)."""
    from meshtorch.checkpoint.versions import inside

    try:
        with open(ipath) as f:
            wmap = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ipath} is not a safetensors index ({type(e).__name__}: {e}); it must be "
                              'JSON with "weight_map": {tensor name: shard file name}') from None
    if not isinstance(wmap, dict):
        raise CheckpointError(f'{ipath}: "weight_map" is a {type(wmap).__name__}, not '
                              "{tensor name: shard file name}")
    out = {}
    for key, fname in wmap.items():
        target = os.path.join(path, fname) if isinstance(fname, str) else ""
        if (not isinstance(fname, str) or not fname or os.path.isabs(fname)
                or ".." in fname.replace("\\", "/").split("/") or not inside(path, target)):
            raise CheckpointError(f"{ipath}: weight_map puts {key!r} in {fname!r}, which is not a file name "
                                  f"inside {path!r} (no '..' or absolute paths, no symlinks out); a model "
                                  "directory only reads its own files")
        out[key] = target
    return out


def weight_map(path: str) -> dict[str, str]:
    """Tensor key -> the safetensors file holding it, for a file, a directory with
    ``model.safetensors``, or a directory of shards with ``model.safetensors.index.json``
    (whose shard names must lie inside the directory)."""
    if os.path.isfile(path):
        with open_safetensors(path) as f:
            return {k: path for k in f.keys()}
    ipath = os.path.join(path, HF_INDEX)
    if os.path.isfile(ipath):
        return _index_map(path, ipath)
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return weight_map(single)
    raise CheckpointError(f"no {SINGLE} or {HF_INDEX} in {path!r}; export one with mt.export_consolidated")


def import_consolidated(path: str | os.PathLike, model: torch.nn.Module, *,
                        rename: Callable[[str], str] | dict[str, str] | None = None,
                        strict: bool = True) -> list[str]:
    """Load consolidated safetensors (a file, or a directory with ``model.safetensors``
    or a sharded index) into ``model``; each processor reads only its slices
    (every processor calls it).

    ``rename`` maps a parameter name to the key in the files. Values are cast to
    each parameter's dtype. With ``strict``, a parameter missing from the files
    is an error. A file written by :func:`export_consolidated` records each
    tensor's named dims (``meshtorch_dims``): they must be the parameter's, names
    and order too, where both have real names; a plain torch parameter's (made-up
    ``dim0, dim1, ...``) on either side, and other files, are checked by sizes. Every parameter is checked
    on every processor before any is copied, so an import that raises (on every
    processor, where one processor's files fail) leaves ``model`` as it was.
    Returns the names of the parameters loaded.
    """
    path = os.fspath(path)
    plan, error = [], None
    try:
        plan = _import_plan(path, model, rename, strict)
    except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
        error = e
    # each processor may read its own copy of the files (one per host): all refuse, or all copy
    agree(error, f"importing {path!r} failed on {{why}}; nothing was loaded")
    coords = current().coords
    try:
        with torch.no_grad():
            for _, view, handle, key, sl in plan:
                region = tuple(slice(s, s + n) for s, n in view.layout.slices(coords))
                part = sl[region] if region else handle.get_tensor(key)
                view.local.copy_(part.to(view.dtype))
    except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
        error = e
    agree(error, f"importing {path!r}: reading the checked files failed on {{why}}; the model is partly "
                 "loaded, import again")
    return [name for name, *_ in plan]


def _import_plan(path: str, model: torch.nn.Module, rename, strict: bool) -> list[tuple]:
    """``(name, view, file handle, key, slice)`` of each parameter to load, checked against the files."""
    wmap = weight_map(path)
    key_of = rename if callable(rename) else (lambda n: (rename or {}).get(n, n))
    handles: dict[str, object] = {}
    dims_of: dict[str, dict] = {}  # file -> its meshtorch_dims ({} for files other tools wrote)
    plan = []
    for name, view in _views(model):
        key = key_of(name)
        fpath = wmap.get(key)
        if fpath is None:
            if strict:
                raise CheckpointError(f"parameter {name!r} (key {key!r}) is not in {path!r}; "
                                      "pass rename= to map names, or strict=False")
            continue
        if fpath not in handles:
            handles[fpath] = open_safetensors(fpath)
            dims_of[fpath] = _saved_dims(handles[fpath], fpath)
        try:
            sl = handles[fpath].get_slice(key)
        except Exception:  # safetensors' SafetensorError has no stable import path across versions
            raise CheckpointError(f"parameter {name!r}: the index of {path!r} puts {key!r} in {fpath}, which "
                                  "does not hold it; the shards are not the index's (a partial copy?), "
                                  "fetch or export them again") from None
        saved = dims_of[fpath].get(key)
        if saved is not None and not _generated(view.shape, name) and not _generated(saved, key):
            _check_dims(name, key, view.shape, saved, fpath)
        if list(sl.get_shape()) != list(view.shape.sizes):
            raise CheckpointError(f"parameter {name!r} has shape [{view.shape}] but {fpath} holds "
                                  f"{key!r} with shape {sl.get_shape()}")
        plan.append((name, view, handles[fpath], key, sl))
    return plan


def _saved_dims(handle, fpath: str) -> dict[str, Shape]:
    """The named shapes a file's ``meshtorch_dims`` metadata records, by key (``{}`` without it)."""
    text = (handle.metadata() or {}).get("meshtorch_dims")
    if text is None:
        return {}
    try:
        recorded = json.loads(text)
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{fpath}: its meshtorch_dims metadata is not JSON of "
                              "{tensor key: [[dim, size], ...]}; export the file again")
    out = {}
    for key, dims in recorded.items():
        try:
            out[key] = shape_from_json(dims)
        except (ValueError, TypeError, MeshTorchError):
            raise CheckpointError(f"{fpath}: its meshtorch_dims metadata gives {key!r} the dims "
                                  f"{json.dumps(dims)[:80]}, not [[dim, size], ...]; export the file "
                                  "again") from None
    return out


def _generated(shape: Shape, name: str) -> bool:
    """Whether ``shape``'s dim names are the ones meshtorch makes up for a plain torch parameter
    ``name`` (``dim0, dim1, ...``, or ``<name>_dim0, ...`` inside an ``mt.nn`` module): they say
    nothing of what the dims are, so a file moves between a plain and an ``mt.nn`` parameter."""
    safe = name.replace(".", "_")
    return any(shape.names == tuple(f"{p}dim{i}" for i in range(len(shape.names))) for p in ("", f"{safe}_"))


def _check_dims(name: str, key: str, mine: Shape, saved: Shape, fpath: str) -> None:
    """Refuse a file's tensor whose recorded dims are not the parameter's (saying so where only the
    order differs)."""
    if saved == mine:
        return
    if sorted(saved.names) == sorted(mine.names) and all(saved[n].size == mine[n].size for n in mine.names):
        fix = ("the same dims in another order: the file's values are laid out in its order, so build the "
               "parameter with its dims in that order")
    else:
        fix = "build the model with the exported dims, or map the name to the right key with rename="
    raise CheckpointError(f"parameter {name!r} has shape [{mine}] but {fpath} holds {key!r} "
                          f"with dims [{saved}] (its meshtorch_dims); {fix}")


def _deprecated(old: str, new: Callable) -> Callable:
    def alias(*args, **kwargs):
        warnings.warn(f"mt.{old} is deprecated and will be removed in the next release: call "
                      f"mt.{new.__name__} (meshtorch's names); the Hugging Face format is "
                      "meshtorch.models.export_hf / from_hf", DeprecationWarning, stacklevel=2)
        return new(*args, **kwargs)

    alias.__name__ = old
    alias.__doc__ = f"Deprecated name of :func:`{new.__name__}`."
    return alias


export_hf = _deprecated("export_hf", export_consolidated)
import_hf = _deprecated("import_hf", import_consolidated)
