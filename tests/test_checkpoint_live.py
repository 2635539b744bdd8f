"""Checkpoints of a live run: readers never fail nor mix versions while ``keep`` prunes, and
background saves write the same files as synchronous ones, from a snapshot, one at a time."""

from __future__ import annotations

import os
import threading
import time

import pytest
import safetensors.torch
import torch

import meshtorch as mt
from meshtorch.checkpoint import reader, writer
from meshtorch.checkpoint.versions import POINTER, read_pointer
from meshtorch.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)

MESH, RULES = "m:2", "h:m"


def make() -> mt.nn.Module:
    h = mt.Dim("h", 6)
    return mt.nn.Sequential(mt.nn.Dense(mt.Dim("d", 4), h), mt.nn.Dense(h, mt.Dim("o", 2)))


def weights(seed: int) -> dict[str, torch.Tensor]:
    """The model initialised with ``seed`` (one processor): what a checkpoint saved from it holds."""
    return {n: v.to_global().clone() for n, v in make().reset_parameters(seed=seed).named_mesh_parameters()}


def loaded(model: mt.nn.Module) -> dict[str, torch.Tensor]:
    return {n: v.to_global() for n, v in model.named_mesh_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def save_aside(root: str, step: int, keep: int = 1, seed: int | None = None) -> None:
    """A save by another writer (a thread of its own, one processor), as a live run's would be."""
    t = threading.Thread(target=lambda: mt.save(root, model=make().reset_parameters(
        seed=step if seed is None else seed), step=step, keep=keep))
    t.start()
    t.join()


# --- readers of a live run ----------------------------------------------------------------------------

@pytest.mark.parametrize("moment", ["resolved", "index read", "files open"])
def test_a_save_that_prunes_the_version_being_read(tmp_path, monkeypatch, moment):
    """keep=1 prunes the version a reader resolved: before its index is open, after the index and
    before its slice files, or after its files are open. The reader returns one whole version:
    the newer one in the first two cases, the one it opened (its files deleted meanwhile) in the last."""
    root = str(tmp_path / "ckpt")
    mt.save(root, model=make().reset_parameters(seed=1), step=1, keep=1)
    fired = []

    def prune_once():
        if not fired:
            fired.append(True)
            save_aside(root, 2)
            assert read_pointer(root) == ["step-000002"]
            assert not os.path.exists(os.path.join(root, "step-000001"))

    if moment == "resolved":
        real = reader.latest
        monkeypatch.setattr(reader, "latest", lambda p: (real(p), prune_once())[0])
    elif moment == "index read":
        real = reader.read_version_index
        monkeypatch.setattr(reader, "read_version_index", lambda v: (real(v), prune_once())[0])
    else:
        real = reader._pin
        monkeypatch.setattr(reader, "_pin", lambda *a: (real(*a), prune_once())[0])
    model = make()
    step = mt.load(root, model=model)["step"]
    assert fired
    assert (step, same(loaded(model), weights(step))) == ((1, True) if moment == "files open" else (2, True))


def test_a_version_name_reused_after_pruning_is_never_mixed_in(tmp_path, monkeypatch):
    """Saves without a step reuse the name ``save`` once keep=1 pruned it: a reader that opened the
    first ``save`` reads it whole, never the slices of the second one under the same name."""
    root = str(tmp_path / "ckpt")
    mt.save(root, model=make().reset_parameters(seed=1), keep=1)
    real = reader._pin

    def pin_then_rewrite(*a):
        pinned = real(*a)
        for seed in (2, 3):  # 'save-2', then 'save' again
            save_aside(root, None, seed=seed)
        assert read_pointer(root) == ["save"]
        return pinned

    monkeypatch.setattr(reader, "_pin", pin_then_rewrite)
    model = make()
    mt.load(root, model=model)
    assert same(loaded(model), weights(1))
    monkeypatch.setattr(reader, "_pin", real)
    mt.load(root, model=model)
    assert same(loaded(model), weights(3))


def test_processors_agree_on_the_version_when_one_finds_it_pruned(tmp_path, monkeypatch):
    """On 2 processors, processor 1 finds the version pruned after processor 0 opened its file:
    both retry, and both load the newer version (no mesh holds halves of two versions)."""
    root = str(tmp_path / "ckpt")
    mt.launch(lambda: mt.save(root, model=make().reset_parameters(seed=1), step=1, keep=1) and None,
              mesh=MESH, rules=RULES)
    real, fired = reader._Pinned.pin, []

    def pin(self, fname, tensor):
        if mt.current().rank == 1 and not fired:
            fired.append(True)
            save_aside(root, 2)
        return real(self, fname, tensor)

    monkeypatch.setattr(reader._Pinned, "pin", pin)

    def load():
        model = make()
        return mt.load(root, model=model)["step"], loaded(model)

    got = mt.launch(load, mesh=MESH, rules=RULES)
    assert fired and [s for s, _ in got] == [2, 2]
    assert all(same(w, weights(2)) for _, w in got)


def test_a_version_pruned_again_and_again_is_a_clear_error(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    mt.save(root, model=make().reset_parameters(seed=1), step=1, keep=1)
    real, steps = reader.latest, iter(range(2, 100))
    monkeypatch.setattr(reader, "latest", lambda p: (real(p), save_aside(root, next(steps)))[0])
    with pytest.raises(CheckpointError, match="newer versions while it was being opened"):
        mt.load(root, model=make())


def test_readers_while_a_writer_saves_with_keep_1(tmp_path):
    """A writer saves 40 versions with keep=1 while two readers load in a loop: every load returns
    one whole version (its weights are that step's), none fails."""
    root = str(tmp_path / "ckpt")
    models = {s: make().reset_parameters(seed=s) for s in range(1, 41)}
    expect = {s: weights(s) for s in models}
    mt.save(root, model=models[1], step=1, keep=1)
    done, results, errors = threading.Event(), [], []

    def write():
        try:
            for s in range(2, 41):
                mt.save(root, model=models[s], step=s, keep=1)
        finally:
            done.set()

    def read():
        model = make()
        try:
            while not done.is_set():
                step = mt.load(root, model=model, restore_rng_state=False)["step"]
                results.append((step, same(loaded(model), expect[step])))
                mt.checkpoint.index.read_index(root)  # the index alone, as `meshtorch generate` reads it
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert results and all(ok for _, ok in results)
    assert sorted(os.listdir(root)) == [POINTER, "step-000040"]


# --- background saves -----------------------------------------------------------------------------------

def trained():
    """A model and an Adam optimizer one step in (so there is optimizer state to save)."""
    model = make().reset_parameters(seed=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = mt.from_global(torch.randn(3, 4, generator=torch.Generator().manual_seed(7)), "b:3,d:4")
    mt.reduce_mean(model(x) * model(x)).backward()
    opt.step()
    return model, opt


def files(d: str) -> dict[str, bytes]:
    out = {}
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), "rb") as fh:
            out[f] = fh.read()
    return out


def test_a_background_save_writes_the_files_of_a_synchronous_save(tmp_path):
    """On 2 processors: the same state saved synchronously and in the background gives the same
    files byte for byte, although the parameters and the optimizer state change right after the
    background save's call returns (it wrote the snapshot taken at the call)."""
    sync, bg = str(tmp_path / "sync"), str(tmp_path / "bg")

    def f():
        model, opt = trained()
        mt.save(sync, model=model, optimizer=opt, step=5, data={"pos": 9})
        assert mt.save(bg, model=model, optimizer=opt, step=5, data={"pos": 9}, background=True) is None
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for state in opt.state.values():
                state["exp_avg"].add_(1.0)
        return mt.checkpoint.wait()

    where = mt.launch(f, mesh=MESH, rules=RULES)
    assert where[0] == where[1] == os.path.join(bg, "step-000005")
    a, b = files(os.path.join(sync, "step-000005")), files(os.path.join(bg, "step-000005"))
    assert list(a) == list(b) == ["index.json", "slices-00000.safetensors", "slices-00001.safetensors"]
    assert a == b
    assert sorted(os.listdir(bg)) == [POINTER, "step-000005"]  # no markers, no temp directory left


def test_a_second_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    """A slow background save of step 1, then a synchronous save of step 2: step 1 is committed
    first (the pointer lists step 2 as the newest), and keep=1 leaves only step 2."""
    root = str(tmp_path / "ckpt")
    real, order = writer._write_slices, []

    def slow(tmp, rank, mine):
        if "w" not in order:
            order.append("w")
            time.sleep(0.3)  # the synchronous save below would overtake it if it did not wait
        return real(tmp, rank, mine)

    monkeypatch.setattr(writer, "_write_slices", slow)
    mt.save(root, model=make().reset_parameters(seed=1), step=1, keep=2, background=True)
    where = mt.save(root, model=make().reset_parameters(seed=2), step=2, keep=2)
    assert where == os.path.join(root, "step-000002")
    assert read_pointer(root) == ["step-000002", "step-000001"]
    model = make()
    mt.load(os.path.join(root, "step-000001"), model=model)
    assert same(loaded(model), weights(1))


def test_background_saves_write_one_at_a_time_and_keep_prunes_as_a_synchronous_save(tmp_path, monkeypatch):
    """Three background saves in a row, each write slowed: never two writes at once (each save waits
    for the one in flight), and keep=2 leaves steps 3 and 2, as three synchronous saves do."""
    root = str(tmp_path / "ckpt")
    real, guard, live, most = writer._write_slices, threading.Lock(), [0], []

    def slow(*a):
        with guard:
            live[0] += 1
            most.append(live[0])
        time.sleep(0.2)  # a save that did not wait would start its write meanwhile
        try:
            return real(*a)
        finally:
            with guard:
                live[0] -= 1

    monkeypatch.setattr(writer, "_write_slices", slow)
    for step in (1, 2, 3):
        model = make().reset_parameters(seed=step)
        assert mt.save(root, model=model, step=step, keep=2, background=True) is None
    assert mt.checkpoint.wait() == os.path.join(root, "step-000003")
    assert most == [1, 1, 1]
    assert read_pointer(root) == ["step-000003", "step-000002"]
    assert sorted(os.listdir(root)) == [POINTER, "step-000002", "step-000003"]
    for step in (2, 3):
        model = make()
        mt.load(os.path.join(root, f"step-00000{step}"), model=model)
        assert same(loaded(model), weights(step))


def test_a_failed_background_write_raises_at_the_next_save_on_every_processor(tmp_path, monkeypatch):
    """Processor 1's background write fails: nothing is committed, the next save raises on both
    processors (naming the cause where it happened), and the path still loads step 1."""
    root = str(tmp_path / "ckpt")
    real, armed = writer._write_slices, []

    def failing(tmp, rank, mine):
        if rank == 1 and armed:
            raise OSError(28, "No space left on device")
        return real(tmp, rank, mine)

    monkeypatch.setattr(writer, "_write_slices", failing)

    def f():
        model = make().reset_parameters(seed=1)
        mt.save(root, model=model, step=1)
        if mt.current().rank == 0:
            armed.append(True)
        mt.current().comm.barrier()
        mt.save(root, model=model, step=2, background=True)
        try:
            mt.save(root, model=model, step=3)
        except CheckpointError as e:
            return str(e)
        return None

    msgs = mt.launch(f, mesh=MESH, rules=RULES)
    assert all(m and "background save" in m for m in msgs), msgs
    assert "No space left on device" in msgs[1]
    assert read_pointer(root) == ["step-000001"]
    assert sorted(os.listdir(root)) == [POINTER, "step-000001"]
    model = make()
    assert mt.load(root, model=model)["step"] == 1 and same(loaded(model), weights(1))


def test_the_background_writer_keeps_the_process_alive_until_written(tmp_path, monkeypatch):
    """The writer thread is not a daemon: Python joins it before the process exits, so the last
    background save is written even by a script that never waits for it."""
    root, gate = str(tmp_path / "ckpt"), threading.Event()
    real = writer._write_slices
    monkeypatch.setattr(writer, "_write_slices", lambda *a: (gate.wait(), real(*a))[1])
    mt.save(root, model=make().reset_parameters(seed=1), step=1, background=True)
    writers = [t for t in threading.enumerate() if t.name.startswith("meshtorch-save-")]
    assert len(writers) == 1 and not writers[0].daemon and writers[0].is_alive()
    assert not os.path.exists(os.path.join(root, POINTER))  # still writing
    gate.set()
    assert mt.checkpoint.wait() == os.path.join(root, "step-000001")


TINY = {"log_every": 1, "lr_schedule": "constant", "mesh": "b:2", "rules": "batch:b", "tokenizer": "bytes",
        "checkpoint_every": 2, "steps": 4, "keep": 2, "no_memory_check": True}


def test_async_checkpoint_without_checkpoint_every_is_refused():
    """Seen: --async-checkpoint alone ran with no background save at all (--checkpoint-every 0: only
    the synchronous final save), silently."""
    from meshtorch.recipes.lm import TrainConfig
    from meshtorch.recipes.lm.config import check_config

    with pytest.raises(mt.errors.ArgumentError, match="--async-checkpoint .* --checkpoint-every is 0"):
        check_config(TrainConfig.of(async_checkpoint=True))
    check_config(TrainConfig.of(async_checkpoint=True, checkpoint_every=5))


def test_train_async_checkpoint(tmp_path):
    """``meshtorch train --async-checkpoint --checkpoint-every 2``: the background save of step 2 and
    the final (synchronous) one of step 4 are both committed, and each loads with its checksums
    verified into the run's model; the flag is recorded with the run's options."""
    from meshtorch import cli
    from meshtorch.recipes.lm.generate import load_lm
    from run_harness import tiny_train, write_corpus

    out, data = str(tmp_path / "run"), write_corpus(tmp_path, 6)
    assert cli.main(["train", "--data", data, "--out", out, *tiny_train(**TINY), "--async-checkpoint"]) == 0
    ckpt = os.path.join(out, "checkpoint")
    assert read_pointer(ckpt) == ["step-000004", "step-000002"]
    assert sorted(os.listdir(ckpt)) == [POINTER, "step-000002", "step-000004"]
    for version in ("step-000002", "step-000004"):
        index = mt.checkpoint.index.read_index(os.path.join(ckpt, version))
        assert index["step"] == int(version[-6:])
        assert index["extra"]["train_config"]["async_checkpoint"] is True
    model = load_lm(out)  # the newest version, every file's sha256 checked
    stored = safetensors.torch.load_file(os.path.join(ckpt, "step-000004", "slices-00000.safetensors"))
    for name, view in model.named_mesh_parameters():
        assert torch.equal(view.to_global(), stored[f"model/{name}@" + ",".join("0" * len(view.shape))])


def test_meshtorch_generate_reads_a_run_whose_checkpoints_keep_1_prunes_meanwhile(tmp_path, monkeypatch):
    """``meshtorch generate --checkpoint`` on a live run whose saves use keep=1 (seen before: 1 in 6
    failed with "No such file or directory"). First each index and weights read of a generate finds its
    version pruned by a newer save just before it reads it; then a writer saves 20 versions while
    generate runs again and again. Every generate answers, as the run's own last version does."""
    from meshtorch import cli
    from meshtorch.checkpoint import index as index_module
    from meshtorch.checkpoint.state import from_json
    from meshtorch.recipes.lm.generate import generate_from_checkpoint, load_lm
    from run_harness import tiny_train, write_corpus

    out, data = str(tmp_path / "run"), write_corpus(tmp_path, 2)
    flags = tiny_train(**{**TINY, "mesh": None, "rules": None})
    assert cli.main(["train", "--data", data, "--out", out, *flags, "--steps", "2", "--keep", "1"]) == 0
    ckpt = os.path.join(out, "checkpoint")
    extra = from_json(mt.checkpoint.index.read_index(ckpt)["extra"])
    want = generate_from_checkpoint(out, "def", max_new_tokens=4, temperature=0.0)
    model, steps = load_lm(out), iter(range(3, 100))

    def save_next():  # the same weights (so every version answers alike), saved as the live run saves
        step = next(steps)
        t = threading.Thread(target=lambda: mt.save(ckpt, model=model, step=step, keep=1, extra=extra))
        t.start()
        t.join()

    reads = []

    def pruned_first(real, who):
        def read(version):
            reads.append((version.dir, who))
            if len(reads) % 2:  # every other read: its version is pruned just before, the retry reads
                save_next()
            return real(version)
        return read

    with monkeypatch.context() as m:
        m.setattr(index_module, "read_version_index", pruned_first(index_module.read_version_index, "index"))
        m.setattr(reader, "read_version_index", pruned_first(reader.read_version_index, "weights"))
        assert generate_from_checkpoint(out, "def", max_new_tokens=4, temperature=0.0) == want
    # the index reads (the tokenizer's, the model config's) and the weights' read: each found its version
    # pruned, and its retry read the newer one
    assert {who for _, who in reads} == {"index", "weights"} and len(reads) % 2 == 0, reads
    assert all(reads[i][0] < reads[i + 1][0] for i in range(0, len(reads), 2)), reads
    done, errors, saves = threading.Event(), [], []

    def write():
        try:
            for _ in range(20):
                save_next()
                saves.append(1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            done.set()

    writer_thread = threading.Thread(target=write)
    writer_thread.start()
    got = []
    try:
        while not done.is_set():
            got.append(generate_from_checkpoint(out, "def", max_new_tokens=4, temperature=0.0))
    finally:
        writer_thread.join()
    assert not errors, errors[0]
    assert got and set(got) == {want} and len(saves) == 20
    assert len(os.listdir(ckpt)) == 2 and POINTER in os.listdir(ckpt)  # keep=1 pruned every other version
