"""One processor's runtime of :func:`~meshtorch.lowering.overlap.overlap`: an :class:`Entry` per
parameter read (a leaf the op reads, its gradient's reduction), and the :class:`Runtime` that
gathers parameters grouped in the order the previous step read them (the next bucket
prefetched), frees gathered values and gathers them again (reshard after forward, recomputed
forwards); its base class, :class:`~meshtorch.lowering.overlap_buckets.GradientBuckets`, reduces
their gradients in buckets (see :mod:`meshtorch.lowering.overlap`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshtorch.comm.base import Communicator, as_axes
from meshtorch.comm.grouped import Gathered, Handle
from meshtorch.lowering.overlap_buckets import (
    FIRST_BUCKET,
    GATHER_SHARE,
    MAX_SHARE,
    Cut,
    GradientBuckets,
    _tell_tracer,
    bytes_per_key,
)
from meshtorch.meta_autocast import autocast_enabled

MAX_PLANS = 16  # models whose read order one processor keeps


@dataclass(frozen=True)
class Options:
    """How :func:`~meshtorch.lowering.overlap.overlap` runs: the size in MB of the buckets of
    gradients to all-reduce (the first one at most 1 MB, as DDP's, so that the first reduction
    starts early), whether gathered parameters are freed after their forward use (and gathered
    again for backward), and the size of a grouped gather, and of a bucket of gradients to
    reduce-scatter (about a block's parameters, FSDP2's unit; at most a third of the gathered
    bytes, or 1 MB)."""

    bucket_mb: float = 25.0
    reshard_after_forward: bool = False
    gather_mb: float = 4.0


class Entry:
    """One parameter's value for this step's ops (a leaf) and its gradient's reduction."""

    __slots__ = ("runtime", "param", "key", "kind", "axes", "dim", "leaf", "grad", "bucket", "freed",
                 "nbytes", "version", "fwd", "pinned", "reads", "needed", "region", "step", "ref", "slot",
                 "refetched", "finalizer", "__weakref__")

    def __init__(self, runtime: Runtime, param: torch.Tensor, key, kind: str, axes, dim: int | None,
                 value: torch.Tensor):
        self.runtime, self.param, self.key = runtime, param, key
        self.kind, self.axes, self.dim = kind, axes, dim
        self.version = param._version  # an in-place update since (an optimizer step) makes it stale
        self.leaf = value.detach().requires_grad_(True)
        self.leaf._overlap_entry = self
        self.grad: torch.Tensor | None = None
        self.slot: torch.Tensor | None = None  # its place in its bucket's buffer, until its gradient comes
        self.bucket: int | None = None  # its backward bucket
        self.fwd: int | None = None  # its forward bucket (the previous step's reads)
        self.freed = False
        self.reads = 0  # forward ops that read it this step
        self.needed = False  # some op's backward reads its value
        self.region: int | None = None  # the checkpointed block (unsaved()) it was first read in
        self.refetched = False  # gathered again in backward with its forward bucket (Runtime._refetch)
        # never freed: an op's result is a view of it, or it is the parameter's own storage (freeing
        # that would free the parameter; a group of one, which read() never gets, would give it)
        self.pinned = kind == "reduce_scatter" and value.untyped_storage() is param.untyped_storage()
        self.nbytes = self.leaf.numel() * self.leaf.element_size()
        self.step = runtime.generation  # the step that last read it (a lasting entry: each step)
        self.ref = None  # a lasting entry's parameter, weakly (``param`` only while a step reads it)
        self.finalizer: weakref.finalize | None = None  # a lasting entry's: forgets it with its parameter
        # (a partial, not a lambda: one Python frame fewer per gradient)
        self.leaf.register_post_accumulate_grad_hook(functools.partial(runtime.ready, self))

    @property
    def gathered(self) -> bool:
        return self.kind == "reduce_scatter"

    def free(self) -> None:
        if not self.freed and not self.pinned:
            self.leaf.untyped_storage().resize_(0)
            self.freed = True
            _resized(self.leaf)

    def fill(self, got: Gathered | list, i: int) -> None:
        """Gather the value again from member ``i`` of a grouped all_gather's result, into the
        storage it had (autograd's saved views of it see the values again)."""
        if self.freed:
            data = self.leaf.data  # its own version counter: autograd's saved copy stays valid
            data.untyped_storage().resize_(self.nbytes)
            if isinstance(got, Gathered):
                got.take(i, into=data)  # from the flat result straight into the storage
            else:
                data.copy_(got[i])
            self.freed = False
            _resized(self.leaf)



def lasting_holds(e: Entry, param: torch.Tensor) -> bool:
    """Whether ``e``, the lasting entry of ``param`` (data parallel's), still serves it: made for
    this parameter object, and its leaf still an alias of the parameter's storage, alike. ``p.data
    = ...`` (``module.to(dtype)``, ``.double()``) swaps the storage, which needs a new leaf."""
    leaf = e.leaf
    return (e.ref() is param and torch._C._is_alias_of(leaf, param) and leaf.shape == param.shape
            and leaf.stride() == param.stride() and leaf.dtype == param.dtype)


def _resized(t: torch.Tensor) -> None:
    """Tell this processor's tracer that ``t``'s storage changed size (``resize_`` is no aten op: a
    tracer that follows memory, the planner's, would not see it)."""
    from meshtorch.context import current

    resized = getattr(current().tracer, "resized", None)
    if resized is not None:
        resized(t)


def _forget(runtime: weakref.ref, key) -> None:
    """A parameter with a lasting entry is gone: drop the entry, and the last cut of buckets,
    which holds it (and its leaf, an alias of the parameter's storage)."""
    rt = runtime()
    if rt is not None:
        rt.lasting.pop(key, None)
        rt.cut = None


class Runtime(GradientBuckets):
    """One processor's grouped, overlapped parameter collectives (see :mod:`meshtorch.lowering.overlap`):
    the forward's values (gathered grouped and prefetched, freed and gathered again) here, the
    backward's gradient buckets in its base class."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.generation = 0
        self.entries: dict = {}  # key -> Entry of this step
        self.order: list[Entry] = []  # this step's entries in order of first forward read
        super().__init__()
        # forward: last step's gathered reads as buckets of (param ref, key, axes, dim)
        # the plan of this step, chosen at its first gathered read among the plans of earlier steps,
        # each kept under its first read (several models on one processor each keep theirs)
        self.plan: list[list[tuple]] = []
        self.plan_at: dict = {}  # key -> bucket index
        self.uses: dict = {}  # key -> forward ops that read it in the step the plan is from
        self.plans: dict = {}  # first read's key -> (plan, plan_at, uses, cut), the newest last
        self.chosen = False
        # the chosen plan's cut ((key, bytes, edge) per member in forward order: Cut's items), and
        # the forward buckets gathered again in backward this step (what the tracer is told)
        self.plan_items: list = []
        self.refetch_calls = 0
        self.fetches: dict[int, Handle] = {}  # forward bucket -> its gather in flight (or done)
        self.refetches: dict[int, tuple[list[Entry], Handle]] = {}  # the same, gathered again
        self.gather_bytes = 4 * 2**20
        self.reshard = False
        # (id(parameter), adapters) -> its lasting entry (gradients to all-reduce: _lasting),
        # dropped when the parameter goes
        self.lasting: dict = {}
        self.hooks_made = 0  # gradient hooks registered on lasting entries' leaves (a count for tests)
        self.alone: dict = {}  # axes -> whether their group is this one processor
        self.opts: Options | None = None

    # -------------------------------------------------------------- forward
    def read(self, param: torch.Tensor, steps, how, opts: Options, region: int | None) -> torch.Tensor:
        """The value an op reads for ``param`` adapted by ``steps`` (``how``: their kind, axes and
        dim), in the checkpointed block ``region`` (:func:`~meshtorch.lowering.overlap.unsaved`'s)
        or outside any (``None``)."""
        if self.buckets is not None:  # (asked here first: no call per read in a normal forward)
            self.settle()
        if opts is not self.opts:
            self.opts = opts
            self.bucket_bytes = max(1, int(opts.bucket_mb * 2**20))
            self.gather_bytes = max(1, int(opts.gather_mb * 2**20))
            self.reshard = opts.reshard_after_forward
        kind, axes, dim = how
        key = (id(param), steps)
        e = self.entries.get(key)
        if kind == "all_reduce":
            if e is None:
                # its lasting entry (made once per parameter and adapters, _lasting), checked here:
                # one Python frame less per parameter read of every step (issue 27)
                e = self.lasting.get(key)
                if e is None or not lasting_holds(e, param):
                    e = self._lasting(param, key, axes)
                e.param, e.step = param, self.generation
                self.entries[key] = e
                self.order.append(e)
            # under autocast a view, not the leaf: autocast caches its casts of leaves that require
            # grad until the autocast block ends (the whole forward), which would keep a bf16 copy
            # of every parameter the step reads alive through a recomputed forward (the per-use
            # path's values are no leaves). Otherwise the leaf itself, as DDP's forward reads its
            # parameters: a view is an op and an autograd node per read, forward and backward
            # (issue 27); after_forward has nothing to free of an alias
            # (the planner's meta tensors: meshtorch's own autocast of them, which caches leaves'
            # casts too; torch's test asked directly, one Python call less per read)
            leaf = e.leaf
            kind = leaf.device.type
            amp = autocast_enabled(kind) if kind == "meta" else torch.is_autocast_enabled(kind)
            return leaf.view_as(leaf) if amp else leaf
        if e is None or e.param is not param or e.version != param._version:
            e = self.entries[key] = self._gathered(param, key, axes, dim)
            self.order.append(e)
        elif e not in self.order:
            self.order.append(e)
        if e.reads == 0 and self.buckets is None and e.region is None and region is not None:
            e.region = region
        if e.freed:
            # read again in forward (the step before read it once more than this one): alone; in
            # backward (a recomputed forward): with the rest of its bucket, the next prefetched
            self.refill([e], read=True, alone=self.buckets is None)
        value = e.leaf.view_as(e.leaf)  # a view, not the leaf: as above
        value._overlap_entry = e
        return value

    def _lasting(self, param: torch.Tensor, key, axes) -> Entry:
        """A new entry of a parameter whose gradient is all-reduced (data parallel), where
        :meth:`read` found none valid for it in :attr:`lasting`: its leaf is an alias of the
        parameter, so it stays valid across optimizer steps (which update the storage in place)
        and is made, with its gradient hook, once per parameter and adapters, not every step, as
        DDP registers its hooks once (and again where ``p.data = ...`` swapped the storage). It is
        kept beside the parameter (weakly: it goes with the parameter) and holds the parameter
        only while a step reads it."""
        old = self.lasting.get(key)
        if old is None or old.ref() is not param:  # (a new parameter, perhaps at a freed one's id)
            finalizer = weakref.finalize(param, _forget, weakref.ref(self), key)
        else:
            finalizer = old.finalizer
        e = self.lasting[key] = Entry(self, param, key, "all_reduce", axes, None, param)
        e.ref, e.finalizer = weakref.ref(param), finalizer
        self.hooks_made += 1
        return e

    def release(self, params: Sequence[torch.Tensor]) -> None:
        """Let go of every weak reference this runtime holds to ``params``: their lasting entries
        (with their finalizers) and the plans and cut that name them, which the next step makes
        again as for new parameters. ``torch.utils.swap_tensors`` (torch's swap flag, in module
        conversions and loads) refuses a tensor with a weak reference."""
        ids = {id(p) for p in params}
        for key, e in list(self.lasting.items()):
            if key[0] in ids:
                if e.finalizer is not None:
                    e.finalizer.detach()
                # (the entry and its leaf refer to each other: the weak reference goes now, not
                # when the garbage collector finds the pair)
                e.ref = e.finalizer = None
                del self.lasting[key]
        for first, (plan, *_) in list(self.plans.items()):
            if any(id(member[0]()) in ids for bucket in plan for member in bucket):
                del self.plans[first]
        self.cut = None

    def _gathered(self, param, key, axes, dim) -> Entry:
        """The entry of a gathered parameter: from the bucket the previous step read it in
        (gathered with the bucket, the next one prefetched), or gathered alone."""
        if not self.chosen:
            self.plan, self.plan_at, self.uses, self.plan_items = self.plans.get(key, ([], {}, {}, []))
            self.chosen = True
        k = self.plan_at.get(key)
        if k is None:
            value = self.comm.all_gather_grouped([param.detach()], axes, [dim])[0]
            return Entry(self, param, key, "reduce_scatter", axes, dim, value)
        self._fetch(k)
        members, values = self.plan[k], self.fetches[k].wait()
        if k + 1 < len(self.plan):
            # prefetch: runs while bucket k computes; issued once k is unpacked, as FSDP2 does, so
            # that k's flat result is gone before k + 1's arrives
            self._fetch(k + 1)
        made = None
        for (ref, mkey, maxes, mdim), value in zip(members, values):
            p = ref()
            if p is None or mkey in self.entries:
                continue
            e = Entry(self, p, mkey, "reduce_scatter", maxes, mdim, value)
            e.fwd = k
            if mkey == key:
                made = e
            else:
                self.entries[mkey] = e  # read later in this step
        if made is None:  # planned for another parameter object: alone
            value = self.comm.all_gather_grouped([param.detach()], axes, [dim])[0]
            made = Entry(self, param, key, "reduce_scatter", axes, dim, value)
        return made

    def _fetch(self, k: int) -> None:
        if k in self.fetches:
            return
        members = [(ref(), axes, dim) for ref, _, axes, dim in self.plan[k]]
        if any(p is None for p, _, _ in members):
            self.fetches[k] = Handle(lambda: [None] * len(members))
            return
        self.fetches[k] = self.comm.all_gather_grouped(
            [p.detach() for p, _, _ in members], members[0][1], [d for _, _, d in members], async_op=True)

    def refill(self, entries: Sequence[Entry], read: bool = False, alone: bool = False) -> None:
        """Gather freed values again (reshard after forward): grouped with the rest of their
        forward bucket that backward reads (``needed``; for a forward that reads them again,
        ``read``, a recomputed one: all of it), the bucket before prefetched (backward runs the
        buckets in reverse); ``alone``: only ``entries``, grouped."""
        self.land()
        todo = [e for e in entries if e.freed]
        if not todo:
            return
        for k in sorted({e.fwd for e in todo if e.fwd is not None and not alone}, reverse=True):
            self._refetch(k, read)
            members, work = self.refetches.pop(k)
            got = work.wait()
            for i, e in enumerate(members):
                e.fill(got, i)
            if k > 0:
                # prefetched as the block before reads it: whole for a recomputed forward (a
                # non-recomputed bucket before a recomputed one took only the members its backward
                # reads, so the recomputation gathered the rest alone), else what backward reads
                # (a recomputed forward's read took a whole non-recomputed bucket before it, which
                # backward may not read at all: learned positions)
                self._refetch(k - 1, self._recomputed(k - 1))
        groups: dict = {}
        for e in todo:
            if e.freed:  # not in a bucket: gathered with the others of its axes and dtype
                groups.setdefault((as_axes(e.axes), e.leaf.dtype), []).append(e)
        for group in groups.values():
            got = self.comm.all_gather_grouped([e.param.detach() for e in group], group[0].axes,
                                               [e.dim for e in group], lazy=True)
            for i, e in enumerate(group):
                e.fill(got, i)

    def land(self) -> None:
        """Wait for the gathers issued ahead for backward (:meth:`refill`'s prefetch of the bucket
        before), so that each is in flight across one op at most: the op whose read or backward
        issued it (called before the next op's backward and after each op's forward).

        On gloo a gather in flight holds a staging buffer of its whole result until every member
        has joined it (``ProcessGroupGloo``'s all_gather gathers into a flat buffer of its own,
        then copies it out). Left in flight across a block's backward or its recomputed forward,
        that buffer outlived the ops the plan puts after it whenever the other processor was
        late, and the peak depended on the other processor's timing (``tests/test_plan_memory.py``,
        its ``fsdp+reshard`` LM with processor 1 issuing each prefetch 50 ms late: processor 0
        8.9% over the plan; issue 27's LM at batch 4 x 64 with ``--recompute``: 7%). The plan
        (processors on time) lets go of it as the call is issued; a late processor now holds it
        across one op. Waiting costs nothing where the gather is done; where another processor
        is late, this one would wait for it at the next bucket anyway."""
        for _, work in self.refetches.values():
            work.wait()

    def _recomputed(self, k: int) -> bool:
        """Whether forward bucket ``k`` is in a checkpointed block, which backward reads in a
        recomputed forward (all its members: :meth:`_refetch`'s ``read``), not only where an op's
        backward needs a value."""
        return any(e.fwd == k and e.region is not None for e in self.order)

    def _refetch(self, k: int, read: bool = False) -> None:
        """Start gathering the freed members of forward bucket ``k`` again (once): those that
        backward reads, or with ``read`` all of them."""
        if k in self.refetches:
            return
        members = [e for e in self.order if e.fwd == k and e.freed and (read or e.needed)]
        work = (self.comm.all_gather_grouped([e.param.detach() for e in members], members[0].axes,
                                             [e.dim for e in members], async_op=True, lazy=True)
                if members else Handle(lambda: []))
        if members:
            self.refetch_calls += 1
            for e in members:
                e.refetched = True
        self.refetches[k] = (members, work)

    def _end_step(self) -> None:
        """The step ends (at :meth:`finish`): its gathered reads, cut into buckets, become the
        forward plan of the next step that reads the same first parameter; its entries go."""
        for work in [*self.fetches.values(), *(w for _, w in self.refetches.values())]:
            work.wait()  # prefetches nobody read: complete before their buffers go
        self.refetches = {}
        # cut into grouped gathers by the rule that cuts gradients (Cut: one place, which the
        # planner runs on a deep model's gathers too): per (axes, dtype, device), each up to
        # gather_mb (at most a third of their bytes), ending at a checkpointed block's edges
        gathered = [e for e in self.order if e.kind == "reduce_scatter"]  # (no property call per entry)
        keys = {e: ("all_gather", as_axes(e.axes), e.leaf.dtype, e.leaf.device) for e in gathered}
        caps = (self.bucket_bytes, self.gather_bytes, FIRST_BUCKET, MAX_SHARE, GATHER_SHARE)
        rule = Cut(caps, bytes_per_key(keys))
        plan: list[list[tuple]] = []
        items, marked = [], []
        last: dict = {}  # key -> its last entry so far
        for e, key in keys.items():
            before = last.get(key)
            item = (key, e.nbytes, before is not None and before.region != e.region)
            items.append(item)
            k = rule.add(*item, e.refetched)
            if k == len(plan):
                plan.append([])
            plan[k].append((weakref.ref(e.param), e.key, e.axes, e.dim))
            marked.append((*item, e.refetched))
            last[key] = e
        if plan and self.plan_items == items and sum(rule.marked.values()) == self.refetch_calls:
            # this step gathered by this very cut (the plan of the step before, read in the same
            # order), a call per bucket, and again in backward the marked ones: the tracer is told
            # it, from which the planner counts a deeper model's gathers (plan.layered)
            _tell_tracer(marked, caps)
        if plan:
            first = plan[0][0][1]
            self.plans.pop(first, None)
            self.plans[first] = (plan, {m[1]: k for k, b in enumerate(plan) for m in b},
                                 {e.key: e.reads for e in gathered}, items)
            while len(self.plans) > MAX_PLANS:
                del self.plans[next(iter(self.plans))]
        self.plan_items, self.refetch_calls = [], 0
        self.plan, self.plan_at, self.uses, self.chosen = [], {}, {}, False
        self.fetches = {}
        for e in self.order:
            if e.ref is not None:  # lasting: ready for the next step, without holding the parameter
                e.param, e.grad, e.bucket, e.slot = None, None, None, None
        self.entries, self.order = {}, []
        self._new_backward()
        self.generation += 1
