"""The plain-PyTorch LM of benchmarks/overhead.py computes what DecoderLM computes.

The overhead benchmark's ratio only means something if both sides do the same
math: same loss and same gradients from the same weights, and the same losses
after a few optimizer steps on each side.
"""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from bench_harness import load_benchmark
from meshtorch.models import DecoderLM, TransformerConfig

overhead = load_benchmark("overhead")


@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize("opts", [dict(), dict(bias=True, tie_embeddings=False, activation="gelu_tanh")])
def test_plain_lm_has_the_same_loss_and_gradients(opts, sdpa):
    cfg = TransformerConfig(vocab=24, d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, max_length=8, **opts)
    ours = DecoderLM(cfg, seed=2)
    with torch.no_grad():  # biases and norms start at 0 and 1: make them count
        for p in ours.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    plain = overhead.PlainLM(ours, sdpa=sdpa)
    data = torch.randint(0, cfg.vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    ids, tgt = data[:, :-1], data[:, 1:]
    loss = ours.loss(mt.from_global(ids, "batch:3,length:8"), mt.from_global(tgt, "batch:3,length:8"))
    loss.backward()
    ref = plain.loss(ids, tgt)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    grads = {n: v.grad.to_global() for n, v in ours.named_mesh_parameters()}
    assert len(plain.names) == len(grads)
    for ours_name, p in plain.named_parameters():
        g = grads[plain.names[ours_name]].reshape(p.shape)
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=ours_name)


def test_benchmark_steps_train_both_models_alike():
    cfg = TransformerConfig(vocab=24, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=16)
    ours = DecoderLM(cfg, seed=0)
    plain = overhead.PlainLM(ours)
    old = overhead.BATCH, overhead.LENGTH
    overhead.BATCH, overhead.LENGTH = 4, 16
    try:
        a, _ = overhead.plain_stepper(plain)
        b, _ = overhead.mesh_stepper(ours)
        # one batch over and over: the loss must fall, so the optimizers really step
        la = [a(*overhead.batch(0, cfg.vocab)) for _ in range(5)]
        lb = [b(*overhead.batch(0, cfg.vocab)) for _ in range(5)]
    finally:
        overhead.BATCH, overhead.LENGTH = old
    assert la[-1] < la[0]
    assert la == pytest.approx(lb, rel=1e-5)
