"""Inside ``mt.overlap()`` a loss's all_reduce does not block: the forward returns with the call in
flight, the processors meet only at the end of backward, and ``.item()`` waits.

References: the same loss and gradients with the blocking call (outside ``overlap``, and inside it
where pending tensors are not available: the fallback), plain tensor arithmetic for
:class:`meshtorch.comm.pending.Pending`.
"""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.comm import pending
from meshtorch.comm.grouped import Handle
from meshtorch.comm.pending import Pending, later
from meshtorch.models import DecoderLM, TransformerConfig

BATCH, LENGTH = 4, 6


def model() -> DecoderLM:
    return DecoderLM(TransformerConfig(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1,
                                       max_length=LENGTH, tie_embeddings=True), seed=0)


def batch():
    data = torch.randint(0, 32, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    shape = f"batch:{BATCH},length:{LENGTH}"
    return mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape)


def in_flight(value: torch.Tensor, waits: list) -> torch.Tensor:
    """``value`` as a call in flight that appends to ``waits`` when waited on."""
    return later(Handle(lambda: waits.append(1) or [value], done=lambda: False), value)


# ------------------------------------------------------------------ on two gloo processes
def forward_before_the_peer() -> tuple:
    """Processor 1 starts its forward only once processor 0's forward has returned (a message
    sent after it): were processor 0's loss all_reduce blocking, neither would get past it (the
    communicator's timeout would raise)."""
    lm, comm = model(), mt.current().comm
    with mt.overlap():
        if comm.rank == 1:
            comm.recv("b", src=0)
        loss = lm.loss(*batch())
        kind = type(loss.local).__name__
        if comm.rank == 0:
            comm.send(torch.ones(1), "b", dst=1)
        loss.backward()
    return kind, loss.item(), lm.loss(*batch()).item()  # (the last: the blocking call's)


def loss_and_grads(on: bool, available: bool) -> tuple:
    lm = model()
    pending.AVAILABLE = available  # (this process's module: the launch's own processes)
    try:
        with mt.overlap(enabled=on):
            loss = lm.loss(*batch())
            kind = type(loss.local).__name__
            loss.backward()
    finally:
        pending.AVAILABLE = True
    return kind, loss.item(), {n: p.grad.to_global() for n, p in lm.named_mesh_parameters()}


def test_a_loss_all_reduce_lets_the_forward_return_before_the_peer_joins_it():
    results = mt.launch(forward_before_the_peer, mesh="b:2", rules="batch:b", backend="torch", timeout=60)
    # processor 0's call was in flight when its forward returned; processor 1's may have
    # completed at once (processor 0 was in it already): then it is the plain result
    assert results[0][0] == "Pending" and results[1][0] in ("Pending", "Tensor")
    assert results[0][1:] == results[1][1:] and results[0][1] == results[0][2]


def variants() -> dict:
    return {name: loss_and_grads(on, available)
            for name, on, available in (("blocking", False, True), ("read later", True, True),
                                        ("fallback", True, False))}


def test_a_loss_read_later_has_the_blocking_calls_value_and_gradients_and_a_fallback():
    for got in mt.launch(variants, mesh="b:2", rules="batch:b", backend="torch", timeout=60):
        # (read later: a Pending, or the plain result where the call completed as it was made)
        assert [kind for kind, _, _ in got.values()][::2] == ["Tensor", "Tensor"]
        blocking, later_, fallback = got.values()
        assert blocking[1] == later_[1] == fallback[1]
        for name in blocking[2]:
            assert torch.equal(later_[2][name], fallback[2][name]), name
            torch.testing.assert_close(later_[2][name], blocking[2][name], rtol=1e-6, atol=0)


def test_on_an_eager_backend_the_loss_is_a_plain_tensor():
    # the threads backend completes its calls when made: nothing is left to wait for
    got = mt.launch(variants, mesh="b:2", rules="batch:b")[0]
    assert [kind for kind, _, _ in got.values()] == ["Tensor"] * 3
    assert len({loss for _, loss, _ in got.values()}) == 1


# ------------------------------------------------------------------ Pending alone
def test_cheap_ops_of_a_pending_value_wait_for_nothing_and_give_the_plain_values():
    waits: list = []
    x = torch.tensor(5.0)
    t = in_flight(x, waits)
    got = [(t / 3 + 1) * 2 - 0.5, -t, t.detach().view(1), t * torch.tensor(3.0), torch.ones_like(t)]
    assert waits == [] and [type(g) for g in got[:4]] == [Pending] * 4
    want = [(x / 3 + 1) * 2 - 0.5, -x, x.view(1), x * 3.0, torch.ones(())]
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # (reads: waits once, then every result is computed)
    assert waits == [1]


def test_an_op_with_a_larger_plain_operand_waits_and_a_0d_one_is_taken_as_it_was():
    waits: list = []
    t = in_flight(torch.tensor(2.0), waits)
    scale = torch.tensor(3.0)
    taken = t * scale
    scale.add_(1)  # changed after the op was taken: the op keeps the operand it was given
    assert waits == []
    added = t + torch.ones(3)  # a [3] operand would have to be copied: waits instead
    assert waits == [1] and type(added) is torch.Tensor
    assert added.tolist() == [3.0, 3.0, 3.0] and taken.item() == 6.0
    large = in_flight(torch.arange(pending.SMALL + 1.0), waits)
    assert type(large / 2) is torch.Tensor and waits == [1, 1]  # no stand-ins of large tensors
    running = in_flight(torch.tensor(1.0), waits)
    for _ in range(3 * pending.MAX_DEPTH):  # a running sum never read: the chain is cut, not held
        running = running + 1
    assert waits == [1, 1, 1] and running.item() == 1.0 + 3 * pending.MAX_DEPTH


def test_autograd_through_a_pending_value_gives_the_plain_gradient():
    waits: list = []

    class Call(torch.autograd.Function):  # an all_reduce_sum's shape: identity backward
        @staticmethod
        def forward(ctx, t, read_later):
            out = t.detach() * 4
            return in_flight(out, waits) if read_later else out

        @staticmethod
        def backward(ctx, g):
            return g, None

    got = []
    for read_later in (True, False):
        w = torch.tensor(1.5, requires_grad=True)
        loss = Call.apply(w * w, read_later) / 7
        loss.backward()
        assert waits == []  # backward read nothing of the pending value
        got.append((w.grad, loss.detach()))
    assert type(got[0][1]) is Pending and waits == []
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]) and waits == [1]


def test_without_the_subclass_machinery_later_waits_at_once(monkeypatch):
    monkeypatch.setattr(pending, "AVAILABLE", False)
    waits: list = []
    t = in_flight(torch.tensor(2.0), waits)
    assert type(t) is torch.Tensor and waits == [1] and t.item() == 2.0


def test_a_failed_wait_raises_where_the_value_is_read():
    def finish():
        raise mt.errors.CommError("the call failed")

    t = later(Handle(finish, done=lambda: False), torch.empty(()))
    half = t / 2
    with pytest.raises(mt.errors.CommError, match="failed"):
        half.item()
