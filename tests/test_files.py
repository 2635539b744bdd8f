"""meshtorch.files: every writer of a run's files goes through one temporary file that gets the usual
mode and reaches the disk before it replaces the target."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import meshtorch as mt
from meshtorch.files import replacing, usual_mode, write_atomic


def replace_fails(monkeypatch, name: str) -> None:
    """From now on ``os.replace`` onto a file called ``name`` fails (a full disk, a lost mount); the
    writers of other files go on as usual."""
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(os.fspath(dst)) == name:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", os.fspath(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def files_under(directory) -> dict[str, bytes]:
    """Every file under ``directory`` (its path relative to it) and its bytes."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return found


def caused_by_oserror(error: BaseException | None) -> bool:
    """Whether ``error`` is an OSError or was raised from one (a writer may wrap it in its own error)."""
    while error is not None:
        if isinstance(error, OSError):
            return True
        error = error.__cause__ or error.__context__
    return False


def a_failed_replace_keeps_everything(monkeypatch, directory, name: str, write) -> None:
    """``write()``, with the replace of its file ``name`` failing, raises from that failure and leaves
    every file under ``directory`` as it was: the old ``name`` whole (or still absent) and no temporary
    file behind."""
    before = files_under(directory)
    with monkeypatch.context() as m:
        replace_fails(m, name)
        with pytest.raises(Exception) as e:  # noqa: PT011 - the writer's own error, raised from the OSError
            write()
    assert caused_by_oserror(e.value), e.value
    assert files_under(directory) == before


def test_each_writer_flushes_its_temporary_file_then_replaces_the_target(tmp_path, monkeypatch):
    """A checkpoint's slices, the consolidated export and write_atomic: each file they leave came in
    by one os.replace of a temporary file beside it that was fsynced and had the usual mode by then
    (without the fsync a power loss can leave the new name on an empty file)."""
    synced: set[int] = set()  # inodes
    replaced: dict[str, tuple[bool, int]] = {}  # target -> (its data fsynced first, mode)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    def replace(src, dst):
        st = os.stat(src)
        assert os.path.dirname(os.fspath(src)) == os.path.dirname(os.fspath(dst))
        replaced[os.path.basename(os.fspath(dst))] = (st.st_ino in synced, st.st_mode & 0o777)
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2))
    mt.save(str(tmp_path / "ckpt"), model=model, step=1)
    mt.export_consolidated(str(tmp_path / "hf"), model)
    write_atomic(str(tmp_path / "metrics.jsonl"), b"{}\n")
    for name in ("slices-00000.safetensors", "model.safetensors", "metrics.jsonl"):
        assert replaced.get(name) == (True, usual_mode()), (name, replaced)


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        torch.save({"w": torch.ones(2)}, tmp)
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.safetensors"]
    a_failed_replace_keeps_everything(monkeypatch, tmp_path, "model.safetensors",
                                      lambda: write_atomic(path, b"new"))


@pytest.mark.skipif(not hasattr(os, "O_DIRECTORY"), reason="a directory cannot be fsynced on Windows")
def test_the_directory_is_flushed_after_the_replace(tmp_path, monkeypatch):
    """A power loss after write_atomic returns keeps the new name: the directory's entry is fsynced
    after the os.replace (as a checkpoint's commit does), not only the file's data."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_atomic(tmp_path / "tokenizer.json", b"{}")
    assert events == ["file", "replace", "dir"], events


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="names a flushed directory by /proc")
def test_a_checkpoints_version_is_flushed_under_its_name_before_the_pointer_names_it(tmp_path, monkeypatch):
    """A save's commit: the version directory's rename is fsynced in the checkpoint's directory before
    the pointer is replaced there, and the pointer's replace is fsynced after (POSIX orders no two
    renames: with only the last fsync a power loss could keep the new pointer and lose the version)."""
    root = str(tmp_path / "ckpt")
    events: list[str] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(root):
            events.append("fsync root")
        real_fsync(fd)

    def replace(src, dst):
        if os.path.dirname(os.fspath(dst)) == root:
            events.append(f"replace {os.path.basename(os.fspath(dst))}")
        real_replace(src, dst)

    def rename(src, dst):
        if os.path.dirname(os.fspath(dst)) == root:
            events.append(f"rename {os.path.basename(os.fspath(dst))}")
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    mt.save(root, model=mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2)), step=7)
    commit = events[events.index("rename step-000007"):]
    assert commit == ["rename step-000007", "fsync root", "replace latest", "fsync root"], events
