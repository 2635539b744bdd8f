"""``mt.launch(fn, backend="threads")``: every processor a thread of this process.

The processors meet in a shared :class:`~meshtorch.comm.threads.Hub`; when one
raises or returns, the hub wakes those waiting for it (their collectives raise
``CommError``), and the launch itself gives up on processors stuck outside any
collective (see :func:`run_threads`), so no failure leaves the launch waiting.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.launcher.threads import run_threads
    >>> run_threads(lambda: mt.current().rank, (), {}, mt.Mesh("m:3"), mt.LayoutRules(""), 60, False)
    [0, 1, 2]
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.device import resolve_device
from meshtorch.comm.threads import Hub, ThreadsCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.errors import CommError
from meshtorch.launcher.failures import FAILURE_GRACE_S, is_comm_error, processor_error, root_cause
from meshtorch.launcher.program import run_program
from meshtorch.launcher.world import threads_sharing_process
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

# per communicator, the number of gather_results calls so far: the key that tells one call's
# exchange from the next, as the fastest thread may start the next before the slowest reads
_GATHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# after an interrupt (Ctrl-C), how long the launch waits for its processors to reach a collective and stop
INTERRUPT_GRACE_S = 10.0
# how long the launch waits for the system threads of processors that have finished to end (see _until_ended)
THREAD_END_S = 5.0
# where Linux lists this process's system threads, by id (Thread.native_id)
_TASKS = "/proc/self/task"


def run_threads(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
                timeout: float, check: bool, device: str | torch.device = "cpu") -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on one thread per processor; results in rank order.

    Each processor computes on ``device`` (see :func:`~meshtorch.comm.device.resolve_device`:
    with ``"cuda"`` processor ``i`` gets ``cuda:i``). No torch-function device mode wraps
    ``fn``: meshtorch's own factories put tensors on ``mt.current().device``; a plain
    ``torch.zeros`` in ``fn`` is made where torch would make it, so pass
    ``device=mt.current().device``.

    Raises the first failure that is not another processor's abandonment, as
    an exception that is both its class and a ``ProcessorError``. The launch
    never waits on a processor in vain: once one has raised, the others get
    :data:`~meshtorch.launcher.failures.FAILURE_GRACE_S` seconds to finish (those
    in a collective are woken at once); once one has returned, the others get
    ``timeout`` seconds. Processors still running then are named in the error
    and left behind as daemon threads (threads cannot be killed); their hub is
    closed, so their next collective raises, and a later launch never meets them.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launcher.threads import run_threads
        >>> run_threads(abs, (-2,), {}, mt.Mesh("b:2"), mt.LayoutRules(""), 60, False)
        [2, 2]
    """
    hub = Hub(mesh, timeout)
    n = mesh.size
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}
    order: list[int] = []
    keys: list[int] = [0] * n  # each processor context's key

    def run(rank: int) -> None:
        comm = ThreadsCommunicator(hub, rank, check=check)
        ctx = ProcessorContext(comm, rules)
        keys[rank] = ctx.key
        try:
            comm.device = resolve_device(device, comm)  # also this thread's current CUDA device
            with use(ctx):  # no device mode: meshtorch's factories put tensors on comm.device
                out = run_program(fn, args, kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            with hub.cond:
                errors[rank] = e
                order.append(rank)
                hub.fail(rank, e)
        else:
            with hub.cond:
                results[rank] = out
                hub.leave(rank)

    # N processors each running multi-threaded kernels would oversubscribe the cores: each gets its
    # share of the process's threads (the user's OMP_NUM_THREADS, else the cores)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads_sharing_process(n))
    try:
        running: list[int] = []
        if n == 1:
            run(0)
        else:
            keep_fake_cuda_guard()
            threads = [threading.Thread(target=run, args=(r,), name=f"meshtorch-{r}", daemon=True)
                       for r in range(n)]
            try:
                for t in threads:
                    t.start()
                running = _wait(hub, n)
            except BaseException:  # e.g. Ctrl-C: the processors stop at their next collective
                hub.close("the launch was interrupted")
                # and are waited for: an interpreter that exits while they are inside torch's kernels
                # can abort ("terminate called without an active exception") instead of exiting
                _stop(threads, time.monotonic() + INTERRUPT_GRACE_S)
                raise
            _stop([t for r, t in enumerate(threads) if r not in running], time.monotonic() + THREAD_END_S)
        with hub.cond:  # a snapshot: processors left behind may still finish later
            failures, first = dict(errors), list(order)
            note = _abandon(hub, running) if running else ""
    finally:
        torch.set_num_threads(prev_threads)
    if failures:
        _join_saves([keys[r] for r in failures])
        rank = root_cause(first, lambda r: is_comm_error(failures[r]))
        exc = failures[rank]
        raise processor_error(exc, rank, mesh.coords(rank), note=note) from exc
    if running:
        exc = CommError(f"{note}. Every processor must return, or make the collectives the others "
                        "wait in; pass a larger timeout= if they only need longer")
        raise processor_error(exc, running[0], mesh.coords(running[0]), where="(still running)") from exc
    return results


@functools.cache
def keep_fake_cuda_guard() -> None:
    """Have a thread that outlives the processors own the process's fake CUDA device guard.

    On a CUDA build of torch with no GPU visible (the GPU image's torch on a CPU host, or
    ``CUDA_VISIBLE_DEVICES=""``), every ``FakeTensorMode`` entry (each Dynamo trace) calls
    ``torch._C._ensureCUDADeviceGuardSet``, whose first call on a thread registers a guard
    that thread owns (c10 keeps it ``thread_local``) for the whole process. A thread-processor
    that traced first and then ended left the registry pointing at freed memory, and the next
    trace on any thread segfaulted in ``FakeTensorMode.__enter__`` (torch 2.11 CUDA; a CPU
    build registers nothing, a visible GPU skips the call). Once a registered fake guard is
    in place, later calls keep it, so this registers it once per process from the main thread
    (or from a daemon thread that never ends when launched from another thread) before the
    processors start. A no-op elsewhere, and where torch lacks the private call.

    Example:
        >>> from meshtorch.launcher.threads import keep_fake_cuda_guard
        >>> keep_fake_cuda_guard()  # once per process; later calls return at once
    """
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is None or not torch.backends.cuda.is_built() or torch.cuda.is_available():
        return
    # only a trace needs the guard: a failure to register it leaves eager launches alone (a
    # trace then meets torch's own error)
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(Exception):
            ensure()
        return
    registered = threading.Event()

    def keep() -> None:
        try:
            ensure()
        except Exception:  # noqa: BLE001 - as above; the launch must not wait for it forever
            registered.set()
            return
        registered.set()
        threading.Event().wait()  # the guard lives as long as this thread: the process

    threading.Thread(target=keep, name="meshtorch-fake-cuda-guard", daemon=True).start()
    registered.wait()


def _join_saves(keys: list[int]) -> None:
    """Wait for the background saves in flight of processors whose program raised (those that
    returned waited for theirs, :func:`~meshtorch.launcher.program.run_program`), without their
    agreement: the launch then returns with nothing left writing, and nothing kept for them."""
    background = sys.modules.get("meshtorch.checkpoint.background")  # (no save without it imported)
    if background is not None:
        for key in keys:
            background.drop(key)


def _wait(hub: Hub, n: int) -> list[int]:
    """Wait until every processor has finished, or until the launch gives up on the rest
    (see :func:`run_threads`); the ranks still running then."""
    with hub.cond:
        while len(hub.finished) < n:
            deadline = math.inf
            if hub.failed_at is not None:
                deadline = hub.failed_at + FAILURE_GRACE_S
            elif hub.left:
                deadline = min(hub.left.values()) + hub.timeout
            now = time.monotonic()
            if now >= deadline:
                return sorted(set(range(n)) - hub.finished)
            hub.finishes.wait(None if deadline == math.inf else deadline - now)
    return []


def _stop(threads: list[threading.Thread], deadline: float) -> None:
    """Wait until ``deadline`` for ``threads`` (processors that finished, or were told to stop) to
    end, system threads included (:func:`_until_ended`). A second Ctrl-C meanwhile does not cut the
    wait short: the process would abort instead of exiting; the wait is bounded."""
    while True:
        try:
            for t in threads:
                if t.ident is not None:  # started
                    t.join(max(0.0, deadline - time.monotonic()))
            _until_ended([t for t in threads if t.ident is not None and not t.is_alive()], deadline)
            return
        except KeyboardInterrupt:
            if time.monotonic() >= deadline:
                raise


def _until_ended(threads: list[threading.Thread], deadline: float) -> None:
    """Wait until ``deadline`` for the system threads of ``threads`` (joined) to end.

    ``Thread.join`` returns once a thread's Python code is done, before its system thread has
    run the destructors of its C++ thread-local state. After a ``backward()`` that raised (its
    collective abandoned because another processor failed, or on Ctrl-C), torch's autograd
    engine still holds the rest of that backward's work in such a thread-local queue, and
    freeing its tensors takes the GIL. If the interpreter has begun to exit by then, Python
    ends the thread with ``pthread_exit`` inside that C++ destructor and the whole process
    aborts: "terminate called without an active exception" (pytorch/pytorch#38228). So the
    launch returns only after those threads have ended. Linux lists its threads in
    ``/proc/self/task``; elsewhere this does not wait.
    """
    if not os.path.isdir(_TASKS):
        return
    pause = 0.0005
    for t in threads:
        task = os.path.join(_TASKS, str(t.native_id))
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(pause)  # the GIL is released: the ending thread may need it
            pause = min(2 * pause, 0.01)


def _abandon(hub: Hub, running: list[int]) -> str:
    """Close ``hub`` on the ``running`` processors; what happened, for the error. Holds ``cond``."""
    mesh = hub.mesh
    who = "processor" + ("s" if len(running) > 1 else "") + " " + ", ".join(
        f"{r} {mesh.coords(r)}" for r in running)
    if hub.failed is not None:
        frank = hub.failed[0]
        why = f"{who} still running {FAILURE_GRACE_S:g} s after processor {frank} {mesh.coords(frank)} failed"
    else:
        first = min(hub.left, key=hub.left.__getitem__)
        why = (f"{who} did not return within the {hub.timeout:g} s timeout after processor {first} "
               f"{mesh.coords(first)} returned")
    hub.close(f"the launch gave up: {why}")
    they, are = ("they", "are") if len(running) > 1 else ("it", "is")
    return (f"the launch gave up: {why}; {they} {are} stuck outside any collective (a long "
            f"computation, a sleep or an endless loop?) and {are} left behind as daemon threads, "
            f"which cannot be killed; {'their' if len(running) > 1 else 'its'} next collective raises")


def gather_results(comm: ThreadsCommunicator, out: Any) -> list[Any]:
    """Every thread-processor's ``out``, in rank order, on every one of them (no copies).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launcher.threads import gather_results
        >>> mt.launch(lambda: gather_results(mt.current().comm, mt.current().rank), mesh="m:2")
        [[0, 1], [0, 1]]
    """
    calls = _GATHERS.setdefault(comm, itertools.count())
    group = tuple(range(comm.mesh.size))
    meta = {"kind": "gather_results", "axes": tuple(comm.mesh.axis_names)}
    vals = comm.hub.exchange(("gather_results", next(calls)), group, comm.rank, meta, out)
    return [vals[r][1] for r in group]
