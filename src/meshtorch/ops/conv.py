"""Convolutions by dim name: ``conv1d``/``conv2d``/``conv3d`` and their transposes.

``mt.conv2d(x, kernel, dims=("h", "w"), kernel_dims=("kh", "kw"))``: the input channel is the dim
``x`` and ``kernel`` share, the output channel the kernel's dim ``x`` lacks, and the output keeps
``x``'s dim order with the input channel replaced by the output channel (every other dim of ``x``
is a batch dim). Any dim may be split by the rules: batch and output channels locally, the input
channel as partial sums (one ``all_reduce``), and a spatial dim with a halo exchange of exactly the
rows the kernel reaches into each neighbour's slice (:mod:`meshtorch.ops.spatial`), also in
backward. ``padding`` is ``"same"`` or ``"valid"`` as in TensorFlow (``"same"``: the output has
``ceil(size / stride)`` positions, the extra padding row after), or an int for that many zeros on
each side as in torch. The local computation is ``torch.nn.functional.conv*d``.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.ones(1, 5, 2), "batch:1,w:5,c:2")
    >>> k = mt.from_global(torch.ones(3, 2, 1), "kw:3,c:2,out:1")
    >>> mt.conv1d(x, k).to_global()[0, :, 0].tolist()
    [4.0, 6.0, 6.0, 6.0, 4.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.nn.functional as F

from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.halo import window
from meshtorch.ops.einsum import _promoted
from meshtorch.ops.spatial import Window, lower_windowed
from meshtorch.shape import Dim, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor

Padding = str | int | Sequence[int]
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def per_dim(value: int | Sequence[int], k: int, what: str, op: str, low: int = 1) -> tuple[int, ...]:
    """``value`` for each of ``k`` spatial dims (an int is repeated), each at least ``low``."""
    vals = (value,) * k if isinstance(value, int) else tuple(value)
    if len(vals) != k or any(not isinstance(v, int) or v < low for v in vals):
        raise ArgumentError(f"{op}: {what}={value!r} must be an int >= {low} or {k} of them, "
                            "one per spatial dim")
    return vals


def conv_padding(padding: Padding, n: int, span: int, stride: int, op: str,
                 i: int = 0) -> tuple[int, int, int]:
    """``(before, after, output size)`` of a convolution of ``n`` positions whose kernel spans
    ``span`` positions (``dilation * (size - 1) + 1``): TensorFlow's ``"same"`` and ``"valid"``, or
    an int (torch's zero padding on both sides).

    Example:
        >>> [conv_padding(p, 5, 3, s, "conv") for p, s in (("same", 2), ("valid", 1), (1, 1))]
        [(1, 1, 3), (0, 0, 3), (1, 1, 5)]
    """
    if isinstance(padding, str) and padding.lower() == "same":
        m = -(-n // stride)
        total = max((m - 1) * stride + span - n, 0)
        return total // 2, total - total // 2, m
    if isinstance(padding, str) and padding.lower() == "valid":
        before = after = 0
    elif isinstance(padding, int) and padding >= 0:
        before = after = padding
    elif not isinstance(padding, str) and isinstance(padding, Sequence) and isinstance(padding[i], int):
        before = after = padding[i]
    else:
        raise ArgumentError(f"{op}: padding={padding!r} must be 'same', 'valid' or an int >= 0 (per dim)")
    m = (n + before + after - span) // stride + 1
    if m < 1:
        raise ShapeError(f"{op}: a kernel spanning {span} positions does not fit {n} (+{before + after} "
                         "padding) positions; use padding='same' or a smaller kernel or dilation")
    return before, after, m


def _channels(op: str, x: MeshTensor, kernel: MeshTensor, dims: tuple[str, ...],
              kernel_dims: tuple[str, ...]) -> tuple[str, str]:
    for d in dims:
        if d not in x.shape:
            raise ShapeError(f"{op}: input [{x.shape}] has no spatial dim {d!r}; name its spatial dims "
                             "with dims=")
    for d in kernel_dims:
        if d not in kernel.shape:
            raise ShapeError(f"{op}: kernel [{kernel.shape}] has no dim {d!r}; name the kernel's window dims "
                             "with kernel_dims=")
    if len(dims) != len(kernel_dims):
        raise ShapeError(f"{op}: {len(dims)} spatial dims {dims} but {len(kernel_dims)} kernel dims "
                         f"{kernel_dims}; name one kernel dim per spatial dim")
    rest = [d for d in kernel.names if d not in kernel_dims]
    cin = [d for d in rest if d in x.shape]
    cout = [d for d in rest if d not in x.shape]
    if len(cin) != 1 or len(cout) != 1 or cin[0] in dims:
        raise ShapeError(
            f"{op}: kernel [{kernel.shape}] must have the window dims {kernel_dims}, one input-channel dim "
            f"that input [{x.shape}] has and one output-channel dim it lacks; found input channels {cin} "
            f"and output channels {cout}")
    return cin[0], cout[0]


def _conv(op: str, x: MeshTensor, kernel: MeshTensor, dims, kernel_dims, padding: Padding, stride,
          dilation, transpose: bool, rank: int, name: str | None) -> MeshTensor:
    # mixed dtypes promote as einsum's operands do (torch's convolutions refuse them)
    x, kernel = _promoted((as_mesh_tensor(x), as_mesh_tensor(kernel)))
    dims = tuple(dim_name(d, x, op, "the input") for d in ((dims,) if isinstance(dims, (str, Dim)) else dims))
    kernel_dims = tuple(dim_name(d, kernel, op, "the kernel")
                        for d in ((kernel_dims,) if isinstance(kernel_dims, (str, Dim)) else kernel_dims))
    if len(dims) != rank:
        raise ShapeError(f"{op} convolves {rank} spatial dims, got dims={dims}")
    cin, cout = _channels(op, x, kernel, dims, kernel_dims)
    strides, dilations = per_dim(stride, rank, "stride", op), per_dim(dilation, rank, "dilation", op)
    windows, crops = [], []
    out = x.shape.replace(cin, kernel.shape[cout])
    for j, (d, kd, s, dl) in enumerate(zip(dims, kernel_dims, strides, dilations)):
        n, span = x.shape[d].size, dl * (kernel.shape[kd].size - 1) + 1
        if transpose:
            crop, m = _transpose_padding(padding, n, span, s, op, j)
            crops.append(crop)

            def reads(start, k, s=s, span=span, crop=crop):
                # full-output position p gets input i with i*s <= p <= i*s + span - 1
                lo, hi = start + crop, start + crop + k - 1
                return (-(-(lo - span + 1) // s), hi // s + 1) if k else (0, 0)
        else:
            before, _, m = conv_padding(padding, n, span, s, op, j)

            def reads(start, k, s=s, span=span, before=before):
                a = start * s - before
                return (a, a + (k - 1) * s + span) if k else (a, a)
        windows.append(Window(d, n, m, reads))
        out = out.replace(d, Dim(d, m))
    batch = [d for d in x.names if d not in dims and d != cin]
    x_perm = [x.names.index(d) for d in (*batch, cin, *dims)]
    w_order = (cin, cout) if transpose else (cout, cin)
    w_perm = [kernel.names.index(d) for d in (*w_order, *kernel_dims)]
    natural = [*batch, cout, *dims]
    out_perm = [natural.index(d) for d in out.names]
    nb = len(batch)
    fn = (_CONV_T if transpose else _CONV)[rank]

    def local(view, xw, wl):
        xp = xw.permute(x_perm)
        lead = xp.shape[:nb]
        xp = xp.reshape(math.prod(lead), *xp.shape[nb:])
        sizes = [view.size(d) for d in dims]
        if min(sizes) == 0 or xp.numel() == 0 or wl.numel() == 0:
            # no input reaches this piece (or no channel is here): zeros, still in the graph of
            # both operands so that their backward collectives run here as on the others
            shape = [*lead, wl.shape[w_perm[1 if transpose else 0]], *sizes]
            y = xw.new_zeros(shape) + 0 * (xw.sum() + wl.sum())
            return y.permute(out_perm)
        # contiguous: torch's CPU convolution backward (slow_conv2d) refuses a weight whose
        # permuted strides it cannot use ("grad_weight must be contiguous", seen with one
        # output channel on a processor)
        y = fn(xp, wl.permute(w_perm).contiguous(), stride=strides, dilation=dilations)
        if transpose:
            for j, (d, w) in enumerate(zip(dims, windows)):
                a, _ = w.reads(view.start(d), sizes[j])
                first = view.start(d) + crops[j] - a * strides[j]
                y = window(y, 2 + j, y.shape[2 + j], first, first + sizes[j])
        return y.reshape(*lead, *y.shape[1:]).permute(out_perm)

    return lower_windowed(op, x, [kernel], out, windows, local, reduced={cin: "sum"},
                          whole=set(kernel_dims), name=name)


def _transpose_padding(padding: Padding, n: int, span: int, stride: int, op: str, i: int) -> tuple[int, int]:
    """``(rows cropped from the front of the full output, output size)`` of a transposed
    convolution: TensorFlow's ``"same"`` (``n * stride`` positions) and ``"valid"``, or torch's int."""
    full = (n - 1) * stride + span
    if isinstance(padding, str) and padding.lower() == "same":
        return max(span - stride, 0) // 2, n * stride
    if isinstance(padding, str) and padding.lower() == "valid":
        return 0, n * stride + max(span - stride, 0)
    p = padding if isinstance(padding, int) else (padding[i] if isinstance(padding, Sequence) else None)
    if not isinstance(p, int) or p < 0 or full - 2 * p < 1:
        raise ArgumentError(f"{op}: padding={padding!r} must be 'same', 'valid' or an int >= 0 (per dim) "
                            f"leaving at least one of the {full} output positions")
    return p, full - 2 * p


def conv1d(x: MeshTensor, kernel: MeshTensor, dims: str | Sequence[str] = ("w",),
           kernel_dims: str | Sequence[str] = ("kw",), padding: Padding = "same", stride: int = 1,
           dilation: int = 1, name: str | None = None) -> MeshTensor:
    """1-D convolution along ``dims`` (see :mod:`meshtorch.ops.conv`).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(6.0).reshape(1, 6, 1), "batch:1,w:6,c:1")
        >>> k = mt.from_global(torch.tensor([1.0, -1.0]).reshape(2, 1, 1), "kw:2,c:1,out:1")
        >>> mt.conv1d(x, k, padding="valid").to_global().flatten().tolist()
        [-1.0, -1.0, -1.0, -1.0, -1.0]
    """
    return _conv("conv1d", x, kernel, dims, kernel_dims, padding, stride, dilation, False, 1, name)


def conv2d(x: MeshTensor, kernel: MeshTensor, dims: Sequence[str] = ("h", "w"),
           kernel_dims: Sequence[str] = ("kh", "kw"), padding: Padding = "same",
           stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
           name: str | None = None) -> MeshTensor:
    """2-D convolution over ``dims`` (Mesh-TF's ``mtf.conv2d`` and ``conv2d_with_blocks``; see
    :mod:`meshtorch.ops.conv`). With ``h`` split, each processor receives the rows the kernel
    reaches into its neighbours' slices, and nothing else.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.random.normal("batch:2,h:8,w:8,c:3", seed=0)
        >>> k = mt.random.normal("kh:3,kw:3,c:3,out:4", seed=1)
        >>> y = mt.conv2d(x, k)
        >>> y.shape
        Shape('batch:2,h:8,w:8,out:4')
        >>> xt, kt = x.to_global().permute(0, 3, 1, 2), k.to_global().permute(3, 2, 0, 1)
        >>> ref = torch.nn.functional.conv2d(xt, kt, padding=1)
        >>> torch.allclose(y.to_global(), ref.permute(0, 2, 3, 1), atol=1e-5)
        True
    """
    return _conv("conv2d", x, kernel, dims, kernel_dims, padding, stride, dilation, False, 2, name)


def conv3d(x: MeshTensor, kernel: MeshTensor, dims: Sequence[str] = ("d", "h", "w"),
           kernel_dims: Sequence[str] = ("kd", "kh", "kw"), padding: Padding = "same",
           stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
           name: str | None = None) -> MeshTensor:
    """3-D convolution over ``dims`` (see :mod:`meshtorch.ops.conv`).

    Example:
        >>> import meshtorch as mt
        >>> x = mt.ones("batch:1,d:4,h:4,w:4,c:1")
        >>> k = mt.ones("kd:3,kh:3,kw:3,c:1,out:1")
        >>> mt.conv3d(x, k, padding="valid").to_global().flatten().tolist()
        [27.0, 27.0, 27.0, 27.0, 27.0, 27.0, 27.0, 27.0]
    """
    return _conv("conv3d", x, kernel, dims, kernel_dims, padding, stride, dilation, False, 3, name)


def conv_transpose1d(x: MeshTensor, kernel: MeshTensor, dims: str | Sequence[str] = ("w",),
                     kernel_dims: str | Sequence[str] = ("kw",), padding: Padding = "same",
                     stride: int = 1, dilation: int = 1, name: str | None = None) -> MeshTensor:
    """Transposed 1-D convolution (the gradient of :func:`conv1d` with respect to its input):
    ``"same"`` gives ``size * stride`` positions, ``"valid"`` every position the kernel reaches,
    at least ``size * stride`` (TensorFlow's ``conv1d_transpose``: ``size * stride + max(span -
    stride, 0)``), an int crops that many from each end (torch's).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([[[1.0], [2.0]]]), "batch:1,w:2,c:1")
        >>> k = mt.from_global(torch.ones(2, 1, 1), "kw:2,c:1,out:1")
        >>> mt.conv_transpose1d(x, k, stride=2).to_global().flatten().tolist()
        [1.0, 1.0, 2.0, 2.0]
    """
    return _conv("conv_transpose1d", x, kernel, dims, kernel_dims, padding, stride, dilation, True, 1, name)


def conv_transpose2d(x: MeshTensor, kernel: MeshTensor, dims: Sequence[str] = ("h", "w"),
                     kernel_dims: Sequence[str] = ("kh", "kw"), padding: Padding = "same",
                     stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
                     name: str | None = None) -> MeshTensor:
    """Transposed 2-D convolution (Mesh-TF's ``mtf.layers.conv2d_transpose``; see
    :func:`conv_transpose1d` for ``padding``).

    Example:
        >>> import meshtorch as mt
        >>> x = mt.ones("batch:1,h:2,w:2,c:1")
        >>> k = mt.ones("kh:2,kw:2,c:1,out:1")
        >>> mt.conv_transpose2d(x, k, stride=2).shape
        Shape('batch:1,h:4,w:4,out:1')
    """
    return _conv("conv_transpose2d", x, kernel, dims, kernel_dims, padding, stride, dilation, True, 2, name)


def conv_transpose3d(x: MeshTensor, kernel: MeshTensor, dims: Sequence[str] = ("d", "h", "w"),
                     kernel_dims: Sequence[str] = ("kd", "kh", "kw"), padding: Padding = "same",
                     stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
                     name: str | None = None) -> MeshTensor:
    """Transposed 3-D convolution (see :func:`conv_transpose1d` for ``padding``).

    Example:
        >>> import meshtorch as mt
        >>> x = mt.ones("batch:1,d:2,h:2,w:2,c:1")
        >>> mt.conv_transpose3d(x, mt.ones("kd:1,kh:1,kw:1,c:1,out:2"), stride=2).shape
        Shape('batch:1,d:4,h:4,w:4,out:2')
    """
    return _conv("conv_transpose3d", x, kernel, dims, kernel_dims, padding, stride, dilation, True, 3, name)
