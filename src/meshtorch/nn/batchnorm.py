"""Batch normalisation over named dims (Mesh-TF's ``mtf.layers.batch_norm``, torch's ``BatchNorm``).

The statistics of each feature are taken over every other dim of the input (batch, and the
spatial dims of an image), however the rules split them: the local sums of ``x`` and ``x²`` are
computed together and summed over the split dims with one ``all_reduce`` (one per group of
axes) of ``2 × features`` numbers, and the gradient flows back through them.

Example:
    >>> import torch, meshtorch as mt
    >>> bn = mt.nn.BatchNorm(mt.Dim("c", 2))
    >>> x = mt.from_global(torch.tensor([[1.0, 10.0], [3.0, 30.0]]), "batch:2,c:2")
    >>> [[round(v, 3) for v in row] for row in bn(x).to_global().tolist()]
    [[-1.0, -1.0], [1.0, 1.0]]
    >>> [round(v, 3) for v in bn.running_mean.mesh_tensor.to_global().tolist()]
    [0.2, 2.0]
"""

from __future__ import annotations

import torch

from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.lower import lower
from meshtorch.nn.module import Module
from meshtorch.nn.parameter import MeshParameter
from meshtorch.ops.elementwise import rsqrt
from meshtorch.ops.pieces import unstack
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor, as_mesh_tensor

_STAT = "batch_norm_moment"  # [sum, sum of squares]: a dim no rule names, so never split


def moments(x: MeshTensor, dim: str) -> tuple[MeshTensor, MeshTensor]:
    """The mean and (biased) variance of ``x`` per element of ``dim``, over every other dim:
    one ``all_reduce`` of the sums of ``x`` and ``x²`` where those dims are split.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.nn.batchnorm import moments
        >>> m, v = moments(mt.from_global(torch.tensor([[1.0], [3.0]]), "batch:2,c:1"), "c")
        >>> m.to_global().tolist(), v.to_global().tolist()
        ([2.0], [1.0])
    """
    others = [n for n in x.names if n != dim]
    idx = [x.shape.index(n) for n in others]
    count = x.shape.numel // x.shape[dim].size

    def local_fn(view, t):
        return torch.stack([t.sum(idx), (t * t).sum(idx)])

    sums = lower("batch_norm", [x], Shape([Dim(_STAT, 2), x.shape[dim]]), local_fn,
                 reduced=dict.fromkeys(others, "sum"))
    total, squares = unstack(sums, _STAT)
    mean = total / count
    return mean, squares / count - mean * mean


class BatchNorm(Module):
    """Normalise each element of ``dim`` (the features or channels) over every other dim of the
    input, with a learned scale and bias (``affine``), as ``torch.nn.BatchNorm1d/2d/3d``.

    In training the batch statistics are used, and ``running_mean``/``running_var`` move towards
    them by ``momentum`` (torch's convention: ``new = (1 - momentum) · old + momentum · batch``,
    the variance unbiased); in eval (``.eval()``) the running statistics are used. Split batch or
    spatial dims cost one ``all_reduce`` of ``2 × dim`` numbers forward (and the same backward
    through the statistics); the values and gradients are those of one processor.
    The running statistics are parameters with ``requires_grad=False``, so they are saved and
    resharded with the model.

    Example:
        >>> import torch, meshtorch as mt
        >>> def f():
        ...     bn = mt.nn.BatchNorm(mt.Dim("c", 1))
        ...     x = mt.from_global(torch.tensor([[0.0], [2.0], [4.0], [6.0]]), "batch:4,c:1")
        ...     return [round(v, 3) for v in bn(x).to_global().flatten().tolist()]
        >>> mt.launch(f, mesh="b:2", rules="batch:b")[0]
        [-1.342, -0.447, 0.447, 1.342]
    """

    def __init__(self, dim: Dim, *, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True):
        super().__init__()
        if not isinstance(dim, Dim):
            raise ShapeError(f"BatchNorm needs the feature dim as a Dim (name and size), got {dim!r}")
        if not 0.0 <= momentum <= 1.0:
            raise ArgumentError(f"BatchNorm momentum={momentum} is outside [0, 1]; torch's default is 0.1")
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.weight = MeshParameter([dim], "ones") if affine else None
        self.bias = MeshParameter([dim], "zeros") if affine else None
        self.running_mean = self.running_var = None
        if track_running_stats:
            self.running_mean = MeshParameter([dim], "zeros", requires_grad=False)
            self.running_var = MeshParameter([dim], "ones", requires_grad=False)

    def forward(self, x: MeshTensor) -> MeshTensor:
        x = as_mesh_tensor(x)
        if self.dim not in x.shape:
            raise ShapeError(f"BatchNorm over {self.dim} got an input [{x.shape}] without it")
        if self.training or self.running_mean is None:
            mean, var = moments(x, self.dim.name)
            if self.training and self.running_mean is not None:
                self._track(mean, var, x.shape.numel // self.dim.size)
        else:
            mean, var = self.running_mean.mesh_tensor, self.running_var.mesh_tensor
        y = (x - mean) * rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight.mesh_tensor + self.bias.mesh_tensor
        return y

    @torch.no_grad()
    def _track(self, mean: MeshTensor, var: MeshTensor, count: int) -> None:
        m = self.momentum
        unbiased = var.detach() * (count / max(count - 1, 1))
        for p, new in ((self.running_mean, mean.detach()), (self.running_var, unbiased)):
            old = p.mesh_tensor
            p.data.copy_(((1 - m) * old + m * new).local.to(p.dtype))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, momentum={self.momentum}"
