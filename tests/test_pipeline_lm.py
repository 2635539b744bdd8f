"""The MeshTensor LM split by layers into pipeline stages trains like the unsplit LM."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.pipeline.lm import lm_pipeline
from run_harness import checkpoint_tensors, tiny_train

pytestmark = pytest.mark.timeout(180)

STEPS = 3


def config(tie: bool, layers: int = 3) -> TransformerConfig:
    return TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=layers, max_length=8,
                             tie_embeddings=tie)


def data():
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 16, (8, 7), generator=g)
    return [seq] * STEPS  # one batch again and again: the loss must fall


def _unsplit(cfg):
    model = DecoderLM(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for seq in data():
        ids = mt.from_global(seq[:, :-1].contiguous(), "batch:8,length:6")
        tgt = mt.from_global(seq[:, 1:].contiguous(), "batch:8,length:6")
        opt.zero_grad()
        loss = model.loss(ids, tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.mesh_tensor.to_global() for n, p in model.named_parameters()}


def _piped(cfg, schedule):
    pipe = lm_pipeline(cfg, microbatches=2, schedule=schedule,
                       optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    losses = []
    for seq in data():
        ids = mt.from_global(seq[:, :-1].contiguous(), "batch:8,length:6")
        tgt = mt.from_global(seq[:, 1:].contiguous(), "batch:8,length:6")
        losses.append(pipe.step(ids, tgt))
    params = {n: p.mesh_tensor.to_global() for n, p in pipe.module.named_model_parameters()}
    return losses, params


@pytest.mark.parametrize("mesh,rules,tie,schedule", [
    ("stage:2,b:2", "batch:b", True, "1f1b"),
    ("stage:3", "", False, "gpipe"),
    ("b:1,stage:2,m:2", "heads:m; d_ff:m; vocab:m", True, "gpipe"),
])
def test_lm_pipeline_equals_unsplit_lm(mesh, rules, tie, schedule):
    cfg = config(tie)
    (want_losses, want), = mt.launch(_unsplit, cfg)
    out = mt.launch(_piped, cfg, schedule, mesh=mesh, rules=rules)
    seen = set()
    for losses, params in out:
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, v in params.items():
            torch.testing.assert_close(v, want[name], rtol=1e-4, atol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(want)  # the stages together hold every parameter of the unsplit model
    assert want_losses[-1] < want_losses[0]


def _unsplit_2bw(cfg):
    """2BW written directly on the unsplit LM: the gradient of batch t at W(t-1) (W(-1) = W(0)),
    applied to W(t) by Adam."""
    model = DecoderLM(cfg, seed=0)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    prev = [p.detach().clone() for p in params]
    for seq in data():
        ids = mt.from_global(seq[:, :-1].contiguous(), "batch:8,length:6")
        tgt = mt.from_global(seq[:, 1:].contiguous(), "batch:8,length:6")
        now = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, prev):
                p.copy_(w)
        opt.zero_grad()
        model.loss(ids, tgt).backward()
        with torch.no_grad():
            for p, w in zip(params, now):
                p.copy_(w)
        prev = now
        opt.step()
    return {n: p.mesh_tensor.to_global() for n, p in model.named_parameters()}


def _piped_2bw(cfg):
    pipe = lm_pipeline(cfg, microbatches=2, schedule="2bw",
                       optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    batch = [(mt.from_global(seq[:, :-1].contiguous(), "batch:8,length:6"),
              mt.from_global(seq[:, 1:].contiguous(), "batch:8,length:6")) for seq in data()]
    pipe.train(batch)  # one table, no flush between the batches
    return {n: p.mesh_tensor.to_global() for n, p in pipe.module.named_model_parameters()}


def test_lm_pipeline_2bw_without_flush_equals_direct_2bw():
    # MeshTensor stages split over b, tied embeddings summed over the stages at each update
    cfg = config(True)
    (want,) = mt.launch(_unsplit_2bw, cfg)
    ((_, sync),) = mt.launch(_unsplit, cfg)
    out = mt.launch(_piped_2bw, cfg, mesh="stage:2,b:2", rules="batch:b")
    assert set().union(*out) == set(want)
    for params in out:
        for name, v in params.items():
            torch.testing.assert_close(v, want[name], rtol=1e-4, atol=1e-5, msg=name)
    # the delay matters: synchronous training ends elsewhere
    assert not torch.allclose(out[0]["embed.table"], sync["embed.table"], atol=1e-4)


def _corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(8):
        (d / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(30)))
    return str(d)


def test_meshtorch_train_pipeline_matches_the_unsplit_run(tmp_path, capsys):
    import json
    import os

    from meshtorch import cli

    tiny = tiny_train(layers=2, batch=8, eval_batches=2, log_every=2, warmup=2, steps=4,
                      data=_corpus(tmp_path), mesh="b:1", rules="")
    plain, piped = str(tmp_path / "plain"), str(tmp_path / "piped")
    assert cli.main(["train", "--out", plain, *tiny]) == 0
    # gpipe: synchronous, so with the same seed, batches, AdamW, warm-up/cosine and clipping over all
    # stages, the pipeline run's losses are the unsplit run's
    assert cli.main(["train", "--out", piped, "--pipeline-stages", "2", "--schedule", "gpipe",
                     "--microbatches", "2", *tiny]) == 0
    printed = capsys.readouterr().out
    assert "pipeline of 2 stages (gpipe, 2 micro-batches) on mesh 'stage:2,b:1'" in printed
    assert "wrote checkpoint/, tokenizer/, metrics.jsonl, summary.json" in printed and "sample:" in printed

    def losses(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f]

    assert losses(piped) == pytest.approx(losses(plain), abs=2e-4)
    summary = [json.load(open(os.path.join(d, "summary.json"))) for d in (plain, piped)]
    assert summary[1]["heldout_loss"] == pytest.approx(summary[0]["heldout_loss"], rel=1e-4)
    assert "def " in summary[1]["sample"]  # the prompt and its continuation, as in the unsplit run
    # the checkpoint is the unsplit run's format: the gathered stages' weights equal the unsplit run's
    from meshtorch.checkpoint import latest
    from meshtorch.checkpoint.index import read_index
    from meshtorch.recipes.lm.generate import generate_from_checkpoint

    idx = read_index(os.path.join(piped, "checkpoint"))
    assert idx["step"] == 4 and any(k.startswith("optim/") for k in idx["tensors"])
    a, b = checkpoint_tensors(plain), checkpoint_tensors(piped)
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-4, msg=k)
    assert isinstance(generate_from_checkpoint(piped, "def ", max_new_tokens=4), str)
    # --resume: 2 steps, then resume to 4, gives the uninterrupted pipeline run's losses
    half = str(tmp_path / "half")
    args = ["train", "--pipeline-stages", "2", "--schedule", "gpipe", "--microbatches", "2", *tiny]
    assert cli.main([*args, "--out", half, "--steps", "2"]) == 0
    assert cli.main([*args, "--resume", half]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert losses(half) == pytest.approx(losses(piped), abs=1e-5)
    # 2BW: the checkpoint holds W(t-1) too, so 2 steps + resume to 4 give the uninterrupted 2BW
    # run's losses, held-out loss and weights. Logging every step makes the losses after the resume
    # depend on W(t-1): batch t's loss is that of W(t-1).
    two = ["train", "--pipeline-stages", "2", "--schedule", "2bw", "--microbatches", "2", *tiny,
           "--log-every", "1"]
    full, cut = str(tmp_path / "full2bw"), str(tmp_path / "cut2bw")
    assert cli.main([*two, "--out", full]) == 0
    assert cli.main([*two, "--out", cut, "--steps", "2"]) == 0
    idx = read_index(os.path.join(cut, "checkpoint"))
    names = [k.removeprefix("model/") for k in idx["tensors"] if k.startswith("model/")]
    prev = {n.removeprefix("previous.") for n in names if n.startswith("previous.")}
    assert prev and prev == {n for n in names if not n.startswith("previous.")}  # both versions, whole
    import shutil

    stale = str(tmp_path / "stale2bw")  # the same checkpoint without W(t-1): resumes with W(t-1) = W(t)
    shutil.copytree(cut, stale)
    assert cli.main([*two, "--resume", cut]) == 0
    assert [len(losses(d)) for d in (full, cut)] == [4, 4]
    assert losses(cut) == pytest.approx(losses(full), abs=1e-5)
    # the delay is real: 2BW's later losses differ from the synchronous run's
    assert abs(losses(full)[3] - losses(piped)[1]) > 1e-4
    summary = [json.load(open(os.path.join(d, "summary.json"))) for d in (full, cut)]
    assert summary[1]["heldout_loss"] == pytest.approx(summary[0]["heldout_loss"], abs=1e-5)
    a, b = checkpoint_tensors(full), checkpoint_tensors(cut)
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # without W(t-1) in the checkpoint the resumed run differs (what this guards against)
    from meshtorch.checkpoint.format import INDEX
    from meshtorch.checkpoint.index import CHECKSUM, index_checksum

    stale_index = os.path.join(latest(os.path.join(stale, "checkpoint")), INDEX)
    with open(stale_index) as f:
        index = json.load(f)
    index["tensors"] = {k: v for k, v in index["tensors"].items() if not k.startswith("model/previous.")}
    index[CHECKSUM] = index_checksum(index)  # a consistent checkpoint, as a GPipe/1F1B run writes it
    with open(stale_index, "w") as f:
        json.dump(index, f)
    assert cli.main([*two, "--resume", stale]) == 0
    assert abs(losses(stale)[2] - losses(full)[2]) > 1e-4  # batch 2 computed with W(2), not W(1)
    # one meaning per flag: --schedule is the pipeline's, --lr-schedule the learning rate's
    from meshtorch.recipes.lm import TrainConfig, check_config

    with pytest.raises(Exception, match="not a pipeline schedule.*is --lr-schedule cosine"):
        check_config(TrainConfig.of(schedule="cosine"))
    with pytest.raises(Exception, match="--lr-schedule 'gpipe' is not 'cosine' or 'constant'"):
        check_config(TrainConfig.of(lr_schedule="gpipe"))
