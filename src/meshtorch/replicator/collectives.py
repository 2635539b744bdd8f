"""Differentiable cross-replica collectives for code inside ``step_fn``.

Each replica's loss is its own, and the Replicator averages gradients, so the
objective is the mean of the replica losses. The adjoint of "every replica
receives the same value" is therefore "sum the gradients every replica sends
back": ``all_reduce`` backward is an all_reduce of the gradients,
``broadcast`` backward sums them into the source replica, and ``all_gather``
backward reduce-scatters them. With these, SyncBatchNorm and any user
statistic over the global batch train exactly as one process on that batch.

The autograd Functions are those of :mod:`meshtorch.lowering.adapters` with
``grad_sum=True``, run on the replica channel's ordered collectives
(:attr:`Channel.ordered <meshtorch.replicator.channel.Channel.ordered>`), so
they queue behind gradient buckets still in flight.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.replicator.channel import channel_for
    >>> from meshtorch.replicator.collectives import all_reduce
    >>> def f():
    ...     x = torch.tensor([1.0 + mt.current().rank], requires_grad=True)
    ...     y = all_reduce(x, channel_for(mt.current().comm), ("replica",), "sum")
    ...     (y * y).sum().backward()            # d/dx of sum over replicas of y^2
    ...     return y.item(), x.grad.item()
    >>> mt.launch(f, mesh="replica:2")
    [(3.0, 12.0), (3.0, 12.0)]
"""

from __future__ import annotations

import torch

from meshtorch.errors import CommError
from meshtorch.lowering import adapters as ca
from meshtorch.replicator.channel import Channel

OPS = ("sum", "mean", "max", "min")


def _tensor(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (int, float, bool)):
        return torch.tensor(float(x))
    raise CommError(f"{what} needs a torch.Tensor or a number, got {type(x).__name__}")


def all_reduce(x: torch.Tensor, chan: Channel, axes: tuple[str, ...], op: str = "sum") -> torch.Tensor:
    """``op`` ∈ sum|mean|max|min of ``x`` over the replicas; the same on every replica."""
    if op not in OPS:
        raise CommError(f"all_reduce op {op!r} is not one of {OPS}")
    t = _tensor(x, "all_reduce")
    if op in ("sum", "mean"):
        out = ca.all_reduce_sum(t, chan.ordered, axes, grad_sum=True)
        return out / len(chan.comm.group(axes)) if op == "mean" else out
    return ca.all_reduce_extreme(t, chan.ordered, axes, op, grad_sum=True)


def broadcast(x: torch.Tensor, chan: Channel, axes: tuple[str, ...], src: int = 0) -> torch.Tensor:
    """Replica ``src``'s ``x`` on every replica."""
    n = len(chan.comm.group(axes))
    if not 0 <= src < n:
        raise CommError(f"broadcast src={src} is not a replica id; there are {n} replicas (0..{n - 1})")
    return ca.broadcast(_tensor(x, "broadcast"), chan.ordered, axes, src, grad_sum=True)


def all_gather(x: torch.Tensor, chan: Channel, axes: tuple[str, ...], dim: int = 0) -> torch.Tensor:
    """Every replica's ``x`` concatenated along tensor dim ``dim``, in replica order.
    Every replica must pass the same shape."""
    t = _tensor(x, "all_gather")
    if t.dim() == 0:
        t = t.reshape(1)
    return ca.all_gather(t, chan.ordered, axes, dim % t.dim())
