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

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from meshtorch.comm.base import Communicator, LocalCommunicator
from meshtorch.comm.stats import CommStats
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh


@dataclass
class ProcessorContext:
    """What one processor knows: its communicator, the mesh and the layout rules."""

    comm: Communicator
    rules: LayoutRules = field(default_factory=LayoutRules)
    random_calls: int = 0

    @property
    def mesh(self) -> Mesh:
        return self.comm.mesh

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def coords(self) -> dict[str, int]:
        return self.comm.coords

    def next_random_stream(self) -> int:
        """A fresh stream number; the same sequence on every processor (SPMD)."""
        self.random_calls += 1
        return self.random_calls


_local = threading.local()
_process_default: list[ProcessorContext] = []


def current() -> ProcessorContext:
    """The context of the processor running this code."""
    ctx = getattr(_local, "ctx", None)
    if ctx is not None:
        return ctx
    if not _process_default:
        _process_default.append(ProcessorContext(LocalCommunicator()))
    return _process_default[-1]


@contextmanager
def use(ctx: ProcessorContext) -> Iterator[ProcessorContext]:
    """Make ``ctx`` current on this thread for the duration of the block."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def set_process_context(ctx: ProcessorContext) -> None:
    """Make ``ctx`` the default of every thread of this process (torch backend)."""
    _process_default.append(ctx)


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
