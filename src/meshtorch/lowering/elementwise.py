"""The lowering of elementwise ops, and the ops that are ``MeshTensor``'s Python operators.

Binary ops broadcast by *name*: the output has the first operand's dims, then the second's dims
that the first lacks. Python numbers and 0-d torch tensors act as scalars. ``x + y``, ``x * y``,
``-x``, ``x < y`` ... are the ops defined here, so the core type owns its operators whatever was
imported first; :mod:`meshtorch.ops.elementwise` adds the other elementwise ops on the same
machinery (:func:`unary`, :func:`nary`).

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering.elementwise import multiply
    >>> x = mt.from_global(torch.tensor([1.0, 2.0]), "a:2")
    >>> y = mt.from_global(torch.tensor([10.0, 20.0, 30.0]), "b:3")
    >>> multiply(x, y).shape, (x * y).to_global()[1].tolist()
    (Shape('a:2,b:3'), [20.0, 40.0, 60.0])
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from meshtorch.caching import BoundedCache
from meshtorch.errors import ShapeError
from meshtorch.lowering.lower import align, is_dynamo_compiling, lower, resolved
from meshtorch.lowering.output import _registered, tensor_type
from meshtorch.shape import Shape

if TYPE_CHECKING:
    from meshtorch.tensor import MeshTensor

Scalar = (int, float, bool)


def _is_scalar(v) -> bool:
    # numbers.Real: numpy's scalars too (np.float32 is no float subclass; torch takes it as one)
    return (isinstance(v, Scalar) or (isinstance(v, torch.Tensor) and v.dim() == 0)
            or isinstance(v, numbers.Real))


def unary(fn: Callable[[torch.Tensor], torch.Tensor], x: MeshTensor, op: str = "unary") -> MeshTensor:
    """Apply an elementwise torch function to every slice; no communication."""
    cls = tensor_type()
    if not isinstance(x, cls):
        raise ShapeError(f"{op} needs a MeshTensor, got {type(x).__name__}")
    return cls(fn(x.local), x.shape, x.layout)


def broadcast_shape(*shapes: Shape) -> Shape:
    """The union of dims, in first-seen order; a shared name must agree in size."""
    dims = {}
    for s in shapes:
        for d in s:
            if d.name in dims and dims[d.name] != d:
                raise ShapeError(
                    f"cannot broadcast dim {d.name!r}: size {dims[d.name].size} vs {d.size} "
                    f"(shapes {' and '.join(f'[{x}]' for x in shapes)})"
                )
            dims.setdefault(d.name, d)
    return Shape(dims.values())


def nary(fn: Callable[..., torch.Tensor], *xs, op: str = "op", defer: str | None = None) -> MeshTensor:
    """Apply an elementwise torch function to operands broadcast by dim name. ``defer``: the
    method of a foreign operand that a MeshTensor operator (:func:`operator`) gives way to."""
    # (one loop, no comprehensions or helper calls: every elementwise op of a model runs this,
    # cold between large kernels, issue 27)
    cls = _registered[0] if _registered else tensor_type()
    # (filled by index, the scalars' places None: no append call per operand)
    n = len(xs)
    shapes, key, tensors = [None] * n, [None] * n, []
    for i, x in zip(range(n), xs):
        if type(x) is cls or isinstance(x, cls):
            s = x.shape
            shapes[i] = s
            key[i] = (s.names, s.sizes)  # equal exactly when the shapes are; hashed in C
            tensors.append(x)
        elif not _is_scalar(x):
            if defer is not None and defers_to(x, defer):
                # its own method, called here rather than by Python after NotImplemented: where
                # it declines too, the error below says what to do (Python's: a bare TypeError)
                result = getattr(x, defer)(xs[1 - i])
                if result is not NotImplemented:
                    return result
            raise ShapeError(
                f"{op}: operand of type {type(x).__name__} is neither a MeshTensor nor a scalar; "
                "wrap torch tensors with mt.from_global(t, shape)"
            )
    compiled = is_dynamo_compiling()  # (asked once: lower() is told)
    if compiled:  # planned outside the trace, from the shapes' names and sizes
        out, same_shapes, trailing = resolved(_nary_of_constants, tuple(key), op)
    else:
        key = tuple(key)
        plan = _NARY.get(key)
        if plan is None:
            plan = _NARY.put(key, _nary_plan(tuple(shapes), op))
        out, same_shapes, trailing = plan
    if same_shapes:
        first = tensors[0].layout
        for x in tensors:
            if x.layout is not first and x.layout != first:
                break
        else:
            if len(tensors) == len(xs) == 2:
                return cls(fn(xs[0].local, xs[1].local), out, first)
            return cls(fn(*[x.local if isinstance(x, cls) else x for x in xs]), out, first)
    if trailing:
        # every operand's dims are the output's last ones in its order (a bias, a scale over the
        # last dims): torch broadcasts the local slices as they are, to the full-size slice
        # lower() checks. Aligning them too costs a permute test, a reshape and a size check in
        # Python per call, which run cold between large kernels (issue 27)
        def local_fn(view, *ls):
            return fn(*ls)

        return lower(op, tensors, out, local_fn, compiled=compiled)
    names = out.names

    def local_fn(view, *ls):
        it = iter(ls)
        args = [align(next(it), x.names, names) if isinstance(x, cls) else x for x in xs]
        y = fn(*args)
        # scalars and broadcasting may leave size-1 dims; the output slice is full-sized
        want = tuple([view.size(n) for n in names])
        return y if y.shape == want else y.expand(want)

    return lower(op, tensors, out, local_fn, compiled=compiled)


# The broadcast shape of each combination of operand shapes (None: a scalar), and whether every
# operand already has it: computed once per combination, as a model repeats the same few.
_NARY = BoundedCache(4096)


def _nary_of_constants(key: tuple, op: str) -> tuple[Shape, bool, bool]:
    """:func:`nary`'s plan from its key (each operand's names and sizes, ``None`` for a scalar)."""
    plan = _NARY.get(key)
    if plan is None:
        shapes = tuple([None if s is None else Shape(zip(*s)) for s in key])
        plan = _NARY.put(key, _nary_plan(shapes, op))
    return plan


def _nary_plan(shapes: tuple[Shape | None, ...], op: str) -> tuple[Shape, bool, bool]:
    """The broadcast shape; whether every operand has it; whether there are only MeshTensor
    operands and each one's dims are the broadcast shape's last ones, in order (torch's own
    broadcasting then lines their local slices up)."""
    present = [s for s in shapes if s is not None]
    if not present:
        raise ShapeError(f"{op} needs at least one MeshTensor operand")
    out = broadcast_shape(*present)
    names = out.names
    trailing = len(present) == len(shapes) and all(
        s.names == names[len(names) - len(s.names):] for s in present)
    return out, all(s == out for s in present), trailing


def binary_op(fn: Callable[..., torch.Tensor], op: str, doc: str | None = None) -> Callable[..., MeshTensor]:
    """The elementwise op ``op`` of two operands (MeshTensors or scalars) computing ``fn``."""
    def f(x, y) -> MeshTensor:
        return nary(fn, x, y, op=op)

    f.__name__ = op
    f.__doc__ = doc or f"Elementwise ``{op}`` with broadcasting by dim name."
    f.local_fn = fn  # (for operator())
    return f


def operator(op_fn: Callable[..., MeshTensor], defer: str | None, swap: bool = False
             ) -> Callable[..., MeshTensor]:
    """MeshTensor's operator method computing the binary op ``op_fn`` (made by :func:`binary_op`):
    ``self op other``, or with ``swap`` (a reflected method, ``__radd__``) ``other op self``.
    An operand that is neither a MeshTensor nor a scalar, whose type has the method ``defer``
    (for ``__add__`` the other's ``__radd__``, for ``__lt__`` its ``__gt__``), has that method
    run, as Python's data model would after ``NotImplemented`` (:func:`defers_to`), but called
    here: where it declines too (``NotImplemented``), the op's error says what to do, where
    Python's would be a bare ``TypeError``; other operands raise the op's error. A reflected
    method passes ``None``: Python calls it only once the other's own method declined. The method
    calls :func:`nary` itself: one frame between the operator and the op, as the op's own
    function (issue 27).

    Example (a type that knows how to add itself to a MeshTensor):
        >>> import meshtorch as mt
        >>> class Offset:
        ...     def __radd__(self, other):
        ...         return other + 1
        >>> (mt.ones("a:2") + Offset()).to_global().tolist()
        [2.0, 2.0]
    """
    fn, op = op_fn.local_fn, op_fn.__name__
    if swap:
        def method(x, y) -> MeshTensor:
            return nary(fn, y, x, op=op, defer=defer)
    else:
        def method(x, y) -> MeshTensor:
            return nary(fn, x, y, op=op, defer=defer)
    method.__doc__ = (f"``{op}``" if defer is None else
                      f"``{op}``, or the result of ``{defer}`` of an operand whose type defines it.")
    return method


def defers_to(other, method: str) -> bool:
    """Whether a MeshTensor operator gives way (runs ``other``'s ``method``) to ``other``, neither a
    MeshTensor nor a scalar: its type defines ``method`` (not ``object``'s), and it is not data
    meshtorch asks to wrap with ``mt.from_global`` (a torch tensor, an array, a builtin such as a
    list or str, whose own methods would fail or repeat a sequence) or a number of another kind
    (a ``Decimal``, a ``Fraction``: :class:`numbers.Number`, whose methods know only numbers),
    which keep the op's error.

    Example:
        >>> import torch
        >>> class Foo:
        ...     def __radd__(self, other):
        ...         return "foo"
        >>> defers_to(Foo(), "__radd__"), defers_to(Foo(), "__rmul__"), defers_to(torch.ones(2), "__radd__")
        (True, False, False)
    """
    cls = type(other)
    if (isinstance(other, (torch.Tensor, numbers.Number)) or cls.__module__ == "builtins"
            or hasattr(cls, "__array__")):
        return False
    found = getattr(cls, method, None)
    return found is not None and found is not getattr(object, method, None)


def unary_op(fn: Callable[[torch.Tensor], torch.Tensor], op: str, doc: str | None = None
             ) -> Callable[[MeshTensor], MeshTensor]:
    """The elementwise op ``op`` of one MeshTensor computing ``fn`` on its slice."""
    def f(x: MeshTensor) -> MeshTensor:
        return unary(fn, x, op)

    f.__name__ = op
    f.__doc__ = doc or f"Elementwise ``{op}``; no communication."
    return f


add = binary_op(torch.add, "add")
subtract = binary_op(torch.sub, "subtract")
multiply = binary_op(torch.mul, "multiply")
divide = binary_op(torch.div, "divide")
less = binary_op(torch.lt, "less")
less_equal = binary_op(torch.le, "less_equal")
greater = binary_op(torch.gt, "greater")
greater_equal = binary_op(torch.ge, "greater_equal")
abs = unary_op(torch.abs, "abs")  # noqa: A001 - mirrors torch.abs
negative = unary_op(torch.neg, "negative")


def _floor_divide(a, b) -> torch.Tensor:
    # detached: torch has no derivative for floor_divide and would fail in backward
    return torch.floor_divide(_detach(a), _detach(b))


def _detach(v):
    return v.detach() if isinstance(v, torch.Tensor) else v


floordiv = binary_op(_floor_divide, "floordiv", """``floor(x / y)`` elementwise, broadcast by dim name
    (Mesh-TF ``floordiv``, Python ``//``). It is piecewise constant, so, as in Mesh-TF, no gradient
    flows through it.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([7.0, -7.0]), "a:2")
        >>> mt.floordiv(x, 2).to_global().tolist(), (x // 2).to_global().tolist()
        ([3.0, -4.0], [3.0, -4.0])
    """)

mod = binary_op(torch.remainder, "mod", """``x - y * floor(x / y)`` elementwise: the remainder takes the
    sign of ``y``, as Python's ``%`` and Mesh-TF's ``mod`` (``torch.remainder``, not ``torch.fmod``).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([7.0, -7.0]), "a:2")
        >>> mt.mod(x, 3).to_global().tolist(), (x % -3).to_global().tolist()
        ([1.0, 2.0], [-2.0, -1.0])
    """)

pow = binary_op(torch.pow, "pow", "``x ** y`` elementwise; either may be a scalar.")  # noqa: A001 - mirrors torch.pow
