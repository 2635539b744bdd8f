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

Schedules (``schedule=``): ``"gpipe"``, ``"1f1b"``, ``"zb"`` (ZB-H1: the
backward split into the input gradient and the deferred weight gradient) and
``"interleaved"`` (interleaved 1F1B: ``virtual_stages=v`` model chunks per
stage, chunk ``c`` on stage ``c mod p``) and ``"zbv"`` (ZB-V: ``virtual_stages=2``,
chunks ``s`` and ``2p-1-s`` on stage ``s``, the split backward) are synchronous: after a step, the
parameters are those of training the unsplit model on the whole batch (the
loss being a mean over each micro-batch, all of equal size).
``"2bw"`` is PipeDream-2BW (Narayanan et al., ICML 2021): each stage keeps
two weight versions; the gradient of batch ``t``, coalesced over its ``m``
micro-batches, is computed with the weights of one step before and applied
to the current ones: ``W(t+1) = W(t) - ν·∇f(W(t-1))`` for SGD (the optimizer
turns the delayed gradient into its update), with ``W(-1) = W(0)``.

:meth:`Pipeline.train` runs a list of batches as one table: under 2BW without
flushes (batch ``t+1`` enters while batch ``t`` drains: the paper's steady
state), under GPipe/1F1B flushed between batches. :meth:`Pipeline.step` is
``train`` of one batch. State between calls: the module holds the newest
weights ``W(t)`` (``t`` = batches trained so far); under 2BW the pipeline also
keeps ``W(t-1)``, which the next batch computes with, so the values after
``train(a); train(b)``, ``train(a + b)`` and one ``step`` per batch are the
same; only the drains between calls differ. Changing the module's weights
from outside (loading a checkpoint) must be followed by
:meth:`Pipeline.set_weight_versions`.

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

import copy
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from meshtorch.comm.base import all_texts
from meshtorch.context import current
from meshtorch.errors import PipelineError
from meshtorch.nn.parameter import MeshParameter
from meshtorch.pipeline.executor import Executor, refuse_inference_mode
from meshtorch.pipeline.schedule import LOOP, SCHEDULES, Schedule, model_chunk_of
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


# torch.fx's tracer patches nn.Module.__call__ for every thread while it runs: thread-processors trace
# one at a time, and none runs a stage before all have traced (a barrier)
_TRACE_LOCK = threading.Lock()


def _is_sequence(stages: Any) -> bool:
    return isinstance(stages, (Sequence, torch.nn.ModuleList))


def _stage_modules(stages, placement) -> Callable[[int], Any]:
    """Model chunk ``i`` (stage ``i`` without virtual stages) of what :class:`Pipeline` was given."""
    if placement is not None:
        if not isinstance(stages, torch.nn.Module):
            raise PipelineError("with a placement, pass the whole module (traced or traceable by torch.fx)")
        from meshtorch.placement.trace import split

        traced = not isinstance(stages, torch.fx.GraphModule)
        with _TRACE_LOCK:
            parts = split(torch.fx.symbolic_trace(stages) if traced else stages, placement)
        if traced:
            current().comm.barrier()
        return lambda i: getattr(parts, f"submod_{i}")
    if callable(stages) and not isinstance(stages, (torch.nn.Module, Sequence)):
        return stages  # a factory: build only this processor's stage (its chunks)
    if _is_sequence(stages):
        return lambda i: stages[i]
    if isinstance(stages, torch.nn.Module):
        raise PipelineError(f"stages is one {type(stages).__name__} and no placement: pass one module per "
                            "stage (e.g. list(model) for an nn.Sequential whose items are the stages), a "
                            "function of the stage index, or the whole module with placement=place(...)")
    raise PipelineError("stages must be a sequence of modules (one per stage), a function of the stage "
                        "index, or a module together with a placement")


def _num_stages(stages, placement) -> int | None:
    if placement is not None:
        return len(placement.stages)
    return len(stages) if _is_sequence(stages) else None


def _held(module: Any, chunks: list[int]) -> list[list]:
    """``[id, model chunk, name, trainable]`` of each parameter and buffer of ``module``, a stage
    holding model chunks ``chunks`` (one chunk: the module itself; more: a list of them)."""
    rows = []
    for c, chunk in zip(chunks, module if len(chunks) > 1 else [module]):
        if isinstance(chunk, torch.nn.Module):
            rows += [[id(p), c, name, p.requires_grad] for name, p in chunk.named_parameters()]
            rows += [[id(b), c, name, False] for name, b in chunk.named_buffers()]
    return rows


def _own_on_threads(module: Any, chunks: list[int], axis: str) -> Any:
    """``module`` (this stage's model chunks ``chunks``), or a copy of it where it is another
    thread-processor's too (every processor calls it, on the threads backend).

    Thread-processors share one process, so the stage objects of a list, of a module placed and
    traced on each thread, or of a factory returning the same module, are the same objects on every
    processor that holds that stage: data-parallel replicas would each step them with their own
    optimizer. Each replica but the first gets its own deep copy instead, made before anyone trains
    (equal to the first's, as processes' copies are). A trainable parameter in the chunks of two
    stages would be stepped by both stages' optimizers: that is refused.
    """
    ctx = current()
    tables = [json.loads(t) for t in all_texts(ctx.comm, json.dumps(_held(module, chunks)))]
    first: dict[int, tuple[int, int, str]] = {}  # id -> (rank, model chunk, name) of its first holder
    copying: set[int] = set()
    for rank, rows in enumerate(tables):
        stage = ctx.mesh.coords(rank)[axis]
        for key, c, name, trainable in rows:
            r0, c0, name0 = first.setdefault(key, (rank, c, name))
            if r0 == rank:  # this processor's own chunks may share (ZB-V's chunks 0 and 2p-1: a tied table)
                continue
            s0 = ctx.mesh.coords(r0)[axis]
            if s0 == stage:
                copying.add(rank)
            elif trainable:
                raise PipelineError(
                    f"parameter {name!r} of model chunk {c} (stage {stage}) is also {name0!r} of model chunk "
                    f"{c0} (stage {s0}): on the threads backend the stages run in one process, so both "
                    "stages' optimizers would step the one tensor. Give each stage its own copy "
                    "(Pipeline(lambda i: copy.deepcopy(stages[i]), ...)) and sum the shared parameter's "
                    "gradient over the stages in pipe.after_backward (docs/pipeline.md, 'Weights shared by "
                    "stages')")
    if ctx.rank in copying:
        module = copy.deepcopy(module)
    if copying:  # nobody changes the originals (trains, loads) before every copy is made
        ctx.comm.barrier()
    return module


def stage_chunks(build: Callable[[int], Any], stage: int, stages: int, virtual_stages: int = 1,
                 placement: str = LOOP) -> Any:
    """What stage ``stage`` of ``stages`` runs: model chunk ``stage`` of ``build``, or with
    ``virtual_stages`` v > 1 its chunks ``stage, stage + p, ..., stage + (v-1)p`` (model chunk
    ``c`` on stage ``c mod p``; under ``placement="v"``, ZB-V's, chunks ``stage`` and
    ``2p-1-stage``) as an ``nn.ModuleList`` (a list if they are not modules).

    Example:
        >>> stage_chunks(lambda c: c, 1, 2, 3), stage_chunks(lambda c: c, 0, 2, 2, "v")
        ([1, 3, 5], [0, 3])
    """
    if virtual_stages == 1:
        return build(stage)
    chunks = [build(model_chunk_of(stage, k, stages, placement)) for k in range(virtual_stages)]
    return torch.nn.ModuleList(chunks) if all(isinstance(c, torch.nn.Module) for c in chunks) else chunks


class Pipeline:
    """A model split into stages along mesh axis ``axis``.

    Args:
        stages: one module (or callable) per stage (a list, tuple or ``nn.ModuleList``),
            a function ``i -> stage i`` (builds only this processor's stage), or a
            whole module with ``placement`` (a contiguous
            :class:`~meshtorch.placement.Placement`; the module is cut with
            :func:`meshtorch.placement.trace.split`). Each stage takes the
            previous stage's output (a tuple is unpacked into arguments); stage 0
            takes the micro-batch of ``inputs``. On the threads backend a trainable
            parameter must not be in two stages, and replicas given one stage
            object each train their own copy of it (docs/pipeline.md).
        placement: see ``stages``.
        axis: the mesh axis the stages lie along (its size = number of stages).
        microbatches: ``m``, micro-batches per batch.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"2bw"``, ``"zb"``, ``"interleaved"`` or
            ``"zbv"`` (module docstring).
        virtual_stages: ``v`` model chunks per stage (``"interleaved"``; 2 for ``"zbv"``):
            ``stages`` then holds ``p·v`` model chunks (a sequence, or a function of the model
            chunk index) and model chunk ``c`` runs on stage ``c mod p`` (under ``"zbv"``: chunks
            ``s`` and ``2p-1-s`` on stage ``s``); :attr:`module` is the stage's ``nn.ModuleList``
            of its ``v`` chunks, and :attr:`last_stage` the stage that applies the loss.
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
                 data_axes: str | Sequence[str] = "auto", batch_dim: str = "batch", virtual_stages: int = 1):
        ctx = current()
        if schedule not in SCHEDULES:
            raise PipelineError(f"schedule {schedule!r} is not one of {SCHEDULES}")
        if axis not in ctx.mesh.axis_names:
            raise PipelineError(f"the pipeline axis {axis!r} is not an axis of the mesh '{ctx.mesh}'; "
                                f"use a mesh like '{axis}:2,...' or pass axis=<one of "
                                f"{list(ctx.mesh.axis_names)}>")
        p, v = ctx.mesh.axis_size(axis), virtual_stages
        self.schedule: Schedule = build_schedule(schedule, p, microbatches, virtual_stages=v)
        n = _num_stages(stages, placement)
        if n is not None and n != p * v:
            what = "model chunks" if v > 1 else "stages"
            has = f"{p} processors" + (f" × {v} virtual stages" if v > 1 else "")
            mesh = f"use a mesh with '{axis}:{n // v}'" if n % v == 0 else ""
            if placement is not None:  # its chunks are what the placer found fastest: fit the mesh to them
                # Problem(devices=p·v) may again give fewer; the interleaved problem cuts exactly p·v chunks
                again = (f"place with Problem(devices={p}, schedule='interleaved', virtual_stages={v}, "
                         f"microbatches=<a multiple of {p}>), which cuts exactly {p * v} chunks "
                         f"(Problem(devices={p * v}) may return fewer, where more are no faster)")
                raise PipelineError(f"the placement has {n} {what} but axis {axis!r} has {has} (the placer "
                                    "uses fewer stages than devices where more are no faster); "
                                    f"{f'{mesh}, or {again}' if mesh and v > 1 else mesh or again}")
            raise PipelineError(f"{n} {what} but axis {axis!r} has {has}; split the model into {p * v} "
                                f"{what}{f' or {mesh}' if mesh else ''}")
        self.axis, self.stage, self.num_stages = axis, ctx.coords[axis], p
        self.virtual_stages = v
        self.microbatches, self.batch_dim = microbatches, batch_dim
        self.module = stage_chunks(_stage_modules(stages, placement), self.stage, p, v,
                                   self.schedule.placement)
        if ctx.comm.backend == "threads" and ctx.mesh.size > 1:
            chunks = [model_chunk_of(self.stage, k, p, self.schedule.placement) for k in range(v)]
            self.module = _own_on_threads(self.module, chunks, axis)
        # the stage holding the last model chunk: it applies the loss (stage 0 under ZB-V's V)
        self.last_stage = self.schedule.where(p * v - 1)[0]
        self.executor = Executor(self.module, axis, loss_fn, recompute)
        others = tuple(a for a in ctx.mesh.axis_names if a != axis)
        self.data_axes = others if data_axes == "auto" else (data_axes,) if isinstance(data_axes, str) \
            else tuple(data_axes)
        self._auto = data_axes == "auto"
        mod = self.module
        # the module's own parameters, fixed here: under 2BW the module runs on aliases while a table runs
        self.parameters_unbound: list[torch.nn.Parameter] = \
            list(mod.parameters()) if isinstance(mod, torch.nn.Module) else []
        self._tables: dict[int, Schedule] = {}
        params = self.parameters()
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self.batches_trained = 0  # t: the module holds W(t)
        # 2BW's double buffer: per parameter, one alias Parameter per weight version parity; the
        # module runs each action on the alias of its version, so in-flight autograd graphs never
        # see the in-place optimizer step (done through the module's own parameters)
        self._aliases: list[list[torch.nn.Parameter]] | None = None
        self._slots: list[tuple[torch.nn.Module, str, int]] = []
        self._bound = -1  # parity bound in the module; -1: the module's own parameters
        # called on every processor after the backward, before replicas average: e.g. to sum the
        # gradient of a parameter two stages share (tied embeddings)
        self.after_backward: Callable[[], None] | None = None
        # called on every processor with the batch index t right before the optimizer step of
        # batch t: e.g. to set the learning rate of a schedule
        self.before_step: Callable[[int], None] | None = None

    def parameters(self) -> list[torch.nn.Parameter]:
        """This processor's stage's parameters (they hold the newest weights)."""
        return self.parameters_unbound

    @property
    def trace(self) -> list[tuple[str, int, float, float, int]]:
        """``(kind, micro-batch, start, end, weight version)`` of each action of the last
        :meth:`train`/:meth:`step`, as executed (versions relative to its first batch)."""
        return self.executor.trace

    def _average_over_replicas(self) -> None:
        axes = tuple(a for a in self.data_axes if current().mesh.axis_size(a) > 1)
        if not axes:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None
                 and not (self._auto and isinstance(p, MeshParameter))]
        if not grads:
            return
        comm = current().comm
        n = len(comm.group(axes))
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), axes) / n
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _split(self, inputs: Any, targets: Any) -> tuple[list | None, list | None]:
        m = self.microbatches
        first, last = self.stage == 0, self.stage == self.last_stage
        return (split_microbatches(inputs, m, self.batch_dim) if first else None,
                split_microbatches(targets, m, self.batch_dim) if last else None)

    def _batch_losses(self, totals: torch.Tensor | None, batches: int = 1) -> list[float]:
        """Each batch's loss (the last stage's ``totals``) on every processor."""
        comm = current().comm
        n = batches if totals is None else totals.numel()
        loss = (torch.zeros(n, dtype=torch.float64, device=current().device) if totals is None
                else totals.to(torch.float64).reshape(n))
        loss = comm.broadcast(loss, self.axis, src=self.last_stage)
        # replicas of plain stages saw different data; a MeshTensor loss is the same on all (a no-op)
        axes = tuple(a for a in self.data_axes if current().mesh.axis_size(a) > 1)
        if axes:
            loss = comm.all_reduce(loss, axes) / len(comm.group(axes))
        if loss.device.type == "meta":  # a planner's trace (meshtorch.plan.pipeline): no values
            return [float("nan")] * n
        return loss.tolist()

    def loss(self, inputs: Any = None, targets: Any = None) -> float:
        """The batch loss without gradients (the forwards of the table only): for evaluation."""
        self._unbind()
        return self._batch_losses(self.executor.run(self.schedule, *self._split(inputs, targets),
                                                    train=False))[0]

    def microbatches_only(self, inputs: Any = None, targets: Any = None) -> None:
        """Run one batch's forwards and backwards through the schedule and accumulate this
        stage's gradients, and nothing that runs once per batch: no gradient clipping or
        averaging over replicas, no optimizer step, no weight versions, no loss broadcast.
        What the planner traces of one micro-batch to bound a step's work from below
        (:func:`meshtorch.plan.pipeline.microbatch_work`)."""
        self._unbind()
        self.executor.run(self.schedule, *self._split(inputs, targets))

    def forward_backward(self, inputs: Any = None, targets: Any = None) -> float:
        """Run one batch through the schedule and accumulate this stage's gradients
        (no optimizer step, no weight versions). ``inputs`` matter on stage 0 and
        ``targets`` on the last stage. Returns the batch loss on every processor
        (the mean of the micro-batch losses, averaged over data-parallel replicas)."""
        self._unbind()

        def reduce(_: int) -> None:
            if self.after_backward is not None:
                self.after_backward()
            self._average_over_replicas()

        return self._batch_losses(self.executor.run(self.schedule, *self._split(inputs, targets),
                                                    on_update=reduce))[0]

    def step(self, inputs: Any = None, targets: Any = None) -> float:
        """One training step: :meth:`train` on one batch. Returns the batch loss."""
        return self.train([(inputs, targets)])[0]

    def train(self, batches: Sequence[tuple[Any, Any]]) -> list[float]:
        """Train on ``batches`` (``(inputs, targets)`` pairs; inputs matter on stage 0,
        targets on the last stage) as one table of ``len(batches)`` batches.

        Each batch's update (at the table's update slot, the same on every stage)
        runs :attr:`after_backward`, averages gradients over data-parallel
        replicas, calls :attr:`before_step` with the batch index and steps the
        optimizer, then zeroes the gradients. Under ``"2bw"`` the table has no
        flush between the batches and each batch computes with the weights of
        one update before (module docstring). Returns every batch's loss on
        every processor (one broadcast at the end, so the stages never wait for
        each other in between).
        """
        batches = list(batches)
        if not batches:
            return []
        if self.optimizer is None and self.parameters():
            raise PipelineError("Pipeline.train/step needs optimizer=<params -> torch.optim.Optimizer>; or "
                                "call forward_backward() and step your own optimizer")
        refuse_inference_mode()  # before 2BW's weight versions are made (as inference tensors)
        self._unbind()
        for p in self.parameters():
            p.grad = None
        table = self._table(len(batches))
        cols = [self._split(x, y) for x, y in batches]
        inputs = [v for c in cols for v in c[0]] if self.stage == 0 else None
        targets = [v for c in cols for v in c[1]] if self.stage == self.last_stage else None
        two_bw = self.schedule.name == "2bw"
        if two_bw:
            self._make_aliases()
        t0 = self.batches_trained
        try:
            losses = self.executor.run(table, inputs, targets, on_update=lambda b: self._update(t0 + b),
                                       bind=(lambda v: self._bind((t0 + v) % 2)) if two_bw else None)
        finally:
            self._unbind()
        return self._batch_losses(losses, len(batches))

    def set_weight_versions(self, previous: Sequence[torch.Tensor] | None = None) -> None:
        """Tell a 2BW pipeline that its weights changed from outside (a loaded
        checkpoint): the module's parameters are ``W(t)``, and ``previous`` (one
        tensor per parameter; default: the same values) is ``W(t-1)``, which the
        next batch computes with. A no-op for the other schedules."""
        if self.schedule.name != "2bw":
            return
        self._aliases = None
        self._make_aliases()
        if previous is not None:
            with torch.no_grad():
                for alias, w in zip(self._aliases[(self.batches_trained - 1) % 2], previous, strict=True):
                    alias.copy_(w)

    def weight_versions(self) -> list[list[torch.Tensor]]:
        """``[W(t), W(t-1)]`` under 2BW, this stage's two weight versions (detached,
        sharing storage with the pipeline's); ``[W(t)]`` otherwise."""
        params = [p.detach() for p in self.parameters()]
        if self.schedule.name != "2bw":
            return [params]
        self._make_aliases()
        return [params, [a.detach() for a in self._aliases[(self.batches_trained - 1) % 2]]]

    # ---------------------------------------------------------------- internals
    def _table(self, batches: int) -> Schedule:
        if batches == 1:
            return self.schedule
        if batches not in self._tables:
            self._tables[batches] = build_schedule(self.schedule.name, self.num_stages, self.microbatches,
                                                   batches, self.virtual_stages)
        return self._tables[batches]

    def _make_aliases(self) -> None:
        if self._aliases is not None:
            return
        params = self.parameters()
        self._slots = [(mod, name, i) for i, p in enumerate(params)
                       for mod in self.module.modules() for name, q in mod._parameters.items() if q is p]

        def alias(p: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
            # the same class (an mt.nn.MeshParameter stays one) with its named shape, layout and path
            a = torch.Tensor._make_subclass(type(p), data, p.requires_grad)
            a.__dict__.update(p.__dict__)
            return a

        # W(t) shares the module parameters' storage (version t has parity t % 2); W(t-1) starts as
        # a copy of it (W(-1) = W(0) at t = 0)
        cur = [alias(p, p.data) for p in params]
        prev = [alias(p, p.data.clone()) for p in params]
        self._aliases = [cur, prev] if self.batches_trained % 2 == 0 else [prev, cur]

    def _bind(self, parity: int) -> None:
        """Put the weight version of ``parity`` (-1: the module's own parameters) in the module."""
        if parity == self._bound:
            return
        params = self.parameters_unbound if parity < 0 else self._aliases[parity]
        for mod, name, i in self._slots:
            mod._parameters[name] = params[i]
        self._bound = parity

    def _unbind(self) -> None:
        if self._bound >= 0:
            self._bind(-1)

    def _update(self, t: int) -> None:
        """Batch ``t``'s update, on every stage at the same slot of the table."""
        self._unbind()
        params = self.parameters()
        two_bw = self.schedule.name == "2bw"
        if two_bw:  # batch t computed with W(t-1): its gradient sits on that version's aliases
            used, newest = self._aliases[(t - 1) % 2], self._aliases[t % 2]
            for p, a in zip(params, used):
                p.grad, a.grad = a.grad, None
        if self.after_backward is not None:
            self.after_backward()
        self._average_over_replicas()
        if two_bw:
            # W(t+1) = W(t) - update(∇f(W(t-1))) goes into W(t-1)'s buffer, free now: batch t has
            # drained and batch t+1 computes with W(t). In place through the module's parameters,
            # whose autograd version counters no in-flight graph holds (those hold the aliases').
            with torch.no_grad():
                for p, a, w in zip(params, used, newest):
                    p.data = a.data
                    p.copy_(w)
        if self.before_step is not None:
            self.before_step(t)
        if self.optimizer is not None:
            self.optimizer.step()
        for p in params:
            p.grad = None
        self.batches_trained = t + 1
