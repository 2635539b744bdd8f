"""The planner's tracer is one owned scope per processor: held by the processor's context,
removed at exit whatever happens, invisible to other launches, and blind to work that is
not the program's (random number drawing)."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest
import torch

import meshtorch as mt
from meshtorch import context
from meshtorch.context import current, use_tracer
from meshtorch.plan import trace
from meshtorch.plan.tracing import tracing


def _step() -> float:
    x = mt.random.normal("batch:8,d:16", seed=1)
    w = mt.random.normal("d:16,f:4", seed=2)
    return mt.reduce_sum(mt.einsum(x, w, output_shape="batch:8,f:4")).item()


def test_concurrent_launches_do_not_see_each_others_tracer():
    solo = trace(_step, mesh="b:2", rules="batch:b", backend="threads")
    traced_running, untraced_done = threading.Event(), threading.Event()
    seen: list = []
    results: dict = {}

    def traced_step() -> float:
        traced_running.set()
        # keep the trace open until the other launch has made all its tensors
        assert untraced_done.wait(60)
        return _step()

    def untraced_step() -> float:
        assert traced_running.wait(60)
        out = _step()
        seen.append(current().tracer)
        return out

    def run_traced() -> None:
        results["traced"] = trace(traced_step, mesh="b:2", rules="batch:b", backend="threads")

    def run_untraced() -> None:
        try:
            results["untraced"] = mt.launch(untraced_step, mesh="b:2", rules="batch:b")
        finally:
            untraced_done.set()

    threads = [threading.Thread(target=run_traced), threading.Thread(target=run_untraced)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen == [None, None]  # both processors of the untraced launch
    got = results["traced"]
    # the traced launch saw its own tensors only: the same trace as when it ran alone
    assert [str(op) for op in got.ops] == [str(op) for op in solo.ops]
    assert got.peak_bytes == solo.peak_bytes and got.flops == solo.flops
    assert results["untraced"] == [got.result, got.result]
    assert context.traced == {}


class _Boom:
    def observe(self, tensor) -> None:
        raise RuntimeError("observer failed")

    def paused(self):
        return nullcontext()


def test_a_tracer_that_raises_is_removed_at_exit():
    with pytest.raises(RuntimeError, match="observer failed"):
        with use_tracer(_Boom()):
            mt.zeros("batch:4")
    assert current().tracer is None and context.traced == {}
    assert mt.zeros("batch:4").local.tolist() == [0.0] * 4  # nobody observes any more

    with pytest.raises(KeyError, match="the traced step failed"):
        with tracing():
            mt.ones("batch:4")
            raise KeyError("the traced step failed")
    assert current().tracer is None and context.traced == {}
    with tracing() as tr:  # a fresh trace starts cleanly
        mt.ones("batch:4")
    assert [op.shape for op in tr.ops] == ["batch:4"]


def test_traces_do_not_nest_on_one_processor():
    with tracing():
        with pytest.raises(mt.errors.PlanError, match="already running"):
            with tracing():
                pass
    assert current().tracer is None


def test_random_initialisation_is_not_counted():
    def init() -> mt.MeshTensor:
        return mt.random.uniform("batch:64,d:32", seed=1)

    real = trace(init, mesh="b:2", rules="batch:b", backend="threads")
    planned = trace(init, mesh="b:2", rules="batch:b", backend="meta")
    # the ~100 integer ops of the counter-based generator are neither ops, FLOPs nor memory:
    # what is left is low + (high - low) * u in float64 on the 32x32 slice, then the cast
    (op,) = real.ops
    assert op.aten == ("mul", "add", "_to_copy")
    assert real.flops == 0
    assert real.peak_bytes == 2 * 32 * 32 * torch.float64.itemsize  # the mul and add results
    # the meta backend never draws numbers at all; the measured run agrees with it exactly
    assert [str(o) for o in real.ops] == [str(o) for o in planned.ops]
    assert real.peak_by_kind == planned.peak_by_kind
