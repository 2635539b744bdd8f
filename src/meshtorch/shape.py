"""Named tensor dimensions (``Dim``) and named shapes (``Shape``).

A *dim* is a named tensor dimension; a *Shape* is an ordered tuple of dims with
unique names. Mesh axes are a different thing (see :mod:`meshtorch.mesh`).

Example:
    >>> from meshtorch.shape import Dim, Shape
    >>> s = Shape("batch:8,d_model:16")
    >>> s["d_model"], s.names, s.sizes
    (Dim(name='d_model', size=16), ('batch', 'd_model'), (8, 16))
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from meshtorch import caching
from meshtorch.errors import ShapeError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"-?[0-9]+")  # a sign passes: the caller's range check names a negative size


def named_sizes(spec: str, error: type[Exception], kind: str, form: str) -> list[tuple[str, int]]:
    """The ``(name, size)`` of each ``name:size`` part of ``spec``, parts separated by ``,`` or ``;``
    (blank ones skipped): how a shape (``"batch:8,seq:16"``) and a mesh (``"b:2,m:4"``) are written.
    A part without ``:`` and a whole number of ASCII digits after it raises ``error``, naming the
    part, the ``kind`` of spec and its ``form``; the names and the sizes' ranges are the caller's
    to check (:class:`Dim`, :class:`meshtorch.mesh.Mesh`).

    Example:
        >>> named_sizes("batch:8; seq: 16,", ShapeError, "shape", "'name:size,name:size'")
        [('batch', 8), ('seq', 16)]
        >>> named_sizes("a:8,b:²", ShapeError, "shape", "'name:size'")
        Traceback (most recent call last):
        ...
        meshtorch.errors.ShapeError: cannot parse 'b:²' in shape 'a:8,b:²'; write 'name:size'
    """
    pairs = []
    for part in re.split(r"[,;]", spec):
        part = part.strip()
        if not part:
            continue
        name, sep, size = part.partition(":")
        if not sep or not _SIZE.fullmatch(size.strip()):
            raise error(f"cannot parse {part!r} in {kind} {spec!r}; write {form}")
        pairs.append((name.strip(), int(size)))
    return pairs


@dataclass(frozen=True)
class Dim:
    """A named tensor dimension of a given size.

    Example:
        >>> Dim("batch", 64)
        Dim(name='batch', size=64)
    """

    name: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ShapeError(
                f"dim name {self.name!r} is not an identifier; use letters, digits and '_'"
            )
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ShapeError(f"dim {self.name!r} has size {self.size!r}; sizes are ints >= 0")

    def __repr__(self) -> str:
        return f"Dim(name={self.name!r}, size={self.size})"

    def __str__(self) -> str:
        return f"{self.name}:{self.size}"


def dim_name(d: Dim | str, of: Shape | HasShape | None = None, op: str | None = None,
             what: str = "the tensor") -> str:
    """The name of a dim argument given as a ``Dim`` or a name.

    ``of``: the shape (or the tensor) whose dim the argument names. A ``Dim`` there is that
    dim, size and all: where ``of`` has a dim of its name but another size, a
    :class:`ShapeError` names the op ``op``, the dim, both sizes and the tensor (by its own
    name, or else ``what``: "the logits"); a dim ``of`` lacks is the caller's to report. Ops
    leave unchecked the dims they make (an output dim of a new size: ``one_hot``, ``range``).

    Example:
        >>> x = Shape("batch:2,vocab:4")
        >>> dim_name("vocab", x, "softmax"), dim_name(Dim("vocab", 4), x, "softmax")
        ('vocab', 'vocab')
        >>> try:
        ...     dim_name(Dim("vocab", 5), x, "softmax")
        ... except ShapeError as e:
        ...     print(e)  # doctest: +NORMALIZE_WHITESPACE
        softmax: dim vocab:5 has size 5, but 'vocab' is 4 in the tensor [batch:2,vocab:4];
        pass the name 'vocab', or Dim('vocab', 4)
    """
    if isinstance(d, str):  # (first: most arguments are names)
        return d
    if isinstance(d, Dim):
        if of is not None:
            shape = of if isinstance(of, Shape) else of.shape
            i = shape._index.get(d.name)
            if i is not None and shape.sizes[i] != d.size:
                name = getattr(of, "name", None)  # (a tensor's own name, where it has one)
                _wrong_size(d, shape.sizes[i], shape, op, f"tensor {name!r}" if name else what)
        return d.name
    raise ShapeError(f"{op + ': ' if op else ''}expected a Dim or a dim name, got {d!r}")


class HasShape(Protocol):
    """What :func:`dim_name` reads of a tensor: its shape and (optional) name."""

    shape: Shape


def _wrong_size(d: Dim, size: int, shape: Shape, op: str | None, what: str) -> None:
    raise ShapeError(f"{op + ': ' if op else ''}dim {d} has size {d.size}, but {d.name!r} is {size} in "
                     f"{what} [{shape}]; pass the name {d.name!r}, or Dim({d.name!r}, {size})")


@functools.lru_cache(maxsize=1024)
def _parse(spec: str) -> tuple[Dim, ...]:
    # cached: programs pass the same few strings (``from_global(ids, "batch:8,length:64")``) every
    # step, and the same Dim objects make equal shapes quick to compare
    pairs = named_sizes(spec, ShapeError, "shape", "'name:size,name:size'")
    return tuple(Dim(name, size) for name, size in pairs)


class Shape:
    """An ordered tuple of dims with unique names.

    Built from ``Dim``s, ``(name, size)`` pairs, another ``Shape``, or a string
    ``"batch:8,seq:16"``.

    Example:
        >>> s = Shape([Dim("batch", 8), ("seq", 16)])
        >>> str(s), s.numel, "seq" in s, s.index("seq")
        ('batch:8,seq:16', 128, True, 1)
    """

    # A Shape never changes after __init__, so what ops ask of it on every call (names, sizes,
    # the hash that keys the lowering's caches) is computed once here.
    __slots__ = ("dims", "_index", "names", "sizes", "_hash", "_derived")

    def __init__(self, dims: Shape | str | Iterable[Dim | tuple[str, int]] = ()):
        if isinstance(dims, Shape):
            self.dims: tuple[Dim, ...] = dims.dims
            self._index = dims._index
            self.names, self.sizes, self._hash = dims.names, dims.sizes, dims._hash
            self._derived = None
            return
        items = _parse(dims) if isinstance(dims, str) else list(dims)
        out = []
        for d in items:
            if isinstance(d, Dim):
                out.append(d)
            elif isinstance(d, tuple) and len(d) == 2:
                out.append(Dim(*d))
            else:
                raise ShapeError(f"cannot make a dim of {d!r}; give Dim(name, size)")
        self.dims = tuple(out)
        self._index = {d.name: i for i, d in enumerate(self.dims)}
        if len(self._index) != len(self.dims):
            seen, dup = set(), []
            for d in self.dims:
                if d.name in seen:
                    dup.append(d.name)
                seen.add(d.name)
            raise ShapeError(
                f"shape {self} repeats dim name(s) {sorted(set(dup))}; "
                "dim names must be unique — rename one (e.g. 'd_model_out')"
            )
        self.names: tuple[str, ...] = tuple(self._index)
        self.sizes: tuple[int, ...] = tuple(d.size for d in self.dims)
        # builtin hash() of a tuple is untraceable on torch 2.11 (a graph break): a shape built in
        # a compiled program hashes on use, which nothing there does (its plans are keyed by
        # tuples of names and sizes, resolved outside the trace)
        self._hash = None if caching.compiling() else hash((self.names, self.sizes))
        #: shapes made from this one by :meth:`without`, :meth:`replace` and ``+``, by their
        #: arguments: ops make the same few every step (the loss's, the embedding's, a renamed
        #: key), and building one is a dozen Python calls, paid cold between large kernels
        self._derived: dict[tuple, Shape] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for size in self.sizes:
            n *= size
        return n

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def index(self, d: Dim | str) -> int:
        """Position of a dim, with an error naming the dims that exist (or, for a ``Dim`` of
        another size than this shape's, both sizes)."""
        name = d if isinstance(d, str) else dim_name(d, self, what="the shape")  # (a name: no call)
        try:
            return self._index[name]
        except KeyError:
            raise ShapeError(f"dim {name!r} is not in shape [{self}]") from None

    def __getitem__(self, key: int | str | Dim) -> Dim:
        if isinstance(key, int):
            return self.dims[key]
        i = self._index.get(key) if isinstance(key, str) else None  # (a name: index's lookup inline)
        return self.dims[self.index(key) if i is None else i]

    def __contains__(self, d: object) -> bool:
        if isinstance(d, str):
            return d in self._index
        return isinstance(d, Dim) and d.name in self._index and self.dims[self._index[d.name]] == d

    def __iter__(self) -> Iterator[Dim]:
        return iter(self.dims)

    def __len__(self) -> int:
        return len(self.dims)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Shape):
            # equal dims <=> equal names and sizes; comparing those tuples runs no Python per dim
            return self is other or (self.names == other.names and self.sizes == other.sizes)
        return NotImplemented

    def __hash__(self) -> int:
        h = self._hash
        return h if h is not None else hash((self.names, self.sizes))

    def __reduce__(self):
        # rebuilt on unpickling: string hashes differ between processes, so _hash must not travel
        return (Shape, (self.dims,))

    def __add__(self, other: Shape | Iterable[Dim]) -> Shape:
        if isinstance(other, Shape):
            return self.derived(("+", other), lambda: Shape(self.dims + other.dims))
        return Shape(self.dims + tuple(Shape(other).dims))

    def derived(self, key: tuple, make: Callable[[], Shape]) -> Shape:
        """``make()``, a shape made from this one, kept under ``key`` (what ``make`` depends on
        besides this shape, which never changes): the next call with an equal key returns it.
        Ops make the same few shapes every step; nothing is kept while ``torch.compile`` traces
        (Dynamo would guard on the memo).

        Example:
            >>> s = Shape("batch:2,d:3")
            >>> s.derived(("twice",), lambda: s + Shape("e:4")) is s.derived(("twice",), lambda: s)
            True
        """
        if caching.compiling():
            return make()
        d = self._derived
        if d is None:
            d = self._derived = {}
        out = d.get(key)
        if out is None:
            if len(d) >= _MAX_DERIVED:  # a shape's callers ask for a few; never grow unbounded
                d.clear()
            out = d[key] = make()
        return out

    def __str__(self) -> str:
        return ",".join(str(d) for d in self.dims)

    def __repr__(self) -> str:
        return f"Shape({str(self)!r})"

    def without(self, names: Iterable[Dim | str]) -> Shape:
        """This shape with the given dims left out."""
        names = tuple(names)
        return self.derived(("without", names), lambda: self._without(names))

    def _without(self, names: tuple[Dim | str, ...]) -> Shape:
        drop = {dim_name(n, self, what="the shape") for n in names}
        for n in drop:
            self.index(n)
        return Shape([d for d in self.dims if d.name not in drop])

    def replace(self, old: Dim | str, new: Dim) -> Shape:
        """This shape with one dim replaced by another, in the same position."""
        def make() -> Shape:
            i = self.index(old)
            return Shape(self.dims[:i] + (new,) + self.dims[i + 1 :])

        return self.derived(("replace", old, new), make)


_MAX_DERIVED = 64


def as_shape(s: Shape | str | Iterable[Dim | tuple[str, int]]) -> Shape:
    """Coerce anything shape-like to a ``Shape`` (one object per string: programs pass the same
    few every step, ``from_global(ids, "batch:8,length:64")``, and its derived shapes are kept).

    Example:
        >>> as_shape("a:2,b:3") is as_shape("a:2,b:3"), as_shape([("a", 2)])
        (True, Shape('a:2'))
    """
    if isinstance(s, Shape):
        return s
    if isinstance(s, str) and not caching.compiling():
        return _shape_of(s)
    return Shape(s)


@functools.lru_cache(maxsize=1024)
def _shape_of(spec: str) -> Shape:
    return Shape(spec)
