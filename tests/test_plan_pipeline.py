"""Planned pipelined steps against real ones, and the search over the pipelined family.

The reference is a real run on the threads backend of the same step
(``meshtorch train --pipeline-stages``'s own ``PipelinedStep``): each stage's
processor's collectives as its communicator counts them (``mt.comm_stats()``
around the step, inside the program; the tracer only watches), and the peak
of its real storages. The plan traces each stage alone on the meta backend.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.errors import PlanError
from meshtorch.mesh import Mesh
from meshtorch.pipeline import build_schedule, simulate
from meshtorch.plan import trace
from meshtorch.plan.estimate import from_trace
from meshtorch.plan.pipeline import PipelineEstimate, estimate_pipeline, microbatch_work, stage_traces
from meshtorch.plan.search import search
from meshtorch.plan.space import pipeline_layouts, rules_for
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import pipelined_training_step, training_step

VOCAB = 16
TINY = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=3, batch=8, length=8, optimizer="adamw")
MESH, RULES = "stage:2,b:2", "batch:b"


def _measured(step, stage: int):
    """Processor (stage, b=0)'s trace of a real threads-backend run: its peak, and the step's
    collectives as its communicator counted them."""
    rank = Mesh(MESH).rank({"stage": stage, "b": 0})
    return trace(step, mesh=MESH, rules=RULES, backend="threads", rank=rank)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
def test_stage_bytes_calls_and_peak_equal_a_real_pipelined_step(schedule):
    cfg = TINY.replace(schedule=schedule, microbatches=4)
    step = pipelined_training_step(cfg, VOCAB)
    est = estimate_pipeline(step, MESH, RULES, device="a100")
    assert est.stages == 2 and est.schedule == schedule
    for s, planned in enumerate(e.trace for e in est.stage_estimates):
        real = _measured(step, s)
        assert planned.comm.as_dict() == real.result["comm"]  # every kind and axis, sends included
        assert planned.peak_bytes == real.peak_bytes
        assert planned.peak_by_kind == real.peak_by_kind
    # between the stages: per micro-batch, one header and one [batch/4/2, length, d_model] float32 slice
    slice_bytes = 8 // 4 // 2 * 8 * 8 * 4
    assert est.transfer_bytes["activations"] == slice_bytes
    first, last = (e.trace.comm for e in est.stage_estimates)
    header = est.transfer_bytes["header"]
    assert first.calls("stage", "send") == 2 * 4
    assert first.bytes("stage", "send") == 4 * (header + slice_bytes)
    assert last.calls("stage", "recv") == 2 * 4 and last.bytes("stage", "send") > 4 * slice_bytes
    # the stage holding more micro-batches in flight: all 4 under GPipe, p - s under 1F1B and 2BW
    assert est.in_flight == ([4, 4] if schedule == "gpipe" else [2, 1])
    # every processor holds the whole model for the checkpoint (the rules split no parameter),
    # and under 2BW its previous version too
    versions = 2 if schedule == "2bw" else 1
    for e in est.stage_estimates:
        assert e.memory_bytes["parameters"] == versions * est.parameters * 4


def test_step_time_is_the_simulated_schedule_of_the_stage_work():
    est = estimate_pipeline(pipelined_training_step(TINY.replace(microbatches=4), VOCAB), MESH, RULES,
                            device="a100")
    work, update = est.stage_seconds, est.update_seconds
    # the update (optimizer, clipping) runs after the stage's last micro-batch: the optimizer's
    # work counted apart by the tracer (the runtime marks it as the "update" phase)
    spec = mt.plan.device("a100")
    for e, u in zip(est.stage_estimates, update):
        up = e.trace.phases["update"]
        assert 0 < up.aten_ops < e.trace.aten_ops
        assert u == pytest.approx(up.aten_ops * spec.op_seconds + sum(
            n / spec.flops_per_second(dt) for dt, n in up.flops_by_dtype.items()))
    per_mb = [(w - u) / 4 for w, u in zip(work, update)]
    hop = est.transfer_seconds  # a send also occupies its sender: stage 0's forwards, stage 1's backwards
    sim = simulate(build_schedule("1f1b", 2, 4), forward=[per_mb[0] / 3 + hop, per_mb[1] / 3],
                   backward=[per_mb[0] * 2 / 3, per_mb[1] * 2 / 3 + hop], comm=hop)
    sync = max(sum(v for k, v in e.comm_seconds.items() if k.split("@")[1] == "stage"
                   and not k.startswith(("send", "recv"))) for e in est.stage_estimates)
    assert est.step_seconds == pytest.approx(sim.step_time + max(update) + sync)
    assert est.bubble == pytest.approx(sim.bubble_fraction) and 0 < est.bubble < 1
    assert est.step_seconds >= max(work)


def test_stage_traces_need_the_pipeline_axis():
    with pytest.raises(PlanError, match="'stage' is not an axis"):
        stage_traces(pipelined_training_step(TINY, VOCAB), "b:2", RULES)


# heads 1, d_ff and vocab odd: only batch is splittable, so the whole space is small enough to trace
SMALL = TrainConfig.of(d_model=8, heads=1, d_kv=4, d_ff=15, layers=2, batch=8, length=8, optimizer="adamw")


def _exhaustive(cfg, n, spec):
    step = training_step(cfg, 15)
    dims = {"batch": 8}
    out = [from_trace(trace(step, mesh=m, rules=r), m, spec) for m in ("b:2",) for r in rules_for(m, dims)]
    out += [estimate_pipeline(step.pipelined(mb), m, r, spec) for m, r, mb in pipeline_layouts(n, dims, 2)]
    return out


def test_search_equals_exhaustive_over_the_pipelined_family():
    # a slow processor (compute dominates) whose memory only the pipelined layouts fit
    spec = mt.plan.device("a100")
    # (no CUDA context or allocator margin: memory this small is the test's, not a GPU's)
    spec = dataclasses.replace(spec, peak_flops={"float32": 2e8}, memory_bytes=40 * 1024, memory_margin=0.0,
                               context_bytes=0)
    every = _exhaustive(SMALL, 2, spec)
    assert len(every) == 2 + 3
    fitting = [e for e in every if e.fits]
    assert fitting and all(isinstance(e, PipelineEstimate) for e in fitting)
    truth = min(fitting, key=lambda e: e.step_seconds)
    res = search(training_step(SMALL, 15), 2, device=spec)
    assert res.space == 5
    best = res.best
    assert isinstance(best, PipelineEstimate)
    assert (best.mesh, best.rules, best.microbatches) == (truth.mesh, truth.rules, truth.microbatches)
    assert best.step_seconds == pytest.approx(truth.step_seconds)
    assert "fits memory where the best layout without stages does not" in res.why()
    assert f"--pipeline-stages 2 --schedule 1f1b --microbatches {truth.microbatches}" in res.table()
    # every candidate is ranked: traced or pruned with its bound
    assert len(res.ranking()) == 5
    without = search(training_step(SMALL, 15), 2, device=spec, pipeline=False)
    assert without.space == 2 and not without.best.fits


# d_ff of 16 splits over 2, heads 1 and 15 ids do not: on 4 processors, 10 pipelined candidates
# (stage:2 with b:2; batch and d_ff on b or not; 2, 4 or 8 micro-batches) besides the SPMD ones
SPLIT = SMALL.replace(d_ff=16)


def test_pipeline_bounds_hold_and_the_pruned_search_equals_exhaustive():
    from meshtorch.plan.bounds import REFERENCE_MESH, dims_of, pipeline_bounds
    from meshtorch.plan.space import meshes_for

    spec = dataclasses.replace(mt.plan.device("a100"), peak_flops={"float32": 2e8},  # compute dominates
                               memory_margin=0.0, context_bytes=0)  # memory: the peak alone, as below
    step = training_step(SPLIT, 15)
    dims = dims_of(trace(step, mesh=REFERENCE_MESH))
    family = pipeline_layouts(4, dims, 2)
    assert len(family) == 10
    bounds = pipeline_bounds(step.pipelined, family, spec)
    piped = {c: estimate_pipeline(step.pipelined(c[2]), c[0], c[1], spec) for c in family}
    for c, e in piped.items():
        t, m = bounds[c]
        assert 0 < t <= e.step_seconds * (1 + 1e-9) and 0 < m <= e.memory_bytes["total"], c
        assert t >= 0.55 * e.step_seconds, c  # the bubble and the uneven stages make it this tight
    # stage by stage: give_up sees each stage's work as the estimate has it, and can stop it
    c, seen = family[0], []
    e = estimate_pipeline(step.pipelined(c[2]), c[0], c[1], spec,
                          give_up=lambda s, w: seen.append(w) or False)
    assert e.stage_seconds == pytest.approx(seen) == piped[c].stage_seconds
    assert estimate_pipeline(step.pipelined(c[2]), c[0], c[1], spec, give_up=lambda s, w: True) is None
    spmd = [mt.plan.estimate(step, m, r, device=spec) for m in meshes_for(4) for r in rules_for(m, dims)]
    every = [*spmd, *piped.values()]
    # memory for the pipelined layouts and a few others only: the best of each family is in play
    need = sorted(e.memory_bytes["total"] for e in every)
    small = dataclasses.replace(spec, name="small", memory_bytes=need[len(need) // 3])
    fitting = [e for e in every if e.memory_bytes["total"] <= small.memory_bytes]
    truth = min(fitting, key=lambda e: e.step_seconds)
    res = search(step, 4, device=small)
    assert res.space == len(every)
    assert res.best.step_seconds == pytest.approx(truth.step_seconds, rel=1e-12)
    assert (res.best.mesh, res.best.rules) == (truth.mesh, truth.rules)
    assert len(res.ranking()) == len(every)
    for p in res.pruned_candidates:
        if p.pipeline and p.by == "time":  # a pruned pipelined candidate's bound is below its step
            (e,) = [e for c, e in piped.items() if (c[0], c[1]) == (p.mesh, p.rules)
                    and p.pipeline.endswith(f"x{c[2]}")]
            assert p.seconds <= e.step_seconds * (1 + 1e-9)


def test_pipeline_layouts_cover_stages_layouts_and_microbatches():
    got = pipeline_layouts(8, {"batch": 8, "d_ff": 16}, layers=4)
    stages = {Mesh(m).axis_size("stage") for m, _, _ in got}
    assert stages == {2, 4}
    assert ("stage:2,b:2,m:2", "batch:b; d_ff:m", 2) in got
    assert ("stage:4,b:2", "batch:b", 4) in got
    assert all(8 // mb % (Mesh(m).axis_size("b") if "batch:b" in r else 1) == 0 for m, r, mb in got)


# a slow link and a host cost per op: collectives (bytes and latency) and op counts weigh in the work
_PROBE_SPECS = {
    "cpu-like": dataclasses.replace(mt.plan.device("a100"), peak_flops={"float32": 2e9}, op_seconds=3e-6)
    .with_links(b=mt.plan.devices.Link(bandwidth=1e8, latency=2e-5),
                m=mt.plan.devices.Link(bandwidth=1e8, latency=2e-5)),
    "h100": mt.plan.device("h100"),  # kernel rooflines: max(device, host) + syncs
}


@settings(max_examples=5, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "2bw", "zb"]), microbatches=st.sampled_from([2, 4]),
       layout=st.sampled_from([("stage:2,b:2", "batch:b"), ("stage:2,m:2", "heads:m; d_ff:m; vocab:m"),
                               ("stage:2,b:2", "batch:b; d_model:b"), ("stage:2,m:2", "length:m")]),
       spec=st.sampled_from(sorted(_PROBE_SPECS)), clip=st.sampled_from([0.0, 1.0]))
def test_one_microbatch_times_microbatches_bounds_every_stage_work(schedule, microbatches, layout, spec,
                                                                   clip):
    # the search prunes a pipelined candidate with microbatch_work before tracing it: never above
    # a stage's traced work, whatever the schedule, layout (FSDP gathers per micro-batch, ring
    # attention's shifts), clipping and device pricing
    mesh, rules = layout
    step = pipelined_training_step(TINY.replace(schedule=schedule, microbatches=microbatches, clip=clip,
                                                heads=2, d_ff=16, optimizer="adafactor"), VOCAB)
    probe = step.one_microbatch()
    assert probe.cfg.run.batch == 8 // microbatches and probe.pipeline.microbatches == 1
    device = _PROBE_SPECS[spec]
    bound = list(microbatch_work(probe, microbatches, mesh, rules, device))
    work = estimate_pipeline(step, mesh, rules, device).stage_seconds
    assert len(bound) == len(work) == 2
    for b, w in zip(bound, work):
        # the update and the gradients' accumulation are the gap: the forwards and backwards are most
        assert 0.3 * w < b <= w * (1 + 1e-9), (b, w)


def test_one_microbatch_is_the_steps_forwards_and_backwards_per_microbatch():
    # exact where nothing runs once per step: one micro-batch's FLOPs, sends and collectives along
    # m, times the micro-batches, are the step's, less its update and the batch loss (one float64
    # averaged over m's replicas); the bound leaves out only what runs once
    step = pipelined_training_step(TINY.replace(microbatches=4, clip=0.0), VOCAB)
    probe = stage_traces(step.one_microbatch(), "stage:2,m:2", "heads:m; d_ff:m; vocab:m")
    whole = stage_traces(step, "stage:2,m:2", "heads:m; d_ff:m; vocab:m")
    for one, t in zip(probe, whole):
        update = t.phases["update"]
        assert 4 * one.flops == t.flops > 0 and not sum(update.flops_by_dtype.values())  # AdamW: no matmul
        assert 4 * one.comm.bytes("stage", "send") == t.comm.bytes("stage", "send") > 0
        assert 4 * one.comm.bytes("m", "all_reduce") + 8 == t.comm.bytes("m", "all_reduce")
        assert 4 * one.comm.calls("m", "all_reduce") + 1 == t.comm.calls("m", "all_reduce")
        assert not update.comm.calls("m", "all_reduce") and not one.comm.calls("stage", "all_reduce")
    assert training_step(TINY, VOCAB).one_microbatch() is None  # an SPMD step has none


def test_search_answers_the_same_with_and_without_the_one_microbatch_bound(monkeypatch):
    import importlib

    search_module = importlib.import_module("meshtorch.plan.search")
    # compute dominates and memory is tight, so SPMD and pipelined layouts are both in play
    spec = dataclasses.replace(mt.plan.device("a100"), name="small", peak_flops={"float32": 2e8},
                               memory_margin=0.0, context_bytes=0, memory_bytes=60 * 1024)
    # without overlap, as the space was chosen: overlapped, data parallel on b:4 wins outright and
    # no pipelined candidate comes under it to be probed
    step = training_step(SPLIT.replace(overlap=False), 15)
    probed, traced = [], []
    real_probe, real_estimate = search_module.microbatch_work, search_module.estimate_pipeline

    def counting_probe(*a, **k):
        probed.append(a[2:4])
        return real_probe(*a, **k)

    def counting_estimate(*a, **k):
        traced.append(a[1:3])
        return real_estimate(*a, **k)

    monkeypatch.setattr(search_module, "microbatch_work", counting_probe)
    monkeypatch.setattr(search_module, "estimate_pipeline", counting_estimate)
    with_probe = search(step, 4, device=spec)
    ended_at_probe = [c for c in probed if c not in traced]
    assert ended_at_probe  # candidates the search did not trace whole: their probe lost
    monkeypatch.setattr(search_module, "microbatch_work", lambda *a, **k: ())
    traced.clear()
    without = search(step, 4, device=spec)
    assert set(ended_at_probe) <= set(traced)  # without the probe, each is traced (and loses)
    assert with_probe.best.step_seconds == without.best.step_seconds
    assert (with_probe.best.mesh, with_probe.best.rules) == (without.best.mesh, without.best.rules)
    assert with_probe.space == without.space and len(with_probe.ranking()) == len(without.ranking())
