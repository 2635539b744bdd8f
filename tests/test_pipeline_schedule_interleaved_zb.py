"""Interleaved 1F1B (virtual stages), ZB-H1 (split backward) and ZB-V (both, in a V) as schedule
tables: validity, in-flight stashes, the simulated bubble against the published formulas, one table
driving the simulator and the timeline, and the search's step-time bound for these tables."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.errors import PipelineError
from meshtorch.pipeline import Pipeline, build_schedule, memory, simulate
from meshtorch.pipeline.executor import Executor
from meshtorch.pipeline.plot import timeline
from meshtorch.pipeline.schedule import Action, Schedule
from meshtorch.pipeline.simulate import chain_share, step_time_bound
from test_pipeline import batches, make_stages, reference


def _slots(table, kind):
    """(stage, chunk, micro-batch) -> slot of the ``kind`` actions."""
    return {(a.stage, a.chunk, a.microbatch): a.slot for a in table.actions if a.kind == kind}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4),
       st.sampled_from([(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)]))
def test_interleaved_table_and_bubble(p, v, rounds, costs):
    m = rounds * p  # micro-batches go through the chunks in rounds of p
    t = build_schedule("interleaved", p, m, virtual_stages=v)
    t.validate()
    assert len(t.actions) == 2 * p * v * m
    f, b = _slots(t, "F"), _slots(t, "B")
    assert set(f) == set(b) == {(s, c, i) for s in range(p) for c in range(v) for i in range(m)}
    # every (micro-batch, chunk)'s forward before its backward; the forward of model chunk k·p + s
    # after that of chunk k·p + s - 1 (on stage s - 1, or on stage p - 1 one local chunk earlier)
    for (s, c, i), slot in f.items():
        assert slot < b[(s, c, i)]
        if (c, s) != (0, 0):
            assert f[(s - 1, c, i) if s else (p - 1, c - 1, i)] < slot
    # unit slots: Narayanan et al.'s bubble, the pipeline fill and drain shrunk v times
    assert t.slots == 2 * (v * m + p - 1)
    want = (p - 1) / (v * m + p - 1)
    assert t.bubble_fraction() == pytest.approx(want)
    sim = simulate(t, forward=costs[0], backward=costs[1])
    assert sim.bubble_fraction == pytest.approx(want)
    assert sim.step_time == pytest.approx((v * m + p - 1) * sum(costs) / v)
    # Megatron's warm-up: 2(p-1-s) + (v-1)p chunk forwards, one more before the first backward
    for s in range(p):
        peak = min(v * m, 2 * (p - 1 - s) + (v - 1) * p + 1) if v > 1 else min(p - s, m)
        assert t.max_in_flight(s) == peak
    # every chunk boundary is a hop: 2m(p·v - 1) messages per batch (1F1B: 2m(p - 1))
    assert sim.messages == (2 * m * (p * v - 1) if p > 1 else 0)
    if v == 1:
        assert [t.order(s) for s in range(p)] == [build_schedule("1f1b", p, m).order(s) for s in range(p)]


def test_interleaved_by_hand():
    t = build_schedule("interleaved", 2, 2, virtual_stages=2)
    assert [str(a) for a in t.for_stage(0)] == ["F0@s0t0", "F1@s0t1", "F0c1@s0t2", "F1c1@s0t3", "B0c1@s0t5",
                                                "B1c1@s0t7", "B0@s0t8", "B1@s0t9"]
    assert [str(a) for a in t.for_stage(1)] == ["F0@s1t1", "F1@s1t2", "F0c1@s1t3", "B0c1@s1t4", "F1c1@s1t5",
                                                "B1c1@s1t6", "B0@s1t7", "B1@s1t8"]
    # each chunk pass takes half the stage's second, each hop 0.25: micro-batch 0 reaches model
    # chunk 3 (stage 1's chunk 1) after 0.5 + .25 + .5 + .25 (chunk 2 on stage 0, free since 1.0)
    # + .5 + .25 = 2.25
    sim = simulate(t, forward=1.0, backward=1.0, comm=0.25)
    a = next(a for a in t.actions if (a.kind, a.stage, a.chunk, a.microbatch) == ("F", 1, 1, 0))
    assert (sim.start[a], sim.end[a]) == (2.25, 2.75)
    assert sim.messages == 12
    # memory: a stash is one chunk's, half the stage's activations; stage 0 holds 5 of them
    four = build_schedule("interleaved", 2, 4, virtual_stages=2)
    assert [four.max_in_flight(s) for s in range(2)] == [5, 3]
    assert memory(four, weights=100, activations=10) == [125.0, 115.0]
    assert memory(four, weights=100, activations=10, inputs=1, recompute=True) == [110.0, 108.0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.floats(0.1, 3.0))
def test_zb_h1_table_and_bubble(p, m, c):
    t = build_schedule("zb", p, m)
    t.validate()
    assert t.split_backward and len(t.actions) == 3 * p * m
    f, b, w = _slots(t, "F"), _slots(t, "B"), _slots(t, "W")
    for key in f:
        assert f[key] < b[key] < w[key]
    # 1F1B's memory: a stash lives from F to W, at most min(p, m) of them (1F1B's stage 0)
    peak = max(t.max_in_flight(s) for s in range(p))
    assert peak == min(p, m) == build_schedule("1f1b", p, m).max_in_flight(0)
    # F = B = W = 1 slot: 3m + p - 1 slots for m >= p; fill and drain of 2m + 2p - 1 otherwise
    assert t.slots == max(3 * m + p - 1, 2 * m + 2 * p - 1)
    sim = simulate(t, forward=c, backward=c, weight=c)
    flush = simulate(build_schedule("1f1b", p, m), forward=c, backward=2 * c)  # backward = B + W
    if m >= p:
        assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        # idle time per stage: (p-1)·c against 1F1B's 3(p-1)·c, a third
        assert sim.step_time - 3 * m * c == pytest.approx((flush.step_time - 3 * m * c) / 3)
    assert flush.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.bubble_fraction <= flush.bubble_fraction + 1e-12


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 6), st.floats(0.1, 2.0), st.floats(0.1, 2.0), st.floats(0, 1))
def test_zb_h1_idle_is_the_papers_for_a_light_weight_gradient(p, extra, f, b, share):
    # Qi et al.: ZB-H1's bubble is (p-1)(F + B - W) per stage (1F1B's: (p-1)(F + B + W)), here
    # exactly so whenever W <= min(F, B) and m >= p
    m, w = p + extra, share * min(f, b)
    sim = simulate(build_schedule("zb", p, m), forward=f, backward=b, weight=w)
    assert sim.step_time - m * (f + b + w) == pytest.approx((p - 1) * (f + b - w), abs=1e-9)


def test_zb_h1_by_hand():
    t = build_schedule("zb", 3, 3)
    # stage s defers up to s weight gradients and runs them when its next F/B must wait
    assert [str(a) for a in t.for_stage(0)] == ["F0@s0t0", "F1@s0t1", "F2@s0t2", "B0@s0t5", "W0@s0t6",
                                                "B1@s0t7", "W1@s0t8", "B2@s0t9", "W2@s0t10"]
    assert [str(a) for a in t.for_stage(1)] == ["F0@s1t1", "F1@s1t2", "B0@s1t4", "F2@s1t5", "B1@s1t6",
                                                "W0@s1t7", "B2@s1t8", "W1@s1t9", "W2@s1t10"]
    assert [str(a) for a in t.for_stage(2)] == ["F0@s2t2", "B0@s2t3", "F1@s2t4", "B1@s2t5", "F2@s2t6",
                                                "B2@s2t7", "W0@s2t8", "W1@s2t9", "W2@s2t10"]
    assert t.update_slot(0) == 11
    # memory: 3 stashes on every stage, 1F1B's 3 on stage 0 only
    assert memory(t, weights=100, activations=10) == [130.0, 130.0, 130.0]
    assert memory(build_schedule("1f1b", 3, 3), weights=100, activations=10) == [130.0, 120.0, 110.0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 14), st.integers(1, 2), st.floats(0.1, 3.0))
def test_zb_v_table_memory_and_bubble(p, m, batches, c):
    t = build_schedule("zbv", p, m, batches=batches, virtual_stages=2)
    t.validate()
    assert (t.placement, t.split_backward, len(t.actions)) == ("v", True, 6 * p * m * batches)
    # the V: model chunk c < p on stage c, chunk c >= p on stage 2p-1-c; every (micro-batch, chunk)
    # runs F, B, W in order, its forward after the previous model chunk's, its B after the next one's
    f, b, w = _slots(t, "F"), _slots(t, "B"), _slots(t, "W")
    assert [t.where(k) for k in range(2 * p)] == [(k, 0) for k in range(p)] + \
        [(p - 1 - k, 1) for k in range(p)]
    for (s, k, i), slot in f.items():
        assert slot < b[(s, k, i)] < w[(s, k, i)]
        mc = t.model_chunk(Action(0, s, i, "F", chunk=k))
        if mc > 0:
            assert f[(*t.where(mc - 1), i)] < slot
        if mc < 2 * p - 1:
            assert b[(*t.where(mc + 1), i)] < b[(s, k, i)]
    # 1F1B's memory: at most 2·min(p, m) half-stage stashes on a stage, 1F1B's stage-0 peak
    assert max(t.max_in_flight(s) for s in range(p)) == 2 * min(p, m)
    assert max(memory(t, weights=100, activations=10)) == memory(build_schedule("1f1b", p, m), 100, 10)[0]
    # each stage's chunk passes take c (its stage's F, B and W 2c): a batch takes 6m + p - 1 chunk slots for
    # m >= 2p - 1, idle (p-1)·c per stage: half of ZB-H1's (p-1)·2c, a sixth of 1F1B's 3(p-1)·2c
    sim = simulate(t, forward=2 * c, backward=2 * c, weight=2 * c)
    zb = simulate(build_schedule("zb", p, m), forward=2 * c, backward=2 * c, weight=2 * c)
    if m >= 2 * p - 1:
        assert t.slots == batches * (6 * m + p - 1)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert sim.step_time - 6 * m * c == pytest.approx((zb.step_time - 6 * m * c) / 2)
    assert sim.bubble_fraction <= zb.bubble_fraction + 1e-12
    # chunk p-1 hands its output to chunk p on the same stage: 4m(p-1) messages, not 2m(2p-1)
    assert sim.messages == 4 * m * (p - 1)


def test_zb_v_by_hand():
    t = build_schedule("zbv", 2, 3, virtual_stages=2)
    # F1.0: the forward of micro-batch 1 on local chunk 0 (model chunk s); .1 is model chunk 3 - s
    rows = [" ".join(f"{a.kind}{a.microbatch}.{a.chunk}" for a in t.for_stage(s)) for s in range(2)]
    # torch.distributed.pipelining's ScheduleZBVZeroBubble order: stage 0 runs 2p - 1 = 3 forwards of model
    # chunk 0, then F, B, W on model chunk 3 (the loss) as each micro-batch comes back up the V
    assert rows == [
        "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0.0 W0.0 F2.1 B2.1 W2.1 B1.0 W1.0 B2.0 W2.0",
        "F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 W1.1 B1.0 B2.1 B2.0 W1.0 W2.1 W2.0"]
    assert t.slots == 19 and t.update_slot(0) == 19


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["zb", "interleaved", "zbv"]), st.integers(1, 5), st.integers(1, 3), st.integers(1, 3),
       st.lists(st.tuples(st.floats(0.1, 3), st.floats(0.1, 3)), min_size=5, max_size=5), st.floats(0, 1),
       st.integers(1, 2))
def test_step_time_bound_with_the_schedules_share_is_below_the_simulation(name, p, v, rounds, costs, comm, n):
    # the planner's search prunes with step_time_bound: for these tables only with chain_share, which
    # for the split backward takes F, B and W a third each of the stage's work, as the planner's replay
    v = {"zb": 1, "zbv": 2}.get(name, v)
    m = rounds * p
    f, b = [c[0] for c in costs[:p]], [c[1] for c in costs[:p]]
    split = name != "interleaved"
    kw = {"backward": f, "weight": f} if split else {"backward": b}
    sim = simulate(build_schedule(name, p, m, batches=n, virtual_stages=v), forward=f, comm=comm, **kw)
    work = [m * (f[s] + (2 * f[s] if split else b[s])) for s in range(p)]
    assert step_time_bound(work, m, n, share=chain_share(name, v)) <= sim.step_time * (1 + 1e-9)


def test_without_the_share_the_bound_overshoots_the_new_schedules():
    # unit F = B = W on 2 stages, 2 micro-batches: ZB-H1 takes 7 slots; the 1F1B bound says 6 + 6/2 = 9
    sim = simulate(build_schedule("zb", 2, 2), forward=1.0, backward=1.0, weight=1.0)
    assert sim.step_time == 7.0
    assert step_time_bound([6.0, 6.0], 2) == 9.0 > sim.step_time
    assert step_time_bound([6.0, 6.0], 2, share=chain_share("zb")) == 7.0  # tight here


def test_new_tables_refuse_what_they_cannot_do(tmp_path):
    with pytest.raises(PipelineError, match="weight=..."):
        simulate(build_schedule("zb", 2, 2), forward=1.0)
    with pytest.raises(PipelineError, match="multiple of stages=2"):
        build_schedule("interleaved", 2, 3, virtual_stages=2)
    with pytest.raises(PipelineError, match="needs schedule='interleaved'"):
        build_schedule("1f1b", 2, 2, virtual_stages=2)
    with pytest.raises(PipelineError, match="not one of"):
        build_schedule("zbh2", 2, 2)
    with pytest.raises(PipelineError, match="'zbv' places exactly 2 model chunks .* virtual_stages=2, got 1"):
        build_schedule("zbv", 2, 2)
    with pytest.raises(PipelineError, match="placement 'v' with 3 chunk"):
        Schedule("x", 1, 1, (), virtual_stages=3, placement="v").validate()
    # a weight gradient before its input gradient; a chunk's forward before the previous chunk's
    with pytest.raises(PipelineError, match="W0 on stage 0 in slot 1 runs before B0"):
        Schedule("x", 1, 1, (Action(0, 0, 0, "F"), Action(1, 0, 0, "W"), Action(2, 0, 0, "B"))).validate()
    two = [Action(0, 0, 0, "F", chunk=1), Action(1, 0, 0, "F"), Action(2, 0, 0, "B", chunk=1),
           Action(3, 0, 0, "B")]
    want = "F0 on stage 0 chunk 1 in slot 0 runs before F0 on stage 0 chunk 0"
    with pytest.raises(PipelineError, match=want):
        Schedule("x", 1, 1, tuple(two), virtual_stages=2).validate()

    def run(name):
        ex = Executor(torch.nn.Linear(2, 2), "stage", torch.nn.functional.mse_loss)
        kw = {"virtual_stages": 2} if name == "interleaved" else {}
        ex.run(build_schedule(name, 2, 2, **kw), [torch.randn(1, 2)] * 2, [torch.randn(1, 2)] * 2)

    with pytest.raises(PipelineError, match="2 model chunk.* per stage but stage [01] holds 1"):
        mt.launch(lambda: run("interleaved"), mesh="stage:2")
    with pytest.raises(PipelineError, match="not one of"):
        mt.launch(lambda: Pipeline(torch.nn.Linear(2, 2), microbatches=2, schedule="zbh2"), mesh="stage:1")


def _zb(stages, data, m, recompute):
    pipe = Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=m, schedule="zb", recompute=recompute,
                    loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    losses = [pipe.step(x, y) for x, y in data]
    kinds = [k for k, *_ in pipe.executor.trace]
    return pipe.module.state_dict(), losses, kinds


@pytest.mark.parametrize("p,m,recompute", [(2, 4, False), (3, 4, False), (3, 2, True)])
def test_zb_trains_like_the_unsplit_model(p, m, recompute):
    # the split backward (B: torch.autograd.grad on the stage inputs, W: on the parameters) gives the
    # unsplit model's Adam steps on whole batches
    stages, data = make_stages(p), batches(2, 8)
    want, want_losses = reference(stages, data)
    out = mt.launch(_zb, stages, data, m, recompute, mesh=f"stage:{p}")
    table = build_schedule("zb", p, m)
    for s, (state, _, kinds) in enumerate(out):
        assert kinds == [k for k, _ in table.order(s)]  # the executed order is the table's
        for k, v in want[s].items():
            torch.testing.assert_close(state[k], v)
    assert [float(x) for x in out[-1][1]] == pytest.approx(want_losses)


@pytest.mark.parametrize("name,v", [("interleaved", 2), ("zb", 1), ("1f1b", 1), ("zbv", 2)])
def test_one_table_drives_the_simulator_and_the_timeline(tmp_path, monkeypatch, name, v):
    # (the executor runs the table's order: test_zb_trains_like_the_unsplit_model and
    # test_pipeline_virtual_stages.py check the executed order against for_stage)
    from matplotlib.axes import Axes

    from meshtorch.pipeline.plot import COLORS

    for p, m, n in ((2, 4, 1), (3, 3, 2), (4, 8, 2)):
        # the simulator replays the table: with unit costs (a chunk's pass 1/v of its stage's) and no hop
        # time each action starts in its slot, each batch after the update of the one before
        t = build_schedule(name, p, m, batches=n, virtual_stages=v)
        unit = simulate(t, forward=float(v), backward=float(v), weight=float(v) if t.split_backward else None)
        assert all(unit.start[a] == a.slot and unit.end[a] == a.slot + 1 for a in t.actions)
    t = build_schedule(name, 2, 4, virtual_stages=v)
    sim = simulate(t, forward=1.0, backward=2.0, weight=0.5 if t.split_backward else None, comm=0.1)
    boxes, draw = [], Axes.broken_barh

    def record(ax, xranges, yrange, **kw):
        boxes.append((xranges[0], yrange[0] + 0.4, kw["facecolors"]))
        return draw(ax, xranges, yrange, **kw)

    monkeypatch.setattr(Axes, "broken_barh", record)
    timeline(t, str(tmp_path / "t.png"), simulation=sim)
    # one box per action of the table, where the simulation puts it, coloured by its kind
    assert len(boxes) == len(t.actions)
    for (x, stage, color), a in zip(boxes, t.actions):
        assert (x[0], x[1], stage) == pytest.approx((sim.start[a], sim.end[a] - sim.start[a], a.stage))
        shade = 1.0 - 0.45 * a.chunk / max(1, v - 1)
        assert color == pytest.approx(tuple(c * shade for c in COLORS[a.kind]))


def test_timeline_draws_chunks_and_weight_gradients(tmp_path):
    for name, kw, sim_kw in (("interleaved", {"virtual_stages": 2}, {}), ("zb", {}, {"weight": 1.0})):
        t = build_schedule(name, 2, 4, **kw)
        path = timeline(t, str(tmp_path / f"{name}.png"), simulation=simulate(t, 1.0, 1.0, **sim_kw))
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 1000
