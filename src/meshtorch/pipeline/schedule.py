"""Pipeline schedules as data: a table of (slot, stage, micro-batch, kind) actions.

A schedule for ``p`` stages and ``m`` micro-batches lists, for every stage,
one forward (``"F"``) and one backward (``"B"``) action per micro-batch, each
in a unit **time slot** (forward and backward both take one slot). The same
table drives the executor (each stage runs its actions in slot order), the
simulator (which replaces unit slots by measured stage costs) and the PNG
timeline.

Dependencies (what any valid table respects):

- ``F(s, i)`` after ``F(s-1, i)``: a stage needs its input activation;
- ``B(s, i)`` after ``B(s+1, i)``: a stage needs its output gradient;
- ``B(s, i)`` after ``F(s, i)``: backward needs the forward's stash.

Schedules (``m`` micro-batches of one batch, flushed at the end of the batch):

- ``"gpipe"``: every stage runs all forwards, then all backwards (micro-batch
  order); each stage stashes all ``m`` micro-batches' activations.
- ``"1f1b"`` (PipeDream-Flush): stage ``s`` runs ``min(p-1-s, m)`` warm-up
  forwards, then alternates one forward and one backward, then drains the
  backwards; at most ``p-s`` micro-batches are in flight on stage ``s``.
- ``"2bw"`` (PipeDream-2BW): the 1F1B order; what differs is the weight
  semantics (two weight versions, updates delayed by one batch), which the
  executor implements; the table is the same.

Slots come from unit-time list scheduling of each stage's order under the
dependencies, so for uniform stages the bubble fraction is ``(p-1)/(m+p-1)``
for all three.

Example:
    >>> from meshtorch.pipeline.schedule import build
    >>> t = build("1f1b", stages=2, microbatches=3)
    >>> [(a.slot, a.kind, a.microbatch) for a in t.for_stage(1)]
    [(1, 'F', 0), (2, 'B', 0), (3, 'F', 1), (4, 'B', 1), (5, 'F', 2), (6, 'B', 2)]
    >>> t.slots, t.bubble_fraction()
    (8, 0.25)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshtorch.errors import PipelineError

SCHEDULES = ("gpipe", "1f1b", "2bw")
FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs the forward (``"F"``) or backward
    (``"B"``) of micro-batch ``microbatch`` in time slot ``slot``."""

    slot: int
    stage: int
    microbatch: int
    kind: str

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}t{self.slot}"


@dataclass(frozen=True)
class Schedule:
    """The action table of one batch: ``actions`` sorted by (slot, stage).

    Attributes:
        name: ``"gpipe"``, ``"1f1b"``, ``"2bw"`` or a user's name.
        stages: number of pipeline stages ``p``.
        microbatches: micro-batches per batch ``m``.
        actions: the table.
    """

    name: str
    stages: int
    microbatches: int
    actions: tuple[Action, ...]

    @property
    def slots(self) -> int:
        """Length of the table in unit slots."""
        return 1 + max(a.slot for a in self.actions)

    def for_stage(self, stage: int) -> list[Action]:
        """Stage ``stage``'s actions in the order it runs them."""
        return sorted((a for a in self.actions if a.stage == stage), key=lambda a: a.slot)

    def order(self, stage: int) -> list[tuple[str, int]]:
        """Stage ``stage``'s ``(kind, microbatch)`` sequence."""
        return [(a.kind, a.microbatch) for a in self.for_stage(stage)]

    def bubble_fraction(self) -> float:
        """Idle share of ``stages × slots`` (unit costs)."""
        return 1.0 - len(self.actions) / (self.stages * self.slots)

    def max_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran on ``stage`` and backward has not:
        how many activation stashes the stage holds at its peak."""
        live = peak = 0
        for a in self.for_stage(stage):
            live += 1 if a.kind == FORWARD else -1
            peak = max(peak, live)
        return peak

    def validate(self) -> None:
        """Raise :class:`PipelineError` unless every stage runs each micro-batch's
        forward and backward once, one action per slot, respecting the dependencies."""
        p, m = self.stages, self.microbatches
        seen: dict[tuple[int, str, int], int] = {}
        busy: set[tuple[int, int]] = set()
        for a in self.actions:
            if a.kind not in (FORWARD, BACKWARD) or not 0 <= a.stage < p or not 0 <= a.microbatch < m:
                raise PipelineError(f"schedule {self.name!r}: action {a} is outside {p} stages × {m} "
                                    "micro-batches or has a kind other than 'F'/'B'")
            if (a.stage, a.slot) in busy:
                raise PipelineError(f"schedule {self.name!r}: stage {a.stage} has two actions in slot "
                                    f"{a.slot}")
            busy.add((a.stage, a.slot))
            key = (a.stage, a.kind, a.microbatch)
            if key in seen:
                raise PipelineError(f"schedule {self.name!r}: {a} repeats an action")
            seen[key] = a.slot
        if len(seen) != 2 * p * m:
            missing = [(s, k, i) for s in range(p) for k in "FB" for i in range(m) if (s, k, i) not in seen]
            raise PipelineError(f"schedule {self.name!r}: actions missing, e.g. {missing[:3]} "
                                "(stage, kind, micro-batch)")
        for (s, k, i), t in seen.items():
            deps = [(s - 1, FORWARD, i)] if k == FORWARD and s > 0 else []
            if k == BACKWARD:
                deps = [(s, FORWARD, i)] + ([(s + 1, BACKWARD, i)] if s < p - 1 else [])
            for d in deps:
                if seen[d] >= t:
                    raise PipelineError(f"schedule {self.name!r}: {k}{i} on stage {s} in slot {t} runs "
                                        f"before {d[1]}{d[2]} on stage {d[0]} (slot {seen[d]}) it needs")


def stage_orders(name: str, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Each stage's ``(kind, microbatch)`` sequence for a named schedule."""
    p, m = stages, microbatches
    if name not in SCHEDULES:
        raise PipelineError(f"schedule {name!r} is not one of {SCHEDULES}")
    if p < 1 or m < 1:
        raise PipelineError(f"a pipeline needs >= 1 stage and >= 1 micro-batch, got {p} and {m}")
    orders = []
    for s in range(p):
        if name == "gpipe":
            order = [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
        else:
            warm = min(p - 1 - s, m)
            order = [(FORWARD, i) for i in range(warm)]
            for i in range(m - warm):
                order += [(FORWARD, warm + i), (BACKWARD, i)]
            order += [(BACKWARD, i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def from_orders(name: str, orders: Sequence[Sequence[tuple[str, int]]], microbatches: int) -> Schedule:
    """The table of per-stage orders: each action in the first unit slot after its
    stage's previous action and its dependencies (unit-time list scheduling).

    Raises:
        PipelineError: the orders deadlock (an action waits on one that cannot run first).
    """
    p = len(orders)
    done: dict[tuple[int, str, int], int] = {}
    pos = [0] * p
    free = [0] * p
    actions = []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] >= len(orders[s]):
                continue
            k, i = orders[s][pos[s]]
            deps = [(s - 1, FORWARD, i)] if k == FORWARD and s > 0 else []
            if k == BACKWARD:
                deps = [(s, FORWARD, i)] + ([(s + 1, BACKWARD, i)] if s < p - 1 else [])
            if any(d not in done for d in deps):
                continue
            slot = max([free[s]] + [done[d] + 1 for d in deps])
            done[(s, k, i)] = slot
            free[s] = slot + 1
            actions.append(Action(slot, s, i, k))
            pos[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: orders[s][pos[s]] for s in range(p) if pos[s] < len(orders[s])}
            raise PipelineError(f"schedule {name!r} deadlocks: stages wait on {stuck} (stage: next action)")
    table = Schedule(name, p, microbatches, tuple(sorted(actions, key=lambda a: (a.slot, a.stage))))
    table.validate()
    return table


def build(name: str, stages: int, microbatches: int) -> Schedule:
    """The table of schedule ``name`` (``"gpipe"``, ``"1f1b"`` or ``"2bw"``).

    Example:
        >>> build("gpipe", 2, 2).order(0)
        [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    """
    return from_orders(name, stage_orders(name, stages, microbatches), microbatches)
