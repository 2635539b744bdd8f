"""Elementwise ops: unary, and binary with broadcasting by dim name.

Binary ops broadcast by *name*: the output has the first operand's dims, then
the second's dims that the first lacks. Python numbers and 0-d torch tensors
act as scalars.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.tensor([1.0, 2.0]), "a:2")
    >>> y = mt.from_global(torch.tensor([10.0, 20.0, 30.0]), "b:3")
    >>> (x + y).shape, mt.relu(x - 1.5).to_global().tolist()
    (Shape('a:2,b:3'), [0.0, 0.5])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.compiler import is_compiling

from meshtorch.caching import BoundedCache
from meshtorch.errors import ShapeError
from meshtorch.lowering.plan import align, lower, resolved
from meshtorch.shape import Shape
from meshtorch.tensor import MeshTensor

Scalar = (int, float, bool)


def _is_scalar(v) -> bool:
    return isinstance(v, Scalar) or (isinstance(v, torch.Tensor) and v.dim() == 0)


def unary(fn: Callable[[torch.Tensor], torch.Tensor], x: MeshTensor, op: str = "unary") -> MeshTensor:
    """Apply an elementwise torch function to every slice; no communication."""
    if not isinstance(x, MeshTensor):
        raise ShapeError(f"{op} needs a MeshTensor, got {type(x).__name__}")
    return MeshTensor(fn(x.local), x.shape, x.layout)


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


def nary(fn: Callable[..., torch.Tensor], *xs, op: str = "op") -> MeshTensor:
    """Apply an elementwise torch function to operands broadcast by dim name."""
    shapes = []
    for x in xs:
        if isinstance(x, MeshTensor):
            shapes.append(x.shape)
        elif _is_scalar(x):
            shapes.append(None)
        else:
            raise ShapeError(
                f"{op}: operand of type {type(x).__name__} is neither a MeshTensor nor a scalar; "
                "wrap torch tensors with mt.from_global(t, shape)"
            )
    if is_compiling():  # planned outside the trace, from the shapes' names and sizes
        out, same_shapes = resolved(_nary_of_constants, tuple(
            [None if s is None else (s.names, s.sizes) for s in shapes]), op)
    else:
        out, same_shapes = _cached_nary(tuple(shapes), op)
    tensors = [x for x in xs if isinstance(x, MeshTensor)]
    if same_shapes:
        first = tensors[0].layout
        if all(x.layout is first or x.layout == first for x in tensors):
            return MeshTensor(fn(*[x.local if isinstance(x, MeshTensor) else x for x in xs]), out, first)
    names = out.names

    def local_fn(view, *ls):
        it = iter(ls)
        args = [align(next(it), x.names, names) if isinstance(x, MeshTensor) else x for x in xs]
        y = fn(*args)
        # scalars and broadcasting may leave size-1 dims; the output slice is full-sized
        want = tuple([view.size(n) for n in names])
        return y if y.shape == want else y.expand(want)

    return lower(op, tensors, out, local_fn)


# The broadcast shape of each combination of operand shapes (None: a scalar), and whether every
# operand already has it: computed once per combination, as a model repeats the same few.
_NARY = BoundedCache(4096)


def _cached_nary(shapes: tuple[Shape | None, ...], op: str) -> tuple[Shape, bool]:
    plan = _NARY.get(shapes)
    return _NARY.put(shapes, _nary_plan(shapes, op)) if plan is None else plan


def _nary_of_constants(shapes: tuple, op: str) -> tuple[Shape, bool]:
    return _cached_nary(tuple([None if s is None else Shape(zip(*s)) for s in shapes]), op)


def _nary_plan(shapes: tuple[Shape | None, ...], op: str) -> tuple[Shape, bool]:
    present = [s for s in shapes if s is not None]
    if not present:
        raise ShapeError(f"{op} needs at least one MeshTensor operand")
    out = broadcast_shape(*present)
    return out, all(s == out for s in present)


def _binary(fn, op):
    def f(x, y) -> MeshTensor:
        return nary(fn, x, y, op=op)

    f.__name__ = op
    f.__doc__ = f"Elementwise ``{op}`` with broadcasting by dim name."
    return f


add = _binary(torch.add, "add")
subtract = _binary(torch.sub, "subtract")
multiply = _binary(torch.mul, "multiply")
divide = _binary(torch.div, "divide")
minimum = _binary(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)), "minimum")
maximum = _binary(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)), "maximum")
equal = _binary(torch.eq, "equal")
not_equal = _binary(torch.ne, "not_equal")
less = _binary(torch.lt, "less")
less_equal = _binary(torch.le, "less_equal")
greater = _binary(torch.gt, "greater")
greater_equal = _binary(torch.ge, "greater_equal")
logical_and = _binary(torch.logical_and, "logical_and")
logical_or = _binary(torch.logical_or, "logical_or")


def floordiv(x, y) -> MeshTensor:
    """``floor(x / y)`` elementwise, broadcast by dim name (Mesh-TF ``floordiv``, Python ``//``).
    It is piecewise constant, so, as in Mesh-TF, no gradient flows through it.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([7.0, -7.0]), "a:2")
        >>> mt.floordiv(x, 2).to_global().tolist(), (x // 2).to_global().tolist()
        ([3.0, -4.0], [3.0, -4.0])
    """
    # detached: torch has no derivative for floor_divide and would fail in backward
    return nary(lambda a, b: torch.floor_divide(_detach(a), _detach(b)), x, y, op="floordiv")


def _detach(v):
    return v.detach() if isinstance(v, torch.Tensor) else v


def mod(x, y) -> MeshTensor:
    """``x - y * floor(x / y)`` elementwise: the remainder takes the sign of ``y``, as Python's
    ``%`` and Mesh-TF's ``mod`` (``torch.remainder``, not ``torch.fmod``).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([7.0, -7.0]), "a:2")
        >>> mt.mod(x, 3).to_global().tolist(), (x % -3).to_global().tolist()
        ([1.0, 2.0], [-2.0, -1.0])
    """
    return nary(torch.remainder, x, y, op="mod")


def pow(x, y) -> MeshTensor:  # noqa: A001 - mirrors torch.pow
    """``x ** y`` elementwise; either may be a scalar."""
    return nary(torch.pow, x, y, op="pow")


def where(condition, x, y) -> MeshTensor:
    """``x`` where ``condition`` holds, else ``y``, broadcast by dim name.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([-1.0, 2.0]), "a:2")
        >>> mt.where(x > 0, x, 0.0).to_global().tolist()
        [0.0, 2.0]
    """
    return nary(lambda c, a, b: torch.where(c, a, b), condition, x, y, op="where")


def _unary_op(fn, op, doc=None):
    def f(x: MeshTensor) -> MeshTensor:
        return unary(fn, x, op)

    f.__name__ = op
    f.__doc__ = doc or f"Elementwise ``{op}``; no communication."
    return f


relu = _unary_op(torch.relu, "relu")
gelu = _unary_op(F.gelu, "gelu", "Elementwise GELU (exact erf form); no communication.")
gelu_tanh = _unary_op(lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh",
                      "Elementwise GELU, tanh approximation (as GPT-2); no communication.")
silu = _unary_op(F.silu, "silu")
exp = _unary_op(torch.exp, "exp")
log = _unary_op(torch.log, "log")
tanh = _unary_op(torch.tanh, "tanh")
sigmoid = _unary_op(torch.sigmoid, "sigmoid")
rsqrt = _unary_op(torch.rsqrt, "rsqrt")
sqrt = _unary_op(torch.sqrt, "sqrt")
square = _unary_op(torch.square, "square")
abs = _unary_op(torch.abs, "abs")  # noqa: A001 - mirrors torch.abs
negative = _unary_op(torch.neg, "negative")
sin = _unary_op(torch.sin, "sin")
cos = _unary_op(torch.cos, "cos")
logical_not = _unary_op(torch.logical_not, "logical_not")
sign = _unary_op(torch.sign, "sign", "Elementwise sign (-1, 0 or 1); its gradient is zero; no communication.")
reciprocal = _unary_op(torch.reciprocal, "reciprocal", "Elementwise ``1 / x``; no communication.")
softplus = _unary_op(F.softplus, "softplus", "Elementwise ``log(1 + exp(x))``; no communication.")
selu = _unary_op(F.selu, "selu",
                 "Elementwise SELU (the fixed scale and alpha of the paper); no communication.")


def elu(x: MeshTensor, alpha: float = 1.0) -> MeshTensor:
    """Elementwise ELU: ``x`` where positive, else ``alpha * (exp(x) - 1)``; no communication.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([-1e9, 2.0]), "a:2")
        >>> mt.elu(x).to_global().tolist()
        [-1.0, 2.0]
    """
    return unary(lambda t: F.elu(t, alpha), x, "elu")


def leaky_relu(x: MeshTensor, alpha: float = 0.2) -> MeshTensor:
    """Elementwise ``x`` where positive, else ``alpha * x``. The default ``alpha`` is Mesh-TF's
    (and TensorFlow's) 0.2, not torch's 0.01; no communication.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([-1.0, 2.0]), "a:2")
        >>> [round(v, 6) for v in mt.leaky_relu(x).to_global().tolist()]
        [-0.2, 2.0]
    """
    return unary(lambda t: F.leaky_relu(t, alpha), x, "leaky_relu")


def cast(x: MeshTensor, dtype: torch.dtype) -> MeshTensor:
    """``x`` converted to ``dtype``; gradients flow back in the original dtype.

    Example:
        >>> import torch, meshtorch as mt
        >>> mt.cast(mt.ones("a:2"), torch.bfloat16).dtype
        torch.bfloat16
    """
    return unary(lambda t: t.to(dtype), x, "cast")


def clamp(x: MeshTensor, min: float | None = None, max: float | None = None) -> MeshTensor:  # noqa: A002
    """Clamp every element into ``[min, max]``."""
    return unary(lambda t: torch.clamp(t, min, max), x, "clamp")


def _install_operators() -> None:
    """MeshTensor's Python operators, which are these ops (the tensor module cannot import them)."""
    operators = {
        "__add__": add, "__radd__": lambda x, o: add(o, x),
        "__sub__": subtract, "__rsub__": lambda x, o: subtract(o, x),
        "__mul__": multiply, "__rmul__": lambda x, o: multiply(o, x),
        "__truediv__": divide, "__rtruediv__": lambda x, o: divide(o, x),
        "__pow__": pow, "__rpow__": lambda x, o: pow(o, x),
        "__floordiv__": floordiv, "__rfloordiv__": lambda x, o: floordiv(o, x),
        "__mod__": mod, "__rmod__": lambda x, o: mod(o, x),
        "__neg__": negative, "__abs__": abs,
        "__lt__": less, "__le__": less_equal, "__gt__": greater, "__ge__": greater_equal,
    }
    for name, fn in operators.items():
        setattr(MeshTensor, name, fn)


_install_operators()
