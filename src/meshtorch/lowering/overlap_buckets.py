"""Backward's half of :class:`~meshtorch.lowering.overlap_runtime.Runtime` (its base class): a
parameter's local gradient, once whole (autograd's post-accumulate hook: :meth:`GradientBuckets.ready`),
goes into a bucket; buckets are cut in reverse order of the step's forward reads, launched in order
as asynchronous grouped ``all_reduce`` (data parallel) or ``reduce_scatter`` (FSDP) calls while
backward goes on, and waited on at the end of ``backward()`` (:meth:`GradientBuckets.finish`), which
adds their results into ``p.grad`` (see :mod:`meshtorch.lowering.overlap`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from meshtorch.comm.base import Communicator, as_axes
from meshtorch.comm.grouped import Handle
from meshtorch.errors import ArgumentError, MeshTorchError

if TYPE_CHECKING:
    from meshtorch.lowering.overlap_runtime import Entry

FIRST_BUCKET = 2**20  # DDP's first bucket: the first reduction starts after the last layer's backward
MAX_SHARE = 4  # an all-reduce bucket holds at most 1 / MAX_SHARE of its kind's gradients
# a gather (and a bucket of gradients to reduce-scatter) at most 1 / GATHER_SHARE of the gathered
# bytes: a third, so that a model of a few blocks gathers a block at a time (a quarter cut a
# 2-block LM's blocks in two, and its peak fell in a window where gloo's staging of a gather in
# flight lives as long as the other processor takes to join it, which the planner cannot know)
GATHER_SHARE = 3
MAX_PENDING = 1  # gradient buckets holding bytes in flight (waited on before another one is launched)
# a flat tensor cut into views of the shapes of a list of tensors, in one call (private: DDP's,
# through torch._utils._unflatten_dense_tensors); without it, split and a view per piece
_unflatten = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)


def bytes_per_key(keys: dict) -> dict:
    """``keys`` (entry -> its bucket key): each key's bytes, summed over its entries."""
    totals: dict = {}
    for e, key in keys.items():
        totals[key] = totals.get(key, 0) + e.nbytes
    return totals


def _adopted(members: Sequence[Entry]) -> bool:
    """Whether :meth:`GradientBuckets._add` makes a bucket's reduced values its members' gradients
    as they are (views of the call's result, no copy): each parameter once, of its own dtype,
    none with a gradient to add into."""
    return _no_grads(members) and _distinct(members)


def _distinct(members: Sequence[Entry]) -> bool:
    """What :func:`_adopted` asks of a bucket besides ``p.grad`` (fixed with the cut: each
    parameter once, of its leaf's dtype)."""
    return len({id(e.param) for e in members}) == len(members) and all(
        e.leaf.dtype == e.param.dtype for e in members)


def _no_grads(members: Sequence[Entry]) -> bool:
    """Whether no member's parameter has a gradient (the rest of :func:`_adopted`)."""
    for e in members:  # (a loop: no Python call per member)
        if e.param.grad is not None:
            return False
    return True


def _pieces(flat: torch.Tensor, layout: list) -> Sequence[torch.Tensor]:
    """A bucket's flat buffer (or result) cut into its members' places (views, of their leaves'
    shapes). (torch's unflatten makes an empty member a new 1-d tensor, not of its shape.)"""
    if _unflatten is not None and 0 not in layout[0]:
        return _unflatten(flat, layout[3])
    return [g.view(t.shape) for g, t in zip(flat.split_with_sizes(layout[0]), layout[3])]


def _holds(members: Sequence[Entry]) -> bool:
    """Whether a launched bucket holds bytes that waiting on it frees: a reduce_scatter's, or an
    all_reduce's whose reduced values do not become the gradients as they are (:func:`_adopted`)."""
    return members[0].kind != "all_reduce" or not _adopted(members)


def gather_cap(gather_bytes: int, total: int) -> int:
    """The bytes a grouped gather (and a bucket of gradients to reduce-scatter, which follows the
    gathers) holds at most, of ``total`` gathered bytes of its kind (``gather_mb``: ``gather_bytes``)."""
    return min(gather_bytes, max(FIRST_BUCKET, total // GATHER_SHARE))


class Cut:
    """The rule that cuts a backward's gradients into buckets, told them one at a time in backward
    order, and a step's gathered parameters into grouped gathers, told them in forward order: the
    runtime's (:meth:`GradientBuckets._cut_buckets`, ``Runtime._end_step``) and the planner's,
    which counts the buckets of a deep model from two shallow traces (:mod:`meshtorch.plan.layered`)
    with it.

    ``caps``: (``bucket_mb``'s bytes, ``gather_mb``'s, :data:`FIRST_BUCKET`, :data:`MAX_SHARE`,
    :data:`GATHER_SHARE`); ``totals``: each key's bytes in all. A key is (kind, axes, dtype,
    device): gradients of one key share buckets, one open at a time; a gradient goes into its
    key's open bucket unless that would pass the bucket's cap (or it starts a checkpointed block's
    region, ``edge``, for gradients to reduce-scatter and gathers), and then into a new one. A
    kind other than ``all_reduce`` is capped as gathers (:func:`gather_cap`). ``mark``: the item
    makes its bucket count in :attr:`marked` (a gather's bucket gathered again in backward once
    any of its members is: ``Runtime._refetch``).

    Example (all-reduce buckets of 1 MB at most, the first one too):
        >>> from meshtorch.lowering.overlap_buckets import Cut
        >>> key, mb = ("all_reduce", ("b",), None, None), 2**20
        >>> rule = Cut((mb, 4 * mb, mb, 4, 3), {key: 3 * mb})
        >>> [rule.add(key, mb // 2) for _ in range(5)], rule.count
        ([0, 0, 1, 1, 2], {('all_reduce', ('b',), None, None): 3})

    Grouped gathers of 1 MB at most (a third of 3 MB), the second one gathered again in backward
    (one call more):
        >>> key = ("all_gather", ("b",), None, None)
        >>> rule = Cut((mb, mb, mb, 4, 3), {key: 3 * mb})
        >>> [rule.add(key, mb // 2, False, i in (2, 3)) for i in range(6)], rule.calls()
        ([0, 0, 1, 1, 2, 2], {('all_gather', ('b',), None, None): 4})
    """

    def __init__(self, caps: tuple, totals: dict):
        self.caps, self.totals = caps, totals
        self.size: dict = {}  # key -> bytes in its open bucket
        self.count: dict = {}  # key -> its buckets so far
        self.open: dict = {}  # key -> the index of its open bucket
        self.buckets = 0  # buckets of every key so far
        self.marked: dict = {}  # key -> its buckets holding a marked item so far
        self.marks: dict = {}  # key -> whether its open bucket holds a marked item

    def cap(self, key) -> int:
        """The bytes the open bucket of ``key`` holds at most."""
        bucket_bytes, gather_bytes, first, share, _ = self.caps
        if key[0] != "all_reduce":
            return gather_cap(gather_bytes, self.totals[key])
        cap = min(bucket_bytes, first) if self.count.get(key) == 1 else bucket_bytes
        return min(cap, max(first, self.totals[key] // share))

    def add(self, key, nbytes: int, edge: bool = False, mark: bool = False) -> int:
        """The bucket (an index, in order of making) of the next gradient, of ``key`` and
        ``nbytes``; ``edge``: it starts a checkpointed block's region; ``mark``: see the class."""
        size = self.size.get(key)
        if size is None or (size + nbytes > self.cap(key) or edge) and size:
            self.open[key], size = self.buckets, 0
            self.count[key] = self.count.get(key, 0) + 1
            self.buckets += 1
            self.marks[key] = False
        self.size[key] = size + nbytes
        if mark:
            self._mark(key)
        return self.open[key]

    def _mark(self, key) -> None:
        if not self.marks[key]:
            self.marks[key] = True
            self.marked[key] = self.marked.get(key, 0) + 1

    def room(self, key) -> int:
        """Bytes of ``key`` that its open bucket takes without a cut, whatever their sizes."""
        size = self.size.get(key)
        return 0 if size is None else max(0, self.cap(key) - size)

    def fill(self, key, nbytes: int, mark: bool = False) -> None:
        """Put ``nbytes`` of ``key`` into its open bucket (at most :meth:`room`: no cut), marked
        (``mark``) or not."""
        self.size[key] += nbytes
        if mark:
            self._mark(key)

    def state(self) -> tuple:
        """What the next cuts depend on (besides the gradients still to come)."""
        return tuple((key, size, min(self.count[key], 2), self.marks[key])
                     for key, size in self.size.items())

    def calls(self) -> dict:
        """Calls per key so far: a call per bucket, and one more per marked bucket (a gather's
        bucket gathered again in backward)."""
        return {key: n + self.marked.get(key, 0) for key, n in self.count.items()}


def _tell_tracer(items: list, caps: tuple) -> None:
    """Tell this processor's tracer (the planner's) a backward's gradients as :class:`Cut` took
    them, ``(key, bytes, edge)`` in backward order (or a step's gathered parameters, ``(key,
    bytes, edge, mark)`` in forward order), and the caps: what a deeper model's buckets are
    counted from (:mod:`meshtorch.plan.layered`)."""
    from meshtorch.context import current, traced  # (above this module: imported when needed)

    if not traced:  # nothing traces (a run): no processor's context to ask
        return
    told = getattr(current().tracer, "cut_buckets", None)
    if told is not None:
        told(items, caps)


def _second_order(e: Entry) -> None:
    """A gradient with an autograd graph of its own (``backward(create_graph=True)``) came to ``e``'s
    leaf: the buckets' collectives are not differentiable, so its second-order gradient would be lost."""
    raise MeshTorchError(
        f"backward(create_graph=True) inside mt.overlap(): the gradient of a parameter reduced by "
        f"{e.kind} over {e.axes!r} has a graph, which mt.overlap()'s bucketed {e.kind} cannot "
        "differentiate (its second-order gradient would be lost). Run the higher-order gradient "
        "(a Hessian-vector product, a penalty on parameters' gradients) outside mt.overlap(), or "
        "with mt.overlap(enabled=False), where every layout's collectives are differentiable; "
        "torch.autograd.grad(..., create_graph=True) with respect to activations or inputs works inside")


class GradientBuckets:
    """The gradient buckets of one processor's :class:`~meshtorch.lowering.overlap_runtime.Runtime`,
    which derives from this class and keeps this step's entries (``order``), its ``generation``
    and the forward's grouped gathers (whose size, ``gather_bytes``, the buckets of gradients to
    reduce-scatter follow)."""

    # the Runtime's
    comm: Communicator
    order: list[Entry]
    generation: int
    gather_bytes: int

    def _end_step(self) -> None:
        """The Runtime's: the step ends (its gathered reads kept as the next step's plan)."""
        raise NotImplementedError

    def __init__(self) -> None:
        # launched gradient buckets: their members, the call, and where it is the bucket's flat
        # buffer whole, the bucket's layout (below: the members' sizes to cut its result into)
        self.pending: list[tuple[list[Entry], Handle, list | None]] = []
        self.waiting: list[int] = []  # per bucket, its members whose gradient has not come yet
        self.bucket_bytes = 25 * 2**20
        # the last cut (entries in order, caps, buckets, each entry's bucket, each bucket's flat
        # layout): data parallel's entries last across steps, and a step that reads the same ones
        # in the same order cuts the same buckets
        self.cut: tuple | None = None
        # per bucket of gradients to all-reduce, [its members' sizes, its prepared call (made at
        # its first launch of a whole buffer: a FlatAllReduce), whether it holds each parameter
        # once, of its leaf's dtype (_distinct), its members' leaves], kept with the cut; else None
        self.layouts: list[list | None] = []
        self._new_backward()

    def _new_backward(self) -> None:
        """No bucket yet: made at the next backward's first gradient."""
        self.buckets: list[list[Entry]] | None = None  # this backward's buckets
        self.launched = 0
        self.finishing = False
        self.callback_missing = False  # no engine callback: finish once every gradient has come
        # entries whose gradient came in this backward (kept without the engine's callback alone)
        self.arrived: set[Entry] = set()
        # all_reduce bucket -> its flat buffer and its members' places there
        self.packs: dict[int, tuple[torch.Tensor, dict]] = {}

    def ready(self, e: Entry, leaf: torch.Tensor | None = None) -> None:
        """``e``'s leaf has its whole local gradient (autograd's post-accumulate hook, which passes
        the leaf) in the step that last read ``e`` (``e.step``)."""
        leaf = e.leaf  # (the hook's argument, the same leaf)
        g = leaf.grad
        if g is not None and g.requires_grad:
            _second_order(e)
        leaf.grad = None
        slot = e.slot
        if slot is not None and g is not None and e.step == self.generation:
            # data parallel's usual gradient: its first in this backward, into its place in its
            # bucket's buffer (made at the bucket's first gradient, :meth:`_pack`). One frame and
            # one call, the copy: a hook runs right after the kernel that made the gradient, with
            # cold caches, where a Python call costs several times its warm price (the general
            # path below makes 4 frames and about 20 calls)
            slot.copy_(g)
            del g
            e.slot = None
            e.grad = slot
            k = e.bucket
            left = self.waiting[k] - 1
            self.waiting[k] = left
            if not left and k == self.launched:
                self._launch(flush=False)
            if self.callback_missing:
                self._arrive(e)
            return
        if g is None:
            return
        generation = e.step
        if e.param is None:  # a lasting entry that this step did not read: a graph of an earlier step
            e.param = e.ref()
            if e.param is None:
                return  # its parameter is gone
            try:
                self._reduce_alone(e, g)
            finally:
                e.param = None
            return
        if generation != self.generation or e.bucket is None and self.buckets is not None:
            # a backward through a graph of an earlier step (retain_graph): reduce it alone
            self._reduce_alone(e, g)
            return
        if self.buckets is None:
            self._cut_buckets()
            self._queue_finish()
        if e.bucket is None:  # not read in this step's forward (no bucket of its own): alone
            self._reduce_alone(e, g)
            return
        if e.grad is None and e.bucket >= self.launched:
            self.waiting[e.bucket] -= 1
        if e.kind == "all_reduce":
            e.grad = self._pack(e, g)
        else:
            e.grad = g if e.grad is None else e.grad + g
            if e.gathered:
                e.free()  # its last use has run backward
        del g  # held by the entry (or the bucket it launches) alone: released once packed
        k = self.launched
        if k < len(self.buckets) and not self.waiting[k]:  # (the next bucket complete: one call fewer else)
            self._launch(flush=False)
        if self.callback_missing:
            self._arrive(e)

    def _arrive(self, e: Entry) -> None:
        """Without the engine's callback: ``e``'s gradient came; the last one finishes the step."""
        self.arrived.add(e)
        if len(self.arrived) == len(self.order):
            self.finish()

    def _reduce_alone(self, e: Entry, g: torch.Tensor) -> None:
        """Reduce ``e``'s gradient ``g`` by itself, outside the buckets, and add it now."""
        self._add([e], self._start(e.kind, e.axes, [e], [g]).wait())

    def _pack(self, e: Entry, g: torch.Tensor) -> torch.Tensor:
        """``e``'s gradient ``g`` copied into its place in its bucket's flat buffer (made at the
        bucket's first gradient), as DDP's buckets: the bucket's all_reduce runs on that buffer
        (:meth:`~meshtorch.comm.base.FlatAllReduce.start`), so its gradients are never held
        twice, unreduced and packed."""
        k = e.bucket
        pack = self.packs.get(k)
        if pack is None:
            pack = self.packs[k] = self._buffer(k, g)
            for m, view in pack[1].items():
                if m is not e and m.grad is None:
                    m.slot = view  # its first gradient goes straight there (ready's first branch)
        slot = pack[1][e]
        if e.grad is None:
            slot.copy_(g)
        else:
            slot.add_(g)
        return slot

    def _buffer(self, k: int, g: torch.Tensor) -> tuple:
        """Bucket ``k``'s flat buffer for gradients like ``g`` and its members' places there:
        ``(flat, {entry: view})``, made afresh each step. (Kept across steps as
        DDP keeps its buckets, the gradients' bytes are no longer freed at ``zero_grad`` for the
        forward to use: on the CPU's allocator (glibc) the forward and backward then page-faulted
        more than the kept buffers saved, +2-3 ms of kernel time a step on issue 27's LM.)"""
        layout = self.layouts[k]
        flat = torch.empty(sum(layout[0]), dtype=g.dtype, device=g.device)
        return flat, dict(zip(self.buckets[k], _pieces(flat, layout)))  # (one call, its members' views)

    def _cut_buckets(self) -> None:
        """Buckets in reverse order of forward reads, per (kind, axes, dtype), each up to its cap:
        gradients to all-reduce as DDP's (``bucket_mb``, the first at most 1 MB), gradients to
        reduce-scatter as FSDP2's, about a block's parameters (``gather_mb``, as their gathers),
        ending at a checkpointed block's edges as the gathers do (see ``Runtime._end_step``).
        An all-reduce bucket holds at most a quarter of its kind's gradients (or 1 MB): its buffer is made at
        its first gradient, while backward still holds most activations, so that a model smaller
        than a few buckets does not hold its gradients' bytes early (its peak stays the per-use
        path's)."""
        caps = (self.bucket_bytes, self.gather_bytes, FIRST_BUCKET, MAX_SHARE, GATHER_SHARE)
        cut = self.cut
        if cut is not None and cut[1] == caps and cut[0] == self.order:  # (identity, entry by entry)
            for e, k in zip(self.order, cut[3]):
                e.bucket = k
            self.buckets, self.layouts, self.launched = cut[2], cut[4], 0
            self.waiting = [len(b) for b in cut[2]]
            _tell_tracer(cut[5], caps)
            return
        keys = {e: (e.kind, as_axes(e.axes), e.leaf.dtype, e.leaf.device) for e in self.order}
        rule = Cut(caps, bytes_per_key(keys))
        buckets: list[list[Entry]] = []
        last: dict = {}  # key -> its last entry so far (a checkpointed block's edge: a new region)
        items = []
        for e in reversed(self.order):
            key = keys[e]
            before = last.get(key)
            edge = before is not None and e.kind != "all_reduce" and before.region != e.region
            item = (key, e.nbytes, edge)
            items.append(item)
            k = rule.add(*item)
            if k == len(buckets):
                buckets.append([])
            buckets[k].append(e)
            last[key] = e
            e.bucket = k
        self.buckets, self.launched = buckets, 0
        self.waiting = [len(b) for b in buckets]
        self.layouts = [[[m.leaf.numel() for m in b], None, _distinct(b), [m.leaf for m in b]]
                        if b[0].kind == "all_reduce" else None for b in buckets]
        # kept where every entry lasts across steps (data parallel's), which a later step reads
        # again; a step's own entries (gathered values) are not kept beyond it
        self.cut = (list(self.order), caps, buckets, [e.bucket for e in self.order], self.layouts,
                    items) if all(e.ref is not None for e in self.order) else None
        _tell_tracer(items, caps)

    def _launch(self, flush: bool) -> None:
        """Launch buckets in order while the next one is complete (``flush``: all, with what
        they have); the same buckets in the same order on every processor."""
        if self.buckets is None:  # _launch runs only after the buckets are made
            raise ArgumentError("gradient buckets launched before they were made (a meshtorch bug)")
        while self.launched < len(self.buckets):
            k = self.launched
            if not flush and self.waiting[k]:
                return
            bucket = self.buckets[k]
            pack = self.packs.pop(k, None)  # its views, in the entries, hold the buffer
            if pack is not None and not self.waiting[k]:
                # every member packed (its gradient came, its slot taken): the flat buffer, whole,
                # is the call's, prepared once per cut (the same bucket every step); its result is
                # cut into the members' sizes. The cut's own list of members, asked per cut
                # whether its reduced values can become the gradients (_adopted)
                layout = self.layouts[k]
                if not (layout[2] and _no_grads(bucket)):
                    self._wait_held()  # before packing: two held buckets' buffers are never alive together
                flat = pack[0]
                if layout[1] is None or layout[1].dtype != flat.dtype:
                    layout[1] = self.comm.prepare_all_reduce(bucket[0].axes, flat.numel(), flat.dtype)
                del pack
                for e in bucket:
                    e.grad = None
                self.pending.append((bucket, layout[1].start(flat), layout))
                del flat
                self.launched += 1
                continue
            members = []
            for e in bucket:
                e.slot = None  # a gradient that has not come goes into no launched bucket
                if e.grad is not None:
                    members.append(e)
            if members:
                first = members[0]
                if _holds(members):
                    self._wait_held()  # before packing: two held buckets' buffers are never alive together
                grads = [e.grad for e in members]
                del pack
                for e in members:
                    e.grad = None
                self.pending.append((members, self._start(first.kind, first.axes, members, grads), None))
            self.launched += 1

    def _wait_held(self) -> None:
        """Before a bucket that holds bytes is launched, wait for the launched ones that hold bytes
        too (oldest first, and every bucket launched before them), so that at most ``MAX_PENDING``
        are in flight, it included: an asynchronous call holds its packed gradients until waited on (a
        reduce_scatter on gloo a copy of them too); FSDP2 waits for a block's reduce-scatter when it
        issues the next one, here before the next is packed, also once backward has ended. A bucket
        whose reduced values become the gradients themselves (all-reduced, none accumulated into:
        :meth:`_add` adopts them) frees nothing when waited on, so it is left to the end of
        backward, as DDP waits: no processor blocks on another in the middle of backward."""
        held = [k for k, (members, _, _) in enumerate(self.pending) if _holds(members)]
        if len(held) >= MAX_PENDING:
            for _ in range(held[len(held) - MAX_PENDING] + 1):
                self._done(*self.pending.pop(0))

    def _start(self, kind: str, axes, members: Sequence[Entry], grads: list[torch.Tensor]) -> Handle:
        """Launch one bucket's reduction; ``grads`` (held nowhere else) is emptied once packed, so
        the unreduced gradients are freed before the call runs, not kept beside their packed copy."""
        grads[:] = [g.contiguous() for g in grads]
        if kind == "all_reduce":
            return self.comm.all_reduce_grouped(grads, axes, async_op=True, release=True)
        return self.comm.reduce_scatter_grouped(grads, axes, [e.dim for e in members], async_op=True,
                                                release=True)

    def _queue_finish(self) -> None:
        engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
        queue = getattr(engine, "queue_callback", None)
        if queue is None:  # a private API: without it, finish once every gradient has come
            self.callback_missing = True
            return
        queue(self.finish)

    def finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, add into ``p.grad``,
        and keep this step's gathered reads as the next step's forward plan."""
        if self.buckets is None:
            return
        self.finishing = True
        try:
            self._launch(flush=True)
            inflight, self.pending = self.pending, []
            for members, work, layout in inflight:
                self._done(members, work, layout)
        finally:
            self._end_step()

    def settle(self, at_exit: bool = False) -> None:
        """Close a backward that did not end through the engine's callback: :meth:`finish` it
        where the engine has none (``callback_missing``), :meth:`abandon` it where it raised
        (:meth:`unfinished`). Asked at the next read and at :func:`overlap`'s exit (``at_exit``)."""
        if self.callback_missing:
            self.finish()  # a backward ended, without the engine's callback to finish it
        elif self.unfinished(at_exit):
            self.abandon()  # a backward raised: its buckets are not the next step's

    def unfinished(self, at_exit: bool = False) -> bool:
        """Whether a backward started (a gradient came, the buckets were cut) but never finished,
        and no backward runs now: it raised (the engine drops its queued :meth:`finish`), and the
        caller caught the error. Asked at the next read and at :func:`overlap`'s exit
        (``at_exit``); with no engine callback (``callback_missing``) :meth:`finish` runs there
        instead, as before."""
        if self.buckets is None or self.callback_missing:
            return False
        task = getattr(torch._C, "_current_graph_task_id", None)  # private: -1 outside a backward
        if task is None:  # a read in a backward's recomputed forward looks the same: the exit only
            return at_exit
        return task() == -1

    def abandon(self) -> None:
        """Recover from a backward that raised (:meth:`unfinished`), the same way on every
        processor (SPMD: every processor's backward raised at the same op, or the program skipped
        the step on all of them, so all launched the same buckets): wait for the launched
        buckets and drop their results, drop the unlaunched ones (their packed gradients and
        slots), and end the step, so that the next one starts as a fresh one. Gradients already
        added into ``p.grad`` before the error (buckets waited on during backward, FSDP's, and
        gradients reduced alone) stay there."""
        self.finishing = True
        try:
            inflight, self.pending = self.pending, []
            for _, work, _ in inflight:
                work.wait()  # every processor launched it: complete it before its buffers go
            for e in self.order:
                e.grad, e.slot = None, None
                if e.leaf.grad is not None:  # (a hook that never ran)
                    e.leaf.grad = None
            self.packs = {}
        finally:
            self._end_step()

    def _done(self, members: list[Entry], work: Handle, layout: list | None) -> None:
        """Wait for a launched bucket and add its results (``layout``: the bucket's, where the
        call reduced its flat buffer whole)."""
        got = work.wait()
        if layout is None:
            self._add(members, got)
        else:
            self._add(members, _pieces(got[0], layout), layout[2])

    def _add(self, members: Sequence[Entry], grads: list[torch.Tensor], distinct: bool | None = None) -> None:
        """Add a bucket's reduced gradients into ``p.grad``. They are views of the call's one flat
        result (:mod:`meshtorch.comm.grouped`): where every member's ``p.grad`` is ``None`` (the
        step's first backward) the views become the gradients, and the flat result is exactly
        their bytes (DDP's ``gradient_as_bucket_view``, FSDP2's reduce output; no copy); otherwise
        (accumulation, a parameter twice in the bucket) those added into drop their views and
        the others take copies, so that no flat result lives on for part of its bytes.
        ``distinct``: the bucket's :func:`_distinct`, where the cut knows it (``grads`` are then of
        the parameters' shapes, :func:`_pieces`)."""
        adopt = _adopted(members) if distinct is None else distinct and _no_grads(members)
        if adopt and distinct is not None:
            for e, g in zip(members, grads):
                e.param.grad = g
            return
        if adopt and members[0].kind == "all_reduce":
            for e, g in zip(members, grads):  # (flat pieces, or of the leaves' shapes: the parameters')
                p = e.param
                p.grad = g.view(p.shape)
            return
        params = [e.param for e in members]
        with torch.no_grad():
            for p, g in zip(params, grads):
                g = g.view(p.shape)
                if p.grad is None:
                    p.grad = g if adopt else g.to(p.dtype, copy=True)
                else:
                    p.grad.add_(g)
