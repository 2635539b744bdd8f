"""One training loop: the pipelined step gets what the plain step gets (bf16, metrics as they
happen, the utilisation figure); the library never imports the app."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshtorch import cli
from meshtorch.context import current
from meshtorch.recipes.lm import strategies
from run_harness import tiny_train

pytestmark = pytest.mark.timeout(300)

TINY = tiny_train(layers=2, batch=8, warmup=2, mesh="b:1", rules="", lr=0.01)
PIPE = ["--pipeline-stages", "2", "--schedule", "gpipe", "--microbatches", "2"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (d / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40)))
    return str(d)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run(out, text, *flags):
    assert cli.main(["train", "--out", out, "--data", text, *TINY, *flags]) == 0
    return [r["loss"] for r in _metrics(out)]


def test_pipelined_run_trains_in_bf16_like_the_plain_run(text, tmp_path):
    steps = ["--steps", "4", "--log-every", "1"]
    plain32 = _run(str(tmp_path / "p32"), text, *steps)
    plain16 = _run(str(tmp_path / "p16"), text, *steps, "--precision", "bf16")
    piped32 = _run(str(tmp_path / "q32"), text, *steps, *PIPE)
    piped16 = _run(str(tmp_path / "q16"), text, *steps, *PIPE, "--precision", "bf16")
    # the reference: the plain run's bf16 losses; gpipe is synchronous, so the pipeline's are the same
    # up to bf16 rounding of two micro-batches instead of one batch: one bf16 step (2^-5 at 4..8)
    assert piped16 == pytest.approx(plain16, abs=2 ** -5 + 1e-6)
    assert piped32 == pytest.approx(plain32, abs=2e-4)
    # and bf16 really ran: its losses are not the fp32 ones
    assert max(abs(a - b) for a, b in zip(piped16, piped32)) > 1e-3


def test_pipelined_run_writes_metrics_as_it_goes_with_utilisation(text, tmp_path, monkeypatch):
    out = str(tmp_path / "piped")
    seen = []
    run = strategies.PipelinedStep.run

    def spy(self, batches, first):
        if first > 0 and current().rank == 0:  # it has written a record for every step before this window
            seen.append((first, [r["step"] for r in _metrics(out)]))
        return run(self, batches, first)

    monkeypatch.setattr(strategies.PipelinedStep, "run", spy)
    _run(out, text, "--steps", "3", "--log-every", "1", *PIPE)
    assert seen and all(steps == list(range(1, first + 1)) for first, steps in seen), seen
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["flop_utilisation"] < 1 for r in records)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["flop_utilisation"] == records[-1]["flop_utilisation"]
    assert (summary["schedule"], summary["pipeline_stages"], summary["microbatches"]) == ("gpipe", 2, 2)


def test_the_library_imports_nothing_of_the_app():
    code = ("import sys, meshtorch, meshtorch.plan, meshtorch.pipeline, meshtorch.pipeline.lm, "
            "meshtorch.placement\nprint(sorted(m for m in sys.modules if m.startswith('meshtorch.recipes')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_help_is_plain_text_with_choices_and_one_default(capsys):
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "sub-command per module" not in top and "train" in top and "plan" in top
    assert cli.main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text and "(default: None)" not in text
    assert text.count("(default") == text.count("(default:")  # one spelling, never doubled
    assert "default runs/<date-time>/) (default" not in text
    for flag, choices in (("--model", "{lm,seq2seq,moe}"), ("--optimizer", "{adamw,adafactor}"),
                          ("--precision", "{fp32,bf16}"), ("--lr-schedule", "{cosine,constant}"),
                          ("--schedule", "{gpipe,1f1b,2bw,zb,interleaved,zbv}"),
                          ("--backend", "{threads,torch}")):
        assert f"{flag} {choices}" in text, flag


def test_config_file_sections_reach_their_fields(tmp_path):
    import argparse

    from meshtorch.recipes.lm.cli import config_from_args, register

    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    f = tmp_path / "c.toml"
    f.write_text('[model]\nname = "moe"\nd_model = 64\n[optimizer]\nname = "adafactor"\nlr = 0.5\n'
                 '[parallelism]\nmesh = "b:4"\n[run]\nsteps = 9\n')
    cfg = config_from_args(p.parse_args(["train", "--config", str(f), "--lr", "0.25"]))
    assert (cfg.model.name, cfg.model.d_model, cfg.optimizer.name, cfg.optimizer.lr, cfg.parallelism.mesh,
            cfg.run.steps) == ("moe", 64, "adafactor", 0.25, "b:4", 9)
    f.write_text("[run]\nstepz = 1\n")
    with pytest.raises(Exception, match="stepz"):
        config_from_args(p.parse_args(["train", "--config", str(f)]))


@pytest.mark.parametrize("flags", [[], PIPE], ids=["plain", "pipelined"])
def test_the_mesh_and_rules_strings_are_parsed_once_on_the_way_to_the_first_step(text, tmp_path, monkeypatch,
                                                                                flags):
    """From ``meshtorch train``'s arguments to the first step, ``--mesh`` and ``--rules`` are parsed
    once (when the config is built) and everything after takes the parsed objects: the checks, the
    memory check's trace, the stage axis of a pipelined run, the launch. (Before: 18 parses at 5-6
    places in the code, plain and pipelined alike.)"""
    from meshtorch.layout import LayoutRules
    from meshtorch.mesh import Mesh

    parsed, at_first_step = [], []
    for cls, kind in ((Mesh, "mesh"), (LayoutRules, "rules")):
        def counting(self, spec="", _init=cls.__init__, _kind=kind):
            if isinstance(spec, str) and spec:  # "" is the empty mesh of the context outside a launch
                parsed.append((_kind, spec))
            _init(self, spec)
        monkeypatch.setattr(cls, "__init__", counting)
    for step in (strategies.PlainStep, strategies.PipelinedStep):
        def spy(self, batches, first, _run=step.run):
            if not at_first_step:
                at_first_step.append(list(parsed))
            return _run(self, batches, first)
        monkeypatch.setattr(step, "run", spy)
    args = ["train", "--out", str(tmp_path / "run"), "--data", text, *TINY, "--mesh", "b:2", "--rules",
            "batch:b", "--tokenizer", "bytes", "--steps", "1", "--sample-tokens", "0", *flags]
    assert cli.main(args) == 0
    assert at_first_step == [[("mesh", "b:2"), ("rules", "batch:b")]]


def test_the_process_count_is_checked_against_the_mesh_with_its_stage_axis(monkeypatch):
    from meshtorch.errors import MeshError
    from meshtorch.recipes.lm import TrainConfig, train

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MeshError, match=r"--mesh 'b:2' \(with the 'stage' axis of --pipeline-stages 2: "
                       r"'stage:2,b:2'\) has 4 processors but 2 processes are running; start 4 processes or "
                       r"pass a --mesh of 1 processors besides the 'stage' axis"):
        train(TrainConfig.of(mesh="b:2", pipeline_stages=2))


@pytest.mark.timeout(240)
def test_torchrun_pipelined_run_on_the_mesh_with_its_stage_axis(text, tmp_path):
    """``torchrun --nproc-per-node 4 -m meshtorch train --pipeline-stages 2 --mesh b:2``: the mesh is
    stage:2,b:2, four processors (before, the world was joined on the mesh without its stage axis and
    the run failed with "start 2 processes"). Its losses are the threads backend's on the same mesh."""
    from test_launch_cli import _run as run_in_group

    flags = [*TINY, "--mesh", "b:2", "--rules", "batch:b", "--tokenizer", "bytes", "--steps", "2",
             "--log-every", "1", "--sample-tokens", "0", *PIPE]
    out = str(tmp_path / "torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                "-m", "meshtorch", "train", "--backend", "torch", "--device", "cpu", "--out", out,
                "--data", text, *flags]
    code, _, err = run_in_group(cmd, timeout=220)
    assert code == 0, err[-3000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["pipeline_stages"], summary["steps"]) == (2, 2)
    threads = _run(str(tmp_path / "threads"), text, *flags[len(TINY):])
    assert [r["loss"] for r in _metrics(out)] == pytest.approx(threads, abs=1e-4)
