"""Processor meshes: named axes, row-major processor numbering.

A mesh spec such as ``"b:2,m:4"`` names the axes and their sizes; processors
are numbered row-major over the axes (the last axis varies fastest).

Example:
    >>> from meshtorch.mesh import Mesh
    >>> mesh = Mesh("b:2,m:4")
    >>> mesh.size, mesh.coords(5), mesh.group(5, ("b",))
    (8, {'b': 1, 'm': 1}, (1, 5))
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from functools import lru_cache

from meshtorch import caching
from meshtorch.errors import MeshError
from meshtorch.shape import named_sizes

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Mesh:
    """A processor mesh with named axes.

    Args:
        spec: ``"b:2,m:4"`` (``;`` also separates), a ``{"b": 2, "m": 4}`` dict,
            a list of ``(name, size)`` pairs, or another ``Mesh``. ``""`` is the
            one-processor mesh with no axes.

    Example:
        >>> Mesh({"b": 2}).axis_names, Mesh("").size
        (('b',), 1)
    """

    __slots__ = ("axes", "_index")

    def __init__(self, spec: Mesh | str | dict[str, int] | Iterable[tuple[str, int]] = ""):
        if isinstance(spec, Mesh):
            self.axes: tuple[tuple[str, int], ...] = spec.axes
            self._index = spec._index
            return
        if isinstance(spec, str):
            items = named_sizes(spec, MeshError, "mesh", "'axis:size,axis:size', e.g. 'b:2,m:4'")
        elif isinstance(spec, dict):
            items = list(spec.items())
        else:
            items = [tuple(x) for x in spec]
        for name, size in items:
            if not isinstance(name, str) or not _NAME.match(name):
                raise MeshError(f"mesh axis name {name!r} is not an identifier")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are ints >= 1")
        self.axes = tuple((n, s) for n, s in items)
        self._index = {n: i for i, (n, _) in enumerate(self.axes)}
        if len(self._index) != len(self.axes):
            raise MeshError(f"mesh {spec!r} repeats an axis name; axis names must be unique")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __contains__(self, axis: object) -> bool:
        return axis in self._index

    def axis_size(self, axis: str) -> int:
        """Size of a mesh axis, with an error naming the axes that exist."""
        try:
            return self.axes[self._index[axis]][1]
        except KeyError:
            raise MeshError(
                f"mesh axis {axis!r} is not in mesh '{self}' (axes: {list(self.axis_names)})"
            ) from None

    def coords(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of processor ``rank``."""
        if not 0 <= rank < self.size:
            raise MeshError(f"processor {rank} is not in mesh '{self}' of {self.size} processors")
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.axis_names}

    def rank(self, coords: dict[str, int]) -> int:
        """Processor number of the given coordinates."""
        r = 0
        for name, size in self.axes:
            r = r * size + coords[name]
        return r

    def group(self, rank: int, axes: Iterable[str]) -> tuple[int, ...]:
        """The processors that share ``rank``'s coordinates on every axis not in
        ``axes``, ordered row-major over ``axes`` (in mesh order)."""
        # Dynamo traces the memo's function itself (it would bypass the lru_cache anyway, warning)
        return (_group.__wrapped__ if caching.compiling() else _group)(
            self, rank, tuple(sorted(axes, key=self._index.__getitem__)))

    def in_order(self, axes: Iterable[str]) -> bool:
        """Whether ``axes`` come in mesh order, so a group over them (numbered row-major in
        mesh order) takes them major first in the order given.

        Example:
            >>> Mesh("b:2,m:4").in_order(("b", "m")), Mesh("b:2,m:4").in_order(("m", "b"))
            (True, False)
        """
        idx = [self._index[a] for a in axes]
        return all(i < j for i, j in zip(idx, idx[1:]))

    def position(self, rank: int, axes: Iterable[str]) -> int:
        """Index of ``rank`` within its group over ``axes``."""
        return self.group(rank, axes).index(rank)

    def groups(self, axes: Iterable[str]) -> list[tuple[int, ...]]:
        """All groups over ``axes``, each ordered as :meth:`group` orders it."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.size):
            seen.setdefault(self.group(r, axes), None)
        return list(seen)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.axes == other.axes

    def __hash__(self) -> int:
        return hash(self.axes)

    def __str__(self) -> str:
        return ",".join(f"{n}:{s}" for n, s in self.axes)

    def __repr__(self) -> str:
        return f"Mesh({str(self)!r})"


@lru_cache(maxsize=4096)
def _group(mesh: Mesh, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    for a in axes:
        mesh.axis_size(a)
    base = mesh.coords(rank)
    members = [dict(base)]
    for a in axes:
        members = [{**m, a: i} for m in members for i in range(mesh.axis_size(a))]
    return tuple(sorted(mesh.rank(m) for m in members))
