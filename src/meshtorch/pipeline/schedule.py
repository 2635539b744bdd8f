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

A table may cover several batches (``batches=T``): micro-batches are then
numbered ``0 .. T·m-1`` over the whole run (batch ``i // m``), and every
action carries the **weight version** it computes with. After the last
backward of batch ``b`` (on stage 0, the last stage to finish it) comes the
**update** of batch ``b``: :meth:`Schedule.update_slot` is the same slot on
every stage, so updates that need collectives over the stages (a tied
embedding's gradient, global-norm clipping) do not stall a stage in unit time.

Schedules:

- ``"gpipe"``: every stage runs all forwards, then all backwards (micro-batch
  order); each stage stashes all ``m`` micro-batches' activations. Batches
  are flushed: batch ``b+1`` starts after batch ``b`` drained and updated.
- ``"1f1b"`` (PipeDream-Flush): stage ``s`` runs ``min(p-1-s, m)`` warm-up
  forwards, then alternates one forward and one backward, then drains the
  backwards; at most ``p-s`` micro-batches are in flight on stage ``s``.
  Flushed between batches like GPipe. Batch ``b`` uses version ``b``.
- ``"2bw"`` (PipeDream-2BW, Narayanan et al., ICML 2021): 1F1B over all
  ``T·m`` micro-batches, **without flushes**: batch ``b+1`` enters while batch
  ``b``'s backwards drain. Batch ``b`` computes with weight version
  ``b-1`` (``W(-1) = W(0)``) in its forwards and backwards, and the update of
  batch ``b`` makes ``W(b+1) = W(b) − ν·∇f(W(b−1))``, first used by batch
  ``b+2``. Two versions live at a time (double buffering), which needs the
  update of batch ``b`` before the first forward of batch ``b+2``: true for
  ``m >= p-1`` (the paper takes ``m >= p``). With ``T = 1`` the table is
  1F1B's.

Slots come from unit-time list scheduling of each stage's order under the
dependencies, so for uniform stages the bubble fraction of one batch is
``(p-1)/(m+p-1)`` for all three; over ``T`` batches it stays so for the
flushed schedules and falls to ``(p-1)/(T·m+p-1)`` for 2BW (no bubble in
its steady state).

Example:
    >>> from meshtorch.pipeline.schedule import build
    >>> t = build("1f1b", stages=2, microbatches=3)
    >>> [(a.slot, a.kind, a.microbatch) for a in t.for_stage(1)]
    [(1, 'F', 0), (2, 'B', 0), (3, 'F', 1), (4, 'B', 1), (5, 'F', 2), (6, 'B', 2)]
    >>> t.slots, t.bubble_fraction()
    (8, 0.25)
    >>> w = build("2bw", stages=2, microbatches=2, batches=3)
    >>> [(a.kind, a.microbatch, a.version) for a in w.for_stage(0)][:6]
    [('F', 0, -1), ('F', 1, -1), ('B', 0, -1), ('F', 2, 0), ('B', 1, -1), ('F', 3, 0)]
    >>> w.slots, round(w.bubble_fraction(), 4), build("1f1b", 2, 2, batches=3).slots
    (14, 0.1429, 18)
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
    (``"B"``) of micro-batch ``microbatch`` in time slot ``slot``, computing with
    weight version ``version`` (``W(version)``; relative to the table's first batch)."""

    slot: int
    stage: int
    microbatch: int
    kind: str
    version: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}t{self.slot}"


@dataclass(frozen=True)
class Schedule:
    """The action table of ``batches`` batches: ``actions`` sorted by (slot, stage).

    Attributes:
        name: ``"gpipe"``, ``"1f1b"``, ``"2bw"`` or a user's name.
        stages: number of pipeline stages ``p``.
        microbatches: micro-batches per batch ``m``.
        actions: the table.
        batches: batches ``T`` in the table (micro-batch ``i`` is in batch ``i // m``).
    """

    name: str
    stages: int
    microbatches: int
    actions: tuple[Action, ...]
    batches: int = 1

    @property
    def weight_versions(self) -> int:
        """Weight versions a stage holds at once: 2 under 2BW (double buffering), else 1."""
        return 2 if self.name == "2bw" else 1

    def batch_of(self, microbatch: int) -> int:
        """The batch micro-batch ``microbatch`` belongs to."""
        return microbatch // self.microbatches

    def update_slot(self, batch: int) -> int:
        """The slot before which every stage applies the update of ``batch``: one
        after the last backward of that batch on any stage (stage 0's)."""
        return 1 + max(a.slot for a in self.actions
                       if a.kind == BACKWARD and self.batch_of(a.microbatch) == batch)

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
        p, m = self.stages, self.microbatches * self.batches
        seen: dict[tuple[int, str, int], int] = {}
        busy: set[tuple[int, int]] = set()
        version: dict[tuple[int, int], int] = {}
        for a in self.actions:
            if a.kind not in (FORWARD, BACKWARD) or not 0 <= a.stage < p or not 0 <= a.microbatch < m:
                raise PipelineError(f"schedule {self.name!r}: action {a} is outside {p} stages × {m} "
                                    "micro-batches or has a kind other than 'F'/'B'")
            if version.setdefault((a.stage, a.microbatch), a.version) != a.version:
                raise PipelineError(f"schedule {self.name!r}: {a} uses weight version {a.version} but the "
                                    f"other pass of micro-batch {a.microbatch} on stage {a.stage} uses "
                                    f"{version[(a.stage, a.microbatch)]}; a backward needs its forward's "
                                    "weights")
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
        # the update of batch b rewrites the buffer of batch b's version: no action of a batch that
        # reuses that buffer (b + versions) may run before it
        n = self.weight_versions
        for b in range(self.batches - n):
            u = self.update_slot(b)
            early = [a for a in self.actions if self.batch_of(a.microbatch) >= b + n and a.slot < u]
            if early:
                raise PipelineError(f"schedule {self.name!r}: {early[0]} of batch "
                                    f"{self.batch_of(early[0].microbatch)} runs before the update of batch "
                                    f"{b} "
                                    f"(slot {u}) that makes its weights; with {n} weight version(s) and "
                                    f"{self.microbatches} micro-batches per batch this needs microbatches >= "
                                    f"stages - 1 = {self.stages - 1}")


def stage_orders(name: str, stages: int, microbatches: int, batches: int = 1) -> list[list[tuple[str, int]]]:
    """Each stage's ``(kind, microbatch)`` sequence for a named schedule over ``batches`` batches."""
    p, m = stages, microbatches
    if name not in SCHEDULES:
        raise PipelineError(f"schedule {name!r} is not one of {SCHEDULES}")
    if p < 1 or m < 1 or batches < 1:
        raise PipelineError(f"a pipeline needs >= 1 stage, micro-batch and batch, got {p}, {m} and {batches}")

    def one_f_one_b(s: int, first: int, n: int) -> list[tuple[str, int]]:
        warm = min(p - 1 - s, n)
        order = [(FORWARD, first + i) for i in range(warm)]
        for i in range(n - warm):
            order += [(FORWARD, first + warm + i), (BACKWARD, first + i)]
        return order + [(BACKWARD, first + i) for i in range(n - warm, n)]

    orders = []
    for s in range(p):
        if name == "2bw":  # no flush: one 1F1B sequence over every micro-batch of the run
            orders.append(one_f_one_b(s, 0, batches * m))
            continue
        order = []
        for b in range(batches):  # flushed: batch after batch
            if name == "gpipe":
                order += [(FORWARD, b * m + i) for i in range(m)] + [(BACKWARD, b * m + i) for i in range(m)]
            else:
                order += one_f_one_b(s, b * m, m)
        orders.append(order)
    return orders


def from_orders(name: str, orders: Sequence[Sequence[tuple[str, int]]], microbatches: int,
                batches: int = 1) -> Schedule:
    """The table of per-stage orders: each action in the first unit slot after its
    stage's previous action and its dependencies (unit-time list scheduling).
    Batch ``b`` computes with weight version ``b - 1`` under ``"2bw"``, ``b`` otherwise.

    Raises:
        PipelineError: the orders deadlock (an action waits on one that cannot run first),
            or the table is invalid (:meth:`Schedule.validate`).
    """
    p = len(orders)
    delay = 1 if name == "2bw" else 0
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
            actions.append(Action(slot, s, i, k, i // microbatches - delay))
            pos[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: orders[s][pos[s]] for s in range(p) if pos[s] < len(orders[s])}
            raise PipelineError(f"schedule {name!r} deadlocks: stages wait on {stuck} (stage: next action)")
    table = Schedule(name, p, microbatches, tuple(sorted(actions, key=lambda a: (a.slot, a.stage))), batches)
    table.validate()
    return table


def build(name: str, stages: int, microbatches: int, batches: int = 1) -> Schedule:
    """The table of schedule ``name`` (``"gpipe"``, ``"1f1b"`` or ``"2bw"``) over ``batches`` batches.

    Example:
        >>> build("gpipe", 2, 2).order(0)
        [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    """
    return from_orders(name, stage_orders(name, stages, microbatches, batches), microbatches, batches)
