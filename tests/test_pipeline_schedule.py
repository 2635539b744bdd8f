"""Pipeline schedule tables, the simulator and the PNG timeline."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtorch.errors import PipelineError
from meshtorch.pipeline import build_schedule, memory, simulate
from meshtorch.pipeline.plot import timeline
from meshtorch.pipeline.schedule import Action, Schedule, from_orders
from meshtorch.pipeline.simulate import step_time_bound


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "2bw"]), st.integers(1, 6), st.integers(1, 10))
def test_tables_are_valid_and_bubble_matches_formula(name, p, m):
    t = build_schedule(name, p, m)
    t.validate()
    assert len(t.actions) == 2 * p * m
    assert t.slots == 2 * (m + p - 1)
    want = (p - 1) / (m + p - 1)
    assert t.bubble_fraction() == pytest.approx(want)
    # uniform stage costs in the simulator give the same bubble, for any forward:backward ratio
    sim = simulate(t, forward=0.7, backward=1.4)
    assert sim.bubble_fraction == pytest.approx(want)
    assert sim.step_time == pytest.approx((m + p - 1) * 2.1)
    # in-flight stashes: GPipe holds all m; 1F1B/2BW at most p - s on stage s
    for s in range(p):
        assert t.max_in_flight(s) == (m if name == "gpipe" else min(p - s, m))


def test_1f1b_table_by_hand():
    t = build_schedule("1f1b", 3, 4)
    assert t.order(0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert t.order(2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert [(a.slot, a.kind, a.microbatch) for a in t.for_stage(0)][:5] == [
        (0, "F", 0), (1, "F", 1), (2, "F", 2), (5, "B", 0), (6, "F", 3)]


def test_simulator_non_uniform_by_hand():
    # 2 stages, 2 micro-batches, GPipe; stage 1 three times slower, comm 0.5 per hop:
    # s0: F0 0-1, F1 1-2;  s1: F0 1.5-4.5, F1 4.5-7.5, B0 7.5-10.5, B1 10.5-13.5;
    # s0: B0 11-12, B1 14-15
    sim = simulate(build_schedule("gpipe", 2, 2), forward=[1, 3], backward=[1, 3], comm=0.5)
    assert sim.step_time == pytest.approx(15.0)
    assert sim.busy == [4.0, 12.0]
    assert sim.bubble_fraction == pytest.approx(1 - 16 / 30)


@pytest.mark.parametrize("p,m,steps", [(2, 4, 5), (4, 4, 6), (4, 8, 3)])
def test_2bw_without_flush_has_a_smaller_bubble_than_flushed_1f1b(p, m, steps):
    flushed = build_schedule("1f1b", p, m, batches=steps)
    two_bw = build_schedule("2bw", p, m, batches=steps)
    # by hand, unit slots (F and B one slot each): the flushed run fills and drains the pipeline once
    # per batch, 2(m+p-1) slots each; 2BW once per run, 2(steps*m + p-1) slots
    assert flushed.slots == steps * 2 * (m + p - 1)
    assert two_bw.slots == 2 * (steps * m + p - 1)
    f, b = 1.0, 2.0  # a backward twice a forward
    sf, sw = simulate(flushed, f, b), simulate(two_bw, f, b)
    assert sf.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sw.bubble_fraction == pytest.approx((p - 1) / (steps * m + p - 1))
    assert sw.bubble_fraction < sf.bubble_fraction
    assert sf.step_time == pytest.approx((m + p - 1) * (f + b))
    assert sw.step_time == pytest.approx((steps * m + p - 1) * (f + b) / steps)
    # steady state: between two updates in the middle of the run a 2BW stage is never idle
    upd = [two_bw.update_slot(k) for k in range(steps)]
    assert all(u2 - u1 == 2 * m for u1, u2 in zip(upd[1:], upd[2:]))
    # memory: 2 weight versions and p - s stashes, as with one batch; versions tag batch - 1
    assert (sw.weight_versions, sw.in_flight) == (2, [min(p - s, steps * m) for s in range(p)])
    assert (sf.weight_versions, sf.in_flight) == (1, [min(p - s, m) for s in range(p)])
    assert {(a.microbatch // m, a.version) for a in two_bw.actions} == {(k, k - 1) for k in range(steps)}
    want = [200.0 + 10 * min(p - s, steps * m) for s in range(p)]
    assert memory(two_bw, weights=100, activations=10) == want


@given(name=st.sampled_from(["gpipe", "1f1b", "2bw"]), m=st.integers(1, 6), batches=st.integers(1, 3),
       costs=st.lists(st.tuples(st.floats(0, 5), st.floats(0, 5)), min_size=1, max_size=5),
       comm=st.floats(0, 1))
@settings(max_examples=200, deadline=None)
def test_step_time_bound_is_below_every_simulated_schedule(name, m, batches, costs, comm):
    # the planner prunes pipelined layouts with it: it must hold for uneven stages, any split of
    # a stage's work into forward and backward, any hop time, flushed or not
    if name == "2bw":
        m = max(m, len(costs) - 1)  # 2BW's tables need micro-batches >= stages - 1
    else:
        batches = 1
    f, b = [c[0] for c in costs], [c[1] for c in costs]
    sim = simulate(build_schedule(name, len(costs), m, batches=batches), f, b, comm=comm)
    work = [m * (x + y) for x, y in costs]
    bound = step_time_bound(work, m, batches)
    assert bound <= sim.step_time * (1 + 1e-9) + 1e-12
    # by hand: the first micro-batch's trip through the stages before the busiest one
    k = max(range(len(work)), key=lambda s: work[s] + sum(work[:s]) / (m * batches))
    assert bound == pytest.approx(work[k] + sum(work[:k]) / (m * batches))
    if comm == 0 and len(set(costs)) == 1 and name != "2bw":  # even stages: exactly the flushed step
        assert bound == pytest.approx(sim.step_time)


@given(st.integers(1, 8), st.lists(st.tuples(st.floats(0, 5), st.floats(0, 5), st.floats(0, 5)),
                                   min_size=1, max_size=5), st.floats(0, 1))
@settings(max_examples=100, deadline=None)
def test_step_time_bound_holds_when_an_update_runs_after_the_micro_batches(m, costs, comm):
    # the planner's pipelined step: the replay of the work less each stage's update, plus the
    # slowest update; only the spread part delays the stages after it
    spread = [m * (f + b) for f, b, _ in costs]
    update = [u for _, _, u in costs]
    step = simulate(build_schedule("1f1b", len(costs), m), [f for f, _, _ in costs],
                    [b for _, b, _ in costs], comm=comm).step_time + max(update)
    work = [w + u for w, u in zip(spread, update)]
    assert step_time_bound(work, m, spread=spread) <= step * (1 + 1e-9) + 1e-12
    # with no spread, the bound is the busiest stage's work alone
    assert step_time_bound(work, m, spread=[0.0] * len(work)) == pytest.approx(max(work))


def test_memory_model():
    # 2BW: two weight versions + (p - s) stashes; recompute stashes inputs + one full activation set
    t = build_schedule("2bw", 2, 4)
    assert memory(t, weights=[100, 50], activations=10) == [220.0, 110.0]
    got = memory(t, weights=[100, 50], activations=10, inputs=1, optimizer=7, recompute=True)
    assert got == [219.0, 118.0]
    assert memory(build_schedule("1f1b", 2, 4), weights=100, activations=10) == [120.0, 110.0]
    assert memory(build_schedule("gpipe", 2, 4), weights=100, activations=10) == [140.0, 140.0]


def test_invalid_tables_raise():
    with pytest.raises(PipelineError, match="not one of"):
        build_schedule("zigzag", 2, 2)
    bad = Schedule("x", 2, 1, (Action(0, 0, 0, "F"), Action(0, 1, 0, "F"), Action(1, 1, 0, "B"),
                               Action(2, 0, 0, "B")))
    with pytest.raises(PipelineError, match="before F0 on stage 0"):
        bad.validate()
    with pytest.raises(PipelineError, match="deadlocks"):
        from_orders("x", [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], 1)
    with pytest.raises(PipelineError, match="one non-negative cost per stage"):
        simulate(build_schedule("gpipe", 2, 2), forward=[1.0])


def test_timeline_png(tmp_path):
    t = build_schedule("gpipe", 3, 4)
    path = timeline(t, str(tmp_path / "g.png"), simulation=simulate(t, 1.0, 2.0))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 1000
