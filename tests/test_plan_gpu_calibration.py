"""``meshtorch plan --calibrate`` on a GPU (plan/gpu_calibration.py): its measurements, the device
file it writes and the plans made with it. There is no GPU here: the same code runs on the CPU
(tiny sizes), and the command line's GPU branch is driven with the CPU standing in."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import meshtorch as mt
from meshtorch.cli import main
from meshtorch.plan import gpu_calibration
from meshtorch.plan.devices import DEVICES, Link, load_spec, save_spec
from meshtorch.plan.gpu_calibration import fit_link, fit_matmul, measure_collectives, measure_gpu
from meshtorch.plan.kernels import matmul_efficiency
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import training_step

CFG = TrainConfig.of(d_model=32, heads=4, d_kv=8, d_ff=64, layers=1, batch=4, length=16, precision="bf16")


def test_the_fit_recovers_the_rates_and_knee_that_made_the_measurements():
    shapes = [(64, 64, 64), (256, 128, 512), (1024, 1024, 1024), (8192, 768, 3072), (8192, 64, 64)]
    made = {**{("bfloat16", s): 7.2e14 * matmul_efficiency(*s, 16.0) for s in shapes},
            **{("float32", s): 5e13 * matmul_efficiency(*s, 16.0) for s in shapes[:3]}}
    peaks, knee = fit_matmul(made)
    assert knee == 16.0
    assert peaks["bfloat16"] == pytest.approx(7.2e14) and peaks["float32"] == pytest.approx(5e13)


def test_attention_is_counted_as_the_planner_counts_it(monkeypatch):
    # one second a step: the rate is the FLOPs, those torch's formulas give the fused kernels
    # (forward 2 products of 2·b·h·s²·d, backward 5 with the scores recomputed), halved for the mask
    monkeypatch.setattr(gpu_calibration, "best_seconds", lambda fn, clock, window: (fn(), 1.0)[1])
    b, h, s, d = 1, 2, 32, 16
    rate = gpu_calibration.attention_rate(torch.device("cpu"), (b, h, s, d), 0.001)
    assert rate == 0.5 * (4 + 10) * b * h * s * s * d == 0.5 * gpu_calibration.attention_flops((b, h, s, d))


def test_a_quick_measurement_of_the_cpu_makes_a_device_file_that_plans(tmp_path):
    spec = measure_gpu("cpu", quick=True)
    assert spec.name == "cpu-roofline" and spec.roofline and spec.achievable == 1.0
    assert spec.peak_flops["float32"] > 0 and spec.peak_flops["bfloat16"] > 0
    assert spec.copy_bandwidth > 0 and spec.op_seconds > 0 and spec.sync_seconds >= 0
    assert 0 < spec.attention_efficiency and spec.matmul_knee in gpu_calibration.KNEES
    assert spec.context_bytes == 0 and spec.memory_bytes > 2 ** 20
    path = tmp_path / "dev.json"
    save_spec(spec, path)
    assert load_spec(path) == spec
    est = mt.plan.estimate(training_step(CFG, vocab=64), "b:1", "batch:b", device=str(path))
    # priced op by op with the measured numbers: the terms add up to the step
    c = est.compute_terms
    assert c and c["step"] == pytest.approx(max(c["device"], c["host"]) + c["sync"])
    assert c["launch"] == pytest.approx(sum(
        n * k[5] for k, n in est.trace.kernels.items()) * spec.launch_seconds)


def test_plan_calibrate_on_a_gpu_writes_the_file_that_plans_and_trains_use(tmp_path, monkeypatch, capsys):
    from meshtorch.recipes.lm import plan_cli

    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    # the CPU stands in for the GPU: the measurement is the same code at tiny sizes
    monkeypatch.setattr(plan_cli, "measure_gpu", lambda device: measure_gpu("cpu", quick=True))
    out = tmp_path / "my-gpu.json"
    assert main(["plan", "--calibrate", "--device", "cuda", "--calibrate-out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"plan with --hardware {out}" in err and out.exists()
    # the matmul rate printed is the fit's at a shape, not its asymptote (which a large knee puts
    # above any rate the device reaches)
    from meshtorch.plan.devices import device
    from meshtorch.plan.kernels import matmul_efficiency

    spec = device(str(out))
    at = spec.peak_flops["bfloat16"] * matmul_efficiency(8192, 8192, 8192, spec.matmul_knee) / 1e12
    assert f"bf16 matmuls fitted at {at:.0f} TFLOP/s at 8192³" in err
    assert not (tmp_path / "cpu.json").exists()   # the host's calibration is not touched
    flags = ["plan", "--layers", "1", "--d-model", "32", "--d-kv", "8", "--d-ff", "64", "--heads", "4",
             "--batch", "4", "--length", "16", "--vocab", "64", "--mesh", "b:1", "--rules", "batch:b",
             "--json"]
    assert main([*flags, "--hardware", str(out)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["device"] == "cpu-roofline" and "compute_terms" in planned
    # without --calibrate-out: the cache's file named after the GPU, which train --rules auto then uses
    assert main(["plan", "--calibrate", "--device", "cuda"]) == 0
    stored = tmp_path / "cpu-roofline.json"
    assert stored.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "CPU roofline")
    hardware, source = plan_cli.hardware_of_run(TrainConfig.of(device="cuda"), 1)
    assert hardware == str(stored) and "meshtorch plan --calibrate measured it" in source


ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 10}


class SimulatedGPU(TorchDispatchMode):
    """A device whose numbers are known, standing in for a GPU: every aten op the calibration runs
    on the CPU advances a device clock by the kernel's time on a device of ``spec``'s numbers, as
    the roofline prices a kernel (max(FLOPs / rate, bytes / bandwidth) + a launch; a view nothing;
    causal fused attention its hand-counted FLOPs halved, at ``attention_efficiency`` of the bf16
    rate), and a host clock by ``op_seconds`` an aten op and ``sync_seconds`` a ``.item()``. It is
    the calibration's :class:`~meshtorch.plan.gpu_calibration.Clock`: the calibration must give
    back ``spec``'s numbers."""

    def __init__(self, spec):
        super().__init__()
        self.spec, self.device_time, self.host_time = spec, 0.0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        spec = self.spec
        self.host_time += spec.op_seconds
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_time += spec.sync_seconds
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        mine = {t.untyped_storage().data_ptr() for t in ins}
        if not func._schema.name.endswith("_") and outs and \
                all(t.untyped_storage().data_ptr() in mine for t in outs):
            return out   # a view: no kernel
        work = 0.0
        if func is torch.ops.aten.mm.default:
            (m, k), n = ins[0].shape, ins[1].shape[1]
            rate = spec.peak_flops[str(ins[0].dtype).removeprefix("torch.")]
            work = 2 * m * n * k / (rate * matmul_efficiency(m, n, k, spec.matmul_knee))
        elif func in ATTENTION:
            b, h, s, d = ins[0].shape
            work = 0.5 * ATTENTION[func] * b * h * s * s * d / (
                spec.attention_efficiency * spec.peak_flops["bfloat16"])
        if func is torch.ops.aten.copy_.default:
            nbytes = 2 * ins[1].nbytes
        else:
            nbytes = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
        self.device_time += max(work, nbytes / spec.copy_bandwidth) + spec.launch_seconds
        return out

    # the Clock protocol
    def mark(self):
        return self.device_time

    def since(self, mark):
        return self.device_time - mark

    def host(self):
        return self.host_time

    def drain(self):
        pass

    def ahead(self, seconds):
        pass


def test_the_calibration_gives_back_the_numbers_of_the_device_it_measures(tmp_path, capsys):
    # a slow device, so that the quick sizes are compute-bound: its products take 10-50 µs
    truth = dataclasses.replace(
        DEVICES["h100"], name="cpu-roofline", peak_flops={"bfloat16": 2e10, "float16": 2e10, "float32": 1e10},
        achievable=1.0, matmul_knee=16.0, attention_efficiency=0.4, copy_bandwidth=1e10,
        memory_bandwidth=1e10, launch_seconds=1e-6, op_seconds=5e-6, sync_seconds=2e-5, context_bytes=0)
    with SimulatedGPU(truth) as sim:
        got = measure_gpu("cpu", quick=True, clock=sim)
    assert got.matmul_knee == truth.matmul_knee
    for field in ("op_seconds", "sync_seconds"):   # the host's clock: exact
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=1e-9), field
    # the launch is a one-element add_'s whole time (its 8 bytes take 0.1% of it); the rest less it
    for field in ("launch_seconds", "copy_bandwidth", "attention_efficiency"):
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=2e-3), field
    for dtype in ("bfloat16", "float32"):
        assert got.peak_flops[dtype] == pytest.approx(truth.peak_flops[dtype], rel=2e-3), dtype
    # one device: no collective; cpu-roofline is no GPU of meshtorch.plan.gpus, so PCIe 4.0 is assumed
    assert got.default_link == Link(32e9, 10e-6) and not got.links
    # the device file it makes round-trips and prices a step as the true numbers do
    path = tmp_path / "measured.json"
    save_spec(got, path)
    assert load_spec(path) == got
    step = training_step(CFG, vocab=64)
    true_spec = dataclasses.replace(truth, memory_bytes=got.memory_bytes)
    want = mt.plan.estimate(step, "b:1", "batch:b", device=true_spec)
    run = ["plan", "--layers", "1", "--d-model", "32", "--d-kv", "8", "--d-ff", "64", "--heads", "4",
           "--batch", "4", "--length", "16", "--vocab", "64", "--precision", "bf16", "--mesh", "b:1",
           "--rules", "batch:b", "--json"]
    assert main([*run, "--hardware", str(path)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["device"] == "cpu-roofline"
    assert planned["step_seconds"] == pytest.approx(want.step_seconds, rel=5e-3)
    for term, seconds in want.compute_terms.items():
        assert planned["compute_terms"][term] == pytest.approx(seconds, rel=5e-3, abs=1e-12), term
    # --device FILE, the flag's name when the issue was written, still takes it (with a notice)
    assert main([*run, "--device", str(path)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == planned and "deprecated, pass --hardware" in out.err


def test_the_link_fit_inverts_the_planners_ring_all_reduce():
    # 4 processors: a ring all_reduce sends 2·3/4 of the payload and takes 2·3 hops
    bw, lat = 2e11, 7e-6
    small, big = 4, 2 ** 28

    def seconds(nbytes):
        return 1.5 * nbytes / bw + 6 * lat

    assert fit_link(4, (small, seconds(small)), (big, seconds(big))) == Link(bw, lat)


def test_a_collective_is_measured_between_processes_of_this_machine():
    # gloo between 2 CPU processes stands in for NCCL between 2 GPUs: the same program and fit
    link = measure_collectives("cpu", 2, quick=True)
    assert link.bandwidth > 1e6 and 0 < link.latency < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the CPU side is tested above)")
def test_calibrate_measures_this_gpu_cuda(tmp_path):
    spec = measure_gpu("cuda", quick=True)
    # a GPU's context lives outside the allocator; its copies beat 10 GB/s; a kernel costs something
    assert spec.context_bytes > 0 and spec.copy_bandwidth > 1e10 and spec.launch_seconds > 0
    assert spec.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert spec.name == gpu_calibration.device_name(torch.device("cuda", 0))


def test_a_device_file_is_written_through_the_one_atomic_writer(tmp_path, monkeypatch):
    """Seen: save_spec wrote through a temporary file of a fixed name beside it ("lab.json" ->
    "lab.tmp", which it then renamed away: a user's file of that name was lost) and never fsynced,
    where meshtorch.files.write_atomic does neither."""
    (tmp_path / "lab.tmp").write_text("the user's notes")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    save_spec(DEVICES["l4"], tmp_path / "lab.json")
    assert load_spec(tmp_path / "lab.json") == DEVICES["l4"]
    assert (tmp_path / "lab.tmp").read_text() == "the user's notes" and synced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.json", "lab.tmp"]


def test_calibrating_cuda_without_a_gpu_is_an_error_naming_the_fix(monkeypatch, capsys):
    """Seen: `meshtorch plan --calibrate --device cuda` on a machine without CUDA ended in torch's
    traceback (AssertionError: Torch not compiled with CUDA enabled)."""
    from meshtorch import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine with a GPU
    assert cli.main(["plan", "--calibrate", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtorch plan: error: measuring 'cuda': this machine has no CUDA GPU"), err
    assert "on the machine with the GPU" in err and "--hardware FILE" in err and "Traceback" not in err
