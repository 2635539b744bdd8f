"""The planner used as its docs show, each case something a user ran into: a plain step function
planned against its real run, the search's table, the memory a run states (``--memory-budget``),
and the flags ``meshtorch plan`` cannot honour, refused with the flag and the fix."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import meshtorch as mt
from meshtorch.cli import main
from meshtorch.errors import ArgumentError, PlanError
from meshtorch.plan.estimate import estimate
from meshtorch.plan.ranking import Pruned, SearchResult
from meshtorch.recipes.lm import TrainConfig, plan_cli
from meshtorch.recipes.lm.fit import check_memory
from meshtorch.recipes.lm.steps import training_step

TINY = ["--layers", "2", "--d-model", "32", "--heads", "4", "--d-kv", "8", "--d-ff", "64", "--batch", "8",
        "--length", "16", "--vocab", "64"]


def mlp_step(optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> dict:
    """docs/planner.md's "any step function": an mt.nn MLP, torch's AdamW, a warm-up step, then one
    step inside mt.plan.measure(), its collectives counted by the communicator."""
    d, h = mt.Dim("d", 32), mt.Dim("h", 64)
    mlp = mt.nn.Sequential(mt.nn.Dense(d, h), mt.relu, mt.nn.Dense(h, d))
    x = mt.random.normal("batch:16,d:32", seed=1)
    opt = optimizer(mlp.parameters(), lr=0.1)
    mt.reduce_sum(mlp(x) ** 2).backward()
    opt.step()
    opt.zero_grad()
    mt.reset_comm_stats()
    with mt.plan.measure():
        mt.reduce_sum(mlp(x) ** 2).backward()
        opt.step()
        opt.zero_grad()
    return mt.comm_stats().as_dict()


@pytest.mark.parametrize("mesh, rules", [("b:2,m:2", "batch:b; h:m"), ("b:4", "batch:b; d:b")])
def test_a_plain_step_function_plans_the_collectives_its_run_makes(mesh, rules):
    planned = mt.plan.trace(mlp_step, mesh=mesh, rules=rules).comm.as_dict()
    assert planned == mt.launch(mlp_step, mesh=mesh, rules=rules)[0]
    assert planned  # it communicates: the gradients' sums at least


@pytest.mark.parametrize("optimizer", [torch.optim.NAdam, torch.optim.Adagrad, torch.optim.ASGD])
def test_a_step_with_any_torch_optimizer_plans_what_its_run_measures(optimizer):
    # NAdam reads its host-held mu_product with .item(): planning raised ZeroDivisionError when
    # the meta backend made it a meta tensor and 1 stood in for the read; Adagrad makes its
    # counters in its constructor, ASGD keeps them on the parameters' device
    planned = mt.plan.trace(mlp_step, optimizer, mesh="b:2", rules="batch:b; h:b")
    measured = mt.plan.trace(mlp_step, optimizer, mesh="b:2", rules="batch:b; h:b", backend="threads")
    assert planned.result == measured.result
    assert planned.flops == measured.flops and planned.peak_by_kind == measured.peak_by_kind


def test_the_search_table_keeps_its_columns_apart_and_tells_small_steps_apart():
    """Seen: a pruned row read '>=0.01>=533.50 KiB' (two columns run together), and every step of a
    small model read 0.01 ms, also the one '167% slower than #1'."""
    est = estimate(training_step(TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4,
                                                length=8), vocab=16), "b:2", "batch:b", device="tpu-v2")
    fast, slow = est.step_seconds, est.step_seconds * 2.6
    assert fast * 1e3 < 0.05  # two decimals would show both as the same few hundredths
    long_rules = "batch:b; heads:b; d_ff:b; vocab:b; d_model:b; experts:b"
    pruned = Pruned("b:2", long_rules, slow, 546304, "time", best=fast)
    rows = SearchResult([est], "tpu-v2", 0.1, space=2, pruned_candidates=[pruned]).table().splitlines()
    first, second = rows[1].split(), rows[2].split()
    assert first[3] == f"{fast * 1e3:.3g}" and float(first[3]) == pytest.approx(fast * 1e3, rel=5e-3)
    # the rules, the bound on the step and the bound on memory stay apart
    assert re.search(rf" {re.escape(long_rules)} +>={slow * 1e3:.3g} +>=533.50 KiB ", rows[2]), rows[2]
    assert f">={slow * 1e3:.3g}" in second and ">=533.50" in second
    assert f"step time >= {slow * 1e3:.3g} ms (lower bound) >= best {fast * 1e3:.3g} ms" in rows[2]


def test_a_tie_is_called_a_tie():
    """Seen (README's search on 8 a100s): '#2 b:2,m:4 batch:(b,m) 1.38 ... 0% slower than #1: more
    all_reduce@b,m (+0.53 ms)' under '#1 b:8 batch:b 1.38': the same step, its all_reduce named
    after other axes."""
    step = training_step(TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=8),
                         vocab=16)
    one, two = (estimate(step, mesh, rules, device="a100") for mesh, rules in (("b:4", "batch:b"),
                                                                              ("b:2,m:2", "batch:(b,m)")))
    assert one.step_seconds == two.step_seconds and set(one.comm_seconds) != set(two.comm_seconds)
    why = SearchResult([one, two], "a100", 0.1).why(two)
    assert why.startswith("as fast as #1") and "more" not in why


def test_where_nothing_fits_the_table_ranks_the_best_first():
    """Seen: `meshtorch plan --search --hardware tiny.json` (nothing fits) ranked candidates pruned for
    their parameters (>= 163 KiB, a bound) above the traced one it named best (1.41 MiB), which the
    top rows did not show."""
    spec = dataclasses.replace(mt.plan.device("tpu-v2"), name="tiny", memory_bytes=1000)
    step = training_step(TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=8),
                         vocab=16)
    best = estimate(step, "b:2", "batch:b; d_model:b", device=spec)
    other = estimate(step, "b:2", "batch:b", device=spec)
    assert not best.fits and best.memory_bytes["total"] < other.memory_bytes["total"]
    huge = Pruned("b:2", "heads:b", 0.0, best.memory_bytes["total"] / 8, "memory")
    res = SearchResult([best, other], "tiny", 0.1, space=3, pruned_candidates=[huge])
    assert res.ranking() == [best, other, huge]
    rows = res.table().splitlines()
    assert "batch:b; d_model:b" in rows[1] and res.best is best and "nothing fits" in rows[-1]


@pytest.mark.parametrize("flags, names", [
    (["--processors", "4"], ["--processors 4", "--search", "--mesh b:4"]),
    (["--fixed-mesh"], ["--fixed-mesh", "--search"]),
    (["--axes", "3"], ["--axes 3", "--search"]),
    (["--no-pipeline"], ["--no-pipeline", "--search"]),
    (["--search", "--processors", "4", "--fixed-mesh"], ["--fixed-mesh", "no --mesh"]),
    (["--search", "--mesh", "b:2,m:2", "--fixed-mesh", "--processors", "8"],
     ["--processors 8", "4 processors"]),
    (["--search", "--mesh", "b:2,m:2", "--fixed-mesh", "--axes", "3"], ["--axes 3", "--fixed-mesh"]),
])
def test_search_options_it_would_drop_are_refused(capsys, flags, names):
    """Each was dropped unsaid: --processors 4 without --search planned --mesh b:2; --fixed-mesh
    without --mesh searched every mesh of 4 processors, pipelines included."""
    assert main(["plan", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names), err


@pytest.mark.parametrize("flags, names", [
    # the search planned a dense LM for it (meshtorch train refuses it)
    (["--model", "moe", "--layers", "1", "--search", "--processors", "2"], ["--layers 1", "--moe-every 2"]),
    # the search failed inside the traced model: "processor 0 {'ref': 0} (meta backend) raised ShapeError"
    (["--model", "moe", "--experts", "1", "--top-k", "2", "--search", "--processors", "2"],
     ["--experts 1", "--top-k 2"]),
    # the model config's words: "kv_heads=3 must divide heads=4"
    (["--kv-heads", "3"], ["--kv-heads 3", "--heads 4", "1, 2, 4"]),
    # "TransformerConfig.vocab must be >= 1, got 0"
    (["--vocab", "0"], ["--vocab 0", "--vocab N >= 1"]),
])
def test_model_flags_that_cannot_work_are_refused_in_their_words(capsys, flags, names):
    assert main(["plan", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names) and "ShapeError" not in err, err


def test_the_planned_training_step_refuses_what_train_refuses():
    """``mt.plan.estimate(training_step(cfg))`` of an MoE config without an expert layer (2 blocks a
    period, 1 layer) planned a dense LM, labelled MoE; meshtorch train refuses the config."""
    with pytest.raises(ArgumentError, match="--layers 1 has no MoE layer"):
        training_step(TrainConfig.of(model="moe", layers=1, experts=4, top_k=2), vocab=16)
    assert training_step(TrainConfig.of(model="moe", layers=2, experts=4, top_k=2), vocab=16).period == 2


@pytest.mark.parametrize("train, search", [
    (["--mesh", "b:2", "--rules", "auto"], ["--mesh", "b:2", "--search", "--fixed-mesh"]),
    (["--mesh", "auto:2", "--rules", "auto"], ["--search", "--processors", "2"]),
])
def test_a_rules_auto_command_line_plans_the_search_train_runs(capsys, train, search):
    """`meshtorch train ... --rules auto` with train replaced by plan was refused, advising --search
    --fixed-mesh, which --mesh auto:N refused in turn (it wants --rules auto)."""
    picked = []
    for flags in (train, search):
        assert main(["plan", *TINY, "--no-pipeline", "--json", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        picked.append((out["mesh"], out["rules"], out["step_seconds"], len(out["pruned"])))
    assert picked[0] == picked[1]


def test_plan_holds_the_step_to_the_memory_budget_of_its_run(capsys):
    """``meshtorch train --memory-budget`` refuses a step over the budget; ``meshtorch plan`` of the
    same flags said it fits (its capacity was the priced hardware's)."""
    budget = 0.0001
    assert main(["plan", *TINY, "--mesh", "b:2", "--memory-budget", str(budget), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_bytes"]["capacity"] == int(budget * 2 ** 30)
    assert out["fits"] is (out["memory_bytes"]["total"] <= budget * 2 ** 30) is False
    assert "--memory-budget 0.0001 GiB" in out["device"]


def test_rules_auto_picks_a_layout_that_fits_the_memory_budget(monkeypatch):
    """``meshtorch train --mesh b:2 --rules auto --memory-budget B`` picked the fastest layout for the
    hardware's memory, then its own memory check refused it over B, though other layouts fit B."""
    monkeypatch.setattr(plan_cli, "hardware_of_run", lambda cfg, processes: ("tpu-v2", "a test's"))
    cfg = TrainConfig.of(d_model=32, heads=4, d_kv=8, d_ff=64, layers=2, batch=8, length=16, mesh="b:2",
                         rules="auto", device="cpu")
    vocab = 64
    fastest, _ = plan_cli.choose_rules(cfg, vocab, 2)
    need = {r: estimate(training_step(cfg.replace(rules=r), vocab), "b:2", r).memory_bytes["total"]
            for r in (fastest.parallelism.rules, "heads:b; d_ff:b; vocab:b")}
    small = need["heads:b; d_ff:b; vocab:b"]
    assert small < need[fastest.parallelism.rules]  # the budget below rules out the fastest
    budget = (small + 64) / 2 ** 30
    picked, chosen = plan_cli.choose_rules(cfg.replace(memory_budget=budget), vocab, 2)
    assert picked.parallelism.rules != fastest.parallelism.rules
    assert chosen["fits"] and chosen["memory_bytes"] <= budget * 2 ** 30
    assert check_memory(picked, vocab, 2)["total"] == chosen["memory_bytes"]  # the run's check passes
    assert "--memory-budget" in chosen["hardware"]


def test_budgeted_leaves_a_run_without_a_budget_alone():
    assert plan_cli.budgeted("h100", TrainConfig.of(), 8) == "h100"
    spec = plan_cli.budgeted("h100", TrainConfig.of(memory_budget=10.0), 8)
    # a GPU's budget holds the allocator's peak with its margin and the CUDA context, as train's check
    assert spec.usable_memory == int((10 * 2 ** 30 - spec.context_bytes) / (1 + spec.memory_margin))
    with pytest.raises(PlanError, match="unknown device"):
        plan_cli.budgeted("no-such-gpu", TrainConfig.of(memory_budget=1.0), 1)
