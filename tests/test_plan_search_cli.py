"""``mt.plan.search`` and ``meshtorch plan``: extrapolation is exact, the search beats hand layouts,
the CLI reports the paper's parameter counts."""

from __future__ import annotations

import dataclasses
import json

import pytest

import meshtorch as mt
from meshtorch.cli import main
from meshtorch.plan import trace
from meshtorch.plan.devices import device
from meshtorch.plan.estimate import from_trace
from meshtorch.plan.layered import extrapolate, layered_trace
from meshtorch.plan.ranking import Pruned
from meshtorch.plan.space import meshes_for, rules_for
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import build_model, training_step

CFG = TrainConfig.of(d_model=32, heads=4, d_kv=8, d_ff=64, layers=3, batch=8, length=16)


@pytest.mark.parametrize("mesh, rules", [("b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"),
                                         ("b:4", "batch:b; d_model:b")])
def test_layer_extrapolation_is_exact_for_bytes_and_flops(mesh, rules):
    step = training_step(CFG, vocab=64)
    t1, t2 = (trace(step.with_layers(n), mesh=mesh, rules=rules) for n in (1, 2))
    full = trace(step, mesh=mesh, rules=rules)
    ext = extrapolate(t1, t2, 2)  # two layers deeper than t1
    assert ext.comm.as_dict() == full.comm.as_dict()
    assert ext.flops == full.flops and ext.result["parameters"] == full.result["parameters"]
    assert ext.aten_ops == full.aten_ops > t2.aten_ops  # the host's share of a CPU step, per op
    for kind in ("parameters", "optimizer"):  # held all step long; the rest depends on the peak moment
        assert ext.peak_by_kind[kind] == full.peak_by_kind[kind]
    assert ext.peak_bytes == pytest.approx(full.peak_bytes, rel=0.1)


def test_search_space_is_pruned_by_divisibility():
    assert meshes_for(12) == ["b:12", "b:2,m:6", "b:3,m:4", "b:4,m:3", "b:6,m:2"]
    rules = rules_for("b:2,m:3", {"batch": 8, "heads": 3, "d_ff": 64, "vocab": 6, "d_model": 32})
    assert all("d_ff:m" not in r for r in rules)  # 64 is not divisible by 3
    assert "batch:b; heads:m; vocab:m; d_model:b" in rules and all(r.startswith("batch:") for r in rules)
    # data parallelism over the whole mesh, alone and with ZeRO-3 over it
    assert "batch:(b,m)" not in rules  # 8 is not a multiple of 6
    both = rules_for("b:2,m:2", {"batch": 8, "d_ff": 64, "d_model": 32})
    assert {"batch:(b,m)", "batch:(b,m); d_model:(b,m)"} <= set(both)


def test_search_finds_a_layout_at_least_as_fast_as_hand_written_ones():
    step = training_step(CFG.replace(layers=1), vocab=64)
    mesh, dp, mp = "b:2,m:2", "batch:b", "batch:b; heads:m; d_ff:m; vocab:m; d_model:b"
    big = device("tpu-v2")
    need_dp = mt.plan.estimate(step, mesh, dp, device=big).memory_bytes["total"]
    need_mp = mt.plan.estimate(step, mesh, mp, device=big).memory_bytes["total"]
    assert need_mp < need_dp
    small = dataclasses.replace(big, name="small", memory_bytes=(need_mp + need_dp) // 2)
    res = mt.plan.search(step, mesh, device=small)
    assert res.best.fits
    for rules in (dp, "batch:b; d_ff:m", mp):
        hand = mt.plan.estimate(step, mesh, rules, device=small)
        assert not hand.fits or res.best.step_seconds <= hand.step_seconds * (1 + 1e-9)
    assert not mt.plan.estimate(step, mesh, dp, device=small).fits
    # what does not fit is ranked after everything that does, with the reason
    flags = [e.fits for e in res.candidates]
    assert flags == sorted(flags, reverse=True)
    assert any("does not fit" in e.reason() for e in res.candidates if not e.fits)
    assert "best: --mesh b:2,m:2" in res.table()


# the Mesh-TensorFlow paper's language models (tensor2tensor mtf_transformer_paper_lm_{m1,0..5}):
# d_ff, heads, parameters in billions, mesh
PAPER = [(4096, 4, 0.14, "batch:32"), (8192, 8, 0.22, "batch:32"), (16384, 16, 0.37, "model:4,batch:8"),
         (32768, 32, 0.67, "model:4,batch:8"), (65536, 64, 1.28, "model:8,batch:16"),
         (131072, 128, 2.48, "batch:16,model:32"), (262144, 256, 4.90, "batch:16,model:32")]
PAPER_RULES = "batch:batch; vocab:model; d_ff:model; heads:model"


def paper_rules(mesh: str) -> str:
    return PAPER_RULES if "model" in mesh else "batch:batch"


@pytest.mark.parametrize("d_ff, heads, billions, mesh", PAPER)
def test_paper_parameter_counts(d_ff, heads, billions, mesh):
    cfg = TrainConfig.of(layers=6, d_model=1024, d_kv=256, d_ff=d_ff, heads=heads, batch=256, length=256,
                      tie_embeddings=False)
    t = trace(lambda: build_model(cfg, 32768), mesh=mesh, rules=paper_rules(mesh))
    assert round(t.parameters / 1e9, 2) == billions


ARGS = ["plan", "--layers", "1", "--d-model", "32", "--d-kv", "8", "--d-ff", "64", "--heads", "4",
        "--batch", "8", "--length", "16", "--vocab", "64", "--no-tie-embeddings"]


def test_cli_json_and_png(capsys, tmp_path):
    png = tmp_path / "plan.png"
    assert main(ARGS + ["--mesh", "b:2,m:2", "--rules", "batch:b; d_ff:m", "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    # untied embedding and output layer, learned positions, one block, final norm
    assert out["parameters"] == 2 * 64 * 32 + 16 * 32 + (4 * 32 * 4 * 8 + 2 * 32 * 64 + 4 * 32) + 2 * 32
    assert out["fits"] is True and set(out["bytes_per_axis"]) == {"b", "m"}
    assert out["memory_bytes"]["parameters"] > 0 and out["flops"] > 0 and out["step_seconds"] > 0
    assert png.stat().st_size > 1000


def test_cli_search_and_errors(capsys):
    assert main(ARGS + ["--search", "--processors", "2", "--hardware", "a100"]) == 0
    text = capsys.readouterr().out
    assert "best: --mesh b:2" in text and "dominated by" in text
    assert main(ARGS + ["--mesh", "b:3", "--rules", "d_ff:b"]) == 2
    assert "dim 'd_ff' of size 64 over axis 'b' of size 3" in capsys.readouterr().err
    assert main(ARGS + ["--mesh", "b:2", "--rules", "experts:b"]) == 2
    assert "does not have" in capsys.readouterr().err


def test_plan_device_is_the_deprecated_name_of_hardware(capsys):
    """``meshtorch plan --hardware`` is the hardware priced (``--device`` is meshtorch train's: where a run
    computes); a hardware name given to ``--device`` still prices that hardware, with a notice on stderr."""
    one = ARGS + ["--mesh", "b:2", "--rules", "batch:b", "--json"]
    assert main(one + ["--hardware", "h100"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["device"] == "h100" and "deprecated" not in out.err
    assert main(one + ["--device", "a100"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["device"] == "a100"
    assert "meshtorch plan: --device a100 is deprecated, pass --hardware a100" in out.err


SMALL = TrainConfig.of(d_model=16, heads=4, d_kv=4, d_ff=32, layers=1, batch=8, length=8, experts=4, top_k=2)


# the MoE is one expert block (moe_every 1): the same 58 layouts, 24 of them with experts split, as two
# blocks under the default moe_every 2 (a dense block, then the expert one), at half the traces' cost
@pytest.mark.parametrize("model, mesh, optimizer, overlap", [("lm", "b:2,m:2", "adafactor", True),
                                                             ("moe", "b:2,m:2", "adamw", False)])
def test_lower_bounds_hold_for_every_candidate_and_pruning_keeps_the_best(model, mesh, optimizer, overlap):
    from meshtorch.plan.bounds import REFERENCE_MESH, dims_of, lower_bounds

    cfg = SMALL.replace(model=model, optimizer=optimizer, overlap=overlap, moe_every=1)
    step = training_step(cfg, vocab=32)
    spec = device("tpu-v2")
    ref = trace(step, mesh=REFERENCE_MESH)
    space = rules_for(mesh, dims_of(ref))
    # the MoE's space holds its expert layouts (experts on b: Mesh-TF's MoE layout)
    assert any("experts:" in r for r in space) == (model == "moe")
    everything = []
    for rules in space:
        est = mt.plan.estimate(step, mesh, rules, device=spec)
        t, m = lower_bounds(ref, mesh, rules, spec)
        assert 0 < t <= est.step_seconds * (1 + 1e-9), rules
        # the forward and backward alone (what the search traces before the whole shallow step;
        # none for a step that overlaps: without the step before, its gathers are not grouped)
        assert (step.without_update() is None) == overlap
        if not overlap:
            part = from_trace(trace(step.without_update(), mesh=mesh, rules=rules), mesh, spec).step_seconds
            assert t * 0.1 < part <= est.step_seconds * (1 + 1e-9), rules
        assert 0 < m <= est.memory_bytes["total"], rules
        everything.append(est)
    # memory between the smallest and largest need, so that half the candidates do not fit
    need = sorted(e.memory_bytes["total"] for e in everything)
    small = dataclasses.replace(spec, name="small", memory_bytes=need[len(need) // 2])
    fastest_fitting = min(e.step_seconds for e in everything if e.memory_bytes["total"] <= small.memory_bytes)
    res = mt.plan.search(step, mesh, device=small)
    assert res.best.fits and res.best.step_seconds == pytest.approx(fastest_fitting, rel=1e-12)
    assert res.space == len(everything) == len(res.candidates) + sum(res.pruned.values())


def test_search_prunes_the_paper_model_without_changing_the_answer():
    # a 3-layer LM (traced with 1 and 2 layers), big enough for compute to dominate
    cfg = TrainConfig.of(layers=3, d_model=1024, d_kv=128, d_ff=8192, heads=8, batch=64, length=128,
                      tie_embeddings=False, optimizer="adafactor")
    step = training_step(cfg, vocab=8192)
    res = mt.plan.search(step, 4, device="tpu-v2", meshes=["b:2,m:2"])
    # 18 rule sets of data and model parallelism, 16 with d_model or length on the model axis
    assert res.pruned["time"] > 0 and len(res.candidates) < res.space == 34
    best = mt.plan.estimate(step, res.mesh, res.rules, device="tpu-v2")
    assert best.step_seconds == pytest.approx(res.best.step_seconds, rel=1e-12)
    # the paper's kind of layout (data on b, the model dims on m) is never better than the search's
    hand = mt.plan.estimate(step, "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m", device="tpu-v2")
    assert res.best.step_seconds <= hand.step_seconds * (1 + 1e-9)


# heads and experts of 3 do not divide over 2: 8 rule sets on b:2,m:2 (d_ff, vocab on m, d_model on b)
DEEP = TrainConfig.of(d_model=16, heads=3, d_kv=4, d_ff=32, layers=6, encoder_layers=1, batch=8, length=8,
                      experts=3, top_k=2, optimizer="adafactor")


@pytest.mark.parametrize("layers", [4, 6, 7])
def test_moe_extrapolation_covers_the_period_of_dense_and_expert_blocks(layers):
    # blocks alternate dense and MoE feed-forward layers: a 1- and 2-layer extrapolation
    # counted 23% too many parameters; one period apart, every count is exact
    step = training_step(DEEP.replace(model="moe", layers=layers), vocab=32)
    assert step.period == 2
    mesh, rules = "b:2,m:2", "batch:b; d_ff:m; vocab:m; d_model:b"
    ext, full = layered_trace(step, mesh, rules), trace(step, mesh=mesh, rules=rules)
    model = build_model(DEEP.replace(model="moe", layers=layers), 32)
    assert ext.result["parameters"] == full.result["parameters"] == model.num_parameters()
    assert ext.comm.as_dict() == full.comm.as_dict() and ext.flops_by_dtype == full.flops_by_dtype
    spec = device("tpu-v2")
    got, want = (from_trace(t, mesh, spec).step_seconds for t in (ext, full))
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("model, layers", [("moe", 6), ("seq2seq", 3)])
def test_search_equals_exhaustive_search(model, layers):
    # the shallowest models the search extrapolates (MoE: period 2); a vocab of 33 does not
    # divide over 2 either, leaving 6 rule sets: batch on b with d_ff on m or not and d_model on
    # b or not, and batch over (b,m) with d_model over (b,m) or not
    step = training_step(DEEP.replace(model=model, layers=layers), vocab=33)
    mesh, spec = "b:2,m:2", device("tpu-v2")
    space = rules_for(mesh, {"batch": 8, "heads": 3, "d_ff": 32, "vocab": 33, "experts": 3, "d_model": 16,
                             "length": 8})
    # and d_model or length on m, with d_ff on m or not
    assert len(space) == 6 + 4
    every = {r: mt.plan.estimate(step, mesh, r, device=spec) for r in space}
    fastest = min(e.step_seconds for e in every.values())
    res = mt.plan.search(step, mesh, device=spec, verify=1)
    assert res.best.step_seconds == pytest.approx(fastest, rel=1e-12)
    assert every[res.rules].step_seconds == pytest.approx(fastest, rel=1e-12)
    # traced and pruned, every candidate is ranked once; a pruned one with a true lower bound
    ranked = res.ranking()
    assert sorted(c.rules for c in ranked) == sorted(space) and res.space == len(space)
    for c in ranked:
        if isinstance(c, Pruned):
            assert c.by == "time"
            assert every[c.rules].step_seconds >= c.seconds * (1 - 1e-9) >= fastest * (1 - 1e-9)
    table = res.table(top=len(space))
    assert len(table.splitlines()) == len(space) + 3  # header, candidates, summary, why
    assert table.count("pruned: step time >=") == res.pruned["time"]


def test_pruned_candidates_are_ranked_with_their_bound():
    from meshtorch.plan.ranking import SearchResult

    est = mt.plan.estimate(training_step(CFG.replace(layers=1), vocab=64), "b:2", "batch:b", device="a100")
    slow = Pruned("b:2", "batch:b; vocab:b", est.step_seconds * 2, 1e3, "time", best=est.step_seconds)
    huge = Pruned("b:2", "", 0.0, 2e12, "memory")
    res = SearchResult([est], "a100", 0.1, space=3, pruned_candidates=[huge, slow])
    assert res.ranking() == [est, slow, huge] and res.pruned == {"time": 1, "memory": 1}
    rows = res.table().splitlines()
    assert f">={est.step_seconds * 2e3:.2f}" in rows[2] and "pruned: step time" in rows[2]
    assert "NO" in rows[3] and "do not fit" in rows[3] and "(replicated)" in rows[3]
    assert "3 candidates, 1 traced (1 pruned: time bound" in rows[4]
