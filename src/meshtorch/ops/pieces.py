"""A dim into pieces and back: split, stack, unstack (Mesh-TF's ``mtf.split``, ``mtf.stack``,
``mtf.unstack``).

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.arange(6.0).reshape(2, 3), "s:2,t:3")
    >>> [p.to_global().tolist() for p in mt.unstack(x, "s")]
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.lowering.lower import lower
from meshtorch.ops.array import slice as slice_dim
from meshtorch.ops.reshape import rename
from meshtorch.shape import Dim, Shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def split(x: MeshTensor, dim: str | Dim, num_or_size_splits: int | Sequence[int],
          name: str | None = None) -> list[MeshTensor]:
    """Cut ``dim`` into consecutive pieces, each keeping the dim's name: ``num_or_size_splits``
    equal pieces, or pieces of the sizes listed (they must add up to the dim's size).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(5.0), "t:5")
        >>> [p.to_global().tolist() for p in mt.split(x, "t", [2, 3])]
        [[0.0, 1.0], [2.0, 3.0, 4.0]]
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "split")]
    if isinstance(num_or_size_splits, int):
        if num_or_size_splits <= 0 or d.size % num_or_size_splits:
            raise ShapeError(
                f"split: dim {d} of [{x.shape}] does not cut into {num_or_size_splits} equal pieces; "
                "pass the piece sizes instead"
            )
        sizes = [d.size // num_or_size_splits] * num_or_size_splits
    else:
        sizes = list(num_or_size_splits)
        if sum(sizes) != d.size or any(s < 0 for s in sizes):
            raise ShapeError(
                f"split: piece sizes {sizes} of dim {d} of [{x.shape}] must be >= 0 and add up to {d.size}"
            )
    out, begin = [], 0
    for s in sizes:
        out.append(slice_dim(x, d.name, begin, s, name=name))
        begin += s
    return out


def stack(xs: Sequence[MeshTensor], dim: str | Dim, axis: int = 0, name: str | None = None) -> MeshTensor:
    """Stack tensors of one shape along a new dim of size ``len(xs)``, put at position ``axis``
    of the output's dims (negative counts from the end, as in ``torch.stack``). The new dim may
    be split by the rules: each processor then keeps only its pieces.

    Example:
        >>> import meshtorch as mt
        >>> y = mt.stack([mt.zeros("t:2"), mt.ones("t:2")], "s", axis=1)
        >>> y.shape, y.to_global().tolist()
        (Shape('t:2,s:2'), [[0.0, 1.0], [0.0, 1.0]])
    """
    xs = [as_mesh_tensor(x) for x in xs]
    if not xs:
        raise ShapeError("stack needs at least one tensor")
    first = xs[0]
    for i, x in enumerate(xs[1:], 1):
        if x.shape != first.shape:
            raise ShapeError(f"stack: tensor {i} has shape [{x.shape}], tensor 0 has [{first.shape}]")
    n = dim_name(dim)
    if n in first.shape:
        raise ShapeError(f"stack: the tensors [{first.shape}] already have a dim named {n!r}")
    if isinstance(dim, Dim) and dim.size != len(xs):
        raise ShapeError(f"stack: dim {dim} must have size {len(xs)}, the number of tensors")
    rank = first.shape.ndim + 1
    if not -rank <= axis < rank:
        raise ShapeError(f"stack: axis {axis} is outside the {rank} dims of the output")
    axis %= rank
    dims = list(first.shape.dims)
    dims.insert(axis, Dim(n, len(xs)))
    return lower("stack", xs, Shape(dims), lambda view, *ts: torch.stack(ts, axis), whole={n}, name=name)


def unstack(x: MeshTensor, dim: str | Dim, name: str | None = None) -> list[MeshTensor]:
    """The tensors ``x[..., i, ...]`` for each ``i`` of ``dim``, which they lack. A split ``dim``
    is gathered once (one ``all_gather`` per axis splitting it), then each piece is local.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(4.0).reshape(2, 2), "s:2,t:2")
        >>> [p.to_global().tolist() for p in mt.unstack(x, "t")]
        [[0.0, 2.0], [1.0, 3.0]]
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "unstack")]
    i = x.shape.index(d.name)
    if x.layout.axes_of(d.name):
        x = rename(x, d.name, _unruled_name(x, d.name))
    out = x.shape.without([x.shape.dims[i].name])
    return [lower("unstack", [x], out, lambda view, t, k=k: t.select(i, k), whole={x.shape.dims[i].name},
                  name=name) for k in range(d.size)]


def _unruled_name(x: MeshTensor, base: str) -> str:
    """A dim name no rule splits and ``x`` does not use: renaming to it gathers the dim."""
    rules = current().rules
    n = f"{base}_whole"
    while rules.axes_of(n) or n in x.shape:
        n += "_"
    return n
