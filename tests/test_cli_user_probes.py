"""The ``meshtorch`` command as a user runs it, each test a case that once went wrong: ``generate`` past
the model's context, its flags' errors, a resume with another ``--length``, pipeline and MoE flags that
cannot work together, ``--tokenizer bpe:0``, and a reader of the output that goes away (``| head``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import meshtorch as mt
from meshtorch import cli
from meshtorch.errors import ArgumentError, PipelineError
from meshtorch.recipes.lm import TrainConfig, check_config
from run_harness import tiny_train, write_corpus

# learned positions over --length 16: the model's context is 16 positions
TINY = tiny_train(tokenizer="bytes", sample_tokens=4, log_every=2)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), files=4)


@pytest.fixture(scope="module")
def run(text, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs") / "two")
    assert cli.main(["train", "--steps", "2", "--out", out, "--data", text, *TINY]) == 0
    return out


def _greedy(out: str, prompt: str, n: int) -> str:
    """``prompt`` and ``n`` greedy tokens by calling the run's model on the whole sequence each time
    (no cache), on one processor: the reference ``meshtorch generate --temperature 0`` must equal."""
    from meshtorch.recipes.lm.generate import checkpoint_dir, load_lm, prompt_ids, run_tokenizer

    tok = run_tokenizer(checkpoint_dir(out))

    def prog():
        model = load_lm(out).eval()
        ids = prompt_ids(tok, prompt)
        for _ in range(n):
            x = mt.from_global(torch.tensor([ids]), f"batch:1,length:{len(ids)}")
            with torch.no_grad():
                ids.append(int(model(x).to_global()[0, -1, :tok.sample_limit].argmax()))
        return tok.decode(ids)

    return mt.launch(prog)[0]


def test_generate_fills_the_context_equals_a_direct_model_call_and_says_it_stopped_short(run, capsys):
    """Seen: ``--tokens 100`` on a --length 16 run printed 11 tokens and nothing else; a model of 16
    positions continues the 5 of "def " (end-of-text + 4 bytes) by 12, the last from all 16."""
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", run, "--prompt", "def ", "--tokens", "100",
                     "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == _greedy(run, "def ", 12) + "\n"
    assert "12 of --tokens 100 generated: the model's context ends there (max_length: the run's --length, " \
        "or config.json's for --init-from; prompt included)" in err
    # a beam of one is greedy, to the same length
    assert cli.main(["generate", "--checkpoint", run, "--prompt", "def ", "--tokens", "100",
                     "--beams", "1"]) == 0
    assert capsys.readouterr().out == out
    # asked for no more than the context holds: nothing said
    assert cli.main(["generate", "--checkpoint", run, "--tokens", "3", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == _greedy(run, "def ", 3) + "\n" and err == ""


def test_generate_checks_its_request_once(run, capsys, monkeypatch):
    """Seen (review16e): check_request (which reads the checkpoint's config and tokenizer) ran twice per
    ``meshtorch generate``: in the command, to say how many tokens it writes, and in
    generate_from_checkpoint. A library call still checks its request."""
    import meshtorch.recipes.lm.generate as gen

    calls, real = [], gen.check_request
    monkeypatch.setattr(gen, "check_request", lambda *a: calls.append(a) or real(*a))
    assert cli.main(["generate", "--checkpoint", run, "--tokens", "3", "--temperature", "0"]) == 0
    assert len(calls) == 1 and capsys.readouterr().out == _greedy(run, "def ", 3) + "\n"
    with pytest.raises(ArgumentError, match="--tokens -1 is out of range"):
        gen.generate_from_checkpoint(run, "def ", max_new_tokens=-1)


def test_a_prompt_longer_than_the_context_is_refused_naming_prompt(run, capsys):
    """Seen: the prompt came back alone, exit status 0."""
    assert cli.main(["generate", "--checkpoint", run, "--prompt", "x" * 16]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--prompt is 16 tokens (plus the end-of-text token that starts it), more than the " \
        "model's context of 16 positions holds (max_length: the run's --length, or config.json's for " \
        "--init-from): shorten it to at most 15 tokens" in err
    assert cli.main(["generate", "--checkpoint", run, "--prompt", "x" * 15, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "x" * 15 + _greedy(run, "x" * 15, 1)[15:] + "\n"


@pytest.mark.parametrize("flag, value, needle", [
    ("--tokens", "-1", "--tokens -1 is out of range: it must be a whole number >= 0"),
    ("--top-k", "-1", "--top-k -1 is out of range"),
    ("--beams", "-2", "--beams -2 is out of range"),
    ("--temperature", "-1", "--temperature -1.0 is out of range: it must be >= 0 (0: greedy)"),
    ("--temperature", "nan", "--temperature nan is out of range"),
    ("--beams", "100000", "--beams 100000 exceeds the 259 tokens the model may emit: pass --beams 259 or "
                          "fewer"),
])
def test_generate_names_the_flag_out_of_range(run, capsys, flag, value, needle):
    """Seen: 'processor 0 {} raised ArgumentError: generate: temperature=0.8 must be >= 0 (0: greedy),
    top_k=40 >= 0 (0: all) and max_new_tokens=-1 >= 0', naming the function's arguments."""
    assert cli.main(["generate", "--checkpoint", run, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshtorch generate: error: {needle}"), err


def test_resume_with_another_length_of_a_learned_position_table_is_refused_naming_length(run, tmp_path,
                                                                                          capsys, text):
    """Seen: 'processor 0 {'b': 0} raised CheckpointError: tensor 'model/decoder.pos.table' has shape
    [positions:8,d_model:16] here but [positions:16,d_model:16] in ...; build the model with the saved
    dims'. --length sizes the learned position table."""
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    assert cli.main(["train", "--steps", "4", "--resume", copy, "--data", text, *TINY, "--length", "8"]) == 2
    err = capsys.readouterr().err
    assert "--length 8 (the run has 16). Pass --length 16 to continue the run as it was; --length would " \
        "give the model other parameters than the run's checkpoint holds" in err, err
    assert os.listdir(os.path.join(copy, "checkpoint")) == os.listdir(os.path.join(run, "checkpoint"))
    # rotary positions have no table: another --length resumes the same parameters
    from meshtorch.recipes.lm.run_files import model_changes

    for positions, changes in (("learned", [("length", 16, 8)]), ("rotary", [])):
        base = dict(positions=positions, length=16, resume=copy)
        record = {"model": "lm", "model_config": TrainConfig.of(**base).model_config(264).to_dict(),
                  "train_config": TrainConfig.of(**base).options()}
        assert model_changes(TrainConfig.of(**{**base, "length": 8}), record) == changes
    # the table has at least 8 positions: --length 4 and 8 make the same one
    base = dict(length=8, resume=copy)
    record = {"model": "lm", "model_config": TrainConfig.of(**base).model_config(264).to_dict()}
    assert model_changes(TrainConfig.of(**{**base, "length": 4}), record) == []


def test_runs_whose_table_length_is_not_length_resume_with_their_own_flags(text, tmp_path, capsys):
    """Seen (review16e): the --length check refused to resume a default ``--model seq2seq`` run and a
    GPT-2 ``--init-from`` fine-tune given their own flags ('--length 16 (the run has 16)'): their
    max_length is the spelling task's and config.json's (32 positions here), not --length's."""
    from meshtorch.models import DecoderLM, TransformerConfig, export_hf

    gpt2 = tmp_path / "gpt2"
    cfg = TransformerConfig(vocab=300, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=32,
                            bias=True)
    mt.launch(lambda: export_hf(gpt2, DecoderLM(cfg, seed=1)))
    assert json.loads((gpt2 / "config.json").read_text())["n_positions"] == 32
    small = tiny_train(tokenizer="bytes", sample_tokens=0, d_model=None, heads=None, d_kv=None, d_ff=None,
                       layers=None)
    for name, flags in (("s2s", [*TINY, "--model", "seq2seq"]),
                        ("gpt2", [*small, "--init-from", str(gpt2)])):
        out = str(tmp_path / name)
        assert cli.main(["train", "--steps", "2", "--out", out, "--data", text, *flags]) == 0
        assert cli.main(["train", "--steps", "3", "--resume", out, "--data", text, *flags]) == 0, \
            capsys.readouterr().err
        assert json.load(open(os.path.join(out, "summary.json")))["steps"] == 3


def test_pipeline_micro_batches_that_do_not_divide_a_processors_rows_are_refused_up_front(tmp_path, capsys,
                                                                                          text):
    """Seen: the run started, then stopped with 'processor 2 {'stage': 1, 'b': 0} raised PipelineError:
    dim 'batch' has 2 entries per processor, not divisible into 4 micro-batches' (meshtorch plan too)."""
    out = tmp_path / "piped"
    flags = [*TINY, "--layers", "2", "--pipeline-stages", "2", "--microbatches", "4"]  # --batch 4 over b:2
    want = ("--batch 4 split over 2 processors by --rules gives each processor 2 sequences, which "
            "--microbatches 4 does not divide; pass --microbatches 2 (a divisor of 2), or --batch a multiple "
            "of 8")
    assert cli.main(["train", "--steps", "2", "--out", str(out), "--data", text, *flags]) == 2
    assert want in capsys.readouterr().err and not out.exists()
    assert cli.main(["plan", *flags]) == 2
    assert want in capsys.readouterr().err


@pytest.mark.parametrize("batch, microbatches, hint", [
    (12, 4, "pass --microbatches 2 (a divisor of 6 and a multiple of --pipeline-stages 2), or --batch a "
            "multiple of 8"),
    (6, 2, "pass --batch a multiple of 4"),  # no even divisor of 3: only --batch
])
def test_the_micro_batch_hint_under_interleaved_is_one_the_checks_accept(batch, microbatches, hint):
    """Seen (review16e): under --schedule interleaved the hint said '--microbatches 3 (a divisor of 6)',
    which the next check refused: interleaved takes a multiple of --pipeline-stages."""
    import re

    base = dict(d_model=16, heads=2, d_kv=8, d_ff=32, layers=4, length=16, pipeline_stages=2,
                virtual_stages=2, schedule="interleaved")
    with pytest.raises(PipelineError) as e:
        check_config(TrainConfig.of(**base, batch=batch, microbatches=microbatches))
    assert hint in str(e.value), str(e.value)
    for flag, value in re.findall(r"--(microbatches|batch) (?:a multiple of )?(\d+)", hint):
        given = {"batch": batch, "microbatches": microbatches, flag: int(value)}
        check_config(TrainConfig.of(**base, **given))


def test_an_moe_model_without_an_moe_layer_is_refused():
    """Seen: --model moe --layers 1 trained a dense LM (7,648 parameters, as --model lm) with the rule
    'experts:b' accepted: under --moe-every 2 only the second block has experts."""
    with pytest.raises(ArgumentError, match="--model moe with --layers 1 has no MoE layer: under "
                       "--moe-every 2 the blocks 2, 4, ... are; pass --layers 2 or more, or --moe-every 1"):
        check_config(TrainConfig.of(model="moe", layers=1, rules="batch:b; experts:b"))
    check_config(TrainConfig.of(model="moe", layers=1, moe_every=1, rules="batch:b; experts:b"))


def test_a_bpe_below_its_least_size_names_tokenizer(capsys):
    """Seen: 'TransformerConfig.vocab must be >= 1, got 0' for --tokenizer bpe:0 (bpe:100 named the flag)."""
    assert cli.main(["plan", "--tokenizer", "bpe:0"]) == 2
    assert "error: --tokenizer 'bpe:0': give the BPE's number of ids, at least 260" in capsys.readouterr().err


class _Head:
    """Standard output read by ``head -1``: the first line, then the pipe is closed."""

    def __init__(self):
        self.text = ""

    def write(self, s: str) -> int:
        if "\n" in self.text:
            raise BrokenPipeError(32, "Broken pipe")
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_a_reader_that_goes_away_costs_the_run_nothing(text, tmp_path, monkeypatch, capsys):
    """Seen: ``meshtorch train ... | head -1`` ended with 'processor 0 {'b': 0} raised BrokenPipeError'
    at the held-out line, after the checkpoint but before summary.json and loss.png."""
    head = _Head()
    monkeypatch.setattr("sys.stdout", head)
    out = str(tmp_path / "run")
    assert cli.main(["train", "--steps", "2", "--out", out, "--data", text, *TINY]) == 0
    assert head.text.startswith("model lm: ") and head.text.count("\n") == 1
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == 2 and summary["heldout_loss"] > 0
    assert os.path.exists(os.path.join(out, "loss.png")) == summary["loss_png"]
    monkeypatch.undo()
    assert capsys.readouterr().err == ""


def _without_reader(argv: list[str], unbuffered: bool,
                    stderr_too: bool = False) -> subprocess.CompletedProcess:
    """``meshtorch ARGV | head -0`` (``2>&1 | head -0`` with ``stderr_too``): the command's standard
    output is a pipe whose reader has gone before the first line, as a real ``head`` leaves one.
    PYTHONUNBUFFERED set (``unbuffered``) makes each line fail as it is written; unset, as in most
    users' shells, lines wait in the buffers until a flush or the exit."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update({"PYTHONUNBUFFERED": "1"} if unbuffered else {})
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "meshtorch", *argv], stdout=write, timeout=240, env=env,
                              stderr=write if stderr_too else subprocess.PIPE, text=True)
    finally:
        os.close(write)


@pytest.mark.parametrize("unbuffered", [True, False])
@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_a_pipe_whose_reader_left_costs_the_run_nothing_on_either_backend(backend, unbuffered, text,
                                                                          tmp_path):
    """Seen (review16e): ``meshtorch train --backend torch ... | head -1`` still ended with 'processor 0
    {'b': 0} raised BrokenPipeError' (the processors it spawns wrote to the pipe unwrapped); on the
    threads backend, lines still buffered when the reader left (PYTHONUNBUFFERED unset) failed the
    exit with status 120."""
    out = str(tmp_path / backend)
    argv = ["train", "--steps", "2", "--out", out, "--data", text, *TINY, "--backend", backend]
    done = _without_reader(argv, unbuffered)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert json.load(open(os.path.join(out, "summary.json")))["steps"] == 2


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_pipe_of_both_streams_whose_reader_left_costs_the_command_nothing(run, unbuffered):
    """``meshtorch generate ... 2>&1 | head``: the note past the context goes to stderr, the same pipe,
    whose reader has gone: dropped as the text is, not a BrokenPipeError."""
    done = _without_reader(["generate", "--checkpoint", run, "--tokens", "100", "--temperature", "0"],
                           unbuffered, stderr_too=True)
    assert done.returncode == 0


def test_generate_reads_one_version_of_a_runs_checkpoint(text, tmp_path, capsys):
    """Seen: ``--checkpoint RUN/checkpoint/step-000002`` (an older version, which ``--keep`` keeps) said
    the run's BPE tokenizer 'is gone' from RUN/checkpoint/tokenizer: it is in RUN/tokenizer."""
    out = str(tmp_path / "bpe")
    assert cli.main(["train", "--steps", "4", "--checkpoint-every", "2", "--out", out, "--data", text,
                     *tiny_train(tokenizer="bpe:300", sample_tokens=0, log_every=2)]) == 0
    capsys.readouterr()
    older = os.path.join(out, "checkpoint", "step-000002")
    assert cli.main(["generate", "--checkpoint", older, "--tokens", "3", "--temperature", "0"]) == 0
    got = capsys.readouterr().out
    assert got == _greedy(older, "def ", 3) + "\n"


def test_resume_names_the_training_options_that_differ_from_the_runs(run, text, tmp_path, capsys):
    """Seen: a run of --lr 0.01 --batch 8 resumed without those flags trained on with the defaults (lr
    0.003 on a cosine schedule, batch 16) and said only 'resumed from ... at step 2'. They may change;
    the line now names them (each flag left out takes its default, not the run's)."""
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    capsys.readouterr()
    assert cli.main(["train", "--steps", "3", "--resume", copy, "--data", os.path.join(text, "."), *TINY,
                     "--batch", "8", "--lr", "0.01"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line == (f"resumed from {copy} at step 2; options other than the run's, in effect from here: "
                    "--lr 0.01 (the run had 0.003), --batch 8 (the run had 4)")
    # the record is what ran: resumed again with the same flags, nothing differs
    assert cli.main(["train", "--steps", "4", "--resume", copy, "--data", text, *TINY, "--batch", "8",
                     "--lr", "0.01"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"resumed from {copy} at step 3"
