"""Elementwise ops: unary, and binary with broadcasting by dim name.

Binary ops broadcast by *name*: the output has the first operand's dims, then
the second's dims that the first lacks. Python numbers and 0-d torch tensors
act as scalars. The ops that are ``MeshTensor``'s Python operators (``add``,
``multiply``, ``less``, ...) and the machinery (:func:`unary`, :func:`nary`)
live in :mod:`meshtorch.lowering.elementwise`, below the tensor type, and are
public here too.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.tensor([1.0, 2.0]), "a:2")
    >>> y = mt.from_global(torch.tensor([10.0, 20.0, 30.0]), "b:3")
    >>> (x + y).shape, mt.relu(x - 1.5).to_global().tolist()
    (Shape('a:2,b:3'), [0.0, 0.5])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtorch.lowering.elementwise import (  # noqa: F401 - the operators' ops, public here too
    abs,
    add,
    binary_op,
    broadcast_shape,
    divide,
    floordiv,
    greater,
    greater_equal,
    less,
    less_equal,
    mod,
    multiply,
    nary,
    negative,
    pow,
    subtract,
    unary,
    unary_op,
)
from meshtorch.tensor import MeshTensor

minimum = binary_op(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)), "minimum")
maximum = binary_op(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)), "maximum")
equal = binary_op(torch.eq, "equal")
not_equal = binary_op(torch.ne, "not_equal")
logical_and = binary_op(torch.logical_and, "logical_and")
logical_or = binary_op(torch.logical_or, "logical_or")


def where(condition, x, y) -> MeshTensor:
    """``x`` where ``condition`` holds, else ``y``, broadcast by dim name.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([-1.0, 2.0]), "a:2")
        >>> mt.where(x > 0, x, 0.0).to_global().tolist()
        [0.0, 2.0]
    """
    return nary(lambda c, a, b: torch.where(c, a, b), condition, x, y, op="where")


relu = unary_op(torch.relu, "relu")
gelu = unary_op(F.gelu, "gelu", "Elementwise GELU (exact erf form); no communication.")
gelu_tanh = unary_op(lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh",
                      "Elementwise GELU, tanh approximation (as GPT-2); no communication.")
silu = unary_op(F.silu, "silu")
exp = unary_op(torch.exp, "exp")
log = unary_op(torch.log, "log")
tanh = unary_op(torch.tanh, "tanh")
sigmoid = unary_op(torch.sigmoid, "sigmoid")
rsqrt = unary_op(torch.rsqrt, "rsqrt")
sqrt = unary_op(torch.sqrt, "sqrt")
square = unary_op(torch.square, "square")
sin = unary_op(torch.sin, "sin")
cos = unary_op(torch.cos, "cos")
logical_not = unary_op(torch.logical_not, "logical_not")
sign = unary_op(torch.sign, "sign", "Elementwise sign (-1, 0 or 1); its gradient is zero; no communication.")
reciprocal = unary_op(torch.reciprocal, "reciprocal", "Elementwise ``1 / x``; no communication.")
softplus = unary_op(F.softplus, "softplus", "Elementwise ``log(1 + exp(x))``; no communication.")
selu = unary_op(F.selu, "selu",
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

