"""Pooling by dim name: ``max_pool`` and ``avg_pool`` over 1, 2 or 3 spatial dims.

``mt.max_pool(x, ("h", "w"), 2)`` pools each 2x2 window of ``h`` and ``w``; every other dim is
pooled independently. Windows move by ``stride`` (default: the window, non-overlapping, as
Mesh-TF's ``max_pool2d``). ``padding`` is TensorFlow's ``"valid"`` (default) or ``"same"``; in
``"same"`` padding the positions outside the input take no part (a max ignores them, an average
divides by the positions inside). A split spatial dim gets the halo its windows reach into the
neighbours' slices, as a convolution does (:mod:`meshtorch.ops.spatial`); with non-overlapping
windows that the pieces divide, none at all. The local computation is ``torch.nn.functional``'s
``max_pool*d`` / ``avg_pool*d``.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.arange(8.0), "w:8")
    >>> mt.max_pool(x, "w", 2).to_global().tolist(), mt.avg_pool(x, "w", 4).to_global().tolist()
    ([1.0, 3.0, 5.0, 7.0], [1.5, 5.5])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshtorch.errors import ShapeError
from meshtorch.ops.conv import conv_padding, per_dim
from meshtorch.ops.spatial import Window, lower_windowed
from meshtorch.shape import Dim, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pool(op: str, x: MeshTensor, dims, size, stride, padding: str, name: str | None) -> MeshTensor:
    x = as_mesh_tensor(x)
    dims = tuple(dim_name(d, x, op, "the input") for d in ((dims,) if isinstance(dims, (str, Dim)) else dims))
    if not 1 <= len(dims) <= 3 or any(d not in x.shape for d in dims):
        raise ShapeError(f"{op}: dims={dims} must name 1 to 3 spatial dims of [{x.shape}]")
    rank = len(dims)
    sizes = per_dim(size, rank, "size", op)
    strides = sizes if stride is None else per_dim(stride, rank, "stride", op)
    if not isinstance(padding, str):
        raise ShapeError(f"{op}: padding={padding!r} must be 'valid' or 'same'")
    windows, out = [], x.shape
    for d, k, s in zip(dims, sizes, strides):
        n = x.shape[d].size
        before, _, m = conv_padding(padding, n, k, s, op)

        def reads(start, length, s=s, k=k, before=before):
            a = start * s - before
            return (a, a + (length - 1) * s + k) if length else (a, a)
        windows.append(Window(d, n, m, reads))
        out = out.replace(d, Dim(d, m))
    rest = [d for d in x.names if d not in dims]
    perm = [x.names.index(d) for d in (*rest, *dims)]
    natural = [*rest, *dims]
    back = [natural.index(d) for d in x.names]
    is_max = op == "max_pool"
    fn = (_MAX if is_max else _AVG)[rank]
    same = padding.lower() == "same"

    def local(view, xw):
        xp = xw.permute(perm)
        lead = xp.shape[:len(rest)]
        pieces = [view.size(d) for d in dims]
        if min(pieces) == 0 or xp.numel() == 0:
            # still in the graph, so that this processor's halo gradients flow back like the others'
            return (xw.new_zeros([*lead, *pieces]) + xw.flatten()[:0].sum()).permute(back)
        flat = xp.reshape(1, math.prod(lead), *xp.shape[len(rest):])
        y = fn(flat, sizes, strides)
        if not is_max and same:
            y = y / fn(_inside(xw, view, dims, windows), sizes, strides)
        return y.reshape(*lead, *y.shape[2:]).permute(back)

    return lower_windowed(op, x, [], out, windows, local, fill=-math.inf if is_max else 0.0, name=name)


def _inside(xw: torch.Tensor, view, dims, windows) -> torch.Tensor:
    """1 where a window position lies inside the input, 0 in the padding (for "same" averages)."""
    mask = torch.ones((), dtype=xw.dtype, device=xw.device)
    for d, w in zip(dims, windows):
        a, b = w.reads(view.start(d), view.size(d))
        pos = torch.arange(a, b, device=xw.device)
        inside = ((pos >= 0) & (pos < w.size)).to(xw.dtype)
        mask = mask.unsqueeze(-1) * inside
    return mask.reshape(1, 1, *mask.shape)


def max_pool(x: MeshTensor, dims: str | Sequence[str], size: int | Sequence[int],
             stride: int | Sequence[int] | None = None, padding: str = "valid",
             name: str | None = None) -> MeshTensor:
    """The maximum of each window of ``size`` positions over ``dims`` (Mesh-TF's ``max_pool2d``
    and ``max_pool1d``; see :mod:`meshtorch.ops.pool`).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(16.0).reshape(4, 4), "h:4,w:4")
        >>> mt.max_pool(x, ("h", "w"), 2).to_global().tolist()
        [[5.0, 7.0], [13.0, 15.0]]
    """
    return _pool("max_pool", x, dims, size, stride, padding, name)


def avg_pool(x: MeshTensor, dims: str | Sequence[str], size: int | Sequence[int],
             stride: int | Sequence[int] | None = None, padding: str = "valid",
             name: str | None = None) -> MeshTensor:
    """The mean of each window of ``size`` positions over ``dims`` (Mesh-TF's ``avg_pool2d``
    and ``avg_pool1d``; in ``"same"`` padding, over the positions inside the input).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(5.0), "w:5")
        >>> mt.avg_pool(x, "w", 2, padding="same").to_global().tolist()
        [0.5, 2.5, 4.0]
    """
    return _pool("avg_pool", x, dims, size, stride, padding, name)
