"""Gradient averaging for a wrapped ``torch.optim.Optimizer``, in flat buckets.

Parameters are packed, in reverse order (roughly the order backward produces
their gradients), into buckets of at most ``bucket_mb`` MiB per device and
dtype. With ``overlap=True`` a post-accumulate-grad hook on every parameter
marks it ready; a bucket is all-reduced, in the background, as soon as it and
every bucket before it are ready, while backward goes on. Buckets always go
out in index order, so every replica issues the same collectives in the same
order even when a parameter is unused on some replicas: at the end of
backward the remaining buckets go out, with zeros where a replica has no
gradient. Each bucket carries one "has a gradient" flag per parameter, so a
parameter unused on every replica keeps ``grad = None`` (the optimizer skips
it, exactly as in one process). Inside ``repl.no_sync()`` nothing is reduced
and gradients accumulate locally; the next synchronised backward averages
the accumulated sums. ``optimizer.step()`` averages anything not yet averaged
first, so ``overlap=False`` (or a backward that reached no parameter) is
still correct.

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
from concurrent.futures import Future

import torch

from meshtorch.errors import CommError
from meshtorch.replicator.channel import Channel


class _Bucket:
    __slots__ = ("params", "index", "future")

    def __init__(self, index: int):
        self.index = index
        self.params: list[torch.nn.Parameter] = []
        self.future: Future | None = None


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
    ):
        if bucket_mb <= 0:
            raise CommError(f"bucket_mb={bucket_mb} must be > 0 (MiB per gradient bucket)")
        self.optimizer = optimizer
        self.chan = chan
        self.axes = axes
        self.num_replicas = len(chan.comm.group(axes))
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.overlap = overlap
        self._no_sync = no_sync_flag
        self._handles: list = []
        self._build_buckets()
        self._reset_round()
        self.synced = False
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(optimizer.register_step_post_hook(self._after_step))

    # ------------------------------------------------------------- buckets
    def _params(self) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _build_buckets(self) -> None:
        for h in self._handles[2:]:
            h.remove()
        del self._handles[2:]
        open_: dict[tuple, _Bucket] = {}
        filled: dict[tuple, int] = {}
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        for p in reversed(self._params()):
            if p.is_sparse:
                raise CommError("wrap_optimizer averages dense gradients; a parameter is sparse")
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            b = open_.get(key)
            if b is None or (b.params and filled[key] + nbytes > self.bucket_bytes):
                b = open_[key] = _Bucket(len(self.buckets))
                self.buckets.append(b)
                filled[key] = 0
            b.params.append(p)
            filled[key] += nbytes
            self._bucket_of[id(p)] = b.index
            if self.overlap:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def refresh(self) -> None:
        """Re-read the optimizer's parameters (after ``add_param_group``)."""
        self._build_buckets()
        self._reset_round()

    def remove(self) -> None:
        """Detach every hook: the optimizer goes back to plain local steps."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -------------------------------------------------------------- rounds
    def _reset_round(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._callback_queued = False

    def _syncing(self) -> bool:
        return not (self._no_sync is not None and getattr(self._no_sync, "on", False))

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._syncing():
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._ready[self._bucket_of[id(p)]] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(
            self.buckets[self._next].params
        ):
            self._launch(self.buckets[self._next], background=True)
            self._next += 1

    def _launch(self, bucket: _Bucket, background: bool) -> None:
        params = bucket.params
        ref = params[0]
        parts = [torch.zeros(p.numel(), dtype=ref.dtype, device=ref.device) if p.grad is None
                 else p.grad.detach().reshape(-1) for p in params]
        parts.append(torch.tensor([0.0 if p.grad is None else 1.0 for p in params],
                                  dtype=ref.dtype, device=ref.device))
        flat = torch.cat(parts)
        chan, axes = self.chan, self.axes
        job = lambda: chan.all_reduce(flat, axes, "sum")
        if background:
            bucket.future = chan.submit(job)
        else:
            bucket.future = Future()
            bucket.future.set_result(chan.call(job))

    def _unpack(self, bucket: _Bucket) -> None:
        flat = bucket.future.result()
        bucket.future = None
        params = bucket.params
        flags = flat[-len(params):]
        avg = flat[: -len(params)].div_(self.num_replicas)
        offset = 0
        with torch.no_grad():
            for p, flag in zip(params, flags.tolist()):
                n = p.numel()
                if flag > 0:
                    # a view into the reduced bucket: no copy; the next backward accumulates into it
                    p.grad = avg[offset: offset + n].view_as(p)
                offset += n

    def _finish(self) -> None:
        # end of backward: send what is left, in bucket order, then install the averages
        try:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next], background=True)
                self._next += 1
            for b in self.buckets:
                self._unpack(b)
            self.synced = True
        finally:
            self._reset_round()

    def sync(self) -> None:
        """Average every gradient now (all replicas must call it)."""
        for b in self.buckets:
            self._launch(b, background=False)
            self._unpack(b)
        self._reset_round()
        self.synced = True

    # ---------------------------------------------------------- step hooks
    def _before_step(self, optimizer, args, kwargs) -> None:
        # torch passes the bound call's args: (optimizer,) or (optimizer, closure)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            if not self.overlap:
                raise CommError(
                    "optimizer.step(closure) with overlap=False cannot average the gradients the "
                    "closure computes; wrap the optimizer with overlap=True"
                )
            return  # the closure's backward averages through the hooks
        if not self.synced:
            self.sync()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.synced = False
