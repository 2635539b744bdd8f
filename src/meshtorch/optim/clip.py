"""Global gradient norm and clipping: each element counted once, whatever the layout.

A gradient split over axes ``S`` and replicated over the others contributes
its local sum of squares, summed over ``S`` with one ``all_reduce``; the
replicated copies are not counted again. All the parts share one collective
per mesh axis (:mod:`meshtorch.lowering.fused`), whatever the layouts.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     w = mt.from_global(torch.tensor([3.0, 4.0]), "d:2", requires_grad=True)
    ...     mt.reduce_sum(w * w).backward()   # grad = [6, 8]
    ...     norm = mt.optim.clip_grad_norm_([w], 5.0).item()
    ...     return norm, [round(v, 4) for v in w.grad.to_global().tolist()]
    >>> mt.launch(f, mesh="m:2", rules="d:m")[0]
    (10.0, [3.0, 4.0])
"""

from __future__ import annotations

import math

import torch

from meshtorch.context import current
from meshtorch.errors import MeshTorchError
from meshtorch.lowering.fused import Fused
from meshtorch.optim.params import Params, layouts_of


def global_grad_norm(params: Params, norm_type: float | str = 2.0) -> torch.Tensor:
    """The norm of all gradients as one global vector; the same on every processor."""
    return _global_grad_norm([(p, lay) for p, lay in layouts_of(params) if p.grad is not None],
                             float(norm_type))


def _global_grad_norm(grads_layouts, norm_type: float) -> torch.Tensor:
    if not grads_layouts:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    if any([layout.split for _, layout in grads_layouts]):
        axis_names = current().mesh.axis_names
        for p, layout in grads_layouts:
            axes = tuple([a for a in axis_names if layout.dim_of(a) is not None]) if layout.split else ()
            groups.setdefault(axes, []).append(p.grad)
    else:
        # every gradient replicated (all of them on one processor): one group, listed without
        # per-parameter calls, host time per step that a GPU waits for at small sizes (issue 25)
        groups[()] = [p.grad for p, _ in grads_layouts]
    by_axes: dict[tuple[str, ...], torch.Tensor] = {}
    for axes, grads in groups.items():
        # one multi-tensor kernel per group, accumulating in float64 (as the per-tensor loop did)
        if inf:
            # the max has no identity: an empty piece (an uneven layout's) would make
            # _foreach_norm raise on this processor alone, and the others wait at the collective
            device, grads = grads[0].device, [g for g in grads if g.numel()]
            if not grads:
                by_axes[axes] = torch.zeros((), dtype=torch.float64, device=device)
                continue
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float64))
        by_axes[axes] = norms.max() if inf else norms.pow(norm_type).sum()
    if len(by_axes) == 1 and () in by_axes:
        # every gradient replicated (one processor, or no split parameter): nothing to reduce,
        # the part is the total as Fused would hand it back (no collective, no bucketing)
        total = by_axes[()]
        return (total if inf else total.pow(1.0 / norm_type)).to(torch.float32)
    # one collective per axis for all the groups together (not one per group)
    fused = Fused()
    for axes in sorted(by_axes):
        fused.partial(by_axes[axes], axes, "max" if inf else "sum")
    total = None  # parts are >= 0 (or NaN): starting from the first equals starting from 0
    for part in fused.run():
        total = part if total is None else torch.maximum(total, part) if inf else total + part
    norm = total if inf else total.pow(1.0 / norm_type)
    return norm.to(torch.float32)


def clip_grad_norm_(params: Params, max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm``, in place.

    Like ``torch.nn.utils.clip_grad_norm_`` on the dense model; returns the norm
    before clipping. Every processor must call it (it communicates).

    It reads no value back to the host (no sync with a GPU): the norm stays a tensor, and a
    non-finite one makes the gradients non-finite, which the loss shows. Check the returned
    norm where the training loop logs, not every step; ``error_if_nonfinite=True`` reads the
    norm on every call to raise at once (a host sync each step on a GPU, as torch's does).
    """
    norm_type = float(norm_type)  # (torch's takes "inf" too)
    views = [(p, lay) for p, lay in layouts_of(params) if p.grad is not None]
    total = _global_grad_norm(views, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise MeshTorchError(f"the global gradient {norm_type}-norm is {total.item()}; "
                             "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [p.grad for p, _ in views]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    if len({g.dtype for g in grads}) == 1:  # (the usual case, without per-gradient calls)
        by_dtype[grads[0].dtype] = grads
    else:
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
    with torch.no_grad():  # (gradients are data here, as in torch.nn.utils.clip_grad_norm_)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))
    return total
