"""meshtorch.plan.gpus: the one table of GPU names and their data sheets' rates. Each GPU is priced
with its own rates wherever a GPU is chosen (``--hardware``, ``meshtorch train --rules auto`` by the
name CUDA gives, the calibration's link; gpu_step's nominal rate is its doctest's); one that is not
in the table is an error naming the fix, never another GPU's price. No GPU here:
``torch.cuda.get_device_name`` is mocked."""

from __future__ import annotations

import json
import re

import pytest
import torch

from meshtorch.errors import PlanError
from meshtorch.plan.devices import DEVICES, H100_KERNELS, device
from meshtorch.plan.gpu_calibration import device_name, unmeasured_link
from meshtorch.plan.gpus import FALLBACK_LINK, GPUS, gpu_kind, spec_of_gpu
from meshtorch.plan.kernels import matmul_efficiency, roofline_seconds
from meshtorch.recipes.lm import TrainConfig, plan_cli

# names as torch.cuda.get_device_name() gives them, the spec each is, and its data sheet's dense
# bf16 TFLOP/s, memory GB and memory bandwidth TB/s (typed from the data sheets, not from the table)
NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100", 989, 80, 3.35), ("NVIDIA H100 PCIe", "h100-pcie", 756, 80, 2.0),
    ("NVIDIA H100 NVL", "h100-nvl", 835, 94, 3.9), ("NVIDIA H200", "h200", 989, 141, 4.8),
    ("NVIDIA H200 NVL", "h200-nvl", 835, 141, 4.8), ("NVIDIA H800", "h800", 989, 80, 3.35),
    ("NVIDIA H800 PCIe", "h800-pcie", 756, 80, 2.0), ("NVIDIA B200", "b200", 2250, 180, 7.7),
    ("NVIDIA A100-SXM4-80GB", "a100", 312, 80, 2.039), ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312, 40, 1.555),
    ("NVIDIA A100 80GB PCIe", "a100-pcie", 312, 80, 1.935),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb", 312, 40, 1.555),
    ("NVIDIA A800-SXM4-80GB", "a800", 312, 80, 2.039), ("NVIDIA A800 80GB PCIe", "a800-pcie", 312, 80, 1.935),
    ("NVIDIA L40S", "l40s", 362, 48, 0.864), ("NVIDIA L4", "l4", 121, 24, 0.3)]
# (the A800 40GB Active: its words are the a800 row's, an 80 GB card; `--hardware` with its name
# priced it as that one, since only --rules auto reads the memory the card reports; a MIG slice's
# name is its whole GPU's and its slice's: 10 GB and a seventh of the A100's rates)
UNKNOWN = ["NVIDIA GeForce RTX 4090", "NVIDIA L40", "NVIDIA GH200 480GB", "Tesla V100-SXM2-16GB",
           "NVIDIA A800 40GB Active", "NVIDIA A100-SXM4-80GB MIG 1g.10gb"]


@pytest.fixture
def on_gpu(monkeypatch, tmp_path):
    """``meshtorch train --rules auto``'s view of a machine whose GPU is called the name given, with no
    calibration of it stored."""
    monkeypatch.setattr(plan_cli, "gpu_calibration_path", lambda file_name: tmp_path / f"{file_name}.json")

    def run_on(name: str) -> tuple[str, str]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        return plan_cli.hardware_of_run(TrainConfig.of(device="cuda"), 1)

    return run_on


@pytest.mark.parametrize(("name", "spec", "tflops", "gb", "tbs"), NAMES, ids=[n[1] for n in NAMES])
def test_a_gpu_detected_by_its_cuda_name_is_priced_with_its_data_sheet(name, spec, tflops, gb, tbs, on_gpu):
    assert spec_of_gpu(name) == spec and gpu_kind(name).bf16_flops == tflops * 1e12
    # the file-name spelling of the name (meshtorch plan --calibrate's) finds the same row
    assert spec_of_gpu(name.lower().replace(" ", "-")) == spec
    hardware, source = on_gpu(name)
    assert hardware == spec and f"the built-in {spec} spec for {name}" in source
    got = device(hardware)
    assert got is DEVICES[spec] and device(name) is got and got.name == spec
    assert got.peak_flops["bfloat16"] == got.peak_flops["float16"] == tflops * 1e12
    assert got.memory_bytes == gb * 10 ** 9 and got.memory_bandwidth == pytest.approx(tbs * 1e12)
    # the H100's kernel numbers are assumed on the other roofline GPUs, and the source says so
    assert ("measured on an H100 SXM, assumed" in source) == (got.roofline and spec != "h100")


# every row's plain fp32 TFLOP/s and its link each way in GB/s: half the sheet's both-ways NVLink
# (H100/H200 900, H800 400, B200 1,800, A100 600, A800 400) or PCIe x16 (5.0: 128, 4.0: 64) figure
FP32_AND_LINK = [
    ("h100", 67, 450, True), ("h100-pcie", 51, 64, False), ("h100-nvl", 60, 64, False),
    ("h200", 67, 450, True), ("h200-nvl", 60, 64, False), ("h800", 67, 200, True),
    ("h800-pcie", 51, 64, False), ("b200", 75, 900, True), ("a100", 19.5, 300, True),
    ("a100-40gb", 19.5, 300, True), ("a100-pcie", 19.5, 32, False), ("a100-pcie-40gb", 19.5, 32, False),
    ("a800", 19.5, 200, True), ("a800-pcie", 19.5, 32, False), ("l40s", 91.6, 32, False),
    ("l4", 30.3, 32, False)]


def test_every_row_has_its_fp32_rate_and_link_typed_here():
    assert sorted(row[0] for row in FP32_AND_LINK) == sorted(kind.spec for kind in GPUS)


@pytest.mark.parametrize(("spec", "fp32", "link_gbs", "nvlink"), FP32_AND_LINK,
                         ids=[row[0] for row in FP32_AND_LINK])
def test_fp32_rate_and_link_are_the_data_sheets(spec, fp32, link_gbs, nvlink):
    got = DEVICES[spec]
    assert got.peak_flops["float32"] == fp32 * 1e12
    # each way: half the data sheet's both-ways NVLink or PCIe x16 figure
    assert got.default_link.bandwidth == link_gbs * 1e9
    assert got.default_link.latency == (5e-6 if nvlink else 10e-6)


def _mm(m: int, n: int, k: int) -> tuple:
    """The tracer's kernel key of one bf16 [m, k] @ [k, n] product (plan/kernels.py)."""
    return ("mm", "bfloat16", 2 * m * n * k, 2 * (m * k + k * n + m * n), (1, m, n, k), 1, 0)


def test_one_matmul_is_priced_at_each_gpus_own_rate():
    m = n = k = 8192
    flops = 2 * m * n * k
    eff = H100_KERNELS["achievable"] * matmul_efficiency(m, n, k, H100_KERNELS["matmul_knee"])
    times = {}
    # the data sheets' dense bf16 rates; the planner reaches 745/989 of each at this shape's efficiency
    for spec, peak in (("h100", 989e12), ("h100-pcie", 756e12), ("l4", 121e12)):
        t = roofline_seconds({_mm(m, n, k): 1}, 0, DEVICES[spec])
        assert t["matmul"] == pytest.approx(flops / (peak * eff), rel=1e-12), spec
        assert t["memory"] == 0.0   # compute-bound on all three
        times[spec] = t["matmul"]
    assert times["h100-pcie"] / times["h100"] == pytest.approx(989 / 756)   # not the SXM's 989
    assert times["l4"] / times["h100"] == pytest.approx(989 / 121)          # not an H100's
    assert 1.4e-3 < times["h100"] < 1.6e-3 and 11e-3 < times["l4"] < 13e-3  # 1.1 TFLOP: ~1.5 ms / ~12 ms


def test_a_memory_bound_op_is_priced_at_each_gpus_own_bandwidth():
    add = ("add", "bfloat16", 0, 3 * 2 ** 30, (), 1, 0)
    for spec, hbm in (("h100", 3.35e12), ("h100-pcie", 2.0e12), ("l4", 0.3e12), ("b200", 7.7e12)):
        # the H100 SXM's copy reached 3.0 of its 3.35 TB/s: the same fraction of each GPU's own
        got = roofline_seconds({add: 1}, 0, DEVICES[spec])["memory"]
        assert got == pytest.approx(3 * 2 ** 30 / (hbm * 3.0 / 3.35)), spec


def test_a_plan_on_h100_pcie_costs_what_its_rates_say(capsys):
    from meshtorch.cli import main

    # large enough that every matmul is compute-bound on all three (the memory-bound ops scale apart)
    flags = ["plan", "--d-model", "2048", "--heads", "16", "--d-kv", "128", "--d-ff", "8192", "--layers", "1",
             "--batch", "8", "--length", "1024", "--vocab", "64", "--mesh", "b:1", "--rules", "batch:b",
             "--precision", "bf16", "--no-layered", "--json"]
    plans, notes = {}, {}
    for hardware in ("h100", "h100-pcie", "NVIDIA L4"):
        assert main([*flags, "--hardware", hardware]) == 0
        out = capsys.readouterr()
        plans[hardware], notes[hardware] = json.loads(out.out), out.err
    # the plan says where the H100's kernel numbers stand in for a GPU's own
    assert "measured on an H100 SXM" not in notes["h100"]
    assert "l4 is priced at its data sheet's rates with kernel efficiencies measured on an H100 SXM, " \
        "assumed for the L4" in notes["NVIDIA L4"]
    assert [p["device"] for p in plans.values()] == ["h100", "h100-pcie", "l4"]
    sxm, pcie, l4 = (plans[h]["compute_terms"]["matmul"] for h in ("h100", "h100-pcie", "NVIDIA L4"))
    assert pcie / sxm == pytest.approx(989 / 756) and l4 / sxm == pytest.approx(989 / 121)
    assert plans["NVIDIA L4"]["memory_bytes"]["capacity"] < plans["h100"]["memory_bytes"]["capacity"] / 3


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_gpu_is_an_error_naming_the_fix_not_an_h100(name, on_gpu):
    assert gpu_kind(name) is None
    with pytest.raises(PlanError, match="meshtorch plan --calibrate --device cuda"):
        spec_of_gpu(name)
    why = "is a MIG slice (a part of a GPU" if "MIG" in name else "is not in meshtorch.plan.gpus.GPUS"
    rules_auto = re.escape(f"--rules auto: the GPU '{name}' {why}") + ".*explicit --rules"
    with pytest.raises(PlanError, match=rules_auto):
        on_gpu(name)
    with pytest.raises(PlanError, match=re.escape(f"the GPU '{name}' {why}")):
        spec_of_gpu(name)
    # --hardware with its name: the fix named there too (it listed the known specs only)
    with pytest.raises(PlanError, match="unknown device.*meshtorch plan --calibrate --device cuda"):
        device(name)


def test_an_unknown_gpu_calibrated_alone_gets_a_pcie_link_and_is_told_so():
    # measure_gpu on one GPU keeps its kind's data-sheet link; a GPU not in the table PCIe 4.0's
    assert unmeasured_link("nvidia-h100-pcie") == DEVICES["h100-pcie"].default_link
    assert unmeasured_link("nvidia-geforce-rtx-4090").bandwidth == FALLBACK_LINK["link_bandwidth"] == 32e9
    assert "PCIe 4.0 x16 64 GB/s assumed" in plan_cli._link_source("nvidia-geforce-rtx-4090", 1)
    assert "NVLink 900 GB/s of the h100 spec" in plan_cli._link_source("nvidia-h100-80gb-hbm3", 1)


@pytest.mark.parametrize("kind", GPUS, ids=lambda kind: kind.spec)
def test_every_row_is_found_by_its_own_words_and_builds_its_spec(kind, monkeypatch):
    name = f"NVIDIA {kind.word}"
    assert gpu_kind(name) == kind   # no other row takes its name
    assert gpu_kind(kind.spec) == kind and device(kind.spec) is device(name)   # its spec's key names it too
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert spec_of_gpu(device_name(torch.device("cuda", 0))) == kind.spec
    spec = DEVICES[kind.spec]
    assert spec.peak_flops["bfloat16"] == kind.bf16_flops and spec.memory_bytes == kind.memory_bytes
    assert spec.roofline == kind.roofline


PLAN_FLAGS = ["plan", "--d-model", "64", "--heads", "4", "--d-kv", "16", "--d-ff", "128", "--layers", "1",
              "--batch", "8", "--length", "32", "--vocab", "64", "--mesh", "b:2", "--rules", "batch:b",
              "--no-layered", "--json"]


def _plan(capsys, *flags) -> tuple[dict, str]:
    from meshtorch.cli import main

    assert main([*PLAN_FLAGS, *flags]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_plan_hardware_cuda_prices_this_machines_gpu_as_rules_auto_does(on_gpu, tmp_path, monkeypatch,
                                                                        capsys):
    """Seen: `meshtorch plan --hardware cuda` said "unknown device 'cuda'"; it is this machine's GPU:
    its row of the table (or its stored calibration), as `meshtorch train --rules auto` picks it."""
    on_gpu("NVIDIA H100 PCIe")  # CUDA's name of this machine's GPU, no calibration stored
    want, _ = _plan(capsys, "--hardware", "h100-pcie")
    got, err = _plan(capsys, "--hardware", "cuda")
    assert got == want and got["device"] == "h100-pcie"
    assert "pricing the built-in h100-pcie spec for NVIDIA H100 PCIe" in err
    # --hardware auto: the hardware --device computes on, the GPU where it is cuda
    assert _plan(capsys, "--hardware", "auto", "--device", "cuda")[0] == want
    assert _plan(capsys, "--hardware", "auto", "--device", "cpu")[0] == _plan(capsys, "--hardware", "cpu")[0]
    # a stored calibration of this GPU wins over its row, as for --rules auto
    from dataclasses import replace

    from meshtorch.plan.devices import save_spec

    calibrated = replace(device("h100-pcie"), name="lab-h100", memory_bytes=int(50e9))

    path = tmp_path / f"{device_name(torch.device('cuda', 0))}.json"
    save_spec(calibrated, path)
    got, err = _plan(capsys, "--hardware", "cuda")
    assert got == _plan(capsys, "--hardware", str(path))[0] and got["device"] == "lab-h100"
    assert got["memory_bytes"]["capacity"] < want["memory_bytes"]["capacity"]
    assert "as meshtorch plan --calibrate measured it" in err


@pytest.mark.parametrize("error", [AssertionError("Torch not compiled with CUDA enabled"),
                                   RuntimeError("No CUDA GPUs are available")])
def test_plan_hardware_cuda_without_a_gpu_names_the_fixes(error, monkeypatch, capsys):
    def no_gpu(*a):
        raise error

    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu)
    from meshtorch.cli import main

    assert main([*PLAN_FLAGS, "--hardware", "cuda"]) == 2
    err = capsys.readouterr().err
    assert (f"--hardware cuda prices this machine's GPU, but torch sees no CUDA GPU on this machine "
            f"({error}); name the GPU to price (--hardware h100") in err and "--hardware cpu" in err, err
    assert "unknown device" not in err and "Traceback" not in err


def test_plan_hardware_cuda_on_an_unknown_gpu_names_the_plan_fixes(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_cli, "gpu_calibration_path", lambda file_name: tmp_path / f"{file_name}.json")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GeForce RTX 4090")
    want = ("--hardware cuda: the GPU 'NVIDIA GeForce RTX 4090' is not in .*price it with.*--calibrate "
            "--device cuda.*name the hardware to price")
    with pytest.raises(PlanError, match=want):
        plan_cli.planned_hardware("cuda", TrainConfig.of())
