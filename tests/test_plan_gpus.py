"""meshtorch.plan.gpus: the one table of GPU names. Each row's name gives its nominal rate (what
benchmarks/gpu_step.py reports MFU against) and the built-in spec that ``meshtorch train --rules
auto`` prices the run with and ``meshtorch plan --calibrate`` takes a measured GPU's links from."""

from __future__ import annotations

import pytest
import torch

from meshtorch.plan.devices import DEVICES
from meshtorch.plan.gpu_calibration import device_name
from meshtorch.plan.gpus import DEFAULT_GPU_SPEC, GPUS, gpu_kind, spec_of_gpu
from meshtorch.recipes.lm import TrainConfig, plan_cli


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L4", 121), ("NVIDIA L40S", 362),
    ("NVIDIA GeForce RTX 3060", None)])
def test_nominal_rate_by_device_name(name, tflops):
    kind = gpu_kind(name)
    assert (kind if kind is None else kind.bf16_flops / 1e12) == tflops


@pytest.mark.parametrize("kind", GPUS, ids=lambda kind: kind.word)
def test_every_gpu_name_maps_to_the_spec_the_planner_prices_it_with(kind, monkeypatch, tmp_path):
    name = f"NVIDIA {kind.word}"
    assert gpu_kind(name) == kind   # no earlier row takes its name
    spec = kind.spec or DEFAULT_GPU_SPEC
    assert spec in DEVICES
    # meshtorch train --rules auto on that GPU, with no calibration of it stored
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(plan_cli, "gpu_calibration_path", lambda file_name: tmp_path / f"{file_name}.json")
    hardware, source = plan_cli.hardware_of_run(TrainConfig.of(device="cuda"), 1)
    assert hardware == spec
    assert ("has no spec of its own" in source) == (kind.spec is None)
    # meshtorch plan --calibrate keeps the links of the spec of the file-name spelling of the name
    file_name = device_name(torch.device("cuda", 0))
    assert spec_of_gpu(file_name) == spec_of_gpu(name) == (spec, kind.spec is not None)
    # the data sheet's rate of the part a built-in spec describes is that spec's
    if kind.word.lower() == kind.spec:
        assert DEVICES[kind.spec].peak_flops["bfloat16"] == kind.bf16_flops
