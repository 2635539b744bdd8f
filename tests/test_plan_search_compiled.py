"""The search prices a compiled run's step compiled (``search(compiled=True)``, ``meshtorch plan
--search --compile``, ``meshtorch train --rules auto --compile``): every candidate as
``torch.compile`` runs it, and the pick is the fastest compiled layout that fits."""

from __future__ import annotations

import meshtorch as mt
from meshtorch.plan.bounds import REFERENCE_MESH, dims_of
from meshtorch.plan.estimate import from_trace
from meshtorch.plan.space import rules_for
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import training_step

CFG = TrainConfig.of(d_model=32, heads=4, d_kv=8, d_ff=64, layers=1, batch=8, length=16, precision="bf16")


def test_the_compiled_search_equals_pricing_every_candidate_compiled():
    step = training_step(CFG, vocab=64)
    spec = mt.plan.device("h100")
    res = mt.plan.search(step, "b:2", device=spec, compiled=True)
    # the reference: every layout of the mesh traced compiled and priced, none pruned
    ref = mt.plan.trace(step, mesh=REFERENCE_MESH, device="cuda")
    every = {}
    for rules in rules_for("b:2", dims_of(ref), step.dims):
        t = mt.plan.trace(step, mesh="b:2", rules=rules, device="cuda", compiled=True)
        every[rules] = from_trace(t, "b:2", spec)
    fastest = min(e.step_seconds for e in every.values() if e.fits)
    assert res.best.step_seconds == fastest
    for e in res.candidates:  # each traced candidate is priced as its compiled trace
        assert e.step_seconds == every[e.rules].step_seconds
    # and below the eager pricing of the same layout: the search did not price eager steps
    eager_of_pick = from_trace(mt.plan.trace(step, mesh="b:2", rules=res.best.rules, device="cuda"),
                               "b:2", spec)
    assert res.best.step_seconds < eager_of_pick.step_seconds


def test_train_rules_auto_with_compile_picks_the_fastest_compiled_layout(monkeypatch):
    from meshtorch.recipes.lm import plan_cli

    # the run computes on an H100 (priced op by op there, so compiling changes the price)
    monkeypatch.setattr(plan_cli, "hardware_of_run", lambda cfg, processes: ("h100", "the test's"))
    cfg = CFG.replace(mesh="b:2", rules="auto", compile=True)
    picked, chosen = plan_cli.choose_rules(cfg, 64, 2)
    res = mt.plan.search(training_step(cfg.replace(rules="batch:b"), vocab=64), "b:2", device="h100",
                         pipeline=False, compiled=True)
    assert picked.parallelism.rules == res.best.rules and chosen["step_seconds"] == res.best.step_seconds
    assert chosen["compiled"] and "a compiled step on h100" in plan_cli.describe_choice(chosen)
