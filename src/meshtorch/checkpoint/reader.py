"""``mt.load``: read a checkpoint onto any mesh and rules, reading only what is needed.

Example:
    >>> import tempfile, os, torch, meshtorch as mt
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> def make():
    ...     return mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
    >>> def save():
    ...     model = make().reset_parameters(seed=5)
    ...     mt.save(path, model=model, step=3)
    ...     return model.kernel.detach().clone()
    >>> saved = mt.launch(save)[0]
    >>> def load():
    ...     model = make()
    ...     info = mt.load(path, model=model)
    ...     return info["step"], model.kernel.mesh_tensor.to_global()
    >>> step, kernel = mt.launch(load, mesh="m:2", rules="d:m")[1]
    >>> step, bool((kernel == saved).all())
    (3, True)
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open

from meshtorch.checkpoint.format import DTYPES, INDEX, overlap, sha256_fd, shape_from_json
from meshtorch.checkpoint.index import missing_index, read_version_index
from meshtorch.checkpoint.state import from_json, restore_rng, scalar_from_json
from meshtorch.checkpoint.versions import ATTEMPTS, OpenVersion, inside, latest
from meshtorch.checkpoint.writer import (
    agree,
    from_rank0,
    model_tensors,
    param_names,
    processors_agree,
)
from meshtorch.context import current
from meshtorch.errors import CheckpointError, MeshTorchError
from meshtorch.mesh import Mesh
from meshtorch.tensor import layout_for, local_shape

# a file opened by descriptor is reopened through this path on Linux: the same file, even once deleted
_PROC_FD = "/proc/self/fd"


def _fd_path(fd: int, fpath: str) -> str:
    proc = os.path.join(_PROC_FD, str(fd))
    return proc if os.path.exists(proc) else fpath


class _Pinned:
    """One version of a checkpoint held open: its index and the files this processor reads."""

    def __init__(self, version: OpenVersion, index: dict):
        self.version, self.index = version, index
        self.fds: dict[str, int] = {}
        self.tensors: dict[str, str] = {}  # a tensor each open file holds, to name in its errors

    def pin(self, fname: str, tensor: str) -> int:
        """Open ``fname``; ``FileNotFoundError`` if it vanished because its version was pruned."""
        fpath = os.path.join(self.version.dir, fname)
        if fname not in self.index["files"]:
            raise CheckpointError(f"tensor {tensor!r} is stored in {fpath}, which is missing from "
                                  f"the checkpoint {self.version.dir!r}; the checkpoint is incomplete")
        if not inside(self.version.dir, fpath):
            raise CheckpointError(f"tensor {tensor!r} is stored in {fpath}, a symlink to "
                                  f"{os.path.realpath(fpath)} outside the checkpoint {self.version.dir!r}; "
                                  "a checkpoint only reads files inside its own directory")
        try:
            fd = self.version.open(fname)
        except FileNotFoundError:
            if self.version.pruned():
                raise
            raise CheckpointError(f"tensor {tensor!r} is stored in {fpath}, which is missing from the "
                                  f"checkpoint {self.version.dir!r}; the checkpoint is incomplete") from None
        if not os.path.isfile(_fd_path(fd, fpath)):
            os.close(fd)
            raise CheckpointError(f"tensor {tensor!r} is stored in {fpath}, which is not a file; "
                                  f"the checkpoint {self.version.dir!r} is incomplete")
        self.fds[fname] = fd
        self.tensors[fname] = tensor
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.version.close()


def _needed(index: dict, model, optimizer, coords) -> dict[str, str]:
    """The files (and a tensor each holds) whose pieces overlap this processor's slices."""
    wanted = [(name, view.layout.slices(coords)) for name, view in model_tensors(model)]
    if optimizer is not None:
        for name, entry in index["tensors"].items():
            if name.startswith("optim/"):
                try:
                    wanted.append((name, layout_for(shape_from_json(entry["dims"])).slices(coords)))
                except MeshTorchError:  # the read itself names the problem
                    continue
    files: dict[str, str] = {}
    for name, sl in wanted:
        entry = index["tensors"].get(name)
        for piece in entry["pieces"] if entry else ():
            if overlap(piece["start"], piece["size"], [s for s, _ in sl], [n for _, n in sl]) is not None:
                files.setdefault(piece["file"], name)
    return files


def _pin(path: str, model, optimizer) -> _Pinned:
    """The version every processor reads, with each processor's files open (every processor calls it).

    Processor 0 resolves the newest version; each processor opens its index
    and files; if any found the version pruned by a newer save, all try again.
    """
    ok, pruned, failed = 0, 1, 2
    for _ in range(ATTEMPTS):
        pinned, error, state = None, None, ok
        try:
            mine = os.path.relpath(latest(path), path) if current().rank == 0 else ""
        except CheckpointError as e:
            mine, error = "", e
        name = from_rank0(mine)
        try:
            if error is not None:
                raise error
            if not name:
                raise CheckpointError(f"processor 0 found no checkpoint to load at {path!r}")
            version = OpenVersion(path, os.path.normpath(os.path.join(path, name)))
            try:
                pinned = _Pinned(version, read_version_index(version))
            except FileNotFoundError:
                if not version.pruned():
                    version.close()
                    raise missing_index(version) from None
                version.close()
                raise
            for fname, tensor in _needed(pinned.index, model, optimizer, current().coords).items():
                pinned.pin(fname, tensor)
        except FileNotFoundError:  # the version was pruned before it was open: all try the newer one
            state = pruned
        except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
            error, state = e, failed
        if state != ok and pinned is not None:
            pinned.close()
        agreed = processors_agree(state)
        if agreed == ok:
            return pinned
        if agreed == failed:
            if error is not None:
                raise error
            raise CheckpointError(f"loading checkpoint {path!r} failed on another processor")
    raise CheckpointError(f"the checkpoint at {path!r} got {ATTEMPTS} newer versions while it was being "
                          "opened (saves with a small keep= pruned each one before it was read); load "
                          "again, or save with a larger keep=")


class _Reader:
    """Read the pinned files of one version: verify each file's checksum once, count the bytes read."""

    def __init__(self, pinned: _Pinned, verify: bool):
        self.pinned, self.path, self.index, self.verify = pinned, pinned.version.dir, pinned.index, verify
        self.handles: dict[str, Any] = {}
        self.bytes_read = 0

    def open(self, fname: str, tensor: str):
        if fname in self.handles:
            return self.handles[fname]
        fpath = os.path.join(self.path, fname)
        fd = self.pinned.fds.get(fname)
        if fd is None:
            fd = self.pinned.pin(fname, tensor)
        if self.verify:
            got, meta = sha256_fd(fd), self.index["files"][fname]
            if got != meta["sha256"]:
                raise CheckpointError(
                    f"checksum mismatch in {fpath} (holding tensor {tensor!r}): sha256 {got} but "
                    f"{os.path.join(self.path, INDEX)} records {meta['sha256']}; the file is "
                    "corrupt — restore it or load an older checkpoint")
        try:  # the very file verified above, even if a newer save has pruned it since
            handle = safe_open(_fd_path(fd, fpath), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {fpath} (tensor {tensor!r}): {e}") from e
        self.handles[fname] = handle
        return handle

    def open_all(self) -> None:
        """Open (and with ``verify`` check the checksum of) every file this processor reads."""
        for fname, tensor in list(self.pinned.tensors.items()):
            self.open(fname, tensor)

    def read_into(self, name: str, entry: dict, out: torch.Tensor, start: list[int]) -> None:
        """Fill ``out`` (the region at ``start``) from the pieces of tensor ``name``."""
        size = list(out.shape)
        covered = 0
        for piece in entry["pieces"]:
            box = overlap(piece["start"], piece["size"], start, size)
            if box is None:
                continue
            f = self.open(piece["file"], name)
            src = tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(box, piece["start"]))
            dst = tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(box, start))
            fpath = os.path.join(self.path, piece["file"])
            try:
                stored = f.get_slice(piece["key"])
                part = stored[src] if src else f.get_tensor(piece["key"])
            except Exception as e:
                raise CheckpointError(f"tensor {name!r}: piece {piece['key']!r} cannot be read from "
                                      f"{fpath}: {e}") from e
            if list(stored.get_shape()) != list(piece["size"]):
                raise CheckpointError(f"tensor {name!r}: piece {piece['key']!r} in {fpath} has shape "
                                      f"{stored.get_shape()} but the index says {piece['size']}; the "
                                      "index is corrupt")
            out[dst] = part
            covered += part.numel()
            self.bytes_read += part.numel() * part.element_size()
        if covered != out.numel():
            raise CheckpointError(f"tensor {name!r}: the pieces in {self.path!r} cover {covered} of "
                                  f"the {out.numel()} elements this processor needs; the index is corrupt")


def _entry(index: dict, path: str, name: str, shape, dtype: torch.dtype) -> dict:
    ipath = os.path.join(path, INDEX)
    entry = index["tensors"].get(name)
    if entry is None:
        kind = name.split("/")[0]
        have = sorted(n.split("/", 1)[1] for n in index["tensors"] if n.startswith(kind + "/"))
        raise CheckpointError(f"tensor {name!r} is missing from checkpoint {ipath} (it has {kind} "
                              f"tensors {have[:8]}{' ...' if len(have) > 8 else ''}); was it saved "
                              "from a different model?")
    fname = entry["pieces"][0]["file"] if entry["pieces"] else INDEX
    saved = shape_from_json(entry["dims"])
    if saved != shape:
        raise CheckpointError(f"tensor {name!r} has shape [{shape}] here but [{saved}] in "
                              f"{os.path.join(path, fname)}; build the model with the saved dims")
    if DTYPES.get(entry["dtype"]) != dtype:
        raise CheckpointError(f"tensor {name!r} is {dtype} here but {entry['dtype']} in "
                              f"{os.path.join(path, fname)}; create the model in the saved dtype "
                              "(cast after loading if needed)")
    return entry


def load(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any = None,
         scheduler: Any = None, data: Any = None, restore_rng_state: bool = True,
         verify: bool = True, strict: bool = True) -> dict:
    """Load a checkpoint written by :func:`~meshtorch.checkpoint.save` (every processor calls it).

    Works on any mesh and rules: each processor reads, from the files that
    hold them, only the regions its slices need. Optimizer state, the LR
    scheduler, the random streams and the data position are restored, so a
    resumed run continues bitwise like the uninterrupted one (same mesh).
    ``path`` is what :func:`~meshtorch.checkpoint.save` was given (the newest
    kept version is read) or one version's directory (``path/step-000200``).
    Reading a live run is safe: processor 0 resolves the newest version, and
    every processor opens the files it needs from that version before reading
    any; a newer save that prunes the version (``keep``) before then makes all
    of them open the newer one instead, and one that prunes it afterwards
    changes nothing (an open file stays readable). So a load never fails, nor
    mixes two versions, because the run it reads saved meanwhile.

    Every check (each tensor's presence, shape and dtype, the optimizer's
    class and groups, the scheduler's state, with ``verify`` every file's
    checksum) passes on every processor before anything is copied: a load
    that raises leaves the model, optimizer and scheduler as they were.

    Args:
        strict: the checkpoint's model tensors must be the model's; ``False``
            loads the model's and ignores the checkpoint's others (a checkpoint
            of a larger model on purpose, e.g. 2BW's ``previous.*`` weights).

    Returns:
        ``{"step", "data", "extra", "bytes_read"}``: the saved step, this
        processor's data position and the extra values, and how many tensor
        bytes this processor read. Where the processors saved different data
        positions (each read its own rows), each gets its own back: on a mesh
        of as many processors, by rank; on another count ``data=`` is refused
        and ``"data"`` is ``None``.

    Raises:
        CheckpointError: missing checkpoint or tensor, a tensor the model lacks
            (``strict``), shape or dtype mismatch, a malformed or modified index
            (naming the field), checksum mismatch of a slice file (with
            ``verify``) — naming the tensor and the file; ``data=`` with
            per-processor positions saved on another mesh.
    """
    pinned = _pin(os.fspath(path), model, optimizer)
    path = pinned.version.dir
    try:
        index = pinned.index
        reader = _Reader(pinned, verify)
        coords = current().coords
        plan, opt_plan, error = [], None, None
        try:  # everything that can refuse the checkpoint, before anything is copied
            plan = [(name, view, _entry(index, path, name, view.shape, view.dtype))
                    for name, view in model_tensors(model)]
            if strict:
                _check_no_others(index, path, {name for name, _, _ in plan})
            if optimizer is not None:
                opt_plan = _optimizer_plan(optimizer, model, index, path)
            if data is not None:
                _check_positions_fit(index, path)
            if scheduler is not None and index.get("scheduler") is None:
                raise CheckpointError(f"checkpoint {path!r} holds no scheduler state; load without "
                                      "scheduler= or save one with mt.save(..., scheduler=sched)")
            reader.open_all()
        except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
            error = e
        # the lowest failing processor's error, on every processor: all refuse, none copied anything
        agree(error, f"loading checkpoint {path!r} failed on {{why}}; nothing was loaded")
        error = None
        try:
            with torch.no_grad():
                for name, view, entry in plan:
                    start = [s for s, _ in view.layout.slices(coords)]
                    buf = torch.empty_like(view.local, device="cpu")
                    reader.read_into(name, entry, buf, start)
                    view.local.copy_(buf)
                if opt_plan is not None:
                    _load_optimizer(optimizer, opt_plan, index, reader, coords)
        except BaseException as e:  # noqa: BLE001 - e.g. a damaged piece found only now (verify=False)
            error = e
        agree(error, f"loading checkpoint {path!r}: reading the checked files failed on {{why}}; the model "
                     "and optimizer are partly loaded, load again")
    finally:
        pinned.close()
    # the scheduler's, the data's and the random state: each processor's own objects may refuse on
    # one processor only (a loader's per-processor state); every processor learns of it, as above,
    # rather than the others waiting at the barrier for one that raised
    error = None
    saved_data = None
    try:
        if scheduler is not None:
            scheduler.load_state_dict(from_json(index["scheduler"]))
        saved_data = _data_position(index)
        if data is not None and hasattr(data, "load_state_dict"):
            data.load_state_dict(saved_data)
        if restore_rng_state:
            restore_rng(index["rng"])
    except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
        error = e
    agree(error, f"loading checkpoint {path!r}: the model and optimizer were loaded, but restoring the "
                  "scheduler, data or random state failed on {why}")
    # threads share torch's generator: nobody draws from it before everyone has restored it
    current().comm.barrier()
    return {"step": index.get("step"), "data": saved_data, "extra": from_json(index.get("extra")),
            "bytes_read": reader.bytes_read}


def _data_position(index: dict) -> Any:
    """This processor's saved data position: its own where each processor's was saved
    (``data_per_processor``) on this very mesh, ``None`` where they were saved on another mesh;
    else the one."""
    ctx = current()
    positions = index.get("data_per_processor")
    if positions is None:
        return from_json(index.get("data"))
    return from_json(positions[ctx.rank]) if _same_mesh(index) else None


def _same_mesh(index: dict) -> bool:
    """Whether the checkpoint was saved on this mesh: the same axes, sizes and order, so each
    rank holds the same coordinates (a rank of ``tp:2,dp:2`` or ``dp:4`` is another processor
    of ``dp:2,tp:2``, reading other rows)."""
    return Mesh(index["mesh"]) == current().mesh


def _check_positions_fit(index: dict, path: str) -> None:
    """Refuse to restore data positions saved per processor on another mesh."""
    positions, mesh = index.get("data_per_processor"), current().mesh
    if positions is not None and not _same_mesh(index):
        raise CheckpointError(
            f"checkpoint {path!r} holds a data position per processor (the {len(positions)} processors of "
            f"mesh '{index['mesh']}' each read their own rows), but this mesh is '{mesh}': a position "
            "belongs to a processor's coordinates, and no rule gives them to the processors of another "
            f"mesh (other axes, sizes or order). Resume on mesh '{index['mesh']}', or load without data= "
            "and place the loaders yourself (read_index(path)['data_per_processor'] lists the positions, "
            "in rank order of the saved mesh)")


def _check_no_others(index: dict, path: str, mine: set[str]) -> None:
    """Refuse a checkpoint holding model tensors that ``mine`` (the model's) lacks."""
    others = sorted(n for n in index["tensors"] if n.startswith("model/") and n not in mine)
    if others:
        raise CheckpointError(f"checkpoint {os.path.join(path, INDEX)} holds tensors {others[:8]}"
                              f"{' ...' if len(others) > 8 else ''} ({len(others)}) that are not in the "
                              "model; was it saved from a different model? Build the model it was saved "
                              "from, or load only this model's tensors with mt.load(..., strict=False)")


def _optimizer_plan(optimizer, model, index, path) -> list[list[tuple]]:
    """Check the saved optimizer state fits ``optimizer``; per group, ``(param, name)`` pairs."""
    saved = index.get("optimizer")
    if saved is None:
        raise CheckpointError(f"checkpoint {path!r} holds no optimizer state; load without "
                              "optimizer= or save one with mt.save(..., optimizer=opt)")
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint {path!r} holds {saved['class']} state, not "
                              f"{type(optimizer).__name__}")
    names = param_names(model)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path!r} has {len(saved['param_groups'])} optimizer "
                              f"groups, this optimizer {len(optimizer.param_groups)}")
    plan = []
    for gi, (group, sgroup) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        mine = [names.get(id(p)) for p in group["params"]]
        if None in mine:
            raise CheckpointError(f"optimizer group {gi} holds {mine.count(None)} parameter(s) that are not "
                                  "in the model given; build the optimizer over the parameters of the model "
                                  "you load into (a model built again needs its optimizer built again)")
        if mine != sgroup["params"]:
            raise CheckpointError(f"optimizer group {gi} holds parameters {mine} here but "
                                  f"{sgroup['params']} in checkpoint {path!r}")
        plan.append(list(zip(group["params"], mine)))
    for tname, entry in index["tensors"].items():
        if tname.startswith("optim/"):
            layout_for(shape_from_json(entry["dims"]))  # a layout the rules refuse raises here
    return plan


def _load_optimizer(optimizer, plan, index, reader, coords) -> None:
    saved = index["optimizer"]
    keys: dict[str, list[str]] = {}  # parameter name -> its sharded state tensors in the index
    for tname in index["tensors"]:
        if tname.startswith("optim/"):
            pname, key = tname.removeprefix("optim/").rsplit("/", 1)
            keys.setdefault(pname, []).append(key)
    groups, state, order = [], {}, 0
    for pairs, sgroup in zip(plan, saved["param_groups"]):
        ids = []
        for p, name in pairs:
            st = {}
            for key, val in saved["scalars"].get(name, {}).items():
                st[key] = from_json(val["json"]) if "json" in val else scalar_from_json(val)
            for key in keys.get(name, []):
                tname = f"optim/{name}/{key}"
                entry = index["tensors"][tname]
                layout = layout_for(shape_from_json(entry["dims"]))
                buf = torch.empty(local_shape(layout), dtype=DTYPES[entry["dtype"]])
                reader.read_into(tname, entry, buf, [s for s, _ in layout.slices(coords)])
                st[key] = buf.to(p.device)
            if st:
                state[order] = st
            ids.append(order)
            order += 1
        hyper = {k: (tuple(v) if isinstance(v, list) and k != "params" else v)
                 for k, v in from_json(sgroup).items()}
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
