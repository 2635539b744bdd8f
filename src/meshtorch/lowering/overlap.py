"""Communication that overlaps: parameters' gradient-summing adapters as grouped, asynchronous
collectives (DDP's buckets, FSDP2's flat gathers and prefetch), switched on by :func:`overlap`.

Without it, a parameter read by an op through an adapter whose backward sums its gradient
(``identity_grad_sum``: data parallel; ``all_gather`` with its ``reduce_scatter`` backward: FSDP
by rules) runs that adapter as an autograd Function: one blocking collective per use forward and
one per parameter backward. Inside ``with mt.overlap():`` the lowering hands such a read to this
module instead (one clear place: :func:`run_op`), for any model written in the language:

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
- **The loss.** The all_reduce of a scalar's partial sums (a mean loss over split rows, a
  metric) is asynchronous too (:func:`read_later`): the result is a ``MeshTensor`` whose local
  value is waited for where it is first read (``.item()``, an op on it); ``backward()`` starts
  without it, since a scalar's gradient does not depend on its value. Blocking, it made every
  processor wait for the others in the forward too; now they meet at the end of backward only.
- **Recomputation.** A forward that ``mt.nn.checkpoint`` recomputes in backward saves nothing
  (:func:`unsaved`): its gathered values are freed after their last read and gathered again
  (grouped, per block) for the recomputation, also with ``reshard_after_forward=False``.
- **Reshard after forward** (``reshard_after_forward=True``): a gathered value's storage is freed
  after its op ran forward and gathered again (grouped, the previous bucket prefetched) just
  before that op's backward runs: FSDP2's ``reshard_after_forward``, less memory for more bytes.
  Otherwise the gathered values live until backward has used them (the default). A bucket
  gathered ahead for backward (or a recomputed forward) is waited on after one op
  (:meth:`~meshtorch.lowering.overlap_runtime.Runtime.land`): gloo stages a gather in flight
  until every processor has joined it, so that a late processor does not move another's peak.

Values are those of the per-use path: the same gathers forward; backward sums the uses' local
gradients before one reduction, as the lazy all-reduce does (bitwise the same where a parameter
has one use or is replicated).

Where it does not apply the per-use path runs: under ``torch.compile`` (a compiled graph
schedules its collectives itself), outside grad mode, for adapters of uneven pieces or of
several steps.

``torch.autograd.grad`` with respect to activations or inputs works inside (a gradient penalty:
the input's gradient with ``create_graph=True`` in the loss, then ``backward()``). With respect
to *parameters* call it outside :func:`overlap`: an op reads this module's leaf, not the
parameter, so autograd finds the parameter unused (``None`` with ``allow_unused=True``, else
torch's "appears to not have been used in the graph"), or, for a parameter that some op also
reads directly (a tied table's row lookup under FSDP rules), returns only that op's part. No
meshtorch code runs in such a call to raise an error of its own (the engine runs only the nodes
that lead to the parameters, none of this module's); seeing the gradients would put a node of
this module between each parameter and its reads, a Python frame per gradient of every step.
``backward(create_graph=True)`` (a Hessian-vector product through the parameters' gradients)
raises a :class:`~meshtorch.errors.MeshTorchError` at the first such gradient: the buckets'
collectives are not differentiable; outside :func:`overlap` every adapter is.

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from meshtorch.comm.base import Communicator, as_axes
from meshtorch.errors import ArgumentError
from meshtorch.lowering import adapters as ca
from meshtorch.lowering.adapters import is_dynamo_compiling
from meshtorch.lowering.overlap_reads import unread_by_backward
from meshtorch.lowering.overlap_runtime import Options, Runtime
from meshtorch.lowering.redistribute import run_shared, run_steps
from meshtorch.meta_autocast import autocast_enabled


class _Here(threading.local):
    """This thread's (processor's) state, set per thread on its first read, so that a read asks
    an attribute, not ``getattr`` (a call per parameter read). No class attribute of the same
    names: Dynamo (torch 2.11) reads a thread-local's attribute that its class also defines as the
    class's constant, and guarding ``options`` (an ``Options``) as one failed the compile of a step
    inside ``overlap()`` ('Unexpected type ... Options'); see :mod:`meshtorch.context`."""

    def __init__(self) -> None:
        self.options: Options | None = None  # while inside overlap()
        self.unsaved = 0  # depth of unsaved() blocks
        self.region = 0  # the last checkpointed block's number
        self.comm: Communicator | None = None  # the communicator whose Runtime ``runtime`` is
        self.runtime: Runtime | None = None


_on = _Here()


@contextmanager
def overlap(enabled: bool = True, *, bucket_mb: float = 25.0, reshard_after_forward: bool = False,
            gather_mb: float = 4.0) -> Iterator[None]:
    """Run parameters' gradient-summing collectives grouped and asynchronously in the block
    (see :mod:`meshtorch.lowering.overlap`); ``enabled=False`` keeps the per-use path.

    Enter it around forward *and* backward of a training step (``meshtorch train`` does).
    ``bucket_mb``: buckets of gradients to all-reduce (DDP's 25 MB); ``gather_mb``: grouped
    parameter gathers and buckets of gradients to reduce-scatter (about a block's parameters,
    FSDP2's unit: what is alive at once under ``reshard_after_forward``).

    A backward that raises (an error caught to skip the batch, on every processor: SPMD) never
    reaches its end, where the buckets are added into ``p.grad``: the next read of a parameter
    (the next step's forward) or the block's exit, whichever comes first, waits for its
    launched buckets and drops them with the rest, so that the next step is a fresh one. Its
    gradients are partial, as on the per-use path, which keeps whatever it reduced and
    accumulated before the error: here what was added by then stays (FSDP's buckets waited on
    during backward, data parallel's none unless ``p.grad`` was accumulating), the rest is
    dropped. Zero the gradients (``opt.zero_grad()``) before the next step, as a loop that skips
    a batch does. Call that next backward after a forward inside the block (as a step does), not
    on another graph made before the failed backward (not found failed before its gradients).

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
    prev = _on.options
    _on.options = (Options(float(bucket_mb), bool(reshard_after_forward), float(gather_mb)) if enabled
                   else None)
    try:
        yield
    finally:
        _on.options = prev
        _on.comm = _on.runtime = None  # (kept only inside the block: a runtime holds parameters' leaves)
        if enabled:
            from meshtorch.context import current

            rt = getattr(current().comm, "_overlap", None)
            if rt is not None:
                rt.settle(at_exit=True)  # a backward whose last gradients never came, or that raised


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
    _on.unsaved += 1
    if _on.unsaved == 1:
        _on.region += 1  # a new checkpointed block: buckets end at its edges
    try:
        yield
    finally:
        _on.unsaved -= 1


def options() -> Options | None:
    """The options in force on this processor, or ``None`` outside :func:`overlap`."""
    return _on.options


# ------------------------------------------------------------------ which reads qualify
def adapter_kind(steps) -> tuple[str, str | tuple[str, ...], int | None] | None:
    """``(kind of the gradient reduction, axes, gathered dim)`` for adapters this module runs,
    else ``None``: one step, an identity (all_reduce) or an even all_gather (reduce_scatter).
    A plan asks once per input (:class:`~meshtorch.lowering.lower.Plan`), its reads never.

    Example:
        >>> from meshtorch.lowering import adapters as ca
        >>> adapter_kind(((ca.identity_grad_sum, "b", ()),)), adapter_kind(())
        (('all_reduce', 'b', None), None)
    """
    if len(steps) != 1:
        return None
    fn, axes, args = steps[0]
    if fn is ca.identity_grad_sum:
        return "all_reduce", axes, None
    if fn is ca.all_gather and len(args) == 1:
        return "reduce_scatter", axes, args[0]
    return None


def run_op(plan, inputs: Sequence, n: int, local_fn, comm: Communicator | None) -> torch.Tensor:
    """The local result of :func:`~meshtorch.lowering.lower.lower`'s op whose plan shares some
    input's adapters (``plan.shared``: their backward sums the input's gradient; ``n``: the number
    of ``inputs``): each such
    input that :func:`overlapped_input` takes (a parameter inside :func:`overlap`) is read from
    this module, the others through their adapters, shared by every use of the tensor
    (:func:`~meshtorch.lowering.redistribute.run_shared`). ``comm``: this processor's, or
    ``None`` in a call Dynamo traces (the per-use path: a compiled graph schedules its
    collectives itself, and a traced step never reads this module's state).

    A data-parallel read of a parameter whose lasting entry is made (every step after the
    first) runs here, not in :func:`overlapped_input` and :meth:`Runtime.read`: one Python frame
    per op, where the op, the parameter's read and its entry's test were three, for every
    weight of a model, paid cold between its large kernels (issue 27)."""
    opts = _on.options
    rt = None
    if opts is not None and comm is not None:
        rt = _on.runtime if _on.comm is comm else _runtime_here(comm)
        if rt.buckets is not None or opts is not rt.opts:
            rt = None  # (a backward to settle, new options: Runtime.read's path)
    args, used = [None] * n, []  # (filled by index: no append call per operand)
    for i, x, s, shared, how in zip(range(n), inputs, plan.inputs, plan.shared, plan.overlapped):
        t = x.local
        if not shared:
            args[i] = run_steps(t, s) if s else t
            continue
        o = None
        if rt is not None and how is not None and how[0] == "all_reduce":
            key = (id(t), s)
            e = rt.lasting.get(key)
            if e is not None and (e.param is not t or e.step != rt.generation):
                # its first read in this step (a lasting entry holds its parameter, ``param``, from
                # its read to the step's end, Runtime._end_step: then it is this step's entry),
                # if it still serves: lasting_holds's test, inline (its call is a frame per read)
                leaf = e.leaf
                if (e.ref() is t and torch._C._is_alias_of(leaf, t) and leaf.shape == t.shape
                        and leaf.stride() == t.stride() and leaf.dtype == t.dtype):
                    e.param, e.step = t, rt.generation
                    rt.entries[key] = e
                    rt.order.append(e)
                else:
                    e = None
            if e is not None:
                # Runtime.read's value, the same: under autocast a view, not the leaf
                leaf = e.leaf
                kind = leaf.device.type
                amp = autocast_enabled(kind) if kind == "meta" else torch.is_autocast_enabled(kind)
                o = leaf.view_as(leaf) if amp else leaf
        if o is None and opts is not None and comm is not None and how is not None:
            o = overlapped_input(t, s, how, comm)
        if o is None:
            o = run_shared(t, x.adapter_memo(), s)
        elif not o.is_leaf:
            # a gathered value (a view of its entry's leaf): after_forward may free it. A
            # data-parallel read is the leaf itself (or, under autocast, an untagged view
            # of it), which after_forward has nothing to do for
            used.append(o)
        args[i] = o
    result = local_fn(plan.view, *args)
    if used:
        after_forward(used, result, args)
    return result


def overlapped_input(t: torch.Tensor, steps, how, comm: Communicator) -> torch.Tensor | None:
    """The value an op uses for the slice ``t`` adapted by ``steps`` inside :func:`overlap`,
    run by this module (a leaf whose gradient is reduced in buckets), or ``None``: use the
    per-use path (``t`` no parameter, or of a group of this processor alone). ``how``:
    :func:`adapter_kind` of ``steps``, which the op's plan holds. :func:`run_op` asks it, with
    this processor's ``comm``, for every input whose adapters sum its gradient (so in grad mode,
    for ``t`` requiring grad: the plan's key says so)."""
    rt = _on.runtime if _on.comm is comm else _runtime_here(comm)
    # (a parameter's class looked up, not isinstance: Parameter's metaclass checks instances in
    # Python; torch also counts a tensor marked _is_param)
    kind = _parameter_types.get(type(t))
    if kind is None:
        kind = _parameter_types[type(t)] = issubclass(type(t), torch.nn.Parameter)
    if not t.requires_grad or not kind and not getattr(t, "_is_param", False):
        return None
    alone = rt.alone.get(how[1])
    if alone is None:
        # a group of one (a rule splitting a dim over an axis of size 1): its collectives return
        # their input, so a "gathered" value would be the parameter itself, which this module
        # frees after backward; nothing moves, so the per-use path costs nothing
        alone = rt.alone[how[1]] = math.prod(rt.comm.mesh.axis_size(a) for a in as_axes(how[1])) == 1
    if alone:
        return None
    return rt.read(t, steps, how, _on.options, _on.region if _on.unsaved else None)


def _runtime_here(comm: Communicator) -> Runtime:
    """:func:`runtime` of ``comm``, kept as this thread's (each processor reads its own, per read)."""
    rt = runtime(comm)
    _on.comm, _on.runtime = comm, rt
    return rt


def read_later(t: torch.Tensor, steps) -> ca.Later | None:
    """Inside :func:`overlap`: the all_reduce of a scalar's partial sums (``steps``: an op's output
    adapters; a mean loss over split rows, a metric), issued asynchronously and waited for where
    the value is read (:meth:`meshtorch.tensor.MeshTensor.local`), so that the processors do not
    meet in the forward (DDP's loss is each process's own: they meet at the end of backward).
    ``None``: run ``steps`` as usual."""
    if (len(steps) != 1 or steps[0][0] is not ca.all_reduce_sum or steps[0][2]
            or _on.options is None or is_dynamo_compiling()):
        return None
    return ca.all_reduce_sum_later(t, _current().comm, steps[0][1])


_parameter_types: dict[type, bool] = {}  # tensor class -> whether it is a torch.nn.Parameter's


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


def release_parameters(params: Sequence[torch.Tensor]) -> None:
    """Before ``params`` are swapped (``torch.utils.swap_tensors``, as torch's swap flag converts
    and loads modules): this processor's :class:`Runtime` lets go of its weak references to them
    (:meth:`Runtime.release`), which swapping refuses; nothing where no step ran inside
    :func:`overlap` here.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.lowering.overlap import release_parameters
        >>> release_parameters([torch.nn.Parameter(torch.ones(2))])
    """
    rt = getattr(_current().comm, "_overlap", None)
    if rt is not None:
        rt.release(params)


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
    if not used or is_dynamo_compiling():
        return
    entries = []
    for v in used:  # (a loop: no generator's frames, per op reading parameters)
        e = getattr(v, "_overlap_entry", None)
        if e is not None and e.kind == "reduce_scatter":  # gathered
            entries.append(e)
    if not entries:
        return
    rt = entries[0].runtime
    rt.land()  # a gather issued ahead for backward is in flight across one op at most
    # the same storage object (data pointers are all 0 on the meta device, which the planner traces)
    if any(e.leaf.untyped_storage() is result.untyped_storage() for e in entries):
        for e in entries:
            e.pinned = True  # the result is a view of a gathered value: it must stay
        return
    if _on.unsaved:
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
