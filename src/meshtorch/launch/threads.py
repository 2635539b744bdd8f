"""``mt.launch(fn, backend="threads")``: every processor a thread of this process.

The processors meet in a shared :class:`~meshtorch.comm.threads.Hub`; when one
raises, the hub wakes the others (their collectives raise ``CommError``), so a
failure never leaves the launch waiting.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.launch.threads import run_threads
    >>> run_threads(lambda: mt.current().rank, (), {}, mt.Mesh("m:3"), mt.LayoutRules(""), 60, False)
    [0, 1, 2]
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.threads import Hub, ThreadsCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.launch.failures import is_comm_error, processor_error, root_cause
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

# per communicator, the number of gather_results calls so far: the key that tells one call's
# exchange from the next, as the fastest thread may start the next before the slowest reads
_GATHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_threads(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
                timeout: float, check: bool) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on one thread per processor; results in rank order.

    Raises the first failure that is not another processor's abandonment, as
    an exception that is both its class and a ``ProcessorError``.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launch.threads import run_threads
        >>> run_threads(abs, (-2,), {}, mt.Mesh("b:2"), mt.LayoutRules(""), 60, False)
        [2, 2]
    """
    hub = Hub(mesh, timeout)
    n = mesh.size
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}
    order: list[int] = []

    def run(rank: int) -> None:
        ctx = ProcessorContext(ThreadsCommunicator(hub, rank, check=check), rules)
        try:
            with use(ctx):
                results[rank] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            errors[rank] = e
            order.append(rank)
            hub.fail(rank, e)

    # N processors each running multi-threaded kernels would oversubscribe the cores.
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    try:
        if n == 1:
            run(0)
        else:
            threads = [
                threading.Thread(target=run, args=(r,), name=f"meshtorch-{r}", daemon=True)
                for r in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        torch.set_num_threads(prev_threads)
    if errors:
        rank = root_cause(order, lambda r: is_comm_error(errors[r]))
        exc = errors[rank]
        raise processor_error(exc, rank, mesh.coords(rank)) from exc
    return results


def gather_results(comm: ThreadsCommunicator, out: Any) -> list[Any]:
    """Every thread-processor's ``out``, in rank order, on every one of them (no copies).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launch.threads import gather_results
        >>> mt.launch(lambda: gather_results(mt.current().comm, mt.current().rank), mesh="m:2")
        [[0, 1], [0, 1]]
    """
    calls = _GATHERS.setdefault(comm, itertools.count())
    group = tuple(range(comm.mesh.size))
    meta = {"kind": "gather_results", "axes": tuple(comm.mesh.axis_names)}
    vals = comm.hub.exchange(("gather_results", next(calls)), group, comm.rank, meta, out)
    return [vals[r][1] for r in group]
