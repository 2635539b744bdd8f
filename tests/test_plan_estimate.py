"""Device specs, collective cost formulas and ``mt.plan.estimate`` against hand-derived numbers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.errors import PlanError
from meshtorch.plan.cost import collective_seconds
from meshtorch.plan.devices import Link, device
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import training_step


def ring_simulation(kind: str, payload: float, n: int, bw: float, lat: float) -> float:
    """Step-by-step ring schedules: each step every member sends one message to its neighbour."""
    if kind == "all_reduce":    # reduce-scatter then all-gather of n chunks of payload/n
        steps, msg = 2 * (n - 1), payload / n
    elif kind == "reduce_scatter":
        steps, msg = n - 1, payload / n
    elif kind == "all_gather":  # the payload is one member's piece; it travels n-1 hops
        steps, msg = n - 1, payload
    elif kind == "all_to_all":  # n-1 rounds, in round r send the chunk for member i+r
        steps, msg = n - 1, payload / n
    else:
        raise AssertionError(kind)
    return steps * (lat + msg / bw)


@given(kind=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]),
       n=st.integers(2, 512), payload=st.floats(1e3, 1e10), bw=st.floats(1e8, 1e12),
       lat=st.floats(0, 1e-4))
@settings(max_examples=200, deadline=None)
def test_ring_formulas_equal_the_step_by_step_schedule(kind, n, payload, bw, lat):
    got = collective_seconds(kind, payload, n, bw, lat)
    assert got == pytest.approx(ring_simulation(kind, payload, n, bw, lat), rel=1e-9)


def test_hand_derived_costs():
    # 1 GB all_reduce over 8 at 100 GB/s, 1 µs: 2·7/8·10 ms + 14 µs
    assert collective_seconds("all_reduce", 1e9, 8, 100e9, 1e-6) == pytest.approx(0.0175 + 14e-6)
    # tree: 2·log2(8) = 6 hops, each the whole payload
    tree = collective_seconds("all_reduce", 1e9, 8, 100e9, 1e-6, algorithm="tree")
    assert tree == pytest.approx(6 * (1e-6 + 0.01))
    assert collective_seconds("broadcast", 1e6, 16, 1e9, 0.0, algorithm="tree") == pytest.approx(4e-3)
    assert collective_seconds("permute", 5e6, 4, 1e9, 2e-6, calls=3) == pytest.approx(5e-3 + 6e-6)
    assert collective_seconds("all_reduce", 1e9, 1, 1.0, 1.0) == 0.0
    with pytest.raises(PlanError, match="gossip"):
        collective_seconds("gossip", 1, 2, 1, 1)


def test_device_specs_and_errors():
    v2, v3, a100, h100 = (device(n) for n in ("tpu-v2", "tpu-v3", "a100", "h100"))
    assert v2.memory_bytes == 8 * 2 ** 30 and v3.memory_bytes == 16 * 2 ** 30
    # the paper: 512 TPU v2 cores peak at 11.5 PFLOP/s
    assert 512 * v2.peak_flops["bfloat16"] == pytest.approx(11.5e15, rel=0.01)
    assert v3.peak_flops["bfloat16"] == 61.5e12 and a100.peak_flops["bfloat16"] == 312e12
    assert h100.peak_flops["bfloat16"] == 989e12 and h100.default_link.bandwidth == 450e9
    fast = a100.with_links(m=Link(1e12, 1e-6))
    assert fast.link("m").bandwidth == 1e12 and fast.link("b") == a100.default_link
    with pytest.raises(PlanError, match="'tpu-v9'.*tpu-v2"):
        device("tpu-v9")


def test_cpu_is_calibrated_once_and_stored(tmp_path, monkeypatch, capsys):
    from meshtorch.cli import main
    from meshtorch.plan import devices

    monkeypatch.setenv("MESHTORCH_CACHE_DIR", str(tmp_path))
    assert main(["plan", "--calibrate"]) == 0
    assert str(tmp_path / "cpu.json") in capsys.readouterr().err
    stored = devices.load_spec(tmp_path / "cpu.json")
    assert stored.peak_flops["float32"] > 1e8 and stored.default_link.bandwidth > 1e8
    assert stored.memory_bytes > 2 ** 20

    def no_measuring():
        raise AssertionError("a stored calibration is not measured again")

    monkeypatch.setattr(devices, "measure_cpu", no_measuring)
    # four thread-processors share the machine: a quarter of its FLOP/s and memory each, every time
    for _ in range(2):
        four = device("cpu", processors=4)
        assert four.peak_flops["float32"] == stored.peak_flops["float32"] / 4
        assert four.memory_bytes == stored.memory_bytes // 4 and four.default_link == stored.default_link


def test_a_device_file_is_planned_with(tmp_path):
    spec = {"name": "lab-gpu", "peak_flops": {"float32": 2e12, "bfloat16": 8e12}, "memory_bytes": 2 ** 30,
            "achievable": 1.0, "link": {"bandwidth": 1e9, "latency": 1e-6},
            "links": {"m": {"bandwidth": 4e9, "latency": 2e-6}}}
    path = tmp_path / "lab-gpu.json"
    path.write_text(json.dumps(spec))
    est = mt.plan.estimate(training_step(CFG, vocab=64), "b:2,m:2", "batch:b; d_ff:m", device=str(path))
    assert est.device == "lab-gpu" and est.memory_capacity == 2 ** 30
    assert est.compute_seconds == pytest.approx(est.flops / 2e12)
    calls, nbytes = est.calls_per_axis["m"]["all_reduce"], est.bytes_per_axis["m"]["all_reduce"]
    assert est.comm_seconds["all_reduce@m"] == pytest.approx(2 * 1 / 2 * nbytes / 4e9 + 2 * 1 * 2e-6 * calls)
    calls, nbytes = est.calls_per_axis["b"]["all_reduce"], est.bytes_per_axis["b"]["all_reduce"]
    assert est.comm_seconds["all_reduce@b"] == pytest.approx(nbytes / 1e9 + 2 * 1e-6 * calls)
    assert device(path) == device(str(path))  # a path or its text; never divided by processors


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "must hold one JSON object"),
    ('{"peak_flops": {"float32": 1e12}, "memory_bytes": 1}', r"needs the field\(s\) \['link'\]"),
    ('{"peak_flops": {"bfloat16": 1e12}, "memory_bytes": 1, "link": {"bandwidth": 1, "latency": 0}}',
     "must map dtypes to FLOP/s and include \"float32\""),
    ('{"peak_flops": {"float32": 1}, "memory_bytes": 1, "link": {"bandwidth": 1}}', "link must be"),
    ('{"peak_flops": {"float32": 1}, "memory_bytes": 1, "link": {"bandwidth": 1, "latency": 0}, "tflops": 3}',
     r"unknown field\(s\) \['tflops'\]"),
    ("{not json", "is not JSON"),
    # a field of the wrong type or sign: it raised ValueError ("invalid literal for int()") or a
    # spec that divides by zero
    ('{"peak_flops": {"float32": 1}, "memory_bytes": "lots", "link": {"bandwidth": 1, "latency": 0}}',
     "memory_bytes must be a positive number, got 'lots'"),
    ('{"peak_flops": {"float32": 0}, "memory_bytes": 1, "link": {"bandwidth": 1, "latency": 0}}',
     "peak_flops.float32 must be a positive number, got 0"),
    ('{"peak_flops": {"float32": 1}, "memory_bytes": 1, "link": {"bandwidth": "fast", "latency": 0}}',
     "link.bandwidth must be a positive number"),
    ('{"peak_flops": {"float32": 1}, "memory_bytes": 1, "link": {"bandwidth": 1, "latency": 0}, '
     '"links": [1]}', "links must map mesh axes to links"),
    ('{"peak_flops": {"float32": 1}, "memory_bytes": 1, "link": {"bandwidth": 1, "latency": 0}, '
     '"launch_seconds": -3e-6}', "launch_seconds must be a non-negative number"),
])
def test_device_file_errors_name_the_file_and_field(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=match) as err:
        device(path)
    assert str(path) in str(err.value)
    with pytest.raises(PlanError, match="cannot read device file"):
        device(tmp_path / "missing.json")


CFG = TrainConfig.of(d_model=32, heads=4, d_kv=8, d_ff=64, layers=2, batch=8, length=16)


def test_data_parallel_estimate_matches_hand_derivation():
    # the per-use path (--no-overlap): blocking all_reduces, whose time adds to the compute's
    per_use = CFG.replace(overlap=False)
    est = mt.plan.estimate(training_step(per_use, vocab=64), "b:4", "batch:b", device="a100")
    params = est.parameters
    assert params == 64 * 32 + 16 * 32 + 2 * (4 * 32 * 32 + 2 * 32 * 64 + 4 * 32) + 64
    # data parallel: every gradient (float32) is all_reduced over b once, the tied embedding
    # table's too (its lookup and output layer add their partial gradients first, as Mesh-TF's lazy
    # all-reduce), plus a few scalars. (The position table's gradient is reduced as the
    # [length, d_model] activation it adds: the same size here, length = max_length.)
    ar = est.bytes_per_axis["b"]["all_reduce"]
    assert 4 * params <= ar < 4 * params + 64
    assert list(est.bytes_per_axis) == ["b"]
    spec = device("a100")
    calls = est.calls_per_axis["b"]["all_reduce"]
    want = 2 * 3 / 4 * ar / spec.default_link.bandwidth + 2 * 3 * spec.default_link.latency * calls
    assert est.comm_seconds["all_reduce@b"] == pytest.approx(want)
    assert est.compute_seconds == pytest.approx(est.flops / (312e12 * 0.5 * 19.5 / 312))
    assert est.step_seconds == pytest.approx(est.compute_seconds + want)
    # memory: float32 parameters and AdamW's two moments, replicated; no gradients at the peak:
    # the step before's (float32, replicated: alive as the step begins) are freed by zero_grad before
    # the forward, and the peak, the forward's values as backward starts, comes before the first new one
    m = est.memory_bytes
    assert m["parameters"] == est.trace.start_by_kind["gradients"] == 4 * params
    assert m["gradients"] == 0
    assert 8 * params <= m["optimizer"] <= 8 * params + 4 * 64
    assert est.fits
    assert m["total"] == sum(m[k] for k in ("parameters", "gradients", "optimizer", "activations"))


def test_model_parallel_shrinks_parameters_per_processor():
    dp = mt.plan.estimate(training_step(CFG, vocab=64), "b:4", "batch:b", device="tpu-v2")
    mp = mt.plan.estimate(training_step(CFG, vocab=64), "m:4", "heads:m; d_ff:m; vocab:m", device="tpu-v2")
    assert mp.parameters == dp.parameters
    assert mp.memory_bytes["parameters"] < dp.memory_bytes["parameters"] / 2
    assert "b" not in mp.bytes_per_axis and mp.bytes_per_axis["m"]["all_reduce"] > 0


def test_estimate_json_and_table_and_not_fitting():
    tiny = dataclasses.replace(device("tpu-v2"), memory_bytes=1000, name="tiny")
    est = mt.plan.estimate(training_step(CFG, vocab=64), "b:2,m:2", "batch:b; d_ff:m", device=tiny)
    j = est.to_json()
    for key in ("parameters", "fits", "memory_bytes", "bytes_per_axis", "flops", "step_seconds"):
        assert key in j
    assert j["fits"] is False and "does not fit" in j["reason"]
    assert set(j["bytes_per_axis"]) == {"b", "m"}
    assert "DOES NOT FIT" in est.table() and "all_reduce" in est.table()
    assert math.isfinite(j["step_seconds"]) and j["step_seconds"] > 0


def _two_ops():
    import torch

    x = torch.ones(4, 8)
    y = torch.ones(8, 2)
    with mt.plan.measure():
        (x @ y).sum()


def test_host_time_per_aten_op_is_priced(monkeypatch, tmp_path):
    from meshtorch.plan import devices
    from meshtorch.plan.estimate import from_trace

    t = mt.plan.trace(_two_ops, mesh="b:1")
    assert t.aten_ops == 2  # mm and sum: the ones made before measure() are not the step's
    spec = dataclasses.replace(device("a100"), op_seconds=1e-3, achievable=1.0)
    est = from_trace(t, "b:1", spec)
    assert est.compute_seconds == pytest.approx(2 * 4 * 8 * 2 / 19.5e12 + 2e-3)
    # a device file carries it; processors beyond the cores stretch it, as they share the FLOP/s
    path = tmp_path / "host.json"
    devices.save_spec(spec, path)
    assert devices.load_spec(path).op_seconds == 1e-3
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    assert devices.share(spec, 2).op_seconds == 1e-3 and devices.share(spec, 8).op_seconds == 4e-3
    assert devices.share(spec, 8).peak_flops["float32"] == spec.peak_flops["float32"] / 8
