"""Positions of extremes along a dim: argmax, argmin, top_k, and sampling by the Gumbel-max trick
(Mesh-TF's ``mtf.argmax``, ``mtf.top_k``, ``mtf.sample_with_temperature``).

Along a split dim ``argmax`` needs no gather: the maximum is all-reduced, then each processor
offers the first global position in its slice that holds it and the smallest offer wins (two
``all_reduce``\\ s of the output's size per group of axes). Ties give the first position, as
``torch.argmax`` and ``tf.argmax`` do, whatever the layout.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.tensor([[1.0, 5.0, 5.0], [7.0, 0.0, 2.0]]), "b:2,v:3")
    >>> mt.argmax(x, "v").to_global().tolist(), mt.argmin(x, "v").to_global().tolist()
    ([1, 0], [0, 1])
"""

from __future__ import annotations

import torch

from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.lower import lower
from meshtorch.ops.elementwise import unary
from meshtorch.ops.reduce import reduce_max, reduce_min
from meshtorch.random import uniform
from meshtorch.shape import Dim, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def _arg_extreme(x: MeshTensor, dim: str | Dim, how: str, name: str | None) -> MeshTensor:
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, f"arg{how}")]
    i = x.shape.index(d.name)
    x = x.detach()
    best = (reduce_max if how == "max" else reduce_min)(x, d.name)
    out = best.shape

    def local_fn(view, t, m):
        start, size = view.slices[d.name]
        pos = torch.arange(start, start + size, device=t.device).reshape(
            [size if j == i else 1 for j in range(t.dim())])
        m = m.unsqueeze(i)
        hit = t == m
        if t.is_floating_point():  # NaN is the extreme, as in torch.argmax
            hit = hit | (t.isnan() & m.isnan())
        offer = torch.where(hit, pos, d.size)
        if size == 0:  # an empty piece of an uneven split offers nothing
            return offer.sum(i) + d.size
        return offer.amin(i)

    return lower(f"arg{how}", [x, best], out, local_fn, reduced={d.name: "min"}, name=name)


def argmax(x: MeshTensor, dim: str | Dim, name: str | None = None) -> MeshTensor:
    """The (int64) position along ``dim`` of the maximum, the first one on ties; ``dim`` may be
    split. Not differentiable.

    Example:
        >>> import torch, meshtorch as mt
        >>> mt.argmax(mt.from_global(torch.tensor([3.0, 9.0, 9.0, 1.0]), "v:4"), "v").item()
        1
    """
    return _arg_extreme(x, dim, "max", name)


def argmin(x: MeshTensor, dim: str | Dim, name: str | None = None) -> MeshTensor:
    """The (int64) position along ``dim`` of the minimum, the first one on ties; ``dim`` may be
    split. Not differentiable.

    Example:
        >>> import torch, meshtorch as mt
        >>> mt.argmin(mt.from_global(torch.tensor([3.0, 1.0, 9.0, 1.0]), "v:4"), "v").item()
        1
    """
    return _arg_extreme(x, dim, "min", name)


def top_k(x: MeshTensor, dim: str | Dim, k_dim: Dim,
          name: str | None = None) -> tuple[MeshTensor, MeshTensor]:
    """The ``k_dim.size`` largest values along ``dim`` and their (int64) positions, largest
    first (the lower position first among equal values), over a new last dim ``k_dim`` that
    replaces ``dim`` (Mesh-TF's ``mtf.top_k``). The
    values are differentiable (the gradient goes to the chosen elements). A split ``dim`` is
    gathered first; a split ``k_dim`` is sliced from the result.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([3.0, 9.0, 4.0, 1.0]), "v:4")
        >>> values, idx = mt.top_k(x, "v", mt.Dim("k", 2))
        >>> values.to_global().tolist(), idx.to_global().tolist()
        ([9.0, 4.0], [1, 2])
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "top_k")]
    if not isinstance(k_dim, Dim):
        raise ShapeError(f"top_k needs a Dim (name and size) for the new dim, got {k_dim!r}")
    if k_dim.name in x.shape:
        raise ShapeError(f"top_k: [{x.shape}] already has a dim named {k_dim.name!r}; name k_dim anew")
    if not 0 < k_dim.size <= d.size:
        raise ShapeError(f"top_k: {k_dim} must have size 1..{d.size}, the size of dim {d}")
    i = x.shape.index(d.name)
    out = x.shape.without([d.name]) + [k_dim]
    whole = {d.name, k_dim.name}

    def local_fn(view, t):
        # a stable sort puts the lower position first among equal values, as tf.math.top_k does
        # (torch.topk leaves the order of ties unspecified)
        r = torch.sort(t, dim=i, descending=True, stable=True)
        return (r.values.narrow(i, 0, k_dim.size).movedim(i, -1),
                r.indices.narrow(i, 0, k_dim.size).movedim(i, -1))

    # the indices are computed without a graph; the values take the gradient through the lowering
    values = lower("top_k", [x], out, lambda view, t: local_fn(view, t)[0], whole=whole, name=name)
    indices = lower("top_k", [x.detach()], out, lambda view, t: local_fn(view, t)[1], whole=whole, name=name)
    return values, indices


def sample_with_temperature(logits: MeshTensor, dim: str | Dim, temperature: float = 1.0, *,
                            seed: int | None = None, name: str | None = None) -> MeshTensor:
    """Ids along ``dim`` drawn from ``softmax(logits / temperature)`` (int64, ``dim`` dropped),
    as Mesh-TF's ``mtf.sample_with_temperature``: the argmax of ``logits + temperature * g``
    for Gumbel noise ``g``; ``temperature=0`` is the argmax. The noise is a pure function of
    the seed (the context's next random stream if ``None``) and the element's global index,
    so every mesh and layout draws the same ids. Communication is :func:`argmax`'s: two small
    ``all_reduce``\\ s where ``dim`` is split. Not differentiable.

    Example:
        >>> import torch, meshtorch as mt
        >>> logits = mt.from_global(torch.tensor([[0.0, 50.0, 0.0], [9.0, 0.0, 0.0]]), "b:2,v:3")
        >>> mt.sample_with_temperature(logits, "v", seed=0).to_global().tolist()
        [1, 0]
        >>> mt.sample_with_temperature(logits, "v", 0.0).to_global().tolist()
        [1, 0]
    """
    logits = as_mesh_tensor(logits).detach()
    if not 0 <= temperature < float("inf"):
        raise ArgumentError(f"sample_with_temperature: temperature={temperature} must be >= 0 and finite "
                            "(0: the argmax)")
    if temperature == 0:
        return argmax(logits, dim, name)
    # the dim must exist (at its size) before noise is drawn for it
    logits.shape[dim_name(dim, logits, "sample_with_temperature", "the logits")]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    tiny = torch.finfo(dtype).tiny
    u = uniform(logits.shape, seed=seed, dtype=dtype)
    gumbel = unary(lambda t: -torch.log(-torch.log(t.clamp_min(tiny))), u, "sample_with_temperature")
    return argmax(logits + gumbel * temperature, dim, name)
