"""Changing names, order and grouping of dims: rename, relayout, transpose, reshape, broadcast.

Since layouts follow from dim names and the rules, renaming a dim is how a
program moves data between processors: ``rename(x, "d_ff", "d_ff_unsplit")``
gathers a split ``d_ff`` if the new name has no rule, and two split dims
trading places become one ``all_to_all``.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,b:3")
    >>> mt.reshape(x, "ab:6").to_global().tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

from collections.abc import Iterable

from meshtorch.errors import ShapeError
from meshtorch.lowering.lower import align, lower
from meshtorch.lowering.redistribute import redistribute
from meshtorch.shape import Dim, Shape, as_shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor, layout_for, share_adapted


def relayout(x: MeshTensor, shape: Shape | str | Iterable[Dim], name: str | None = None) -> MeshTensor:
    """The same values under new dim names (same sizes, same order), laid out
    as the rules say for the new names: each axis that changes dim costs one
    ``all_to_all``; an axis that becomes replicated, one ``all_gather``; an axis
    that becomes split, a local slice.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.ones("a:2,b:4")
        >>> mt.relayout(x, "a:2,c:4").shape
        Shape('a:2,c:4')
    """
    if not isinstance(x, MeshTensor):  # (the checks' calls made only where they act: per step)
        as_mesh_tensor(x)
    if not isinstance(shape, Shape):
        shape = as_shape(shape)
    if shape.sizes != x.shape.sizes:
        raise ShapeError(
            f"relayout keeps sizes: [{x.shape}] has sizes {list(x.shape.sizes)}, but the new "
            f"shape [{shape}] has {list(shape.sizes)}; use mt.reshape to change sizes"
        )
    out_layout = layout_for(shape, name)
    # redistribute gives this processor's slice of the new layout: no size check to make again
    out = MeshTensor._checked_elsewhere(redistribute(x.local, x.layout, out_layout), shape, out_layout, name)
    share_adapted(x, out)
    return out


def relayout_like(x: MeshTensor, like: MeshTensor) -> MeshTensor:
    """``x`` (of ``like``'s shape, possibly another layout) in ``like``'s layout."""
    if x.shape != like.shape:
        raise ShapeError(f"expected shape [{like.shape}], got [{x.shape}]")
    if x.layout == like.layout:
        return x
    return relayout(x, like.shape)


def rename(x: MeshTensor, old: str | Dim, new: str | Dim, name: str | None = None) -> MeshTensor:
    """Rename one dim (its layout follows the new name's rule).

    Example:
        >>> import meshtorch as mt
        >>> mt.rename(mt.ones("a:2,b:3"), "b", "c").shape
        Shape('a:2,c:3')
    """
    if not isinstance(x, MeshTensor):
        as_mesh_tensor(x)
    if isinstance(old, str) and isinstance(new, str):
        # the same renames every step (attention's keys): the new shape is made once
        shape = x.shape.derived(("rename", old, new), lambda: _renamed(x.shape, old, new))
    else:
        shape = _renamed(x.shape, old, new)
    return relayout(x, shape, name)


def _renamed(shape: Shape, old: str | Dim, new: str | Dim) -> Shape:
    d = shape[dim_name(old, shape, "rename")]
    new_dim = new if isinstance(new, Dim) else Dim(new, d.size)
    if new_dim.size != d.size:
        raise ShapeError(f"rename keeps sizes: {d} cannot become {new_dim}; use mt.reshape")
    return shape.replace(old, new_dim)


def transpose(x: MeshTensor, order: Iterable[str | Dim], name: str | None = None) -> MeshTensor:
    """The same tensor with its dims in another order (the layout may change,
    since an earlier dim takes a shared axis first).

    Example:
        >>> import meshtorch as mt
        >>> mt.transpose(mt.ones("a:2,b:3"), ["b", "a"]).shape
        Shape('b:3,a:2')
    """
    x = as_mesh_tensor(x)
    names = [dim_name(d, x, "transpose") for d in order]
    if sorted(names) != sorted(x.names):
        raise ShapeError(f"transpose order {names} must list exactly the dims of [{x.shape}]")
    out = Shape([x.shape[n] for n in names])
    perm = [x.shape.index(n) for n in names]
    return lower("transpose", [x], out, lambda view, t: t.permute(perm), name=name)


def reshape(x: MeshTensor, shape: Shape | str | Iterable[Dim], name: str | None = None) -> MeshTensor:
    """Reinterpret the elements, in row-major order of ``x``'s dims, as ``shape``
    (as ``torch.reshape`` does). Dims kept with the same name, size and row-major
    position stay split; the others are gathered and the result laid out anew.

    Example:
        >>> import meshtorch as mt
        >>> mt.reshape(mt.ones("batch:2,h:2,d:3"), "batch:2,hd:6").shape
        Shape('batch:2,hd:6')
    """
    x = as_mesh_tensor(x)
    shape = as_shape(shape)
    if shape.numel != x.shape.numel:
        raise ShapeError(
            f"reshape keeps the number of elements: [{x.shape}] has {x.shape.numel}, "
            f"[{shape}] has {shape.numel}"
        )

    def prefixes(s: Shape) -> dict[str, tuple[int, int]]:
        out, p = {}, 1
        for d in s:
            out[d.name] = (p, d.size)
            p *= d.size
        return out

    old_p, new_p = prefixes(x.shape), prefixes(shape)
    aligned = {n for n in old_p if n in new_p and old_p[n] == new_p[n]}
    whole = (set(x.names) | set(shape.names)) - aligned

    def local_fn(view, t):
        return t.reshape([view.size(d.name) if d.name in aligned else d.size for d in shape])

    return lower("reshape", [x], shape, local_fn, whole=whole, name=name)


def replace_dims(
    x: MeshTensor, old: Iterable[str | Dim], new: Shape | str | Iterable[Dim], name: str | None = None
) -> MeshTensor:
    """Replace adjacent dims ``old`` by dims ``new`` of the same total size
    (merge or split dims in place).

    Example:
        >>> import meshtorch as mt
        >>> mt.replace_dims(mt.ones("b:2,h:2,d:3"), ["h", "d"], "hd:6").shape
        Shape('b:2,hd:6')
    """
    x = as_mesh_tensor(x)
    old_names = [dim_name(d, x, "replace_dims") for d in old]
    idx = [x.shape.index(n) for n in old_names]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ShapeError(
            f"replace_dims: dims {old_names} must be adjacent and in order in [{x.shape}]"
        )
    new = as_shape(new)
    dims = x.shape.dims[: idx[0]] + new.dims + x.shape.dims[idx[-1] + 1 :]
    return reshape(x, Shape(dims), name)


def broadcast(x: MeshTensor, shape: Shape | str | Iterable[Dim], name: str | None = None) -> MeshTensor:
    """``x`` repeated over the dims of ``shape`` it lacks, with its dims in ``shape``'s order
    (Mesh-TF's ``mtf.broadcast``). ``shape`` must hold every dim of ``x``. A new dim split by the
    rules costs nothing: each processor makes its slice; in backward the gradient is summed over
    the new dims (an ``all_reduce`` along the axes that split them, where ``x`` is replicated).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([1.0, 2.0]), "d:2")
        >>> mt.broadcast(x, "d:2,t:3").to_global().tolist()
        [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    """
    x = as_mesh_tensor(x)
    shape = as_shape(shape)
    for d in x.shape:
        if d not in shape.dims:
            raise ShapeError(
                f"broadcast: dim {d} of [{x.shape}] is not in the target shape [{shape}]; "
                "the target must hold every dim of the tensor, with the same size"
            )
    names, target = x.names, shape.names

    def local_fn(view, t):
        return align(t, names, target).expand([view.size(n) for n in target])

    return lower("broadcast", [x], shape, local_fn, name=name)
