"""``mt.launch(fn, backend="torch")``: one process per processor over ``torch.distributed``.

Outside torchrun, fresh processes are spawned (``fn`` and its arguments are
pickled into them), results come back in rank order, and the first failure
is re-raised after the other processes are terminated rather than left
waiting. Under torchrun ``fn`` runs in this process as its rank and the
results of all ranks are gathered.

Example:
    >>> import meshtorch as mt
    >>> mt.launch(abs, -3, mesh="m:2", backend="torch")  # doctest: +SKIP
    [3, 3]
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.errors import CommError, MeshError, MeshTorchError, ProcessorError
from meshtorch.launch.failures import RemoteTraceback, processor_error, root_cause
from meshtorch.launch.world import RENDEZVOUS_MIN_S, in_torchrun, init_distributed, shutdown
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

# after the first failure, how long to wait for the other processes' reports
# (to tell a root cause from the CommErrors it provokes) before terminating them
FAILURE_GRACE_S = 2.0


def launch_processes(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
                     timeout: float, check: bool, nprocs: int | None = None) -> list[Any]:
    """``mt.launch`` for ``backend="torch"``; see :func:`meshtorch.launch`.

    Under torchrun (``nprocs`` not given) ``fn`` runs in this process as its
    rank and the results of all ranks are gathered; otherwise ``nprocs``
    (default: the mesh size) fresh processes are spawned.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launch.processes import launch_processes
        >>> launch_processes(abs, (-3,), {}, mt.Mesh("m:2"), mt.LayoutRules(""), 60, False)  # doctest: +SKIP
        [3, 3]
    """
    if nprocs is None and in_torchrun():
        return _run_in_world(fn, args, kwargs, mesh, rules, timeout, check)
    nprocs = mesh.size if nprocs is None else nprocs
    if nprocs != mesh.size:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but nprocs={nprocs}; pass nprocs={mesh.size} "
            f"or a mesh of {nprocs} processors")
    try:
        payload = pickle.dumps((fn, args, kwargs, str(mesh), str(rules), timeout, check))
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing
        raise ProcessorError(
            f"mt.launch(backend='torch') runs {getattr(fn, '__qualname__', fn)!r} in fresh processes, "
            f"so it and its arguments must be picklable: define the function at module level "
            f"({type(e).__name__}: {e})") from e
    return _spawn(payload, mesh, nprocs, timeout)


def gather_results(out: Any) -> list[Any]:
    """Every rank's ``out``, in rank order, on every rank of the ``torch.distributed`` world.

    Example (on each of 2 processes):
        >>> from meshtorch.launch.processes import gather_results
        >>> gather_results(current().rank)  # doctest: +SKIP
        [0, 1]
    """
    import torch.distributed as dist

    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, out)
    return results


def _run_in_world(fn, args, kwargs, mesh, rules, timeout, check) -> list[Any]:
    ctx = current()
    if ctx.comm.backend != "torch" or ctx.mesh != mesh:
        ctx = init_distributed(mesh, rules, check=check, timeout=timeout)
    else:
        ctx.rules = rules
    try:
        out = fn(*args, **kwargs)
    except BaseException as e:
        raise processor_error(e, ctx.rank, mesh.coords(ctx.rank)) from e
    return gather_results(out)


def _child(rank: int, world: int, host: str, port: int, payload: bytes, q) -> None:
    """Body of one spawned processor: join the world, run, report to the parent."""
    try:
        import torch.distributed as dist

        fn, args, kwargs, mesh, rules, timeout, check = pickle.loads(payload)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world))
        store = dist.TCPStore(host, port, None, False,
                              timeout=datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S)))
        init_distributed(mesh, rules, check=check, timeout=timeout, store=store, rank=rank,
                         world_size=world)
        out = fn(*args, **kwargs)
        q.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(e)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
            blob = None
        q.put((rank, "err", (blob, type(e).__name__, str(e), tb)))
    finally:
        shutdown()


def _spawn(payload: bytes, mesh: Mesh, nprocs: int, timeout: float) -> list[Any]:
    import multiprocessing as mp

    import torch.distributed as dist

    # the parent holds the rendezvous store: port 0 lets the OS pick a free port, no races
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S)))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, nprocs, "127.0.0.1", store.port, payload, q),
                         name=f"meshtorch-{r}", daemon=True) for r in range(nprocs)]
    results: dict[int, Any] = {}
    errors: dict[int, tuple] = {}
    order: list[int] = []
    first_error_at: float | None = None
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < nprocs:
            if first_error_at is not None and time.monotonic() - first_error_at > FAILURE_GRACE_S:
                break
            try:
                rank, status, body = q.get(timeout=0.1)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results and r not in errors]
                if dead:
                    try:  # a report may still be in the pipe
                        rank, status, body = q.get(timeout=1.0)
                    except queue_mod.Empty:
                        for r in dead:
                            errors[r] = (None, "ProcessExit", f"exited with code {procs[r].exitcode} "
                                         "without reporting a result", "")
                            order.append(r)
                        first_error_at = first_error_at or time.monotonic()
                        continue
                else:
                    continue
            if status == "ok":
                results[rank] = body
            else:
                errors[rank] = body
                order.append(rank)
                first_error_at = first_error_at or time.monotonic()
    finally:
        _terminate(procs)
        q.close()
    if errors:
        _raise_root(errors, order, mesh)
    return [pickle.loads(results[r]) for r in range(nprocs)]


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _raise_root(errors: dict, order: list[int], mesh: Mesh) -> None:
    rank = root_cause(order, lambda r: errors[r][1] == "CommError")
    blob, tname, msg, tb = errors[rank]
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - an exception that will not unpickle travels as text
            exc = None
    if exc is None:
        exc = CommError(msg) if tname == "CommError" else MeshTorchError(f"{tname}: {msg}")
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    err = processor_error(exc, rank, mesh.coords(rank))
    if type(exc).__name__ != tname:  # travelled as text: name the class the processor raised
        err = ProcessorError(f"processor {rank} {mesh.coords(rank)} raised {tname}: {msg}", rank,
                             mesh.coords(rank))
    raise err from exc
