"""``meshtorch plan --calibrate`` on a GPU (plan/gpu_calibration.py): its measurements, the device
file it writes and the plans made with it. There is no GPU here: the same code runs on the CPU
(tiny sizes), and the command line's GPU branch is driven with the CPU standing in."""

from __future__ import annotations

import json

import pytest
import torch

import meshtorch as mt
from meshtorch.cli import main
from meshtorch.plan import gpu_calibration
from meshtorch.plan.devices import load_spec
from meshtorch.plan.gpu_calibration import fit_matmul, measure_gpu
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
    monkeypatch.setattr(gpu_calibration, "best_seconds", lambda fn, device, window: (fn(), 1.0)[1])
    b, h, s, d = 1, 2, 32, 16
    rate = gpu_calibration.attention_rate(torch.device("cpu"), (b, h, s, d), 0.001)
    assert rate == 0.5 * (4 + 10) * b * h * s * s * d


def test_a_quick_measurement_of_the_cpu_makes_a_device_file_that_plans(tmp_path):
    spec = measure_gpu("cpu", quick=True)
    assert spec.name == "cpu-roofline" and spec.roofline and spec.achievable == 1.0
    assert spec.peak_flops["float32"] > 0 and spec.peak_flops["bfloat16"] > 0
    assert spec.copy_bandwidth > 0 and spec.op_seconds > 0 and spec.sync_seconds >= 0
    assert 0 < spec.attention_efficiency and spec.matmul_knee in gpu_calibration.KNEES
    assert spec.context_bytes == 0 and spec.memory_bytes > 2 ** 20
    path = tmp_path / "dev.json"
    from meshtorch.plan.devices import save_spec

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the CPU side is tested above)")
def test_calibrate_measures_this_gpu_cuda(tmp_path):
    spec = measure_gpu("cuda", quick=True)
    # a GPU's context lives outside the allocator; its copies beat 10 GB/s; a kernel costs something
    assert spec.context_bytes > 0 and spec.copy_bandwidth > 1e10 and spec.launch_seconds > 0
    assert spec.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert spec.name == gpu_calibration.device_name(torch.device("cuda", 0))
