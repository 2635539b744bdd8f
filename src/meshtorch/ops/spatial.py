"""Spatial partitioning: ``halo_exchange``, and the lowering of windowed ops (conv, pool).

A windowed op computes each output position of a spatial dim from a window of input positions.
When the rules split a spatial dim over the same axes in the input and the output, each processor
computes its piece of the output from its slice of the input plus a halo of the rows the window
reaches into its neighbours' slices (:mod:`meshtorch.lowering.halo`); otherwise the dim is
gathered. The other dims (batch, channels) go through the ordinary lowering, so a split input
channel gives partial sums (one ``all_reduce``) and a split output channel splits the kernel.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     x = mt.from_global(torch.arange(8.0), "h:8")
    ...     return mt.halo_exchange(x, "h", 1, 1).tolist()
    >>> mt.launch(f, mesh="b:2", rules="h:b")
    [[0.0, 0.0, 1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0, 7.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from meshtorch.errors import ShapeError
from meshtorch.layout import piece
from meshtorch.lowering.halo import halo_slice, window
from meshtorch.lowering.lower import LocalView, lower
from meshtorch.shape import Dim, Shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor, layout_for


def halo_exchange(x: MeshTensor, dim: str | Dim, left: int, right: int, wrap: bool = False,
                  fill: float = 0.0) -> torch.Tensor:
    """This processor's slice of ``x``, extended along ``dim`` by the ``left`` elements before it
    and the ``right`` elements after it (``fill`` beyond the ends of ``dim``, or with ``wrap`` the
    dim is cyclic): the building block of spatial partitioning, Mesh-TF's ``mtf.halo_exchange``.

    It returns the local ``torch.Tensor`` (dims in ``x``'s order), the input of a local windowed
    computation. Along a split ``dim`` the halos come from the neighbouring processors, one
    point-to-point ``permute`` per side over the axes that split it (gradients flow back the same
    way); a halo wider than a neighbour's slice raises :class:`~meshtorch.errors.LayoutError`
    naming the most pieces that work. Along an unsplit dim it only pads.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(4.0), "h:4")
        >>> mt.halo_exchange(x, "h", 1, 2).tolist()
        [0.0, 0.0, 1.0, 2.0, 3.0, 0.0, 0.0]
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "halo_exchange")]
    if left < 0 or right < 0:
        raise ShapeError(f"halo_exchange of {d.name!r}: left and right must be >= 0 (got {left}, {right})")
    i = x.shape.index(d.name)

    def need(parts):
        s, n = piece(d.size, parts)
        return s - left, s + n + right

    return halo_slice(x.local, i, x.layout.axes_of(d.name), d.size, need, wrap=wrap, fill=fill,
                      dim=d.name, op="halo_exchange")


@dataclass(frozen=True)
class Window:
    """One spatial dim of a windowed op: its input size, output size, and the input range
    ``[a, b)`` an output range ``(start, length)`` reads (outside the input: the op's fill)."""

    name: str
    size: int
    out: int
    reads: Callable[[int, int], tuple[int, int]]


def lower_windowed(op: str, x: MeshTensor, others: Sequence[MeshTensor], out_shape: Shape,
                   windows: Sequence[Window], local_fn: Callable[..., torch.Tensor], *,
                   fill: float = 0.0, reduced: dict[str, str] | None = None,
                   whole: set[str] = frozenset(), name: str | None = None) -> MeshTensor:
    """Lower a windowed op: ``local_fn(view, xw, *others)`` gets, along every window dim, exactly
    the input range its output piece reads (``xw``) and returns that output piece.

    A window dim split over the same axes in ``x`` and the output (and held by no other operand)
    is served by a halo exchange; any other is gathered whole. The rest is :func:`lower`'s.
    """
    out_layout = layout_for(out_shape, name)
    held = {a for o in others for axes in o.layout.split.values() for a in axes}
    t, proxy, gathered = x.local, x.shape, set(whole)
    for w in windows:
        axes = x.layout.axes_of(w.name)
        if axes and axes == out_layout.axes_of(w.name) and not held.intersection(axes):
            def need(parts, w=w):
                s, n = piece(w.out, parts)
                return w.reads(s, n)

            t = halo_slice(t, x.shape.index(w.name), axes, w.size, need, fill=fill, dim=w.name, op=op)
            proxy = proxy.replace(w.name, Dim(w.name, w.out))
        else:
            gathered.add(w.name)
    # x with its halos: its window dims sized as the output's, so the lowering splits them alike
    xh = MeshTensor._checked_elsewhere(t, proxy, layout_for(proxy), x.name)
    spots = [(x.shape.index(w.name), w) for w in windows if w.name in gathered]

    def run(view: LocalView, xl: torch.Tensor, *ols: torch.Tensor) -> torch.Tensor:
        for i, w in spots:
            xl = window(xl, i, w.size, *w.reads(0, w.out), fill=fill)
        if spots:
            # a gathered dim's view is the whole output dim (the lowering saw two sizes)
            view = LocalView({**view.slices, **{w.name: (0, w.out) for _, w in spots}})
        return local_fn(view, xl, *ols)

    return lower(op, [xh, *others], out_shape, run, reduced=reduced, whole=gathered, name=name)
