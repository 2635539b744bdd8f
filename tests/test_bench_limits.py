"""benchmarks/limits.py counts a step's work as the hand formulas say, and holds times against limits."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench_harness import load_benchmark

limits = load_benchmark("limits")


def _mlp_step(batch: int, d_model: int, d_ff: int, x_grad: bool) -> float:
    """benchmarks/tp_mlp.py's step: two bias-free Linear layers, ReLU, sum of squares, backward."""
    model = torch.nn.Sequential(torch.nn.Linear(d_model, d_ff, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(d_ff, d_model, bias=False))
    x = torch.randn(batch, d_model, requires_grad=x_grad)
    return limits.count(lambda: (model(x) ** 2).sum().backward())[1]


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 9), d_model=st.integers(1, 17), d_ff=st.integers(1, 33), x_grad=st.booleans())
def test_mlp_step_flops_equal_the_hand_formula(batch, d_model, d_ff, x_grad):
    # a [b, m] x [m, f] matmul is 2bmf FLOPs: two forward, then dW2, dh, dW1 (and dx when x needs it)
    matmuls = 2 + 3 + (1 if x_grad else 0)
    assert _mlp_step(batch, d_model, d_ff, x_grad).flops == matmuls * 2 * batch * d_model * d_ff


def test_tp_mlp_default_step_is_0_67_gflop():
    assert _mlp_step(64, 512, 2048, x_grad=False).flops == 671_088_640


def test_bytes_count_operands_and_results_not_views():
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    _, mm = limits.count(lambda: a @ b)
    assert (mm.flops, mm.bytes) == (2 * 6 * 4 * 5, 4 * (6 * 4 + 4 * 5 + 6 * 5))
    _, view = limits.count(lambda: a.t().reshape(24)[:3])  # views and a contiguous copy of a.t()
    assert view.bytes == 4 * (24 + 24)
    c = torch.zeros(6, 4)
    _, inplace = limits.count(lambda: c.add_(a))  # reads c and a, writes c
    assert inplace.bytes == 3 * 4 * 24


def test_figure_is_held_against_the_larger_bound_times_the_cores():
    lim = limits.Limits(flops_per_core=2e9, bytes_per_core=1e9, cores=2)
    work = limits.Work(flops=4_000_000, bytes=1_000_000)
    f = limits.figure("x", 0.004, work, processors=2, lim=lim)
    assert f["flop_bound_s"] == pytest.approx(1e-3) and f["byte_bound_s"] == pytest.approx(5e-4)
    assert f["limit_s"] == pytest.approx(1e-3) and f["x_limit"] == pytest.approx(4.0)
    assert f["flop_fraction"] == pytest.approx(0.25) and f["bandwidth_fraction"] == pytest.approx(0.125)
    row = limits.table([f]).splitlines()[-1]
    assert row == "| x | 2 | 4.00 | 0.004 | 1.0 | 1.00 | 4.00 | 25.0 | 12.5 |"


def test_limits_come_from_the_run_file_when_run_all_set_it(tmp_path, monkeypatch):
    path = tmp_path / "limits.json"
    limits.save(limits.Limits(3e10, 2e10, 4), path)
    assert json.loads(path.read_text()) == {"flops_per_core": 3e10, "bytes_per_core": 2e10, "cores": 4}
    monkeypatch.setenv(limits.ENV, str(path))
    assert limits.limits() == limits.Limits(3e10, 2e10, 4)
    assert "30.0 GFLOP/s per core" in limits.limits().describe()


def test_run_all_table_names_each_benchmark_its_figures_and_failures(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.setitem(sys.modules, "limits", limits)
    spec = importlib.util.spec_from_file_location(
        "bench_run_all", Path(__file__).resolve().parents[1] / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    lim = limits.Limits(flops_per_core=1e9, bytes_per_core=1e9, cores=2)
    fig = limits.figure("step", 0.002, limits.Work(flops=1_000_000, bytes=0), processors=1, lim=lim)
    page = run_all.readme(lim.describe(), [
        {"name": "tp_mlp", "rc": 0, "wall_s": 3.0, "figures": [fig], "note": "", "args": []},
        {"name": "planner", "rc": 1, "wall_s": 1.0, "figures": [], "note": "", "args": [],
         "error": "Traceback: boom"}], quick=True, load=(1.0, 2.0))
    assert "| tp_mlp: step | 1 | 2.00 | 0.001 | 0.0 | 1.00 | 2.00 | 50.0 | 0.0 |" in page
    assert "| planner | failed (exit 1) |" in page and "Traceback: boom" in page
    assert set(run_all.BENCHMARKS) == {p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks")
                                       .glob("*.py")} - run_all.MODULES - set(run_all.BY_HAND)
