"""``torch.compile`` of a meshtorch step: each processor's local program as one graph.

Dynamo traces the whole step on each processor as one graph (``fullgraph``: a
graph break is an error): meshtorch's layouts, plans and adapters are Python
constants of the trace, so what remains is the processor's torch ops and its
collectives. The lowering's plans are resolved outside the trace
(:func:`meshtorch.lowering.lower.plan_of` hands Dynamo only constants), so Dynamo
does not run the planner's Python and the eager steps' plans serve the compile.
On the ``torch`` backend (gloo, NCCL) the collectives are ``torch.distributed``'s
functional collectives, ops of the graph; on the ``threads`` backend each is one
opaque op (``meshtorch::collective``) that calls the processor's communicator.
AOTAutograd compiles the backward too.

The communicator's counters (``mt.comm_stats()``) count a compiled step's
collectives at every call, as an eager step's: a trace notes them once and
:func:`compile_step` counts them per call (the backward's with its forward).

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.compiler import compile_step
    >>> def f():
    ...     x = mt.from_global(torch.arange(4.0), "batch:4")
    ...     step = compile_step(mt.reduce_sum, backend="eager")
    ...     return [(step(x).item(), mt.comm_stats().calls()) for _ in range(2)]
    >>> mt.launch(f, mesh="b:2", rules="batch:b")
    [[(6.0, 1), (6.0, 2)], [(6.0, 1), (6.0, 2)]]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from meshtorch import caching
from meshtorch.caching import CONSTANT_RESULTS, dispatch_mode_active
from meshtorch.comm.stats import begin_traced, traced_tally
from meshtorch.context import current
from meshtorch.tensor import MeshTensor


def compile_step(fn: Callable[..., Any], backend: Any = "inductor", dynamic: bool = False,
                 fullgraph: bool = True) -> Callable[..., Any]:
    """``fn`` (a step, or a model's ``loss``) under ``torch.compile(backend=..., dynamic=...,
    fullgraph=...)``, counting its collectives in this processor's ``mt.comm_stats()`` at every
    call.

    One graph by default (``fullgraph=True``): a graph break raises, naming its cause, rather
    than silently splitting the step (pass ``fullgraph=False`` for a function that must break,
    e.g. one that reads ``.item()``). Shapes are static by default: a batch of another shape
    compiles again. Under the threads backend every processor compiles its own graph of the
    same code (its plans, its slices) on its first call: Dynamo's recompile limits are raised
    to allow one version per processor. Under a ``TorchDispatchMode`` (a FLOP counter) ``fn``
    runs uncompiled, as the same values: ``torch.compile`` does not compile there.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.compiler import compile_step
        >>> x = mt.from_global(torch.ones(2, 3), "batch:2,d:3")
        >>> compile_step(mt.reduce_sum, backend="eager")(x).item()
        6.0
    """
    # caching.constant_result marks these without importing Dynamo; torch's own decorator
    # (Dynamo is imported now) keeps them marked should a torch release mark constants another way
    for marked in CONSTANT_RESULTS:
        torch.compiler.assume_constant_result(marked)
    config = torch._dynamo.config
    n = current().mesh.size
    config.recompile_limit = max(config.recompile_limit, 2 * n)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * n)
    # thread-processors share torch.fx's process-wide 'symbolic tracing' flag, which one's compile
    # sets while AOTAutograd traces: torch 2.11 then refused another processor's call of its
    # compiled step ('Detected that you are using FX to symbolically trace a dynamo-optimized
    # function'; 2.13 masks the flag by marking the process compiling during any compile). No
    # processor FX-traces a compiled step, so the refusal only misfires: Dynamo's
    # force_compile_during_fx_trace lets the call go on, set only while some processor's compiled
    # step runs (a process-wide setting on 2.11: left on, it would wave through a user's own FX
    # trace of a compiled function after the launch)
    shared = (n > 1 and current().comm.backend == "threads"
              and hasattr(config, "force_compile_during_fx_trace"))

    def traced(*args: Any, **kwargs: Any) -> tuple[Any, int]:
        tally = begin_traced()  # a constant of the trace: the tally its collectives are noted in
        return fn(*args, **kwargs), tally

    compiled = torch.compile(traced, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    def step(*args: Any, **kwargs: Any) -> Any:
        if not caching.compiling() and dispatch_mode_active(any_mode=False):
            # torch.compile would not compile here, and the try would mark `traced`'s code (every
            # compiled step's) never to compile again in the process. (Inside an outer compile
            # the step is traced into that graph: nothing to ask, and the test would break it.)
            return fn(*args, **kwargs)
        _values_in((args, kwargs))
        with _fx_trace_check_off(config) if shared else nullcontext():
            out, tally = compiled(*args, **kwargs)
        stats = current().comm.stats
        for kind, axes, nbytes in traced_tally(tally):
            stats.record(kind, axes, nbytes)
        return out

    return step


_fx_off_lock = threading.Lock()
_fx_off = {"calls": 0, "before": False}  # compiled steps running with the check off; its setting before


@contextmanager
def _fx_trace_check_off(config: Any) -> Iterator[None]:
    """Dynamo's ``force_compile_during_fx_trace`` on while any thread-processor's compiled step
    runs, back to its value before when the last one returns (counted: one processor's return
    must not turn it off under another that is still compiling)."""
    with _fx_off_lock:
        if _fx_off["calls"] == 0:
            _fx_off["before"] = config.force_compile_during_fx_trace
            config.force_compile_during_fx_trace = True
        _fx_off["calls"] += 1
    try:
        yield
    finally:
        with _fx_off_lock:
            _fx_off["calls"] -= 1
            if _fx_off["calls"] == 0:
                config.force_compile_during_fx_trace = _fx_off["before"]


def _values_in(x: Any) -> None:
    """Wait for the value of every MeshTensor in ``x`` (nested lists, tuples, dicts) whose
    all_reduce is in flight (a loss inside ``mt.overlap()``): Dynamo reads the unset slot as
    missing, not through :meth:`~meshtorch.tensor.MeshTensor.__getattr__`."""
    if isinstance(x, MeshTensor):
        if x._later is not None:
            x.local  # noqa: B018 - the read fills it
    elif isinstance(x, (list, tuple)):
        for v in x:
            _values_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            _values_in(v)


def graph_breaks() -> dict[str, int]:
    """The graph breaks ``torch.compile`` has met in this process so far: reason -> count.

    Example:
        >>> from meshtorch.compiler import graph_breaks
        >>> isinstance(graph_breaks(), dict)
        True
    """
    from torch._dynamo.utils import counters

    return {reason.strip().splitlines()[0][:200]: n for reason, n in counters["graph_break"].items()}
