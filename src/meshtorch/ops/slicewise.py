"""``slicewise``: the escape hatch for any local torch function.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.tensor([[3.0, 1.0, 2.0]]), "batch:1,t:3")
    >>> mt.slicewise(lambda t: t.sort(-1).values, x, whole=["t"]).to_global().tolist()
    [[1.0, 2.0, 3.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from meshtorch.lowering.lower import lower
from meshtorch.shape import Dim, Shape, as_shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def slicewise(
    fn: Callable[..., torch.Tensor],
    *xs: MeshTensor,
    output_shape: Shape | str | Iterable[Dim] | None = None,
    whole: Iterable[str | Dim] = (),
    reduced: dict[str, str] | None = None,
    name: str | None = None,
) -> MeshTensor:
    """Apply ``fn`` to the local slices of ``xs``.

    ``fn`` gets torch tensors whose dims are in each operand's shape order and
    must return the local slice of ``output_shape`` (default: the first
    operand's shape), in that order. Dims listed in ``whole`` are never split
    while ``fn`` runs (they are gathered first), so ``fn`` may work across them;
    every other dim may be split, so ``fn`` must act independently along it,
    unless it is listed in ``reduced`` (``{"dim": "sum"}``): then ``fn`` returns
    partial results over its slice and they are combined across processors.
    """
    xs = tuple(as_mesh_tensor(x) for x in xs)
    out = xs[0].shape if output_shape is None else as_shape(output_shape)
    return lower(getattr(fn, "__name__", "slicewise"), xs, out, lambda view, *ls: fn(*ls),
                 whole=_whole_names(whole, xs, out), reduced=reduced, name=name)


def _whole_names(whole: Iterable[str | Dim], xs: tuple[MeshTensor, ...], out: Shape) -> set[str]:
    """The names of the ``whole`` dims; a ``Dim`` among them is checked against each operand
    and the output that has a dim of its name."""
    names = set()
    for d in whole:
        if isinstance(d, Dim):
            for i, x in enumerate(xs):
                dim_name(d, x, "slicewise", f"operand {i}")
            dim_name(d, out, "slicewise", "the output")
        names.add(dim_name(d))
    return names
