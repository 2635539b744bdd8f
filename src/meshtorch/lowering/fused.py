"""Fused reductions: the all_reduces of several small ops, one collective per mesh axis.

An optimizer step reduces many small tensors (a parameter's RMS, Adafactor's row and column
statistics, each gradient's share of the global norm). Lowered one at a time, each is its own
``all_reduce``, and on a large mesh a scalar all_reduce costs its latency, not its bytes.
:class:`Fused` lowers the ops one by one (their local parts and any input adapters run at
once, so their inputs can be freed) and holds back their output reductions; :meth:`Fused.run`
then issues them bucketed: the pending ``all_reduce`` steps along the same axis with the same
reduce op and dtype are flattened into one buffer, reduced with one collective, and split back
(what DDP's gradient buckets do). Every backend runs the same collective, so the ``meta``
backend's counts, and with them the planner, see the fused calls.

The buffers are reduced elementwise, so the values are those of the ops lowered one by one.
A tensor reduced along several axes takes its axes in mesh order; each round runs the earliest
axis any tensor is waiting on, so ``k`` tensors each reduced over some of the axes cost at most
one collective per axis (and per reduce op and dtype).

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering.fused import Fused
    >>> def f():
    ...     x = mt.from_global(torch.arange(4.0), "batch:4")
    ...     fused = Fused()
    ...     for k in range(3):
    ...         fused.lower("sum", [x * k], mt.Shape(""), lambda view, t: t.sum(0),
    ...                     reduced={"batch": "sum"})
    ...     sums = [s.item() for s in fused.run()]
    ...     return sums, mt.comm_stats().calls(kind="all_reduce")
    >>> mt.launch(f, mesh="b:2", rules="batch:b")[0]
    ([0.0, 6.0, 12.0], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from meshtorch.comm.base import as_axes
from meshtorch.context import current
from meshtorch.errors import CommError
from meshtorch.lowering import adapters as ca
from meshtorch.lowering.lower import local_result
from meshtorch.lowering.output import tensor_type
from meshtorch.lowering.redistribute import Step
from meshtorch.shape import Shape

if TYPE_CHECKING:
    from meshtorch.tensor import MeshTensor

# the steps that reduce elementwise, so tensors can share one buffer
_FUSABLE = (ca.all_reduce_sum, ca.all_reduce_extreme)


class Fused:
    """Ops whose output all_reduces run together, at :meth:`run`.

    Add ops with :meth:`lower` (as :func:`meshtorch.lowering.lower.lower`) or raw partial
    results with :meth:`partial`; :meth:`run` returns the results in the order added. Every
    processor must add the same ops in the same order (SPMD).
    """

    def __init__(self) -> None:
        self._results: list[torch.Tensor] = []
        self._steps: list[tuple[Step, ...]] = []
        self._wrap: list[tuple[Shape, object, str | None] | None] = []

    def __len__(self) -> int:
        return len(self._results)

    def lower(self, op: str, inputs: Sequence[MeshTensor], out_shape: Shape,
              local_fn: Callable[..., torch.Tensor], *, reduced: dict[str, str] | None = None,
              whole: Iterable[str] = (), name: str | None = None) -> int:
        """Lower an op now, except its output adapters; returns its index in :meth:`run`'s list."""
        plan, result = local_result(op, inputs, out_shape, local_fn, reduced, whole, name)
        self._results.append(result)
        self._steps.append(plan.outputs)
        self._wrap.append((out_shape, plan.layout, name))
        return len(self._results) - 1

    def partial(self, t: torch.Tensor, axes: Iterable[str], op: str = "sum") -> int:
        """A local tensor to reduce (``sum``, ``max`` or ``min``) over ``axes``; its index in
        :meth:`run`'s list, where it is a plain tensor, the same on every processor of the group."""
        mesh = current().mesh
        axes = set(axes)
        for a in axes:
            mesh.axis_size(a)
        if op not in ("sum", "max", "min"):
            raise CommError(f"partial reduce op {op!r} is not one of ('sum', 'max', 'min')")
        step = (ca.all_reduce_sum, ()) if op == "sum" else (ca.all_reduce_extreme, (op,))
        self._results.append(t)
        self._steps.append(tuple((step[0], a, step[1]) for a in mesh.axis_names if a in axes))
        self._wrap.append(None)
        return len(self._results) - 1

    def run(self) -> list[MeshTensor | torch.Tensor]:
        """Issue the held-back adapters, bucketed, and return every result (MeshTensors for
        :meth:`lower`, tensors for :meth:`partial`). The object is empty afterwards."""
        tensors = run_bucketed(self._results, self._steps)
        out: list[MeshTensor | torch.Tensor] = [
            t if w is None else tensor_type()._checked_elsewhere(t, w[0], w[1], w[2])
            for t, w in zip(tensors, self._wrap)]
        self._results, self._steps, self._wrap = [], [], []
        return out


def run_bucketed(tensors: Sequence[torch.Tensor], steps: Sequence[Sequence[Step]]) -> list[torch.Tensor]:
    """Apply each tensor's adapter steps, in its own order, fusing the elementwise reductions
    that are next for several tensors along the same axis into one collective."""
    comm = current().comm
    order = {a: i for i, a in enumerate(comm.mesh.axis_names)}
    out = list(tensors)
    pos = [0] * len(out)
    while True:
        ready: dict[tuple, list[int]] = {}
        for i, s in enumerate(steps):
            # what cannot share a buffer runs as soon as it is next
            while pos[i] < len(s) and s[pos[i]][0] not in _FUSABLE:
                fn, axis, args = s[pos[i]]
                out[i] = fn(out[i], comm, axis, *args)
                pos[i] += 1
            if pos[i] < len(s):
                fn, axis, args = s[pos[i]]
                t = out[i]
                # a dim split over several axes reduces over the whole group in one step
                key = (tuple(order[a] for a in as_axes(axis)), _FUSABLE.index(fn), args, str(t.dtype),
                       str(t.device))
                ready.setdefault(key, []).append(i)
        if not ready:
            return out
        # the earliest axes first: a tensor reduced over b then m joins the b bucket, then the m one
        members = ready[min(ready)]
        fn, axis, args = steps[members[0]][pos[members[0]]]
        for i, t in zip(members, _bucket([out[i] for i in members], fn, comm, axis, args)):
            out[i] = t
            pos[i] += 1


def _bucket(ts: list[torch.Tensor], fn, comm, axis: str, args: tuple) -> list[torch.Tensor]:
    if len(ts) == 1:
        return [fn(ts[0], comm, axis, *args)]
    flat = fn(torch.cat([t.reshape(-1) for t in ts]), comm, axis, *args)
    return [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in ts]), ts)]
