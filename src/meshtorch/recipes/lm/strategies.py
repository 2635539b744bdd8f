"""The two steps of the training loop: a plain step, or a pipelined one along a ``stage`` mesh axis.

A strategy resumes from ``--resume``, trains on a window of batches (the steps
between two log or checkpoint steps) and names the module a checkpoint holds.
It is also the step the planner prices: both strategies implement
:class:`meshtorch.plan.program.Step` (model, optimizer, how it is pipelined, ``run``),
and :class:`meshtorch.recipes.lm.steps.TrainingProgram` traces their ``run``
(:func:`strategy_for` picks the strategy for both), so the step planned is the step that trains.

:class:`PipelinedStep` (``--pipeline-stages N``) splits ``--model lm`` by
layers: the mesh gets a ``stage:N`` axis in front unless it has one (so
``--mesh b:2 --pipeline-stages 2`` runs on ``stage:2,b:2``, four processors);
the layout rules are the usual ones and never mention it. ``--schedule
gpipe|1f1b|2bw|zb|interleaved|zbv`` picks the pipeline schedule (``--lr-schedule`` the
learning rate's; ``--virtual-stages v`` model chunks per stage for ``interleaved``, 2 for ``zbv``),
``--microbatches`` the micro-batches per batch. Gradient clipping uses the norm
over all stages (the tied embedding table counted once). A window runs
as one table, so 2BW does not flush inside it. Every processor gathers the whole
model (and optimizer state) from the stages for ``checkpoint/``, the plain
run's format (``meshtorch generate`` and ``--resume`` read it), the held-out
loss and the generated sample. Under 2BW the checkpoint also holds the previous
weight version ``W(t-1)`` (tensors ``model/previous.<name>``, which loading
into the plain LM ignores), so ``--resume`` continues exactly like the
uninterrupted run; a checkpoint without them resumes with ``W(t-1) = W(t)``.

Example:
    >>> from meshtorch.recipes.lm.strategies import pipeline_mesh
    >>> str(pipeline_mesh("b:2", 2)), str(pipeline_mesh("b:2,stage:2", 2))
    ('stage:2,b:2', 'b:2,stage:2')
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

import torch

from meshtorch.compiler import compile_step, graph_breaks
from meshtorch.context import current
from meshtorch.plan.program import Pipelining, Step
from meshtorch.recipes.lm.config import AXIS, TrainConfig, pipeline_mesh  # noqa: F401 - re-exported
from meshtorch.recipes.lm.optimizer import lr_at, optimizer_step
from meshtorch.recipes.lm.run_files import resume_run

PREVIOUS = "previous"  # 2BW's W(t-1) in the checkpoint: tensors model/previous.<name>


class TrainStep(Step, Protocol):
    """What the training loop asks of a strategy: the planner's :class:`~meshtorch.plan.program.Step`
    (``model``, ``opt``, ``pipeline``, ``run``) and what a run around it needs."""

    def resume(self, batches: Any, lead: bool) -> int:
        """Load ``--resume`` (if given); the step to continue from."""

    def banner(self) -> str:
        """The run's first line: what trains on which mesh."""

    def saved(self) -> torch.nn.Module:
        """The module a checkpoint holds now."""

    def summary(self) -> dict[str, Any]:
        """What this strategy adds to ``summary.json``."""


def precision_context(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """bf16 autocast (fp32 master weights) with ``--precision bf16``, else nothing."""
    from meshtorch import amp

    return amp.autocast(torch.bfloat16) if cfg.run.precision == "bf16" else contextlib.nullcontext()


def overlapped(cfg: TrainConfig) -> Any:
    """``mt.overlap`` around a plain step's forward and backward, as ``--overlap`` and
    ``--reshard-after-forward`` say (both on by default; the latter only with the former): the one
    place the trainer switches it. Off under ``--compile`` (the graph schedules its collectives). On the meta
    backend too, so that the planner traces the grouped, asynchronous calls the run makes (and
    prices their overlap: :mod:`meshtorch.plan.timeline`)."""
    from meshtorch.lowering.overlap import overlap

    return overlap(enabled=overlaps(cfg), reshard_after_forward=cfg.parallelism.reshard_after_forward)


def overlaps(cfg: TrainConfig) -> bool:
    """Whether ``cfg``'s plain step runs its parameters' collectives with ``mt.overlap``."""
    par = cfg.parallelism
    return par.overlap and not cfg.run.compile


def _value(loss: Any) -> float:
    """A scalar loss on the host; NaN on the meta backend (a planner's trace: no values)."""
    return float("nan") if loss.local.device.type == "meta" else loss.item()


class PlainStep:
    """Every processor runs ``zero_grad(set_to_none=True)``, forward, backward, clipping and the
    optimizer step of each batch (with ``--compile``, the forward and backward as ``torch.compile``
    graphs)."""

    pipeline: Pipelining | None = None  # an SPMD step: every processor runs all of it

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.cfg, self.model, self.opt = cfg, model, opt
        self.loss = compile_step(model.loss) if cfg.run.compile else model.loss
        # what the clip reads, in the model's order (its norm sums them in it), listed once as
        # the optimizer listed its own: walking the modules each step (torch's generators, a
        # Python frame per module and parameter) was host time a GPU waits for (issue 25)
        self.params = list(model.parameters())

    def resume(self, batches: Any, lead: bool) -> int:
        """Load ``--resume``; the step to continue from."""
        return resume_run(self.cfg, self.model, self.opt, batches, lead)

    def banner(self) -> str:
        cfg = self.cfg
        return (f"model {cfg.model.name}: {self.model.num_parameters():,} parameters; mesh "
                f"'{cfg.parallelism.mesh}' rules '{cfg.parallelism.rules}' backend {cfg.parallelism.backend}"
                + ("; torch.compile (the first step compiles)" if cfg.run.compile else ""))

    def run(self, batches: list, first: int) -> float:
        """Train on ``batches`` (steps ``first``, ``first + 1``, ...); the last one's loss."""
        from meshtorch import optim

        loss = None
        for i, batch in enumerate(batches):
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.cfg, first + i)
            # the step before's gradients go before the forward, as in a plain PyTorch loop: the
            # forward's peak does not carry them (a whole model's, or a shard's under FSDP). Not
            # after the step: they stay readable until the next step starts (and a planner's trace
            # sees mt.overlap's gradients, views of its buckets, when its measured block ends)
            self.opt.zero_grad(set_to_none=True)
            with overlapped(self.cfg):
                with precision_context(self.cfg):
                    loss = self.loss(*batch)
                loss.backward()
            if self.cfg.optimizer.clip:
                optim.clip_grad_norm_(self.params, self.cfg.optimizer.clip)
            optimizer_step(self.opt)
        return _value(loss)

    def saved(self) -> torch.nn.Module:
        """The module the checkpoint holds."""
        return self.model

    def summary(self) -> dict[str, Any]:
        if self.cfg.run.compile:
            return {"compiled": True, "graph_breaks": graph_breaks()}
        on = overlaps(self.cfg)
        return {"overlap": on, "reshard_after_forward": on and self.cfg.parallelism.reshard_after_forward}


def strategy_for(cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 pipelined: bool | None = None) -> TrainStep:
    """The strategy that trains ``model`` with ``opt``: :class:`PipelinedStep` with
    ``--pipeline-stages`` > 1 (or ``pipelined``), else :class:`PlainStep`."""
    if pipelined is None:
        pipelined = cfg.parallelism.pipeline_stages > 1
    return PipelinedStep(cfg, model, opt) if pipelined else PlainStep(cfg, model, opt)


def pipelining(cfg: TrainConfig) -> Pipelining:
    """How :class:`PipelinedStep` pipelines ``cfg``'s step: along ``stage``, ``--schedule``,
    ``--microbatches``, without recomputation."""
    par = cfg.parallelism
    return Pipelining(schedule=par.schedule, microbatches=par.microbatches, axis=AXIS, recompute=False,
                      virtual_stages=par.virtual_stages)


class _Stepper:
    """The pipeline's optimizer: all the pipeline asks of it is ``step()``, here
    :func:`~meshtorch.recipes.lm.optimizer.optimizer_step` (which also steps meta parameters)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt

    def step(self) -> None:
        optimizer_step(self.opt)


def _clip(pipe: Any, max_norm: float) -> None:
    """Scale every stage's gradients so that the norm over the whole model is at most ``max_norm``."""
    from meshtorch.optim.clip import global_grad_norm
    from meshtorch.pipeline.executor import chunks_of
    from meshtorch.pipeline.lm import named_model_parameters, owner_stage

    mod = pipe.module
    cfg = chunks_of(mod)[0].cfg
    # the tied table sits on the first and the last stage with equal gradients: count it once (its owner's)
    params = [p for n, p in named_model_parameters(mod)
              if owner_stage(n, cfg, pipe.num_stages, pipe.virtual_stages) == pipe.stage]
    local = global_grad_norm(params).to(torch.float64) ** 2
    total = current().comm.all_reduce(local.reshape(1), AXIS)[0].sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in mod.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))


def _with_previous(model: torch.nn.Module, previous: torch.nn.Module) -> torch.nn.Module:
    """A module whose parameters are ``model``'s (same names, so the optimizer state keeps its
    names) and ``previous``'s under ``previous.``: what a 2BW checkpoint saves and loads."""
    from meshtorch.nn.module import Module

    both = Module()
    # torch's add_module: Module.add_module would re-derive the children's values from their new paths
    for name, child in [*model.named_children(), (PREVIOUS, previous)]:
        torch.nn.Module.add_module(both, name, child)
    return both


class PipelinedStep:
    """The LM split by layers into stages along the ``stage`` axis; a window is one pipeline table.

    Every processor holds the whole model and an optimizer over it, so the
    checkpoint is the plain run's (any mesh can load it, ``meshtorch generate``
    reads it); a stage trains its share (the others have no gradients, so the
    optimizer skips them).
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer):
        from meshtorch.models import DecoderLM

        self.cfg, self.model, self.opt = cfg, model, opt
        # 2BW: the whole model's W(t-1), gathered from the stages for the checkpoint
        self.previous = DecoderLM(model.cfg, seed=cfg.run.seed) if cfg.parallelism.schedule == "2bw" else None
        self.pipeline: Pipelining | None = pipelining(cfg)
        self.pipe: Any = None

    def resume(self, batches: Any, lead: bool) -> int:
        """Load ``--resume`` (with 2BW's ``W(t-1)`` when it holds one), then build the pipeline."""
        from meshtorch.checkpoint.index import read_index
        from meshtorch.pipeline.lm import lm_pipeline, restore_previous

        cfg = self.cfg
        resumed_previous = bool(cfg.run.resume) and self.previous is not None and any(
            k.startswith(f"model/{PREVIOUS}.")
            for k in read_index(os.path.join(cfg.run.resume, "checkpoint"))["tensors"])
        start = resume_run(cfg, self.model, self.opt, batches, lead,
                           saved=_with_previous(self.model, self.previous) if resumed_previous else None)
        how = pipelining(cfg)  # what this step declares to the planner (self.pipeline) is what it builds
        pipe = lm_pipeline(self.model.cfg, model=self.model, axis=how.axis, microbatches=how.microbatches,
                           schedule=how.schedule, recompute=how.recompute, virtual_stages=how.virtual_stages)
        pipe.optimizer, pipe.batches_trained = _Stepper(self.opt), start
        if resumed_previous:
            restore_previous(pipe, self.previous)
        if cfg.optimizer.clip:
            sync = pipe.after_backward

            def after_backward() -> None:
                sync()
                _clip(pipe, cfg.optimizer.clip)

            pipe.after_backward = after_backward

        def set_lr(t: int) -> None:
            for g in self.opt.param_groups:
                g["lr"] = lr_at(cfg, t)

        pipe.before_step = set_lr
        self.pipe = pipe
        return start

    def banner(self) -> str:
        chunks = f" × {self.pipe.virtual_stages} chunks" if self.pipe.virtual_stages > 1 else ""
        return (f"pipeline of {self.pipe.num_stages} stages{chunks} ({self.pipe.schedule.name}, "
                f"{self.cfg.parallelism.microbatches} micro-batches) on mesh '{current().mesh}' "
                f"rules '{self.cfg.parallelism.rules}'")

    def run(self, batches: list, first: int) -> float:
        """Train on ``batches`` as one pipeline table; the last one's loss."""
        with precision_context(self.cfg):
            return self.pipe.train(batches)[-1]

    def saved(self) -> torch.nn.Module:
        """The whole model gathered from the stages (and 2BW's ``W(t-1)``): what the checkpoint holds."""
        from meshtorch.pipeline.lm import gather_whole

        gather_whole(self.pipe, self.model, self.opt, self.previous)
        return self.model if self.previous is None else _with_previous(self.model, self.previous)

    def summary(self) -> dict[str, Any]:
        return {"schedule": self.pipe.schedule.name, "pipeline_stages": self.pipe.num_stages,
                "virtual_stages": self.pipe.virtual_stages,
                "microbatches": self.cfg.parallelism.microbatches}
