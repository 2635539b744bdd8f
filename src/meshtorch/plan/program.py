"""The contract between a training program and the planner: what a program says about itself.

The planner traces a program on the meta backend (:func:`meshtorch.plan.trace`),
prices it (:func:`meshtorch.plan.estimate`,
:func:`meshtorch.plan.pipeline.estimate_pipeline`) and searches its layouts
(:func:`meshtorch.plan.search`). It reads the program only through the two
protocols here, never through attributes it hopes are present:

- :class:`Step` is one processor's training step as a training loop runs it
  (its model, its optimizer, how it is pipelined, and ``run``: train on a window
  of batches). :func:`measured_run` is how a :class:`Program` measures it: the
  planner traces the very ``run`` the loop calls.
- :class:`Program` is what the planner calls: one processor's part of a step
  (build, warm up, then one steady-state step inside :func:`meshtorch.plan.measure`),
  with what a search may do with it: rebuild it with fewer layers (it traces two
  shallow copies and extrapolates), take its update away (a cheaper lower bound),
  pipeline it, probe one micro-batch of its pipeline (a cheaper lower bound on a
  stage), reshard it after forward (less memory where a layout does not fit), and
  which dims of its model a layout may split (:class:`SpaceDims`).

Any plain callable is a program too: :func:`program_of` wraps one that
declares nothing (no layers, no pipeline, the :data:`TRANSFORMER_DIMS`); one that
declares part of the protocol is refused, naming what it lacks.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.plan.program import Program, program_of
    >>> def step():
    ...     ff = mt.nn.Dense(mt.Dim("d_model", 8), mt.Dim("d_ff", 16), bias=False)
    ...     with mt.plan.measure():
    ...         mt.reduce_sum(ff(mt.random.normal("batch:4,d_model:8", seed=1))).backward()
    >>> p = program_of(step)
    >>> isinstance(p, Program), p.layers, p.pipeline, p.pipelined(2), program_of(p) is p
    (True, 0, None, None, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from meshtorch.plan.tracing import measure


@dataclass(frozen=True)
class Pipelining:
    """How a pipelined step runs: along mesh axis ``axis``, ``schedule`` (``gpipe``, ``1f1b``,
    ``2bw``, ``zb``, ``interleaved``) over ``microbatches`` micro-batches per batch, recomputing
    activations or not, with ``virtual_stages`` model chunks per stage (``interleaved``)."""

    schedule: str
    microbatches: int
    axis: str = "stage"
    recompute: bool = False
    virtual_stages: int = 1


@dataclass(frozen=True)
class SpaceDims:
    """The dims of a model that the search's layouts may split, by their role.

    ``batch``: the data dim (split for data parallelism); ``model``: the dims a
    model axis may split (heads, hidden units, vocabulary: Megatron's tensor
    parallelism); ``experts``: a mixture's expert dim (on the model axis, or with
    ``batch`` on the data axis); ``hidden``: the residual stream's dim, which
    also indexes the parameters' rows (on the data axis it shards parameters,
    ZeRO/FSDP; on the model axis it splits the residual stream); ``sequence``:
    the sequence dim (on the model axis: sequence parallelism). A name the
    model does not have is skipped.
    """

    batch: str = "batch"
    model: tuple[str, ...] = ("heads", "d_ff", "vocab")
    experts: str = "experts"
    hidden: str = "d_model"
    sequence: str = "length"


# The dim names of meshtorch's Transformer layers and models (meshtorch.nn, meshtorch.models).
TRANSFORMER_DIMS = SpaceDims()


@runtime_checkable
class Step(Protocol):
    """One processor's training step, as a training loop runs it (and the planner measures it).

    ``model`` holds the parameters and ``opt`` steps them; ``pipeline`` is how the step is
    pipelined along a mesh axis, or ``None`` for an SPMD step every processor runs whole.
    """

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    pipeline: Pipelining | None

    def run(self, batches: list, first: int) -> float:
        """Train on ``batches`` (steps ``first``, ``first + 1``, ...); the last one's loss
        (NaN where it has no value: on the meta backend)."""


@runtime_checkable
class Program(Protocol):
    """A training program as the planner traces, prices and searches it.

    Calling it runs one processor's part of a step: build what it uses (so that its memory
    is seen), warm up, and run one steady-state step inside :func:`meshtorch.plan.measure`
    (:func:`measured_run`); it returns ``{"parameters": global parameter count, ...}``.
    It must be picklable to be traced on the torch backend.
    """

    layers: int  # repeating blocks; 0: it cannot be rebuilt with fewer (traced whole)
    period: int  # blocks repeat with this period (an MoE model alternating dense/expert blocks: 2)
    pipeline: Pipelining | None  # None: an SPMD program; else a pipeline (priced stage by stage)
    dims: SpaceDims  # which of its model's dims a searched layout may split

    def __call__(self) -> Any:
        """One processor's part of the step (see the class docstring)."""

    def with_layers(self, n: int) -> Program:
        """This program with ``n`` layers (only called when ``layers`` > 0)."""

    def without_update(self) -> Program | None:
        """The step's forward and backward alone (no optimizer, no warm-up): a part of its
        work, whose cost bounds the step's from below; ``None`` if there is none."""

    def pipelined(self, microbatches: int) -> Program | None:
        """This program pipelined over ``microbatches`` micro-batches along a mesh axis
        (``pipeline`` set), or ``None`` if it cannot be pipelined."""

    def one_microbatch(self) -> Program | None:
        """One micro-batch of this pipelined program: the same stages, rules and schedule on
        ``batch / microbatches`` sequences, measuring only their forwards and backwards, so that
        ``microbatches`` times each stage's work bounds the step's stage from below
        (:func:`meshtorch.plan.pipeline.microbatch_work`); ``None`` if there is none."""

    def resharded(self) -> Program | None:
        """This program resharding its gathered parameters after forward (less memory, more
        bytes), what a search prices where a layout does not fit; ``None`` where that changes
        nothing."""


# what a Program declares (program_of refuses an object that declares part of it)
PROGRAM_MEMBERS = ("layers", "period", "pipeline", "dims", "with_layers", "without_update", "pipelined",
                   "one_microbatch", "resharded")


def measured_run(step: Step, batch: Any, first: int = 1) -> dict[str, Any]:
    """Run ``step`` on ``batch`` inside :func:`meshtorch.plan.measure`: what a :class:`Program`
    does after its warm-up. Returns ``{"parameters": global count, "comm": that step's
    collectives as this processor's communicator counts them}``.

    Example:
        >>> import meshtorch as mt
        >>> class SGDStep:
        ...     pipeline = None
        ...     def __init__(self):
        ...         self.model = mt.nn.Dense(mt.Dim("d_model", 8), mt.Dim("d_ff", 16), bias=False)
        ...         self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        ...     def run(self, batches, first):
        ...         for x in batches:
        ...             loss = mt.reduce_sum(self.model(x))
        ...             loss.backward()
        ...             self.opt.step()
        ...         return loss.item()
        >>> def program():
        ...     return measured_run(SGDStep(), mt.random.normal("batch:4,d_model:8", seed=1))
        >>> out = mt.launch(program, mesh="b:2", rules="batch:b")[0]
        >>> out["parameters"], out["comm"]["all_reduce@b"]["calls"]  # the loss, the gradient
        (128, 2)
    """
    from meshtorch.context import comm_stats

    with measure():
        before = comm_stats().copy()
        step.run([batch], first)
        counted = comm_stats() - before
    return {"parameters": _parameters(step.model), "comm": counted.as_dict()}


def _parameters(model: torch.nn.Module) -> int:
    """The global parameter count (a MeshTensor parameter counts its global elements)."""
    from meshtorch.nn.module import Module

    return model.num_parameters() if isinstance(model, Module) else sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class FunctionProgram:
    """A plain callable as a :class:`Program` that declares nothing: traced whole, never
    pipelined, no cheaper part, the :data:`TRANSFORMER_DIMS` unless told."""

    fn: Callable[[], Any]
    dims: SpaceDims = TRANSFORMER_DIMS
    layers: int = 0
    period: int = 1
    pipeline: Pipelining | None = None

    def __call__(self) -> Any:
        return self.fn()

    def with_layers(self, n: int) -> Program:
        return self

    def without_update(self) -> Program | None:
        return None

    def pipelined(self, microbatches: int) -> Program | None:
        return None

    def one_microbatch(self) -> Program | None:
        return None

    def resharded(self) -> Program | None:
        return None


def program_of(fn: Callable[[], Any] | Program, dims: SpaceDims | None = None) -> Program:
    """``fn`` as a :class:`Program`: itself if it is one, else :class:`FunctionProgram`
    (with ``dims``, default :data:`TRANSFORMER_DIMS`).

    An object that declares part of the protocol is refused, naming what it lacks: wrapped, it
    would be traced whole, its declarations silently unused.

    Example:
        >>> from meshtorch.plan.program import program_of
        >>> class Half:
        ...     layers, period, pipeline = 2, 1, None
        ...     def __call__(self): ...
        >>> program_of(Half())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshtorch.errors.PlanError: the program Half declares layers, period, pipeline but not dims, ...
    """
    if isinstance(fn, Program):
        return fn
    declared = [m for m in PROGRAM_MEMBERS if hasattr(fn, m)]
    if declared:
        from meshtorch.errors import PlanError

        lacks = [m for m in PROGRAM_MEMBERS if m not in declared]
        raise PlanError(f"the program {type(fn).__name__} declares {', '.join(declared)} but not "
                        f"{', '.join(lacks)}: a meshtorch.plan.program.Program declares all of them "
                        "(or none: a plain callable)")
    return FunctionProgram(fn, dims or TRANSFORMER_DIMS)


__all__ = ["PROGRAM_MEMBERS", "TRANSFORMER_DIMS", "FunctionProgram", "Pipelining", "Program", "SpaceDims",
           "Step", "measured_run", "program_of"]
