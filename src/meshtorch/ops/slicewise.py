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

from meshtorch.errors import ShapeError
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
    """The names of the ``whole`` dims; a ``Dim`` among them must have the size of its name in the
    operands, or in the output (a function may resize a dim it takes whole, an FFT say)."""
    names = set()
    for d in whole:
        if isinstance(d, Dim):
            holders = [x.shape for x in xs if d.name in x.shape.names] + (
                [out] if d.name in out.names else [])
            if holders and not any(h[d.name].size == d.size for h in holders):
                sizes = sorted({h[d.name].size for h in holders})
                raise ShapeError(f"slicewise: whole dim {d} has size {d.size}, but '{d.name}' is "
                                 f"{' or '.join(map(str, sizes))} in the operands and the output; pass "
                                 f"the name '{d.name}', or Dim('{d.name}', {sizes[0]})")
        names.add(dim_name(d))
    return names
