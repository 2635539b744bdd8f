"""LM, seq2seq and MoE train to the same losses on 2 gloo processes as on one processor.

The threads-backend half of the issue's test (meshes ``b:1``, ``b:2,m:2`` and
``b:2,m:2,e:2`` under different rules) is in test_models_lm.py and
test_models_moe_seq2seq.py; here one spawn of 2 gloo processes (spawning
dominates the cost) trains all three models under rules that split the batch
*and* the model dims over the same axis, so the processes exchange
activations through all_reduce/all_gather/all_to_all, not just gradients.
"""

from __future__ import annotations

import pytest

import meshtorch as mt
from meshtorch.data.seq2seq import SpellingTask
from meshtorch.models import DecoderLM, EncoderDecoder, TransformerConfig
from test_models_lm import TINY, lm_batch, train_loop

pytestmark = pytest.mark.timeout(240)

# batch holds b in activations (data parallel); weights, which have no batch dim, are split
# along b by heads / d_ff / vocab / experts (model parallel over the same two processes)
GLOO_RULES = "batch:b; heads:b; d_ff:b; vocab:b; experts:b"


def cases():
    """name -> (config, model class, batch function): the configs of the threads-backend tests."""
    lm = TransformerConfig(**TINY, positions="rotary")
    moe = TransformerConfig(**TINY, experts=4, top_k=2, moe_every=1)
    s2s = TransformerConfig(**{**TINY, "vocab": 264, "max_length": 48}, encoder_layers=1)
    task = SpellingTask(batch=4, seed=0)
    return {"lm": (lm, DecoderLM, lm_batch(lm)),
            "moe": (moe, DecoderLM, lm_batch(moe)),
            "seq2seq": (s2s, EncoderDecoder, lambda model, step: model.loss(*task.at(step % 2)))}


def three_models() -> dict[str, list[float]]:
    """Each model's 10 training losses on this processor (runs inside each gloo process)."""
    return {name: train_loop(cfg, fn, 10, cls) for name, (cfg, cls, fn) in cases().items()}


def test_three_models_train_identically_on_two_gloo_processes():
    base = mt.launch(three_models)[0]
    per_proc = mt.launch(three_models, mesh="b:2", rules=GLOO_RULES, backend="torch", nprocs=2)
    assert len(per_proc) == 2 and per_proc[0] == per_proc[1], "processors disagree on the loss"
    for name, losses in base.items():
        assert losses[-1] < losses[0] - 0.1, f"{name} should learn in 10 steps: {losses}"
        assert per_proc[0][name] == pytest.approx(losses, rel=1e-4), name
