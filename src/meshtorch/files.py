"""Writing a file so that a reader (another processor of the run, a rerun, another user of a shared
run directory) sees the old file or the whole new one, never a part, with the mode ``open`` gives.

Every file meshtorch writes goes through :func:`replacing`: a checkpoint's slices, index, pointer
(committed by :mod:`meshtorch.checkpoint.versions`) and background-save markers, the consolidated
safetensors export, the tokenizer files an export copies, and through it :func:`write_atomic` (a
tokenizer, metrics, ``summary.json``, the encoded-corpus cache, a device file of ``meshtorch plan
--calibrate``, a placement graph's JSON, the probe of a shared run directory) and :func:`save_figure`
(every plot). Only ``metrics.jsonl``'s per-step lines are appended in place: a log grows by a line.

Example:
    >>> import os, tempfile
    >>> from meshtorch.files import replacing, write_atomic
    >>> path = os.path.join(tempfile.mkdtemp(), "notes.txt")
    >>> write_atomic(path, b"one\\n")
    >>> with replacing(path) as tmp:
    ...     with open(tmp, "w") as f:
    ...         _ = f.write("two\\n")
    >>> open(path).read(), os.listdir(os.path.dirname(path))
    ('two\\n', ['notes.txt'])
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any


def usual_mode() -> int:
    """The mode ``open`` gives a new file in this process (``0o666`` less the umask): what a file
    written through a temporary one gets (``tempfile.mkstemp`` and safetensors make theirs ``0o600``,
    which another user of a shared run directory could not read).

    Example:
        >>> usual_mode() & 0o600
        384
    """
    try:  # Linux says the umask without changing it (os.umask would, for every thread at once)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def replacing(path: str | os.PathLike, temporary: str | None = None) -> Iterator[str]:
    """A temporary file's path beside ``path`` for the body to write (by name, as safetensors does);
    on leaving, that file gets :func:`usual_mode`, is flushed to the disk and replaces ``path`` in
    one ``os.replace``, and the directory is flushed (:func:`fsync_dir`). If the body raises,
    ``path`` is untouched and the temporary file removed. The result is a new file: a ``path``
    that existed loses its own mode (it gets the usual one) and, where it was a symbolic link, is
    replaced, not written through.

    The temporary name starts with a dot and the target's name, so a listing of the directory
    shows which file it was for; it is unique per writer (``tempfile.mkstemp``). A caller that names
    its temporary files (a checkpoint's pointer names its writer, so that a later save removes the
    one a crashed writer left) passes ``temporary``, a new path in ``path``'s directory.
    """
    path = os.fspath(path)
    if temporary is None:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
    else:
        tmp = os.fspath(temporary)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # as mkstemp: never another's file
    os.close(fd)
    # (no fsync of the directory for the temporary name: nothing reads it, and a power loss that
    # forgets it loses nothing; the one fsync atomicity needs comes after the replace)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDWR)  # writable: Windows flushes only a handle that may write
        try:
            os.fsync(fd)  # the data is on the disk before the name points at it
        finally:
            os.close(fd)
        os.chmod(tmp, usual_mode())  # as open() would make it, not mkstemp's or safetensors' 0o600
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")  # the new name survives a power loss too
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes, temporary: str | None = None) -> None:
    """Write ``data`` to ``path`` through :func:`replacing` (``temporary``: its temporary file's path).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a.json")
        >>> write_atomic(path, b"{}")
        >>> open(path).read()
        '{}'
    """
    with replacing(path, temporary) as tmp, open(tmp, "wb") as f:
        f.write(data)


def save_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> None:
    """``fig.savefig(path, **savefig)`` through :func:`replacing`, in the format ``path``'s suffix
    names (matplotlib's default, ``savefig.format``, where it has none) unless ``format=`` is given.

    Example:
        >>> import os, tempfile
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, _ = plt.subplots()
        >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
        >>> save_figure(fig, path, dpi=50)
        >>> plt.close(fig)
        >>> open(path, "rb").read(4), os.listdir(os.path.dirname(path))
        (b'\\x89PNG', ['loss.png'])
    """
    # the temporary name ends in .tmp, which matplotlib would take for the format
    fmt = savefig.pop("format", None) or os.path.splitext(os.fspath(path))[1][1:] or None
    with replacing(path) as tmp, open(tmp, "wb") as f:
        fig.savefig(f, format=fmt, **savefig)


def fsync_dir(path: str) -> None:
    """Flush directory ``path``'s entries (a rename or a new file in it) to the disk.

    Without it a power loss can forget a rename that ``os.replace`` already reported.
    """
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a directory; NTFS journals renames
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
