"""Communication that overlaps: parameters' gradient-summing adapters as grouped, asynchronous
collectives (DDP's buckets, FSDP2's flat gathers and prefetch), switched on by :func:`overlap`.

Without it, a parameter read by an op through an adapter whose backward sums its gradient
(``identity_grad_sum``: data parallel; ``all_gather`` with its ``reduce_scatter`` backward: FSDP
by rules) runs that adapter as an autograd Function: one blocking collective per use forward and
one per parameter backward. Inside ``with mt.overlap():`` the lowering hands such a read to this
module instead (one clear place: :func:`overlapped_input`), for any model written in the language:

- **Backward.** The op gets the gathered (or, for an identity, the aliased) value as a
  *detached leaf*, so autograd accumulates the unreduced local gradient there (an aliased
  leaf, data parallel's, is made once per parameter with its hook and serves every step, as
  DDP registers its hooks once; a gathered one is made per step). A
  post-accumulate-grad hook puts it into a bucket: buckets are cut in reverse order of the
  step's forward reads (the same on every processor: SPMD), per axis group, kind and dtype, up
  to ``bucket_mb`` for all-reduces (DDP's 25 MB, the first 1 MB) and ``gather_mb`` for
  reduce-scatters (about a block's parameters, FSDP2's unit). A full bucket, once every earlier
  one has gone, launches one asynchronous ``all_reduce`` (data parallel) or ``reduce_scatter``
  (FSDP) while backward goes on. A callback queued on the autograd engine waits for them at the
  end of ``backward()`` and *adds* each result into ``p.grad``, so gradient accumulation over
  micro-batches stays exact. A ``p.grad`` that was ``None`` becomes a view of its bucket's flat
  result, which holds exactly the bucket's gradients (DDP's ``gradient_as_bucket_view``): the
  gradients cost their slices' bytes, and ``zero_grad(set_to_none=True)`` frees the bucket.
  Clone a gradient to keep it past that.
- **Forward.** Gathers are grouped per bucket in the order the previous step read them, and the
  next bucket is gathered asynchronously while the current one computes (prefetch). A bucket
  (of gathers, or of gradients to reduce-scatter) holds up to ``gather_mb`` and at most a
  third of the gathered bytes (or 1 MB), and ends at the edges of a block recomputed in
  backward (``mt.nn.checkpoint``): a grouped gather's result and its copies are alive at once
  (one flat buffer cannot be the parameters' storage), so a bucket of a small model's every
  weight, or one that straddles two recomputed blocks, would cost more than the per-use path.
- **Recomputation.** A forward that ``mt.nn.checkpoint`` recomputes in backward saves nothing
  (:func:`unsaved`): its gathered values are freed after their last read and gathered again
  (grouped, per block) for the recomputation, also with ``reshard_after_forward=False``.
- **The loss.** The all_reduce of a scalar's partial sums (a mean loss over split rows, a
  metric) is asynchronous too, and its result a tensor that waits for the call where its value
  is read (:mod:`meshtorch.comm.pending`): the mean's division, ``backward()``'s seed and a
  ``detach()`` do not wait, ``.item()`` does. Blocking, it made a second point per step where
  every processor waited for the others (DDP's loss is each process's own); now they meet at
  the end of backward only.
- **Reshard after forward** (``reshard_after_forward=True``): a gathered value's storage is freed
  after its op ran forward and gathered again (grouped, the previous bucket prefetched) just
  before that op's backward runs: FSDP2's ``reshard_after_forward``, less memory for more bytes.
  Otherwise the gathered values live until backward has used them (the default). A bucket
  gathered ahead for backward (or a recomputed forward) is waited on after one op
  (:meth:`Runtime.land`): gloo stages a gather in flight until every processor has joined it, so
  that a late processor does not move another's peak.

Values are those of the per-use path: the same gathers forward; backward sums the uses' local
gradients before one reduction, as the lazy all-reduce does (bitwise the same where a parameter
has one use or is replicated).

Where it does not apply the per-use path runs: under ``torch.compile`` (a compiled graph
schedules its collectives itself), outside grad mode, for adapters of uneven pieces or of
several steps. ``torch.autograd.grad`` with respect to parameters cannot see gradients that
go to a detached leaf: call it outside :func:`overlap`.

Example (data parallel: three parameters' gradients in one all_reduce, the same values):
    >>> import torch, meshtorch as mt
    >>> def step(on):
    ...     dense = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 3))
    ...     x = mt.random.normal("batch:4,d:4", seed=1)
    ...     with mt.overlap(enabled=on):
    ...         before = mt.comm_stats().calls(kind="all_reduce")
    ...         mt.reduce_sum(dense(x) ** 2).backward()
    ...     calls = mt.comm_stats().calls(kind="all_reduce") - before
    ...     return calls, [p.grad.sum().item() for p in dense.parameters()]
    >>> off, on = mt.launch(step, False, mesh="b:2", rules="batch:b")[0], mt.launch(
    ...     step, True, mesh="b:2", rules="batch:b")[0]
    >>> off[0], on[0], off[1] == on[1]
    (3, 2, True)
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from meshtorch.comm import pending
from meshtorch.comm.base import Communicator, as_axes
from meshtorch.comm.grouped import Gathered, Handle
from meshtorch.errors import ArgumentError
from meshtorch.lowering import adapters as ca

FIRST_BUCKET = 2**20  # DDP's first bucket: the first reduction starts after the last layer's backward
MAX_PLANS = 16  # models whose read order one processor keeps
MAX_SHARE = 4  # an all-reduce bucket holds at most 1 / MAX_SHARE of its kind's gradients
# a gather (and a bucket of gradients to reduce-scatter) at most 1 / GATHER_SHARE of the gathered
# bytes: a third, so that a model of a few blocks gathers a block at a time (a quarter cut a
# 2-block LM's blocks in two, and its peak fell in a window where gloo's staging of a gather in
# flight lives as long as the other processor takes to join it, which the planner cannot know)
GATHER_SHARE = 3
MAX_PENDING = 1  # gradient buckets holding bytes in flight (waited on before another one is launched)
_on = threading.local()  # this processor's options, while inside overlap()


@dataclass(frozen=True)
class Options:
    """How :func:`overlap` runs: the size in MB of the buckets of gradients to all-reduce (the
    first one at most 1 MB, as DDP's, so that the first reduction starts early), whether gathered
    parameters are freed after their forward use (and gathered again for backward), and the size
    of a grouped gather, and of a bucket of gradients to reduce-scatter (about a block's
    parameters, FSDP2's unit; at most a third of the gathered bytes, or 1 MB)."""

    bucket_mb: float = 25.0
    reshard_after_forward: bool = False
    gather_mb: float = 4.0


@contextmanager
def overlap(enabled: bool = True, *, bucket_mb: float = 25.0, reshard_after_forward: bool = False,
            gather_mb: float = 4.0) -> Iterator[None]:
    """Run parameters' gradient-summing collectives grouped and asynchronously in the block
    (see :mod:`meshtorch.lowering.overlap`); ``enabled=False`` keeps the per-use path.

    Enter it around forward *and* backward of a training step (``meshtorch train`` does).
    ``bucket_mb``: buckets of gradients to all-reduce (DDP's 25 MB); ``gather_mb``: grouped
    parameter gathers and buckets of gradients to reduce-scatter (about a block's parameters,
    FSDP2's unit: what is alive at once under ``reshard_after_forward``).

    Example:
        >>> import meshtorch as mt
        >>> with mt.overlap(bucket_mb=4, reshard_after_forward=True):
        ...     mt.lowering.overlap.options()
        Options(bucket_mb=4.0, reshard_after_forward=True, gather_mb=4.0)
    """
    for name, value in (("bucket_mb", bucket_mb), ("gather_mb", gather_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ArgumentError(f"{name}={value!r} must be a positive, finite number of megabytes, e.g. "
                                f"{name}=25 (one bucket for everything: a size above the model's, e.g. 1e6)")
    prev = getattr(_on, "options", None)
    _on.options = (Options(float(bucket_mb), bool(reshard_after_forward), float(gather_mb)) if enabled
                   else None)
    try:
        # a loss's all_reduce too: asynchronous, read later (meshtorch.comm.pending.all_reduce_later)
        with pending.reading_later(enabled):
            yield
    finally:
        _on.options = prev
        if enabled:
            from meshtorch.context import current

            rt = getattr(current().comm, "_overlap", None)
            if rt is not None and rt.callback_missing:
                rt.finish()  # a backward whose last gradients never came


@contextmanager
def unsaved() -> Iterator[None]:
    """The forward run inside is recomputed for its backward (``mt.nn.checkpoint``'s first
    run, whose autograd graph saves nothing): gathered values read inside are freed after their
    last forward read, as though no backward read them, and gathered again when recomputed
    (without it, ``reshard_after_forward=False`` would keep every gathered value from forward
    to backward, which the per-use path gathers again).

    Example:
        >>> import meshtorch as mt
        >>> with mt.lowering.overlap.unsaved():
        ...     pass
    """
    _on.unsaved = getattr(_on, "unsaved", 0) + 1
    if _on.unsaved == 1:
        _on.region = getattr(_on, "region", 0) + 1  # a new checkpointed block: buckets end at its edges
    try:
        yield
    finally:
        _on.unsaved -= 1


def options() -> Options | None:
    """The options in force on this processor, or ``None`` outside :func:`overlap`."""
    return getattr(_on, "options", None)


# ------------------------------------------------------------------ which reads qualify
def _adapter(steps) -> tuple[str, str | tuple[str, ...], int | None] | None:
    """``(kind of the gradient reduction, axes, gathered dim)`` for adapters this module runs,
    else ``None``: one step, an identity (all_reduce) or an even all_gather (reduce_scatter)."""
    if len(steps) != 1:
        return None
    fn, axes, args = steps[0]
    if fn is ca.identity_grad_sum:
        return "all_reduce", axes, None
    if fn is ca.all_gather and len(args) == 1:
        return "reduce_scatter", axes, args[0]
    return None


def overlapped_input(t: torch.Tensor, steps) -> torch.Tensor | None:
    """The value an op uses for the parameter slice ``t`` adapted by ``steps``, run by this
    module (a leaf whose gradient is reduced in buckets), or ``None``: use the per-use path.
    The lowering asks this for every input whose adapters sum its gradient."""
    if torch.compiler.is_compiling():  # first: a traced step never reads this module's state
        return None
    opts = getattr(_on, "options", None)
    if (opts is None or not t.requires_grad or not isinstance(t, torch.nn.Parameter)
            or not torch.is_grad_enabled()):
        return None
    # (the lowering's plans hand the same few step tuples every step: what they ask, kept)
    how = _hows.get(steps, False)
    if how is False:
        if len(_hows) > MAX_HOWS:
            _hows.clear()
        how = _hows[steps] = _adapter(steps)
    if how is None:
        return None
    comm = _current().comm
    rt = getattr(comm, "_overlap", None) or runtime(comm)
    alone = rt.alone.get(how[1])
    if alone is None:
        # a group of one (a rule splitting a dim over an axis of size 1): its collectives return
        # their input, so a "gathered" value would be the parameter itself, which this module
        # frees after backward; nothing moves, so the per-use path costs nothing
        alone = rt.alone[how[1]] = math.prod(comm.mesh.axis_size(a) for a in as_axes(how[1])) == 1
    return None if alone else rt.read(t, steps, how, opts)


MAX_HOWS = 4096  # adapter tuples whose kind overlapped_input keeps
_hows: dict = {}  # adapters (a plan's steps for one input) -> _adapter(steps)


def _current():
    """:func:`meshtorch.context.current` (the context sits above this module: imported at the
    first call, then kept)."""
    global _current
    from meshtorch.context import current

    _current = current
    return current()


def runtime(comm: Communicator) -> Runtime:
    """``comm``'s processor's :class:`Runtime` (made on first use; it lives as long as ``comm``)."""
    rt = getattr(comm, "_overlap", None)
    if rt is None:
        rt = comm._overlap = Runtime(comm)  # type: ignore[attr-defined]
    return rt


def after_forward(used: Sequence[torch.Tensor], result: torch.Tensor,
                  args: Sequence[torch.Tensor] = ()) -> None:
    """After an op ran forward on ``used`` (values from :func:`overlapped_input`; ``args``: all
    the op's local inputs): free the gathered values that the op's backward does not read (an
    autocast's bf16 copy, an embedding's rows: autograd keeps the copy, not the fp32 gathered
    value), once the step has read them for the last time in forward; with
    ``reshard_after_forward``, free the others too but for the last forward bucket, which
    backward needs first. Before the op's backward, gather again those it reads that were freed
    since (otherwise they stay until their gradient is taken, as FSDP2 frees after backward,
    which a retained graph may run again)."""
    if not used or torch.compiler.is_compiling():
        return
    entries = [e for e in (getattr(v, "_overlap_entry", None) for v in used) if e is not None and e.gathered]
    if not entries:
        return
    rt = entries[0].runtime
    rt.land()  # a gather issued ahead for backward is in flight across one op at most
    # the same storage object (data pointers are all 0 on the meta device, which the planner traces)
    if any(e.leaf.untyped_storage() is result.untyped_storage() for e in entries):
        for e in entries:
            e.pinned = True  # the result is a view of a gathered value: it must stay
        return
    if getattr(_on, "unsaved", 0):
        # a checkpointed forward (mt.nn.checkpoint): its backward keeps nothing of it and
        # recomputes, reading the values again (gathered again if freed), as the per-use path
        unread = [True] * len(entries)
    else:
        # (the values handed to the op are views of the leaves: the walk goes through them)
        others = [a for a in args if all(a is not v for v in used)]
        unread = unread_by_backward(result, [e.leaf for e in entries], others)
    kept = []
    counting = rt.buckets is None  # no gradient yet: forward (a recomputed forward runs in backward)
    for e, skip in zip(entries, unread):
        e.reads += counting
        if not skip:
            e.needed = True
            kept.append(e)
    last = len(rt.plan) - 1
    # (in backward, a recomputed forward's values stay for the backward that follows it at once)
    reshard = rt.reshard and counting
    for e, skip in zip(entries, unread):
        if e.reads < rt.uses.get(e.key, 1):
            continue  # read again in this forward (as the step before; in the first step, assumed not)
        if skip and (reshard or not e.needed):
            e.free()  # an earlier op's backward that reads it keeps it (``needed``) but resharded
        elif reshard and (e.fwd is None or e.fwd != last):
            e.free()
    if kept and result.requires_grad:
        result.register_hook(lambda g: (rt.refill(kept), g)[1])


# Autograd nodes whose result is new storage and whose backward reads no value of the input
# (a cast, a copy, a sum, a row lookup: those two save only the integer indices)
_COPIES = frozenset({"ToCopyBackward0", "CloneBackward0", "AddBackward0", "SubBackward0", "NegBackward0",
                     "IndexBackward0", "EmbeddingBackward0"})
_MAX_NODES = 256  # an op's own autograd graph is a few nodes; past this, assume it reads everything
_saves: dict[type, bool] = {}


def _saves_tensors(node: object) -> bool:
    """Whether autograd nodes of ``node``'s kind keep tensors for backward (``_raw_saved_*``)."""
    kind = type(node)
    saves = _saves.get(kind)
    if saves is None:
        saves = _saves[kind] = any(a.startswith("_raw_saved_") for a in dir(kind))
    return saves


def unread_by_backward(result: torch.Tensor, leaves: Sequence[torch.Tensor],
                       args: Sequence[torch.Tensor] = ()) -> list[bool]:
    """For each leaf an op read to compute ``result``, whether the op's backward leaves the
    leaf's storage unread: every path from the leaf up through the op's autograd graph (that
    between ``result`` and the op's inputs ``args``) reaches a cast or copy (:data:`_COPIES`)
    before any node that keeps tensors, passing only nodes that keep none (views, which share
    the leaf's storage). Unknown kinds count as reading it: a freed storage that backward reads
    would fail, a kept one costs only memory.

    Example (an autocast's cast keeps its bf16 copy; a matmul keeps its fp32 operand):
        >>> import torch
        >>> from meshtorch.lowering.overlap import unread_by_backward
        >>> w = torch.ones(3, 2, requires_grad=True)
        >>> x = torch.ones(4, 3)
        >>> unread_by_backward(x.bfloat16() @ w.t().bfloat16().t(), [w]), unread_by_backward(x @ w, [w])
        ([True], [False])
    """
    stop = {a.grad_fn for a in args if a.grad_fn is not None}
    consumers: dict = {}  # node -> the nodes of this op whose input it makes
    accumulators: dict = {}  # id(leaf) -> its AccumulateGrad node
    wanted = {id(t) for t in leaves}
    start = result.grad_fn
    seen, todo = {start}, [start] if start is not None else []
    while todo:
        n = todo.pop()
        if len(seen) > _MAX_NODES:
            return [False] * len(leaves)
        for child, _ in n.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(n)
            if child in seen:
                continue
            seen.add(child)
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                if id(variable) in wanted:
                    accumulators[id(variable)] = child
            elif child not in stop:
                todo.append(child)

    # (no nested function: a recursive closure is a reference cycle, and it would keep these
    # nodes, and the activations they save, alive until the garbage collector runs)
    if start is None:
        return [True] * len(leaves)  # no backward runs through the op
    # a leaf the walk did not reach counts as read: a freed storage that backward reads would fail
    return [id(t) in accumulators and not _reads(consumers.get(accumulators[id(t)], ()), consumers)
            for t in leaves]


def _reads(first: Sequence, consumers: dict) -> bool:
    """Whether a node among ``first`` (the nodes that take a leaf's value), or one after a node that
    keeps no tensor (a view: its result shares the storage), keeps tensors for backward."""
    todo, seen = list(first), set()
    while todo:
        n = todo.pop()
        if n in seen or type(n).__name__ in _COPIES:
            continue
        if _saves_tensors(n) or len(seen) > _MAX_NODES:
            return True
        seen.add(n)
        todo.extend(consumers.get(n, ()))
    return False


# ------------------------------------------------------------------ the runtime
class Entry:
    """One parameter's value for this step's ops (a leaf) and its gradient's reduction."""

    __slots__ = ("runtime", "param", "key", "kind", "axes", "dim", "leaf", "grad", "bucket", "freed",
                 "nbytes", "version", "fwd", "pinned", "reads", "needed", "region", "step", "ref",
                 "__weakref__")

    def __init__(self, runtime: Runtime, param: torch.Tensor, key, kind: str, axes, dim: int | None,
                 value: torch.Tensor):
        self.runtime, self.param, self.key = runtime, param, key
        self.kind, self.axes, self.dim = kind, axes, dim
        self.version = param._version  # an in-place update since (an optimizer step) makes it stale
        self.leaf = value.detach().requires_grad_(True)
        self.leaf._overlap_entry = self
        self.grad: torch.Tensor | None = None
        self.bucket: int | None = None  # its backward bucket
        self.fwd: int | None = None  # its forward bucket (the previous step's reads)
        self.freed = False
        self.reads = 0  # forward ops that read it this step
        self.needed = False  # some op's backward reads its value
        self.region: int | None = None  # the checkpointed block (unsaved()) it was first read in
        # never freed: an op's result is a view of it, or it is the parameter's own storage (freeing
        # that would free the parameter; a group of one, which read() never gets, would give it)
        self.pinned = kind == "reduce_scatter" and value.untyped_storage() is param.untyped_storage()
        self.nbytes = self.leaf.numel() * self.leaf.element_size()
        self.step = runtime.generation  # the step that last read it (a lasting entry: each step)
        self.ref = None  # a lasting entry's parameter, weakly (``param`` only while a step reads it)
        self.leaf.register_post_accumulate_grad_hook(lambda leaf: runtime.ready(self, self.step))

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


def _totals(keys: dict) -> dict:
    """``keys`` (entry -> its bucket key): each key's bytes, summed over its entries."""
    totals: dict = {}
    for e, key in keys.items():
        totals[key] = totals.get(key, 0) + e.nbytes
    return totals


def _adopted(members: Sequence[Entry]) -> bool:
    """Whether :meth:`Runtime._add` will make a bucket's reduced values its members' gradients
    as they are (views of the call's result, no copy): all-reduced, each parameter once, of its
    own dtype, none with a gradient to add into."""
    if members[0].kind != "all_reduce":
        return False
    params = [e.param for e in members]
    return (len({id(p) for p in params}) == len(params)
            and all(p.grad is None and e.leaf.dtype == p.dtype for p, e in zip(params, members)))


def _resized(t: torch.Tensor) -> None:
    """Tell this processor's tracer that ``t``'s storage changed size (``resize_`` is no aten op: a
    tracer that follows memory, the planner's, would not see it)."""
    from meshtorch.context import current

    resized = getattr(current().tracer, "resized", None)
    if resized is not None:
        resized(t)


class Runtime:
    """One processor's grouped, overlapped parameter collectives (see the module)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.generation = 0
        self.entries: dict = {}  # key -> Entry of this step
        self.order: list[Entry] = []  # this step's entries in order of first forward read
        self.pending: list[tuple[list[Entry], Handle]] = []  # launched gradient buckets
        self.buckets: list[list[Entry]] | None = None  # this backward's buckets
        self.launched = 0
        self.waiting: list[int] = []  # per bucket, its members whose gradient has not come yet
        self.finishing = False
        # forward: last step's gathered reads as buckets of (param ref, key, axes, dim)
        # the plan of this step, chosen at its first gathered read among the plans of earlier steps,
        # each kept under its first read (several models on one processor each keep theirs)
        self.plan: list[list[tuple]] = []
        self.plan_at: dict = {}  # key -> bucket index
        self.uses: dict = {}  # key -> forward ops that read it in the step the plan is from
        self.plans: dict = {}  # first read's key -> (plan, plan_at), the newest last
        self.chosen = False
        self.fetches: dict[int, Handle] = {}  # forward bucket -> its gather in flight (or done)
        self.refetches: dict[int, tuple[list[Entry], Handle]] = {}  # the same, gathered again
        self.bucket_bytes = 25 * 2**20
        self.gather_bytes = 4 * 2**20
        self.reshard = False
        self.arrived: set[Entry] = set()  # entries whose gradient came in this backward
        self.packs: dict[int, dict] = {}  # all_reduce bucket -> its members' places in its flat buffer
        # (id(parameter), adapters) -> its lasting entry (gradients to all-reduce: _lasting),
        # dropped when the parameter goes
        self.lasting: dict = {}
        self.hooks_made = 0  # gradient hooks registered on lasting entries' leaves (a count for tests)
        self.alone: dict = {}  # axes -> whether their group is this one processor
        self.opts: Options | None = None

    # -------------------------------------------------------------- forward
    def read(self, param: torch.Tensor, steps, how, opts: Options) -> torch.Tensor:
        if self.callback_missing and self.buckets is not None:
            self.finish()  # a backward ended, without the engine's callback to finish it
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
                e = self.entries[key] = self._lasting(param, key, axes)
                self.order.append(e)
            # a view, not the leaf: autocast caches its casts of leaves that require grad until the
            # autocast block ends (the whole forward), which would keep a bf16 copy of every
            # parameter the step reads alive through a recomputed forward (the per-use path's
            # values are no leaves); untagged: after_forward has nothing to free of an alias
            return e.leaf.view_as(e.leaf)
        if e is None or e.param is not param or e.version != param._version:
            e = self.entries[key] = self._gathered(param, key, axes, dim)
            self.order.append(e)
        elif e not in self.order:
            self.order.append(e)
        if e.reads == 0 and self.buckets is None and e.region is None and getattr(_on, "unsaved", 0):
            e.region = _on.region
        if e.freed:
            # read again in forward (the step before read it once more than this one): alone; in
            # backward (a recomputed forward): with the rest of its bucket, the next prefetched
            self.refill([e], read=True, alone=self.buckets is None)
        value = e.leaf.view_as(e.leaf)  # a view, not the leaf: as above
        value._overlap_entry = e
        return value

    def _lasting(self, param: torch.Tensor, key, axes) -> Entry:
        """The entry of a parameter whose gradient is all-reduced (data parallel): its leaf is an
        alias of the parameter, so it stays valid across optimizer steps (which update the
        storage in place) and is made, with its gradient hook, once per parameter and adapters,
        not every step, as DDP registers its hooks once. It is kept beside the parameter (weakly:
        it goes with the parameter) and holds the parameter only while a step reads it."""
        e = self.lasting.get(key)
        if e is None or e.ref() is not param:
            weakref.finalize(param, self.lasting.pop, key, None)
            e = None
        leaf = None if e is None else e.leaf
        # `p.data = ...` (module.to(dtype), .double()) swaps the storage: a new leaf for the new one
        if (leaf is None or not torch._C._is_alias_of(leaf, param) or leaf.shape != param.shape
                or leaf.stride() != param.stride() or leaf.dtype != param.dtype):
            e = self.lasting[key] = Entry(self, param, key, "all_reduce", axes, None, param)
            e.ref = weakref.ref(param)
            self.hooks_made += 1
        e.param, e.step = param, self.generation
        return e

    def _gathered(self, param, key, axes, dim) -> Entry:
        """The entry of a gathered parameter: from the bucket the previous step read it in
        (gathered with the bucket, the next one prefetched), or gathered alone."""
        if not self.chosen:
            self.plan, self.plan_at, self.uses = self.plans.get(key, ([], {}, {}))
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
                self._refetch(k - 1, read)
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

    def _refetch(self, k: int, read: bool = False) -> None:
        """Start gathering the freed members of forward bucket ``k`` again (once): those that
        backward reads, or with ``read`` all of them."""
        if k in self.refetches:
            return
        members = [e for e in self.order if e.fwd == k and e.freed and (read or e.needed)]
        work = (self.comm.all_gather_grouped([e.param.detach() for e in members], members[0].axes,
                                             [e.dim for e in members], async_op=True, lazy=True)
                if members else Handle(lambda: []))
        self.refetches[k] = (members, work)

    # -------------------------------------------------------------- backward
    def ready(self, e: Entry, generation: int) -> None:
        """``e``'s leaf has its whole local gradient (autograd's post-accumulate hook)."""
        g = e.leaf.grad
        e.leaf.grad = None
        if g is None:
            return
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
        del g  # held by the entry (or the bucket it launches) alone: released once packed
        self.arrived.add(e)
        if e.gathered:
            e.free()  # its last use has run backward
        self._launch(flush=False)
        if self.callback_missing and len(self.arrived) == len(self.order):
            self.finish()

    callback_missing = False

    def _reduce_alone(self, e: Entry, g: torch.Tensor) -> None:
        """Reduce ``e``'s gradient ``g`` by itself, outside the buckets, and add it now."""
        self._add([e], self._start(e.kind, e.axes, [e], [g]).wait())

    def _pack(self, e: Entry, g: torch.Tensor) -> torch.Tensor:
        """``e``'s gradient ``g`` copied into its place in its bucket's flat buffer (made at the
        bucket's first gradient), as DDP's buckets: the bucket's all_reduce runs on that buffer
        (:func:`~meshtorch.comm.grouped.pack_reduce` takes consecutive views of one buffer as
        it is), so its gradients are never held twice, unreduced and packed."""
        k = e.bucket
        slots = self.packs.get(k)
        if slots is None:
            members = self.buckets[k]
            flat = torch.empty(sum(m.leaf.numel() for m in members), dtype=g.dtype, device=g.device)
            slots, at = {}, 0
            for m in members:
                slots[m] = flat[at:at + m.leaf.numel()].view(m.leaf.shape)
                at += m.leaf.numel()
            self.packs[k] = slots
        slot = slots[e]
        if e.grad is None:
            slot.copy_(g)
        else:
            slot.add_(g)
        return slot

    def _cut_buckets(self) -> None:
        """Buckets in reverse order of forward reads, per (kind, axes, dtype), each up to its cap:
        gradients to all-reduce as DDP's (``bucket_mb``, the first at most 1 MB), gradients to
        reduce-scatter as FSDP2's, about a block's parameters (``gather_mb``, as their gathers),
        ending at a checkpointed block's edges as the gathers do (see :meth:`_end_step`).
        An all-reduce bucket holds at most a quarter of its kind's gradients (or 1 MB): its buffer is made at
        its first gradient, while backward still holds most activations, so that a model smaller
        than a few buckets does not hold its gradients' bytes early (its peak stays the per-use
        path's)."""
        buckets: list[list[Entry]] = []
        open_: dict = {}  # key -> (index of its open bucket, its bytes, buckets of the key so far)
        keys = {e: (e.kind, as_axes(e.axes), e.leaf.dtype, e.leaf.device) for e in self.order}
        totals = _totals(keys)
        for e in reversed(self.order):
            key = keys[e]
            k, size, count = open_.get(key, (None, 0, 0))
            edge = False
            if e.kind == "all_reduce":
                cap = min(self.bucket_bytes, FIRST_BUCKET) if count == 1 else self.bucket_bytes
                cap = min(cap, max(FIRST_BUCKET, totals[key] // MAX_SHARE))
            else:
                cap = self._gather_cap(totals[key])
                edge = k is not None and bool(buckets[k]) and buckets[k][-1].region != e.region
            if k is None or (size + e.nbytes > cap or edge) and size:
                k, size, count = len(buckets), 0, count + 1
                buckets.append([])
            buckets[k].append(e)
            open_[key] = (k, size + e.nbytes, count)
            e.bucket = k
        self.buckets, self.launched = buckets, 0
        self.waiting = [len(b) for b in buckets]

    def _gather_cap(self, total: int) -> int:
        """The bytes a grouped gather (and a bucket of gradients to reduce-scatter, which follows
        the gathers) holds at most, of ``total`` gathered bytes of its kind."""
        return min(self.gather_bytes, max(FIRST_BUCKET, total // GATHER_SHARE))

    def _launch(self, flush: bool) -> None:
        """Launch buckets in order while the next one is complete (``flush``: all, with what
        they have); the same buckets in the same order on every processor."""
        if self.buckets is None:  # _launch runs only after the buckets are made
            raise ArgumentError("gradient buckets launched before they were made (a meshtorch bug)")
        while self.launched < len(self.buckets):
            if not flush and self.waiting[self.launched]:
                return
            bucket = self.buckets[self.launched]
            members = [e for e in bucket if e.grad is not None]
            self.packs.pop(self.launched, None)  # its views, in the entries, hold the buffer
            if members:
                grads = [e.grad for e in members]
                for e in members:
                    e.grad = None
                if not _adopted(members):
                    self._wait_held()  # before packing: two held buckets' buffers are never alive together
                self.pending.append((members, self._start(members[0].kind, members[0].axes, members, grads)))
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
        held = [k for k, (members, _) in enumerate(self.pending) if not _adopted(members)]
        if len(held) >= MAX_PENDING:
            for _ in range(held[len(held) - MAX_PENDING] + 1):
                done, work = self.pending.pop(0)
                self._add(done, work.wait())

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
            for members, work in inflight:
                self._add(members, work.wait())
        finally:
            self._end_step()

    def _add(self, members: Sequence[Entry], grads: list[torch.Tensor]) -> None:
        """Add a bucket's reduced gradients into ``p.grad``. They are views of the call's one flat
        result (:mod:`meshtorch.comm.grouped`): where every member's ``p.grad`` is ``None`` (the
        step's first backward) the views become the gradients, and the flat result is exactly
        their bytes (DDP's ``gradient_as_bucket_view``, FSDP2's reduce output; no copy); otherwise
        (accumulation, a parameter twice in the bucket) those added into drop their views and
        the others take copies, so that no flat result lives on for part of its bytes."""
        params = [e.param for e in members]
        adopt = (len({id(p) for p in params}) == len(params)
                 and all(p.grad is None and g.dtype == p.dtype for p, g in zip(params, grads)))
        with torch.no_grad():
            for p, g in zip(params, grads):
                g = g.view(p.shape)
                if p.grad is None:
                    p.grad = g if adopt else g.to(p.dtype, copy=True)
                else:
                    p.grad.add_(g)

    def _end_step(self) -> None:
        for work in [*self.fetches.values(), *(w for _, w in self.refetches.values())]:
            work.wait()  # prefetches nobody read: complete before their buffers go
        self.refetches = {}
        plan: list[list[tuple]] = []
        open_: dict = {}
        gathered = [e for e in self.order if e.gathered]
        keys = {e: (as_axes(e.axes), e.leaf.dtype, e.leaf.device) for e in gathered}
        totals = _totals(keys)
        for e, key in keys.items():
            cap = self._gather_cap(totals[key])
            k = open_.get(key)
            if (k is None or plan[k] and (sum(m[4] for m in plan[k]) + e.nbytes > cap
                                          or plan[k][-1][5] != e.region)):
                k = open_[key] = len(plan)
                plan.append([])
            plan[k].append((weakref.ref(e.param), e.key, e.axes, e.dim, e.nbytes, e.region))
        if plan:
            first = plan[0][0][1]
            self.plans.pop(first, None)
            self.plans[first] = ([[m[:4] for m in b] for b in plan],
                                 {m[1]: k for k, b in enumerate(plan) for m in b},
                                 {e.key: e.reads for e in self.order if e.gathered})
            while len(self.plans) > MAX_PLANS:
                del self.plans[next(iter(self.plans))]
        self.plan, self.plan_at, self.uses, self.chosen = [], {}, {}, False
        self.fetches = {}
        for e in self.order:
            if e.ref is not None:  # lasting: ready for the next step, without holding the parameter
                e.param, e.grad, e.bucket = None, None, None
        self.entries, self.order = {}, []
        self.buckets, self.launched, self.finishing = None, 0, False
        self.callback_missing = False
        self.arrived = set()
        self.packs = {}
        self.generation += 1
