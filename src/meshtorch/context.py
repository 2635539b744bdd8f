"""The processor context: which mesh, rules and communicator an op runs under.

Inside ``mt.launch`` each processor (thread or process) has its own context;
outside any launch, ops run on a one-processor mesh with no rules, so
meshtorch also works at a plain Python prompt.

Example:
    >>> import meshtorch as mt
    >>> mt.current().mesh.size
    1
    >>> mt.launch(lambda: mt.current().coords, mesh="b:2")
    [{'b': 0}, {'b': 1}]
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import meshtorch.comm.compiled  # noqa: F401  (registers the op compiled collectives run)
from meshtorch.caching import constant_result
from meshtorch.comm.base import Communicator, LocalCommunicator
from meshtorch.comm.stats import CommStats
from meshtorch.errors import PlanError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

if TYPE_CHECKING:
    import torch


class ProcessorTracer(Protocol):
    """What the core tells a processor's tracer (the planner's is one).

    The core never knows who traces: it reports each new ``MeshTensor`` to
    :meth:`observe`, and runs work that is not the program's own (drawing
    initial random numbers, a backend's private staging copies) inside
    :meth:`paused`, so that it is neither counted nor held as memory.
    """

    def observe(self, tensor: Any) -> None:
        """A ``MeshTensor`` was just made on this processor."""

    def paused(self) -> AbstractContextManager[Any]:
        """A block whose tensor work the tracer does not see."""

    def drawing(self) -> AbstractContextManager[bool]:
        """A block drawing random numbers; it yields whether the tracer follows its memory
        (inside a measured step, where a dropout mask's draw is the step's own work)."""

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """A block whose work the tracer also counts apart, under ``name`` (a pipeline's
        update, which runs after the schedule's micro-batches instead of between them)."""


_keys = itertools.count(1)  # (next() on it is atomic: contexts made on several threads differ)


@dataclass
class ProcessorContext:
    """What one processor knows: its communicator, the mesh and the layout rules."""

    comm: Communicator
    rules: LayoutRules = field(default_factory=LayoutRules)
    random_calls: int = 0
    tracer: ProcessorTracer | None = None
    #: this context's number, never another's in the process (``id()`` may name a later context
    #: once this one is gone): the key of what is kept for it elsewhere (its background save)
    key: int = field(default_factory=lambda: next(_keys), compare=False, repr=False)
    #: the lowering's stand-in for (rules, mesh, rank) in its plans' keys, with the rules and
    #: communicator it was made for (:func:`meshtorch.lowering.lower._scope_of`); not a field
    plan_scope: ClassVar[tuple | None] = None

    @property
    def mesh(self) -> Mesh:
        return self.comm.mesh

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def coords(self) -> dict[str, int]:
        return self.comm.coords

    @property
    def device(self) -> torch.device | None:
        """The ``torch.device`` this processor computes on, or ``None``: torch's default device."""
        return self.comm.device

    def __post_init__(self) -> None:
        # the backend's private copies stay unseen by this processor's tracer (``tracing``: the
        # dict of contexts with one, empty while nothing traces, for the backend's hot paths)
        self.comm.unseen, self.comm.tracing = untraced, traced

    def next_random_stream(self) -> int:
        """A fresh stream number; the same sequence on every processor (SPMD)."""
        self.random_calls += 1
        return self.random_calls


class _Local(threading.local):
    def __init__(self) -> None:
        # made per thread, on its first read; no class attribute of the same name: Dynamo (torch
        # 2.11) reads a thread-local's attribute that its class also defines from the class,
        # which lost the processor's context inside a compiled step
        self.ctx: ProcessorContext | None = None  # this thread's use() block's context


_local = _Local()
#: this thread's context inside ``use()``, else ``None``: ``here.ctx or current()`` is
#: :func:`current` without its Python frame, for the lowering's per-op path (issue 27: each frame
#: between a model's large kernels runs cold)
here = _local
#: the process's default context (the torch backend's processor, else the one-processor context,
#: made at the first current()): what a thread outside any ``use()`` block computes in
_process: ProcessorContext | None = None


def current() -> ProcessorContext:
    """The context of the processor running this code."""
    ctx = _local.ctx
    if ctx is not None:
        return ctx
    if _process is None:
        set_process_context(ProcessorContext(LocalCommunicator()))
    return _process


@contextmanager
def use(ctx: ProcessorContext) -> Iterator[ProcessorContext]:
    """Make ``ctx`` current on this thread for the duration of the block."""
    prev = _local.ctx  # this thread's own (None: the process default), not the default itself
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        # (a generator holding this block may be finished on another thread: that thread's own
        # context becomes the one from before the block, None there as a rule: its default)
        _local.ctx = prev


# The contexts that have a tracer now, by id. Empty unless something traces, so the hot path
# (every MeshTensor made) tests this dict, as cheap as a global flag, before asking current().
traced: dict[int, ProcessorContext] = {}
_traced_lock = threading.Lock()


@contextmanager
def use_tracer(tracer: ProcessorTracer) -> Iterator[ProcessorTracer]:
    """Give this processor ``tracer`` for the block; it is removed at exit, also on errors.

    Example:
        >>> from contextlib import nullcontext
        >>> import meshtorch as mt
        >>> from meshtorch.context import current, use_tracer
        >>> class Count:
        ...     n = 0
        ...     def observe(self, tensor): self.n += 1
        ...     def paused(self): return nullcontext()
        >>> with use_tracer(Count()) as c:
        ...     _ = mt.zeros("batch:4")
        >>> c.n, current().tracer is None
        (1, True)
    """
    ctx = current()
    if ctx.tracer is not None:
        raise PlanError(
            "a trace is already running on this processor; finish it before starting another "
            "(traces do not nest)")
    ctx.tracer = tracer
    with _traced_lock:
        traced[id(ctx)] = ctx
    try:
        yield tracer
    finally:
        with _traced_lock:
            del traced[id(ctx)]
        ctx.tracer = None


def untraced() -> AbstractContextManager[Any]:
    """A block this processor's tracer (if any) does not see: work that is not the program's.

    Example:
        >>> import torch
        >>> from meshtorch.context import untraced
        >>> with untraced():
        ...     t = torch.zeros(3)
    """
    tracer = current().tracer if traced else None
    return nullcontext() if tracer is None else tracer.paused()


def drawing() -> AbstractContextManager[bool]:
    """A block drawing random numbers: unseen by this processor's tracer when it is
    initialisation, followed as memory inside a measured step (each step draws its
    dropout masks again, and the draw's temporaries are part of its peak). It yields
    whether a tracer follows it.

    Example:
        >>> import torch
        >>> from meshtorch.context import drawing
        >>> with drawing() as followed:
        ...     t = torch.zeros(3)
        >>> followed
        False
    """
    tracer = current().tracer if traced else None
    return nullcontext(False) if tracer is None else tracer.drawing()


def phase(name: str) -> AbstractContextManager[Any]:
    """A block of the program whose work a tracer (if any) also counts apart under ``name``;
    nothing otherwise. The pipeline runtime marks its optimizer update so, as the planner
    prices it after the schedule's micro-batches rather than spread over them.

    Example:
        >>> import torch
        >>> from meshtorch.context import phase
        >>> with phase("update"):
        ...     t = torch.zeros(3)
    """
    tracer = current().tracer if traced else None
    return nullcontext() if tracer is None else tracer.phase(name)


def processor_device() -> torch.device:
    """The device this processor computes on: ``mt.launch(..., device=)``'s (its context's
    ``device``), or torch's default device outside a launch. No device mode wraps a
    processor's program, so code that makes tensors passes this as ``device=``; a constant
    made per call is better made once per device (a dict keyed by this device).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.context import processor_device
        >>> mt.launch(lambda: processor_device().type, mesh="b:2")
        ['cpu', 'cpu']
    """
    dev = current().device
    return dev if dev is not None else _default_device()


@constant_result  # a constant of a compiled program (Dynamo cannot trace the call)
def _default_device() -> torch.device:
    import torch

    return torch.get_default_device()


def set_process_context(ctx: ProcessorContext) -> None:
    """Make ``ctx`` the default of every thread of this process (torch backend)."""
    global _process
    _process = ctx


def comm_stats() -> CommStats:
    """This processor's collective counters (calls and payload bytes per axis and kind).

    Example:
        >>> import meshtorch as mt
        >>> mt.comm_stats().bytes()
        0
    """
    return current().comm.stats


def reset_comm_stats() -> None:
    """Zero this processor's collective counters."""
    current().comm.stats.reset()
