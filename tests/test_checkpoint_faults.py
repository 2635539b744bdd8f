"""Checkpoints under faults: a failure or a crash at every file operation of a save, a kill -9 during
a real training run, and every field of the index corrupted. Nothing complete is ever lost."""

from __future__ import annotations

import copy
import inspect
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch import cli
from meshtorch.checkpoint.format import INDEX
from meshtorch.checkpoint.index import CHECKSUM, check_index, index_checksum, read_index
from meshtorch.checkpoint.versions import POINTER, clean_stale, mark_live, read_pointer
from meshtorch.errors import CheckpointError
from run_harness import assert_same_bits, checkpoint_tensors, tiny_train, write_corpus

pytestmark = pytest.mark.timeout(300)

MESH, RULES = "m:2", "h:m"
# the file operations a save makes; a fault or a crash is injected before each call
OPS = ("rename", "replace", "fsync", "mkdir", "unlink", "remove", "rmdir")


def make() -> mt.nn.Module:
    h = mt.Dim("h", 6)
    return mt.nn.Sequential(mt.nn.Dense(mt.Dim("d", 4), h), mt.nn.Dense(h, mt.Dim("o", 2)))


def weights(step: int) -> dict[str, torch.Tensor]:
    """What the checkpoint of ``step`` holds: the model initialised with seed ``step`` (one processor)."""
    return {n: v.to_global().clone() for n, v in make().reset_parameters(seed=step).named_mesh_parameters()}


def save(root: str, step: int, keep: int = 2) -> None:
    mt.launch(lambda: mt.save(root, model=make().reset_parameters(seed=step), step=step, keep=keep) and None,
              mesh=MESH, rules=RULES)


def loaded(path: str) -> tuple[int, dict[str, torch.Tensor]]:
    model = make()
    step = mt.load(path, model=model)["step"]
    return step, {n: v.to_global() for n, v in model.named_mesh_parameters()}


def assert_holds(path: str, step: int) -> None:
    """``path`` loads bitwise the checkpoint saved at ``step``."""
    got, values = loaded(path)
    assert got == step
    want = weights(step)
    assert sorted(values) == sorted(want)
    for k in want:
        assert torch.equal(values[k], want[k]), k


def temp_entries(root: str) -> list[str]:
    return [f for f in os.listdir(root) if f.startswith(".")]


def kept_steps(root: str) -> list[int]:
    return [int(v.removeprefix("step-")) for v in read_pointer(root)]


def in_checkpoint(frame) -> bool:
    """Whether ``frame`` runs checkpoint code (also through shutil.rmtree): so a run in any process
    counts the same file operations, whatever else it imports or writes."""
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("meshtorch.checkpoint"):
            return True
        frame = frame.f_back
    return False


class Hooks:
    """Count the checkpoint code's file operations (all threads); call ``before(k, op)`` ahead of the k-th."""

    def __init__(self, monkeypatch, before):
        self.calls, self.before, self.ops = 0, before, []
        self.lock, self.inside = threading.Lock(), threading.local()
        for op in OPS:
            monkeypatch.setattr(os, op, self._wrap(op, getattr(os, op)))

    def _wrap(self, op, real):
        def hooked(*args, **kwargs):
            if not getattr(self.inside, "on", False) and in_checkpoint(sys._getframe(1)):
                # one operation at a time over all threads, ``before`` included: a snapshot of the
                # directory (shutil.copytree) is not atomic, and another processor's thread renaming
                # its slice file in the middle of it made the copy fail (ENOENT), not the checkpoint
                with self.lock:
                    k = self.calls
                    self.calls += 1
                    self.ops.append((op, args))
                    self.inside.on = True
                    try:
                        self.before(k, op)
                    finally:
                        self.inside.on = False
                    return real(*args, **kwargs)
            return real(*args, **kwargs)

        return hooked


def count_ops(monkeypatch, root: str, step: int) -> int:
    scratch = tempfile.mkdtemp()
    shutil.copytree(root, os.path.join(scratch, "c"))
    with monkeypatch.context() as m:
        hooks = Hooks(m, lambda k, op: None)
        save(os.path.join(scratch, "c"), step)
    shutil.rmtree(scratch)
    return hooks.calls


@pytest.fixture
def two_saved(tmp_path):
    """A checkpoint path holding steps 1 and 2 (keep=2), and a pristine copy of it."""
    root = str(tmp_path / "ckpt")
    save(root, 1)
    save(root, 2)
    assert kept_steps(root) == [2, 1]
    pristine = str(tmp_path / "pristine")
    shutil.copytree(root, pristine)
    return root, pristine


def test_a_failure_at_every_file_operation_loses_nothing(two_saved, monkeypatch):
    root, pristine = two_saved
    n = count_ops(monkeypatch, root, 3)
    assert n >= 8  # slice files, index, directories, rename, pointer, deleting step 1
    outcomes = set()
    for fail_at in range(n):
        shutil.rmtree(root)
        shutil.copytree(pristine, root)

        def fault(k, op, fail_at=fail_at):
            if k == fail_at:
                raise OSError(f"injected failure of os.{op} (call {k})")

        with monkeypatch.context() as m:
            Hooks(m, fault)
            try:
                save(root, 3)
                outcomes.add("saved")
            except CheckpointError:
                outcomes.add("failed")
        # the latest complete checkpoint loads bitwise, and every kept one still does
        kept = kept_steps(root)
        assert kept in ([3, 2], [2, 1]), (fail_at, kept)
        for s in kept:
            assert_holds(os.path.join(root, f"step-{s:06d}"), s)
        assert_holds(root, kept[0])
        # the next save works and leaves no temporary entry behind
        save(root, 4)
        assert kept_steps(root) == [4, kept[0]] and temp_entries(root) == []
        assert_holds(root, 4)
    assert outcomes == {"saved", "failed"}  # failures before the commit, and after it (garbage collection)


def test_a_crash_at_every_instant_of_a_save_loses_nothing(two_saved, monkeypatch, tmp_path):
    root, pristine = two_saved
    snaps = str(tmp_path / "snaps")
    os.mkdir(snaps)

    def crash(k, op):  # the directory as a process killed right now would leave it
        shutil.copytree(root, os.path.join(snaps, f"{k:03d}-{op}"), symlinks=True)

    with monkeypatch.context() as m:
        hooks = Hooks(m, crash)
        save(root, 3)
    shutil.copytree(root, os.path.join(snaps, f"{hooks.calls:03d}-done"))
    states = sorted(os.listdir(snaps))
    assert len(states) == hooks.calls + 1 >= 9
    seen = []
    for name in states:
        crashed = os.path.join(snaps, name)
        kept = kept_steps(crashed)
        assert kept in ([3, 2], [2, 1]), (name, kept)
        seen.append(kept[0])
        for s in kept:
            assert_holds(os.path.join(crashed, f"step-{s:06d}"), s)
        assert_holds(crashed, kept[0])
        # the crashed save's temporary entries are stale (this process no longer writes them): the next
        # save removes them and keeps the newest complete checkpoint
        save(crashed, 4)
        assert kept_steps(crashed) == [4, kept[0]] and temp_entries(crashed) == [], name
        assert_holds(crashed, 4)
    assert seen == sorted(seen) and seen[0] == 2 and seen[-1] == 3  # the pointer moves once, forward


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.integers(1, 3), saves=st.integers(1, 5))
def test_keep_holds_the_newest_checkpoints(tmp_path_factory, keep, saves):
    root = str(tmp_path_factory.mktemp("keep") / "ckpt")
    for s in range(1, saves + 1):
        mt.save(root, model=make().reset_parameters(seed=s), step=s, keep=keep)
    want = list(range(saves, max(0, saves - keep), -1))
    assert kept_steps(root) == want
    assert sorted(os.listdir(root)) == sorted([POINTER] + [f"step-{s:06d}" for s in want])
    for s in want:
        assert_holds(os.path.join(root, f"step-{s:06d}"), s)
    # the same step saved again is a new version, not an overwrite of the one the pointer names
    mt.save(root, model=make().reset_parameters(seed=saves), step=saves, keep=keep)
    assert read_pointer(root)[0] == f"step-{saves:06d}-2"
    with pytest.raises(mt.errors.ArgumentError, match="keep"):
        mt.save(root, model=make(), step=1, keep=0)


def test_only_certainly_stale_temporary_entries_are_removed(tmp_path):
    root = str(tmp_path / "ckpt")
    mt.save(root, model=make(), step=1)
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    entries = {
        "dead": f".tmp-{host}-{dead.pid}-{'a' * 16}",         # its writer is gone: stale
        "trash": f".trash-{host}-{dead.pid}-{'b' * 16}",      # a half-deleted old version: stale
        "mine": f".tmp-{host}-{os.getpid()}-{'c' * 16}",      # this process, no longer writing: stale
        "live": f".tmp-{host}-{os.getpid()}-{'d' * 16}",      # this process, writing now: kept
        "parent": f".tmp-{host}-{os.getppid()}-{'e' * 16}",   # a running process: kept
        "remote": f".tmp-otherhost-{dead.pid}-{'f' * 16}",    # another host's writer: cannot tell, kept
    }
    for name in entries.values():
        os.mkdir(os.path.join(root, name))
    mark_live(os.path.join(root, entries["live"]), True)
    try:
        assert sorted(clean_stale(root)) == sorted(entries[k] for k in ("dead", "trash", "mine"))
    finally:
        mark_live(os.path.join(root, entries["live"]), False)
    assert sorted(temp_entries(root)) == sorted(entries[k] for k in ("live", "parent", "remote"))


def test_a_checkpoint_written_before_versioning_loads_and_is_kept_as_the_older_one(tmp_path):
    root = str(tmp_path / "ckpt")
    mt.save(root, model=make().reset_parameters(seed=1), step=1)
    # turn it into the old layout: index.json and slices directly in the path, format version 1
    version = os.path.join(root, "step-000001")
    for f in os.listdir(version):
        os.rename(os.path.join(version, f), os.path.join(root, f))
    os.rmdir(version)
    os.remove(os.path.join(root, POINTER))
    with open(os.path.join(root, INDEX)) as f:
        index = json.load(f)
    del index[CHECKSUM]
    index["version"] = 1
    with open(os.path.join(root, INDEX), "w") as f:
        json.dump(index, f)
    assert_holds(root, 1)
    mt.save(root, model=make().reset_parameters(seed=2), step=2, keep=2)
    assert read_pointer(root) == ["step-000002", "."]
    assert_holds(root, 2)
    mt.save(root, model=make().reset_parameters(seed=3), step=3, keep=2)  # drops the old layout's files
    assert sorted(os.listdir(root)) == [POINTER, "step-000002", "step-000003"]
    assert_holds(root, 3)


# --- a kill -9 during a real training run -------------------------------------------------------------

TINY = tiny_train(log_every=1, lr_schedule="constant", mesh="b:2", rules="batch:b", checkpoint_every=1,
                  steps=4)

# the run in a child process that SIGKILLs itself just before its checkpoint code's kill_at-th file operation
CHILD = inspect.getsource(in_checkpoint) + """
import os, signal, sys, threading
kill_at, calls, lock = int(sys.argv[1]), [0], threading.Lock()
def wrap(real):
    def hooked(*a, **k):
        if in_checkpoint(sys._getframe(1)):
            with lock:
                calls[0] += 1
                if calls[0] - 1 == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    return hooked
for op in OPS:
    setattr(os, op, wrap(getattr(os, op)))
from meshtorch import cli
cli.main(sys.argv[2:])
print("checkpoint file operations:", calls[0])
"""


def _losses(out: str) -> list[tuple[int, float]]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), files=6)


def test_kill_9_during_training_then_resume_equals_the_uninterrupted_run(corpus, tmp_path, monkeypatch):
    full = str(tmp_path / "full")
    with monkeypatch.context() as m:
        hooks = Hooks(m, lambda k, op: None)
        assert cli.main(["train", "--out", full, "--data", corpus, *TINY]) == 0
    total = hooks.calls  # the checkpoint code's file operations during the whole run
    first_commit = next(k for k, (op, args) in enumerate(hooks.ops)
                        if op == "replace" and str(args[1]).endswith(os.sep + POINTER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(19)
    # two drawn instants after the first checkpoint: the kill lands just before a drawn file operation,
    # mid-save (between writes, renames, the pointer's replace) or while old versions are deleted
    for kill_at in sorted(rng.sample(range(first_commit + 1, total), 2)):
        out = str(tmp_path / f"killed-{kill_at}")
        code = f"OPS = {OPS!r}\n{CHILD}"
        argv = [sys.executable, "-c", code, str(kill_at), "train", "--out", out, "--data", corpus, *TINY]
        child = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL, (kill_at, child.stdout[-500:], child.stderr[-2000:])
        start = read_index(os.path.join(out, "checkpoint"))["step"]
        assert 1 <= start <= 4
        assert cli.main(["train", "--resume", out, "--data", corpus, *TINY]) == 0
        assert _losses(out) == _losses(full)  # bitwise: the same floats, step for step
        assert_same_bits(checkpoint_tensors(out), checkpoint_tensors(full))
        # the killed save's leftovers are removed by the next save, or by clean_stale when none came
        ckpt = os.path.join(out, "checkpoint")
        if start == 4:
            leftovers = temp_entries(ckpt)
            assert sorted(clean_stale(ckpt)) == sorted(leftovers)
        assert temp_entries(ckpt) == []


# --- every field of the index corrupted ---------------------------------------------------------------

def _paths(value, prefix=()):
    """Every JSON path in ``value`` (dict keys and list positions), parents before children."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _at(value, path):
    for p in path:
        value = value[p]
    return value


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory):
    """A checkpoint with every kind of field: optimizer tensors and scalars, scheduler, data, extra."""
    root = str(tmp_path_factory.mktemp("full") / "ckpt")

    def run():
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
        mt.save(root, model=model, optimizer=opt, scheduler=sched, step=5, data={"pos": 5},
                extra={"note": "x"})

    mt.launch(run, mesh=MESH, rules=RULES)
    ckpt = mt.checkpoint.latest(root)
    with open(os.path.join(ckpt, INDEX)) as f:
        index = json.load(f)
    return ckpt, index, list(_paths(index))


def _assert_names_field(msg: str) -> None:
    """A corrupt index's error names the field and what is wrong, or the index's own checksum."""
    assert re.search(r"field \S+ (is missing|must|names|covers|is |holds)", msg) \
        or "checksum mismatch in checkpoint index" in msg or "not a meshtorch checkpoint index" in msg \
        or "newer than this meshtorch reads" in msg, msg


def _corrupt(bad: dict, path: tuple, how: str, value=None) -> None:
    parent, key = _at(bad, path[:-1]), path[-1]
    if how == "delete":
        del parent[key]
    else:
        parent[key] = value


def test_every_field_deleted_or_of_the_wrong_type_is_a_checkpoint_error(full_checkpoint):
    ckpt, index, paths = full_checkpoint
    ipath = os.path.join(ckpt, INDEX)
    tried = 0
    for path in paths:
        for how, value in [("delete", None), ("set", None), ("set", "x"), ("set", -1), ("set", [])]:
            bad = copy.deepcopy(index)
            _corrupt(bad, path, how, value)
            if json.dumps(bad, sort_keys=True) == json.dumps(index, sort_keys=True):
                continue
            with pytest.raises(CheckpointError) as e:
                check_index(bad, ipath)  # what read_index does after parsing the file
            msg = str(e.value)
            assert ipath in msg, msg
            _assert_names_field(msg)
            tried += 1
    assert tried > 4 * len(paths) > 400  # every key of every entry, tensors and pieces included


WRONG = [None, -1, 0, 7, 1.5, True, "x", "../../etc/passwd", "/abs/slices-00000.safetensors", [], {}, [[1]]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_corrupted_index_field_is_a_checkpoint_error_naming_file_and_field(full_checkpoint, data):
    ckpt, index, paths = full_checkpoint
    path = data.draw(st.sampled_from(paths), label="field")
    kind = data.draw(st.sampled_from(["delete", "wrong", "swap"]), label="corruption")
    bad = copy.deepcopy(index)
    parent, key = _at(bad, path[:-1]), path[-1]
    if kind == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif kind == "wrong":
        parent[key] = data.draw(st.sampled_from(WRONG), label="value")
    else:  # swap with a sibling: the keys (or positions) of two entries exchanged
        siblings = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        other = data.draw(st.sampled_from(siblings), label="sibling")
        parent[key], parent[other] = parent[other], parent[key]
    if json.dumps(bad, sort_keys=True) == json.dumps(index, sort_keys=True):
        return  # e.g. a swap of equal values: nothing corrupted
    with tempfile.TemporaryDirectory() as tmp:
        copy_dir = os.path.join(tmp, "step-000005")
        shutil.copytree(ckpt, copy_dir)
        ipath = os.path.join(copy_dir, INDEX)
        with open(ipath, "w") as f:
            json.dump(bad, f)
        for read in (lambda: read_index(copy_dir), lambda: mt.load(copy_dir, model=make())):
            with pytest.raises(CheckpointError) as e:
                read()
            msg = str(e.value)
            assert ipath in msg, msg
            _assert_names_field(msg)
            if kind == "delete" and len(path) == 1 and key != "format":
                assert f"field {key!r} is missing" in msg, msg


def test_truncated_index_paths_outside_and_symlinks_out_are_checkpoint_errors(full_checkpoint, tmp_path):
    ckpt, index, _ = full_checkpoint
    work = str(tmp_path / "c")
    shutil.copytree(ckpt, work)
    ipath = os.path.join(work, INDEX)
    raw = open(ipath, "rb").read()
    for cut in sorted(random.Random(4).sample(range(len(raw)), 6)) + [0]:
        open(ipath, "wb").write(raw[:cut])
        with pytest.raises(CheckpointError, match=f"{ipath} cannot be read as JSON"):
            mt.load(work, model=make())
    name = next(iter(index["tensors"]))
    for escape in ("../outside.safetensors", "/etc/passwd", "sub/slices-00000.safetensors"):
        bad = copy.deepcopy(index)
        bad["files"][escape] = bad["files"].pop("slices-00000.safetensors")
        for p in bad["tensors"][name]["pieces"]:
            p["file"] = escape
        bad[CHECKSUM] = index_checksum(bad)  # a consistent index that points outside: still refused
        open(ipath, "w").write(json.dumps(bad))
        with pytest.raises(CheckpointError, match=r"field files\[.*must name a file 'slices-NNNNN"):
            mt.load(work, model=make())
    # a slice file that is a symlink to a file outside the checkpoint directory
    open(ipath, "wb").write(raw)
    outside = str(tmp_path / "outside.safetensors")
    os.rename(os.path.join(work, "slices-00000.safetensors"), outside)
    os.symlink(outside, os.path.join(work, "slices-00000.safetensors"))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        mt.load(work, model=make())
    # a version directory that is a symlink out of the checkpoint path
    root = str(tmp_path / "root")
    os.mkdir(root)
    os.symlink(ckpt, os.path.join(root, "step-000005"))
    open(os.path.join(root, POINTER), "w").write(json.dumps(
        {"format": "meshtorch-checkpoint-pointer", "versions": ["step-000005"]}))
    with pytest.raises(CheckpointError, match="symlink .* outside"):
        mt.load(root, model=make())
    # a pointer that is cut short or names a path outside
    for text in ('{"format": "meshtorch-checkpoint-pointer", "vers', json.dumps(
            {"format": "meshtorch-checkpoint-pointer", "versions": ["../elsewhere"]})):
        open(os.path.join(root, POINTER), "w").write(text)
        with pytest.raises(CheckpointError, match=f"{os.path.join(root, POINTER)}"):
            mt.load(root, model=make())


def test_swapped_piece_keys_with_a_matching_checksum_are_caught_by_the_key_check(full_checkpoint, tmp_path):
    ckpt, index, _ = full_checkpoint
    work = str(tmp_path / "c")
    shutil.copytree(ckpt, work)
    names = [n for n in index["tensors"] if n.startswith("model/") and len(index["tensors"][n]["pieces"]) > 1]
    bad = copy.deepcopy(index)
    pieces = bad["tensors"][names[0]]["pieces"]
    pieces[0]["key"], pieces[1]["key"] = pieces[1]["key"], pieces[0]["key"]
    bad[CHECKSUM] = index_checksum(bad)
    open(os.path.join(work, INDEX), "w").write(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"pieces\[0\]\.key.*is stored as"):
        mt.load(work, model=make())
    # without the checksum fixed up, the same swap is a checksum mismatch of the index itself
    del bad[CHECKSUM]
    bad[CHECKSUM] = index[CHECKSUM]
    pieces[0]["key"], pieces[1]["key"] = pieces[1]["key"], pieces[0]["key"]
    bad["files"]["slices-00000.safetensors"], bad["files"]["slices-00001.safetensors"] = (
        bad["files"]["slices-00001.safetensors"], bad["files"]["slices-00000.safetensors"])
    open(os.path.join(work, INDEX), "w").write(json.dumps(bad))
    with pytest.raises(CheckpointError, match="checksum mismatch in checkpoint index"):
        mt.load(work, model=make())
