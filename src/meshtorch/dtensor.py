"""Interop with PyTorch ``DTensor`` on the ``torch`` backend.

Our mesh becomes a ``DeviceMesh`` with the same axis names, in the same
row-major rank order; a tensor's layout becomes one placement per mesh axis:
``Shard(i)`` where the tensor's dim ``i`` holds the axis, ``Replicate()``
where it is replicated; a dim split over several axes gets a ``Shard`` on each
(``_StridedShard`` where the rule's axis order is not the mesh's, see
:func:`placements`). Our slices are ``torch.chunk`` pieces, exactly DTensor's
``Shard``, so values move unchanged both ways and without communication when
the placements agree. Both directions are differentiable.

Example (under ``mt.launch(..., backend="torch")``):
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     x = mt.from_global(torch.arange(8.0).reshape(4, 2), "batch:4,d:2")
    ...     dt = mt.to_dtensor(x)
    ...     return str(dt.placements), mt.from_dtensor(dt, x.shape).local.tolist()
    >>> mt.launch(f, mesh="b:2", rules="batch:b", backend="torch")  # doctest: +SKIP
    [('(Shard(dim=0),)', [[0.0, 1.0], [2.0, 3.0]]), ('(Shard(dim=0),)', [[4.0, 5.0], [6.0, 7.0]])]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from meshtorch.context import current
from meshtorch.errors import CommError, LayoutError, ShapeError
from meshtorch.layout import Layout, format_axes
from meshtorch.shape import Dim, Shape, as_shape
from meshtorch.tensor import MeshTensor, _called, layout_for, local_shape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def device_mesh() -> DeviceMesh:
    """The ``DeviceMesh`` of the current mesh (axis names kept): the torch communicator's
    (:meth:`~meshtorch.comm.torch.TorchCommunicator.device_mesh`). Creating it is collective:
    every processor calls it (SPMD).

    Example (under the torch backend, on mesh ``b:2,m:2``):
        >>> from meshtorch.dtensor import device_mesh
        >>> device_mesh().mesh_dim_names  # doctest: +SKIP
        ('b', 'm')
    """
    comm = current().comm
    if comm.backend != "torch":
        raise CommError(
            f"DTensor interop needs the torch backend (this processor runs on {comm.backend!r}); start "
            "the program with mt.launch(fn, backend='torch'), `meshtorch launch --backend torch` or torchrun")
    return comm.device_mesh()


def placements(layout: Layout) -> list:
    """One DTensor placement per mesh axis for ``layout``, in mesh axis order.

    DTensor applies placements in mesh-axis order, each ``Shard`` cutting the piece the earlier
    ones left. A dim over axes in mesh order is therefore one ``Shard`` per axis; where the rule
    puts an axis after one that comes later in the mesh (``(m,b)`` on mesh ``b,m``), that axis's
    placement is torch's ``_StridedShard`` whose ``split_factor`` counts the pieces those later
    axes cut first.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = layout.mesh
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    out = []
    for axis in mesh.axis_names:
        dim = layout.dim_of(axis)
        if dim is None:
            out.append(Replicate())
            continue
        axes, i = layout.axes_of(dim), layout.shape.index(dim)
        before = axes[: axes.index(axis)]
        factor = math.prod(mesh.axis_size(a) for a in before if order[a] > order[axis])
        if factor > 1 and layout.shape[dim].size % math.prod(mesh.axis_size(a) for a in axes):
            raise LayoutError(
                f"DTensor cannot hold dim {dim!r} of size {layout.shape[dim].size} split unevenly over "
                f"axes {format_axes(axes)} against the mesh order ({', '.join(mesh.axis_names)}): torch's "
                f"_StridedShard needs equal pieces; list the axes in mesh order, or make {dim!r} a multiple "
                f"of {math.prod(mesh.axis_size(a) for a in axes)}")
        out.append(Shard(i) if factor == 1 else _StridedShard(i, split_factor=factor))
    return out or [Replicate()]


def to_dtensor(x: MeshTensor) -> DTensor:
    """``x`` as a ``DTensor`` on :func:`device_mesh`, sharing its local slice.

    Example:
        >>> mt.to_dtensor(x).full_tensor()  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor

    dm = device_mesh()
    local = x.local if x.local.device.type == dm.device_type else x.local.to(dm.device_type)
    size = torch.Size(x.shape.sizes)
    return DTensor.from_local(local, dm, placements(x.layout), run_check=False, shape=size,
                              stride=_contiguous_stride(size))


def from_dtensor(dt: DTensor, shape: Shape | str | Iterable[Dim], name: str | None = None) -> MeshTensor:
    """A ``MeshTensor`` of named ``shape`` holding ``dt``'s values, laid out by the
    current rules; ``dt`` is redistributed only if its placements differ.

    Args:
        dt: a DTensor on a device mesh of the same shape and rank order as the
            current mesh (axis names, if any, must match too).
        shape: the named shape; its sizes must be ``dt.shape``.

    Example:
        >>> y = mt.from_dtensor(dt, "batch:4,d:2")  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise ShapeError(f"from_dtensor needs a torch DTensor, got {type(dt).__name__}")
    shape = as_shape(shape)
    if tuple(dt.shape) != shape.sizes:
        raise ShapeError(
            f"from_dtensor: DTensor{_called(name)} has shape {list(dt.shape)} but the named "
            f"shape [{shape}] needs {list(shape.sizes)}")
    mine = device_mesh()
    theirs = dt.device_mesh
    mesh = current().mesh
    if tuple(theirs.mesh.shape) != tuple(mine.mesh.shape) or not torch.equal(theirs.mesh.cpu(),
                                                                             mine.mesh.cpu()):
        raise LayoutError(
            f"from_dtensor: the DTensor's device mesh {theirs.mesh.tolist()} is not mesh '{mesh}' "
            f"(ranks {mine.mesh.tolist()}); build it with meshtorch.dtensor.device_mesh()")
    if theirs.mesh_dim_names and mesh.axes and tuple(theirs.mesh_dim_names) != mesh.axis_names:
        raise LayoutError(
            f"from_dtensor: the DTensor's mesh axes {theirs.mesh_dim_names} are not mesh '{mesh}' "
            f"axes {mesh.axis_names}; name the DeviceMesh dims like the mesh axes")
    layout = layout_for(shape, name)
    want = placements(layout)
    if tuple(dt.placements) != tuple(want):
        dt = dt.redistribute(theirs, want)
    local = dt.to_local()
    if tuple(local.shape) != local_shape(layout):  # pragma: no cover - DTensor cuts as torch.chunk
        raise LayoutError(f"from_dtensor: local shard {list(local.shape)} is not {list(local_shape(layout))}")
    return MeshTensor(local, shape, layout, name)


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
