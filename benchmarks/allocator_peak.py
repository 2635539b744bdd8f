"""A step's peak memory as the CPU allocator sees it: the independent reference for the planner.

The planner's tracer follows the storages of the ops it sees; this module does
not trust it. ``torch.profiler`` with ``profile_memory=True`` reports every
allocation and free of torch's CPU allocator, those made inside
``torch.distributed`` (gloo's buffers) and inside random number drawing
included. Profiling starts before the model is built, so every block alive
during the step is known, and the peak is the most bytes alive at once
between the step's start and end.

gloo's worker thread lets go of a collective's tensors a moment after the
caller resumes, so a tensor the caller drops right after a collective is
sometimes freed a little later than the program says. :func:`step_peaks`
measures several steady-state steps; their least is the program's own peak.
One profiler session runs per process, so this measures the ``torch``
backend (a process per processor), not threads.

    from allocator_peak import training_step_peak
    mt.launch(training_step_peak, cfg, 256, mesh="b:2", rules="batch:b", backend="torch")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function


def _peaks(prof, names: list[str]) -> list[int]:
    allocs, windows = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                allocs.append((e.start_time_ns, f.alloc_size < 0, f.ptr, f.alloc_size))
        elif e.name in names:
            windows[e.name] = (e.start_time_ns, e.end_time_ns)
    allocs.sort(key=lambda a: a[:2])  # at one instant, an allocation before a free
    sizes: dict[int, int] = {}
    live, best = 0, dict.fromkeys(names, 0)
    for t, _, ptr, n in allocs:
        if n > 0:
            # the allocator handing out a block it still lends means the block was freed where the
            # profiler does not look: by gloo's worker thread, which drops its reference to a
            # collective's tensors after the caller has resumed
            live += n - sizes.get(ptr, 0)
            sizes[ptr] = n
        else:  # a block allocated before profiling began is unknown: its free is left out
            live -= sizes.pop(ptr, 0)
        for name, (start, end) in windows.items():
            if start <= t <= end and live > best[name]:
                best[name] = live
    return [best[n] for n in names]


def step_peaks(setup: Callable[[], Any], step: Callable[[Any], Any], repeats: int = 3) -> list[int]:
    """The allocator's peak bytes during each of ``repeats`` calls ``step(state)``,
    ``state = setup()`` (everything the steps use is made inside the profile)."""
    names = [f"meshtorch_step_{i}" for i in range(repeats)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = setup()
        for name in names:
            with record_function(name):
                step(state)
        del state
    return _peaks(prof, names)


def training_step_peak(cfg, vocab: int, repeats: int = 3) -> int:
    """The least allocator peak of ``repeats`` steady-state training steps of ``cfg`` (the
    planner's ``training_step`` after its warm-up), on this processor."""
    from meshtorch.recipes.lm.steps import prepare, train_step

    return min(step_peaks(lambda: prepare(cfg, vocab), lambda s: train_step(cfg, *s), repeats))
