"""ZB-H1's split backward: the input gradient B and the weight gradient W give autograd's gradients,
and together cost one backward (W does not run the input-gradient chain again)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.pipeline.lm import LMStage, lm_loss
from meshtorch.pipeline.split_backward import input_gradient, weight_gradient
from meshtorch.tensor import MeshTensor

pytestmark = pytest.mark.timeout(120)

CFG = TransformerConfig(vocab=32, d_model=16, heads=4, d_kv=4, d_ff=32, layers=3, max_length=8,
                        tie_embeddings=True)


def _grads(chunk: int, split: bool):
    """(gradients of the parameters and the input, FLOPs of the backward) of chunk ``chunk`` of 3."""
    model = DecoderLM(CFG, seed=0)
    stage = LMStage(model, chunk, 3)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, CFG.vocab, (4, 8), generator=g)
    if chunk == 0:
        x = mt.from_global(ids, "batch:4,length:8")
        leaf = None
    else:
        x = mt.from_global(torch.randn(4, 8, CFG.d_model, generator=g), "batch:4,length:8,d_model:16")
        leaf = x.local.detach().requires_grad_(True)
        x = MeshTensor(leaf, x.shape, x.layout)
    out = stage(x)
    if chunk == 2:  # the last chunk's output is its loss
        out = lm_loss(out, mt.from_global(ids, "batch:4,length:8"))
        grad = torch.ones_like(out.local)
    else:
        grad = torch.randn(out.local.shape, generator=g)
    params = list(stage.parameters())
    with FlopCounterMode(display=False) as count:
        if split:
            kept = input_gradient([out.local], [grad], [] if leaf is None else [leaf], params)
            weight_gradient(kept)
        else:
            torch.autograd.backward([out.local], [grad])
    return [p.grad for p in params] + ([] if leaf is None else [leaf.grad]), count.get_total_flops()


@pytest.mark.parametrize("chunk", [0, 1, 2])
@pytest.mark.parametrize("mesh,rules", [("", ""), ("m:2", "heads:m; d_ff:m; vocab:m")])
def test_b_and_w_give_autograds_gradients_in_one_backward(chunk, mesh, rules):
    # chunk 0: token ids in, no input gradient (W does it all); 2: the tied table, the loss; on m:2
    # the model axis's collectives run inside B and W
    got = mt.launch(_grads, chunk, True, mesh=mesh, rules=rules)
    want = mt.launch(_grads, chunk, False, mesh=mesh, rules=rules)
    for (grads, flops), (ref, ref_flops) in zip(got, want):
        assert len(grads) == len(ref) and all(g is not None for g in grads)
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert flops == ref_flops > 0  # each multiply of the backward once
