"""Neural-network ops over named dims: softmax, cross_entropy, norms, dropout.

All are compositions of the lowered primitives, so they work with any dim
split (a split vocabulary or ``d_model`` costs a few small all_reduces).

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.zeros(2, 4), "batch:2,vocab:4")
    >>> mt.softmax(x, "vocab").to_global()[0].tolist()
    [0.25, 0.25, 0.25, 0.25]
"""

from __future__ import annotations

from meshtorch.ops.array import one_hot
from meshtorch.ops.elementwise import exp, rsqrt
from meshtorch.ops.reduce import reduce_logsumexp, reduce_mean, reduce_sum
from meshtorch.shape import Dim, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def softmax(x: MeshTensor, dim: str | Dim) -> MeshTensor:
    """``exp(x) / sum(exp(x))`` over ``dim``.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([0.0, 0.0]), "v:2")
        >>> mt.softmax(x, "v").to_global().tolist()
        [0.5, 0.5]
    """
    return exp(log_softmax(x, dim))


def log_softmax(x: MeshTensor, dim: str | Dim) -> MeshTensor:
    """``x - logsumexp(x)`` over ``dim``.

    Example:
        >>> import torch, math, meshtorch as mt
        >>> x = mt.from_global(torch.zeros(2), "v:2")
        >>> abs(mt.log_softmax(x, "v").to_global()[0].item() + math.log(2)) < 1e-6
        True
    """
    x = as_mesh_tensor(x)
    return x - reduce_logsumexp(x, dim_name(dim))


def cross_entropy(logits: MeshTensor, targets: MeshTensor, dim: str | Dim = "vocab") -> MeshTensor:
    """Per-example ``-log softmax(logits)[target]`` over ``dim`` (the class dim is
    reduced away; ``targets`` has the other dims). Works on a split vocabulary:
    no processor ever holds a whole row of logits.

    Example:
        >>> import torch, math, meshtorch as mt
        >>> logits = mt.from_global(torch.zeros(2, 4), "batch:2,vocab:4")
        >>> targets = mt.from_global(torch.tensor([1, 3]), "batch:2")
        >>> round(mt.reduce_mean(mt.cross_entropy(logits, targets)).item(), 5) == round(math.log(4), 5)
        True
    """
    logits = as_mesh_tensor(logits)
    v = logits.shape[dim_name(dim)]
    target_logit = reduce_sum(logits * one_hot(targets, v, dtype=logits.dtype), v.name)
    return reduce_logsumexp(logits, v.name) - target_logit


def layer_norm(
    x: MeshTensor,
    dim: str | Dim,
    weight: MeshTensor | None = None,
    bias: MeshTensor | None = None,
    eps: float = 1e-5,
) -> MeshTensor:
    """Normalise over ``dim`` to zero mean and unit variance, then scale and shift.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([1.0, 3.0]), "d:2")
        >>> [round(v, 3) for v in mt.layer_norm(x, "d").to_global().tolist()]
        [-1.0, 1.0]
    """
    x = as_mesh_tensor(x)
    n = dim_name(dim)
    xc = x - reduce_mean(x, n)
    y = xc * rsqrt(reduce_mean(xc * xc, n) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm(x: MeshTensor, dim: str | Dim, weight: MeshTensor | None = None,
             eps: float = 1e-6) -> MeshTensor:
    """Scale to unit root-mean-square over ``dim`` (no centring), then by ``weight``.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([3.0, 4.0]), "d:2")
        >>> [round(v, 3) for v in mt.rms_norm(x, "d").to_global().tolist()]
        [0.849, 1.131]
    """
    x = as_mesh_tensor(x)
    y = x * rsqrt(reduce_mean(x * x, dim_name(dim)) + eps)
    return y * weight if weight is not None else y


def dropout(x: MeshTensor, rate: float, *, seed: int | None = None, training: bool = True,
            stream: int | str | None = None) -> MeshTensor:
    """Zero each element with probability ``rate`` and scale the rest by
    ``1/(1-rate)``. The mask is a pure function of (seed, stream, element index),
    so it is the same on any mesh and layout. Without ``seed``, the next stream of
    the processor context is used (the same on every processor).

    Example:
        >>> import torch, meshtorch as mt
        >>> y = mt.dropout(mt.ones("t:1000"), 0.5, seed=0)
        >>> set(y.to_global().unique().tolist()) == {0.0, 2.0}
        True
    """
    from meshtorch import random

    x = as_mesh_tensor(x)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if not training or rate == 0.0:
        return x
    keep = random.bernoulli(x.shape, 1.0 - rate, seed=seed, stream=stream, dtype=x.dtype)
    return x * keep / (1.0 - rate)


