"""``meshtorch train`` end to end on a tiny model: files, resume, flag errors, generate."""

from __future__ import annotations

import json
import os
import re

import pytest

from meshtorch import cli
from meshtorch.checkpoint.index import read_index
from meshtorch.errors import ArgumentError
from meshtorch.recipes.lm import TrainConfig, train
from run_harness import assert_same_bits, checkpoint_tensors, tiny_train, write_corpus

TINY = tiny_train(sample_tokens=8, log_every=2, lr_schedule="constant")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), files=12)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_heldout_line_says_how_far_below_or_above_the_unigram_entropy():
    from meshtorch.recipes.lm.report import against_unigram

    assert against_unigram(7.492, 6.174, "token") == (
        "held-out loss 7.492 nats/token vs token-unigram entropy 6.174 (1.318 above: not yet 1 nat/token "
        "below it)")
    assert against_unigram(5.0, 6.174, "byte") == (
        "held-out loss 5.000 nats/byte vs byte-unigram entropy 6.174 (1.174 below: learned)")
    assert against_unigram(5.5, 6.174, "token").endswith("(0.674 below: not yet 1 nat/token below it)")


def test_train_writes_its_files_and_resume_continues_exactly(text, tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert cli.main(["train", "--steps", "4", "--out", a, "--data", text, *TINY]) == 0
    printed = capsys.readouterr().out
    assert f"run directory: {os.path.abspath(a)}" in printed
    # the default tokenizer: a BPE fitted to the corpus, saved with the run (a rerun fits the same one)
    assert "token-unigram entropy" in printed and "sample:" in printed
    # 4 steps leave the loss above the unigram entropy: the line says "above" with a positive gap
    line = re.search(r"held-out loss ([\d.]+) nats/token vs token-unigram entropy ([\d.]+) "
                     r"\(([\d.]+) (below|above): ", printed)
    assert line, printed
    loss, entropy, gap = (float(line.group(i)) for i in (1, 2, 3))
    assert line.group(4) == ("below" if loss <= entropy else "above")
    assert gap == pytest.approx(abs(entropy - loss), abs=2e-3)
    assert os.path.exists(os.path.join(a, "tokenizer", "tokenizer.json"))
    for f in ("checkpoint/latest", "checkpoint/step-000004/index.json", "metrics.jsonl", "summary.json"):
        assert os.path.exists(os.path.join(a, f)), f
    m = _metrics(a)
    assert [r["step"] for r in m] == [2, 4]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in m)
    summary = json.load(open(os.path.join(a, "summary.json")))
    assert summary["heldout_loss"] > 0 and 0 < summary["unigram_entropy"] < 6
    # the run records how its parameters' collectives ran: overlapped and resharded, the defaults
    assert (summary["overlap"], summary["reshard_after_forward"]) == (True, True)

    # the uninterrupted run vs 4 steps + resume for 4 more (on another mesh layout of the batch)
    assert cli.main(["train", "--steps", "8", "--out", b, "--data", text, *TINY]) == 0
    assert cli.main(["train", "--steps", "8", "--resume", a, "--data", text, *TINY]) == 0
    full, resumed = _metrics(b), _metrics(a)
    assert [r["step"] for r in resumed] == [2, 4, 6, 8]
    for x, y in zip(full, resumed):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (x, y)
    assert "resumed from" in capsys.readouterr().out
    # --steps is the total: the resumed run's checkpoint says step 8 and holds the 8-step run's weights
    assert read_index(os.path.join(a, "checkpoint"))["step"] == 8
    assert_same_bits(checkpoint_tensors(a), checkpoint_tensors(b))

    assert cli.main(["generate", "--checkpoint", a, "--prompt", "def ", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def")
    # a BPE's words carry their leading space: the prompt's trailing space is left to the model
    from meshtorch.recipes.lm.generate import checkpoint_dir, prompt_ids, run_tokenizer

    tok = run_tokenizer(checkpoint_dir(a))
    assert tok.decode(prompt_ids(tok, "def ")) == "def" and tok.decode(tok.encode("def ")) == "def "
    # beam search: the same best continuation on one processor and with the vocabulary split
    from meshtorch.recipes.lm.generate import generate_from_checkpoint

    assert cli.main(["generate", "--checkpoint", a, "--prompt", "def ", "--tokens", "4", "--beams", "3"]) == 0
    beamed = capsys.readouterr().out
    assert beamed == generate_from_checkpoint(a, "def ", 4, beams=3, mesh="m:2", rules="vocab:m") + "\n"


def test_resume_with_fewer_steps_than_the_checkpoint_is_an_error(text, tmp_path, capsys):
    a = str(tmp_path / "a")
    run = ["train", "--data", text, *TINY]
    assert cli.main([*run, "--steps", "3", "--out", a]) == 0
    before = sorted(os.listdir(os.path.join(a, "checkpoint")))
    capsys.readouterr()
    assert cli.main([*run, "--steps", "2", "--resume", a]) == 2
    assert re.search(r"--steps 2 is less than step 3 of the checkpoint in --resume .*total number of steps.*"
                     r"pass --steps 3 or more \(e.g. --steps 5 to train 2 more", capsys.readouterr().err)
    with pytest.raises(ArgumentError, match="--steps 1 is less than step 3"):
        train(TrainConfig.of(steps=1, resume=a, data=text))
    # resuming to the step the checkpoint holds trains nothing and writes no relabelled copy of it
    assert cli.main([*run, "--steps", "3", "--resume", a]) == 0
    assert sorted(os.listdir(os.path.join(a, "checkpoint"))) == before == ["latest", "step-000003"]
    assert read_index(os.path.join(a, "checkpoint"))["step"] == 3


@pytest.mark.parametrize("flags, needle", [
    (["--mesh", "b:2,m:2", "--rules", "batch:b; heads:m", "--heads", "3"], "--heads"),
    (["--mesh", "b:2", "--rules", "batch:x"], "axis 'x'"),
    (["--rules", "bach:b"], "'bach'"),
    (["--batch", "3"], "--batch"),
    (["--model", "gpt"], "--model"),
    (["--activation", "tanh"], "--activation: invalid choice: 'tanh'"),
    (["--keep", "0"], "--keep 0 is out of range: it must be >= 1"),
])
def test_invalid_flags_fail_before_training(flags, needle, capsys, tmp_path):
    assert cli.main(["train", "--out", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("argv, usage, hint", [
    (["train", "--batchsize", "4"], "usage: meshtorch train ", "--batchsize 4 (did you mean --batch?)"),
    (["plan", "--vocab", "64", "--layred"], "usage: meshtorch plan ", "--layred (did you mean --layered?)"),
    (["plan", "--layer", "2"], "usage: meshtorch plan ",
     "ambiguous option: --layer could match --layers, --layered"),
    (["place", "g.json", "--devics=2", "extra"], "usage: meshtorch place ",
     "arguments: --devics=2 extra (did you mean --devices?)"),
    (["train", "--zzz"], "usage: meshtorch train ", "unrecognized arguments: --zzz\n"),
    # a mistyped required option: argparse said only that --checkpoint was missing, which the user
    # believes they gave
    (["export", "--checkpont", "run", "--out", "x"], "usage: meshtorch export ",
     "required: --checkpoint; unrecognized arguments: --checkpont (did you mean --checkpoint?)"),
    (["generate", "--checkpont=run"], "usage: meshtorch generate ",
     "unrecognized arguments: --checkpont (did you mean --checkpoint?)"),
    # another command's option is named as that command's, not matched to an unrelated one of this
    # command's by shared letters (seen: --search "did you mean --batch?", --steps "--tokens?")
    (["train", "--search"], "usage: meshtorch train ",
     "unrecognized arguments: --search (--search is an option of meshtorch plan)\n"),
    (["generate", "--checkpoint", "c", "--steps", "3"], "usage: meshtorch generate ",
     "unrecognized arguments: --steps 3 (--steps is an option of meshtorch train and plan)\n"),
    (["launch", "--mesh2", "b:2", "x.py", "--lr", "3"], "usage: meshtorch launch ",
     "required: --mesh; unrecognized arguments: --mesh2 (did you mean --mesh?)\n"),
    # main() registers only the command being run (place needs no torch): the others are read on error
    (["place", "g.json", "--hardware", "l4"], "usage: meshtorch place ",
     "unrecognized arguments: --hardware l4 (--hardware is an option of meshtorch plan)\n"),
    (["train", "--nproc-per-node", "2"], "usage: meshtorch train ",
     "unrecognized arguments: --nproc-per-node 2 (--nproc-per-node is an option of meshtorch launch)\n"),
])
def test_a_mistyped_argument_shows_the_commands_usage_and_the_close_option(argv, usage, hint, capsys):
    """Seen: `meshtorch train --batchsize 4` printed `usage: meshtorch [-h] COMMAND ...`, which lists no
    option of train's, and named none of them."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and hint in err, err
    assert f"meshtorch {argv[0]}: error: " in err, err


def test_the_option_hints_need_no_private_argparse_table():
    """The hints read argparse's private option table (Python 3.10 to 3.14); without it the options are
    read from the help, the same ones for every parser of the CLI, and the hints are the same."""
    from meshtorch.cli import _did_you_mean, _long_options, build_parser

    parser = build_parser()
    commands = dict(parser.commands.choices)
    with_table = {name: set(_long_options(p)) for name, p in commands.items()}
    assert {"--batch", "--layered", "--hardware", "--help"} <= with_table["plan"]
    hint_of = {"place": ["--devics=2"], "train": ["--batchsize", "4", "--search"]}
    hints = {name: _did_you_mean(commands[name], argv, {n: p for n, p in commands.items() if n != name})
             for name, argv in hint_of.items()}
    assert hints == {"place": " (did you mean --devices?)",
                     "train": " (did you mean --batch?; --search is an option of meshtorch plan)"}
    for p in commands.values():
        del p._option_string_actions  # an instance attribute: as on a Python without it
    assert {name: set(_long_options(p)) for name, p in commands.items()} == with_table
    assert {name: _did_you_mean(commands[name], argv, {n: p for n, p in commands.items() if n != name})
            for name, argv in hint_of.items()} == hints


def test_a_command_whose_module_cannot_be_imported_gives_no_hint(monkeypatch, capsys):
    """The other commands are imported only for an error's hint: one that cannot be is left out of it,
    and the error is still argparse's, not an ImportError."""
    monkeypatch.setitem(cli.SUBCOMMANDS, "gone", "meshtorch.no_such_module")
    assert cli.main(["place", "g.json", "--hardware", "l4", "--devics", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--hardware l4 --devics 2 (did you mean --devices?; --hardware is an option of meshtorch plan)")


def test_mesh_size_must_match_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(Exception, match="3 processes"):
        train(TrainConfig.of(mesh="b:2"))


def test_config_file_is_overridden_by_flags(tmp_path):
    import argparse

    from meshtorch.recipes.lm.cli import config_from_args, register

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[train]\nsteps = 7\nlr = 0.5\nrules = "batch:b; vocab:b"\n')
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    cfg = config_from_args(p.parse_args(["train", "--config", str(cfg_file), "--lr", "0.1"]))
    assert (cfg.run.steps, cfg.optimizer.lr, cfg.parallelism.rules) == (7, 0.1, "batch:b; vocab:b")
    # the learning-rate schedule is lr_schedule / --lr-schedule; schedule is the pipeline's
    cfg_file.write_text('lr_schedule = "constant"\nschedule = "2bw"\n')
    cfg = config_from_args(p.parse_args(["train", "--config", str(cfg_file)]))
    assert (cfg.optimizer.lr_schedule, cfg.parallelism.schedule) == ("constant", "2bw")
    cfg = config_from_args(p.parse_args(["train", "--lr-schedule", "cosine", "--schedule", "gpipe"]))
    assert (cfg.optimizer.lr_schedule, cfg.parallelism.schedule) == ("cosine", "gpipe")
    cfg_file.write_text("stepz = 1\n")
    with pytest.raises(Exception, match="stepz"):
        config_from_args(p.parse_args(["train", "--config", str(cfg_file)]))


def test_reshard_after_forward_without_overlap_is_refused(tmp_path):
    """Seen: `--no-overlap --reshard-after-forward` ran the per-use path, which keeps every gathered
    parameter until backward, with nothing said; asked for explicitly (flag or file), it is refused.
    The default (on, with --overlap) is no request and stays silent under --no-overlap."""
    import argparse

    from meshtorch.recipes.lm.cli import config_from_args, register

    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("overlap = false\nreshard_after_forward = true\n")
    for argv in (["--no-overlap", "--reshard-after-forward"], ["--config", str(cfg_file)]):
        with pytest.raises(ArgumentError, match="--reshard-after-forward .* with --no-overlap"):
            config_from_args(p.parse_args(["train", *argv]))
    assert config_from_args(p.parse_args(["train", "--no-overlap"])).parallelism.overlap is False


def test_model_options_are_the_transformer_config_fields(tmp_path):
    import argparse
    import dataclasses

    from meshtorch.models import TransformerConfig
    from meshtorch.recipes.lm.cli import config_from_args, register
    from meshtorch.recipes.lm.config import ModelSection

    train_fields = {f.name: f for f in dataclasses.fields(ModelSection)}
    for f in dataclasses.fields(TransformerConfig):
        if f.name in ("vocab", "max_length", "extra"):
            assert f.name not in train_fields, f.name
            continue
        assert train_fields[f.name].type == f.type, f.name
        want = {"encoder_layers": 2, "experts": 4}.get(f.name, f.default)
        assert train_fields[f.name].default == want, f.name
    # flags and TOML keys reach the model config; --model decides encoder/expert counts
    cfg_file = tmp_path / "m.toml"
    cfg_file.write_text('model = "moe"\nnorm = "rms"\nexperts = 8\nmoe_every = 1\n')
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    cfg = config_from_args(p.parse_args(["train", "--config", str(cfg_file), "--activation", "relu",
                                         "--d-model", "64", "--length", "32"]))
    m = cfg.model_config(vocab=264)
    assert (m.norm, m.activation, m.experts, m.moe_every, m.d_model, m.max_length, m.encoder_layers) == \
        ("rms", "relu", 8, 1, 64, 32, 0)
    assert TrainConfig.of(model="lm").model_config(264).experts == 0
    assert TrainConfig.of(model="seq2seq").model_config(264).encoder_layers == 2


@pytest.mark.parametrize("model, rules, key", [("moe", "batch:b; experts:b", "unigram_entropy"),
                                               ("seq2seq", "batch:b", "heldout_accuracy")])
def test_moe_and_seq2seq_runs(model, rules, key, text, tmp_path):
    out = str(tmp_path / model)
    # an MoE model of 2 blocks: the second (--moe-every 2) is its expert layer
    deep = ["--layers", "2"] if model == "moe" else []
    assert cli.main(["train", "--model", model, "--steps", "2", "--rules", rules, "--out", out,
                     "--data", text, *TINY, *deep]) == 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert key in summary and summary["heldout_loss"] > 0
    if model == "seq2seq":  # --eval-batches 1 of --batch 4 numbers
        assert summary["heldout_numbers"] == 4 and 0 <= summary["heldout_accuracy"] <= 1
    assert [r["step"] for r in _metrics(out)] == [2]


def test_resume_drops_a_metrics_record_cut_short_and_names_a_malformed_one(tmp_path):
    from meshtorch.errors import MeshTorchError
    from meshtorch.recipes.lm.run_files import earlier_metrics

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 5.0 - s} for s in (2, 4, 6)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    cfg = TrainConfig.of(resume=str(run))
    # a crash while the step-8 record was written: its line has no end
    (run / "metrics.jsonl").write_text(text + '{"step": 8, "lo')
    assert earlier_metrics(cfg, str(tmp_path / "out"), start=4) == records[:2]
    assert earlier_metrics(cfg, str(tmp_path / "out"), start=6) == records
    (run / "metrics.jsonl").write_text(text.replace('"step": 4', '"step": 4,,', 1))
    with pytest.raises(MeshTorchError, match=r"metrics.jsonl line 2 is not a JSON record"):
        earlier_metrics(cfg, str(tmp_path / "out"), start=6)
    (run / "metrics.jsonl").write_text(text + '{"loss": 1}\n')
    with pytest.raises(MeshTorchError, match=r"line 4 is not a metrics record with an integer 'step'"):
        earlier_metrics(cfg, str(tmp_path / "out"), start=6)


def _train_counting_fits(cfg, sample):
    """One torchrun-like process (RANK/WORLD_SIZE set, gloo world joined): ``meshtorch train``'s own
    code path, counting the BPE fits this process runs and recording the ids its tokenizer gives."""
    import meshtorch.data.hf_tokenizer as hf
    import meshtorch.recipes.lm.trainer as trainer

    fits, ids, fit, tokenizer_of = [], [], hf.train_bpe, trainer.tokenizer_of

    def counted(*a, **k):
        fits.append(1)
        return fit(*a, **k)

    def recorded(c):
        tok = tokenizer_of(c)
        ids.append(tok.encode(sample))
        return tok

    hf.train_bpe, trainer.tokenizer_of = counted, recorded
    try:
        result = train(cfg)
    finally:
        hf.train_bpe, trainer.tokenizer_of = fit, tokenizer_of
    return len(fits), ids, result["final_loss"]


@pytest.mark.timeout(180)
def test_torchrun_processes_fit_the_tokenizer_once_and_share_its_ids(text, tmp_path):
    """Under torchrun every process runs ``train``: processor 0 alone fits and writes the BPE, the
    other reads that file, and both encode with the same ids (before, each fitted its own and wrote
    the same file at once)."""
    import meshtorch as mt
    from meshtorch.data.hf_tokenizer import HFTokenizer

    out = str(tmp_path / "run")
    cfg = TrainConfig.of(backend="torch", steps=2, data=text, out=out, tokenizer="bpe:300",
                         memory_check=False, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4,
                         length=16, eval_batches=1, sample_tokens=4, log_every=1, progress=False)
    sample = "def f3_7(x):\n    return x + 7\n"
    per_proc = mt.launch(_train_counting_fits, cfg, sample, mesh="b:2", backend="torch", nprocs=2)
    assert [fits for fits, _, _ in per_proc] == [1, 0]
    want = HFTokenizer(os.path.join(out, "tokenizer")).encode(sample)  # the file as left, read afresh
    assert len(want) < len(sample)  # merges were fitted: not one id per byte
    for _, ids, loss in per_proc:
        assert ids and all(i == want for i in ids)
        assert loss == per_proc[0][2]
    assert sorted(f for f in os.listdir(os.path.join(out, "tokenizer"))) == ["tokenizer.json",
                                                                            "tokenizer_config.json"]


def test_overlap_is_on_by_default_and_no_overlap_turns_it_off():
    import argparse

    from meshtorch.recipes.lm.flags import add_train_flags, config_from_args
    from meshtorch.recipes.lm.strategies import overlaps

    p = argparse.ArgumentParser()
    add_train_flags(p)
    default = config_from_args(p.parse_args([]))
    assert overlaps(default) and default.parallelism.reshard_after_forward
    off = config_from_args(p.parse_args(["--no-overlap"]))
    assert not overlaps(off)
    keep = config_from_args(p.parse_args(["--no-reshard-after-forward"]))
    assert overlaps(keep) and not keep.parallelism.reshard_after_forward
    assert not overlaps(config_from_args(p.parse_args(["--compile"])))  # a compiled graph schedules them
