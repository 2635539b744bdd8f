"""``mt.Replicator``: TF-Replicator's API for plain ``torch.nn`` code.

One replica runs on each processor of the current mesh (a 1-D ``replica``
mesh, as :func:`meshtorch.replicator.launch_replicas` makes); each builds its own
model, feeds it its own share of the batch and averages gradients with the
others before every optimizer step. The same script runs on the threads
backend (``mt.launch``), the torch backend (``meshtorch launch --backend torch`` /
torchrun), and as a plain one-replica ``python script.py``.

Example:
    >>> import torch, meshtorch as mt
    >>> def main():
    ...     repl = mt.Replicator(device="cpu")
    ...     with repl.context():
    ...         model = torch.nn.Linear(2, 1)
    ...         opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ...     def input_fn(ctx):
    ...         return torch.full((4, 2), float(ctx.replica_id))
    ...     def step_fn(x):
    ...         loss = model(x).pow(2).mean()
    ...         opt.zero_grad(); loss.backward(); opt.step()
    ...         return loss
    ...     per_replica = repl.run(step_fn, input_fn)
    ...     return repl.reduce("mean", per_replica) == repl.reduce("mean", per_replica)
    >>> mt.replicator.launch_replicas(main, num_replicas=2)
    [tensor(True), tensor(True)]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from meshtorch.comm.base import as_axes
from meshtorch.context import current
from meshtorch.errors import CommError
from meshtorch.replicator import collectives
from meshtorch.replicator.batchnorm import convert_sync_batchnorm
from meshtorch.replicator.building import BuiltModules
from meshtorch.replicator.channel import channel_for
from meshtorch.replicator.data import ReplicaLoader
from meshtorch.replicator.device import host_random, resolve_device, to_device
from meshtorch.replicator.optimizer import GradientSync

# thread-replicas share torch's default generator: they build their models one at a time
_BUILD_LOCK = threading.Lock()


def _refuse_local_torch_syncbn(module: torch.nn.Module, args: tuple) -> None:
    if module.training:
        raise CommError(
            f"torch.nn.SyncBatchNorm({module.num_features}) needs torch.distributed's default process "
            "group, which these replicas (threads backend) do not have: it would normalise with each "
            "replica's own batch, silently. Convert it with model = repl.convert_sync_batchnorm(model) "
            "(inside repl.context()), whose statistics span every replica's batch")


def _refuse_max_norm(module: torch.nn.Embedding | torch.nn.EmbeddingBag, args: tuple) -> None:
    raise CommError(
        f"nn.{type(module).__name__}({module.num_embeddings}, {module.embedding_dim}, "
        f"max_norm={module.max_norm}) "
        "renormalises in place, in forward, the rows its input looks up: each replica would renormalise "
        "only its own rows and the replicas' weights drift apart. Build it with max_norm=None and "
        "before the forward renormalise the rows of every replica's ids: with torch.no_grad(): "
        "torch.embedding_renorm_(emb.weight, repl.all_gather(ids).flatten(), max_norm, norm_type) "
        "(what one process on the global batch does)")


@dataclass(frozen=True)
class ReplicaContext:
    """What ``input_fn`` is told about the replica it feeds."""

    replica_id: int
    num_replicas: int
    device: torch.device


class Replicator:
    """Data-parallel replicas of a plain ``torch.nn`` model, one per processor.

    Args:
        device: ``"auto"`` (CUDA, else MPS, else CPU), ``"cpu"``, ``"cuda"``,
            ``"mps"``, ``"cuda:1"`` or a ``torch.device``. With CUDA each replica
            takes the GPU of its local index.
        axes: mesh axes the replicas span; default every axis of the current mesh.
        seed: the seed :meth:`context` gives torch's RNG on every replica.

    Example:
        >>> import meshtorch as mt
        >>> mt.launch(lambda: mt.Replicator(device="cpu").replica_id, mesh="replica:3")
        [0, 1, 2]
    """

    def __init__(self, device: str | torch.device = "auto", axes: str | Iterable[str] | None = None,
                 seed: int = 0):
        ctx = current()
        self.comm = ctx.comm
        self.axes = tuple(ctx.mesh.axis_names) if axes is None else as_axes(axes)
        for a in self.axes:
            ctx.mesh.axis_size(a)
        self.replica_id = self.comm.position(self.axes)
        self.num_replicas = len(self.comm.group(self.axes))
        self.device = resolve_device(device, self.comm)
        self.seed = seed
        self.channel = channel_for(self.comm)
        self._syncs: list[GradientSync] = []
        self._to_broadcast: list[torch.Tensor] = []
        self._no_sync = threading.local()

    @property
    def replica_context(self) -> ReplicaContext:
        return ReplicaContext(self.replica_id, self.num_replicas, self.device)

    # ------------------------------------------------------------- building
    @contextmanager
    def context(self) -> Iterator[ReplicaContext]:
        """Build the model and optimizer here: identical initial weights everywhere.

        Inside the block torch's RNG is seeded with ``seed`` on every replica and
        factory functions default to the replica's device, while random numbers are
        drawn from the CPU's generator (:class:`~meshtorch.replicator.device.host_random`):
        the same seed gives the same initial weights on CPU, CUDA or MPS. The device
        mode covers only this block; the steps run without one. Thread-replicas share
        one process-wide generator, so they take turns through the block; it
        must therefore not call collectives (they raise ``CommError``). On
        leaving, the trainable parameters of optimizers wrapped inside are broadcast
        from replica 0, as DDP does: seeding makes the weights reproducible (equal to
        a one-process run with the same seed), the broadcast makes them equal even
        when construction is not deterministic or their values were loaded on
        replica 0 only. Buffers (BatchNorm's statistics) and frozen parameters are
        not broadcast: load a checkpoint on every replica. Then replicas past 0 get
        random streams of their own (independent dropout masks; on the torch backend
        everything drawn from torch's global generator after the block differs per
        replica: shard data with a generator of your own, as :meth:`distribute` does).

        Example:
            >>> import torch, meshtorch as mt
            >>> def f():
            ...     repl = mt.Replicator(device="cpu")
            ...     with repl.context():
            ...         return torch.nn.Linear(3, 1).weight.sum().item()
            >>> a, b = mt.launch(f, mesh="replica:2"); a == b
            True
        """
        with _BUILD_LOCK:
            self.channel.building = True
            try:
                with BuiltModules() as built:
                    torch.manual_seed(self.seed)
                    if self.device.type == "cpu":
                        yield self.replica_context
                    else:
                        with self.device, host_random():
                            yield self.replica_context
            finally:
                self.channel.building = False
                self._own_random_stream()
        # the models the optimizers wrapped here train get the guards (local forward hooks). Their
        # buffers are not broadcast: which modules belong to a model is a guess (a module built on
        # replica 0 only that wraps or ties the model joins it there alone), and a guess that
        # differs between replicas makes mismatched collectives, a hang on gloo (review15b)
        self._guard_unsupported(built.trained(self._to_broadcast))
        # also a barrier: no replica draws random numbers while another still builds
        self._broadcast_params(self._to_broadcast)
        self._to_broadcast = []

    def _guard_unsupported(self, modules: Iterable[torch.nn.Module]) -> None:
        """Modules built in :meth:`context` that would make replicas silently differ raise
        when run (a forward pre-hook, so one converted away or never run costs nothing):

        - ``torch.nn.SyncBatchNorm`` without torch.distributed's default process group
          (thread-replicas): its training forward uses the replica's own batch;
        - ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm``: its forward renormalises
          the replica's own rows.
        """
        if self.num_replicas == 1:
            return
        dist = torch.distributed
        local_syncbn = not (dist.is_available() and dist.is_initialized())
        for module in modules:
            if local_syncbn and isinstance(module, torch.nn.SyncBatchNorm):
                module.register_forward_pre_hook(_refuse_local_torch_syncbn)
            elif (isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                  and module.max_norm is not None):
                module.register_forward_pre_hook(_refuse_max_norm)

    def _own_random_stream(self) -> None:
        """After building, each replica past 0 draws (dropout) from a stream of its own.

        One process per replica (torch backend), all seeded alike, would otherwise
        draw the same dropout masks on every replica, where one process on the global
        batch draws independent ones. Replica 0 keeps the stream one process with
        ``seed`` has. Thread-replicas share one generator, whose draws already differ.
        """
        if self.replica_id > 0 and self.comm.backend != "threads":
            torch.manual_seed((self.seed * 1_000_003 + self.replica_id) % 2**63)

    def _broadcast_params(self, params: list[torch.Tensor]) -> None:
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        if not groups:
            groups[(self.device, torch.float32)] = []
        for (dev, dtype), ps in groups.items():
            flat = torch.cat([p.detach().reshape(-1) for p in ps]) if ps else torch.zeros(0, dtype=dtype,
                                                                                        device=dev)
            flat = self.channel.call(lambda f=flat: self.channel.broadcast(f, self.axes, 0))
            offset = 0
            with torch.no_grad():
                for p in ps:
                    p.copy_(flat[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, bucket_mb: float = 25.0,
                       overlap: bool = True) -> torch.optim.Optimizer:
        """Make ``optimizer.step()`` use gradients averaged over all replicas.

        Returns the same optimizer object (so LR schedulers and ``state_dict``
        work unchanged); wrapping it again replaces the earlier wrapping.
        Gradients live in flat buckets of ``bucket_mb`` MiB (``p.grad`` becomes a
        view into one: clone a gradient to keep it past the next backward); with
        ``overlap`` each bucket is all-reduced while backward still runs, without
        it all at the end of backward: either way gradients are averaged when
        ``backward()`` returns (clip them there as in one process). Unused
        parameters, :meth:`no_sync` accumulation and parameters that become
        trainable later are handled; see :mod:`meshtorch.replicator.optimizer`.

        Example:
            >>> import torch, meshtorch as mt
            >>> repl = mt.Replicator(device="cpu")
            >>> opt = repl.wrap_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
            >>> isinstance(opt, torch.optim.SGD)
            True
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise CommError(f"wrap_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        sync = GradientSync(optimizer, self.channel, self.axes, bucket_mb, overlap, self._no_sync,
                            broadcast=self._broadcast_params)
        # a second wrap of the same optimizer replaces the first (GradientSync removes its hooks)
        self._syncs = [s for s in self._syncs if s.optimizer is not optimizer] + [sync]
        params = [p for b in sync.buckets for p in b.params]
        if self.channel.building:
            self._to_broadcast.extend(params)
        else:
            self._broadcast_params(params)
        return optimizer

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages.

        Example:
            >>> import meshtorch as mt
            >>> with mt.Replicator(device="cpu").no_sync():
            ...     pass
        """
        prev = getattr(self._no_sync, "on", False)
        self._no_sync.on = True
        try:
            yield
        finally:
            self._no_sync.on = prev

    def convert_sync_batchnorm(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with every BatchNorm replaced by a :class:`SyncBatchNorm` over the replicas."""
        return convert_sync_batchnorm(module, axes=self.axes)

    # ------------------------------------------------------------- running
    def run(self, step_fn: Callable[..., Any], input_fn: Callable[[ReplicaContext], Any] | Iterator | None
            = None) -> Any:
        """One step on this replica: ``step_fn(input_fn(ctx))``, batch moved to the device.

        ``input_fn`` may also be an iterator (its next item is the batch) or
        ``None`` (``step_fn()`` takes no batch). Returns this replica's value.
        """
        if input_fn is None:
            return step_fn()
        batch = next(input_fn) if isinstance(input_fn, Iterator) else input_fn(self.replica_context)
        return step_fn(to_device(batch, self.device))

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``sum``/``mean``/``max``/``min`` of ``x`` over the replicas; differentiable.
        Every replica must call it (MPI semantics)."""
        return collectives.all_reduce(x, self.channel, self.axes, op)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Replica ``src``'s ``x`` on every replica; differentiable."""
        return collectives.broadcast(x, self.channel, self.axes, src)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every replica's ``x`` (same shape on all) concatenated along ``dim``; differentiable."""
        return collectives.all_gather(x, self.channel, self.axes, dim)

    def reduce(self, op: str, value: Any) -> Any:
        """Combine per-replica results (tensors, numbers, or lists/tuples/dicts of them).

        The result is the same on every replica and carries no autograd history;
        numbers come back as floats.
        """
        if op not in collectives.OPS:
            raise CommError(f"reduce op {op!r} is not one of {collectives.OPS}")
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                return collectives.all_reduce(value.detach(), self.channel, self.axes, op)
        if isinstance(value, (bool, int, float)):
            return self.reduce(op, torch.tensor(float(value), dtype=torch.float64)).item()
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(self.reduce(op, v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self.reduce(op, v) for v in value)
        if isinstance(value, dict):
            return {k: self.reduce(op, v) for k, v in value.items()}
        raise CommError(f"reduce cannot combine a {type(value).__name__}; give tensors or numbers")

    def distribute(self, dataset: Any, global_batch_size: int, shuffle: bool = False,
                   seed: int | None = None) -> ReplicaLoader:
        """This replica's disjoint share of ``dataset``, ``global_batch_size`` examples a step
        over all replicas; see :class:`~meshtorch.replicator.data.ReplicaLoader`."""
        return ReplicaLoader(dataset, global_batch_size, self.replica_id, self.num_replicas,
                             shuffle=shuffle, seed=self.seed if seed is None else seed, device=self.device)
