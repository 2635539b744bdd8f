"""Versioned checkpoint directories behind an atomically replaced pointer.

A checkpoint path holds one directory per save (``step-000300/``) and the
pointer file ``latest``, a JSON list of the kept directories, newest first.
A save is committed by replacing the pointer (``os.replace``, then an fsync
of the directory), so at every instant ``latest`` names complete
checkpoints only: a crash before the replace leaves the previous pointer,
one after it the new one. Directories that fall out of the last ``keep`` are
deleted after the commit. Temporary entries carry the writer's host and
process id (``.tmp-<host>-<pid>-<token>``) so that a later save removes
those of crashed writers, and never those of a writer still running.

A path written by meshtorch before versioning (``index.json`` directly in
it) is the version ``"."``: it loads as before, and the next save keeps it
as the older checkpoint until ``keep`` drops it.

Example:
    >>> import tempfile, os, meshtorch as mt
    >>> from meshtorch.checkpoint.versions import latest
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2))
    >>> for step in (100, 200, 300):
    ...     _ = mt.save(path, model=model, step=step, keep=2)
    >>> sorted(os.listdir(path)), os.path.basename(latest(path))
    (['latest', 'step-000200', 'step-000300'], 'step-000300')
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading

from meshtorch.checkpoint.format import INDEX
from meshtorch.errors import CheckpointError
from meshtorch.files import fsync_dir, write_atomic

POINTER = "latest"
POINTER_FORMAT = "meshtorch-checkpoint-pointer"
LEGACY = "."  # the checkpoint written directly into the path, before versioned directories
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TEMP = re.compile(r"^\.(tmp|trash|latest-tmp)-(.+)-(\d+)-([0-9a-f]{16})$")

# temporary entries this process is writing right now (threads of one process share them)
_live: set[str] = set()
_live_lock = threading.Lock()
# a reader whose version a newer save pruned before it was opened resolves the pointer again, this often
ATTEMPTS = 16
# files opened relative to a held directory descriptor: a version reused by name is never mixed in
_DIR_FD = os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


def writer_tag(token: str) -> str:
    """``<host>-<pid>-<token>``: this process as the writer of temporary entries."""
    return f"{socket.gethostname()}-{os.getpid()}-{token}"


def temp_path(path: str, kind: str, tag: str) -> str:
    """``path/.<kind>-<tag>``: a temporary entry that names its writer (see :func:`writer_tag`)."""
    return os.path.join(path, f".{kind}-{tag}")


def mark_live(entry: str, live: bool) -> None:
    """Record that this process is (or is no longer) writing ``entry``."""
    with _live_lock:
        (_live.add if live else _live.discard)(os.path.abspath(entry))


def version_name(step: int | None, taken: set[str]) -> str:
    """``step-000300`` (``save`` without a step), suffixed ``-2``, ``-3``... if already taken."""
    base = "save" if step is None else f"step-{step:06d}"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}-{k}"
    return name


def read_pointer(path: str) -> list[str]:
    """The kept versions of the checkpoint at ``path``, newest first (``[]`` if there are none)."""
    ppath = os.path.join(path, POINTER)
    if not os.path.exists(ppath):
        return [LEGACY] if os.path.isfile(os.path.join(path, INDEX)) else []
    fix = (f"; the checkpoint pointer is corrupt: load one of the step directories in {path!r} "
           "directly (mt.load(path + '/step-...')) or delete the pointer file")
    try:
        with open(ppath, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint pointer {ppath}: {e}{fix}") from e
    if not isinstance(data, dict) or data.get("format") != POINTER_FORMAT:
        raise CheckpointError(f"{ppath} is not a meshtorch checkpoint pointer (no format "
                              f"{POINTER_FORMAT!r}){fix}")
    versions = data.get("versions")
    if not isinstance(versions, list) or not versions:
        raise CheckpointError(f"{ppath}: field 'versions' must be a non-empty list of directory "
                              f"names, got {versions!r}{fix}")
    for name in versions:
        if not isinstance(name, str) or not (name == LEGACY or _NAME.match(name)):
            raise CheckpointError(f"{ppath}: field 'versions' holds {name!r}, which is not the name of "
                                  f"a directory inside {path!r} (no '..', '/' or absolute paths){fix}")
    return versions


def inside(root: str, target: str) -> bool:
    """Whether ``target`` (symlinks resolved) is ``root`` or lies under it."""
    root, target = os.path.realpath(root), os.path.realpath(target)
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def latest(path: str | os.PathLike) -> str:
    """The directory of the checkpoint that ``mt.load(path)`` reads: the newest kept version.

    A save that commits between reading the pointer and looking at the directory it names
    (and, with ``keep=1``, prunes that directory) makes it read the pointer again.

    Example:
        >>> import tempfile, os, meshtorch as mt
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = mt.save(path, model=mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2)), step=7)
        >>> os.path.relpath(mt.checkpoint.latest(path), path)
        'step-000007'
    """
    path = os.fspath(path)
    for _ in range(ATTEMPTS):
        versions = read_pointer(path) if os.path.isdir(path) else []
        if not versions:
            hint = " (it is not a directory)" if os.path.exists(path) and not os.path.isdir(path) else ""
            fix = "save one with mt.save(path, model=...)"
            if any(os.path.exists(os.path.join(path, f)) for f in ("model.safetensors",
                                                                    "model.safetensors.index.json")):
                fix = ("it holds a consolidated model.safetensors (mt.export_consolidated, export_hf): "
                       "read that with mt.import_consolidated or meshtorch.models.from_hf")
            raise CheckpointError(f"no checkpoint at {path!r}{hint}: it has neither a {POINTER} pointer nor "
                                  f"an {INDEX}; {fix}")
        if versions[0] == LEGACY:
            return path
        target = os.path.join(path, versions[0])
        if not os.path.isdir(target):
            if read_pointer(path)[:1] != versions[:1]:
                continue  # a save moved the pointer on (and pruned this version) meanwhile
            raise CheckpointError(f"checkpoint pointer {os.path.join(path, POINTER)} names {versions[0]!r}, "
                                  f"which is not a directory in {path!r}; the checkpoint was damaged after "
                                  f"it was written — load an older one of {versions[1:]} directly")
        if not inside(path, target):
            raise CheckpointError(f"checkpoint directory {target} is a symlink to "
                                  f"{os.path.realpath(target)}, outside {path!r}; a checkpoint only reads "
                                  "files inside its own directory")
        return target
    raise _moving(path)


def _moving(path: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint at {path!r} got {ATTEMPTS} newer versions while it was being "
                           "opened (saves with a small keep= pruned each one before it was read); load "
                           "again, or save with a larger keep=")


class OpenVersion:
    """One version directory held open: what is read through it cannot change or vanish.

    A version's files are never modified after its commit, only deleted when
    ``keep`` prunes it, and a file that is open stays readable after it is
    deleted. Files are opened relative to the directory's own descriptor
    (where the OS can), so a version pruned and then written again under the
    same name (saves without ``step``) is never mixed into what was opened
    first: every byte read comes from the one directory that was resolved.
    Opening raises ``FileNotFoundError`` when the version was pruned; then
    :meth:`pruned` tells a pruned version from a damaged one.

    Example:
        >>> import tempfile, os, meshtorch as mt
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = mt.save(path, model=mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2)), step=1, keep=1)
        >>> v = OpenVersion(path, latest(path))
        >>> fd = v.open("index.json")
        >>> _ = mt.save(path, model=mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2)), step=2, keep=1)
        >>> os.listdir(path), os.read(fd, 1), v.pruned()
        (['latest', 'step-000002'], b'{', True)
        >>> os.close(fd); v.close()
    """

    def __init__(self, root: str, directory: str):
        self.root, self.dir = os.fspath(root), os.fspath(directory)
        self.fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY) if _DIR_FD else None

    def open(self, fname: str) -> int:
        """A read-only descriptor of file ``fname`` of this version."""
        if self.fd is not None:
            return os.open(fname, os.O_RDONLY, dir_fd=self.fd)
        return os.open(os.path.join(self.dir, fname), os.O_RDONLY | getattr(os, "O_BINARY", 0))

    def pruned(self) -> bool:
        """Whether a newer save's ``keep`` dropped this version (the pointer no longer names it)."""
        if not os.path.isdir(self.root):
            return True
        try:
            names = read_pointer(self.root)
        except CheckpointError:
            return False
        name = os.path.relpath(self.dir, self.root)
        return name not in names or not os.path.isdir(self.dir)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def open_latest(path: str | os.PathLike) -> OpenVersion:
    """The newest version of the checkpoint at ``path``, held open (see :class:`OpenVersion`)."""
    path = os.fspath(path)
    for _ in range(ATTEMPTS):
        target = latest(path)
        try:
            return OpenVersion(path, target)
        except FileNotFoundError:  # pruned between the pointer and the open: the pointer moved on
            continue
    raise _moving(path)


def commit(path: str, tmp: str, step: int | None, keep: int, tag: str) -> str:
    """Move the complete checkpoint ``tmp`` into ``path`` as a new version and make it the latest.

    Returns its directory. Before the pointer is replaced, ``path`` still loads the previous
    checkpoint; after, the new one. Versions beyond the newest ``keep`` are then deleted.
    """
    old = read_pointer(path)
    name = version_name(step, set(old) | set(os.listdir(path)))
    final = os.path.join(path, name)
    new = [name] + old[:keep - 1]
    pointer_tmp = temp_path(path, "latest-tmp", tag)
    mark_live(pointer_tmp, True)
    try:
        os.rename(tmp, final)
        # the version's name is on the disk before the pointer names it: the pointer's replace below
        # is flushed by write_atomic's own fsync of this directory, and POSIX orders no two renames,
        # so without this one a power loss could keep the new pointer and forget this rename
        fsync_dir(path)
        # a temporary pointer that names its writer: a later save removes one a crash left behind
        write_atomic(os.path.join(path, POINTER), json.dumps({"format": POINTER_FORMAT, "versions": new},
                                                             indent=1).encode(), temporary=pointer_tmp)
    except BaseException:
        # the previous pointer stands (write_atomic removed its temporary file), and the new directory
        # is nobody's; a pointer already replaced, whose directory's fsync then failed, names it
        if not _names_first(path, name):
            _remove(final)
        raise
    finally:
        mark_live(pointer_tmp, False)
    try:  # garbage collection: a failure here loses nothing the pointer names
        for name in old:
            if name not in new:
                _drop(path, name, tag)
        clean_stale(path)
    except OSError:
        pass
    return final


def _names_first(path: str, name: str) -> bool:
    """Whether the pointer in ``path`` names version ``name`` as the newest."""
    try:
        return read_pointer(path)[:1] == [name]
    except CheckpointError:
        return False


def _drop(path: str, name: str, tag: str) -> None:
    """Delete version ``name``, which the pointer no longer names (best effort: it is garbage)."""
    if name == LEGACY:
        # its index goes first: from then on the leftover slices are not a loadable checkpoint
        for fname in [INDEX] + sorted(f for f in os.listdir(path) if f.startswith("slices-")):
            _remove(os.path.join(path, fname))
        return
    # renamed in one step to a temporary name, so a crash mid-delete leaves a stale temp entry
    trash = temp_path(path, "trash", tag)
    try:
        os.rename(os.path.join(path, name), trash)
    except OSError:
        return
    _remove(trash)


def _remove(entry: str) -> None:
    if os.path.isdir(entry) and not os.path.islink(entry):
        shutil.rmtree(entry, ignore_errors=True)
    else:
        try:
            os.remove(entry)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        return True
    return True


def clean_stale(path: str) -> list[str]:
    """Remove the temporary entries in ``path`` left by crashed saves; return their names.

    An entry is certainly stale when its writer ran on this host and that process is gone,
    or is this process and no longer writing it. Entries of other hosts are left alone.
    """
    host, me = socket.gethostname(), os.getpid()
    removed = []
    for fname in sorted(os.listdir(path)):
        m = _TEMP.match(fname)
        if m is None or m.group(2) != host:
            continue
        entry = os.path.join(path, fname)
        pid = int(m.group(3))
        with _live_lock:
            live = os.path.abspath(entry) in _live
        if (pid == me and not live) or (pid != me and not _alive(pid)):
            _remove(entry)
            removed.append(fname)
    return removed
