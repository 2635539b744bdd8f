"""torch.compile of a meshtorch step: one graph per processor, no graph breaks, the eager step's
loss and gradients (torch's own compiled run against the uncompiled one)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.config import check_config
from meshtorch.recipes.lm.strategies import compile_loss, graph_breaks

CFG = TransformerConfig(vocab=32, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=8)
SHAPE = "batch:4,length:8"


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, CFG.vocab, (4, 8), generator=g) for _ in range(2)) for _ in range(n)]


def train(backend: str | None, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of the tiny LM, eager (``backend=None``) or compiled; the losses and
    the whole (global) gradients of the last step."""
    model = DecoderLM(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = model.loss if backend is None else compile_loss(model, backend)
    losses = []
    for ids, tgt in batches(steps):
        loss = loss_fn(mt.from_global(ids, SHAPE), mt.from_global(tgt, SHAPE))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.to_global() for n, p in model.named_mesh_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def test_one_processor_forward_is_one_graph_without_breaks():
    model = DecoderLM(CFG, seed=0)
    ids, tgt = (mt.from_global(t, SHAPE) for t in batches(1)[0])
    explained = torch._dynamo.explain(model.loss)(ids, tgt)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()


def test_one_processor_inductor_step_matches_eager():
    eager_losses, eager_grads = train(None)
    losses, grads = train("inductor")
    torch._dynamo.reset()
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert set(grads) == set(eager_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.timeout(600)  # each processor traces its graph in turn: minutes on a loaded 2-core machine
def test_two_processors_on_threads_compile_collectives_into_the_graph():
    """Each processor traces its own graph (rules split the batch and d_ff over one axis, so the
    forward and backward all-gather, reduce-scatter and all-reduce); the collectives are ops of
    the graph, not breaks, and the communicator counts them."""

    def program():
        eager = train(None, steps=1)
        mt.reset_comm_stats()
        compiled = train("aot_eager", steps=1)
        return eager, compiled, mt.comm_stats().calls()

    counters.clear()
    out = mt.launch(program, mesh="b:2", rules="batch:b; d_ff:b")
    breaks = graph_breaks()
    unique = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert breaks == {}
    assert unique == 2  # one graph per processor
    one_losses, _ = train(None, steps=1)
    for (eager_losses, eager_grads), (losses, grads), calls in out:
        # aot_eager runs the same ATen ops in the same order as the eager step
        assert losses == eager_losses
        assert losses == pytest.approx(one_losses, rel=1e-5)  # and the one-processor model's
        for name, g in grads.items():
            torch.testing.assert_close(g, eager_grads[name], rtol=0, atol=0, msg=name)
        assert calls > 0  # the compiled graphs' collectives went through the communicator


def test_compile_with_pipeline_stages_is_refused():
    with pytest.raises(mt.errors.MeshTorchError, match="--compile"):
        check_config(TrainConfig.of(compile=True, pipeline_stages=2, mesh="b:2"))
