"""``mt.save``: write a resharding checkpoint, atomically (see docs/design.md, Checkpoints).

Example:
    >>> import tempfile, os, torch, meshtorch as mt
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> def f():
    ...     model = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
    ...     where = mt.save(path, model=model, step=7)
    ...     return sorted(os.listdir(path)), sorted(os.listdir(where))
    >>> mt.launch(f, mesh="m:2", rules="d:m")[0]
    (['latest', 'step-000007'], ['index.json', 'slices-00000.safetensors', 'slices-00001.safetensors'])
"""

from __future__ import annotations

import json
import numbers
import os
import secrets
import shutil
from typing import Any

import safetensors.torch
import torch

from meshtorch.checkpoint.background import collect, start_background, wait_markers, write_marker
from meshtorch.checkpoint.format import (
    FORMAT,
    INDEX,
    SHARED_DATA_VERSION,
    VERSION,
    dtype_name,
    piece_key,
    sha256_file,
    shape_json,
    slice_file,
)
from meshtorch.checkpoint.index import CHECKSUM, index_checksum
from meshtorch.checkpoint.state import rng_state, scalar_json, to_json
from meshtorch.checkpoint.versions import commit, latest, mark_live, temp_path, writer_tag
from meshtorch.comm.base import all_texts
from meshtorch.context import current
from meshtorch.errors import ArgumentError, CheckpointError
from meshtorch.files import fsync_dir, replacing, write_atomic
from meshtorch.nn.module import Module
from meshtorch.optim.params import view_of
from meshtorch.shape import Shape
from meshtorch.tensor import MeshTensor, layout_for


def model_tensors(model: torch.nn.Module) -> list[tuple[str, MeshTensor]]:
    """``("model/<param>", view)`` for every parameter of ``model``."""
    if isinstance(model, Module):
        items = model.named_mesh_parameters()
    else:
        items = ((n, view_of(p)) for n, p in model.named_parameters())
    return [(f"model/{n}", v) for n, v in items]


def param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def state_shape(optimizer, p: torch.Tensor, key: str, value: torch.Tensor, name: str) -> Shape:
    """The named shape of optimizer state ``key`` of parameter ``name``."""
    hook = getattr(optimizer, "state_shape", None)
    shape = hook(p, key) if hook is not None else None
    if shape is not None:
        return shape
    view = view_of(p)
    if tuple(value.shape) == tuple(p.shape):
        return view.shape
    raise CheckpointError(
        f"optimizer {type(optimizer).__name__} keeps state {key!r} of parameter {name!r} with local "
        f"shape {list(value.shape)}, unlike the parameter's {list(p.shape)}; give the optimizer a "
        "state_shape(param, key) -> Shape method so the checkpoint knows its named dims"
    )


def optimizer_content(optimizer, model) -> tuple[list[tuple[str, MeshTensor]], dict]:
    """Optimizer state as named tensors (sharded like parameters) plus JSON (groups, scalars)."""
    names = param_names(model)
    tensors, scalars, groups = [], {}, []
    for gi, group in enumerate(optimizer.param_groups):
        pnames = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"optimizer group {gi} holds a parameter that is not in the "
                                      "model; save the model that owns the optimizer's parameters")
            name = names[id(p)]
            pnames.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    shape = state_shape(optimizer, p, key, value, name)
                    layout = layout_for(shape)
                    tensors.append((f"optim/{name}/{key}", MeshTensor(value, shape, layout)))
                elif isinstance(value, torch.Tensor):
                    scalars.setdefault(name, {})[key] = scalar_json(value)
                else:
                    scalars.setdefault(name, {})[key] = {"json": to_json(value, f"state {key!r}")}
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**to_json(hyper, f"optimizer group {gi}"), "params": pnames})
    return tensors, {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}


def _write_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    with replacing(path) as tmp:
        safetensors.torch.save_file(tensors, tmp)


def _write_slices(tmp: str, rank: int, mine: dict[str, torch.Tensor]) -> str | None:
    """Write processor ``rank``'s slices into ``tmp`` durably; their file's sha256 (``None``: no slices)."""
    if not mine:
        return None
    fpath = os.path.join(tmp, slice_file(rank))
    _write_file(fpath, mine)
    return sha256_file(fpath)


def _commit_index(path: str, tmp: str, index: dict, digests: dict[int, str | None], step: int | None,
                  keep: int, tag: str) -> str:
    """Processor 0: record every file's sha256 in the index, write it, and commit the version."""
    for rank in sorted(digests):
        if digests[rank] is not None:
            index["files"][slice_file(rank)] = {"sha256": digests[rank]}
    index[CHECKSUM] = index_checksum(index)
    write_atomic(os.path.join(tmp, INDEX), json.dumps(index, indent=1).encode())
    return commit(path, tmp, step, keep, tag)


def from_rank0(text: str, src: int = 0) -> str:
    """Processor ``src``'s ``text`` (at most 512 bytes), on every processor (every processor calls it)."""
    comm = current().comm
    raw = text.encode()[:512]
    t = torch.zeros(512, dtype=torch.uint8)
    t[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    t = comm.broadcast(t, comm.mesh.axis_names, src)
    return bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")


def processors_agree(state: int) -> int:
    """The largest ``state`` of all processors (every processor calls it): 0 where all are fine."""
    comm = current().comm
    flag = torch.tensor([float(state)])
    return int(comm.all_reduce(flag, comm.mesh.axis_names, "max").item())


def first_failure(error: BaseException | None) -> str | None:
    """``None`` where no processor failed, else ``"processor R: <its error>"`` of the lowest failing
    processor R, on every processor (every processor calls it), so each can say why."""
    ctx = current()
    size = ctx.mesh.size
    agreed = processors_agree(0 if error is None else size - ctx.rank)
    if not agreed:
        return None
    failed = size - agreed
    text = from_rank0(f"{type(error).__name__}: {error}" if error is not None else "", failed)
    return f"processor {failed}: {text}"


def agree(error: BaseException | None, message: str) -> None:
    """Every processor learns whether any failed (:func:`first_failure`, a collective): the failing
    one raises its own error, the others a CheckpointError of ``message`` naming it (``{why}``)."""
    why = first_failure(error)
    if why is not None:
        if error is not None:
            raise error
        raise CheckpointError(message.replace("{why}", str(why)))  # (a path may hold braces)


def _token() -> str:
    """A fresh temp-file token chosen by processor 0 and broadcast to all."""
    return from_rank0(secrets.token_hex(8))


def _all_ok(ok: bool) -> bool:
    return processors_agree(0 if ok else 1) == 0


def wait() -> str | None:
    """Wait for this processor's save in flight (``mt.save(..., background=True)``); all processors call it.

    Returns the directory of the version it wrote (``None`` if no save was in flight). If it
    failed on any processor, every processor raises :class:`~meshtorch.errors.CheckpointError`,
    and the checkpoint path still loads the newest complete version.

    Example:
        >>> import tempfile, os, meshtorch as mt
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> mt.save(path, model=mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2)), step=3, background=True)
        >>> os.path.basename(mt.checkpoint.wait()), mt.checkpoint.wait()
        ('step-000003', None)
    """
    job = collect(current().key)
    if job is None:
        return None
    if not _all_ok(job.error is None):
        error = job.error
        where = "" if error is None else f": {type(error).__name__}: {error}"
        raise CheckpointError(f"the background save of checkpoint {job.work.path!r} failed on some "
                              f"processor{where}; mt.load({job.work.path!r}) reads the newest complete "
                              "checkpoint") from error
    return latest(job.work.path)


class _BackgroundWrite:
    """What a processor's thread does for a background save (:mod:`~meshtorch.checkpoint.background`)."""

    def __init__(self, path, tmp, rank, size, mine, index, step, keep, tag):
        self.path, self.tmp, self.rank, self.size, self.mine = path, tmp, rank, size, mine
        self.index, self.step, self.keep, self.tag = index, step, keep, tag

    def __call__(self) -> str | None:
        if self.rank != 0:
            digest, error = None, None
            try:
                digest = _write_slices(self.tmp, self.rank, self.mine)
            except BaseException as e:  # noqa: BLE001 - processor 0 learns of it from the marker
                error = e
            self.mine = {}
            write_marker(self.tmp, self.rank, digest, error)
            if error is not None:
                raise error
            return None
        try:
            digests: dict[int, str | None] = {}
            error: BaseException | None = None
            try:
                digests[0] = _write_slices(self.tmp, 0, self.mine)
            except BaseException as e:  # noqa: BLE001 - the others' files are awaited before cleaning up
                error = e
            self.mine = {}
            for rank, marker in wait_markers(self.tmp, range(1, self.size)).items():
                if "error" in marker and error is None:
                    error = CheckpointError(f"processor {rank} failed to write its slices: {marker['error']}")
                digests[rank] = marker.get("sha256")
            if error is not None:
                raise error
            return _commit_index(self.path, self.tmp, self.index, digests, self.step, self.keep, self.tag)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            mark_live(self.tmp, False)


def save(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: Any = None,
         scheduler: Any = None, step: int | None = None, data: Any = None,
         extra: dict | None = None, keep: int = 2, background: bool = False) -> str | None:
    """Write a new checkpoint version under ``path`` and return its directory (every processor calls it).

    Each processor writes the slices it owns (a replicated region is written
    by the processor at coordinate 0 along the replicated axes only) into a
    temporary directory inside ``path``; processor 0 writes ``index.json``
    with a sha256 per file and of the index itself, renames the directory to
    ``path/step-<step>`` and then atomically replaces the pointer
    ``path/latest``, which is what :func:`~meshtorch.checkpoint.load` reads.
    Every file and directory is fsynced before the pointer moves, so a crash
    at any instant leaves ``path`` loading either the previous checkpoint or
    this one. If any processor fails, the pointer is not moved and every
    processor raises :class:`~meshtorch.errors.CheckpointError`.

    Args:
        model: the model; parameters are saved with their named shapes.
        optimizer: a ``torch.optim`` optimizer over ``model.parameters()``.
        scheduler: anything with a JSON-able ``state_dict()`` (LR schedulers).
        step: the training step, returned by :func:`~meshtorch.checkpoint.load`
            and naming the version directory (``step-000300``).
        data: the data position: a JSON value or an object with ``state_dict()``,
            each processor's own (where processors read their own rows, their
            positions differ, and each is saved; see :func:`~meshtorch.checkpoint.load`).
        extra: more JSON values (e.g. ``{"scaler": scaler.state_dict()}``).
        keep: how many versions to keep, newest first; older ones are deleted
            once this one is committed, as are temporary directories of crashed
            saves on this host.
        background: copy the state to host memory now and write the files on
            a background thread (see :mod:`~meshtorch.checkpoint.background`);
            returns ``None`` at once. The files are the same bytes a
            synchronous save writes. A save still in flight is waited for first
            (by every save), and its failure raises at the next save or at
            :func:`~meshtorch.checkpoint.wait`, which returns the directory.
    """
    if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1:
        raise ArgumentError(f"mt.save(keep={keep!r}): keep is how many checkpoints to keep and must be "
                            "an integer >= 1")
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0):
        raise ArgumentError(f"mt.save(step={step!r}): step must be an integer >= 0 or None")
    if not isinstance(background, bool):
        raise ArgumentError(f"mt.save(background={background!r}) must be True or False")
    keep, step = int(keep), None if step is None else int(step)
    ctx = current()
    mesh = ctx.mesh
    path = os.fspath(path)
    wait()  # at most one save in flight; an earlier background save's failure raises here
    # processor 0 writes the index and commits, so the temp directory bears its host and process id
    tag = from_rank0(writer_tag(secrets.token_hex(8)))
    tmp = temp_path(path, "tmp", tag)
    error: BaseException | None = None
    digest = torch.zeros(33, dtype=torch.uint8)
    index: dict = {}
    # a collective: before anything that may fail on some processors only (their data= values)
    rng = rng_state(gather=True)
    try:
        entries = model_tensors(model)
        opt_json = None
        if optimizer is not None:
            opt_entries, opt_json = optimizer_content(optimizer, model)
            entries += opt_entries
        position = to_json(data.state_dict() if hasattr(data, "state_dict") else data, "data")
        index = _index(entries, mesh, ctx.rules, step, extra, scheduler, opt_json, rng)
        if ctx.rank == 0:
            _make_dirs(path)
            mark_live(tmp, True)
            os.mkdir(tmp)
    except BaseException as e:  # noqa: BLE001 - every processor must learn of it below
        error = e
    try:
        why = first_failure(error)
        if why is not None:
            raise CheckpointError(f"saving checkpoint {path!r} failed before writing on {why}; nothing "
                                  "was changed") from error
        index.update(_data_fields(position))  # a collective: every processor's own position
        return _write_and_commit(ctx, path, tmp, tag, entries, index, step, keep, background, digest)
    except BaseException:
        # a failure, or a collective that raised on the way (the launch abandoned, Ctrl-C: also the
        # check above, which a processor's interrupt can abandon right after the directory was made):
        # no temporary directory of this process is left behind
        _discard(tmp)  # (no background writer was started: it owns the directory once started)
        raise


def _write_and_commit(ctx, path: str, tmp: str, tag: str, entries, index: dict, step: int | None, keep: int,
                      background: bool, digest: torch.Tensor) -> str | None:
    """The part of :func:`save` after the temporary directory exists: write the slices, then commit
    (or hand the snapshot to the background writer)."""
    comm, mesh = ctx.comm, ctx.mesh
    everyone = mesh.axis_names
    error: BaseException | None = None
    try:
        mine = {}
        for name, view in entries:
            if all(ctx.coords[a] == 0 for a in view.layout.replicated_axes()):
                start = [s for s, _ in view.layout.slices(ctx.coords)]
                local = view.local.detach().contiguous()
                # a background save owns a host copy: the step loop goes on changing the original
                mine[piece_key(name, start)] = local.to("cpu", copy=True) if background else local.cpu()
        if not background:
            sha = _write_slices(tmp, ctx.rank, mine)
            if sha is not None:
                digest = torch.tensor([1] + list(bytes.fromhex(sha)), dtype=torch.uint8)
    except BaseException as e:  # noqa: BLE001
        error = e
    if background:  # every processor holds its snapshot, or none starts writing
        if not _all_ok(error is None):
            _discard(tmp)
            raise CheckpointError(f"saving checkpoint {path!r} failed before writing; nothing was "
                                  "changed") from error
        work = _BackgroundWrite(path, tmp, ctx.rank, mesh.size, mine, index, step, keep, tag)
        start_background(ctx.key, work)
        return None
    ok = _all_ok(error is None)
    if ok:
        digests = comm.all_gather(digest.reshape(1, -1), everyone, 0)
        if ctx.rank == 0:
            try:
                got = {rank: bytes(digests[rank][1:].tolist()).hex() if digests[rank][0] else None
                       for rank in range(mesh.size)}
                _commit_index(path, tmp, index, got, step, keep, tag)
            except BaseException as e:  # noqa: BLE001
                error = e
        ok = _all_ok(error is None)
    if not ok:
        _discard(tmp)
        comm.barrier()
        where = "" if error is None else f": {type(error).__name__}: {error}"
        raise CheckpointError(f"saving checkpoint {path!r} failed on some processor{where}; "
                              f"mt.load({path!r}) reads the newest complete checkpoint") from error
    mark_live(tmp, False)
    return latest(path)


def _make_dirs(path: str) -> None:
    """Create ``path`` (and its parents) durably: a new directory's entry is fsynced in its parent."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(os.path.abspath(path))
    _make_dirs(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint path {path!r} exists and is not a directory; pass a "
                                  "directory path to mt.save") from None
        return
    fsync_dir(parent)


def _discard(tmp: str) -> None:
    """Processor 0 removes its temporary directory of a failed save."""
    if current().rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        mark_live(tmp, False)


def _data_fields(position: Any) -> dict:
    """The index's data fields from every processor's ``position`` (every processor calls it):
    ``"data"``, processor 0's; and where the positions differ (each processor reads its own rows),
    ``"data_per_processor"``, each processor's in rank order, in an index of format version 3."""
    positions = [json.loads(t) for t in all_texts(current().comm, json.dumps(position))]
    if len({json.dumps(p, sort_keys=True) for p in positions}) == 1:
        return {"data": positions[0]}
    return {"data": positions[0], "data_per_processor": positions, "version": VERSION}


def _index(entries, mesh, rules, step, extra, scheduler, opt_json, rng) -> dict:
    tensors = {}
    for name, view in entries:
        pieces = []
        for rank in range(mesh.size):
            coords = mesh.coords(rank)
            if all(coords[a] == 0 for a in view.layout.replicated_axes()):
                sl = view.layout.slices(coords)
                start = [s for s, _ in sl]
                pieces.append({"file": slice_file(rank), "key": piece_key(name, start),
                               "start": start, "size": [n for _, n in sl]})
        tensors[name] = {"dims": shape_json(view.shape), "dtype": dtype_name(view.dtype),
                         "pieces": pieces}
    return {
        "format": FORMAT, "version": SHARED_DATA_VERSION, "mesh": str(mesh), "rules": str(rules),
        "step": step, "extra": to_json(extra, "extra"),
        "rng": rng,
        "scheduler": None if scheduler is None else to_json(scheduler.state_dict(), "scheduler"),
        "optimizer": opt_json, "tensors": tensors, "files": {},
    }
