"""The one engine that moves data between layouts.

:func:`redistribute` takes a local slice laid out one way and returns this processor's slice of
the same values laid out another way (same sizes, dims possibly renamed), with the fewest
collectives: per mesh axis that changes, one ``all_to_all`` when the axis moves to another dim,
one ``all_gather`` when it becomes replicated, a local slice (no communication) when it becomes
split. Each step is an adapter of :mod:`meshtorch.lowering.adapters`, so the result is
differentiable. ``relayout``, ``to_global``, ``MeshTensor.backward(gradient)`` and the lowering of
every op move data through it.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.layout import LayoutRules
    >>> from meshtorch.lowering.redistribute import redistribute
    >>> def f():
    ...     x = mt.from_global(torch.arange(4.0), "batch:4")
    ...     whole = LayoutRules("").layout(x.shape, mt.current().mesh)
    ...     return redistribute(x.local, x.layout, whole).tolist(), mt.comm_stats().calls()
    >>> mt.launch(f, mesh="b:2", rules="batch:b")
    [([0.0, 1.0, 2.0, 3.0], 1), ([0.0, 1.0, 2.0, 3.0], 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshtorch.caching import BoundedCache
from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.layout import Layout
from meshtorch.lowering import adapters as ca

# One step of a move: an adapter and its arguments after (tensor, comm).
Step = tuple[Callable[..., torch.Tensor], str, tuple[int, ...]]


def steps_between(src: Layout, dst: Layout) -> tuple[Step, ...]:
    """The adapters that take a slice in layout ``src`` to layout ``dst``, in the order to run them.

    A tensor position can hold one axis at a time, so axes first move onto positions that nobody
    holds (one ``all_to_all`` each), then what must become whole is gathered, then what must become
    split is sliced.
    """
    if src.shape.sizes != dst.shape.sizes:
        raise ShapeError(
            f"redistribute keeps sizes: [{src.shape}] has sizes {list(src.shape.sizes)}, but "
            f"[{dst.shape}] has {list(dst.shape.sizes)}; use mt.reshape to change sizes"
        )
    before = {a: src.shape.index(d) for d, a in src.split.items()}
    after = {a: dst.shape.index(d) for d, a in dst.split.items()}
    moving = [a for a in src.mesh.axis_names if before.get(a) != after.get(a)]
    held = set(before.values())
    steps: list[Step] = []
    moved = set()
    for a in moving:
        if a in before and a in after and after[a] not in held:
            steps.append((ca.all_to_all, a, (after[a], before[a])))
            moved.add(a)
    steps += [(ca.all_gather_sliced, a, (before[a],)) for a in moving if a in before and a not in moved]
    steps += [(ca.local_slice, a, (after[a],)) for a in moving if a in after and a not in moved]
    return tuple(steps)


def run_steps(t: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    """Apply ``steps`` (adapters and their arguments) to the local tensor ``t`` on this processor."""
    if steps:
        comm = current().comm
        for fn, axis, args in steps:
            t = fn(t, comm, axis, *args)
    return t


def redistribute(t: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This processor's slice in layout ``dst`` of the tensor whose slice in layout ``src`` is ``t``.

    ``src`` and ``dst`` have the same sizes (their dim names may differ); the moves are cached per
    pair of layouts. Every processor must call it (SPMD): it runs collectives.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.lowering.redistribute import redistribute
        >>> x = mt.ones("a:2")
        >>> redistribute(x.local, x.layout, x.layout).tolist()
        [1.0, 1.0]
    """
    if src is dst:
        return t
    key = (src, dst)
    steps = _STEPS.get(key)
    if steps is None:
        steps = _STEPS.put(key, steps_between(src, dst))
    return run_steps(t, steps)


_STEPS = BoundedCache(4096)
