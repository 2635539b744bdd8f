"""Lowering: one op on MeshTensors → adapters + a local torch op (DESIGN §3–§4).

An op is described by its inputs, its output shape, the dims it reduces
(``"sum"``, ``"max"`` or ``"min"``), the dims its local function needs whole,
and the local function. :func:`lower` then

1. chooses, per mesh axis, the dim the *computation* is split on: among the
   dims that some operand or the output holds on that axis, the one that moves
   the fewest bytes forward and backward (ties: the output's); none if nothing
   is split along the axis;
2. brings every input to that computation layout with exactly one adapter of
   :mod:`meshtorch.comm.autograd` per input and axis (DESIGN §4's table);
3. runs the local function on the slices;
4. turns the local result into the output's layout (partial sums →
   ``all_reduce`` or ``reduce_scatter``; a split moved → ``all_to_all``; ...).

This is the only place that decides communication, so individual ops never
call collectives themselves.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering import lower
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
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from meshtorch.caching import BoundedCache
from meshtorch.comm import autograd as ca
from meshtorch.context import current
from meshtorch.errors import LayoutError, ShapeError
from meshtorch.layout import Layout
from meshtorch.shape import Shape
from meshtorch.tensor import MeshTensor, layout_for

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


def _cost(c, axis, n, inputs, out_layout, reduced, grad) -> float:
    """Elements moved per processor (ring formulas), forward plus backward."""
    total = 0.0
    for x in inputs:
        local = x.local.numel()
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
    out_whole = math.prod(out_layout.local_sizes) * (n if d_out else 1)
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
            if c in sizes and rules.axis_of(c) == axis and sizes[c] % n == 0
            and (c in out_shape or c in reduced)
        ] or [None]
        d_out = out_layout.dim_of(axis)

        def key(c, axis=axis, n=n, d_out=d_out):
            return (_cost(c, axis, n, inputs, out_layout, reduced, grad), c != d_out)

        comp[axis] = min(cands, key=key)
    return comp


def to_computation(
    x: MeshTensor, comp: dict[str, str | None], varying: Iterable[str] | None = None
) -> torch.Tensor:
    """``x``'s local tensor brought to the computation layout (DESIGN §4 table)."""
    comm = current().comm
    t = x.local
    for axis, c in comp.items():
        d = x.layout.dim_of(axis)
        if d == c:
            continue
        if d is not None:
            i = x.shape.index(d)
            if c is None:
                t = ca.all_gather_sliced(t, comm, axis, i)
            elif c not in x.shape:
                t = ca.all_gather(t, comm, axis, i)
            else:
                t = ca.all_to_all(t, comm, axis, x.shape.index(c), i)
        elif c is not None:
            if c in x.shape:
                t = ca.local_slice(t, comm, axis, x.shape.index(c))
            elif x.requires_grad:
                t = ca.identity_grad_sum(t, comm, axis)
    return t


def from_computation(
    t: torch.Tensor,
    comp: dict[str, str | None],
    out_shape: Shape,
    out_layout: Layout,
    reduced: dict[str, str],
) -> torch.Tensor:
    """A local result in the computation layout → the output's layout."""
    comm = current().comm
    for axis, c in comp.items():
        d_out = out_layout.dim_of(axis)
        if c is None:
            if d_out is not None:
                t = ca.local_slice(t, comm, axis, out_shape.index(d_out))
        elif c in reduced:
            if reduced[c] == "sum":
                if d_out is None:
                    t = ca.all_reduce_sum(t, comm, axis)
                else:
                    t = ca.reduce_scatter(t, comm, axis, out_shape.index(d_out))
            else:
                t = ca.all_reduce_extreme(t, comm, axis, reduced[c])
                if d_out is not None:
                    t = ca.local_slice(t, comm, axis, out_shape.index(d_out))
        elif c in out_shape:
            if d_out is None:
                t = ca.all_gather_sliced(t, comm, axis, out_shape.index(c))
            elif d_out != c:
                t = ca.all_to_all(t, comm, axis, out_shape.index(d_out), out_shape.index(c))
        else:  # pragma: no cover - choose_computation never picks such a dim
            raise LayoutError(f"dim {c!r} is neither reduced nor in the output [{out_shape}]")
    return t


def lower(
    op: str,
    inputs: Sequence[MeshTensor],
    out_shape: Shape,
    local_fn: Callable[..., torch.Tensor],
    *,
    reduced: dict[str, str] | None = None,
    whole: Iterable[str] = (),
    name: str | None = None,
) -> MeshTensor:
    """Run ``local_fn(view, *local_inputs)`` as an SPMD op with minimal communication.

    Args:
        op: the op's name, for error messages.
        inputs: the MeshTensor operands.
        out_shape: the global output shape.
        local_fn: maps the operands' local slices (dims in each operand's shape
            order, sliced as the chosen computation layout says) to the local
            result (dims in ``out_shape`` order). ``view`` gives each dim's
            ``(start, size)`` in the computation.
        reduced: dims of the inputs that are reduced away, with how.
        whole: dims the local function needs unsplit (they are gathered).
        name: the output's name, for error messages.
    """
    ctx = current()
    if ctx.mesh.size == 1:
        return _lower_one_processor(ctx, op, inputs, out_shape, local_fn, reduced, whole, name)
    reduced = dict(reduced or {})
    _check_reductions(op, reduced)
    whole = set(whole)
    out_layout = layout_for(out_shape, name)
    comp = choose_computation(inputs, out_shape, out_layout, reduced, whole)
    locals_ = [to_computation(x, comp) for x in inputs]
    split = {c: a for a, c in comp.items() if c is not None}
    view_slices: dict[str, tuple[int, int]] = {}
    for shape in [x.shape for x in inputs] + [out_shape]:
        for d in shape:
            if d.name in split:
                n = ctx.mesh.axis_size(split[d.name])
                size = d.size // n
                view_slices[d.name] = (ctx.coords[split[d.name]] * size, size)
            else:
                view_slices.setdefault(d.name, (0, d.size))
    result = local_fn(LocalView(view_slices), *locals_)
    want = tuple(view_slices[d.name][1] if d.name in split else d.size for d in out_shape)
    if tuple(result.shape) != want:
        raise ShapeError(
            f"{op}: the local function returned a slice of size {list(result.shape)}, but the "
            f"output [{out_shape}] computed as {split or 'replicated'} needs {list(want)}"
        )
    out = from_computation(result, comp, out_shape, out_layout, reduced)
    return MeshTensor(out, out_shape, out_layout, name)


def _check_reductions(op: str, reduced: dict[str, str]) -> None:
    for d, how in reduced.items():
        if how not in REDUCTIONS:
            raise ShapeError(f"{op}: reduction {how!r} of dim {d!r} is not one of {REDUCTIONS}")


def _lower_one_processor(ctx, op, inputs, out_shape, local_fn, reduced, whole, name) -> MeshTensor:
    """:func:`lower` on a one-processor mesh: every slice is the whole tensor and every adapter
    is the identity, so only the local function runs (the per-op Python is most of meshtorch's
    cost on one processor). Same checks and errors as the general path."""
    # whole is a set of dims: frozenset, so the same dims in another order hit the same entry
    key = (tuple([x.shape for x in inputs]), out_shape, frozenset(whole),
           tuple(reduced.items()) if reduced else ())
    view = _ONE_VIEWS.get(key)
    if view is None:
        view = _ONE_VIEWS.put(key, _one_processor_view(op, inputs, out_shape, reduced or {}, set(whole)))
    result = local_fn(view, *[x.local for x in inputs])
    if result.shape != out_shape.sizes:
        raise ShapeError(
            f"{op}: the local function returned a slice of size {list(result.shape)}, but the "
            f"output [{out_shape}] computed as replicated needs {list(out_shape.sizes)}"
        )
    # axes of size 1 divide every dim: the layout cannot raise
    layout = ctx.rules.layout(out_shape, ctx.mesh)
    return MeshTensor._checked_elsewhere(result, out_shape, layout, name)


# The one-processor LocalView of each op signature (input shapes, output shape, whole and reduced
# dims): a model runs the same few signatures every step. It depends on nothing else (not the
# rules, not the mesh), so entries hold across launches; the checks run when an entry is made.
_ONE_VIEWS = BoundedCache(4096)


def _one_processor_view(op, inputs, out_shape, reduced, whole) -> LocalView:
    _check_reductions(op, reduced)
    view: dict[str, tuple[int, int]] = {}
    for shape in [x.shape for x in inputs] + [out_shape]:
        for d in shape.dims:
            seen = view.setdefault(d.name, (0, d.size))
            if seen[1] != d.size and d.name not in whole:
                _dim_sizes(inputs, out_shape, whole)  # raises, naming both tensors
    return LocalView(view)


def align(t: torch.Tensor, names: Sequence[str], target: Sequence[str]) -> torch.Tensor:
    """Permute and unsqueeze a local tensor with dims ``names`` so it broadcasts
    against dims ``target`` (a superset, any order)."""
    perm, where = _alignment(tuple(names), tuple(target))
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
