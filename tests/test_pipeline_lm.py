"""The MeshTensor LM split by layers into pipeline stages trains like the unsplit LM."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.pipeline.lm import lm_pipeline

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
    return losses, {n: mt.nn.module.as_mesh_view(p).to_global() for n, p in model.named_parameters()}


def _piped(cfg, schedule):
    pipe = lm_pipeline(cfg, microbatches=2, schedule=schedule,
                       optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    losses = []
    for seq in data():
        ids = mt.from_global(seq[:, :-1].contiguous(), "batch:8,length:6")
        tgt = mt.from_global(seq[:, 1:].contiguous(), "batch:8,length:6")
        losses.append(pipe.step(ids, tgt))
    params = {n: mt.nn.module.as_mesh_view(p).to_global() for n, p in pipe.module.named_model_parameters()}
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
