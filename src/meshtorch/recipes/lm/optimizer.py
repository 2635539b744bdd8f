"""The optimizer of ``meshtorch train`` and its learning-rate schedule.

Example:
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.optimizer import lr_at
    >>> cfg = TrainConfig.of(lr=1.0, warmup=2, steps=12)
    >>> [round(lr_at(cfg, s), 2) for s in (0, 1, 2, 12)]
    [0.5, 1.0, 1.0, 0.1]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from meshtorch.recipes.lm.config import TrainConfig


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``model``: AdamW with weight-decay groups, or Adafactor.

    On CUDA AdamW is torch's fused one: one kernel for all parameters, and its step counters
    stay on the GPU where the kernel reads them, so a step makes no host sync (the for-each
    AdamW reads a counter per parameter with ``.item()``, a sync each where the counters are on
    the GPU). On the host it stays the for-each AdamW: fused results differ from it in the last
    bit, and a host read is no sync there. The planner's meta parameters stand for the device
    the plan prices (:func:`meshtorch.plan.tracing.device_type`): a plan for a GPU traces the
    fused AdamW (one ``_fused_adamw_`` per parameter group), one for the host the for-each one.
    """
    from meshtorch import optim

    if cfg.optimizer.name == "adafactor":
        return optim.Adafactor(model, lr=cfg.optimizer.lr)
    groups = optim.weight_decay_groups(model, cfg.optimizer.weight_decay)
    from meshtorch.plan.tracing import device_type

    first = next(model.parameters())
    fused = device_type(first) == "cuda" and (first.device.type != "meta" or _FUSED_CHECKS is not None)
    return torch.optim.AdamW(groups, lr=cfg.optimizer.lr, betas=(0.9, 0.99), fused=fused or None)


def optimizer_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``, also on meta parameters (a planner's trace of the step): a fused AdamW
    checks its parameters' device first and refuses meta, which :func:`_fused_on_meta` lets
    through. (Its step counters are host tensors there as in a run: the meta backend leaves
    ``torch.optim``'s factories torch's own default device, :mod:`meshtorch.launcher.meta`.)
    """
    # the first parameter says where the step runs, read without listing them all
    # (host time per step, which a GPU waits for at small sizes: issue 25)
    groups = opt.param_groups
    first = groups[0]["params"] if groups else ()
    if not first:  # an empty first group: the first parameter of any
        first = [p for g in groups for p in g["params"]]
    if not first or first[0].device.type != "meta":
        opt.step()
        return
    with _fused_on_meta(opt):
        opt.step()


def _fused_checks() -> list[Any] | None:
    """The torch modules whose optimizers refuse a fused step on meta parameters (they call
    ``torch.optim.optimizer._device_dtype_check_for_fused``, a private function); None where this
    torch has none (then a meta trace keeps the for-each AdamW: its kernels, not the fused one)."""
    import torch.optim.adam as adam
    import torch.optim.adamw as adamw

    found = [m for m in (adam, adamw) if hasattr(m, "_device_dtype_check_for_fused")]
    return found or None


_FUSED_CHECKS = _fused_checks()


@contextlib.contextmanager
def _fused_on_meta(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Let a fused optimizer step on meta parameters: torch's ``_fused_adamw_`` has a meta kernel,
    but ``AdamW`` checks the parameters' device first (for CUDA, CPU...) and refuses meta."""
    if not _FUSED_CHECKS or not any(g.get("fused") for g in opt.param_groups):
        yield
        return
    saved = [m._device_dtype_check_for_fused for m in _FUSED_CHECKS]

    def check(p: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if p.device.type != "meta":
            saved[0](p, *args, **kwargs)

    for m in _FUSED_CHECKS:
        m._device_dtype_check_for_fused = check
    try:
        yield
    finally:
        for m, f in zip(_FUSED_CHECKS, saved):
            m._device_dtype_check_for_fused = f


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth (or constant with ``lr_schedule="constant"``)."""
    o = cfg.optimizer
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    if o.lr_schedule == "constant":
        return o.lr
    frac = (step - o.warmup) / max(1, cfg.run.steps - o.warmup)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
