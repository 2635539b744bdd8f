"""Cross-replica BatchNorm: batch statistics over the global batch.

In training, each replica sums ``x - shift`` and ``(x - shift)^2`` per channel
over its examples (``shift`` is the running mean, identical on every replica,
which keeps ``E[d^2] - E[d]^2`` away from cancellation once it has warmed up),
and one differentiable all_reduce gives the global sums and count. Its
backward all-reduces the two gradient sums, so gradients equal those of one
process running ``torch.nn.BatchNorm`` on the whole global batch. Running
statistics use the global count (unbiased variance), as that process would.
The state-dict keys are BatchNorm's, so checkpoints move between the two.

Example:
    >>> import torch, meshtorch as mt
    >>> x = torch.randn(8, 3, 4, 4)
    >>> def f():
    ...     bn = mt.replicator.SyncBatchNorm(3)
    ...     r = mt.current().rank
    ...     return bn(x[4 * r: 4 * r + 4])
    >>> y = torch.cat(mt.launch(f, mesh="replica:2"))
    >>> torch.allclose(y, torch.nn.BatchNorm2d(3)(x), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from meshtorch.comm.base import as_axes
from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.replicator.channel import channel_for
from meshtorch.replicator.collectives import all_reduce


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over inputs ``(N, C, ...)`` whose statistics span every replica's batch.

    Args:
        num_features: channels ``C``.
        eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm2d``.
        axes: mesh axes of the replicas; default every axis of the current mesh.

    Example:
        >>> import torch, meshtorch as mt
        >>> mt.replicator.SyncBatchNorm(4)(torch.randn(2, 4)).shape
        torch.Size([2, 4])
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 axes: str | Iterable[str] | None = None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.axes = None if axes is None else as_axes(axes)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ShapeError(f"SyncBatchNorm expects input (N, C, ...), got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ShapeError(
                f"SyncBatchNorm({self.num_features}) got {x.shape[1]} channels in input of shape "
                f"{tuple(x.shape)}; channels are tensor dim 1"
            )
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        c = self.num_features
        dims = [0] + list(range(2, x.dim()))
        view = [1, c] + [1] * (x.dim() - 2)
        shift = (self.running_mean if self.running_mean is not None else torch.zeros(c, device=x.device)
                 ).detach().to(x.dtype)
        d = x - shift.view(view)
        local_n = x.numel() // c
        stats = torch.cat([d.sum(dims), (d * d).sum(dims),
                           torch.full((1,), float(local_n), dtype=x.dtype, device=x.device)])
        ctx = current()
        axes = tuple(ctx.mesh.axis_names) if self.axes is None else self.axes
        stats = all_reduce(stats, channel_for(ctx.comm), axes, "sum")
        n = stats[-1].detach()
        mean_d = stats[:c] / n
        var = (stats[c: 2 * c] / n - mean_d * mean_d).clamp_min(0)
        mean = mean_d + shift

        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.detach().to(self.running_var.dtype), factor)

        y = (x - mean.view(view)) * torch.rsqrt(var + self.eps).view(view)
        if self.affine:
            y = y * self.weight.view(view) + self.bias.view(view)
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, axes: str | Iterable[str] | None = None
                               ) -> torch.nn.Module:
        """See :func:`convert_sync_batchnorm`."""
        return convert_sync_batchnorm(module, axes)


def convert_sync_batchnorm(module: torch.nn.Module, axes: str | Iterable[str] | None = None
                           ) -> torch.nn.Module:
    """``module`` with every ``torch.nn.BatchNorm1d/2d/3d`` replaced by a :class:`SyncBatchNorm`
    holding the same parameters and running statistics (returned; children changed in place).

    Example:
        >>> import torch, meshtorch as mt
        >>> m = mt.replicator.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
        >>> type(m[0]).__name__
        'SyncBatchNorm'
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, axes=axes)
        with torch.no_grad():
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            if module.track_running_stats:
                out.running_mean = module.running_mean
                out.running_var = module.running_var
                out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        return out
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, axes)
        if new is not child:
            setattr(module, name, new)
    return module
