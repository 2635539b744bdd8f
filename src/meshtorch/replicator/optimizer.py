"""Gradient averaging for a wrapped ``torch.optim.Optimizer``, in flat buckets.

Parameters are packed, in reverse order (roughly the order backward produces
their gradients), into buckets of at most ``bucket_mb`` MiB per device and
dtype. Each bucket owns one flat buffer, allocated once: the parameters'
gradient slots followed by one "has a gradient" flag per parameter. After
the first synchronised backward every ``p.grad`` *is* a view into its
bucket's buffer, so averaging needs no copy-in/copy-out.

With ``overlap=True`` (the default) a post-accumulate-grad hook on every
parameter writes ``grad / num_replicas`` into the parameter's slot (one pass
over the gradient; nothing when the gradient already lives there), points ``p.grad``
at the slot, and, once a bucket and every bucket before it are complete,
sends the bucket off:

- on the torch backend (gloo or NCCL, no ``check``) as
  ``torch.distributed.all_reduce(buffer, async_op=True)`` straight from the
  hook, so the transfer runs on the process group's own C++ threads while
  backward goes on — no Python thread competes for the GIL, as with DDP's
  C++ reducer. A callback queued on the autograd engine waits for the
  buckets at the end of backward;
- on the threads backend (and with ``check=True``) through the replica's
  ordered :class:`~meshtorch.replicator.channel.Channel`, on its background
  thread.

With ``overlap=False`` the hooks only queue that callback, which then sends
every bucket at the end of backward: nothing is in flight while backward
runs, yet code between ``backward()`` and ``step()`` (``clip_grad_norm_``)
sees averaged gradients either way, as in one process.

Buckets always go out in index order, so every replica issues the same
collectives in the same order even when a parameter is unused on some
replicas: at the end of backward the remaining buckets go out, with zeros
where a replica has no gradient. The flags are summed with the gradients, so
a parameter unused on every replica keeps ``grad = None`` (the optimizer
skips it, exactly as in one process). Inside ``repl.no_sync()`` nothing is
reduced and gradients accumulate locally; the next synchronised backward
averages the accumulated sums. ``optimizer.step()`` averages anything not
yet averaged first (a backward that reached no parameter). When the
optimizer's trainable parameters change (a frozen module unfrozen,
``add_param_group``) ``step()`` re-buckets first.

As with DDP's ``gradient_as_bucket_view``, a gradient tensor kept across
steps is overwritten by the next synchronised backward; ``.clone()`` it to
keep it.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     repl = mt.Replicator(device="cpu")
    ...     with repl.context():
    ...         w = torch.nn.Parameter(torch.zeros(2))
    ...         opt = repl.wrap_optimizer(torch.optim.SGD([w], lr=1.0))
    ...     (w * (repl.replica_id + 1)).sum().backward()   # grads 1 and 2: mean 1.5
    ...     opt.step()
    ...     return w.tolist()
    >>> mt.launch(f, mesh="replica:2")
    [[-1.5, -1.5], [-1.5, -1.5]]
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from meshtorch.errors import CommError
from meshtorch.replicator.channel import Channel


class _Bucket:
    __slots__ = ("index", "params", "first", "views", "buffer", "flags", "async_ok", "pending")

    def __init__(self, index: int, params: list[torch.nn.Parameter], first: int):
        self.index = index
        self.params = params
        self.first = first  # index of params[0] among all the optimizer's parameters
        ref = params[0]
        total = sum(p.numel() for p in params)
        self.buffer = torch.zeros(total + len(params), dtype=ref.dtype, device=ref.device)
        self.flags = self.buffer[total:]
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset: offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.async_ok = False
        # a torch.distributed Work, a Future of the channel, or None
        self.pending: object = None


class GradientSync:
    """Averages one optimizer's gradients over the replicas (see module docstring).

    Built by :meth:`Replicator.wrap_optimizer`; the optimizer object itself is
    returned unchanged in type, so LR schedulers and ``state_dict`` work as usual.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        chan: Channel,
        axes: tuple[str, ...],
        bucket_mb: float = 25.0,
        overlap: bool = True,
        no_sync_flag: threading.local | None = None,
        broadcast: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        if bucket_mb <= 0:
            raise CommError(f"bucket_mb={bucket_mb} must be > 0 (MiB per gradient bucket)")
        self.optimizer = optimizer
        self.chan = chan
        self.axes = axes
        self.num_replicas = len(chan.comm.group(axes))
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.overlap = overlap
        self._no_sync = no_sync_flag if no_sync_flag is not None else threading.local()
        # makes parameters that join after wrapping equal on every replica (see _before_step)
        self._broadcast = broadcast
        # wrapped again (a helper wrapped it already, or a new bucket size): the old hooks would
        # divide every gradient a second time, so the new averaging replaces the old
        previous = getattr(optimizer, "_meshtorch_gradient_sync", None)
        if previous is not None:
            previous.remove()
        optimizer._meshtorch_gradient_sync = self
        self._grad_hooks: list = []
        self._build_buckets()
        self._reset_round()
        self.synced = False
        self._step_hooks = [optimizer.register_step_pre_hook(self._before_step),
                            optimizer.register_step_post_hook(self._after_step)]

    # ------------------------------------------------------------- buckets
    def _params(self) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _async_group(self, device: torch.device):
        """The process group to all-reduce a bucket on ``device`` asynchronously, or None.

        Only the torch backend has asynchronous collectives. ``check=True`` must
        compare every collective first, which the communicator does synchronously,
        and a bucket away from the communicator's device (NCCL wants
        ``cuda:<local rank>``) must be moved by it: both take the channel.
        """
        comm = self.chan.comm
        if comm.backend != "torch" or comm.check or device != getattr(comm, "device", None):
            return None
        return comm.process_group(self.axes)

    def _build_buckets(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        groups: dict[tuple, list[list[torch.nn.Parameter]]] = {}
        filled: dict[tuple, int] = {}
        order: list[tuple[tuple, int]] = []
        params = self._params()
        self._bucketed = [id(p) for p in params]
        for p in reversed(params):
            if p.is_sparse:
                raise CommError("wrap_optimizer averages dense gradients; a parameter is sparse")
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            lists = groups.setdefault(key, [])
            if not lists or filled[key] + nbytes > self.bucket_bytes:
                lists.append([])
                order.append((key, len(lists) - 1))
                filled[key] = 0
            lists[-1].append(p)
            filled[key] += nbytes
        self.buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[int, int, torch.Tensor]] = {}
        first = 0
        for key, k in order:
            b = _Bucket(len(self.buckets), groups[key][k], first)
            b.async_ok = self._async_group(b.buffer.device) is not None
            self.buckets.append(b)
            for j, p in enumerate(b.params):
                self._slot[id(p)] = (b.index, first + j, b.views[j])
            first += len(b.params)
        self._num_params = first
        self._group = self._async_group(self.buckets[0].buffer.device) if self.buckets else None
        # one replica: its gradients are already the average; nothing to hook. Without overlap
        # the hooks only queue the end-of-backward averaging: code between backward() and
        # step() (clip_grad_norm_) must see the average, as in one process
        if self.num_replicas > 1:
            for b in self.buckets:
                for p in b.params:
                    self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def refresh(self) -> None:
        """Re-read the optimizer's parameters (after ``add_param_group``)."""
        self._build_buckets()
        self._reset_round()

    def remove(self) -> None:
        """Detach every hook: the optimizer goes back to plain local steps."""
        for h in self._grad_hooks + self._step_hooks:
            h.remove()
        self._grad_hooks.clear()
        self._step_hooks.clear()
        if getattr(self.optimizer, "_meshtorch_gradient_sync", None) is self:
            del self.optimizer._meshtorch_gradient_sync

    # -------------------------------------------------------------- rounds
    def _reset_round(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._prepared = [False] * self._num_params
        self._next = 0
        # the backward (autograd graph task) whose end-of-backward callback is queued
        self._task: int | None = None
        self._heard: set[int] = set()  # ids of the parameters whose hook ran this round

    def _put(self, p: torch.Tensor, view: torch.Tensor) -> bool:
        """Move ``p``'s gradient, divided by the replica count, into its bucket slot."""
        g = p.grad
        if g is None:
            return False
        # backward(create_graph=True) runs hooks with grad mode on; averaging is not
        # differentiated (as with DDP)
        with torch.no_grad():
            if g is view:
                # accumulated in place (zero_grad(set_to_none=False), or no_sync micro-batches)
                view.div_(self.num_replicas)
            else:
                if g.layout != torch.strided:
                    raise CommError("wrap_optimizer averages dense gradients; a parameter got a "
                                    f"{g.layout} gradient (e.g. nn.Embedding(sparse=True)); use a "
                                    "dense one")
                # dividing while copying: one pass, and the sum of the replicas is the mean
                torch.div(g, self.num_replicas, out=view)
                p.grad = view
        return True

    def _on_grad(self, p: torch.Tensor) -> None:
        if getattr(self._no_sync, "on", False):
            return
        task = torch._C._current_graph_task_id()
        if task != self._task and (self._task is None or id(p) in self._heard):
            if self._task is not None:
                # a parameter heard again in another backward: the one that queued the last
                # callback raised before its end; start afresh
                self._reset_round()
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        # (another backward whose parameters are not heard yet is nested in the round's:
        # reentrant activation checkpointing runs the segment's backward as one; its gradients
        # join the round, whose callback comes at the outer backward's end. Starting afresh
        # there put the parameters already in their slots again: their gradients halved, review15b)
        self._heard.add(id(p))
        if not self.overlap:
            return
        b, i, view = self._slot[id(p)]
        self._prepared[i] = self._put(p, view)
        self._ready[b] += 1
        buckets = self.buckets
        while self._next < len(buckets) and self._ready[self._next] == len(buckets[self._next].params):
            self._launch(buckets[self._next], background=True)
            self._next += 1

    def _launch(self, b: _Bucket, background: bool) -> None:
        # parameters whose hook did not put them this round: unused in this backward (their
        # gradient may still hold no_sync sums), or overlap=False
        present = True
        flags = []
        for j, (p, view) in enumerate(zip(b.params, b.views)):
            has = self._prepared[b.first + j] or self._put(p, view)
            if not has:
                view.zero_()
                present = False
            flags.append(1.0 if has else 0.0)
        if present:
            b.flags.fill_(1.0)
        else:
            b.flags.copy_(torch.tensor(flags, dtype=b.flags.dtype))
        if b.async_ok:
            comm = self.chan.comm
            comm.stats.record("all_reduce", self.axes, b.buffer.numel() * b.buffer.element_size())
            try:
                b.pending = torch.distributed.all_reduce(b.buffer, group=self._group, async_op=True)
            except RuntimeError as e:
                raise self._comm_error(b, e) from e
            return
        chan, axes, buf = self.chan, self.axes, b.buffer
        job = lambda: chan.all_reduce(buf, axes, "sum")  # noqa: E731
        if background:
            b.pending = chan.submit(job)
        else:
            b.pending = chan.call(job)

    def _comm_error(self, b: _Bucket, e: BaseException) -> CommError:
        return CommError(
            f"gradient all_reduce of bucket {b.index} ({b.buffer.numel() * b.buffer.element_size()} "
            f"bytes) over axes {self.axes} failed: {str(e).strip()}. Every replica must run the same "
            "backward()/optimizer.step() calls; a replica that skipped one, exited or crashed leaves "
            "the others waiting"
        )

    def _wait(self, b: _Bucket) -> None:
        pending, b.pending = b.pending, None
        if isinstance(pending, Future):
            pending = pending.result()
        if isinstance(pending, torch.Tensor):
            if pending is not b.buffer:
                b.buffer.copy_(pending)
        elif pending is not None:
            try:
                pending.wait()
            except RuntimeError as e:
                raise self._comm_error(b, e) from e
        # the flags now count the replicas that had a gradient; they are read (a device sync) only
        # for a bucket with a parameter unused here, whose gradient exists if another replica's does
        if any(p.grad is not view for p, view in zip(b.params, b.views)):
            for p, view, count in zip(b.params, b.views, b.flags.tolist()):
                if count > 0 and p.grad is not view:
                    p.grad = view

    def _finish(self) -> None:
        # end of backward: send what is left, in bucket order, then wait for all
        try:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next], background=True)
                self._next += 1
            for b in self.buckets:
                self._wait(b)
            self.synced = True
        finally:
            self._reset_round()

    def sync(self) -> None:
        """Average every gradient now (all replicas must call it)."""
        if self.num_replicas > 1:
            try:
                for b in self.buckets:
                    self._launch(b, background=False)
                for b in self.buckets:
                    self._wait(b)
            finally:
                self._reset_round()
        self.synced = True

    # ---------------------------------------------------------- step hooks
    def _rebucket_if_changed(self) -> bool:
        """Re-bucket when the trainable parameters differ from the buckets' (a frozen
        module unfrozen, ``add_param_group``): their gradients would otherwise stay local
        and the replicas drift apart. Every replica runs the same code, so all notice it
        at the same step. Parameters new to the buckets are broadcast from replica 0."""
        # (one comprehension per step, no dict: torch refuses a parameter in two groups)
        groups = self.optimizer.param_groups
        if [id(p) for g in groups for p in g["params"] if p.requires_grad] == self._bucketed:
            return False
        params = self._params()
        before = set(self._bucketed)
        self.refresh()
        if self._broadcast is not None and self.num_replicas > 1:
            self._broadcast([p for p in params if id(p) not in before])
        return True

    def _before_step(self, optimizer, args, kwargs) -> None:
        # torch passes the bound call's args: (optimizer,) or (optimizer, closure)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if self._rebucket_if_changed() and closure is None:
            # gradients already averaged stay the mean when averaged again; the new ones join
            self.sync()
            return
        if closure is not None:
            return  # the closure's backward averages through the hooks
        if not self.synced:
            self.sync()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.synced = False
