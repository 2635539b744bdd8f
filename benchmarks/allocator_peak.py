"""A step's peak memory as the CPU allocator sees it: the independent reference for the planner.

The planner's tracer follows the storages of the ops it sees; this module does
not trust it. ``torch.profiler`` with ``profile_memory=True`` reports every
allocation and free of torch's CPU allocator, those made inside
``torch.distributed`` (gloo's buffers) and inside random number drawing
included. Profiling starts before the model is built, so every block alive
during the step is known, and the peak is the most bytes alive at once
between the step's start and end.

The profiler records only the frees made by the threads it watches, and
gloo's worker thread lets go of a collective's tensors a moment after the
caller resumes (how long depends on the machine's load). Unchecked, a tensor
the program drops right after a collective would be freed unseen, and
counted alive until its block is handed out again. So while measuring
(:func:`caller_frees`), every ``torch.distributed`` call returns, and every
``wait()`` of an asynchronous one (``isend``, or any call made with
``async_op=True``), only once gloo has let go of the call's
tensors and of their storages: each is then freed where the program drops
it, by the program's own thread, as the planner assumes. What gloo makes
for itself inside a call (a copy to reduce in place, say) dies with the
call's work, by then gone: such a block, if its free goes unseen, is freed
at the call's end. :func:`step_peaks` measures several steady-state steps;
their least is the program's own peak. One profiler session runs per
process, so this measures the ``torch`` backend (a process per processor),
not threads.

    from allocator_peak import training_step_peak
    mt.launch(training_step_peak, cfg, 256, mesh="b:2", rules="batch:b", backend="torch")
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.autograd.profiler import profile
from torch.profiler import record_function

_CALL = "meshtorch_collective"  # the profiler's window around each torch.distributed call
# an asynchronous call's issue and its wait, paired by a number: "meshtorch_issue_7", "meshtorch_wait_7"
_ISSUE, _WAIT = "meshtorch_issue_", "meshtorch_wait_"
_issues = itertools.count()


def _peaks(prof: profile, names: list[str]) -> list[int]:
    events, windows, calls = [], {}, []
    issued: dict[str, tuple[int, int]] = {}  # number -> an asynchronous call's issue window
    waited: dict[str, int] = {}  # number -> the end of its wait
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                events.append((e.start_time_ns, f.alloc_size < 0, f.ptr, f.alloc_size))
        elif e.name in names:
            windows[e.name] = (e.start_time_ns, e.end_time_ns)
        elif e.name == _CALL:
            calls.append((e.start_time_ns, e.end_time_ns))
        elif e.name.startswith(_ISSUE):
            issued[e.name[len(_ISSUE):]] = (e.start_time_ns, e.end_time_ns)
        elif e.name.startswith(_WAIT):
            waited[e.name[len(_WAIT):]] = e.end_time_ns
    events.sort(key=lambda a: a[:2])  # at one instant, an allocation before a free
    calls.sort()
    starts = [c[0] for c in calls]

    # a buffer gloo makes in the caller's thread as an asynchronous call is issued (a
    # reduce_scatter's copy of its input) is let go of by gloo's worker thread once the call is
    # done, and that free is unseen where the worker holds the work a moment after the wait
    # returns (a loaded machine): it lives until the wait, not until its block is handed out again
    by_issue = sorted((start, end, waited[k]) for k, (start, end) in issued.items() if k in waited)
    issue_starts = [w[0] for w in by_issue]

    def call_end(t: int) -> int | None:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and calls[i][0] <= t <= calls[i][1]:
            return calls[i][1]
        i = bisect.bisect_right(issue_starts, t) - 1
        return by_issue[i][2] if i >= 0 and by_issue[i][0] <= t <= by_issue[i][1] else None

    # every block's life: from its allocation to its free, or, when the free went unseen (the
    # allocator hands the block out again, or never frees it in view), to the end of the call it
    # was made in (gloo's own buffer) or else to the moment the allocator hands it out again
    changes: list[tuple[int, bool, int]] = []
    open_: dict[int, tuple[int, int]] = {}
    for t, _, ptr, n in events:
        if n > 0:
            if ptr in open_:
                born, size = open_.pop(ptr)
                end = call_end(born)
                changes.append((min(end, t) if end is not None else t, True, -size))
            open_[ptr] = (t, n)
            changes.append((t, False, n))
        elif ptr in open_:  # a block allocated before profiling began is unknown: its free is left out
            changes.append((t, True, -open_.pop(ptr)[1]))
    for born, size in open_.values():
        end = call_end(born)
        if end is not None:
            changes.append((end, True, -size))
    changes.sort(key=lambda c: c[:2])
    live, best = 0, dict.fromkeys(names, 0)
    for t, _, n in changes:
        live += n
        for name, (start, end) in windows.items():
            if start <= t <= end and live > best[name]:
                best[name] = live
    return [best[n] for n in names]


_BLOCKING = tuple(n for n in ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce",
                              "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single",
                              "broadcast", "send", "recv") if hasattr(dist, n))
_ASYNC = ("isend", "irecv")
_LET_GO_S = 5.0  # a worker still holding tensors after this is stuck, not slow: stop waiting


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(tuple(a), {}))
        elif isinstance(a, dist.P2POp):
            out.append(a.tensor)
    return out


def _owners(t: torch.Tensor) -> tuple[int, int]:
    """How many hold ``t`` and how many hold its storage (gloo may hold a view of it)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _let_go(tensors: list[torch.Tensor], owners: list[tuple[int, int]]) -> None:
    """Return once no tensor or storage has more owners than before the call: gloo has let go."""
    deadline = time.monotonic() + _LET_GO_S
    while time.monotonic() < deadline and any(
            a > b or c > d for t, (b, d) in zip(tensors, owners) for a, c in [_owners(t)]):
        os.sched_yield()


class _Waited:
    """An asynchronous call's work whose ``wait()`` also waits for gloo to let go of its tensors."""

    def __init__(self, work, tensors: list[torch.Tensor], owners: list[tuple[int, int]], number: int = -1):
        self._work, self._tensors, self._owners, self._number = work, tensors, owners, number

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(_CALL), torch.profiler.record_function(f"{_WAIT}{self._number}"):
            out = self._work.wait(*args, **kwargs)
            self._work = None  # our own reference holds the work's tensors too
            _let_go(self._tensors, self._owners)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _issued(start: Callable[[], Any], tensors: list[torch.Tensor], owners: list[tuple[int, int]]
            ) -> _Waited | None:
    """``start()``, an asynchronous call on ``tensors`` (``owners``: theirs before it), in a window
    of its own; its work, whose ``wait()`` lets go of them."""
    number = next(_issues)
    with torch.profiler.record_function(f"{_ISSUE}{number}"):
        out = start()
    return None if out is None else _Waited(out, tensors, owners, number)


def _blocking(fn):
    signature = inspect.signature(fn)

    def call(*args, **kwargs):
        tensors = _tensors(args, kwargs)
        owners = [_owners(t) for t in tensors]
        if signature.bind_partial(*args, **kwargs).arguments.get("async_op"):
            # called asynchronously (FSDP2's prefetch, overlapped collectives): gloo holds the
            # tensors until the work completes, so the wait lets go of them, not the call
            return _issued(lambda: fn(*args, **kwargs), tensors, owners)
        with torch.profiler.record_function(_CALL):
            out = fn(*args, **kwargs)
            _let_go(tensors, owners)
        return out
    return call


def _asynchronous(fn, many: bool = False):
    def call(*args, **kwargs):
        tensors = _tensors(args, kwargs)
        owners = [_owners(t) for t in tensors]
        out = fn(*args, **kwargs)
        if many:  # batch_isend_irecv: the caller waits on each; the last wait lets go of them all
            return [_Waited(w, tensors if i == len(out) - 1 else [], owners) for i, w in enumerate(out)]
        return None if out is None else _Waited(out, tensors, owners)
    return call


def _process_group_allreduce(find: Callable) -> Callable:
    """meshtorch's ``process_group_allreduce`` (``find``) whose method, the process group's own
    C++ ``allreduce`` that a flat gradient bucket is reduced by (not ``dist.all_reduce``),
    returns a work whose ``wait()`` waits for gloo to let go of the bucket, as ``dist``'s do."""
    def lookup(pg):
        method = find(pg)
        if method is None:
            return None

        def call(group, tensors, opts):
            held = list(tensors)
            return _issued(lambda: method(group, tensors, opts), held, [_owners(t) for t in held])
        return call
    return lookup


@contextlib.contextmanager
def caller_frees() -> Iterator[None]:
    """While inside, ``torch.distributed``'s calls return (and their works' ``wait()``) only
    after gloo's worker thread has let go of the call's tensors, so that the caller's thread,
    which the profiler watches, frees them; each call is a window named ``meshtorch_collective``.
    A free on another thread is not recorded at all: where gloo's worker dropped a bucket's last
    reference, that block counted as live to the profile's end (about 3% of data-parallel steps
    measured when meshtorch's direct ``ProcessGroup.allreduce`` went unwrapped)."""
    from meshtorch.comm import torch as comm_torch

    saved_find = comm_torch.process_group_allreduce
    saved = {n: getattr(dist, n) for n in (*_BLOCKING, *_ASYNC, "batch_isend_irecv")}
    # P2POp accepts only the op that is distributed_c10d's own isend or irecv (ring attention's
    # batch_isend_irecv builds them from dist.isend): wrapped there too, the wrappers are those ops
    c10d = dist.distributed_c10d
    saved_c10d = {n: getattr(c10d, n) for n in _ASYNC}
    try:
        for n in _BLOCKING:
            setattr(dist, n, _blocking(saved[n]))
        for n in _ASYNC:
            setattr(dist, n, _asynchronous(saved[n]))
            setattr(c10d, n, getattr(dist, n))
        dist.batch_isend_irecv = _asynchronous(saved["batch_isend_irecv"], many=True)
        comm_torch.process_group_allreduce = _process_group_allreduce(saved_find)
        yield
    finally:
        comm_torch.process_group_allreduce = saved_find
        for n, fn in saved.items():
            setattr(dist, n, fn)
        for n, fn in saved_c10d.items():
            setattr(c10d, n, fn)


def step_peaks(setup: Callable[[], Any], step: Callable[[Any], Any], repeats: int = 3) -> list[int]:
    """The allocator's peak bytes during each of ``repeats`` calls ``step(state)``,
    ``state = setup()`` (everything the steps use is made inside the profile)."""
    names = [f"meshtorch_step_{i}" for i in range(repeats)]
    # the autograd profiler that torch.profiler.profile drives, driven directly: the same CPU events,
    # without torch.profiler's start-up, whose hasattr(torch, "_inductor") imports Inductor and
    # Dynamo (about 1.2 s of CPU, once per measuring process)
    with caller_frees(), profile(use_cpu=True, profile_memory=True, use_kineto=True) as prof:
        state = setup()
        for name in names:
            with record_function(name):
                step(state)
        del state
    return _peaks(prof, names)


def training_step_peak(cfg, vocab: int, repeats: int = 3) -> int:
    """The least allocator peak of ``repeats`` steady-state training steps of ``cfg`` (the
    planner's ``training_step`` after its warm-up), on this processor."""
    from meshtorch.recipes.lm.steps import prepare

    return min(step_peaks(lambda: prepare(cfg, vocab), lambda s: s[0].run([s[1]], 1), repeats))
