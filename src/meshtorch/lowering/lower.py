"""Lowering: one op on MeshTensors → adapters + a local torch op.

An op is described by its inputs, its output shape, the dims it reduces
(``"sum"``, ``"max"`` or ``"min"``), the dims its local function needs whole,
and the local function. :func:`lower` then

1. chooses, per mesh axis, the dim the *computation* is split on: among the
   dims that some operand or the output holds on that axis, the one that moves
   the fewest bytes forward and backward (ties: the output's); none if nothing
   is split along the axis;
2. brings every input to that computation layout with exactly one adapter of
   :mod:`meshtorch.lowering.adapters` per input and axis (the adapter table of the adapters module);
   where those adapters sum the input's gradient, every use of the tensor that needs the same
   ones shares them, so its gradient is reduced once (Mesh-TF's lazy all-reduce:
   :func:`~meshtorch.lowering.redistribute.run_shared`);
3. runs the local function on the slices;
4. turns the local result into the output's layout (partial sums →
   ``all_reduce`` or ``reduce_scatter``; a split moved → ``all_to_all``; ...).

This is the only place that decides communication, so individual ops never
call collectives themselves.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering.lower import lower
    >>> def f():
    ...     x = mt.from_global(torch.arange(4.0), "batch:4")
    ...     out = mt.Shape("")
    ...     s = lower("sum", [x], out, lambda view, l: l.sum(0), reduced={"batch": "sum"})
    ...     return s.item(), mt.comm_stats().calls(kind="all_reduce")
    >>> mt.launch(f, mesh="b:2", rules="batch:b")
    [(6.0, 1), (6.0, 1)]
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from meshtorch import caching
from meshtorch.caching import BoundedCache, constant_result
from meshtorch.context import current, here, traced
from meshtorch.errors import ShapeError
from meshtorch.layout import Layout, format_axes, piece
from meshtorch.lowering import adapters as ca
from meshtorch.lowering.adapters import is_dynamo_compiling  # (also the ops' and layers' test)
from meshtorch.lowering.output import _registered, tensor_type
from meshtorch.lowering.overlap import adapter_kind, read_later, run_op
from meshtorch.lowering.redistribute import Step, group, moves, run_steps, sums_gradient
from meshtorch.mesh import Mesh
from meshtorch.shape import Shape

if TYPE_CHECKING:
    from meshtorch.tensor import MeshTensor

REDUCTIONS = ("sum", "max", "min")


@dataclass(frozen=True)
class LocalView:
    """The computation's slice on this processor: ``(start, size)`` per dim name."""

    slices: dict[str, tuple[int, int]]

    def start(self, name: str) -> int:
        return self.slices[name][0]

    def size(self, name: str) -> int:
        return self.slices[name][1]


def _dim_sizes(inputs: Sequence[MeshTensor], out: Shape, whole: set[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for where, shape in [(f"input {i}", x.shape) for i, x in enumerate(inputs)] + [("output", out)]:
        for d in shape:
            if d.name in whole:
                continue
            if sizes.setdefault(d.name, d.size) != d.size:
                raise ShapeError(
                    f"dim {d.name!r} has size {sizes[d.name]} in one tensor and {d.size} in "
                    f"{where} [{shape}]; a dim name must mean one size — rename one of them"
                )
    return sizes


def _per_processor(layout: Layout) -> float:
    """Elements of a slice, averaged over the processors."""
    mesh = layout.mesh
    return layout.shape.numel / math.prod([mesh.axis_size(a) for a in mesh.axis_names if layout.dim_of(a)])


def _cost(c, axis, n, inputs, out_layout, reduced, grad) -> float:
    """Elements moved per processor (ring formulas), forward plus backward.

    Counted from global sizes over the number of pieces, never from this processor's slice:
    uneven pieces differ between processors, and every processor must choose alike."""
    total = 0.0
    for x in inputs:
        local = _per_processor(x.layout)
        d = x.layout.dim_of(axis)
        rg = x.requires_grad
        if d == c:
            continue
        if d is not None:
            if c is None:
                total += (n - 1) * local
            elif c not in x.shape:
                total += (n - 1) * local * (2 if rg else 1)
            else:
                total += (n - 1) / n * local * (2 if rg else 1)
        elif c is not None and rg:
            total += (n - 1) / n * local * (1 if c in x.shape else 2)
    d_out = out_layout.dim_of(axis)
    # the output's elements per processor along this axis (averaged over uneven pieces)
    out_whole = _per_processor(out_layout) * (n if d_out else 1)
    if c is None:
        total += (n - 1) / n * out_whole if (d_out and grad) else 0
    elif c in reduced:
        if reduced[c] == "sum":
            total += (n - 1) / n * out_whole * (2 if d_out is None else (2 if grad else 1))
        else:
            total += (n - 1) / n * out_whole * (4 if grad else 2)
    elif d_out != c:
        if d_out is None:
            total += (n - 1) / n * out_whole
        else:
            total += (n - 1) / n * out_whole / n * (2 if grad else 1)
    return total


def choose_computation(
    inputs: Sequence[MeshTensor],
    out_shape: Shape,
    out_layout: Layout,
    reduced: dict[str, str],
    whole: set[str],
) -> dict[str, str | None]:
    """Per mesh axis, the dim the computation is split on (``None``: not split)."""
    ctx = current()
    mesh, rules = ctx.mesh, ctx.rules
    sizes = _dim_sizes(inputs, out_shape, whole)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    comp: dict[str, str | None] = {}
    for axis in mesh.axis_names:
        n = mesh.axis_size(axis)
        held = {x.layout.dim_of(axis) for x in inputs} | {out_layout.dim_of(axis)}
        # Only dims some operand already holds on this axis: splitting the work on a
        # dim nobody holds would move data just to save compute. With none held the
        # op is computed replicated along the axis, which needs no communication.
        cands: list[str | None] = [
            c for c in sorted(held - {None})
            if c in sizes and axis in rules.axes_of(c) and (c in out_shape or c in reduced)
        ] or [None]
        d_out = out_layout.dim_of(axis)

        def key(c, axis=axis, n=n, d_out=d_out):
            return (_cost(c, axis, n, inputs, out_layout, reduced, grad), c != d_out)

        # the first cheapest (min's own key= is not traceable by torch.compile)
        comp[axis] = cands[min([(key(c), i) for i, c in enumerate(cands)])[1]]
    return comp


def computation_axes(comp: dict[str, str | None], rules) -> dict[str, tuple[str, ...]]:
    """Per dim the computation splits, its axes in its rule's order (major first)."""
    out: dict[str, tuple[str, ...]] = {}
    for c in dict.fromkeys(c for c in comp.values() if c is not None):
        out[c] = tuple(a for a in rules.axes_of(c) if comp.get(a) == c)
    return out


def _to_computation(x: MeshTensor, comp: dict[str, str | None], split: dict[str, tuple[str, ...]],
                    grad: bool) -> tuple[Step, ...]:
    """The adapters that bring ``x``'s slice to the computation layout ``split`` (dim → axes).

    Unlike :func:`steps_between`, an axis's computation dim may be one ``x`` does not have (it is
    contracted against another operand): ``x`` is then needed whole along that axis while the op
    varies along it, which needs the gradient-aware adapters.
    """
    mesh = x.layout.mesh
    summed = frozenset(a for a, c in comp.items() if c is not None and c not in x.shape)
    steps = moves(mesh, x.shape.sizes, [x.layout.axes_of(d.name) for d in x.shape],
                  [split.get(d.name, ()) for d in x.shape], summed)
    if grad and x.requires_grad:
        # replicated along an axis the op varies along: the identity forward, its gradient summed
        ident = tuple(a for a in mesh.axis_names if a in summed and x.layout.dim_of(a) is None)
        if ident:
            steps += ((ca.identity_grad_sum, group(ident), ()),)
    return steps


def _from_computation(
    comp: dict[str, str | None], split: dict[str, tuple[str, ...]], out_shape: Shape, out_layout: Layout,
    reduced: dict[str, str]
) -> tuple[Step, ...]:
    """The adapters that turn a local result in the computation layout into the output's layout
    (partial sums are reduced, unlike in :func:`steps_between`)."""
    mesh = out_layout.mesh
    partial = {a: reduced[c] for a, c in comp.items() if c in reduced}
    cur = [split.get(d.name, ()) for d in out_shape]
    dst = [out_layout.axes_of(d.name) for d in out_shape]
    steps: list[Step] = []
    # Where the output splits a dim next over axes that hold partial sums, reduce_scatter onto
    # it; over axes nothing holds, slice first (free) so that later collectives move less.
    for i in range(len(cur)):
        while cur[i] == dst[i][: len(cur[i])] and len(cur[i]) < len(dst[i]):
            a = dst[i][len(cur[i])]
            held = {b for axes in cur for b in axes}
            if partial.get(a) == "sum":
                run = (a,)
                for b in dst[i][len(cur[i]) + 1:]:
                    if partial.get(b) != "sum" or not mesh.in_order(run + (b,)):
                        break
                    run += (b,)
                steps.append((ca.reduce_scatter, group(run), (i,)))
                for b in run:
                    del partial[b]
            elif a not in partial and a not in held:
                run = (a,)
                steps.append((ca.local_slice, a, (i,)))
            else:
                break
            cur[i] += run
    for how in REDUCTIONS:
        axes = tuple(a for a in mesh.axis_names if partial.get(a) == how)
        if axes:
            if how == "sum":
                steps.append((ca.all_reduce_sum, group(axes), ()))
            else:
                steps.append((ca.all_reduce_extreme, group(axes), (how,)))
    return tuple(steps) + moves(mesh, out_shape.sizes, cur, dst)


class Plan:
    """What :func:`lower` decides for one op signature, computed once and replayed.

    Attributes:
        inputs: per input, the adapters that bring its slice to the computation layout.
        outputs: the adapters that bring the local result to the output's layout.
        view: the computation's slice of every dim on this processor.
        want: the local result's size the local function must return.
        layout: the output's layout.
        computed_as: per split dim, its axes (for error messages).
        moves: whether any adapter runs (never on one processor).
        shared: per input, whether its adapters are shared by every use of the tensor that runs
            the same ones (:func:`~meshtorch.lowering.redistribute.run_shared`: their backward sums
            the gradient, so it is summed locally and reduced once); ``None`` where none is.
        overlapped: per input, where ``shared`` is set, what :mod:`~meshtorch.lowering.overlap`
            runs of its adapters (:func:`~meshtorch.lowering.overlap.adapter_kind`, ``None``: not
            them), asked once per plan, not per read.
    """

    __slots__ = ("inputs", "outputs", "view", "want", "layout", "computed_as", "moves", "shared",
                 "overlapped")

    def __init__(self, inputs, outputs, view, want, layout, computed_as, shared=None):
        self.inputs: tuple[tuple[Step, ...], ...] = inputs
        self.outputs: tuple[Step, ...] = outputs
        self.view: LocalView = view
        self.want: tuple[int, ...] = want
        self.layout: Layout = layout
        self.computed_as: dict[str, tuple[str, ...]] = computed_as
        self.moves = bool(outputs) or any(inputs)
        self.shared: tuple[bool, ...] | None = shared if shared and any(shared) else None
        self.overlapped: tuple | None = None if self.shared is None else tuple(
            adapter_kind(s) if on else None for s, on in zip(inputs, self.shared))

    @property
    def adapters(self) -> int:
        """How many adapters the plan runs (0 on one processor)."""
        return sum(map(len, self.inputs)) + len(self.outputs)


def make_plan(
    op: str,
    inputs: Sequence[MeshTensor],
    out_shape: Shape,
    reduced: dict[str, str],
    whole: set[str],
    name: str | None,
) -> Plan:
    """The :class:`Plan` of one op under the current mesh and rules (checks its dims, raising
    :class:`ShapeError` or :class:`LayoutError` naming the tensor and dim at fault)."""
    ctx = current()
    _check_reductions(op, reduced)
    out_layout = ctx.rules.layout(out_shape, ctx.mesh, name)
    if ctx.mesh.size == 1:
        # every slice is the whole tensor: no adapters, only the checks
        _dim_sizes(inputs, out_shape, whole)
        comp: dict[str, str | None] = {}
    else:
        comp = choose_computation(inputs, out_shape, out_layout, reduced, whole)
    split = computation_axes(comp, ctx.rules)
    view_slices: dict[str, tuple[int, int]] = {}
    mesh, coords = ctx.mesh, ctx.coords
    for shape in [x.shape for x in inputs] + [out_shape]:
        for d in shape:
            if d.name in split:
                view_slices[d.name] = piece(d.size, [(mesh.axis_size(a), coords[a]) for a in split[d.name]])
            else:
                view_slices.setdefault(d.name, (0, d.size))
    want = tuple(view_slices[d.name][1] if d.name in split else d.size for d in out_shape)
    if not comp:
        return Plan(((),) * len(inputs), (), LocalView(view_slices), want, out_layout, split)
    grad = torch.is_grad_enabled()
    steps = tuple(_to_computation(x, comp, split, grad) for x in inputs)
    return Plan(
        steps, _from_computation(comp, split, out_shape, out_layout, reduced),
        LocalView(view_slices), want, out_layout, split,
        tuple(grad and x.requires_grad and sums_gradient(s) for x, s in zip(inputs, steps)),
    )


def plan_of(
    op: str,
    inputs: Sequence[MeshTensor],
    out_shape: Shape,
    reduced: dict[str, str] | None = None,
    whole: Iterable[str] = (),
    name: str | None = None,
    *,
    compiled: bool | None = None,
) -> Plan:
    """The cached :class:`Plan` of an op: a pure function of the inputs' layouts, which of them
    require grad and whether grad mode is on, the output shape, the reduced and whole dims, the
    rules, the mesh and this processor's rank. A model runs the same few signatures every step,
    so after the first step every op is one dict lookup.

    Under ``torch.compile`` the plan is resolved outside the trace: the traced code hands only
    constants (the inputs' :attr:`~meshtorch.layout.Layout.key`, names, sizes) to a function
    Dynamo calls rather than traces (``assume_constant_result``), and reads the plan back from
    :data:`RESOLVED`. So Dynamo does not trace the planner's Python (the bulk of a trace), a
    compile reuses the eager steps' plans, and the trace calls no builtin ``hash`` (untraceable
    on torch 2.11). ``compiled``: whether Dynamo traces the call, where the caller asked
    already (:func:`lower`); ``None``: asked here.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.lowering.lower import plan_of
        >>> x = mt.ones("batch:4")
        >>> p = plan_of("sum", [x], mt.Shape(""), reduced={"batch": "sum"})
        >>> p is plan_of("sum", [x], mt.Shape(""), reduced={"batch": "sum"}), p.adapters
        (True, 0)
    """
    # (the lookup is lower()'s first part: a lowered op then makes no call for its plan)
    return lower(op, inputs, out_shape, None, reduced=reduced, whole=whole, name=name, compiled=compiled)


_NO_DIMS: frozenset = frozenset()
# (rules, mesh, rank) -> a number that stands for them in the plans' keys
_SCOPES = BoundedCache(1024)
_SCOPE_SERIAL = itertools.count()
# this process's mark on the scopes it numbered: a context copied or unpickled elsewhere brings
# a number from another process's count, which a copy of this object does not vouch for
_HERE = object()


def _scope_of(ctx) -> tuple:
    """``ctx``'s rules, mesh and rank as one number, kept on ``ctx`` with the rules and
    communicator it was made for (:attr:`~meshtorch.context.ProcessorContext.plan_scope`).

    Every op's plan key holds them; hashing the three (Python ``__hash__`` methods) on every op
    cost three Python calls per op, paid cold between a model's large kernels (issue 27). Equal
    rules, mesh and rank give the same number, so contexts alike (each launch's, each thread
    processor's of one rank) share plans as before; a number is never given to other ones."""
    comm = ctx.comm
    key = (ctx.rules, comm.mesh, comm.rank)
    n = _SCOPES.get(key)
    if n is None:
        n = _SCOPES.put(key, next(_SCOPE_SERIAL))
    scope = ctx.plan_scope = (ctx.rules, comm, n, _HERE)
    return scope


class _Operand:
    """What the planner reads of an operand, rebuilt from a compiled program's constants."""

    __slots__ = ("layout", "shape", "local", "requires_grad")

    def __init__(self, key: tuple, requires_grad: bool):
        names, sizes, axes, split = key
        self.layout = Layout(Shape(zip(names, sizes)), Mesh(axes), dict(split))
        self.shape = self.layout.shape
        self.requires_grad = requires_grad
        self.local = self  # the plan's key reads ``x.local.requires_grad``


def _plan_of_constants(op: str, layouts: tuple, requires_grad: tuple | None, out_names: tuple,
                       out_sizes: tuple, reduced: tuple, whole: tuple, grad: bool,
                       name: str | None) -> Plan:
    """:func:`plan_of` from a compiled program's constants (run by :func:`resolved`)."""
    inputs = [_Operand(k, r) for k, r in zip(layouts, requires_grad or (False,) * len(layouts))]
    with torch.set_grad_enabled(grad):  # the traced program's grad mode, not the tracer's
        return plan_of(op, inputs, Shape(zip(out_names, out_sizes)), dict(reduced), whole, name)


def resolved(compute: Callable[..., Any], *args: Any) -> Any:
    """``compute(*args)`` for a compiled program, computed outside the trace and read by the
    graph as a constant; outside ``torch.compile``, simply ``compute(*args)``.

    ``args`` must be constants (strings, numbers, booleans, ``None``, tuples of them) that
    determine the result together with this processor's rules, mesh and rank; ``compute``
    must not change what it returns for them (memos of plans and shapes). Dynamo calls it
    once per trace instead of tracing it, and the graph reads the result as an attribute of
    :data:`RESOLVED`, set once and never changed, so the guards Dynamo installs on what it
    reads always hold: no recompile. A compiled step so spends no trace on planning, and reuses
    the plans its eager steps made.

    Example (eager, it is the call; :func:`plan_of` and the einsum and elementwise plans use it):
        >>> from meshtorch.lowering.lower import resolved
        >>> resolved(range, 0, 6, 2)
        range(0, 6, 2)
    """
    if not caching.compiling():
        return compute(*args)
    return getattr(RESOLVED, _resolve(compute, args))


#: What compiled programs read (:func:`resolved`), one attribute each; a module, so Dynamo
#: guards each attribute it reads, never the set of them.
RESOLVED = types.ModuleType("meshtorch.lowering.lower.RESOLVED")
_RESOLVED_NAMES: dict[tuple, str] = {}
_RESOLVING = threading.Lock()  # thread processors may compile at once
_SERIAL = itertools.count()  # attribute names are never reused


@constant_result
def _resolve(compute: Callable[..., Any], args: tuple) -> str:
    """For :func:`resolved`: Dynamo calls this (it does not trace it) with constants; the name
    of the attribute of :data:`RESOLVED` that holds ``compute(*args)``."""
    ctx = current()
    key = (compute, args, ctx.rules, ctx.comm.mesh, ctx.comm.rank)
    attr = _RESOLVED_NAMES.get(key)
    if attr is None:
        value = compute(*args)
        with _RESOLVING:
            attr = _RESOLVED_NAMES.get(key)
            if attr is None:
                attr = _RESOLVED_NAMES[key] = f"value{next(_SERIAL)}"
                setattr(RESOLVED, attr, value)
    return attr


# Every op's plan. A plan depends on nothing but its key, so entries hold across launches and
# threads (the rules, mesh and rank are in the key).
_PLANS = BoundedCache(8192)


def lower(
    op: str,
    inputs: Sequence[MeshTensor],
    out_shape: Shape,
    local_fn: Callable[..., torch.Tensor] | None,
    *,
    reduced: dict[str, str] | None = None,
    whole: Iterable[str] = (),
    name: str | None = None,
    compiled: bool | None = None,
    outputs: bool = True,
) -> MeshTensor:
    """Run ``local_fn(view, *local_inputs)`` as an SPMD op with minimal communication.

    Args:
        op: the op's name, for error messages.
        inputs: the MeshTensor operands.
        out_shape: the global output shape.
        local_fn: maps the operands' local slices (dims in each operand's shape
            order, sliced as the chosen computation layout says) to the local
            result (dims in ``out_shape`` order). ``view`` gives each dim's
            ``(start, size)`` in the computation. ``None``: only the op's :class:`Plan`
            (:func:`plan_of`), which the lookup that starts every lowered op finds.
        reduced: dims of the inputs that are reduced away, with how.
        whole: dims the local function needs unsplit (they are gathered).
        name: the output's name, for error messages.
        compiled: whether Dynamo traces this call (:func:`is_dynamo_compiling`), where the op
            asked already; ``None``: asked here. Asked once per op and handed down (to the plan,
            the overlap), not once per use: each Python frame between a model's large kernels
            runs cold (issue 27).
        outputs: ``False``: return ``(plan, local result)`` before the output adapters
            (``plan.outputs``) run, as :func:`local_result`.

    Returns the op's result, a MeshTensor (with ``local_fn=None`` its :class:`Plan`, with
    ``outputs=False`` the pair): one function, so that a lowered op runs in one Python frame.
    """
    if compiled is None:
        compiled = is_dynamo_compiling()
    # The op's Plan (plan_of's). Traced: resolved outside the trace (the planner's Python is much
    # of what Dynamo would otherwise trace per op), from constants only. Eager (and outside the
    # trace): one dict lookup, its key built here rather than in a function of its own (one
    # Python call less per op, paid cold between large kernels, issue 27).
    grad = torch.is_grad_enabled()
    n = len(inputs)  # (asked once: each builtin's call runs cold too)
    if compiled:
        plan = resolved(
            _plan_of_constants, op, tuple([x.layout.key for x in inputs]),
            tuple([x.local.requires_grad for x in inputs]) if grad else None,
            out_shape.names, out_shape.sizes, tuple(reduced.items()) if reduced else (),
            tuple(sorted(set(whole))), grad, name)
    else:
        ctx = here.ctx or current()  # (current() without its frame, inside a launch)
        scope = ctx.plan_scope
        if scope is None or scope[0] is not ctx.rules or scope[1] is not ctx.comm or scope[3] is not _HERE:
            scope = _scope_of(ctx)
        # Layouts and the output shape by their constants (Layout.key; names and sizes: equal
        # constants, equal objects), which hash and compare in C: the objects' own __hash__ and
        # __eq__ are Python calls, per op. One or two operands (nearly every op) without a loop.
        if n == 1:
            a = inputs[0]
            layouts = (a.layout.key,)
            needs = (a.local.requires_grad,) if grad else None
        elif n == 2:
            a, b = inputs
            layouts = (a.layout.key, b.layout.key)
            needs = (a.local.requires_grad, b.local.requires_grad) if grad else None
        elif n == 3:  # (layer norms with their weight and bias, attention)
            a, b, c = inputs
            layouts = (a.layout.key, b.layout.key, c.layout.key)
            needs = (a.local.requires_grad, b.local.requires_grad, c.local.requires_grad) if grad else None
        else:
            keys, wants = [None] * n, [None] * n
            for i, x in zip(range(n), inputs):
                keys[i], wants[i] = x.layout.key, x.local.requires_grad
            layouts, needs = tuple(keys), tuple(wants) if grad else None
        # whole is a set of dims: frozenset, so the same dims in another order hit the same entry
        key = (
            layouts,
            needs,
            out_shape.names,
            out_shape.sizes,
            tuple(reduced.items()) if reduced else (),
            frozenset(whole) if whole else _NO_DIMS,
            scope[2],
        )
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS.put(key, make_plan(op, inputs, out_shape, dict(reduced or {}), set(whole), name))
    if local_fn is None:
        return plan
    if plan.shared is not None:
        # parameters inside mt.overlap(): grouped, asynchronous reductions (lowering/overlap.py)
        # (one loop, no comprehensions: data parallel runs it for every op reading a parameter;
        # traced, the per-use path: a compiled graph schedules its collectives itself)
        result = run_op(plan, inputs, n, local_fn, None if compiled else ctx.comm)
    elif plan.moves:
        args = [None] * n
        for i, x, s in zip(range(n), inputs, plan.inputs):  # (a loop: no comprehension's frame)
            args[i] = run_steps(x.local, s) if s else x.local
        result = local_fn(plan.view, *args)
    elif n == 1:  # (no list built, no comprehension's frame: the usual op)
        result = local_fn(plan.view, inputs[0].local)
    elif n == 2:
        result = local_fn(plan.view, inputs[0].local, inputs[1].local)
    elif n == 3:  # (layer norms with their weight and bias, attention: no comprehension's frame)
        result = local_fn(plan.view, inputs[0].local, inputs[1].local, inputs[2].local)
    else:
        result = local_fn(plan.view, *[x.local for x in inputs])
    if result.shape != plan.want:
        raise ShapeError(
            f"{op}: the local function returned a slice of size {list(result.shape)}, but the "
            f"output [{out_shape}] computed as {_describe(plan.computed_as)} needs {list(plan.want)}"
        )
    if not outputs:
        return plan, result
    if plan.outputs:
        if not result.dim() and not compiled:  # a loss inside mt.overlap(): its all_reduce is read later
            later = read_later(result, plan.outputs)
            if later is not None:
                return tensor_type()._read_later(later, out_shape, plan.layout, name)
        result = run_steps(result, plan.outputs)
    # the adapters produce the output layout's slice of a result of the checked size: made as
    # MeshTensor._checked_elsewhere makes it (its body, here: one Python frame less per op, paid
    # cold between a model's large kernels, issue 27; tests/test_overhead_caches.py checks the two alike)
    t = object.__new__(_registered[0] if _registered else tensor_type())
    t.shape, t.layout, t.local, t.name = out_shape, plan.layout, result, name
    t._adapted = t._later = None
    if traced:
        tracer = current().tracer
        if tracer is not None:
            tracer.observe(t)
    return t


def local_result(op: str, inputs: Sequence[MeshTensor], out_shape: Shape,
                 local_fn: Callable[..., torch.Tensor], reduced: dict[str, str] | None = None,
                 whole: Iterable[str] = (), name: str | None = None) -> tuple[Plan, torch.Tensor]:
    """The first half of :func:`lower`: the op's plan and its local result in the computation
    layout, checked against the plan's size, before the output adapters (``plan.outputs``) run.
    :mod:`meshtorch.lowering.fused` runs the output adapters of several ops together."""
    return lower(op, inputs, out_shape, local_fn, reduced=reduced, whole=whole, name=name, outputs=False)


def _describe(split: dict[str, tuple[str, ...]]) -> str:
    return "; ".join(f"{d}:{format_axes(a)}" for d, a in split.items()) or "replicated"


def _check_reductions(op: str, reduced: dict[str, str]) -> None:
    for d, how in reduced.items():
        if how not in REDUCTIONS:
            raise ShapeError(f"{op}: reduction {how!r} of dim {d!r} is not one of {REDUCTIONS}")


def align(t: torch.Tensor, names: Sequence[str], target: Sequence[str]) -> torch.Tensor:
    """Permute and unsqueeze a local tensor with dims ``names`` so it broadcasts
    against dims ``target`` (a superset, any order)."""
    # Dynamo traces the memo's small function itself (it would bypass the lru_cache anyway, warning)
    memo = _alignment.__wrapped__ if caching.compiling() else _alignment
    perm, where = memo(tuple(names), tuple(target))
    if perm is not None:
        t = t.permute(perm)
    if where is None:
        return t
    sizes = t.shape
    return t.reshape([1 if i is None else sizes[i] for i in where])


@functools.lru_cache(maxsize=4096)
def _alignment(names: tuple[str, ...], target: tuple[str, ...]
               ) -> tuple[tuple[int, ...] | None, tuple[int | None, ...] | None]:
    """For :func:`align`: the permutation (``None``: already in order) and, for each dim of
    ``target``, the position of the permuted tensor's dim that fills it or ``None`` for a new
    size-1 dim (``None`` overall: nothing to add)."""
    order = tuple(names.index(n) for n in target if n in names)
    perm = order if order != tuple(range(len(order))) else None
    if len(order) == len(target):
        return perm, None
    it = iter(range(len(order)))
    return perm, tuple(next(it) if n in names else None for n in target)
