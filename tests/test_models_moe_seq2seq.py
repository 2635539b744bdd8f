"""MoE layer vs a per-token plain-torch reference; MoE LM and seq2seq training are layout-invariant."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import meshtorch as mt
from meshtorch.data.seq2seq import SpellingTask, spell
from meshtorch.models import EncoderDecoder, TransformerConfig
from meshtorch.models.moe import MoE
from test_models_lm import TINY, lm_batch, train_losses


def reference_moe(x, wg, wi, wo, top_k, capacity_factor):
    """GShard routing written token by token: top-1 slots first, then top-2, per group (batch row)."""
    b, t, _ = x.shape
    e = wg.shape[1]
    cap = max(1, math.ceil(capacity_factor * t * top_k / e))
    probs = (x @ wg).softmax(-1)
    y = torch.zeros_like(x)
    for g in range(b):
        first = probs[g].argmax(-1)
        masked = probs[g].clone()
        masked[torch.arange(t), first] = 0
        second = masked.argmax(-1)
        count = [0] * e
        slots = []
        for rank, choice in enumerate([first, second][:top_k]):
            for i in range(t):
                ex = int(choice[i])
                if count[ex] < cap:
                    slots.append((i, ex, rank))
                count[ex] += 1
        for i, ex, _ in slots:
            p1, p2 = probs[g, i, first[i]], probs[g, i, second[i]]
            gate = probs[g, i, ex] / ((p1 + p2) if top_k == 2 else 1.0)
            y[g, i] += gate * (torch.relu(x[g, i] @ wi[ex]) @ wo[ex])
    return y


@pytest.mark.parametrize("top_k, factor", [(1, 1.0), (2, 1.0), (2, 0.5)])
def test_moe_matches_token_by_token_reference(top_k, factor):
    cfg = TransformerConfig(**TINY, experts=4, top_k=top_k, capacity_factor=factor, activation="relu")
    x = torch.randn(4, 6, cfg.d_model, generator=torch.Generator().manual_seed(0))

    def prog():
        moe = MoE(cfg)
        y, aux = moe(mt.from_global(x, "batch:4,length:6,d_model:8"))
        P = {n: v.to_global().detach() for n, v in moe.named_mesh_parameters()}
        return y.to_global(), aux.item(), P, mt.comm_stats().calls(kind="all_to_all")

    outs = mt.launch(prog, mesh="b:2,m:2", rules="batch:b; experts:b; d_ff:m")
    y, aux, P, a2a = outs[0]
    ref = reference_moe(x, P["gate.kernel"], P["wi"], P["wo"], top_k, factor)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert a2a >= 2, "dispatch and combine should each be an all_to_all along b"
    probs = (x @ P["gate.kernel"]).softmax(-1).detach()
    frac = torch.nn.functional.one_hot(probs.argmax(-1), 4).float().mean(1)
    assert aux == pytest.approx(float((frac * probs.mean(1)).mean() * 16), rel=1e-5)


MOE_LAYOUTS = [
    ("b:1", ""),
    ("b:2,m:2", "batch:b; experts:b; heads:m; d_ff:m; vocab:m"),
    ("b:2,m:2,e:2", "batch:b; experts:e; heads:m; d_ff:m; vocab:e"),
]


def test_moe_lm_training_is_layout_invariant():
    cfg = TransformerConfig(**TINY, experts=4, top_k=2, moe_every=1)
    runs = {m: train_losses(cfg, m, r, batch_fn=lm_batch(cfg)) for m, r in MOE_LAYOUTS}
    base = runs["b:1"]
    assert base[-1] < base[0] - 0.1, base
    for mesh, losses in runs.items():
        assert losses == pytest.approx(base, rel=1e-4), mesh


def test_seq2seq_training_is_layout_invariant():
    cfg = TransformerConfig(**{**TINY, "vocab": 264, "max_length": 48}, encoder_layers=1)
    task = SpellingTask(batch=4, seed=0)

    def batch_fn(model, step):
        return model.loss(*task.at(step % 2))

    runs = {m: train_losses(cfg, m, r, model_cls=EncoderDecoder, batch_fn=batch_fn) for m, r in MOE_LAYOUTS}
    base = runs["b:1"]
    assert base[-1] < base[0] - 0.5, base
    for mesh, losses in runs.items():
        assert losses == pytest.approx(base, rel=1e-4), mesh


def test_spelling_task_batches():
    task = SpellingTask(batch=3, seed=1)
    src, tin, tout, w = (t.to_global() for t in task.at(0))
    tok = task.tok
    for row in range(3):
        n = int(tok.decode(src[row].tolist()))
        assert tok.decode(tout[row].tolist()) == spell(n)
        k = len(spell(n)) + 1
        assert tin[row, 0] == tok.bos and torch.equal(tin[row, 1:k], tout[row, : k - 1])
        assert int(w[row].sum()) == len(spell(n)) + 1
    held = set(task.heldout(1).numbers.tolist())
    assert held and not held & set(task.numbers.tolist())
    assert spell(9999) == "nine thousand nine hundred ninety-nine" and spell(40) == "forty"


@pytest.mark.parametrize("tie", [True, False])
def test_seq2seq_parameter_count_honours_tie_embeddings(tie):
    v, d, h, k, f, enc, dec, pos = 40, 8, 2, 4, 16, 2, 3, 12
    cfg = TransformerConfig(vocab=v, d_model=d, heads=h, d_kv=k, d_ff=f, layers=dec, encoder_layers=enc,
                            max_length=pos, tie_embeddings=tie)
    model = EncoderDecoder(cfg)
    attention, ffn, norm = 4 * d * h * k, 2 * d * f, 2 * d
    encoder = pos * d + enc * (attention + ffn + 2 * norm) + norm
    decoder = pos * d + dec * (2 * attention + ffn + 3 * norm) + norm
    want = v * d + encoder + decoder + (0 if tie else d * v)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) == want
    src = mt.from_global(torch.tensor([[5, 6, 7]]), "batch:1,length:3")
    tgt = mt.from_global(torch.tensor([[1, 2]]), "batch:1,length:2")
    mt.reduce_sum(model(src, tgt)).backward()  # untied, the logits come from the output layer
    if not tie:
        assert model.head.kernel.grad is not None and model.head.kernel.grad.abs().sum() > 0


def test_meshtorch_plan_counts_the_untied_seq2seq_output_layer(capsys):
    import json

    from meshtorch.cli import main

    args = ["plan", "--model", "seq2seq", "--layers", "1", "--encoder-layers", "1", "--d-model", "8",
            "--d-kv", "4", "--d-ff", "16", "--heads", "2", "--batch", "4", "--length", "8", "--vocab", "32",
            "--mesh", "b:2", "--rules", "batch:b", "--json"]
    counts = {}
    for flag in ("--tie-embeddings", "--no-tie-embeddings"):
        assert main(args + [flag]) == 0
        counts[flag] = json.loads(capsys.readouterr().out)["parameters"]
    assert counts["--no-tie-embeddings"] - counts["--tie-embeddings"] == 32 * 8


def test_seq2seq_masks_its_padding_id_out_of_the_source():
    """Seen: EncoderDecoder masked out the source id ``pad`` (256) whatever cfg.padding_id said: a
    model with padding_id=5 stopped training the lookups of 5 but attended to them. Its source
    padding is now padding_id where set (trailing pads then change nothing), and a ``pad`` that
    contradicts it is refused."""
    cfg = TransformerConfig(vocab=40, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, encoder_layers=1,
                            max_length=8, padding_id=5)
    tgt = mt.from_global(torch.tensor([[1, 2, 3]]), "batch:1,length:3")

    def logits(src):
        return EncoderDecoder(cfg, seed=1)(mt.from_global(torch.tensor([src]), f"batch:1,length:{len(src)}"),
                                           tgt).to_global()

    torch.testing.assert_close(logits([7, 8, 5, 5]), logits([7, 8]), rtol=0, atol=1e-6)
    assert (logits([7, 8, 9, 9]) - logits([7, 8])).abs().max() > 1e-4  # (other ids do count)
    assert EncoderDecoder(dataclasses.replace(cfg, padding_id=-1)).pad == 256
    with pytest.raises(mt.errors.ArgumentError, match=r"pad=31\) but cfg.padding_id=5"):
        EncoderDecoder(cfg, pad=31)


def test_train_seq2seq_takes_only_its_tasks_padding_id():
    from meshtorch.recipes.lm import TrainConfig
    from meshtorch.recipes.lm.config import check_model_flags

    with pytest.raises(mt.errors.ArgumentError, match=r"--padding-id 5: --model seq2seq's spelling task pads "
                                                      r"with id 256.*pass --padding-id 256"):
        check_model_flags(TrainConfig.of(model="seq2seq", padding_id=5))
    check_model_flags(TrainConfig.of(model="seq2seq", padding_id=256))
    check_model_flags(TrainConfig.of(model="lm", padding_id=5))
