"""benchmarks/host_step.py: the host's work per phase of the one-GPU step, meshtorch vs plain, in counts."""

from __future__ import annotations

import pytest

from bench_harness import load_benchmark


def _size(layers: int) -> dict[str, int]:
    return dict(layers=layers, d_model=8, heads=2, d_kv=4, d_ff=16, vocab=32, batch=1, length=4)


@pytest.fixture(scope="module")
def runs():
    bench = load_benchmark("host_step")
    return {n: bench.measure("test", "bf16", 1, 1, size=_size(n)) for n in (1, 3)}


def test_clip_and_optimizer_step_run_no_python_per_parameter(runs):
    """The recipe's clip runs the same Python frames and calls into C at 1 layer as at 3 (its
    parameters listed once, replicated gradients grouped without per-parameter calls), fewer
    than torch.nn.utils.clip_grad_norm_'s; the optimizer step runs plain PyTorch's frames."""
    one, three = (runs[n]["phases"] for n in (1, 3))
    mt1, mt3 = one["clip"]["meshtorch"], three["clip"]["meshtorch"]
    assert (mt1["frames"], mt1["c_calls"]) == (mt3["frames"], mt3["c_calls"])
    assert mt3["frames"] < three["clip"]["plain"]["frames"]
    assert three["step"]["meshtorch"]["frames"] <= three["step"]["plain"]["frames"] + 4
    assert three["zero_grad"]["meshtorch"]["frames"] == three["zero_grad"]["plain"]["frames"]


def test_report_states_the_ratio_and_the_flops(runs):
    r = runs[3]
    assert r["ratio_cpu"] == pytest.approx(r["total"]["meshtorch"]["cpu_ms"] / r["total"]["plain"]["cpu_ms"],
                                           rel=1e-2)
    # the same model and batch: the same FLOPs (FlopCounterMode) on both sides
    assert r["work"]["meshtorch"]["flops"] == r["work"]["plain"]["flops"] > 0
    # a forward's Python grows with the layers on both sides (one Block's ops each)
    per_layer = (r["phases"]["forward"]["meshtorch"]["frames"]
                 - runs[1]["phases"]["forward"]["meshtorch"]["frames"]) / 2
    assert per_layer > 0
