"""The ``meshtorch`` command as a user runs it, each test a case that once went wrong: ``generate`` past
the model's context and its flags' errors."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch import cli
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
    assert "12 of --tokens 100 generated: the model's context ends there" in err
    # a beam of one is greedy, to the same length
    assert cli.main(["generate", "--checkpoint", run, "--prompt", "def ", "--tokens", "100",
                     "--beams", "1"]) == 0
    assert capsys.readouterr().out == out
    # asked for no more than the context holds: nothing said
    assert cli.main(["generate", "--checkpoint", run, "--tokens", "3", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == _greedy(run, "def ", 3) + "\n" and err == ""


def test_a_prompt_longer_than_the_context_is_refused_naming_prompt(run, capsys):
    """Seen: the prompt came back alone, exit status 0."""
    assert cli.main(["generate", "--checkpoint", run, "--prompt", "x" * 16]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--prompt is 16 tokens (plus the end-of-text token that starts it), more than the " \
        "model's context of 16 positions holds (its run's --length): shorten it to at most 15 tokens" in err
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
