"""Layout rules and tensor layouts (see docs/design.md, Vocabulary).

Layout rules map dim names to mesh axes, globally for a program: ``"batch:b; d_ff:m"``. A rule
may name a tuple of axes, ``"batch:(b,m)"``: the dim is split over the sub-mesh of those axes,
row-major (``b`` major, ``m`` minor, as JAX's ``PartitionSpec(("b", "m"))``). A tensor's layout
follows from its shape and the rules: dims are taken in shape order, and a dim takes its rule's
axes unless an earlier dim of the same tensor already holds one of them (then it takes none of
them, and the tensor is replicated along the free ones). Along every axis a tensor is either split
(one dim holds the axis) or replicated.

A dim over axes ``(a1, ..., ak)`` is cut with ``torch.chunk`` over ``a1``, each piece again over
``a2``, and so on: DTensor's ``Shard`` placed on those mesh axes one after another. A dim its
axes do not divide is split all the same: the last pieces are smaller, or empty.

Example:
    >>> from meshtorch.layout import LayoutRules
    >>> from meshtorch.mesh import Mesh
    >>> from meshtorch.shape import Shape
    >>> rules = LayoutRules("batch:(b,m); d_model:b; d_ff:m")
    >>> lay = rules.layout(Shape("batch:8,d_model:16"), Mesh("b:2,m:2"))
    >>> lay.split, lay.local_sizes
    ({'batch': ('b', 'm')}, (2, 16))
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Iterable, Mapping

from meshtorch import caching
from meshtorch.caching import BoundedCache
from meshtorch.errors import LayoutError, ShapeError
from meshtorch.mesh import Mesh
from meshtorch.shape import Dim, Shape


def _check_dim_name(dim: object, axis: object) -> None:
    """Raise unless ``dim`` is a valid dim name: a rule naming no possible dim would never apply."""
    try:
        Dim(dim, 1)  # type: ignore[arg-type]  # Dim's own name check, the one definition of a name
    except ShapeError:
        raise LayoutError(
            f"rule '{dim}:{axis}' names dim {dim!r}, which is not a dim name (letters, digits and '_', "
            "not starting with a digit; no spaces); fix the rule's dim name, e.g. 'd_ff:m'"
        ) from None

Axes = tuple[str, ...]

# ';' or ',' separate rules, but not the ',' inside a rule's "(b,m)"
_RULE_SEP = re.compile(r"[;,](?![^()]*\))")


def piece(size: int, parts: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``(start, length)`` of one piece of a dim of ``size`` cut by ``torch.chunk`` again and
    again: ``parts`` lists, major first, each cut's number of pieces and the index taken.

    Example:
        >>> piece(8, [(2, 1), (2, 0)]), piece(5, [(4, 3)])
        ((4, 2), (5, 0))
    """
    start, length = 0, size
    for n, i in parts:
        # torch.chunk's pieces: ceil(length / n) each, the last ones shorter or empty
        chunk = -(-length // n)
        lo = min(i * chunk, length)
        start, length = start + lo, min(lo + chunk, length) - lo
    return start, length


def lengths(mesh: Mesh, axes: str | Iterable[str], whole: int) -> list[int] | None:
    """Each group member's length (in group order) when a length ``whole`` is cut over ``axes``
    (in mesh order), or ``None`` when the pieces are equal (no axes: one piece).

    Example:
        >>> lengths(Mesh("b:2,m:2"), ("b", "m"), 5), lengths(Mesh("b:2"), "b", 4)
        ([2, 1, 1, 1], None)
    """
    # Dynamo traces the memo's function itself (it would bypass the lru_cache anyway, warning)
    return (_lengths.__wrapped__ if caching.compiling() else _lengths)(mesh, _as_axes(axes), whole)


@functools.lru_cache(maxsize=4096)
def _lengths(mesh: Mesh, axes: Axes, whole: int) -> list[int] | None:
    counts = [mesh.axis_size(a) for a in axes]
    if whole % math.prod(counts) == 0:
        return None
    return [piece(whole, zip(counts, idx))[1] for idx in itertools.product(*map(range, counts))]


def format_axes(axes: Axes) -> str:
    """How a rule writes ``axes``: ``b`` for one axis, ``(b,m)`` for several."""
    return axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"


def _parse_axes(dim: str, spec: object, whole: object) -> Axes:
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("(") and text.endswith(")"):
            axes = tuple(a.strip() for a in text[1:-1].split(","))
        else:
            axes = (text,)
    elif isinstance(spec, Iterable):
        axes = tuple(spec)
    else:
        axes = ()
    if not axes or not all(isinstance(a, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a) for a in axes):
        raise LayoutError(
            f"cannot parse the axes {spec!r} of dim {dim!r} in {whole!r}; write 'dim:axis' or "
            "'dim:(axis,axis)', e.g. 'batch:(b,m); d_ff:m'"
        )
    if len(set(axes)) != len(axes):
        raise LayoutError(f"rule '{dim}:{format_axes(axes)}' names an axis twice; name each axis once")
    return axes


class LayoutRules:
    """Global rules: which mesh axes each dim name is split over.

    Args:
        spec: ``"batch:(b,m); d_ff:m"`` (``;`` or ``,`` separate rules; ``(b,m)`` splits a dim
            over several axes, ``b`` major), a dict of dim name to an axis or a tuple of axes,
            or another ``LayoutRules``. ``""`` keeps every tensor replicated.

    Example:
        >>> LayoutRules("batch:(b,m); vocab:m").axes_of("batch")
        ('b', 'm')
    """

    # ``rules`` is fixed once built (nothing may change it in place): the layouts derived from it
    # are cached per (shape, mesh) in ``_layouts``, which belongs to this object alone, so other
    # rules (another launch, another thread's context) never see its entries.
    __slots__ = ("rules", "_layouts", "_hash")

    def __init__(self, spec: LayoutRules | str | Mapping[str, str | Iterable[str]] | None = ""):
        # per rules object; a program uses far fewer distinct shapes than the bound
        self._layouts: BoundedCache = BoundedCache(4096)
        if isinstance(spec, LayoutRules):
            self.rules: dict[str, Axes] = dict(spec.rules)
            self._hash = spec._hash
            return
        pairs: list[tuple[str, object]] = []
        if spec is None:
            spec = ""
        if isinstance(spec, str):
            for part in _RULE_SEP.split(spec):
                part = part.strip()
                if not part:
                    continue
                dim, sep, axis = part.partition(":")
                if not sep or not dim.strip() or not axis.strip():
                    raise LayoutError(
                        f"cannot parse rule {part!r} in {spec!r}; write 'dim:axis; dim:(axis,axis)', "
                        "e.g. 'batch:(b,m); d_ff:m'"
                    )
                pairs.append((dim.strip(), axis))
        else:
            pairs = list(spec.items())
        rules: dict[str, Axes] = {}
        for dim, axis in pairs:
            _check_dim_name(dim, axis)
            axes = _parse_axes(dim, axis, spec)
            if dim in rules and rules[dim] != axes:
                raise LayoutError(
                    f"dim {dim!r} has two rules, '{dim}:{format_axes(rules[dim])}' and "
                    f"'{dim}:{format_axes(axes)}'; keep one rule for {dim!r} (to split it over "
                    f"several axes name them together: '{dim}:(a,b)')"
                )
            rules[dim] = axes
        self.rules = rules
        # the lowering's plans are keyed by the rules: hashed once, here, not on first use, which
        # torch.compile would guard on (a recompile once eager code hashed it); rules built in a
        # compiled program hash on use (builtin hash() is untraceable on torch 2.11)
        self._hash = None if caching.compiling() else hash(tuple(sorted(rules.items())))

    def axes_of(self, dim: str) -> Axes:
        """The axes a dim name is split over, major first (``()``: no rule)."""
        return self.rules.get(dim, ())

    def axis_of(self, dim: str) -> str | None:
        """The one axis a dim name is split over, for algorithms that run along a single axis
        (halo shifts, ring attention); ``None`` when it has no rule or a rule of several axes
        (then such algorithms take their general path).

        Example:
            >>> rules = LayoutRules("batch:(b,m); vocab:m")
            >>> rules.axis_of("vocab"), rules.axis_of("batch")
            ('m', None)
        """
        axes = self.rules.get(dim, ())
        return axes[0] if len(axes) == 1 else None

    def pieces(self, dim: str, mesh: Mesh) -> int:
        """How many pieces ``dim``'s rule cuts it into on ``mesh`` (axes the mesh lacks count 1),
        when no earlier dim of the tensor holds its axes.

        Example:
            >>> rules = LayoutRules("batch:(b,m)")
            >>> rules.pieces("batch", Mesh("b:2,m:4")), rules.pieces("d", Mesh("b:2"))
            (8, 1)
        """
        return math.prod([mesh.axis_size(a) for a in self.rules.get(dim, ()) if a in mesh])

    def check(self, mesh: Mesh) -> None:
        """Raise if a rule names an axis the mesh does not have."""
        for dim, axes in self.rules.items():
            for axis in axes:
                if axis not in mesh:
                    raise LayoutError(
                        f"rule '{dim}:{format_axes(axes)}' names axis {axis!r}, which mesh '{mesh}' "
                        f"does not have (axes: {list(mesh.axis_names)}); fix the rule or add the axis "
                        "to the mesh"
                    )

    def unused(self, *of: object) -> list[str]:
        """The rules whose dim none of ``of`` has: a typo (``dff`` for ``d_ff``) or a rule for
        another model. Rules are global and a rule naming a dim no tensor has splits nothing, which
        is no error (one rule set may serve several models): this is how to see it.

        Each of ``of`` is a :class:`~meshtorch.shape.Shape` or its text (``"batch:8,d_model:16"``),
        a MeshTensor (its ``.shape``), or a module (the dims of its ``named_mesh_parameters()``).
        Parameters have no ``batch`` or ``length``: pass an input's shape for the activations' dims.

        Example:
            >>> rules = LayoutRules("batch:b; dff:m; heads:m")
            >>> rules.unused("batch:8,d_model:16", "d_model:16,d_ff:64")
            ['dff:m', 'heads:m']
        """
        dims: set[str] = set()
        for x in of:
            if hasattr(x, "named_mesh_parameters"):  # a module (duck-typed: nn sits above this file)
                for _, p in x.named_mesh_parameters():
                    dims.update(p.shape.names)
                continue
            shape = x.shape if hasattr(x, "shape") and isinstance(x.shape, Shape) else x
            if not isinstance(shape, (Shape, str)):
                raise ShapeError(f"unused() takes Shapes, their text, MeshTensors or modules, got {x!r}")
            dims.update(Shape(shape).names)
        return [f"{d}:{format_axes(a)}" for d, a in self.rules.items() if d not in dims]

    def layout(self, shape: Shape, mesh: Mesh, name: str | None = None) -> Layout:
        """The layout of ``shape`` on ``mesh`` under these rules (see docs/design.md, Vocabulary)."""
        # A model asks for the same few layouts on every op of every step. Shape and Mesh are
        # immutable and compared by value, so an entry is right for any equal shape and mesh.
        # (``name`` only words the error, and errors are not cached.)
        # (by names, sizes and mesh axes, equal exactly when the objects are: hashed in C, where
        # the objects' own __hash__ are Python calls, on every op's output)
        key = (shape.names, shape.sizes, mesh.axes)
        compiled = caching.compiling()
        lay = None if compiled else self._layouts.get(key)
        if lay is None:
            lay = self._derive(shape, mesh, name)
            if not compiled:
                self._layouts.put(key, lay)
        return lay

    def _derive(self, shape: Shape, mesh: Mesh, name: str | None) -> Layout:
        split: dict[str, Axes] = {}
        taken: set[str] = set()
        for d in shape:
            # axes the mesh lacks are ignored, as a one-axis rule for a missing axis is
            axes = tuple(a for a in self.rules.get(d.name, ()) if a in mesh)
            # all or nothing: a dim whose axes are partly held keeps none, so a rule's
            # axes always stay together, in the rule's order
            if not axes or taken.intersection(axes):
                continue
            split[d.name] = axes
            taken.update(axes)
        return Layout(shape, mesh, split)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutRules) and self.rules == other.rules

    def __hash__(self) -> int:
        h = self._hash
        return h if h is not None else hash(tuple(sorted(self.rules.items())))

    def __reduce__(self):
        return (LayoutRules, (dict(self.rules),))

    def __str__(self) -> str:
        return "; ".join(f"{d}:{format_axes(a)}" for d, a in self.rules.items())

    def __repr__(self) -> str:
        return f"LayoutRules({str(self)!r})"


class Layout:
    """Where the pieces of one tensor live: ``split`` maps dim name → its axes, major first.

    Example:
        >>> lay = Layout(Shape("batch:8,d:4"), Mesh("b:2,m:2"), {"batch": ("b", "m")})
        >>> lay.dim_of("m"), lay.axes_of("d"), lay.slices({"b": 1, "m": 0})
        ('batch', (), ((4, 2), (0, 4)))
    """

    # Immutable once built. The slice sizes (checked against every new MeshTensor's slice) are
    # computed here once when every piece is the same size, else once per processor.
    __slots__ = ("shape", "mesh", "split", "_by_axis", "even_sizes", "_at", "key", "_hash")

    def __init__(self, shape: Shape, mesh: Mesh, split: Mapping[str, str | Axes]):
        self.shape = shape
        self.mesh = mesh
        self.split: dict[str, Axes] = {
            d.name: _as_axes(split[d.name]) for d in shape if d.name in split and split[d.name]}
        #: the layout as plain constants (dim names, sizes, mesh axes, split): equal keys, equal
        #: layouts; what a compiled program keys the lowering's plans with
        self.key = (shape.names, shape.sizes, mesh.axes, tuple(self.split.items()))
        # every lowered op hashes its inputs' layouts (the plan's key): hashed once, here, not on
        # first use, which torch.compile would guard on (a recompile once eager code hashed it);
        # a layout built in a compiled program hashes on use (hash() is untraceable on torch 2.11)
        self._hash = None if caching.compiling() else hash(self.key)
        self._by_axis = {a: d for d, axes in self.split.items() for a in axes}
        if len(self._by_axis) != sum(map(len, self.split.values())):
            raise LayoutError(f"layout {split} splits over one axis twice")
        counts = [math.prod([mesh.axis_size(a) for a in self.split.get(d.name, ())]) for d in shape]
        #: sizes of the local slice, in shape order, when they are the same on every processor
        #: (every split dim divisible by its number of pieces); else ``None``
        self.even_sizes: tuple[int, ...] | None = (
            tuple(d.size // n for d, n in zip(shape, counts))
            if all(d.size % n == 0 for d, n in zip(shape, counts)) else None)
        self._at: dict[tuple[int, ...], tuple[int, ...]] = {}

    @property
    def even(self) -> bool:
        """Whether every processor's slice has the same sizes."""
        return self.even_sizes is not None

    @property
    def local_sizes(self) -> tuple[int, ...]:
        """Sizes of the local slice, in shape order, of an :attr:`even` layout (an uneven one's
        differ between processors: :meth:`local_sizes_at`)."""
        if self.even_sizes is None:
            raise LayoutError(
                f"layout {self} of [{self.shape}] splits a dim unevenly, so its slice sizes differ "
                "between processors; ask layout.local_sizes_at(coords) (or "
                "meshtorch.tensor.local_shape(layout) for this processor)")
        return self.even_sizes

    def local_sizes_at(self, coords: dict[str, int]) -> tuple[int, ...]:
        """Sizes of the slice at ``coords``, in shape order (``torch.chunk`` pieces: the last
        ones may be smaller or empty)."""
        if self.even_sizes is not None:
            return self.even_sizes
        key = tuple(coords[a] for a in self.mesh.axis_names)
        sizes = self._at.get(key)
        if sizes is None:
            sizes = self._at[key] = tuple(n for _, n in self.slices(coords))
        return sizes

    def axes_of(self, dim: str) -> Axes:
        """The axes a dim of this tensor is split over, major first (``()``: whole)."""
        return self.split.get(dim, ())

    def axis_of(self, dim: str) -> str | None:
        """The one axis a dim of this tensor is split over; ``None`` when it is whole or split
        over several axes (see :meth:`axes_of`)."""
        axes = self.split.get(dim, ())
        return axes[0] if len(axes) == 1 else None

    def dim_of(self, axis: str) -> str | None:
        """The dim that holds ``axis``, or ``None`` if replicated along it."""
        return self._by_axis.get(axis)

    def slices(self, coords: dict[str, int]) -> tuple[tuple[int, int], ...]:
        """``(start, size)`` of the local slice of each dim at ``coords``."""
        mesh = self.mesh
        return tuple([  # (a list in one frame, not a generator resumed per dim)
            piece(d.size, [(mesh.axis_size(a), coords[a]) for a in self.split[d.name]])
            if d.name in self.split else (0, d.size)
            for d in self.shape.dims
        ])

    def replicated_axes(self) -> tuple[str, ...]:
        """Axes along which this tensor is replicated."""
        return tuple(a for a in self.mesh.axis_names if a not in self._by_axis)

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Layout)
            and self.shape == other.shape
            and self.mesh == other.mesh
            and self.split == other.split
        )

    def __hash__(self) -> int:
        h = self._hash
        return h if h is not None else hash(self.key)

    def __reduce__(self):
        # string hashes differ between processes, so _hash must not travel
        return (Layout, (self.shape, self.mesh, dict(self.split)))

    def __str__(self) -> str:
        parts = [f"{d}:{format_axes(a)}" for d, a in self.split.items()]
        return "; ".join(parts) if parts else "replicated"

    def __repr__(self) -> str:
        return f"Layout([{self.shape}] on '{self.mesh}': {self})"


def _as_axes(axes: str | Iterable[str]) -> Axes:
    return (axes,) if isinstance(axes, str) else tuple(axes)
