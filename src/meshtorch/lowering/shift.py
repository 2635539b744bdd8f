"""Shifting a slice along a dim: the halo a processor needs from its neighbours.

:func:`shift_slice` is what ``mt.shift`` lowers to: ``out[g] = x[g - offset]`` along one tensor
dim, where zeros shift in at the edges (or, with ``wrap``, the dim is cyclic). Along a dim that a
mesh axis splits, each processor receives exactly the elements it lacks, with one point-to-point
``shift`` along the axis (two when ``offset`` is not a multiple of the slice length); along an
unsplit dim nothing is sent. A dim split over several axes, or unevenly, receives its halo from
the neighbouring pieces (:mod:`meshtorch.lowering.halo`) when they hold it, and is gathered only
for an offset that reaches past a neighbour's slice. The point-to-point steps are adapters of
:mod:`meshtorch.lowering.adapters`, so the result is differentiable.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering.shift import shift_slice
    >>> def f():
    ...     x = mt.from_global(torch.arange(4.0), "t:4")
    ...     return shift_slice(x.local, 0, "b", 1, wrap=True).tolist(), mt.comm_stats().calls()
    >>> mt.launch(f, mesh="b:2", rules="t:b")
    [([3.0, 0.0], 1), ([1.0, 2.0], 1)]
"""

from __future__ import annotations

import math

import torch

from meshtorch.comm.base import as_axes
from meshtorch.context import current
from meshtorch.layout import piece
from meshtorch.lowering import adapters as ca
from meshtorch.lowering.halo import feasible, halo_slice
from meshtorch.lowering.redistribute import moves, run_steps


def shift_slice(t: torch.Tensor, i: int, axes: str | tuple[str, ...] | None, offset: int,
                wrap: bool, total: int | None = None) -> torch.Tensor:
    """This processor's slice of ``x`` shifted by ``offset`` along tensor dim ``i``.

    ``t`` is the local slice; ``axes`` are the mesh axes that split dim ``i`` (``None`` or ``()``:
    the dim is whole on every processor and the shift is local), ``total`` its global size
    (``None``: evenly split). A dim split over several axes, or unevenly, gets the halo from its
    neighbouring pieces; only an offset wider than a neighbour's slice gathers it.
    """
    axes = as_axes(axes) if axes else ()
    if not axes:
        return _shift_whole(t, i, offset, wrap)
    comm = current().comm
    n = math.prod([comm.mesh.axis_size(a) for a in axes])
    total = t.shape[i] * n if total is None else total
    if len(axes) > 1 or total % n:
        if not wrap and abs(offset) >= total:
            return _shift_whole(t, i, offset, wrap)
        # the halo from the neighbouring pieces, in the rule's order, when they hold it
        for k in ((offset % total, offset % total - total) if wrap else (offset,)):
            def need(parts, k=k):
                s, length = piece(total, parts)
                return s - k, s + length - k

            if feasible(total, axes, need, wrap):
                return halo_slice(t, i, axes, total, need, wrap=wrap, dim="", op="shift")
        split = [()] * t.dim()
        split[i] = axes
        sizes = [0] * t.dim()
        sizes[i] = total
        whole = run_steps(t, moves(comm.mesh, sizes, split, [()] * t.dim()))
        return run_steps(_shift_whole(whole, i, offset, wrap), moves(comm.mesh, sizes, [()] * t.dim(), split))
    axis = axes[0]
    length = t.shape[i]
    q, r = divmod(offset, length)
    # global position g = c*L + j reads g - offset: from processor c-q at j-r, or c-q-1 at j-r+L
    near = ca.shift(t.narrow(i, 0, length - r), comm, axis, q, wrap)
    if r == 0:
        return near
    far = ca.shift(t.narrow(i, length - r, r), comm, axis, q + 1, wrap)
    return torch.cat([far, near], i)


def _shift_whole(t: torch.Tensor, i: int, k: int, wrap: bool) -> torch.Tensor:
    if wrap:
        return torch.roll(t, k, i)
    n = t.shape[i]
    if abs(k) >= n:
        # concatenating an empty slice keeps the result in the autograd graph
        return torch.cat([torch.zeros_like(t), t.narrow(i, 0, 0)], i)
    if k >= 0:
        return torch.cat([torch.zeros_like(t.narrow(i, 0, k)), t.narrow(i, 0, n - k)], i)
    return torch.cat([t.narrow(i, -k, n + k), torch.zeros_like(t.narrow(i, 0, -k))], i)
