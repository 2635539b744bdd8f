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

from meshtorch.errors import ArgumentError, MeshTorchError
from meshtorch.recipes.lm.config import TrainConfig


def check_resume(cfg: TrainConfig, error: type[MeshTorchError] = MeshTorchError) -> int:
    """The step of ``--resume``'s checkpoint, checked against ``--steps`` before anything runs.

    ``--steps`` is the total the run trains to, so resuming continues from the checkpoint's
    step to ``--steps``; fewer steps than the checkpoint holds is an error.
    """
    from meshtorch.checkpoint.index import read_index

    run = cfg.run
    if not os.path.isdir(os.path.join(run.resume, "checkpoint")):
        raise error(f"--resume {run.resume!r} has no checkpoint/ directory; pass the --out "
                    "directory of an earlier run")
    saved = read_index(os.path.join(run.resume, "checkpoint"))["step"]
    if saved is None:
        raise error(f"the checkpoint in --resume {run.resume!r} records no step; it was not written by "
                    "meshtorch train")
    if run.steps < saved:
        raise ArgumentError(f"--steps {run.steps} is less than step {saved} of the checkpoint in --resume "
                            f"{run.resume!r}: --steps is the total number of steps the run trains to, and "
                            f"a resumed run continues from step {saved}; pass --steps {saved} or more "
                            f"(e.g. --steps {saved + run.steps} to train {run.steps} more)")
    return saved


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
             step: int, saved: torch.nn.Module | None = None, background: bool = False) -> None:
    """Write a new version of ``out/checkpoint`` at ``step`` (the step the run is at; ``--keep``
    versions are kept); ``saved`` (default ``model``) is the module whose parameters
    are written, e.g. one that holds ``model``'s under the same names and more besides.
    ``background``: write the files on a thread (``mt.save(..., background=True)``)."""
    from meshtorch import checkpoint
    from meshtorch.recipes.lm.guards import check_weights

    check_weights(model if saved is None else saved, step)  # never a checkpoint of NaN weights
    extra = {"model_config": model.cfg.to_dict(), "train_config": cfg.options(), "model": cfg.model.name}
    checkpoint.save(os.path.join(out, "checkpoint"), model=model if saved is None else saved, optimizer=opt,
                    step=step, data=batches, extra=extra, keep=cfg.run.keep, background=background)


def earlier_metrics(cfg: TrainConfig, out: str, start: int) -> list[dict]:
    """Create ``out``; return the ``--resume`` run's metrics records up to step ``start``."""
    os.makedirs(out, exist_ok=True)
    resume = cfg.run.resume
    path = os.path.join(resume or "", "metrics.jsonl")
    if not resume or not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line) if line.strip() else None
        except ValueError as e:
            if i == len(lines) - 1:  # no newline after it: cut short by a crash while it was written
                break
            raise MeshTorchError(f"{path} line {i + 1} is not a JSON record ({e}); fix or delete that "
                                 "line to resume") from e
        if rec is None:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise MeshTorchError(f"{path} line {i + 1} is not a metrics record with an integer 'step': "
                                 f"{line[:80]!r}; fix or delete that line to resume")
        if rec["step"] <= start:
            records.append(rec)
    return records
