"""``mt.launch``: run one SPMD function on every processor of a mesh.

Example:
    >>> import meshtorch as mt
    >>> mt.launch(lambda x: x + mt.current().rank, 10, mesh="b:2,m:2")
    [10, 11, 12, 13]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.threads import Hub, ThreadsCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.errors import CommError, MeshError, ProcessorError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

BACKENDS = ("threads", "torch", "meta")


def launch(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh | str | dict = "",
    rules: LayoutRules | str | dict = "",
    backend: str = "threads",
    timeout: float = 300.0,
    check: bool = False,
    nprocs: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once per processor; return the results in
    processor (row-major) order.

    Args:
        fn: the SPMD program; it sees its processor through ``mt.current()``.
        mesh: mesh spec, e.g. ``"b:2,m:4"``.
        rules: layout rules, e.g. ``"batch:b; d_ff:m"``; empty = all replicated.
        backend: ``"threads"``, ``"torch"`` (one process per processor over
            ``torch.distributed``; ``fn`` and its arguments must be picklable), or
            ``"meta"`` (processor 0 alone, on ``meta`` tensors, collectives only
            counted: for planning; the result list has that one processor's result).
        nprocs: processes to spawn with ``backend="torch"`` (must equal the mesh
            size; default: the mesh size, or the torchrun world when under torchrun).
        timeout: seconds a collective may wait for its group before it raises.
        check: record call sites so mismatched collectives name both sides.

    Raises:
        ProcessorError: ``fn`` raised on some processor; the message names its
            rank and coordinates and the original exception is the ``__cause__``.

    Example:
        >>> import meshtorch as mt
        >>> mt.launch(lambda: mt.current().coords["m"], mesh="b:1,m:2")
        [0, 1]
    """
    mesh = Mesh(mesh)
    rules = LayoutRules(rules)
    rules.check(mesh)
    if backend not in BACKENDS:
        raise MeshError(f"backend {backend!r} is not one of {BACKENDS}")
    if backend == "torch":
        from meshtorch.launcher import launch_processes

        return launch_processes(fn, args, kwargs, mesh, rules, timeout, check, nprocs)
    if backend == "meta":
        return [_launch_meta(fn, args, kwargs, mesh, rules)]
    if nprocs not in (None, mesh.size):
        raise MeshError(f"mesh '{mesh}' has {mesh.size} processors but nprocs={nprocs}")
    return _launch_threads(fn, args, kwargs, mesh, rules, timeout, check)


def _launch_meta(fn, args, kwargs, mesh, rules) -> Any:
    from meshtorch.comm.meta import MetaCommunicator

    ctx = ProcessorContext(MetaCommunicator(mesh), rules)
    try:
        with use(ctx), torch.device("meta"):
            return fn(*args, **kwargs)
    except Exception as e:
        raise ProcessorError(
            f"processor 0 {mesh.coords(0)} (meta backend) raised {type(e).__name__}: {e}", 0,
            mesh.coords(0)) from e


def _launch_threads(fn, args, kwargs, mesh, rules, timeout, check) -> list[Any]:
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
        # the root cause is the first failure that is not another processor's abandonment
        roots = [r for r in order if not isinstance(errors[r], CommError)] or order
        rank = roots[0]
        exc = errors[rank]
        coords = mesh.coords(rank)
        raise ProcessorError(
            f"processor {rank} {coords} raised {type(exc).__name__}: {exc}", rank, coords
        ) from exc
    return results
