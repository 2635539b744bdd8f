"""``meshtorch train`` never goes wrong silently: bad flags fail up front, a non-finite loss stops
the run without touching the last good checkpoint, metrics are strict JSON, a run directory has
one writer and is never replaced by accident, and a step that cannot fit fails before training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from meshtorch import cli
from meshtorch.errors import ArgumentError, LayoutError, TrainingError
from meshtorch.ops.cross_entropy_rows import KERNELS, chunk_bytes
from meshtorch.recipes.lm import TrainConfig, strategies, train
from meshtorch.recipes.lm.fit import check_memory
from meshtorch.recipes.lm.guards import RunDirLock
from run_harness import checkpoint_tensors, tiny_train, write_corpus

pytestmark = pytest.mark.timeout(300)

TINY = tiny_train(log_every=2, lr_schedule="constant")
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), 6)


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def _records(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [_strict(line) for line in f]


def _checkpoint(out: str) -> tuple[int, dict[str, bytes]]:
    """The step and every tensor's bytes of the latest checkpoint in ``out``."""
    from meshtorch.checkpoint.index import read_index

    tensors = {k: v.numpy().tobytes() for k, v in checkpoint_tensors(out).items()}
    return read_index(os.path.join(out, "checkpoint"))["step"], tensors


@pytest.mark.parametrize("option, value, needle", [
    ("clip", -1.0, "--clip -1.0 is out of range: it must be >= 0 (0 turns clipping off"),
    ("checkpoint_every", -1, "--checkpoint-every -1 is out of range: it must be >= 0"),
    ("pipeline_stages", 0, "--pipeline-stages 0 is out of range: it must be >= 1"),
    ("warmup", -5, "--warmup -5 is out of range: it must be >= 0"),
    ("temperature", -1.0, "--temperature -1.0 is out of range: it must be >= 0 (0: greedy)"),
    ("timeout", 0.0, "--timeout 0.0 is out of range: it must be > 0 seconds"),
    ("timeout", -3.0, "--timeout -3.0 is out of range"),
    ("eval_batches", 0, "--eval-batches 0 is out of range: it must be >= 1"),
    ("lr", float("nan"), "--lr must be a finite number, got nan"),
    ("rules", "batch:b; d ff:b", "rule 'd ff:b' names dim 'd ff', which is not a dim name"),
])
def test_bad_flags_fail_up_front_from_the_cli_and_from_python(option, value, needle, capsys, tmp_path):
    out = str(tmp_path / "x")
    assert cli.main(["train", "--out", out, "--" + option.replace("_", "-"), str(value)]) == 2
    assert needle in capsys.readouterr().err
    assert not os.path.exists(out)  # nothing ran, nothing was created
    with pytest.raises(LayoutError if option == "rules" else ArgumentError) as e:
        TrainConfig.of(**{option: value}, out=out)
    assert needle in str(e.value)


def test_the_checks_hold_for_config_files_and_explicit_no_clipping(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text("[optimizer]\nclip = -1\n")
    assert cli.main(["train", "--config", str(toml), "--out", str(tmp_path / "x")]) == 2
    assert "--clip -1 is out of range" in capsys.readouterr().err
    toml.write_text('[run]\nsteps = "ten"\n')
    assert cli.main(["train", "--config", str(toml), "--out", str(tmp_path / "x")]) == 2
    assert "--steps must be a whole number, got 'ten'" in capsys.readouterr().err
    assert TrainConfig.of(clip=0).optimizer.clip == 0  # 0 is the spelling of "no clipping"


def test_generate_rejects_a_negative_temperature():
    from meshtorch.models import DecoderLM, TransformerConfig, generate

    model = DecoderLM(TransformerConfig(vocab=8, d_model=8, heads=2, d_kv=4, d_ff=8, layers=1, max_length=8))
    with pytest.raises(ArgumentError, match="temperature=-1 must be >= 0"):
        generate(model, [[1, 2]], 2, temperature=-1)


def _nan_lr_from(monkeypatch, t0: int) -> None:
    """Steps ``t0 + 1`` on take a NaN learning rate: their update makes the weights NaN."""
    lr_at = strategies.lr_at
    monkeypatch.setattr(strategies, "lr_at", lambda cfg, t: float("nan") if t >= t0 else lr_at(cfg, t))


@pytest.mark.parametrize("nan_from, message, logged", [
    # the update of step 5 makes the weights NaN: step 6's loss, read at the end of window 5..6, is NaN
    (4, "the training loss is nan at step 6 (it turned in steps 5..6", [2, 4]),
    # the update of step 6 (the window's last) makes them NaN: its loss (computed before) is finite and
    # logged, but the checkpoint of step 6 would hold NaN weights
    (5, "the weights are not finite at step 6", [2, 4, 6]),
])
def test_a_non_finite_run_stops_and_keeps_the_last_good_checkpoint(nan_from, message, logged, text, tmp_path,
                                                                  capsys, monkeypatch):
    out = str(tmp_path / "run")
    run = ["train", "--data", text, *TINY, "--checkpoint-every", "2"]
    assert cli.main([*run, "--steps", "4", "--out", out]) == 0
    good = _checkpoint(out)
    assert good[0] == 4
    capsys.readouterr()
    _nan_lr_from(monkeypatch, nan_from)
    assert cli.main([*run, "--steps", "8", "--resume", out]) == 2
    err = capsys.readouterr().err
    assert message in err and "stopped without writing a checkpoint" in err, err
    assert "TrainingError" in err
    assert _checkpoint(out) == good  # the step-4 checkpoint, bitwise
    assert [r["step"] for r in _records(out)] == logged  # strict JSON, no NaN record
    with pytest.raises(TrainingError, match="loss is nan at step 2|weights are not finite at step 2"):
        _nan_lr_from(monkeypatch, 0)
        train(TrainConfig.of(data=text, steps=2, log_every=2, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1,
                             batch=4, length=16, progress=False, out=str(tmp_path / "fresh")))
    assert not os.path.exists(os.path.join(tmp_path, "fresh", "checkpoint"))


def test_metrics_are_strict_json():
    from meshtorch.recipes.lm.run_files import json_text

    assert json.loads(json_text({"step": 1, "loss": 2.5, "flop_utilisation": None}, "m")) == {
        "step": 1, "loss": 2.5, "flop_utilisation": None}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(TrainingError, match=r"metrics.jsonl: the record .* has fields \['loss'\]"):
            json_text({"step": 1, "loss": bad}, "metrics.jsonl")


def test_out_onto_an_earlier_run_needs_resume_or_overwrite(text, tmp_path, capsys):
    out = str(tmp_path / "run")
    run = ["train", "--data", text, *TINY, "--steps", "2", "--out", out]
    assert cli.main(run) == 0
    before = _checkpoint(out)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli.main(run) == 2
    err = capsys.readouterr().err
    assert f"--out {out!r} holds an earlier run (checkpoint, metrics.jsonl, summary.json" in err
    assert f"--resume {out} to continue it, another --out for a new run, or --overwrite" in err
    assert _checkpoint(out) == before
    # --overwrite replaces the run's files (and leaves the user's)
    assert cli.main([*run, "--steps", "4", "--overwrite"]) == 0
    assert [r["step"] for r in _records(out)] == [2, 4] and _checkpoint(out)[0] == 4
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    with pytest.raises(ArgumentError, match="--overwrite would delete the checkpoint that --resume"):
        train(TrainConfig.of(resume=out, overwrite=True, steps=4, data=text))


def test_a_second_writer_of_a_run_directory_fails_at_once_naming_the_holder(text, tmp_path, capsys):
    out = str(tmp_path / "run")
    # another process holds --out (the lock a running meshtorch train takes)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom meshtorch.recipes.lm.config import TrainConfig\n"
         "from meshtorch.recipes.lm.guards import RunDirLock\n"
         "RunDirLock(TrainConfig(), sys.argv[1]).__enter__()\n"
         "print('held', flush=True)\nsys.stdin.read()", out],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli.main(["train", "--data", text, *TINY, "--steps", "2", "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"--out {out!r} is in use by another meshtorch train (pid {holder.pid}" in err, err
        assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
        # within this process too (a second RunDirLock is a second open file: flock sees two holders)
        holder.send_signal(signal.SIGKILL)  # the kernel drops a killed holder's lock
        holder.wait(30)
        mine = rf"in use by another meshtorch train \(pid {os.getpid()},"
        with RunDirLock(TrainConfig(), out), pytest.raises(TrainingError, match=mine):
            train(TrainConfig.of(data=text, steps=2, out=out))
    finally:
        holder.kill()
        holder.wait(30)


def test_a_step_that_cannot_fit_fails_before_training(text, tmp_path, monkeypatch):
    from meshtorch.plan import devices

    cfg = TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=16, mesh="b:2",
                         data=text, steps=2, progress=False, out=str(tmp_path / "x"))
    monkeypatch.setattr(devices, "available_memory", lambda: (1 << 40, "test"))
    need = check_memory(cfg, 264, processes=2)
    # each processor holds every parameter (none is split): embedding, positions, attention,
    # feed-forward and 3 layer norms' weights and biases, 4 bytes each
    assert need["parameters"] == 4 * (264 * 16 + 16 * 16 + 4 * 16 * 2 * 8 + 2 * 16 * 32 + 3 * 2 * 16)
    assert need["total"] >= need["parameters"] + need["optimizer"]
    assert need["need"] == need["total"]  # on the host: the peak itself, no allocator margin
    # the limit is the processors of this machine times one's predicted peak
    monkeypatch.setattr(devices, "available_memory", lambda: (2 * need["total"], "test"))
    assert check_memory(cfg, 264, processes=2) == need
    monkeypatch.setattr(devices, "available_memory", lambda: (2 * need["total"] - 1, "the test's limit"))
    with pytest.raises(TrainingError, match=r"does not fit: it needs about .*: 2 processor\(s\) on this "
                       r"machine x the planned peak .*activations .*available \(the test's limit\)\. To fit: "
                       r"--recompute: .*; --batch 2: .*FSDP rules .*--no-memory-check"):
        check_memory(cfg, 264, processes=2)
    with pytest.raises(TrainingError, match="as meshtorch plan predicts"):
        train(cfg)  # the threads backend: both processors in this process
    assert not os.path.exists(tmp_path / "x")
    assert check_memory(cfg.replace(memory_check=False), 264, processes=2) is None
    monkeypatch.setattr(devices, "available_memory", lambda: None)  # no known limit: nothing to check
    assert check_memory(cfg, 264, processes=2) is None


def test_the_changes_the_refusal_names_are_planned(text, monkeypatch):
    from meshtorch.plan import devices

    cfg = TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, batch=8, length=32, mesh="b:2",
                         data=text, steps=2, progress=False)
    monkeypatch.setattr(devices, "available_memory", lambda: (1 << 40, "test"))
    need = check_memory(cfg, 264, processes=1)["total"]
    recomputed = check_memory(cfg.replace(recompute=True), 264, processes=1)["total"]
    halved = check_memory(cfg.replace(batch=4), 264, processes=1)["total"]
    assert recomputed < need and halved < need
    # a limit between what --recompute needs and what the run needs: --recompute fits, half the batch
    # (which keeps more here) is named as still too much, each with its planned need
    limit = max(recomputed, halved - 1)
    assert recomputed <= limit < need
    monkeypatch.setattr(devices, "available_memory", lambda: (limit, "test"))
    from meshtorch.plan.estimate import _fmt_bytes

    with pytest.raises(TrainingError) as err:
        check_memory(cfg, 264, processes=1)
    msg = str(err.value)
    assert f"--recompute: {_fmt_bytes(recomputed)} (fits)" in msg
    assert f"--batch 4: {_fmt_bytes(halved)} ({'fits' if halved <= limit else 'still too much'})" in msg


def test_a_stated_budget_replaces_the_devices_memory(text, monkeypatch):
    from meshtorch.plan import devices

    cfg = TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=16, mesh="b:2",
                         data=text, steps=2, progress=False)
    monkeypatch.setattr(devices, "available_memory", lambda: (1 << 40, "test"))
    need = check_memory(cfg, 264, processes=2)["total"]
    gib = 2 ** 30
    # per processor, whatever the host has: the budget alone is compared
    assert check_memory(cfg.replace(memory_budget=need / gib), 264, processes=2)["total"] == need
    with pytest.raises(TrainingError, match=r"available \(--memory-budget .* GiB a processor\)"):
        check_memory(cfg.replace(memory_budget=(need - 1024) / gib), 264, processes=2)
    monkeypatch.setattr(devices, "available_memory", lambda: None)
    with pytest.raises(TrainingError, match="--memory-budget"):  # a budget is a known limit
        check_memory(cfg.replace(memory_budget=(need - 1024) / gib), 264, processes=2)


def test_a_compiled_run_is_checked_as_the_compiled_step_holds_memory(text, monkeypatch):
    import meshtorch as mt
    from meshtorch.plan import devices
    from meshtorch.recipes.lm.steps import training_step

    cfg = TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=16, mesh="b:1",
                         rules="batch:b", data=text, steps=2, progress=False, precision="bf16")
    monkeypatch.setattr(devices, "available_memory", lambda: (1 << 40, "test"))
    compiled = cfg.replace(compile=True)
    got = check_memory(compiled, 264, processes=1)
    want = mt.plan.trace(training_step(compiled, 264), mesh="b:1", rules="batch:b", compiled=True)
    eager = check_memory(cfg, 264, processes=1)
    assert got["total"] == want.peak_bytes < eager["total"]


def two_idle_gpus(monkeypatch) -> None:
    """torch.cuda answers as two GPUs, the CPU standing in, that capture no CUDA graph: torch 2.11's
    optimizer step asks torch.cuda.is_current_stream_capturing() whenever torch.cuda.is_available()
    says yes (2.13 asks torch.accelerator, which is not patched), and a CUDA build of torch on a host
    without a GPU raises there ('CUDA driver version is insufficient')."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_on_gpus_one_processors_peak_must_fit_the_fullest_gpu(text, tmp_path, monkeypatch):
    from meshtorch.plan import devices
    from meshtorch.plan.allocator import CUDA_CONTEXT_BYTES, FRAGMENTATION

    cfg = TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=16, mesh="b:2",
                         data=text, steps=2, progress=False, device="cuda")
    free = {}
    two_idle_gpus(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 1 << 40))
    free.update({0: 1 << 40, 1: 1 << 40})
    need = check_memory(cfg, 264, processes=2)
    # the allocator's peak: every storage a block of 512-byte multiples (far more than the host's
    # peak for these tiny tensors), and on top its fragmentation margin and the CUDA context
    # (the host's loss priced as CUDA's, its rows in the generated kernels, not in cache-sized
    # chunks: the same ops on both, so that only the allocator differs)
    with chunk_bytes(KERNELS, "cpu"):
        same_ops = check_memory(cfg.replace(device="cpu", memory_budget=1.0), 264, processes=2)
    assert need["total"] > same_ops["total"] and need["total"] % 512 == 0
    host = check_memory(cfg.replace(device="cpu", memory_budget=1.0), 264, processes=2)
    assert need["need"] == int(need["total"] * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES
    # not twice the need, as on a shared host: each processor has its own GPU
    free.update({0: need["need"], 1: 1 << 40})
    assert check_memory(cfg, 264, processes=2) == need
    free.update({1: need["need"] - 1})
    with pytest.raises(TrainingError, match=r"a GPU: the allocator's planned peak .* \+ 10% for its "
                       r"fragmentation \+ 512.00 MiB of CUDA context.*available \(free memory of cuda:1\)"):
        check_memory(cfg, 264, processes=2)
    # with --device auto the GPUs are used (and checked) only when each processor has one
    monkeypatch.setattr(devices, "available_memory", lambda: (1 << 40, "test"))
    assert check_memory(cfg.replace(device="auto"), 264, processes=3) == host


def test_available_memory_takes_the_least_limit(monkeypatch):
    import resource

    from meshtorch.plan.devices import available_memory

    free, source = available_memory()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < free <= total
    # ulimit -v of 1 GiB above this process's address space leaves 1 GiB
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit",
                        lambda r: (size + 2 ** 30, -1) if r == resource.RLIMIT_AS else real(r))
    free, source = available_memory()
    assert "RLIMIT_AS" in source and 2 ** 30 - 2 ** 26 < free <= 2 ** 30


def test_a_crashed_pipelined_run_keeps_the_metrics_of_the_steps_it_ran(text, tmp_path, monkeypatch):
    out = str(tmp_path / "piped")
    run = strategies.PipelinedStep.run

    def crash_at_step_3(self, batches, first):
        if first == 2:
            raise RuntimeError("injected crash after 2 steps")
        return run(self, batches, first)

    monkeypatch.setattr(strategies.PipelinedStep, "run", crash_at_step_3)
    with pytest.raises(RuntimeError, match="injected crash"):
        train(TrainConfig.of(data=text, steps=6, log_every=1, pipeline_stages=2, schedule="gpipe",
                             microbatches=2, mesh="b:1", rules="", d_model=16, heads=2, d_kv=8, d_ff=32,
                             layers=2, batch=8, length=16, progress=False, out=out))
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


def test_train_on_gpus_that_cannot_hold_the_step_is_refused_naming_the_term_and_the_fixes(
        text, tmp_path, monkeypatch, capsys):
    # `meshtorch train --device cuda` on two GPUs, the CPU standing in: torch.cuda answers as two
    # 80 GB GPUs whose free memory is what the planned step needs, less a byte on the second
    from types import SimpleNamespace

    two_idle_gpus(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 10 ** 9))
    free = {0: 1 << 40, 1: 1 << 40}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free[i], 80 * 10 ** 9))
    from meshtorch.recipes.lm.cli import config_from_args

    out = tmp_path / "run"
    argv = ["train", "--data", text, "--out", str(out), "--device", "cuda", "--tokenizer", "bytes",
            *tiny_train(layers=2, batch=8, length=32, eval_batches=None, sample_tokens=None, warmup=None,
                        mesh="b:2", rules="batch:b", steps=2)]
    cfg = config_from_args(cli.build_parser("train").parse_args(argv))   # what the command line makes
    planned = check_memory(cfg, 264, processes=2)
    largest = max(("activations", "optimizer", "parameters", "gradients"), key=planned.__getitem__)
    free[1] = planned["need"] - 1
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and not out.exists()   # refused before anything ran or was written
    from meshtorch.plan.estimate import _fmt_bytes

    # the need and its largest term first, the GPU that lacks it, then the planned changes: --recompute
    # and half the batch with their needs, FSDP rules, a larger mesh axis
    assert f"it needs about {_fmt_bytes(planned['need'])} a GPU: the allocator's planned peak " \
           f"{_fmt_bytes(planned['total'])} ({largest} {_fmt_bytes(planned[largest])}," in err
    assert f"but {_fmt_bytes(free[1])} is available (free memory of cuda:1)" in err
    recomputed = check_memory(cfg.replace(recompute=True), 264, processes=2)["need"]
    halved = check_memory(cfg.replace(batch=4), 264, processes=2)["need"]
    assert f"--recompute: {_fmt_bytes(recomputed)} (fits)" in err
    assert f"--batch 4: {_fmt_bytes(halved)} ({'fits' if halved <= free[1] else 'still too much'})" in err
    assert "FSDP rules (e.g. --rules 'batch:b; d_model:b')" in err and "a larger --mesh axis" in err
    assert "--no-memory-check" in err
