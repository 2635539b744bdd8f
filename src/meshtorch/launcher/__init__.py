"""Starting an SPMD program on every processor of a mesh.

- :func:`launch` (``mt.launch``) runs a Python function: on threads of this
  process (``backend="threads"``, the default), one process per processor over
  ``torch.distributed`` (``"torch"``), or one representative processor on
  ``meta`` tensors (``"meta"``, for planning).
- :func:`init_distributed` (``mt.init_distributed``) joins a world that
  torchrun started, for scripts run by plain ``torchrun``.
- ``meshtorch launch [--backend threads|torch] --mesh b:2,m:2 script.py``
  runs a script (:mod:`meshtorch.launcher.cli`).

Whatever the backend, a processor's exception reaches the caller as one that
is both its own class and a :class:`~meshtorch.errors.ProcessorError` naming
the processor (:mod:`meshtorch.launcher.failures`).

Example:
    >>> import meshtorch as mt
    >>> mt.launch(lambda x: x + mt.current().rank, 10, mesh="b:2,m:2")
    [10, 11, 12, 13]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.base import check_timeout
from meshtorch.comm.device import parse_device, threads_device
from meshtorch.context import current
from meshtorch.errors import MeshError
from meshtorch.launcher import processes, threads
from meshtorch.launcher.meta import run_meta
from meshtorch.launcher.world import init_distributed
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

BACKENDS = ("threads", "torch", "meta")

__all__ = ["BACKENDS", "gather_results", "init_distributed", "launch"]


def launch(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh | str | dict = "",
    rules: LayoutRules | str | dict = "",
    backend: str = "threads",
    timeout: float = 300.0,
    check: bool = False,
    nprocs: int | None = None,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once per processor; return the results in
    processor (row-major) order.

    Args:
        fn: the SPMD program; it sees its processor through ``mt.current()``.
        mesh: mesh spec, e.g. ``"b:2,m:4"``.
        rules: layout rules, e.g. ``"batch:b; d_ff:m"``; empty = all replicated.
        backend: ``"threads"`` (default: nothing to set up, ``fn`` need not be
            picklable), ``"torch"`` (one process per processor over
            ``torch.distributed``; ``fn`` and its arguments must be picklable), or
            ``"meta"`` (processor 0 alone, on ``meta`` tensors, collectives only
            counted: for planning; the result list has that one processor's result).
        nprocs: processes to spawn with ``backend="torch"`` (must equal the mesh
            size; default: the mesh size, or the torchrun world when under torchrun).
        timeout: seconds a collective may wait for its group before it raises (positive).
            On the threads backend it also bounds the launch: once a processor has
            returned, the others have ``timeout`` seconds to return too (see
            ``docs/distributed.md``, hangs and timeouts).
        check: record call sites so mismatched collectives name both sides.
        device: where each processor computes: ``"cpu"``; ``"cuda"`` (one GPU per
            processor: processor ``i`` of a node on ``cuda:i``; NCCL on the torch
            backend); ``"auto"`` (CUDA when this machine has a GPU for each of its
            processors, else the CPU). Default: ``"cpu"`` on threads, ``"auto"`` on
            torch (``MESHTORCH_DEVICE`` there); the meta backend ignores it. It is
            ``mt.current().device`` inside ``fn``, where meshtorch's factories
            (``mt.zeros``, ``mt.random``, layers' parameters, masks and positions) and
            ``mt.from_global`` (also of a host tensor) put their tensors. No device mode
            wraps ``fn``: a plain ``torch.zeros`` is made where torch makes it; pass it
            ``device=mt.current().device``.

    Raises:
        ArgumentError: ``timeout`` is zero, negative or not a number.
        ProcessorError: ``fn`` raised on some processor. The exception is also an
            instance of the class raised there (``except mt.errors.ShapeError``
            catches a processor's ``ShapeError``), names the processor's rank and
            coordinates (``.rank``, ``.coords``), and has the original exception
            as its ``__cause__`` (from another process, with the remote traceback
            as that exception's cause).

    Example:
        >>> import meshtorch as mt
        >>> mt.launch(lambda: mt.current().coords["m"], mesh="b:1,m:2")
        [0, 1]
        >>> def bad():
        ...     if mt.current().rank == 1:
        ...         raise mt.errors.ShapeError("dim d is 3, not 4")
        >>> try:
        ...     mt.launch(bad, mesh="m:2")
        ... except mt.errors.ShapeError as e:
        ...     print(e.coords, isinstance(e, mt.errors.ProcessorError))
        {'m': 1} True
    """
    timeout = check_timeout(timeout)
    mesh = Mesh(mesh)
    rules = LayoutRules(rules)
    rules.check(mesh)
    if backend not in BACKENDS:
        raise MeshError(f"backend {backend!r} is not one of {BACKENDS}")
    if device is not None:
        parse_device(device)  # a bad spec fails here, not once per processor
    if backend == "torch":
        return processes.launch_processes(fn, args, kwargs, mesh, rules, timeout, check, nprocs,
                                          None if device is None else str(device))
    if backend == "meta":
        return [run_meta(fn, args, kwargs, mesh, rules)]
    if nprocs not in (None, mesh.size):
        raise MeshError(f"mesh '{mesh}' has {mesh.size} processors but nprocs={nprocs}; "
                        f"pass nprocs={mesh.size} or leave it out")
    return threads.run_threads(fn, args, kwargs, mesh, rules, timeout, check,
                               threads_device(device, mesh.size))


def gather_results(out: Any) -> list[Any]:
    """Inside a running program: every processor's ``out`` in rank order, on every processor.

    This is what a launch returns, for a function that runs as one processor
    of a program already started (by ``meshtorch launch``, torchrun or an
    outer ``mt.launch``). On the ``meta`` backend only processor 0 runs, so
    the list holds its ``out`` alone; outside any launch, ``[out]``.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launcher import gather_results
        >>> mt.launch(lambda: gather_results(mt.current().coords["m"]), mesh="m:2")
        [[0, 1], [0, 1]]
        >>> gather_results("alone")
        ['alone']
    """
    comm = current().comm
    if comm.backend == "threads":
        return threads.gather_results(comm, out)
    if comm.backend == "torch":
        return processes.gather_results(out)
    return [out]
