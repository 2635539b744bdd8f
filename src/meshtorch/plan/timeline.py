"""When a step's collectives overlap its compute: the timeline a trace records, and its seconds.

A step run with :func:`meshtorch.overlap` issues some collectives asynchronously (a
prefetched group of parameter gathers, a bucket of gradients reduced while backward goes on)
and waits for them later; the compute issued in between runs while the call is on the wire.
The planner's tracer (:mod:`meshtorch.plan.tracing`) records, while it counts, a
:class:`Timeline`: every collective call in order (kind, axes, payload, whether asynchronous),
every wait of an asynchronous one, and at each of these moments the compute counted so far
(aten ops, FLOPs by dtype, kernels), so that a device spec can price the compute between any
two of them.

:func:`simulate` runs the priced timeline on two clocks, as the run does: the processor's
compute, and one link that carries the collectives in the order they are issued. A blocking
call (every per-use collective) waits for the link and then for itself: its time adds to the
step. An asynchronous call starts when the link is free and the processor has issued it; the
processor goes on until the call's wait, where it waits only for what is left of the call. So
a window from an issue to its wait costs the larger of its compute and its communication, and
the step is the compute plus the exposed parts of the collectives. Without asynchronous calls it
is exactly the sum of compute and communication, the planner's price before overlap.

Example (a call issued asynchronously before 2 ms of compute and waited for after it):
    >>> from meshtorch.plan.timeline import simulate
    >>> simulate([("issue", 0, 0.003, True), ("compute", 0.002), ("wait", 0)])  # 3 ms of link
    0.003
    >>> simulate([("issue", 0, 0.003, False), ("compute", 0.002)])  # the same call, blocking
    0.005
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# the compute counted up to a moment: (aten ops, FLOPs by dtype, kernels by count)
Mark = tuple[int, dict[str, int], dict[Any, float]]


@dataclass
class Timeline:
    """A traced step's collectives in order, with the compute counted at each issue and wait.

    ``calls``: ``[kind, axes, payload bytes, asynchronous]`` per call; ``events``: ``(call index,
    whether this is its wait, the compute counted then)`` in the order they happened.
    """

    calls: list[list[Any]] = field(default_factory=list)
    events: list[tuple[int, bool, Mark]] = field(default_factory=list)

    @property
    def asynchronous(self) -> int:
        """How many calls were issued asynchronously."""
        return sum(1 for c in self.calls if c[3])

    def order(self, end: Mark, compute: Callable[[int, dict[str, int], dict[Any, float]], float],
              comm: Callable[[str, tuple[str, ...], int], float], total: float | None = None) -> list[tuple]:
        """The timeline as :func:`simulate` takes it: the compute between two events priced by
        ``compute(aten ops, FLOPs by dtype, kernels)`` (then scaled so that the segments sum to
        ``total``, the step's compute as priced whole), each call by ``comm(kind, axes, bytes)``;
        ``end`` is the compute counted at the end of the step."""
        segments, items, last = [], [], (0, {}, {})
        for i, waits, mark in [*self.events, (-1, False, end)]:
            segments.append(compute(*_delta(mark, last)))
            last = mark
            items.append(len(segments) - 1)
            if i >= 0:
                kind, axes, nbytes, asynchronous = self.calls[i]
                items.append(("wait", i) if waits else ("issue", i, comm(kind, axes, nbytes), asynchronous))
        priced = sum(segments)
        scale = total / priced if total is not None and priced > 0 else 1.0
        return [("compute", segments[x] * scale) if isinstance(x, int) else x for x in items]


def _delta(now: Mark, before: Mark) -> tuple[int, dict[str, int], dict[Any, float]]:
    flops = {k: v - before[1].get(k, 0) for k, v in now[1].items() if v != before[1].get(k, 0)}
    kernels = {k: v - before[2].get(k, 0) for k, v in now[2].items() if v != before[2].get(k, 0)}
    return now[0] - before[0], flops, kernels


def simulate(order: Sequence[tuple]) -> float:
    """Seconds of a step given as ``("compute", s)``, ``("issue", call, s, asynchronous)`` and
    ``("wait", call)`` items in program order, on one processor and one link (see the module).

    Example (two gradient buckets of 2 ms each reduced during 3 ms of backward, the second
    issued after 1 ms; the link carries them one after the other: done at 4 ms, 1 ms exposed):
        >>> from meshtorch.plan.timeline import simulate
        >>> simulate([("issue", 0, 0.002, True), ("compute", 0.001), ("issue", 1, 0.002, True),
        ...           ("compute", 0.002), ("wait", 0), ("wait", 1)])
        0.004
    """
    now = link = 0.0
    ends: dict[int, float] = {}
    for item in order:
        if item[0] == "compute":
            now += item[1]
        elif item[0] == "issue":
            _, call, seconds, asynchronous = item
            link = max(now, link) + seconds
            if asynchronous:
                ends[call] = link
            else:
                now = link
        else:
            now = max(now, ends.pop(item[1], now))
    return max(now, *ends.values()) if ends else now  # a call never waited for ends the step


__all__ = ["Mark", "Timeline", "simulate"]
