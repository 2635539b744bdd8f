"""The planned peak memory against a real step's, measured by the CPU allocator.

The reference is independent of the planner's tracer: ``torch.profiler``'s
record of every allocation and free of torch's CPU allocator
(``benchmarks/allocator_peak.py``), in real steps on the torch backend (gloo,
2 processes), where gloo allocates buffers inside its calls. On the threads
backend the tracer following real storages is the reference (its staging
copies are made unseen, see ``comm/threads.py``); dropout's draws are real
memory on both.
"""

from __future__ import annotations

import pytest

import meshtorch as mt
from memory_harness import (
    CASES,
    collective_peaks,
    collective_step,
    late_step_peak,
    measure_all,
    pipelined_step_peak,
    step_flops_and_peak,
    training_step_peak,
)
from meshtorch.mesh import Mesh
from meshtorch.plan import trace
from meshtorch.plan.pipeline import stage_traces
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import pipelined_training_step, training_step

VOCAB = 64
CFG = TrainConfig.of(batch=4, length=16, d_model=64, heads=4, d_kv=16, d_ff=256, layers=1, optimizer="adamw")
# every gloo measurement runs for 2 processes: all of one mesh's in one launch (see `real`)
# one xdist worker runs the whole module: its module fixture launches gloo processes once
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("test_plan_memory")]


def _gloo_jobs() -> dict[str, tuple]:
    """Every real step the tests below measure: name -> (mesh, function, args, rules)."""
    jobs: dict[str, tuple] = {"collectives": ("b:2", collective_peaks, (), "")}
    for layout, (mesh, rules, rate) in LAYOUTS.items():
        jobs[layout] = (mesh, training_step_peak, (CFG.replace(dropout=rate), VOCAB), rules)
    for case, (model, precision, mesh, rules) in OTHERS.items():
        jobs[case] = (mesh, training_step_peak, (_other(model, precision), VOCAB), rules)
    for case, (mesh, rules, cfg) in OVERLAPPED.items():
        jobs[case] = (mesh, training_step_peak, (cfg, VOCAB), rules)
    for case in LATE:
        mesh, rules, cfg = OVERLAPPED[case]
        jobs[f"{case}, late"] = (mesh, late_step_peak, (cfg, VOCAB, LATE_RANK, LATE_S), rules)
    for case, cfg in DEFAULT_VS_PER_USE.items():
        jobs[case] = ("b:2", training_step_peak, (cfg, LM_VOCAB), "batch:b; d_model:b")
    jobs["pipeline"] = ("stage:2", pipelined_step_peak, (PIPELINED, VOCAB), "")
    for model in ("lm", "seq2seq"):
        jobs[f"recompute-{model}"] = (REMAT_MESH, step_flops_and_peak,
                                      (_remat(model).replace(recompute=True), VOCAB), REMAT_RULES)
    return jobs


@pytest.fixture(scope="module")
def real() -> dict[str, list]:
    """name -> every processor's result of that job: one gloo launch per mesh runs all its jobs
    (a launch starts two fresh interpreters; each measurement profiles only its own step)."""
    jobs, out = _gloo_jobs(), {}
    for mesh in sorted({job[0] for job in jobs.values()}):
        names = [name for name, job in jobs.items() if job[0] == mesh]
        ranks = mt.launch(measure_all, [jobs[name][1:] for name in names], mesh=mesh, backend="torch",
                          timeout=120)
        out.update({name: [r[i] for r in ranks] for i, name in enumerate(names)})
    return out


def test_gloo_collective_buffers_are_planned(real):
    real = real["collectives"]
    for kind, dim in CASES:
        plan = trace(collective_step, kind, dim, mesh="b:2", staging="gloo")
        bare = trace(collective_step, kind, dim, mesh="b:2")
        # processor 0's, as planned, to the allocator's few bytes of bookkeeping; gloo's
        # algorithms give another processor a receive buffer of one piece more at most
        assert plan.peak_bytes == pytest.approx(real[0][kind, dim], abs=256), (kind, dim, real)
        assert plan.peak_bytes == pytest.approx(real[1][kind, dim], rel=0.15), (kind, dim, real)
        if kind != "all_reduce":  # all_reduce works in place; the others stage
            assert bare.peak_bytes < plan.peak_bytes


LAYOUTS = {
    "data": ("b:2", "batch:b", 0.0),
    "model+dropout": ("m:2", "heads:m; d_ff:m; vocab:m", 0.1),
    "fsdp": ("b:2", "batch:b; d_model:b", 0.0),
    "fsdp+dropout": ("b:2", "batch:b; d_model:b", 0.1),
    # ring attention: keys and values passed around m by batch_isend_irecv (which the allocator's
    # harness could not measure: P2POp refused its wrapped isend)
    "sequence": ("m:2", "length:m", 0.0),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_planned_peak_is_within_5_percent_of_a_gloo_step(layout, real):
    mesh, rules, rate = LAYOUTS[layout]
    cfg = CFG.replace(dropout=rate)
    plan = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, staging="gloo")
    real = real[layout]
    for r in real:
        assert plan.peak_bytes == pytest.approx(r, rel=0.05), (layout, plan.peak_bytes, real)


# mt.overlap (grouped gradient buckets, grouped and prefetched gathers), and reshard_after_forward
# on an LM whose two blocks' gathered weights (d_model 256 at batch 4 x 64) fill two gather buckets,
# the first freed after forward and gathered again for backward (CFG overlaps and reshards: meshtorch
# train's default)
OVERLAPPED = {
    "data+overlap": ("b:2", "batch:b", CFG.replace(overlap=True)),
    "fsdp+overlap": ("b:2", "batch:b; d_model:b", CFG.replace(overlap=True, reshard_after_forward=False)),
    "fsdp+reshard": ("b:2", "batch:b; d_model:b", CFG.replace(d_model=256, d_kv=64, d_ff=1024, layers=2,
                                                              length=64, reshard_after_forward=True)),
    # recomputed blocks: gathered per block, again for the recomputation; each block's gradients'
    # reduce_scatter in flight (its packed buffer and gloo's copy of it) while the next computes
    "fsdp+reshard+recompute": ("b:2", "batch:b; d_model:b", CFG.replace(
        d_model=256, d_kv=64, d_ff=1024, layers=2, length=64, reshard_after_forward=True, recompute=True)),
}


@pytest.mark.parametrize("case", OVERLAPPED)
def test_overlapped_and_resharded_peaks_are_within_5_percent_of_a_gloo_step(case, real):
    mesh, rules, cfg = OVERLAPPED[case]
    plan = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, staging="gloo")
    real = real[case]
    for r in real:
        assert plan.peak_bytes == pytest.approx(r, rel=0.05), (case, plan.peak_bytes, real)


# a late processor: gloo holds a prefetched all_gather's staging buffer (its whole result) until
# every member has joined, so the others' gathers stay in flight while it is late. A gather issued
# ahead for backward is waited on after one op (mt.overlap: Runtime.land); left in flight across
# a block's backward, fsdp+reshard peaked 8.9% over the plan on the processor on time
LATE = ("fsdp+reshard", "fsdp+reshard+recompute")
LATE_RANK, LATE_S = 1, 0.05  # processor 1 issues each prefetch 50 ms late (a few ops' time)


@pytest.mark.parametrize("case", LATE)
def test_a_late_processor_leaves_the_overlapped_peaks_within_5_percent_of_the_plan(case, real):
    mesh, rules, cfg = OVERLAPPED[case]
    plan = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, staging="gloo")
    late = real[f"{case}, late"]
    for r in late:
        assert plan.peak_bytes == pytest.approx(r, rel=0.05), (case, plan.peak_bytes, late)


# issue 27's LM (vocab 2048, d_model 256, 4 heads, d_ff 1024, 4 layers, tied) at batch 4 x 64, FSDP by
# rules: meshtorch train's default step (mt.overlap, resharded after forward) and the per-use path
LM_VOCAB = 2048
LM = TrainConfig.of(batch=4, length=64, d_model=256, heads=4, d_kv=64, d_ff=1024, layers=4, optimizer="adamw")
DEFAULT_VS_PER_USE = {"lm-default": LM, "lm-per-use": LM.replace(overlap=False)}


def test_the_default_step_peaks_no_higher_than_the_per_use_path(real):
    """Overlapping costs no memory here: the default step's peak, planned and measured by the gloo
    allocator, is at most the per-use path's (which keeps every gathered weight a matmul saves)."""
    planned = {case: trace(training_step(cfg, LM_VOCAB), mesh="b:2", rules="batch:b; d_model:b",
                           staging="gloo").peak_bytes for case, cfg in DEFAULT_VS_PER_USE.items()}
    assert planned["lm-default"] <= planned["lm-per-use"], planned
    for default, per_use in zip(real["lm-default"], real["lm-per-use"]):
        assert default <= per_use, (real["lm-default"], real["lm-per-use"])
    # and planned as measured (the default step's gradient buckets in flight hold gloo's copy of
    # their input until waited on: planned 6% under before that was counted)
    for case, plan in planned.items():
        for r in real[case]:
            assert plan == pytest.approx(r, rel=0.05), (case, plan, real[case])


# the other models and bf16: seq2seq's cross-attention, MoE's dispatch (all_to_all over the
# experts' axis), bf16 activations and partial sums
OTHERS = {
    "seq2seq-model-bf16": ("seq2seq", "bf16", "m:2", "heads:m; d_ff:m; vocab:m"),
    "moe-experts-fp32": ("moe", "fp32", "m:2", "heads:m; d_ff:m; vocab:m; experts:m"),
    "moe-fsdp-bf16": ("moe", "bf16", "b:2", "batch:b; d_model:b"),
}


def _other(model: str, precision: str) -> TrainConfig:
    return CFG.replace(model=model, precision=precision, layers=2, encoder_layers=1, experts=4, top_k=2)


@pytest.mark.parametrize("case", OTHERS)
def test_seq2seq_moe_and_bf16_peaks_are_within_5_percent_of_a_gloo_step(case, real):
    model, precision, mesh, rules = OTHERS[case]
    cfg = _other(model, precision)
    plan = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, staging="gloo")
    real = real[case]
    assert plan.peak_bytes == pytest.approx(real[0], rel=0.05), (case, plan.peak_bytes, real)


PIPELINED = CFG.replace(layers=2, schedule="1f1b", microbatches=2)


def test_pipeline_stage_peaks_are_within_5_percent_of_a_gloo_step(real):
    cfg = PIPELINED
    mesh = "stage:2"
    plans = stage_traces(pipelined_training_step(cfg, VOCAB), mesh, "", staging="gloo")
    bare = stage_traces(pipelined_training_step(cfg, VOCAB), mesh, "")
    real = real["pipeline"]
    for stage, plan in enumerate(plans):
        rank = Mesh(mesh).rank({"stage": stage})
        assert plan.peak_bytes == pytest.approx(real[rank], rel=0.05), (stage, plan.peak_bytes, real)
    # what gloo receives into is memory the threads backend's unseen copies are not
    assert plans[0].peak_bytes > bare[0].peak_bytes


@pytest.mark.parametrize("layout", ["model+dropout", "fsdp+dropout"])
def test_dropout_masks_and_their_draws_are_planned_on_threads(layout):
    mesh, rules, rate = LAYOUTS[layout]
    # the peak is in backward, where the masks live: also under mt.overlap, whose gradients hold
    # only their slices' bytes (a reduce-scattered bucket's flat result is the gradients)
    base = CFG.replace(overlap=True)
    cfg = base.replace(dropout=rate)
    plan = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules)
    real = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, backend="threads")
    without = trace(training_step(base, VOCAB), mesh=mesh, rules=rules)
    assert plan.peak_bytes == real.peak_bytes
    # at least the masks of the embedding, attention and feed-forward outputs (float32, batch·length·d_model)
    assert plan.peak_bytes - without.peak_bytes >= 3 * 4 * 16 * 64 * 4 // 2


REMAT_MESH, REMAT_RULES = "b:2", "batch:b; d_model:b"


def _remat(model: str) -> TrainConfig:
    # per-use collectives: under mt.overlap this small model's peak is its forward's grouped
    # gather (all blocks' weights in one, at the default gather_mb: the flat input, the result and
    # its unpacked copies), which recomputation does not change
    return CFG.replace(model=model, layers=2, encoder_layers=1, dropout=0.1, overlap=False)


@pytest.mark.parametrize("model", ["lm", "seq2seq"])
def test_recompute_is_priced_as_a_real_recompute_step(model, real):
    mesh, rules = REMAT_MESH, REMAT_RULES
    cfg = _remat(model)
    plain = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, staging="gloo")
    remat = trace(training_step(cfg.replace(recompute=True), VOCAB), mesh=mesh, rules=rules, staging="gloo")
    (flops, peak), _ = real[f"recompute-{model}"]
    assert remat.flops == flops
    assert remat.peak_bytes == pytest.approx(peak, rel=0.05), (remat.peak_bytes, peak)
    # what recomputation trades: each block's forward once more, for its activations
    assert plain.flops < remat.flops < 1.5 * plain.flops
    assert remat.peak_by_kind["activations"] < 0.8 * plain.peak_by_kind["activations"]
    assert remat.result["parameters"] == plain.result["parameters"]
