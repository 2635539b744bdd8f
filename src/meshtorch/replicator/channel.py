"""One replica's collectives, issued in program order, optionally in the background.

Gradient buckets are all-reduced while ``backward()`` is still running, so a
replica may have collectives in flight when another one (SyncBatchNorm's
backward, ``repl.all_reduce``) is issued. Every member of a group must issue
its collectives in the same order, so all of a replica's Replicator
collectives go through one :class:`Channel`: a FIFO executed by at most one
worker thread at a time. When nothing is pending, a call runs inline on the
caller's thread (no thread hop on the common path). (On the torch backend
without ``check``, gradient buckets skip the channel: they are asynchronous
``torch.distributed`` all_reduces, which the process group keeps in issue
order; see :mod:`meshtorch.replicator.optimizer`.)

The collective methods of a :class:`Channel` issue at once (for jobs already
running in order); :attr:`Channel.ordered` is the same set of collectives,
each waiting its turn, shaped like a communicator, so the differentiable
collectives of :mod:`meshtorch.lowering.adapters` run on it unchanged.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.replicator.channel import channel_for
    >>> def f():
    ...     chan = channel_for(mt.current().comm)
    ...     fut = chan.submit(lambda: chan.all_reduce(torch.ones(2), ("replica",), "sum"))
    ...     return fut.result().tolist()
    >>> mt.launch(f, mesh="replica:2")
    [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from meshtorch.comm.base import Communicator
from meshtorch.errors import CommError


class Channel:
    """The ordered collective queue of one processor's communicator."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self._lock = threading.Lock()
        self._queue: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._wake = threading.Condition(self._lock)
        self._pending = 0
        self._worker: threading.Thread | None = None
        self.linger_s = 2.0
        # set while repl.context() holds the model-building lock (see replicator.py)
        self.building = False
        self.ordered = OrderedCollectives(self)

    # -------------------------------------------------------------- ordering
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` (which issues collectives) behind everything already queued."""
        fut: Future = Future()
        with self._wake:
            self._queue.append((fut, fn))
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._drain, name=f"meshtorch-replica-{self.comm.rank}-comm", daemon=True
                )
                self._worker.start()
            self._wake.notify()
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after everything queued; inline when nothing is pending."""
        with self._lock:
            idle = self._pending == 0
        if idle:
            return fn()
        return self.submit(fn).result()

    def _drain(self) -> None:
        # the worker outlives one burst of buckets (a thread start per step would cost
        # more than it hides) but goes away when the replica stops training
        while True:
            with self._wake:
                if not self._queue:
                    self._wake.wait(self.linger_s)
                if not self._queue:
                    self._worker = None
                    return
                fut, fn = self._queue.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    fut.set_exception(e)
            with self._lock:
                self._pending -= 1

    # ----------------------------------------------------------- collectives
    def _check(self, kind: str) -> None:
        if self.building:
            raise CommError(
                f"{kind} called inside repl.context(): replicas build their models there one at "
                "a time (they share torch's random generator), so a collective there would wait "
                "forever for replicas still queued. Call it after the `with repl.context():` block"
            )

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        # thread-processors exchange tensors in host memory; replicas on different GPUs
        # could not be summed there, so stage device tensors through the CPU
        if self.comm.backend == "threads" and t.device.type != "cpu":
            return t.detach().cpu()
        return t.detach().contiguous()

    def all_reduce(self, t: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        self._check("all_reduce")
        return self.comm.all_reduce(self._staged(t), axes, op).to(t.device)

    def all_gather(self, t: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        self._check("all_gather")
        return self.comm.all_gather(self._staged(t), axes, dim).to(t.device)

    def reduce_scatter(self, t: torch.Tensor, axes: tuple[str, ...], dim: int, op: str = "sum"
                       ) -> torch.Tensor:
        self._check("reduce_scatter")
        return self.comm.reduce_scatter(self._staged(t), axes, dim, op).to(t.device)

    def broadcast(self, t: torch.Tensor, axes: tuple[str, ...], src: int) -> torch.Tensor:
        self._check("broadcast")
        return self.comm.broadcast(self._staged(t), axes, src).to(t.device)


class OrderedCollectives:
    """A channel's collectives, each issued after everything queued before it.

    Has the collective methods of a :class:`~meshtorch.comm.base.Communicator`
    (anything else, e.g. ``position`` or ``mesh``, is the communicator's), so it
    can stand in for one in :mod:`meshtorch.lowering.adapters`.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.replicator.channel import channel_for
        >>> def f():
        ...     ordered = channel_for(mt.current().comm).ordered
        ...     y = ordered.all_reduce(torch.ones(1), ("replica",), "max")
        ...     return y.item(), ordered.position("replica")
        >>> mt.launch(f, mesh="replica:2")
        [(1.0, 0), (1.0, 1)]
    """

    def __init__(self, chan: Channel):
        self.chan = chan

    def __getattr__(self, name: str) -> Any:
        if name == "chan":  # not yet set (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.chan.comm, name)

    def all_reduce(self, t: torch.Tensor, axes, op: str = "sum") -> torch.Tensor:
        chan = self.chan
        return chan.call(lambda: chan.all_reduce(t, axes, op))

    def all_gather(self, t: torch.Tensor, axes, dim: int) -> torch.Tensor:
        chan = self.chan
        return chan.call(lambda: chan.all_gather(t, axes, dim))

    def reduce_scatter(self, t: torch.Tensor, axes, dim: int, op: str = "sum") -> torch.Tensor:
        chan = self.chan
        return chan.call(lambda: chan.reduce_scatter(t, axes, dim, op))

    def broadcast(self, t: torch.Tensor, axes, src: int = 0) -> torch.Tensor:
        chan = self.chan
        return chan.call(lambda: chan.broadcast(t, axes, src))


_channels: weakref.WeakKeyDictionary[Communicator, Channel] = weakref.WeakKeyDictionary()
_channels_lock = threading.Lock()


def channel_for(comm: Communicator) -> Channel:
    """The one :class:`Channel` of ``comm`` (created on first use)."""
    with _channels_lock:
        chan = _channels.get(comm)
        if chan is None:
            chan = _channels[comm] = Channel(comm)
        return chan
