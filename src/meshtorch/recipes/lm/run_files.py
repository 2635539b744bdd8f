"""A run directory's checkpoint and metrics: what ``--resume`` continues from.

Example:
    >>> import tempfile
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.run_files import earlier_metrics
    >>> earlier_metrics(TrainConfig(), tempfile.mkdtemp(), start=0)
    []
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from meshtorch.recipes.lm.config import TrainConfig


def resume_run(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Any, lead: bool,
               saved: torch.nn.Module | None = None) -> int:
    """Load ``--resume``'s checkpoint into ``model`` (or ``saved``, see :func:`save_run`),
    ``opt`` and ``batches``; return the step to continue from (0 without ``--resume``)."""
    from meshtorch import checkpoint

    if not cfg.run.resume:
        return 0
    state = checkpoint.load(os.path.join(cfg.run.resume, "checkpoint"),
                            model=model if saved is None else saved, optimizer=opt, data=batches)
    start = int(state["step"])
    if lead:
        print(f"resumed from {cfg.run.resume} at step {start}")
    return start


def save_run(cfg: TrainConfig, out: str, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: Any,
             step: int, saved: torch.nn.Module | None = None) -> None:
    """Write ``out/checkpoint``; ``saved`` (default ``model``) is the module whose parameters
    are written, e.g. one that holds ``model``'s under the same names and more besides."""
    from meshtorch import checkpoint

    extra = {"model_config": model.cfg.to_dict(), "train_config": cfg.options(), "model": cfg.model.name}
    checkpoint.save(os.path.join(out, "checkpoint"), model=model if saved is None else saved, optimizer=opt,
                    step=step, data=batches, extra=extra)


def earlier_metrics(cfg: TrainConfig, out: str, start: int) -> list[dict]:
    """Create ``out``; return the ``--resume`` run's metrics records up to step ``start``."""
    os.makedirs(out, exist_ok=True)
    resume = cfg.run.resume
    if resume and os.path.exists(os.path.join(resume, "metrics.jsonl")):
        with open(os.path.join(resume, "metrics.jsonl")) as f:
            return [m for m in map(json.loads, f) if m["step"] <= start]
    return []
