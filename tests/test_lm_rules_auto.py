"""``meshtorch train --rules auto``: the planner's search picks the rules of ``--mesh`` for the trainer's
own step, the run prints and records them (summary.json, the checkpoint) and trains as the explicit
layout it picked does; what it cannot search is refused before anything runs."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from meshtorch import cli
from meshtorch.checkpoint.index import read_index
from meshtorch.errors import ArgumentError, PlanError
from meshtorch.mesh import Mesh
from meshtorch.recipes.lm import TrainConfig, plan_cli
from meshtorch.recipes.lm.generate import generate_from_checkpoint
from meshtorch.recipes.lm.plan_cli import hardware_of_run
from run_harness import tiny_train, write_corpus

TINY = tiny_train(batch=8, log_every=1, lr_schedule="constant", lr=0.01, tokenizer="bytes", steps=3,
                  mesh="b:2,m:2")
# every dim the search may split over m is split: a layout unlike "batch:b" alone
SPLIT = "batch:b; heads:m; d_ff:m; vocab:m"


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), files=4)


def _run(out, text, rules):
    assert cli.main(["train", "--out", out, "--data", text, *TINY, "--rules", rules]) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    with open(os.path.join(out, "summary.json")) as f:
        return losses, json.load(f)


def test_rules_auto_trains_as_the_layout_it_picks_and_records_it(text, tmp_path, capsys):
    auto, summary = _run(str(tmp_path / "auto"), text, "auto")
    printed = capsys.readouterr().out
    chosen = summary["rules_auto"]
    picked = chosen["rules"]
    # the rules picked are real rules of this mesh, printed with the runner-up and its cost
    assert picked != "auto" and summary["rules"] == picked and summary["mesh"] == chosen["mesh"] == "b:2,m:2"
    assert f'--mesh b:2,m:2 --rules auto: picked --mesh b:2,m:2 --rules "{picked}"' in printed
    runner = chosen["runner_up"]
    assert runner["rules"] != picked and runner["mesh"] == "b:2,m:2"
    assert f'runner-up --mesh b:2,m:2 --rules "{runner["rules"]}"' in printed
    # the best ranks first: the runner-up costs at least as much (a traced one, or its lower bound)
    assert runner.get("step_seconds", runner.get("step_seconds_lower_bound")) >= chosen["step_seconds"]
    assert chosen["hardware"] == "cpu" and chosen["candidates"] >= chosen["traced"] >= 2
    assert f"rules '{picked}'" in printed  # the run's banner: it trains on them
    # the checkpoint records the rules picked, not "auto": --resume and generate read them as any others
    index = read_index(str(tmp_path / "auto" / "checkpoint"))
    assert index["extra"]["train_config"]["rules"] == index["rules"] == picked
    assert generate_from_checkpoint(str(tmp_path / "auto"), "def ", 4, temperature=0.0, mesh="b:2,m:2",
                                    rules=picked)
    # the same losses as the explicit layout it picked (the same run), and as another layout up to
    # float32 rounding of sums split differently
    same, _ = _run(str(tmp_path / "same"), text, picked)
    other, _ = _run(str(tmp_path / "other"), text, SPLIT if picked != SPLIT else "batch:b")
    assert len(auto) == 3 and auto == same
    assert auto == pytest.approx(other, abs=2e-4)
    assert auto[-1] < auto[0]  # it trained


def test_mesh_auto_picks_the_mesh_of_n_processors_and_its_rules(text, tmp_path, capsys):
    flags = ["--data", text, *TINY, "--steps", "2"]
    out = str(tmp_path / "auto")
    assert cli.main(["train", "--out", out, *flags, "--mesh", "auto:4", "--rules", "auto"]) == 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    mesh, rules = summary["mesh"], summary["rules"]
    assert Mesh(mesh).size == 4 and summary["rules_auto"]["mesh"] == mesh
    assert f'--mesh auto:4 --rules auto: picked --mesh {mesh} --rules "{rules}"' in capsys.readouterr().out
    index = read_index(os.path.join(out, "checkpoint"))
    assert (index["extra"]["train_config"]["mesh"], index["extra"]["train_config"]["rules"]) == (mesh, rules)
    # the explicit run of what it picked trains the same
    same = str(tmp_path / "same")
    assert cli.main(["train", "--out", same, *flags, "--mesh", mesh, "--rules", rules]) == 0
    assert json.load(open(os.path.join(same, "summary.json")))["final_loss"] == summary["final_loss"]


def test_mesh_auto_picks_a_pipeline_where_only_a_pipeline_fits_and_trains_on_it(text, tmp_path, capsys,
                                                                                  monkeypatch):
    # a device (a slow processor of 100 KiB) on which this LM's plain layouts over 2 processors need
    # 155 KiB and its 2-stage pipelines 71 KiB: `--mesh auto:2 --rules auto` picks a pipeline split
    import dataclasses

    import meshtorch as mt
    from meshtorch.plan.devices import save_spec
    from meshtorch.recipes.lm import plan_cli

    spec = dataclasses.replace(mt.plan.device("a100"), name="tiny", peak_flops={"float32": 2e8},
                               memory_bytes=100 * 1024, memory_margin=0.0, context_bytes=0)
    save_spec(spec, tmp_path / "tiny.json")
    monkeypatch.setattr(plan_cli, "hardware_of_run", lambda cfg, n: (str(tmp_path / "tiny.json"), "test"))
    model = ["--d-model", "8", "--heads", "1", "--d-kv", "4", "--d-ff", "15", "--layers", "2", "--batch",
             "8", "--length", "8", "--optimizer", "adamw", "--tokenizer", "bytes", "--steps", "2",
             "--eval-batches", "1", "--sample-tokens", "4", "--warmup", "0", "--lr-schedule", "constant",
             "--no-progress", "--data", text]
    out = str(tmp_path / "auto")
    assert cli.main(["train", "--out", out, *model, "--mesh", "auto:2", "--rules", "auto"]) == 0
    printed = capsys.readouterr().out
    summary = json.load(open(os.path.join(out, "summary.json")))
    chosen = summary["rules_auto"]
    # the runner-up, traced or pruned by its bound, is a layout without stages that does not fit
    assert chosen["pipeline_stages"] == 2 and chosen["fits"] and chosen["why"].startswith("fits memory")
    runner = chosen["runner_up"]
    assert "pipeline_stages" not in runner and not runner.get("fits", False)
    flags = ["--pipeline-stages", "2", "--schedule", chosen["schedule"], "--microbatches",
             str(chosen["microbatches"])]
    assert f'--mesh auto:2 --rules auto: picked --mesh {chosen["mesh"]} --rules "{chosen["rules"]}" ' \
           f'{" ".join(flags)}: planned' in printed
    # it trained pipelined, and the checkpoint records the split, as an explicit run of those flags
    config = read_index(os.path.join(out, "checkpoint"))["extra"]["train_config"]
    assert (config["pipeline_stages"], config["schedule"], config["microbatches"]) == (
        2, chosen["schedule"], chosen["microbatches"])
    same = str(tmp_path / "same")
    assert cli.main(["train", "--out", same, *model, "--mesh", chosen["mesh"], "--rules", chosen["rules"],
                     *flags]) == 0
    assert json.load(open(os.path.join(same, "summary.json")))["final_loss"] == summary["final_loss"]


@pytest.mark.parametrize("flags, needle", [
    (["--mesh", "auto:4", "--rules", "batch:b"], "--mesh auto:4 is picked with its rules: pass --rules auto"),
    (["--mesh", "auto", "--rules", "auto"], "--mesh auto needs a processor count: --mesh auto:N"),
    (["--mesh", "auto:x", "--rules", "auto"], "auto:N takes a processor count N >= 1"),
    (["--rules", "auto", "--pipeline-stages", "2"], "--rules auto searches the layout of a plain step"),
    # the config's own error, before any search
    (["--rules", "auto", "--model", "moe", "--experts", "1", "--top-k", "2"],
     "--experts 1 must be >= --top-k 2"),
])
def test_rules_auto_refuses_what_it_cannot_search_before_training(flags, needle, capsys, tmp_path):
    mesh = [] if "--mesh" in flags else ["--mesh", "b:2,m:2"]
    assert cli.main(["train", "--out", str(tmp_path / "x"), *mesh, *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_rules_auto_cannot_be_read_before_it_is_resolved():
    cfg = TrainConfig.of(mesh="b:2,m:2", rules="auto")
    assert cfg.parallelism.auto_rules
    with pytest.raises(ArgumentError, match="--rules auto is resolved by meshtorch train"):
        _ = cfg.parallelism.parsed
    assert str(cfg.replace(rules="batch:b").parallelism.parsed.rules) == "batch:b"


@pytest.mark.parametrize("gpu, spec, note", [
    ("NVIDIA H100 80GB HBM3", "h100", "for NVIDIA H100"),
    ("NVIDIA A100-SXM4-80GB", "a100", "for NVIDIA A100"),
    ("NVIDIA H100 PCIe", "h100-pcie", "for NVIDIA H100 PCIe"),
    ("NVIDIA L4", "l4", "for NVIDIA L4"),
])
def test_rules_auto_prices_the_gpu_the_run_is_on(gpu, spec, note, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    hardware, source = hardware_of_run(TrainConfig.of(device="cuda"), 2)
    assert hardware == spec and note in source
    assert hardware_of_run(TrainConfig.of(device="cpu"), 2)[0] == "cpu"


def test_rules_auto_on_a_gpu_without_rates_says_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_cli, "gpu_calibration_path", lambda file_name: tmp_path / f"{file_name}.json")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GeForce RTX 4090")
    with pytest.raises(PlanError, match="4090' is not in meshtorch.plan.gpus.GPUS.*--calibrate --device"):
        hardware_of_run(TrainConfig.of(device="cuda"), 2)


@pytest.mark.parametrize("error", [AssertionError("Torch not compiled with CUDA enabled"),
                                   RuntimeError("No CUDA GPUs are available")])
def test_rules_auto_with_device_cuda_on_a_machine_without_one_says_so(error, monkeypatch):
    """Seen: `meshtorch train --rules auto --device cuda` on a CPU-only torch ended in torch's
    traceback from hardware_of_run, before the run's own device check could say it."""
    def no_gpu(*a):
        raise error

    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu)
    with pytest.raises(PlanError, match=r"--rules auto: --device cuda asked for, but torch sees no CUDA GPU "
                                        r"on this machine \(.*\).*use --device auto or cpu"):
        hardware_of_run(TrainConfig.of(device="cuda"), 2)


def _train_auto(cfg, disagree):
    """One torchrun-like process running ``meshtorch train --rules auto``; with ``disagree``, processor
    1's search is made to pick other rules. The rules trained on and the final loss, or the error."""
    import meshtorch.recipes.lm.trainer as trainer
    from meshtorch.context import current

    choose = trainer.choose_rules

    def other_on_rank_1(c, vocab, processes):
        c, chosen = choose(c, vocab, processes)
        other = "" if str(c.parallelism.parsed.rules) else "batch:b"
        return (c.replace(rules=other) if current().rank == 1 else c), chosen

    if disagree:
        trainer.choose_rules = other_on_rank_1
    try:
        result = trainer.train(cfg)
    except Exception as e:
        return str(e)
    finally:
        trainer.choose_rules = choose
    return result["mesh"], result["rules"], result["final_loss"]


@pytest.mark.parametrize("disagree", [False, True])
def test_auto_under_torchrun_every_process_trains_on_the_same_layout(text, tmp_path, disagree):
    import meshtorch as mt

    cfg = TrainConfig.of(backend="torch", steps=2, data=text, out=str(tmp_path / "run"), tokenizer="bytes",
                         mesh="b:2" if disagree else "auto", rules="auto", d_model=16, heads=2, d_kv=8,
                         d_ff=32, layers=1, batch=4, length=16, eval_batches=1, sample_tokens=4,
                         log_every=1, progress=False)
    per_proc = mt.launch(_train_auto, cfg, disagree, mesh="b:2", backend="torch", nprocs=2)
    if disagree:  # every process stops, naming what each picked (none waits for the others forever)
        assert all("--rules auto picked different rules on different processes" in p for p in per_proc)
        return
    # --mesh auto: torchrun's 2 processes; both pick the same mesh and rules and train alike
    (mesh, rules, loss), other = per_proc
    assert Mesh(mesh).size == 2 and rules != "auto" and other == (mesh, rules, loss)


@pytest.mark.parametrize("gpu, reported, refused", [
    # a card whose name states no size, smaller than its row's (the table's only A800 rows are 80 GB
    # cards); a name that states one, "NVIDIA A800 40GB Active", matches no row (test_plan_gpus)
    ("NVIDIA A800", 42.4e9, True),
    ("NVIDIA A100-SXM4-40GB", 42.4e9, False),  # a 40 GB row of its own
    ("NVIDIA H100 80GB HBM3", 85.5e9, False),  # CUDA reports GiB-rounded totals above the sheet's GB
])
def test_rules_auto_refuses_a_gpu_with_less_memory_than_its_row(gpu, reported, refused, monkeypatch,
                                                                tmp_path):
    monkeypatch.setattr(plan_cli, "gpu_calibration_path", lambda file_name: tmp_path / f"{file_name}.json")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(total_memory=int(reported)))
    if refused:
        with pytest.raises(PlanError, match=r"reports 42.4 GB of memory, but its row .*\(a800\) has 80 GB"
                                            r".*--calibrate"):
            hardware_of_run(TrainConfig.of(device="cuda"), 2)
    else:
        assert hardware_of_run(TrainConfig.of(device="cuda"), 2)[0] in ("a100-40gb", "h100")
