"""``--resume`` never trains another model than the run's, the options it records are the ones in effect,
and ``--overwrite`` never loses what meshtorch did not write (issue 29)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from meshtorch.errors import ArgumentError
from meshtorch.recipes.lm import TrainConfig, train
from meshtorch.recipes.lm.run_files import recorded
from run_harness import assert_same_bits, checkpoint_tensors, write_corpus

pytestmark = pytest.mark.timeout(300)

TINY = dict(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=4, length=16, eval_batches=1,
            sample_tokens=4, log_every=1, warmup=0, lr_schedule="constant", progress=False,
            tokenizer="bytes", memory_check=False)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), 6)


@pytest.fixture(scope="module")
def run2(text, tmp_path_factory):
    """A 2-step run (GELU, learned positions); tests copy it before they change it."""
    out = str(tmp_path_factory.mktemp("runs") / "two")
    train(TrainConfig.of(steps=2, out=out, data=text, **TINY))
    return out


def _files(out: str) -> dict[str, bytes]:
    """Every file under ``out`` (but the lock) by its relative path: what a refused run must not touch."""
    found = {}
    for root, _, names in os.walk(out):
        for n in names:
            if n != ".lock":
                path = os.path.join(root, n)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, out)] = f.read()
    return found


@pytest.mark.parametrize("change, needle", [
    ({"activation": "relu"}, "--activation 'relu' (the run has 'gelu')"),
    ({"eps": 1e-6}, "--eps 1e-06 (the run has 1e-05)"),
    ({"rotary_base": 500.0}, "--rotary-base 500.0 (the run has 10000.0)"),
    # (an MoE model of one block needs --moe-every 1: it is refused without a block of experts)
    ({"model": "moe", "moe_every": 1}, "--model 'moe' (the run has 'lm')"),
    ({"bias": True, "gated": True}, "--bias True (the run has False); --gated True (the run has False)"),
])
def test_resume_refuses_a_model_change_that_keeps_the_shapes(change, needle, run2, text):
    before = _files(run2)
    with pytest.raises(ArgumentError) as e:
        train(TrainConfig.of(steps=4, resume=run2, data=text, **{**TINY, **change}))
    msg = str(e.value)
    assert needle in msg, msg
    names = ",".join(k for k in change)
    if "model" in change:  # the kind alone: its experts follow from it and are not "changes" to undo
        assert "--experts" not in msg and "Pass --model lm --moe-every 2 to continue" in msg, msg
        # its block of experts holds parameters the checkpoint lacks
        assert "--model would give the model other parameters" in msg, msg
    elif "gated" in change:  # booleans are named as their flags
        assert "Pass --no-bias --no-gated to continue" in msg, msg
        # a bias and a second input projection are parameters the checkpoint lacks: --allow-change
        # cannot resume them, so the error does not offer it
        assert "to change it on purpose" not in msg, msg
        assert "--bias, --gated would give the model other parameters than the run's checkpoint" in msg, msg
    else:
        assert f"--allow-change {names} to change it on purpose" in msg, msg
    assert _files(run2) == before  # refused before anything was written


# the options that give each kind of model other parameters (a one-layer run's MoE has no MoE layer)
RESHAPING = {"d_model", "heads", "d_kv", "d_ff", "layers", "kv_heads", "gated", "bias", "norm", "positions",
             "tie_embeddings"}


def test_a_change_of_the_parameters_is_refused_even_when_allowed(run2, text):
    """Seen: the error for --d-model 64 said '--allow-change d_model to change it on purpose', which
    then failed loading the checkpoint ('has shape [vocab:264,d_model:64] here but ...')."""
    for change in ({"d_model": 32}, {"layers": 2}, {"positions": "rotary"}):
        (name,) = change
        with pytest.raises(ArgumentError) as e:
            train(TrainConfig.of(steps=4, resume=run2, data=text, allow_change=name, **{**TINY, **change}))
        msg = str(e.value)
        assert f"--{name.replace('_', '-')} would give the model other parameters" in msg, msg
        assert "to change it on purpose" not in msg and "another --out" in msg, msg


def test_the_changes_are_told_apart_in_one_planning_launch(monkeypatch):
    """Which changed options reshape the parameters is found by building the run's model and each
    changed one on the meta backend: one launch for all of them (each launch starts a thread and a
    communicator), with the message naming each option as before."""
    import meshtorch.launcher
    from meshtorch.recipes.lm.run_files import check_resumed_model

    base = dict(d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, length=16, resume="/r")
    record = {"model": "lm", "model_config": TrainConfig.of(**base).model_config(264).to_dict()}
    launches = []
    real = meshtorch.launcher.launch
    monkeypatch.setattr(meshtorch.launcher, "launch", lambda *a, **k: launches.append(k) or real(*a, **k))
    cfg = TrainConfig.of(**{**base, "d_model": 32, "layers": 3, "activation": "relu", "eps": 1e-3},
                         allow_change="d_model,layers,activation,eps")
    with pytest.raises(ArgumentError) as e:
        check_resumed_model(cfg, record)
    assert launches == [{"mesh": "one:1", "backend": "meta"}]
    msg = str(e.value)
    assert "--d-model 32 (the run has 16); --layers 3 (the run has 2)." in msg, msg
    assert "--d-model, --layers would give the model other parameters" in msg, msg
    assert "--activation" not in msg and "--eps" not in msg, msg
    check_resumed_model(cfg.replace(d_model=16, layers=2), record)  # the shape-keeping ones, allowed


def _pasted(msg: str, base: dict) -> TrainConfig:
    """The options of ``base`` with the flags the error says to pass (and drop), as the shell and the
    command line take them: the hint pasted."""
    import argparse
    import shlex

    from meshtorch.recipes.lm.flags import add_train_flags, config_from_args

    hint = re.search(r"\. (Pass (.*?)(?: and drop (.*?))?|Drop (.*?)) to continue the run as it was", msg)
    assert hint, msg
    given, dropped = hint.group(2) or "", (hint.group(3) or hint.group(4) or "").split(", ")
    p = argparse.ArgumentParser()
    add_train_flags(p)
    args = p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in base.items()] + shlex.split(given))
    for flag in filter(None, dropped):
        setattr(args, flag[2:].replace("-", "_"), None)
    return config_from_args(args)


SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}


def test_a_rope_scaled_run_resumed_without_its_flags_names_them_as_a_shell_takes_them():
    """Seen (review16d): a --positions rotary --rope-scaling run resumed with neither flag raised
    TransformerConfig's own ShapeError ('rope_scaling=... rescales rotary positions, but
    positions='learned'') from building the changed model, hiding the resume guard's error; and the
    guard's hint spelled --rope-scaling as a Python dict, which the command line refuses as JSON."""
    from meshtorch.recipes.lm.run_files import check_resumed_model

    base = dict(d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, length=16, resume="/r")
    record = {"model": "lm", "model_config": TrainConfig.of(**base, positions="rotary", rope_scaling=SCALING)
              .model_config(264).to_dict()}
    for given in ({}, {"positions": "rotary"}):
        with pytest.raises(ArgumentError) as e:
            check_resumed_model(TrainConfig.of(**base, **given), record)
        msg = str(e.value)
        assert "--rope-scaling None (the run has" in msg, msg
        assert ("--positions would give the model other parameters" in msg) == ("positions" not in given), msg
        # the hint pasted gives the run's model back: that one resumes
        pasted = _pasted(msg, {**{k: v for k, v in base.items() if k != "resume"}, **given})
        assert pasted.model.rope_scaling == SCALING and pasted.model.positions == "rotary", msg
        check_resumed_model(pasted.replace(resume="/r"), record)
    # a run without scaling resumed with it: the hint says to drop the flag
    plain = {"model": "lm",
             "model_config": TrainConfig.of(**base, positions="rotary").model_config(264).to_dict()}
    with pytest.raises(ArgumentError) as e:
        check_resumed_model(TrainConfig.of(**base, positions="rotary", rope_scaling=SCALING), plain)
    msg = str(e.value)
    assert "Drop --rope-scaling to continue the run as it was, or --allow-change rope_scaling" in msg, msg
    pasted = _pasted(msg, {"positions": "rotary", "rope_scaling": json.dumps(SCALING),
                           **{k: v for k, v in base.items() if k != "resume"}})
    assert pasted.model.rope_scaling is None
    check_resumed_model(pasted.replace(resume="/r"), plain)
    # a learned run resumed as a scaled rotary one: --rope-scaling alone holds no parameter
    learned = {"model": "lm", "model_config": TrainConfig.of(**base).model_config(264).to_dict()}
    with pytest.raises(ArgumentError) as e:
        check_resumed_model(TrainConfig.of(**base, positions="rotary", rope_scaling=SCALING,
                                           allow_change="rope_scaling"), learned)
    msg = str(e.value)
    assert "; --positions would give the model other parameters" in msg, msg
    assert "Pass --positions learned and drop --rope-scaling" in msg, msg


def test_an_option_that_makes_no_model_alone_is_told_with_the_others_it_changes_with():
    """--heads 2 --kv-heads 2 resuming a --heads 4 --kv-heads 4 run: --heads 2 under the run's
    --kv-heads 4 is no model (kv_heads must divide heads); the guard's error, not that ShapeError."""
    from meshtorch.recipes.lm.run_files import check_resumed_model

    base = dict(d_model=16, heads=4, kv_heads=4, d_kv=8, d_ff=32, layers=1, length=16, resume="/r")
    record = {"model": "lm", "model_config": TrainConfig.of(**base).model_config(264).to_dict()}
    with pytest.raises(ArgumentError) as e:
        check_resumed_model(TrainConfig.of(**{**base, "heads": 2, "kv_heads": 2}), record)
    assert "--heads, --kv-heads would give the model other parameters" in str(e.value), str(e.value)


@pytest.mark.parametrize("kind", ["lm", "moe", "seq2seq"])
def test_every_model_field_is_compared_on_resume_but_those_that_compute_the_same_function(kind):
    """Each model option changed alone, against the record of a ``--model kind`` run (no training): every
    option that reaches the kind's TransformerConfig is refused naming its flag; dropout, the attention
    kernel and recomputation (the same function) never are. Over the three kinds, every option is seen."""
    import dataclasses

    from meshtorch.recipes.lm.config import ModelSection
    from meshtorch.recipes.lm.run_files import SAME_FUNCTION, check_resumed_model, model_changes

    base = dict(model=kind, d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, length=16, resume="/r")
    new = {"positions": "rotary", "norm": "rms", "activation": "relu", "top_k": 1, "dropout": 0.1,
           "attention": "gather", "padding_id": 3, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    others = {}
    for f in dataclasses.fields(ModelSection):
        old = getattr(TrainConfig.of(**base).model, f.name)
        value = new.get(f.name, (not old) if isinstance(old, bool) else old * 2 if old else 1)
        if f.name != "name" and not (f.name == "gated" and kind == "moe"):  # MoE experts are never gated
            others[f.name] = value
    for name, value in others.items():
        run = {**base, "positions": "rotary"} if name == "rope_scaling" else base  # it rescales rotary ones
        record = {"model": kind, "model_config": TrainConfig.of(**run).model_config(264).to_dict()}
        cfg = TrainConfig.of(**{**run, name: value})
        changed = [c[0] for c in model_changes(cfg, record)]
        relevant = {"encoder_layers": kind == "seq2seq", "experts": kind == "moe"}.get(name, True)
        if name in SAME_FUNCTION or not relevant:
            assert changed == [], (name, changed)
            check_resumed_model(cfg, record)
            continue
        assert changed == [name], (name, changed)
        with pytest.raises(ArgumentError, match=f"--{name.replace('_', '-')} "):
            check_resumed_model(cfg, record)
        own = {"lm": set(), "moe": {"experts", "moe_every"}, "seq2seq": {"encoder_layers"}}[kind]
        if name in RESHAPING | own:
            with pytest.raises(ArgumentError, match="would give the model other parameters"):
                check_resumed_model(cfg.replace(allow_change=name), record)
        else:
            check_resumed_model(cfg.replace(allow_change=name), record)
    assert set(SAME_FUNCTION) == {"dropout", "attention", "recompute"}


def test_allow_change_lets_the_named_field_change_and_records_it(run2, text, tmp_path):
    out = str(tmp_path / "relu")
    with pytest.raises(ArgumentError, match=r"--activation 'relu' \(the run has 'gelu'\)"):  # eps is not it
        train(TrainConfig.of(steps=3, resume=run2, out=out, data=text, allow_change="eps",
                             **{**TINY, "activation": "relu"}))
    with pytest.raises(ArgumentError, match=r"--allow-change 'steps' names \['steps'\], which are not model"):
        train(TrainConfig.of(steps=3, resume=run2, out=out, data=text, allow_change="steps", **TINY))
    train(TrainConfig.of(steps=3, resume=run2, out=out, data=text, allow_change="activation",
                         **{**TINY, "activation": "relu"}))
    rec = recorded(out)
    assert rec["model_config"]["activation"] == "relu" and rec["train_config"]["activation"] == "relu"
    # options that compute the same function are free: the attention kernel, recomputation, dropout
    train(TrainConfig.of(steps=3, resume=run2, out=str(tmp_path / "free"), data=text,
                         **{**TINY, "recompute": True, "attention": "gather", "dropout": 0.1}))


def test_resume_refuses_another_optimizer(run2, text):
    with pytest.raises(ArgumentError, match="--optimizer 'adafactor': --resume .* trained with --optimizer "
                       "'adamw'.*pass --optimizer adamw"):
        train(TrainConfig.of(steps=4, resume=run2, data=text, optimizer="adafactor", **TINY))


def _decay_groups(out: str) -> list[float]:
    from meshtorch.checkpoint.index import read_index

    groups = read_index(os.path.join(out, "checkpoint"))["optimizer"]["param_groups"]
    return [g["weight_decay"] for g in groups]


def test_weight_decay_given_on_resume_takes_effect_and_is_recorded(run2, text, tmp_path, capsys):
    assert _decay_groups(run2) == [0.01, 0.0]
    runs = {}
    for wd in (0.01, 0.5):
        out = str(tmp_path / f"wd{wd}")
        train(TrainConfig.of(steps=3, resume=run2, out=out, data=text, weight_decay=wd, **TINY))
        runs[wd] = checkpoint_tensors(out)
        assert _decay_groups(out) == [wd, 0.0]  # the optimizer's groups as given, not as loaded
        assert recorded(out)["train_config"]["weight_decay"] == wd
    assert "optimizer options now as given: weight_decay" in capsys.readouterr().out
    # the reference: AdamW's decoupled decay of step 3 alone, lr * wd * w, on the decayed weights
    # (the gradient part of the update is the same in both runs: same weights, batch and moments)
    base = checkpoint_tensors(run2)
    lr = TrainConfig().optimizer.lr
    name = "model/embed.table@0,0"
    want = runs[0.01][name] - lr * (0.5 - 0.01) * base[name]
    torch.testing.assert_close(runs[0.5][name], want, rtol=0, atol=1e-6)
    assert not torch.equal(runs[0.5][name], runs[0.01][name])
    bias = "model/decoder.ln_f.bias@0"  # in the group without decay: the same bits either way
    assert torch.equal(runs[0.5][bias], runs[0.01][bias])


def test_lr_given_on_resume_takes_effect_and_is_recorded(run2, text, tmp_path):
    """AdamW's step is linear in the learning rate (the decay and the moment-normalised gradient alike,
    from the same weights, batch and moments): a step resumed at --lr 3x moves each weight 3x as far."""
    lr = TrainConfig().optimizer.lr
    moved = {}
    for scale in (1, 3):
        out = str(tmp_path / f"lr{scale}")
        train(TrainConfig.of(steps=3, resume=run2, out=out, data=text, lr=lr * scale, **TINY))
        moved[scale] = checkpoint_tensors(out)
        assert recorded(out)["train_config"]["lr"] == lr * scale
        with open(os.path.join(out, "metrics.jsonl")) as f:
            assert json.loads(f.read().splitlines()[-1])["lr"] == lr * scale
    base = checkpoint_tensors(run2)
    name = "model/embed.table@0,0"
    torch.testing.assert_close(moved[3][name] - base[name], 3 * (moved[1][name] - base[name]), rtol=1e-3,
                               atol=1e-7)
    assert not torch.equal(moved[3][name], moved[1][name])


def _bpe(path, size: int = 300) -> str:
    from meshtorch.data.hf_tokenizer import train_bpe

    train_bpe([f"def f{i}(x):\n    return x + {i}\n" for i in range(40)], size, str(path))
    return str(path)


def test_the_tokenizer_is_kept_in_the_run_and_a_moved_run_resumes_from_its_copy(text, tmp_path):
    from meshtorch.errors import CheckpointError
    from meshtorch.recipes.lm.generate import run_tokenizer
    from meshtorch.recipes.lm.run_files import tokenizer_digest

    mine = _bpe(tmp_path / "mine")
    out = str(tmp_path / "run")
    train(TrainConfig.of(steps=2, out=out, data=text, **{**TINY, "tokenizer": mine}))
    rec = recorded(out)["tokenizer"]
    assert rec == {"path": "tokenizer", "sha256": tokenizer_digest(mine)}  # the copy computes the same
    assert tokenizer_digest(os.path.join(out, "tokenizer")) == rec["sha256"]
    # move the run and lose the original: the run resumes (and samples) from its own copy
    moved = str(tmp_path / "moved")
    os.rename(out, moved)
    os.rename(mine, str(tmp_path / "elsewhere"))
    assert run_tokenizer(os.path.join(moved, "checkpoint")).path == os.path.join(moved, "tokenizer")
    train(TrainConfig.of(steps=3, resume=moved, data=text, **{**TINY, "tokenizer": "auto"}))
    assert recorded(moved)["tokenizer"] == rec
    # an explicit --tokenizer must be the run's: the same one (wherever it is) is accepted, another refused
    train(TrainConfig.of(steps=4, resume=moved, data=text,
                         **{**TINY, "tokenizer": str(tmp_path / "elsewhere")}))
    before = _files(moved)
    for other in ("bytes", _bpe(tmp_path / "other", 280)):
        with pytest.raises(ArgumentError, match=f"--tokenizer '{other}' is not the tokenizer --resume .*"
                           r"trained with \(its own copy in .*moved/tokenizer\); drop --tokenizer"):
            train(TrainConfig.of(steps=5, resume=moved, data=text, **{**TINY, "tokenizer": other}))
    assert _files(moved) == before
    # a copy changed since the checkpoint was written is named, not used
    shutil.copy(os.path.join(tmp_path, "other", "tokenizer.json"), os.path.join(moved, "tokenizer"))
    with pytest.raises(CheckpointError, match="is not the one --resume .* trained with .*sha256 differs"):
        train(TrainConfig.of(steps=5, resume=moved, data=text, **{**TINY, "tokenizer": "auto"}))


def test_a_byte_run_refuses_a_tokenizer_on_resume(run2, text):
    with pytest.raises(ArgumentError, match=r"--tokenizer 'bpe:300' is not the tokenizer .*\(bytes\)"):
        train(TrainConfig.of(steps=4, resume=run2, data=text, **{**TINY, "tokenizer": "bpe:300"}))


def test_overwrite_removes_only_what_meshtorch_wrote_after_checking_the_inputs(text, tmp_path, monkeypatch):
    from meshtorch.errors import TrainingError

    out = tmp_path / "run"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "__init__.py").write_text("# the user's package")
    for overwrite in (False, True):  # a user's tokenizer/ is never the run's to replace
        with pytest.raises(TrainingError, match="holds tokenizer, which meshtorch train did not write"):
            train(TrainConfig.of(steps=2, out=str(out), data=text, overwrite=overwrite, **TINY))
    assert (out / "tokenizer" / "__init__.py").read_text() == "# the user's package"
    shutil.rmtree(out / "tokenizer")
    mine = _bpe(tmp_path / "mine")
    train(TrainConfig.of(steps=2, out=str(out), data=text, **{**TINY, "tokenizer": mine}))
    (out / "notes.txt").write_text("mine")
    before = _files(str(out))
    # inputs inside what --overwrite removes, or missing, are refused before anything is removed
    with pytest.raises(ArgumentError, match=r"--tokenizer '.*run/tokenizer' is in .*run/tokenizer, a file of "
                       "the earlier run that --overwrite would remove"):
        train(TrainConfig.of(steps=2, out=str(out), data=text, overwrite=True,
                             **{**TINY, "tokenizer": str(out / "tokenizer")}))
    with pytest.raises(ArgumentError, match="--data '.*nowhere' does not exist; nothing in --out was remo"):
        train(TrainConfig.of(steps=2, out=str(out), data=str(tmp_path / "nowhere"), overwrite=True, **TINY))
    # a stray RANK never skips the earlier-run check of the threads backend
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(TrainingError, match="holds an earlier run .*pass --resume .* or --overwrite"):
        train(TrainConfig.of(steps=2, out=str(out), data=text, **TINY))
    assert _files(str(out)) == before
    train(TrainConfig.of(steps=1, out=str(out), data=text, overwrite=True, **TINY))
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "tokenizer").exists()  # the earlier run's; this one is on bytes
    assert recorded(str(out))["tokenizer"] == {"path": "bytes"}


def test_overwrite_keeps_a_tokenizer_put_beside_a_run_that_never_wrote_one(run2, text, tmp_path):
    """The manifest lists what the run wrote, not every name a run may write: a run on bytes wrote
    no tokenizer/ (nor tensorboard/), so one put there afterwards is the user's and survives
    --overwrite (seen: the manifest listed every name and --overwrite deleted the package)."""
    from meshtorch.errors import TrainingError
    from meshtorch.recipes.lm.guards import MANIFEST

    out = tmp_path / "run"
    shutil.copytree(run2, out)
    with open(out / MANIFEST) as f:
        listed = json.load(f)["files"]
    assert {"checkpoint", "metrics.jsonl", "summary.json"} <= set(listed) <= {
        "checkpoint", "metrics.jsonl", "summary.json", "loss.png"}  # loss.png: where matplotlib is
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "__init__.py").write_text("# the user's package")
    with pytest.raises(TrainingError, match="holds tokenizer, which meshtorch train did not write"):
        train(TrainConfig.of(steps=2, out=str(out), data=text, overwrite=True, **TINY))
    assert (out / "tokenizer" / "__init__.py").read_text() == "# the user's package"


def test_a_run_stopped_before_its_first_checkpoint_names_overwrite(run2, text, tmp_path):
    from meshtorch.errors import TrainingError

    out = str(tmp_path / "cut")
    shutil.copytree(run2, out)
    shutil.rmtree(os.path.join(out, "checkpoint"))  # as if stopped before it was written
    with pytest.raises(TrainingError, match=r"holds an earlier run \(metrics.jsonl, .*\); it stopped before "
                       "its first checkpoint: pass --overwrite to rerun it in place"):
        train(TrainConfig.of(steps=2, out=out, data=text, **TINY))
    with pytest.raises(Exception, match=f"--resume '{out}' has no checkpoint/ .*--overwrite"):
        train(TrainConfig.of(steps=2, resume=out, data=text, **TINY))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert len(f.read().splitlines()) == 2  # a failed resume leaves the metrics as they were
    train(TrainConfig.of(steps=2, out=out, data=text, overwrite=True, **TINY))


def test_a_resume_that_fails_reading_the_checkpoint_or_the_metrics_leaves_the_metrics_as_they_were(
        run2, text, tmp_path):
    from meshtorch.errors import CheckpointError, MeshTorchError

    out = str(tmp_path / "run")
    shutil.copytree(run2, out)
    metrics = os.path.join(out, "metrics.jsonl")
    with open(metrics, "rb") as f:
        before = f.read()
    assert before.count(b"\n") == 2
    # a slice file cut short: the load fails after the run directory is held and the model is built
    ckpt = os.path.join(out, "checkpoint")
    version = os.path.join(ckpt, sorted(v for v in os.listdir(ckpt) if v.startswith("step-"))[-1])
    slices = os.path.join(version, "slices-00000.safetensors")
    with open(slices, "rb") as f:
        good = f.read()
    with open(slices, "wb") as f:
        f.write(good[: len(good) // 2])
    with pytest.raises(CheckpointError):
        train(TrainConfig.of(steps=4, resume=out, data=text, **TINY))
    with open(metrics, "rb") as f:
        assert f.read() == before
    with open(slices, "wb") as f:
        f.write(good)
    # a metrics record that is not JSON (not the last line, which a crash may cut short): named, and kept
    broken = b"{not json\n" + before.split(b"\n", 1)[1]
    with open(metrics, "wb") as f:
        f.write(broken)
    with pytest.raises(MeshTorchError, match="metrics.jsonl line 1 is not a JSON record .*fix or delete"):
        train(TrainConfig.of(steps=4, resume=out, data=text, **TINY))
    with open(metrics, "rb") as f:
        assert f.read() == broken
    with open(metrics, "wb") as f:
        f.write(before)
    train(TrainConfig.of(steps=3, resume=out, data=text, **TINY))  # and the run resumes once repaired
    with open(metrics) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps[:2] == [1, 2] and steps[-1] == 3


def test_config_file_tables_merge_and_an_option_set_twice_is_refused(tmp_path):
    from meshtorch.errors import MeshTorchError
    from meshtorch.recipes.lm.flags import _toml_options

    def options(body: str) -> dict:
        path = tmp_path / "c.toml"
        path.write_text(body)
        return _toml_options(str(path))

    # the top level, [train] and the section tables are one set of options: nothing is dropped
    body = 'lr = 1e9\n[train]\nsteps = 3\n[train.model]\nname = "moe"\n[optimizer]\nclip = 0.5\n'
    assert options(body) == {"lr": 1e9, "steps": 3, "model": "moe", "clip": 0.5}
    for body, needle in [
        ("lr = 1.0\n[train]\nlr = 2.0\n", "'lr' is set twice, in the top level (1.0) and in [train] (2.0)"),
        ("steps = 3\n[run]\nsteps = 4\n", "'steps' is set twice, in the top level (3) and in [run] (4)"),
        ('model = "lm"\n[train.model]\nname = "moe"\n', "'model' is set twice, in the top level ('lm') and"),
        ("[train]\nbogus = 1\n", "unknown option 'bogus' in [train]"),
    ]:
        with pytest.raises(MeshTorchError, match=re.escape(needle)):
            options(body)


def test_a_run_from_before_manifests_keeps_a_tokenizer_it_did_not_record(run2, text, tmp_path):
    from meshtorch import cli
    from meshtorch.errors import TrainingError
    from meshtorch.recipes.lm.guards import MANIFEST

    out = tmp_path / "legacy"
    shutil.copytree(run2, out)
    os.remove(out / MANIFEST)  # as an earlier meshtorch wrote it: no manifest
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "__init__.py").write_text("# the user's package")
    # the run trained on bytes: its tokenizer/ is not the run's, so even --overwrite leaves it alone
    with pytest.raises(TrainingError, match="holds tokenizer, which meshtorch train did not write"):
        train(TrainConfig.of(steps=2, out=str(out), data=text, overwrite=True, **TINY))
    assert (out / "tokenizer" / "__init__.py").exists() and (out / "checkpoint").exists()
    # the flag on the command line: --allow-change of a field that did not change is no error
    argv = ["train", "--resume", str(out), "--steps", "3", "--data", text, "--allow-change", "activation"]
    argv += [f"--{k.replace('_', '-')}" if v is True else f"--no-{k.replace('_', '-')}" if v is False
             else f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    shutil.rmtree(out / "tokenizer")
    assert cli.main(argv) == 0
    assert os.path.exists(out / MANIFEST)  # the resumed run lists its files from now on


def test_resuming_a_run_in_progress_before_its_first_checkpoint_says_it_runs(text, tmp_path):
    """Seen: --resume of a run still training (no checkpoint yet) said 'its run stopped before its
    first checkpoint: rerun it in place with --out ... --overwrite', advice for a stopped run."""
    from meshtorch.errors import MeshTorchError
    from meshtorch.recipes.lm.guards import RunDirLock

    out = tmp_path / "live"
    with RunDirLock(TrainConfig(), str(out)):  # as the run in progress holds it
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        with pytest.raises(MeshTorchError, match=rf"is a run still in progress \(pid {os.getpid()} holds"):
            train(TrainConfig.of(steps=2, resume=str(out), data=text, **TINY))
    with pytest.raises(MeshTorchError, match="stopped before its first checkpoint: rerun it in place"):
        train(TrainConfig.of(steps=2, resume=str(out), data=text, **TINY))


def _forget_padding_id(out: str) -> None:
    """Make ``out``'s checkpoint one a meshtorch from before ``padding_id`` wrote: no such field."""
    import meshtorch as mt
    from meshtorch.checkpoint.index import CHECKSUM, index_checksum

    path = os.path.join(mt.checkpoint.latest(os.path.join(out, "checkpoint")), "index.json")
    with open(path) as f:
        index = json.load(f)
    for part in ("model_config", "train_config"):
        del index["extra"][part]["padding_id"]
    index[CHECKSUM] = index_checksum(index)
    with open(path, "w") as f:
        json.dump(index, f)


def test_a_fine_tune_that_trained_the_pad_row_resumes_as_it_trained(text, tmp_path, capsys):
    """Seen: a fine-tune of a Llama with pad_token_id begun by a meshtorch without padding_id (which
    trained the pad row) could not resume: '--padding-id 2 (the run has -1). Pass --padding-id -1',
    which gave the same error (-1 is the default, so --init-from's config decides). It now resumes
    as it trained, bit for bit, saying so in a note, and again after that (its checkpoint then records
    -1); --allow-change padding_id takes the config's pad id. A config.json changed in another option
    is refused with advice that can work: no flag contradicts --init-from."""
    import meshtorch as mt
    from meshtorch.models import DecoderLM, TransformerConfig, export_hf

    plain, padded = tmp_path / "plain", tmp_path / "padded"
    cfg = TransformerConfig(vocab=264, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=16,
                            positions="rotary", norm="rms", activation="silu", gated=True)
    mt.launch(lambda: export_hf(plain, DecoderLM(cfg, seed=1)))
    shutil.copytree(plain, padded)
    config = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**config, "pad_token_id": 32}))  # ' ': in every batch
    small = {**{k: v for k, v in TINY.items() if k not in cfg.__dict__}, "sample_tokens": 0}
    runs = {name: str(tmp_path / name) for name in ("straight", "old", "changed")}
    train(TrainConfig.of(steps=4, out=runs["straight"], data=text, init_from=str(plain), **small))
    train(TrainConfig.of(steps=2, out=runs["old"], data=text, init_from=str(plain), **small))
    _forget_padding_id(runs["old"])
    shutil.copytree(runs["old"], runs["changed"])
    capsys.readouterr()
    train(TrainConfig.of(steps=3, resume=runs["old"], data=text, init_from=str(padded), **small))
    note = ("note: --resume '{}' trained with --padding-id -1 (the default; a run older than the option "
            "trained so) and goes on so, though --init-from '{}' has pad_token_id=32; add --allow-change "
            "padding_id to train with the config's from here on").format(runs["old"], padded)
    assert note in capsys.readouterr().out
    assert recorded(runs["old"])["model_config"]["padding_id"] == -1
    train(TrainConfig.of(steps=4, resume=runs["old"], data=text, init_from=str(padded), **small))
    assert note in capsys.readouterr().out
    assert_same_bits(checkpoint_tensors(runs["old"]), checkpoint_tensors(runs["straight"]))
    # opting in: from step 3 on the pad row's lookups no longer train it
    train(TrainConfig.of(steps=4, resume=runs["changed"], data=text, init_from=str(padded),
                         allow_change="padding_id", **small))
    assert "note:" not in capsys.readouterr().out
    assert recorded(runs["changed"])["model_config"]["padding_id"] == 32
    pad_rows = [checkpoint_tensors(runs[r])["model/embed.table@0,0"][32] for r in ("changed", "straight")]
    assert not torch.equal(*pad_rows)
    (padded / "config.json").write_text(json.dumps({**config, "pad_token_id": 32, "rope_theta": 500.0,
                                                    "rope_parameters": {"rope_type": "default",
                                                                        "rope_theta": 500.0}}))
    with pytest.raises(ArgumentError, match=r"--rotary-base 500.0 \(the run has 10000.0\)\. Put back the "
                                            r"config.json the run started from \(--init-from '.*'s sets "
                                            r"--rotary-base now\) to continue the run as it was, or "
                                            r"--allow-change rotary_base") as e:
        train(TrainConfig.of(steps=5, resume=runs["old"], data=text, init_from=str(padded), **small))
    assert "Pass --" not in str(e.value)
    with pytest.raises(ArgumentError, match=r"Pass --top-k 2 and put back the config.json the run started "
                                            r"from \(--init-from '.*'s sets --rotary-base now\)"):
        train(TrainConfig.of(steps=5, resume=runs["old"], data=text, init_from=str(padded), top_k=1, **small))
