"""The search's enlarged space: d_model and length on the model axis, experts on the data
axis, three-axis meshes with tuple rules; search = exhaustive search over it, and the
reasons it gives for its ranking."""

from __future__ import annotations

import importlib

import pytest

import meshtorch as mt
from meshtorch.plan import trace
from meshtorch.plan.bounds import REFERENCE_MESH, dims_of
from meshtorch.plan.space import meshes_for, pipeline_layouts, rules_for
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import prepare, training_step

VOCAB = 16
TINY = TrainConfig.of(batch=4, length=8, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, encoder_layers=1,
                      experts=2, top_k=1, moe_every=1, optimizer="adamw")


def space(step, mesh):
    return rules_for(mesh, dims_of(trace(step, mesh=REFERENCE_MESH)))


@pytest.mark.parametrize("model", ["lm", "moe", "seq2seq"])
def test_search_equals_exhaustive_search_over_the_enlarged_space(model):
    # MoE and seq2seq with 3 heads and 17 ids (which 2 does not divide): a smaller space, faster
    cfg, vocab = (TINY, VOCAB) if model == "lm" else (TINY.replace(model=model, heads=3), 17)
    step = training_step(cfg, vocab)
    mesh, spec = "b:2,m:2", mt.plan.device("a100")
    rules = space(step, mesh)
    # the families the search could not express before
    assert "batch:b; d_model:m" in rules and "batch:b; length:m" in rules
    assert ("batch:b; experts:b" in rules) == (model == "moe")
    every = {r: mt.plan.estimate(step, mesh, r, device=spec) for r in rules}
    fastest = min(e.step_seconds for e in every.values() if e.fits)
    res = mt.plan.search(step, mesh, device=spec, verify=1)
    assert res.space == len(rules)
    assert res.best.step_seconds == pytest.approx(fastest, rel=1e-12)
    assert every[res.rules].step_seconds == pytest.approx(fastest, rel=1e-12)
    assert sorted(c.rules for c in res.ranking()) == sorted(rules)


def test_three_axis_meshes_and_their_search():
    assert meshes_for(8, axes=3) == ["b:8", "b:2,m:4", "b:4,m:2", "b:2,m:2,x:2"]
    step = training_step(TINY, VOCAB)
    rules = space(step, "b:2,m:2,x:2")
    assert "batch:(b,x); heads:m; d_ff:m; vocab:m; d_model:(b,x)" in rules
    # x is a slow link: the search keeps the big gradient sums off it where it can
    spec = mt.plan.device("a100").with_links(x=mt.plan.Link(1e9, 1e-4))
    every = {r: mt.plan.estimate(step, "b:2,m:2,x:2", r, device=spec) for r in rules}
    res = mt.plan.search(step, "b:2,m:2,x:2", device=spec, verify=1)
    assert res.best.step_seconds == pytest.approx(min(e.step_seconds for e in every.values()), rel=1e-12)


def _counted(cfg, vocab):
    step, batch = prepare(cfg, vocab)
    before = mt.comm_stats().copy()
    step.run([batch], 1)
    return (mt.comm_stats() - before).as_dict()


@pytest.mark.parametrize("mesh, rules", [
    ("b:2,m:2,x:2", "batch:(b,x); heads:m; d_ff:m; vocab:m; d_model:(b,x)"),
    ("b:2,m:2", "batch:b; length:m; heads:m"),
    ("b:2,m:2", "batch:b; d_model:m; d_ff:m"),
])
def test_planned_bytes_equal_a_real_step_counted_by_the_communicator(mesh, rules):
    cfg = TINY.replace(model="lm", layers=2)
    planned = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules)
    real = mt.launch(_counted, cfg, VOCAB, mesh=mesh, rules=rules, backend="threads")[0]
    assert planned.comm.as_dict() == real


def test_the_search_says_why_it_chose():
    step = training_step(TINY, VOCAB)
    res = mt.plan.search(step, "b:2,m:2", device="a100", verify=2)
    first, second = res.candidates[:2]
    assert res.why(first).startswith("fits memory (") and "fastest" in res.why(first)
    slower = round((second.step_seconds / first.step_seconds - 1) * 100)
    assert res.why(second).startswith(f"{slower}% slower than #1")
    lines = res.reasons(3)
    assert lines[0].startswith("1st b:2,m:2") and lines[1].startswith("2nd ")
    assert res.why(first) in res.table(3)


def test_the_space_has_the_sizes_the_search_docstring_gives():
    """``mt.plan.search``'s docstring sizes its space for the paper's 4.9B LM (6 layers, d_model 1024,
    d_kv 256, d_ff 262144, 256 heads, batch 256 x 256 tokens, vocabulary 32768), with the dims a
    meta trace of ``meshtorch plan``'s step reports."""
    dims = {"vocab": 32768, "d_model": 1024, "positions": 256, "heads": 256, "d_kv": 256, "d_ff": 262144,
            "batch": 256, "length": 256, "memory_length": 256}
    tiny = dims_of(trace(training_step(TrainConfig.of(layers=1, d_model=16, d_kv=4, d_ff=32, heads=2, batch=8,
                                                      length=8), 32), mesh=REFERENCE_MESH, backend="meta"))
    assert set(tiny) == set(dims)
    counts = [(sum(len(rules_for(m, dims)) for m in meshes_for(n)), len(pipeline_layouts(n, dims, layers=6)))
              for n in (2, 8, 64, 512)]
    assert counts == [(16, 3), (84, 198), (186, 810), (260, 1104)]
    doc = " ".join(importlib.import_module("meshtorch.plan.search").__doc__.split())
    assert "16 SPMD candidates on 2 processors, 84 on 8, 186 on 64 and 260 on 512" in doc
    assert "the pipelined family 3, 198, 810 and 1,104 more" in doc
