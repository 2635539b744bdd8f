"""The planner prices ZB-H1, interleaved 1F1B (virtual stages) and ZB-V from each stage's traced run
of that schedule: its bytes, calls and peak against a real run on the threads backend, its step against
the simulated table, and on H100s ZB-H1 and interleaving beat 1F1B on a 4-stage, 8-micro-batch
model; meshtorch plan takes their flags, and the search's bound holds for them."""

from __future__ import annotations

import json

import pytest

import meshtorch as mt
from meshtorch.pipeline import build_schedule, simulate
from meshtorch.plan.pipeline import estimate_pipeline
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import pipelined_training_step
from test_plan_pipeline import MESH, RULES, TINY, VOCAB, _measured

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("schedule,v", [("zb", 1), ("interleaved", 2)])
def test_stage_bytes_calls_and_peak_equal_a_real_run_of_the_schedule(schedule, v):
    m = 4
    step = pipelined_training_step(TINY.replace(layers=4, schedule=schedule, virtual_stages=v,
                                                microbatches=m), VOCAB)
    est = estimate_pipeline(step, MESH, RULES, device="a100")
    assert (est.schedule, est.virtual_stages) == (schedule, v)
    for s, planned in enumerate(e.trace for e in est.stage_estimates):
        real = _measured(step, s)
        assert planned.comm.as_dict() == real.result["comm"]  # every kind and axis, sends included
        assert planned.peak_bytes == real.peak_bytes
    # stage 0 sends, per micro-batch, its v chunks' activations and v - 1 chunks' gradients: a header
    # and one [batch/4/2, length, d_model] float32 slice each (1F1B: one activation)
    slice_bytes = 8 // 4 // 2 * 8 * 8 * 4
    header = est.transfer_bytes["header"]
    assert est.transfer_bytes["activations"] == slice_bytes
    first = est.stage_estimates[0].trace.comm
    assert first.calls("stage", "send") == 2 * m * (2 * v - 1)
    # a gradient's header says less: its one leaf is a plain tensor
    gradient_header = len(json.dumps({"tuple": False, "leaves": [""]}))
    assert first.bytes("stage", "send") == m * v * (header + slice_bytes) + \
        m * (v - 1) * (gradient_header + slice_bytes)
    # interleaving multiplies the point-to-point messages: 2m(pv - 1) per batch against 2m(p - 1)
    assert est.messages == 2 * m * (2 * v - 1)
    table = build_schedule(schedule, 2, m, virtual_stages=v)
    assert est.in_flight == [table.max_in_flight(s) for s in range(2)]
    assert est.in_flight == ([2, 2] if schedule == "zb" else [min(v * m, 2 + (v - 1) * 2 + 1), 3])


def test_zb_v_stages_equal_a_real_run_on_three_stages():
    # under the V, stage s takes activations from stage s + 1 too (traced after it) and sends
    # gradients to it: each stage's traced bytes, calls and peak against a real threads run
    from meshtorch.plan import trace

    mesh, m = "stage:3", 3
    step = pipelined_training_step(TINY.replace(layers=6, batch=12, schedule="zbv", virtual_stages=2,
                                                microbatches=m), VOCAB)
    est = estimate_pipeline(step, mesh, "", device="a100")
    for s, e in enumerate(est.stage_estimates):
        real = trace(step, mesh=mesh, rules="", backend="threads", rank=s)
        assert e.trace.comm.as_dict() == real.result["comm"], s
        assert e.trace.peak_bytes == real.peak_bytes, s
    # per micro-batch (a header and a slice each): stage 0 sends chunk 0's activation and chunk 5's
    # gradient; stage 1 both ways for chunks 1 and 4; stage 2 (the turn) hands chunk 2's output to
    # chunk 3 in memory and sends chunk 3's activation and chunk 2's gradient
    sends = [e.trace.comm.calls("stage", "send") for e in est.stage_estimates]
    assert sends == [2 * m * k for k in (2, 4, 2)]
    table = build_schedule("zbv", 3, m, virtual_stages=2)
    assert est.messages == 4 * m * 2 and est.in_flight == [table.max_in_flight(s) for s in range(3)]


def test_zb_step_is_the_simulated_split_backward():
    est = estimate_pipeline(pipelined_training_step(TINY.replace(schedule="zb", microbatches=4), VOCAB),
                            MESH, RULES, device="a100")
    per_mb = [(w - u) / 4 for w, u in zip(est.stage_seconds, est.update_seconds)]
    hop = est.transfer_seconds
    # forward, input gradient B and weight gradient W a third of the work each; a send occupies its
    # sender (stage 0's forwards, stage 1's input gradients)
    sim = simulate(build_schedule("zb", 2, 4), forward=[per_mb[0] / 3 + hop, per_mb[1] / 3],
                   backward=[per_mb[0] / 3, per_mb[1] / 3 + hop], weight=[w / 3 for w in per_mb], comm=hop)
    sync = max(sum(v for k, v in e.comm_seconds.items() if k.split("@")[1] == "stage"
                   and not k.startswith(("send", "recv"))) for e in est.stage_estimates)
    assert est.step_seconds == pytest.approx(sim.step_time + max(est.update_seconds) + sync)
    assert est.bubble == pytest.approx(sim.bubble_fraction)


def test_interleaved_and_zb_plan_shorter_steps_than_1f1b_on_h100s():
    # the case (4 stages, 8 micro-batches, on H100s) at 8 layers, not its 32: one layer per
    # interleaved chunk. What is held is depth-free (messages, stashes in flight, the same FLOPs per
    # stage) or an order that holds at any depth: the bubble shrinks by the schedule, so the step with
    # it (1F1B 342 ms, interleaved 316, ZB-H1 307 here; 906, 804, 770 at 32 layers, docs/planner.md).
    # The 12 stage traces of 32 layers took 16 s of the suite's CPU, these 5
    base = TrainConfig.of(d_model=1024, heads=16, d_kv=64, d_ff=4096, layers=8, batch=32, length=1024,
                          pipeline_stages=4, microbatches=8, mesh="", rules="")
    est = {}
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        cfg = base.replace(schedule=schedule, virtual_stages=v)
        est[schedule] = estimate_pipeline(pipelined_training_step(cfg, 32000), "stage:4", "", device="h100")
    one, inter, zb = est["1f1b"], est["interleaved"], est["zb"]
    assert inter.step_seconds < one.step_seconds and zb.step_seconds < one.step_seconds
    assert inter.bubble < one.bubble and zb.bubble < one.bubble
    # the same work per stage (zb's split backward runs each part of the backward once)
    for e in (inter, zb):
        assert [s.flops for s in e.stage_estimates] == [s.flops for s in one.stage_estimates]
    # what they pay: interleaving 2m(pv - 1) = 112 messages against 48, and more activations in flight
    # on stage 0 (11 half-stage stashes against 4 whole ones); ZB-H1 holds 1F1B's stage-0 count (4) on
    # every stage, so its last stage holds more than 1F1B's
    assert (one.messages, inter.messages) == (48, 112)
    assert (one.in_flight, inter.in_flight[0], zb.in_flight) == ([4, 3, 2, 1], 11, [4, 4, 4, 4])
    assert inter.memory_bytes["total"] > one.memory_bytes["total"]
    assert zb.stage_estimates[3].memory_bytes["total"] > one.stage_estimates[3].memory_bytes["total"]
    assert mt.plan.device("h100").name == one.device


@pytest.mark.parametrize("schedule,v", [("zb", 1), ("interleaved", 2)])
def test_the_searchs_pipeline_bounds_hold_for_the_new_schedules(schedule, v):
    # meshtorch plan --search prunes pipelined layouts whose bound exceeds the best step found: the
    # bound must stay below the planned step, which 1F1B's (every stage before the busiest one passed
    # whole, forward and back) does not for ZB-H1 (x1.24 here) or interleaved 1F1B (x1.15)
    import dataclasses

    from meshtorch.pipeline.simulate import step_time_bound
    from meshtorch.plan import trace
    from meshtorch.plan.bounds import REFERENCE_MESH, dims_of, pipeline_bounds, stage_bounds
    from meshtorch.plan.space import pipeline_layouts
    from meshtorch.recipes.lm.steps import training_step
    from test_plan_pipeline import SMALL

    spec = dataclasses.replace(mt.plan.device("a100"), peak_flops={"float32": 2e8}, memory_margin=0.0,
                               context_bytes=0)  # compute dominates
    step = training_step(SMALL.replace(schedule=schedule, virtual_stages=v, layers=4), 15)
    family = pipeline_layouts(2, dims_of(trace(step, mesh=REFERENCE_MESH)), 4)[:2]  # stage:2, m = 2, 4
    bounds, works = pipeline_bounds(step.pipelined, family, spec), stage_bounds(step.pipelined, family, spec)
    planned = {c: estimate_pipeline(step.pipelined(c[2]), c[0], c[1], spec).step_seconds for c in family}
    for c in family:
        assert 0.9 * planned[c] <= bounds[c][0] <= planned[c] * (1 + 1e-9), c
    c = family[0]
    work, _, lead = works[c]
    assert step_time_bound(work, c[2], spread=lead) > 1.1 * planned[c]  # the share = 1 bound


def test_meshtorch_plan_takes_virtual_stages_and_the_schedules(capsys):
    # `meshtorch plan` with meshtorch train's flags: the plan of the interleaved run has v times the hops
    # and the table's stashes, the plan of ZB-H1 the table's split backward; a flag train refuses, plan too
    from meshtorch.cli import main

    tiny = ["--layers", "4", "--d-model", "16", "--d-kv", "8", "--d-ff", "32", "--heads", "2", "--batch", "8",
            "--length", "8", "--vocab", "16", "--mesh", "b:1", "--rules", "", "--pipeline-stages", "2",
            "--microbatches", "4", "--json"]
    got = {}
    for schedule, v in (("interleaved", 2), ("zb", 1)):
        assert main(["plan", *tiny, "--schedule", schedule, "--virtual-stages", str(v)]) == 0
        got[schedule] = json.loads(capsys.readouterr().out)["pipeline"]
        table = build_schedule(schedule, 2, 4, virtual_stages=v)
        assert (got[schedule]["schedule"], got[schedule]["virtual_stages"]) == (schedule, v)
        assert got[schedule]["in_flight"] == [table.max_in_flight(s) for s in range(2)]
    # 2m(pv - 1) point-to-point messages a batch: 24 interleaved (v = 2) against 1F1B's and ZB-H1's 8
    assert (got["interleaved"]["messages"], got["zb"]["messages"]) == (24, 8)
    assert main(["plan", *tiny, "--schedule", "zb", "--virtual-stages", "2"]) != 0
    assert "--virtual-stages 2 needs --schedule interleaved" in capsys.readouterr().err
    # ZB-V: a boundary inside a stage (the V's turn) is no hop: 4m(p - 1) = 16
    assert main(["plan", *tiny, "--schedule", "zbv", "--virtual-stages", "2"]) == 0
    zbv = json.loads(capsys.readouterr().out)["pipeline"]
    assert (zbv["schedule"], zbv["virtual_stages"], zbv["messages"]) == ("zbv", 2, 16)
    table = build_schedule("zbv", 2, 4, virtual_stages=2)
    assert zbv["in_flight"] == [table.max_in_flight(s) for s in range(2)]
