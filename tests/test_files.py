"""meshtorch.files: every writer of a run's files goes through one temporary file that gets the usual
mode and reaches the disk before it replaces the target."""

from __future__ import annotations

import os

import pytest
import torch

import meshtorch as mt
from meshtorch.files import replacing, usual_mode, write_atomic


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


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "model.safetensors"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        torch.save({"w": torch.ones(2)}, tmp)
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.safetensors"]


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
