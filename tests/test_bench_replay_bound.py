"""benchmarks/replay_bound.py: its replay of a recorded forward computes what the eager forward does."""

from __future__ import annotations

import torch

import meshtorch as mt
from bench_harness import load_benchmark
from meshtorch.models import DecoderLM, TransformerConfig


def test_the_replay_is_the_eager_forward_step_after_step():
    """The replayed loss of a tiny LM is the eager one bitwise, again after an optimizer step
    updated the parameters in place (the replay reads the recording's parameter objects), its
    gradients the eager ones to float32 rounding (the loss's autograd.Function runs as the calls
    inside it); the replay makes no tensor-less call (``.shape`` is a constant of the recording)."""
    bench = load_benchmark("replay_bound")
    cfg = TransformerConfig(vocab=32, d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, max_length=8)
    model = DecoderLM(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    shape = "batch:2,length:8"

    def eager():
        return model.loss(mt.from_global(ids[:, :-1], shape), mt.from_global(ids[:, 1:], shape)).local

    eager().backward()
    replay = bench.Replay(eager)
    assert all(f.__name__ != "__get__" for f, *_ in replay.calls)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        want = eager()
        want.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        got = replay()
        got.backward()
        assert torch.equal(got, want), (got.item(), want.item())
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
        opt.step()  # (the next round: new values in the same parameter objects)
    assert not torch.equal(want, replay.recorded)  # the parameters did change in between


def test_in_place_ops_and_writes_are_replayed_on_the_new_values():
    """An in-place op (its result its input: the same slot), a call returning its input as it is
    (``contiguous``) and a write returning None (``t[0] = v``) are replayed: after the input changes
    in place, the replay is the eager function's new value, not the recording's."""
    bench = load_benchmark("replay_bound")
    a = torch.arange(4.0)

    def fn():
        b = a * 1
        b.add_(1)
        c = b.contiguous()
        c[0] = 100.0
        return c * 2 + (a + 1)

    replay = bench.Replay(fn)
    a.mul_(3)
    assert torch.equal(replay(), fn()), (replay(), fn())
    assert not torch.equal(fn(), replay.recorded)
