"""``mt.launch(fn, backend="torch")``: one process per processor over ``torch.distributed``.

Outside torchrun, fresh processes are started (``fn`` and its arguments are
pickled into them), results come back in rank order, and the first failure
is re-raised after the other processes are terminated rather than left
waiting. Under torchrun ``fn`` runs in this process as its rank and the
results of all ranks are gathered.

The processes are forked from a fork server (``multiprocessing``'s
``"forkserver"`` start method, where the system has one; ``"spawn"`` elsewhere):
a fresh, single-threaded interpreter started on the first launch, which has
imported torch and meshtorch once (:mod:`meshtorch.launcher.preload`), so a
processor starts in milliseconds rather than re-importing them (about a second
of CPU each). As with ``"spawn"``, a processor inherits no thread, lock or GPU
state of the launcher, sees the launcher's ``sys.path``, working directory and
main module, and gets the launcher's environment and standard output and error
as they are at the launch (not as they were when the fork server started).
Environment variables that torch reads only while it is imported come from the
first launch's environment.

Example:
    >>> import meshtorch as mt
    >>> mt.launch(abs, -3, mesh="m:2", backend="torch")  # doctest: +SKIP
    [3, 3]
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.base import check_timeout
from meshtorch.context import current
from meshtorch.errors import CommError, MeshError, MeshTorchError, ProcessorError
from meshtorch.launcher.failures import FAILURE_GRACE_S, RemoteTraceback, processor_error, root_cause
from meshtorch.launcher.lifeline import EXIT_PARENT_DIED, die_with_parent
from meshtorch.launcher.program import run_program
from meshtorch.launcher.world import (
    RENDEZVOUS_MIN_S,
    in_torchrun,
    init_distributed,
    shutdown,
    threads_for,
)
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.streams import reader_may_leave


def launch_processes(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
                     timeout: float, check: bool, nprocs: int | None = None,
                     device: str | None = None) -> list[Any]:
    """``mt.launch`` for ``backend="torch"``; see :func:`meshtorch.launch`.

    Under torchrun (``nprocs`` not given) ``fn`` runs in this process as its
    rank and the results of all ranks are gathered; otherwise ``nprocs``
    (default: the mesh size) fresh processes are spawned. Each computes on
    ``device`` (see :func:`~meshtorch.launcher.world.init_distributed`).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launcher.processes import launch_processes
        >>> launch_processes(abs, (-3,), {}, mt.Mesh("m:2"), mt.LayoutRules(""), 60, False)  # doctest: +SKIP
        [3, 3]
    """
    timeout = check_timeout(timeout)
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ProcessorError(
            "mt.launch(backend='torch') was called while a fresh processor imported your script's "
            "main module: call it under `if __name__ == \"__main__\":` so that only the parent "
            "launches")
    if nprocs is None and in_torchrun():
        return _run_in_world(fn, args, kwargs, mesh, rules, timeout, check, device)
    nprocs = mesh.size if nprocs is None else nprocs
    if nprocs != mesh.size:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but nprocs={nprocs}; pass nprocs={mesh.size} "
            f"or a mesh of {nprocs} processors")
    try:
        payload = pickle.dumps((fn, args, kwargs, str(mesh), str(rules), timeout, check, device))
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing
        raise ProcessorError(
            f"mt.launch(backend='torch') runs {getattr(fn, '__qualname__', fn)!r} in fresh processes, "
            f"so it and its arguments must be picklable: define the function at module level "
            f"({type(e).__name__}: {e})") from e
    return _spawn(payload, mesh, nprocs, timeout)


def gather_results(out: Any) -> list[Any]:
    """Every rank's ``out``, in rank order, on every rank of the ``torch.distributed`` world.

    Example (on each of 2 processes):
        >>> from meshtorch.launcher.processes import gather_results
        >>> gather_results(current().rank)  # doctest: +SKIP
        [0, 1]
    """
    import torch.distributed as dist

    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, out)
    return results


def _run_in_world(fn, args, kwargs, mesh, rules, timeout, check, device) -> list[Any]:
    ctx = current()
    if ctx.comm.backend != "torch" or ctx.mesh != mesh:
        ctx = init_distributed(mesh, rules, check=check, timeout=timeout, device=device)
    else:
        ctx.rules = rules
    try:
        out = run_program(fn, args, kwargs)
    except BaseException as e:
        raise processor_error(e, ctx.rank, mesh.coords(ctx.rank)) from e
    return gather_results(out)


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


# the fork server imports this before it forks any processor (the start method where the system has one)
PRELOAD = ["meshtorch.launcher.preload"]


def _start_context() -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context that starts processors: ``"forkserver"`` where the system
    has it (its server imports :data:`PRELOAD` once), else ``"spawn"``.

    Example:
        >>> from meshtorch.launcher.processes import _start_context
        >>> _start_context().get_start_method() in ("forkserver", "spawn")
        True
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    # keep whatever this program asked its fork server to preload (the list is global, and
    # only read when the server starts)
    server = getattr(forkserver, "_forkserver", None)
    theirs = list(getattr(server, "_preload_modules", None) or [])
    ctx.set_forkserver_preload(theirs + [m for m in PRELOAD if m not in theirs])
    return ctx


class _Inherited:
    """What a forked processor takes from its launcher at the launch, as a spawned one would:
    the environment and the standard output and error (the fork server has the ones of the
    first launch). The two descriptors travel through ``multiprocessing``'s own fd passing.
    In the processor it unpickles to ``True``: "forked by the fork server"."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _adopt, (dict(os.environ), *(DupFd(fd) if _is_open(fd) else None for fd in (1, 2)))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # a launcher started with its output closed: the processor keeps the server's
        return False
    return True


def _adopt(env: dict[str, str], out, err) -> bool:
    os.environ.clear()
    os.environ.update(env)
    for fd, dup in ((1, out), (2, err)):
        src = dup.detach() if dup is not None else fd
        if src != fd:
            os.dup2(src, fd)
            os.close(src)
    return True


def _leave_fork_server(launcher_pid: int) -> int:
    """In a processor forked by the fork server: the pid it must die with (the server, whose
    child it is), after letting go of the server's liveness pipe. The server exits when the
    last holder of that pipe's write end is gone; had every processor kept a copy, a launcher
    killed by SIGKILL would leave the server, and the processors, alive."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    # the server outlives the launcher only until it sees the pipe close: if the launcher is
    # already gone, so is this run
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        os._exit(EXIT_PARENT_DIED)
    except PermissionError:
        pass
    return parent


def _child(rank: int, world: int, rendezvous: str, payload: bytes, q, launcher_pid: int,
           forked: bool = False) -> None:
    """Body of one processor: join the world, run, report to the launcher. ``forked``: started
    by the fork server (an :class:`_Inherited` in the launcher), else spawned."""
    die_with_parent(_leave_fork_server(launcher_pid) if forked else launcher_pid)
    # `meshtorch train --backend torch ... | head`: processor 0's lines go to the same pipe, whose
    # reader may leave; the run goes on without them
    with reader_may_leave():
        try:
            import torch.distributed as dist

            fn, args, kwargs, mesh, rules, timeout, check, device = pickle.loads(payload)
            # the user's OMP_NUM_THREADS stands; set here, not left to torch: a forked processor's OpenMP
            # read the environment when the fork server started, not the launch's
            torch.set_num_threads(threads_for(world))
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world))
            # every processor is on this machine: gloo's and NCCL's bootstrap connections
            # need no other interface (a user's setting still wins)
            lo = _loopback_interface()
            if lo:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
            store = dist.FileStore(os.path.join(rendezvous, "store"), world)
            store.set_timeout(datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S)))
            init_distributed(mesh, rules, check=check, timeout=timeout, store=store, rank=rank,
                             world_size=world, device=device)
            out = run_program(fn, args, kwargs)
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


class _Signalled(BaseException):
    """The launcher was asked to stop (SIGTERM, SIGHUP) while its processors ran."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, frame: Any) -> None:
    raise _Signalled(signum)


@contextlib.contextmanager
def _stop_signals_raise():
    """While the processors run, SIGTERM and SIGHUP raise in the launcher (as SIGINT's
    KeyboardInterrupt does) so that it stops its processors before it dies; only from the
    main thread, and only for signals whose handler is still the default."""
    installed: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _raise_signalled)
    try:
        yield
    finally:
        for sig, old in installed.items():
            signal.signal(sig, old)


def _spawn(payload: bytes, mesh: Mesh, nprocs: int, timeout: float) -> list[Any]:
    ctx = _start_context()
    forked = _Inherited() if ctx.get_start_method() == "forkserver" else False
    q = ctx.Queue()
    # the rendezvous is a file in a directory only this user can read: no port open to anyone
    rendezvous = tempfile.mkdtemp(prefix="meshtorch-rendezvous-")
    procs = [ctx.Process(target=_child, args=(r, nprocs, rendezvous, payload, q, os.getpid(), forked),
                         name=f"meshtorch-{r}", daemon=True) for r in range(nprocs)]
    results: dict[int, Any] = {}
    errors: dict[int, tuple] = {}
    order: list[int] = []
    first_error_at: float | None = None
    stop_signal = signal.SIGTERM
    try:
        with _stop_signals_raise():
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
                                    errors[r] = (None, "ProcessExit", _exit_text(procs[r].exitcode), "")
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
            except _Signalled as s:
                stop_signal = s.signum
                raise
            except KeyboardInterrupt:  # SIGINT: the workers get it too (a terminal sends it to all)
                stop_signal = signal.SIGINT
                raise
            finally:
                _terminate(procs, stop_signal)
                q.close()
                shutil.rmtree(rendezvous, ignore_errors=True)
    except _Signalled as s:
        # the processors are gone; now die of the signal as if it had never been caught
        signal.raise_signal(s.signum)
        raise
    if errors:
        _raise_root(errors, order, mesh, sorted(results))
    return [pickle.loads(results[r]) for r in range(nprocs)]


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} without reporting a result"
        except ValueError:
            pass
    return f"exited with code {code} without reporting a result"


def _terminate(procs, sig: int = signal.SIGTERM) -> None:
    """Stop every processor still running: ``sig``, then SIGKILL after a grace period."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:  # exited since is_alive
                pass
    deadline = time.monotonic() + 3.0
    for p in procs:
        if p.pid is None:  # never started (an earlier start failed): nothing to stop
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _raise_root(errors: dict, order: list[int], mesh: Mesh, returned: list[int]) -> None:
    rank = root_cause(order, lambda r: errors[r][1] == "CommError")
    blob, tname, msg, tb = errors[rank]
    if tname == "CommError" and returned:
        # nobody failed but some left early: they are why the collective could not complete
        msg += ("; processors that had already returned from the program, leaving the others "
                "waiting: " + ", ".join(f"{r} {mesh.coords(r)}" for r in returned))
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - an exception that will not unpickle travels as text
            exc = None
    if exc is not None and tname == "CommError" and returned:
        exc.args = (msg,)
    if exc is None:
        exc = CommError(msg) if tname == "CommError" else MeshTorchError(f"{tname}: {msg}")
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    err = processor_error(exc, rank, mesh.coords(rank))
    if type(exc).__name__ != tname:  # travelled as text: name the class the processor raised
        err = ProcessorError(f"processor {rank} {mesh.coords(rank)} raised {tname}: {msg}", rank,
                             mesh.coords(rank))
    raise err from exc
