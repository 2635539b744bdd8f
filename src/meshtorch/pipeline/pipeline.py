"""``Pipeline``: a model split into stages, run along a mesh axis.

Every processor runs the same program (SPMD) and builds the same
``Pipeline``; a processor keeps the stage its coordinate on ``axis`` names
and runs its row of the schedule table (:mod:`~meshtorch.pipeline.executor`).
Other mesh axes compose: processors that differ only in another axis hold
the same stage, either as data-parallel replicas (plain ``torch.nn`` stages:
gradients are averaged over those axes) or as the model/data-parallel
processors of a stage written with MeshTensors (the layout rules, which
never mention the pipeline axis, split its dims; its collectives already
produce the right gradients). So the mesh ``stage:4,b:2`` is 3-D parallelism.

Schedules (``schedule=``): ``"gpipe"`` and ``"1f1b"`` are synchronous: after
a step, the parameters are those of training the unsplit model on the whole
batch (the loss being a mean over each micro-batch, all of equal size).
``"2bw"`` is PipeDream-2BW (Narayanan et al., ICML 2021): each stage keeps
two weight versions; the gradient of batch ``t``, coalesced over its ``m``
micro-batches, is computed with the weights of one step before and applied
to the current ones: ``W(t+1) = W(t) - ν·∇f(W(t-1))`` for SGD (the optimizer
turns the delayed gradient into its update), with ``W(-1) = W(0)``. Batches are
flushed between steps here, so 2BW runs the 1F1B table and keeps its memory
bound (two weight versions, at most ``p - s`` stashed micro-batches on stage
``s``).

Example:
    >>> import copy, torch, meshtorch as mt
    >>> from meshtorch.pipeline import Pipeline
    >>> _ = torch.manual_seed(0)
    >>> stages = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), torch.nn.Linear(8, 1)]
    >>> x, y = torch.randn(16, 4), torch.randn(16, 1)
    >>> def train():
    ...     pipe = Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=4, schedule="1f1b",
    ...                     loss_fn=torch.nn.functional.mse_loss,
    ...                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    ...     return [round(pipe.step(x, y), 4) for _ in range(3)]
    >>> a, b = mt.launch(train, mesh="stage:2")
    >>> a == b and a[2] < a[0]
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.errors import PipelineError
from meshtorch.nn.module import mesh_shape
from meshtorch.pipeline.executor import Executor
from meshtorch.pipeline.schedule import SCHEDULES, Schedule
from meshtorch.pipeline.schedule import build as build_schedule
from meshtorch.shape import Dim
from meshtorch.tensor import MeshTensor, layout_for

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def split_microbatches(value: Any, m: int, batch_dim: str = "batch") -> list[Any]:
    """``value`` cut into ``m`` equal micro-batches: tensors along dim 0, MeshTensors
    along ``batch_dim`` (each processor cuts its own slice, so no data moves),
    tuples leaf by leaf, ``None`` stays ``None``.

    Example:
        >>> import torch
        >>> [t.tolist() for t in split_microbatches(torch.arange(4), 2)]
        [[0, 1], [2, 3]]
    """
    if value is None:
        return [None] * m
    if isinstance(value, tuple):
        cols = [split_microbatches(v, m, batch_dim) for v in value]
        return [tuple(c[i] for c in cols) for i in range(m)]
    if isinstance(value, MeshTensor):
        if batch_dim not in value.shape:
            raise PipelineError(f"cannot cut a MeshTensor of shape [{value.shape}] into micro-batches: it "
                                f"has no {batch_dim!r} dim; pass batch_dim=<its batch dim>")
        k = value.shape.index(batch_dim)
        n = value.local.shape[k]
        if n % m:
            raise PipelineError(f"dim {batch_dim!r} has {n} entries per processor, not divisible into {m} "
                                "micro-batches; change the batch size or microbatches")
        shape = value.shape.replace(batch_dim, Dim(batch_dim, value.shape[batch_dim].size // m))
        layout = layout_for(shape)
        return [MeshTensor(c, shape, layout) for c in value.local.chunk(m, k)]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % m:
            raise PipelineError(f"a tensor of shape {list(value.shape)} cannot be cut into {m} equal "
                                "micro-batches along dim 0; change the batch size or microbatches")
        return list(value.chunk(m, 0))
    raise PipelineError(f"pipeline inputs are tensors, MeshTensors, None or tuples, got "
                        f"{type(value).__name__}")


def _stage_modules(stages, placement) -> Callable[[int], Any]:
    if placement is not None:
        if not isinstance(stages, torch.nn.Module):
            raise PipelineError("with a placement, pass the whole module (traced or traceable by torch.fx)")
        from meshtorch.placement.trace import split

        gm = stages if isinstance(stages, torch.fx.GraphModule) else torch.fx.symbolic_trace(stages)
        parts = split(gm, placement)
        return lambda i: getattr(parts, f"submod_{i}")
    if callable(stages) and not isinstance(stages, (torch.nn.Module, Sequence)):
        return stages  # a factory: build only this processor's stage
    if isinstance(stages, Sequence):
        return lambda i: stages[i]
    raise PipelineError("stages must be a sequence of modules (one per stage), a function of the stage "
                        "index, or a module together with a placement")


def _num_stages(stages, placement) -> int | None:
    if placement is not None:
        return len(placement.stages)
    return len(stages) if isinstance(stages, Sequence) else None


class Pipeline:
    """A model split into stages along mesh axis ``axis``.

    Args:
        stages: one module (or callable) per stage, a function ``i -> stage i``
            (builds only this processor's stage), or a whole module with
            ``placement`` (a contiguous :class:`~meshtorch.placement.Placement`;
            the module is cut with :func:`meshtorch.placement.trace.split`).
            Each stage takes the previous stage's output (a tuple is unpacked
            into arguments); stage 0 takes the micro-batch of ``inputs``.
        placement: see ``stages``.
        axis: the mesh axis the stages lie along (its size = number of stages).
        microbatches: ``m``, micro-batches per batch.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"2bw"`` (module docstring).
        loss_fn: ``loss_fn(last_stage_output, target)``: a scalar mean over the
            micro-batch (tensor or MeshTensor).
        optimizer: ``params -> torch.optim.Optimizer`` for this stage's
            parameters (needed by :meth:`step`).
        recompute: activation recomputation (stash stage inputs only).
        data_axes: axes over which processors are data-parallel replicas of
            the pipeline: gradients of plain parameters are averaged over them.
            ``"auto"``: every other mesh axis for plain parameters; parameters of
            ``mt.nn`` modules are left alone (their layouts already reduce them).
        batch_dim: the dim MeshTensor inputs are cut into micro-batches along.
    """

    def __init__(self, stages: Sequence[Any] | Callable[[int], Any] | torch.nn.Module,
                 placement: Any = None, *, axis: str = "stage", microbatches: int = 1,
                 schedule: str = "1f1b", loss_fn: Callable | None = None,
                 optimizer: OptimizerFactory | None = None, recompute: bool = False,
                 data_axes: str | Sequence[str] = "auto", batch_dim: str = "batch"):
        ctx = current()
        if schedule not in SCHEDULES:
            raise PipelineError(f"schedule {schedule!r} is not one of {SCHEDULES}")
        if axis not in ctx.mesh.axis_names:
            raise PipelineError(f"the pipeline axis {axis!r} is not an axis of the mesh '{ctx.mesh}'; "
                                f"use a mesh like '{axis}:2,...' or pass axis=<one of "
                                f"{list(ctx.mesh.axis_names)}>")
        p = ctx.mesh.axis_size(axis)
        n = _num_stages(stages, placement)
        if n is not None and n != p:
            raise PipelineError(f"{n} stages but axis {axis!r} has {p} processors; split the model into {p} "
                                f"stages or use a mesh with '{axis}:{n}'")
        self.axis, self.stage, self.num_stages = axis, ctx.coords[axis], p
        self.schedule: Schedule = build_schedule(schedule, p, microbatches)
        self.microbatches, self.batch_dim = microbatches, batch_dim
        self.module = _stage_modules(stages, placement)(self.stage)
        self.executor = Executor(self.module, axis, loss_fn, recompute)
        others = tuple(a for a in ctx.mesh.axis_names if a != axis)
        self.data_axes = others if data_axes == "auto" else (data_axes,) if isinstance(data_axes, str) \
            else tuple(data_axes)
        self._auto = data_axes == "auto"
        params = self.parameters()
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self._stale: list[torch.Tensor] | None = None  # 2BW: the weights of one step before
        # called on every processor after the backward, before replicas average: e.g. to sum the
        # gradient of a parameter two stages share (tied embeddings)
        self.after_backward: Callable[[], None] | None = None

    def parameters(self) -> list[torch.nn.Parameter]:
        """This processor's stage's parameters."""
        mod = self.module
        return list(mod.parameters()) if isinstance(mod, torch.nn.Module) else []

    @property
    def trace(self) -> list[tuple[str, int, float, float]]:
        """``(kind, micro-batch, start, end)`` of each action of the last step, as executed."""
        return self.executor.trace

    def _average_over_replicas(self) -> None:
        axes = tuple(a for a in self.data_axes if current().mesh.axis_size(a) > 1)
        if not axes:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None
                 and not (self._auto and mesh_shape(p) is not None)]
        if not grads:
            return
        comm = current().comm
        n = len(comm.group(axes))
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), axes) / n
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _split(self, inputs: Any, targets: Any) -> tuple[list | None, list | None]:
        m = self.microbatches
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        return (split_microbatches(inputs, m, self.batch_dim) if first else None,
                split_microbatches(targets, m, self.batch_dim) if last else None)

    def _batch_loss(self, total: torch.Tensor | None) -> float:
        comm = current().comm
        loss = torch.zeros(1, dtype=torch.float64) if total is None else total.to(torch.float64).reshape(1)
        loss = comm.broadcast(loss, self.axis, src=self.num_stages - 1)
        # replicas of plain stages saw different data; a MeshTensor loss is the same on all (a no-op)
        axes = tuple(a for a in self.data_axes if current().mesh.axis_size(a) > 1)
        if axes:
            loss = comm.all_reduce(loss, axes) / len(comm.group(axes))
        return float(loss.item())

    def loss(self, inputs: Any = None, targets: Any = None) -> float:
        """The batch loss without gradients (the forwards of the table only): for evaluation."""
        return self._batch_loss(self.executor.run(self.schedule, *self._split(inputs, targets), train=False))

    def forward_backward(self, inputs: Any = None, targets: Any = None) -> float:
        """Run one batch through the schedule and accumulate this stage's gradients
        (no optimizer step, no weight versions). ``inputs`` matter on stage 0 and
        ``targets`` on the last stage. Returns the batch loss on every processor
        (the mean of the micro-batch losses, averaged over data-parallel replicas)."""
        total = self.executor.run(self.schedule, *self._split(inputs, targets))
        if self.after_backward is not None:
            self.after_backward()
        self._average_over_replicas()
        return self._batch_loss(total)

    def step(self, inputs: Any = None, targets: Any = None) -> float:
        """One training step: zero gradients, :meth:`forward_backward`, optimizer
        step (under ``"2bw"``: gradients at the previous weights, applied to the
        current ones). Returns the batch loss."""
        if self.optimizer is None and self.parameters():
            raise PipelineError("Pipeline.step needs optimizer=<params -> torch.optim.Optimizer>; or call "
                                "forward_backward() and step your own optimizer")
        params = self.parameters()
        for p in params:
            p.grad = None
        if self.schedule.name != "2bw":
            loss = self.forward_backward(inputs, targets)
            if self.optimizer is not None:
                self.optimizer.step()
            return loss
        if self._stale is None:
            self._stale = [p.detach().clone() for p in params]  # W(-1) = W(0)
        with torch.no_grad():
            current_w = [p.data for p in params]
            for p, w in zip(params, self._stale):
                p.data = w  # compute the gradient at W(t-1)
        try:
            loss = self.forward_backward(inputs, targets)
        finally:
            with torch.no_grad():
                for p, w in zip(params, current_w):
                    p.data = w
        with torch.no_grad():
            for old, w in zip(self._stale, current_w):
                old.copy_(w)  # W(t) becomes the version the next batch computes with
        if self.optimizer is not None:
            self.optimizer.step()  # W(t+1) from W(t) and ∇f(W(t-1))
        return loss
