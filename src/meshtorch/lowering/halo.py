"""Halo exchange: the rows of a split dim a processor needs from its neighbours' slices.

A windowed op (a convolution, a pool, a shift) computes its piece of a dim from a range of the
input that reaches a little past this processor's slice on either side. :func:`halo_slice` gives
each processor exactly that range: its own rows, the rows before them from the previous piece
and the rows after them from the next piece, each received with one point-to-point ``permute``
over the axes that split the dim (one axis, or a group of axes for a rule such as ``h:(b,m)``;
pieces in the rule's order, even or uneven). Rows outside the dim are ``fill`` (or, with
``wrap``, the dim is cyclic). All members of a ``permute`` send the same shape, so each direction
carries the widest halo any processor needs, and only to the processors that need one: for a
kernel that reaches the same distance from every piece (a "same"-padded, stride-1 convolution)
that is the analytic minimum. The permutes are adapters of :mod:`meshtorch.lowering.adapters`,
so backward sends the halo's gradient back the same way.

A halo wider than the neighbour's slice would need rows from a processor further away: that raises
:class:`~meshtorch.errors.LayoutError`, naming the dim, the axes and the most pieces that work.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering.halo import halo_slice
    >>> def f():
    ...     x = mt.from_global(torch.arange(6.0), "t:6")
    ...     need = lambda parts: (lambda s, n: (s - 1, s + n + 1))(*mt.layout.piece(6, parts))
    ...     return halo_slice(x.local, 0, ("b",), 6, need, dim="t").tolist()
    >>> mt.launch(f, mesh="b:2", rules="t:b")
    [[0.0, 0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0, 0.0]]
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from meshtorch.context import current
from meshtorch.errors import LayoutError
from meshtorch.layout import format_axes, piece
from meshtorch.lowering import adapters as ca
from meshtorch.mesh import Mesh

# a piece of a dim, as meshtorch.layout.piece takes it: per cut (major first) its count and index
Parts = tuple[tuple[int, int], ...]
# the input range [a, b) a piece needs, in global positions (outside 0..total-1: fill, or wrapped)
Need = Callable[[Parts], tuple[int, int]]


class _Exchange:
    """What one processor does for one halo exchange (the same plan on every processor)."""

    __slots__ = ("left", "right", "recv_left", "recv_right", "own", "front", "back", "pieces", "me")

    def __init__(self, left, right, recv_left, recv_right, own, front, back, pieces, me):
        # widths sent in each direction (0: no permute), per piece who sends (None: nobody)
        self.left, self.right = left, right
        self.recv_left, self.recv_right = recv_left, recv_right
        # this processor's part: (start, length) of its own rows, rows taken from the left and
        # right halos ((offset, length) within the received block), fill rows before and after
        self.own, self.front, self.back = own, front, back
        self.pieces, self.me = pieces, me


def _parts(counts: Sequence[int], p: int) -> Parts:
    idx = []
    for n in reversed(counts):
        p, r = divmod(p, n)
        idx.append(r)
    return tuple(zip(counts, reversed(idx)))


@functools.lru_cache(maxsize=1024)
def _widths(total: int, counts: tuple[int, ...], needs: tuple[tuple[int, int], ...], wrap: bool
            ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]] | int:
    """Per piece: the rows it needs from its left and right neighbour and its clipped need.
    Returns the index of a piece whose halo reaches past its neighbour's slice when one does."""
    n = len(needs)
    spans = [piece(total, _parts(counts, p)) for p in range(n)]
    lefts, rights, clipped = [], [], []
    for p, ((s, length), (a, b)) in enumerate(zip(spans, needs)):
        e = s + length
        if not wrap:
            a, b = max(a, 0), min(b, total)
        if a >= b:
            lefts.append((0, 0))
            rights.append((0, 0))
            clipped.append((s, s))
            continue
        left = right = 0
        if a < s:
            q = p - 1 if p else (n - 1 if wrap else None)
            if q is None or n == 1 or s - a > spans[q][1] or (p == 0 and spans[q][0] + spans[q][1] != total):
                return p
            left = s - a
        if b > e:
            q = p + 1 if p < n - 1 else (0 if wrap else None)
            if q is None or n == 1 or b - e > spans[q][1] or (p == n - 1 and e != total):
                return p
            right = b - e
        lefts.append((left, max(0, min(b, s) - a)))
        rights.append((right, max(0, b - max(a, e))))
        clipped.append((a, b))
    return lefts, rights, clipped


def halo_slice(t: torch.Tensor, i: int, axes: Sequence[str], total: int, need: Need, *,
               wrap: bool = False, fill: float = 0.0, dim: str = "", op: str = "halo_exchange"
               ) -> torch.Tensor:
    """This processor's range ``need(piece)`` of a dim of global size ``total`` (tensor dim ``i``
    of the local slice ``t``, split over ``axes`` in its rule's order, ``torch.chunk`` pieces).

    ``need`` maps a piece (as :func:`meshtorch.layout.piece` takes it: per cut its count and
    index) to the global range ``[a, b)`` that piece needs; every processor evaluates it for every
    piece, so that it knows what its neighbours need from it. Positions outside ``0 .. total-1``
    are ``fill``, or with ``wrap`` taken cyclically. ``dim`` and ``op`` name the dim and the op in
    the error raised when a halo reaches past a neighbour's slice.
    """
    axes = tuple(axes)
    mesh = current().mesh
    counts = tuple(mesh.axis_size(a) for a in axes)
    n = math.prod(counts)
    if n == 1:
        return window(t, i, total, *need(_parts(counts, 0)), fill=fill, wrap=wrap)
    needs = tuple(need(_parts(counts, p)) for p in range(n))
    plan = _widths(total, counts, needs, wrap)
    if isinstance(plan, int):
        raise _too_wide(plan, total, counts, needs, need, axes, mesh, wrap, dim, op)
    lefts, rights, clipped = plan
    coords = current().coords
    me = 0
    for a, c in zip(axes, counts):
        me = me * c + coords[a]
    order = _group_order(mesh, axes, coords)
    s, length = piece(total, _parts(counts, me))
    a, b = clipped[me]
    parts: list[torch.Tensor] = []
    raw_a, raw_b = needs[me]
    if not wrap and raw_a < raw_b and raw_a < 0:
        parts.append(_fill_like(t, i, min(raw_b, 0) - raw_a, fill))
    group = _group(mesh, axes)
    # each piece sends its last rows to the next piece, and its first rows to the previous; the
    # fill beside a short piece is never read (a piece needs at most its neighbour's length)
    got = _receive(t, i, lefts, -1, order, group, fill)
    if got is not None:
        # the halo holds global rows [s - width, s): this piece reads [a, min(b, s))
        parts.append(got.narrow(i, got.shape[i] - lefts[me][0], lefts[me][1]))
    own_a, own_b = max(a, s), min(b, s + length)
    parts.append(t.narrow(i, own_a - s, max(0, own_b - own_a)) if own_b > own_a else t.narrow(i, 0, 0))
    got = _receive(t, i, rights, 1, order, group, fill)
    if got is not None:
        # the halo holds global rows [e, e + width): this piece reads [max(a, e), b)
        start = max(a, s + length) - (s + length)
        parts.append(got.narrow(i, min(start, got.shape[i]), rights[me][1]))
    if not wrap and raw_a < raw_b and raw_b > total:
        parts.append(_fill_like(t, i, raw_b - max(total, raw_a), fill))
    return parts[0] if len(parts) == 1 else torch.cat(parts, i)


def window(t: torch.Tensor, i: int, total: int, a: int, b: int, *, fill: float = 0.0,
           wrap: bool = False) -> torch.Tensor:
    """Rows ``[a, b)`` of tensor dim ``i`` of ``t``, which holds the whole dim (``total`` rows);
    rows outside it are ``fill``, or with ``wrap`` taken cyclically.

    Example:
        >>> import torch
        >>> t = torch.arange(3.0)
        >>> window(t, 0, 3, -1, 5).tolist(), window(t, 0, 3, -1, 2, wrap=True).tolist()
        ([0.0, 0.0, 1.0, 2.0, 0.0, 0.0], [2.0, 0.0, 1.0])
    """
    if b <= a:
        return t.narrow(i, 0, 0)
    if wrap:
        if a >= 0 and b <= total:
            return t.narrow(i, a, b - a)
        return t.index_select(i, torch.arange(a, b, device=t.device) % total)
    lo, hi = max(a, 0), min(b, total)
    mid = t.narrow(i, lo, max(0, hi - lo)) if hi > lo else t.narrow(i, 0, 0)
    if lo == a and hi == b:
        return mid
    front, back = max(0, min(lo, b) - a), max(0, b - max(hi, a))
    return torch.cat([_fill_like(t, i, front, fill), mid, _fill_like(t, i, back, fill)], i)


def _receive(t: torch.Tensor, i: int, widths: list[tuple[int, int]], step: int, order: list[int],
             group: str | tuple[str, ...], fill: float) -> torch.Tensor | None:
    """The halo from the piece ``step`` places on (``-1``: the previous piece's last rows,
    ``1``: the next piece's first rows), as wide as the widest any piece needs, sent only to the
    pieces that need one; ``None`` when none does."""
    width = max(w for w, _ in widths)
    if not width:
        return None
    sent = _pad_front(t, i, width, fill) if step < 0 else _pad_back(t, i, width, fill)
    n = len(widths)
    src: list[int | None] = [None] * n
    for p in range(n):
        if widths[p][0]:
            src[order[p]] = order[(p + step) % n]
    return ca.permute(sent, current().comm, group, tuple(src))


def feasible(total: int, axes: Sequence[str], need: Need, wrap: bool = False) -> bool:
    """Whether :func:`halo_slice` can serve ``need`` over ``axes`` (every halo within the
    neighbour's slice), on the current mesh.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.lowering.halo import feasible
        >>> wide = lambda parts: (lambda s, n: (s - 3, s + n))(*mt.layout.piece(4, parts))
        >>> [mt.launch(lambda: feasible(4, ("b",), wide), mesh=m)[0] for m in ("b:2", "b:4")]
        [True, False]
    """
    mesh = current().mesh
    counts = tuple(mesh.axis_size(a) for a in axes)
    needs = tuple(need(_parts(counts, p)) for p in range(math.prod(counts)))
    return not isinstance(_widths(total, counts, needs, wrap), int)


def _group(mesh: Mesh, axes: tuple[str, ...]) -> str | tuple[str, ...]:
    ordered = tuple(sorted(axes, key=mesh.axis_names.index))
    return ordered[0] if len(ordered) == 1 else ordered


def _group_order(mesh: Mesh, axes: tuple[str, ...], coords: dict[str, int]) -> list[int]:
    """Per piece (numbered row-major over ``axes`` in the rule's order), the position of the
    processor holding it in this processor's permute group (numbered in mesh order)."""
    ordered = sorted(axes, key=mesh.axis_names.index)
    sizes = {a: mesh.axis_size(a) for a in axes}
    out = []
    for idx in itertools.product(*(range(sizes[a]) for a in axes)):
        at = dict(zip(axes, idx))
        pos = 0
        for a in ordered:
            pos = pos * sizes[a] + at[a]
        out.append(pos)
    return out


def _fill_like(t: torch.Tensor, i: int, k: int, fill: float) -> torch.Tensor:
    size = list(t.shape)
    size[i] = k
    return t.new_full(size, fill)


def _pad_front(t: torch.Tensor, i: int, width: int, fill: float) -> torch.Tensor:
    n = t.shape[i]
    if n >= width:
        return t.narrow(i, n - width, width)
    return torch.cat([_fill_like(t, i, width - n, fill), t], i)


def _pad_back(t: torch.Tensor, i: int, width: int, fill: float) -> torch.Tensor:
    n = t.shape[i]
    if n >= width:
        return t.narrow(i, 0, width)
    return torch.cat([t, _fill_like(t, i, width - n, fill)], i)


def _too_wide(p: int, total: int, counts: tuple[int, ...], needs, need: Need, axes: tuple[str, ...],
              mesh: Mesh, wrap: bool, dim: str, op: str) -> LayoutError:
    s, length = piece(total, _parts(counts, p))
    a, b = needs[p]
    reach = max(s - max(a, 0 if not wrap else a), min(b, total if not wrap else b) - s - length)
    n = math.prod(counts)
    def fits(k: int) -> bool:
        return not isinstance(_widths(total, (k,), tuple(need(((k, q),)) for q in range(k)), wrap), int)

    most = next((k for k in range(n - 1, 0, -1) if fits(k)), 1)
    if len(axes) == 1:
        sizes = ",".join(f"{x}:{most if x == axes[0] else mesh.axis_size(x)}" for x in mesh.axis_names)
        fix = f"use mesh '{sizes}' (at most {most} pieces along axis {axes[0]!r})"
    else:
        fix = f"split {dim!r} over axes that make at most {most} pieces"
    return LayoutError(
        f"{op}: dim {dim!r} of size {total} is split over axis {format_axes(axes)} into {n} pieces; "
        f"piece {p} (rows {s}..{s + length - 1}) needs {reach} rows from a neighbour, more than the "
        f"neighbour's slice holds (halo wider than a slice); {fix}, or leave {dim!r} unsplit"
    )
