"""Pipeline schedules as data: a table of (slot, stage, micro-batch, kind, chunk) actions.

A schedule for ``p`` stages and ``m`` micro-batches lists, for every stage,
one forward (``"F"``) and one backward (``"B"``) action per micro-batch, each
in a unit **time slot** (forward and backward both take one slot). The same
table drives the executor (each stage runs its actions in slot order), the
simulator (which replaces unit slots by measured stage costs) and the PNG
timeline.

Dependencies (what any valid table respects), over model chunks ``c`` (with one
chunk per stage, ``c`` is the stage; with ``v`` virtual stages, local chunk ``k``
of stage ``s`` is ``c = k·p + s``):

- ``F(c, i)`` after ``F(c-1, i)``: a chunk needs its input activation;
- ``B(c, i)`` after ``B(c+1, i)``: a chunk needs its output gradient;
- ``B(c, i)`` after ``F(c, i)``: backward needs the forward's stash;
- ``W(c, i)`` after ``B(c, i)``: the weight gradient of a split backward.

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

- ``"interleaved"`` (interleaved 1F1B, Narayanan et al., SC 2021; Megatron-LM's
  order): each stage holds ``v = virtual_stages`` model chunks (model chunk ``c``
  on stage ``c mod p``, so every chunk boundary is a hop between stages: ``v``
  times the point-to-point messages). Micro-batches go through the chunks in
  rounds of ``p`` (``m`` must be a multiple of ``p``); stage ``s`` runs
  ``2(p-1-s) + (v-1)p`` warm-up chunk forwards, then one forward / one backward.
  Bubble ``(p-1)/(v·m+p-1)``; stage ``s`` stashes at most
  ``min(v·m, 2(p-1-s) + (v-1)p + 1)`` chunk activations (each ``1/v`` of the stage's).
- ``"zb"`` (ZB-H1, Qi et al., ICLR 2024): 1F1B with the backward split into the
  input gradient ``"B"`` (on the critical path) and the weight gradient ``"W"``
  (needed only by the update), deferred to fill the bubble: a stage runs a
  pending ``W`` whenever its next ``F``/``B`` is not ready, or when stage ``s``
  already defers ``s`` of them. A stash lives from ``F`` to ``W``: at most
  ``min(p, m)`` per stage, 1F1B's peak (stage 0's). With ``F = B = W`` in unit
  slots a batch takes ``3m + p - 1`` slots for ``m >= p`` (``2m + 2p - 1``
  otherwise): bubble ``(p-1)/(3m+p-1)``, against 1F1B's ``3(p-1)/(3m+3(p-1))``
  with its backward ``B + W`` (a third of the idle time). The simulator gives
  ``(p-1)(F+B-W)`` idle seconds per stage for ``W <= min(F, B)`` (the paper's).
- ``"zbv"`` (ZB-V, Qi et al., §6): the split backward over 2 chunks per stage in a V
  (model chunk ``c`` and ``2p-1-c`` on stage ``c``: :func:`where`), in the order of
  ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble``. At most ``2·min(p, m)``
  half-stage stashes per stage (1F1B's peak); with ``F = B = W`` a batch takes ``6m + p - 1``
  chunk slots for ``m >= 2p - 1``: idle ``(p-1)`` chunk passes per stage, half ZB-H1's.

The executor runs every one of them (:data:`SCHEDULES`), the interleaved one
with ``v`` model chunks per stage, ZB-V with its two.

Slots come from unit-time list scheduling of each stage's order under the
dependencies, so for uniform stages the bubble fraction of one batch is
``(p-1)/(m+p-1)`` for these three; over ``T`` batches it stays so for the
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

SCHEDULES = ("gpipe", "1f1b", "2bw", "zb", "interleaved", "zbv")  # the executor runs these
TABLES = SCHEDULES  # the tables the simulator and the timeline take: the same ones
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"

Key = tuple[int, int, str, int]  # (stage, local chunk, kind, micro-batch)


LOOP, V_SHAPE = "loop", "v"  # how model chunks sit on the stages (see where())
V_SHAPED = ("zbv",)  # the schedules whose tables use the V placement


def where(c: int, stages: int, placement: str = LOOP) -> tuple[int, int]:
    """(stage, local chunk) of model chunk ``c``. ``"loop"`` (interleaved 1F1B, and one chunk
    per stage): chunk ``c`` on stage ``c mod p``, local chunk ``c // p``. ``"v"`` (ZB-V, two
    chunks per stage): chunk ``c < p`` on stage ``c`` (local chunk 0), chunk ``c >= p`` on stage
    ``2p-1-c`` (local chunk 1), so the model goes down the stages and back up, and the first and
    the last chunk are both on stage 0.

    Example:
        >>> [where(c, 3) for c in range(6)]
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
        >>> [where(c, 3, "v") for c in range(6)]
        [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    """
    if placement == V_SHAPE:
        return (c, 0) if c < stages else (2 * stages - 1 - c, 1)
    return c % stages, c // stages


def model_chunk_of(stage: int, chunk: int, stages: int, placement: str = LOOP) -> int:
    """The model chunk that local ``chunk`` of ``stage`` is (the inverse of :func:`where`).

    Example:
        >>> model_chunk_of(1, 1, 3), model_chunk_of(1, 1, 3, "v")
        (4, 4)
        >>> model_chunk_of(0, 1, 3), model_chunk_of(0, 1, 3, "v")
        (3, 5)
    """
    if placement == V_SHAPE:
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


def dependencies(stage: int, chunk: int, kind: str, microbatch: int, stages: int, virtual_stages: int = 1,
                 split: bool = False, placement: str = LOOP) -> list[Key]:
    """The actions ``kind`` of ``microbatch`` on (``stage``, local ``chunk``) waits for:
    the previous model chunk's forward, the next model chunk's backward, its own
    forward (a backward) or its own backward (a weight gradient). Model chunk
    ``c`` (:func:`model_chunk_of`; ``chunk·p + stage`` under the loop placement)
    follows ``c - 1`` and precedes ``c + 1``, on the processors :func:`where` puts them
    (``(c ± 1) mod p`` under the loop placement).

    Example:
        >>> dependencies(0, 1, "F", 3, stages=2, virtual_stages=2)   # model chunk 2 after chunk 1
        [(1, 0, 'F', 3)]
        >>> dependencies(1, 0, "B", 3, stages=2, virtual_stages=2, split=True)
        [(1, 0, 'F', 3), (0, 1, 'B', 3)]
        >>> dependencies(1, 1, "F", 3, stages=2, virtual_stages=2, placement="v")  # chunk 2 after 1
        [(1, 0, 'F', 3)]
    """
    p, c, i = stages, model_chunk_of(stage, chunk, stages, placement), microbatch
    if kind == FORWARD:
        return [(*where(c - 1, p, placement), FORWARD, i)] if c > 0 else []
    if kind == WEIGHT:
        return [(stage, chunk, BACKWARD, i)]
    deps = [(stage, chunk, FORWARD, i)]
    return deps + ([(*where(c + 1, p, placement), BACKWARD, i)] if c < p * virtual_stages - 1 else [])


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage (processor) ``stage`` runs the forward (``"F"``), the
    backward (``"B"``; only the input gradient when the table also has ``"W"``
    actions) or the weight gradient (``"W"``) of micro-batch ``microbatch`` on its
    local model chunk ``chunk`` in time slot ``slot``, computing with weight version
    ``version`` (``W(version)``; relative to the table's first batch). Local chunk
    ``c`` of stage ``s`` is model chunk ``c·p + s`` (:meth:`Schedule.model_chunk`)."""

    slot: int
    stage: int
    microbatch: int
    kind: str
    version: int = 0
    chunk: int = 0

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{chunk}@s{self.stage}t{self.slot}"


@dataclass(frozen=True)
class Schedule:
    """The action table of ``batches`` batches: ``actions`` sorted by (slot, stage).

    Attributes:
        name: one of :data:`TABLES` or a user's name.
        stages: number of pipeline stages (processors on the axis) ``p``.
        microbatches: micro-batches per batch ``m``.
        actions: the table.
        batches: batches ``T`` in the table (micro-batch ``i`` is in batch ``i // m``).
        virtual_stages: model chunks per stage ``v`` (``p·v`` model chunks; chunk
            ``c`` on stage ``c mod p``, or as ``placement`` says).
        placement: ``"loop"`` or ``"v"`` (ZB-V's V shape): where model chunks sit (:func:`where`).
    """

    name: str
    stages: int
    microbatches: int
    actions: tuple[Action, ...]
    batches: int = 1
    virtual_stages: int = 1
    placement: str = LOOP

    @property
    def weight_versions(self) -> int:
        """Weight versions a stage holds at once: 2 under 2BW (double buffering), else 1."""
        return 2 if self.name == "2bw" else 1

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into input gradient ``"B"`` and weight gradient ``"W"``."""
        return any(a.kind == WEIGHT for a in self.actions)

    def model_chunk(self, action: Action) -> int:
        """The model chunk ``action`` computes: ``chunk·p + stage`` (:func:`model_chunk_of`)."""
        return model_chunk_of(action.stage, action.chunk, self.stages, self.placement)

    def where(self, chunk: int) -> tuple[int, int]:
        """(stage, local chunk) of model chunk ``chunk`` (:func:`where`)."""
        return where(chunk, self.stages, self.placement)

    def batch_of(self, microbatch: int) -> int:
        """The batch micro-batch ``microbatch`` belongs to."""
        return microbatch // self.microbatches

    def update_slot(self, batch: int) -> int:
        """The slot before which every stage applies the update of ``batch``: one
        after the last backward (or weight gradient) of that batch on any stage."""
        return 1 + max(a.slot for a in self.actions
                       if a.kind != FORWARD and self.batch_of(a.microbatch) == batch)

    @property
    def slots(self) -> int:
        """Length of the table in unit slots."""
        return 1 + max(a.slot for a in self.actions)

    def for_stage(self, stage: int) -> list[Action]:
        """Stage ``stage``'s actions in the order it runs them."""
        return sorted((a for a in self.actions if a.stage == stage), key=lambda a: a.slot)

    def order(self, stage: int) -> list[tuple[str, int]]:
        """Stage ``stage``'s ``(kind, microbatch)`` sequence (the chunks: :meth:`for_stage`)."""
        return [(a.kind, a.microbatch) for a in self.for_stage(stage)]

    def bubble_fraction(self) -> float:
        """Idle share of ``stages × slots`` (unit costs)."""
        return 1.0 - len(self.actions) / (self.stages * self.slots)

    def max_in_flight(self, stage: int) -> int:
        """Most (micro-batch, chunk) activation stashes ``stage`` holds at once: a forward
        stashes, the backward (the weight gradient when the backward is split) frees.
        With one chunk per stage, micro-batches whose forward ran and backward has not."""
        release = WEIGHT if self.split_backward else BACKWARD
        live = peak = 0
        for a in self.for_stage(stage):
            live += 1 if a.kind == FORWARD else -1 if a.kind == release else 0
            peak = max(peak, live)
        return peak

    def validate(self) -> None:
        """Raise :class:`PipelineError` unless every stage runs each micro-batch's
        forward and backward (and weight gradient, if any) once on each of its chunks,
        one action per slot, respecting the dependencies (:func:`dependencies`)."""
        p, v, m = self.stages, self.virtual_stages, self.microbatches * self.batches
        split = self.split_backward
        if self.placement not in (LOOP, V_SHAPE) or (self.placement == V_SHAPE and v != 2):
            raise PipelineError(f"schedule {self.name!r}: placement {self.placement!r} with {v} chunk(s) per "
                                f"stage; the placements are {LOOP!r} (any chunks) and {V_SHAPE!r} (2 chunks)")
        kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
        seen: dict[Key, int] = {}
        busy: set[tuple[int, int]] = set()
        version: dict[tuple[int, int, int], int] = {}
        for a in self.actions:
            if a.kind not in kinds or not 0 <= a.stage < p or not 0 <= a.microbatch < m \
                    or not 0 <= a.chunk < v:
                raise PipelineError(f"schedule {self.name!r}: action {a} is outside {p} stages × {v} "
                                    f"chunks × {m} micro-batches or has a kind other than 'F'/'B'/'W'")
            if version.setdefault((a.stage, a.chunk, a.microbatch), a.version) != a.version:
                raise PipelineError(f"schedule {self.name!r}: {a} uses weight version {a.version} but the "
                                    f"other pass of micro-batch {a.microbatch} on stage {a.stage} uses "
                                    f"{version[(a.stage, a.chunk, a.microbatch)]}; a backward needs its "
                                    "forward's weights")
            if (a.stage, a.slot) in busy:
                raise PipelineError(f"schedule {self.name!r}: stage {a.stage} has two actions in slot "
                                    f"{a.slot}")
            busy.add((a.stage, a.slot))
            key = (a.stage, a.chunk, a.kind, a.microbatch)
            if key in seen:
                raise PipelineError(f"schedule {self.name!r}: {a} repeats an action")
            seen[key] = a.slot
        if len(seen) != len(kinds) * p * v * m:
            missing = [(s, c, k, i) for s in range(p) for c in range(v) for k in kinds for i in range(m)
                       if (s, c, k, i) not in seen]
            raise PipelineError(f"schedule {self.name!r}: actions missing, e.g. {missing[:3]} "
                                "(stage, chunk, kind, micro-batch)")
        for (s, c, k, i), t in seen.items():
            for d in dependencies(s, c, k, i, p, v, split, self.placement):
                if seen[d] >= t:
                    mine, theirs = (f" chunk {c}", f" chunk {d[1]}") if v > 1 else ("", "")
                    raise PipelineError(f"schedule {self.name!r}: {k}{i} on stage {s}{mine} in slot {t} runs "
                                        f"before {d[2]}{d[3]} on stage {d[0]}{theirs} (slot {seen[d]}) it "
                                        "needs")
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


Order = list[tuple[str, int, int]]  # (kind, micro-batch, local chunk)


def _one_f_one_b(p: int, s: int, first: int, n: int) -> Order:
    warm = min(p - 1 - s, n)
    order = [(FORWARD, first + i, 0) for i in range(warm)]
    for i in range(n - warm):
        order += [(FORWARD, first + warm + i, 0), (BACKWARD, first + i, 0)]
    return order + [(BACKWARD, first + i, 0) for i in range(n - warm, n)]


def _interleaved(p: int, v: int, s: int, first: int, m: int) -> Order:
    """Megatron-LM's interleaved 1F1B on stage ``s`` (Narayanan et al., SC 2021): the
    ``v·m`` (chunk, micro-batch) passes go in rounds of ``p`` micro-batches per chunk,
    forwards chunk 0 → v-1, backwards chunk v-1 → 0; ``2(p-1-s) + (v-1)p`` warm-up
    forwards, then one forward / one backward."""
    n = v * m

    def unit(k: int, backward: bool) -> tuple[str, int, int]:
        c = (k // p) % v
        return (BACKWARD if backward else FORWARD, first + (k // (p * v)) * p + k % p,
                v - 1 - c if backward else c)

    warm = min(2 * (p - 1 - s) + (v - 1) * p, n) if v > 1 else min(p - 1 - s, n)
    order = [unit(k, False) for k in range(warm)]
    for j in range(n - warm):
        order += [unit(warm + j, False), unit(j, True)]
    return order + [unit(j, True) for j in range(n - warm, n)]


def _zb_h1(p: int, first: int, m: int) -> list[Order]:
    """ZB-H1 (Qi et al., ICLR 2024) for all stages: 1F1B's forwards and input-gradient
    backwards; each weight gradient ``W`` runs as soon as the stage would otherwise wait,
    or when stage ``s`` already defers ``s`` of them (so a stage holds at most ``p``
    micro-batches' activations, 1F1B's peak on stage 0). Unit-time list scheduling."""
    seq = [[(k, i, 0) for k, i, _ in _one_f_one_b(p, s, first, m)] for s in range(p)]
    done: dict[Key, int] = {}
    pos, pending = [0] * p, [[] for _ in range(p)]
    orders: list[Order] = [[] for _ in range(p)]
    t = 0
    while any(pos[s] < len(seq[s]) or pending[s] for s in range(p)):
        now: dict[Key, int] = {}
        for s in range(p):
            act = None
            ready = False
            if pos[s] < len(seq[s]):
                k, i, _ = seq[s][pos[s]]
                ready = all(done.get(d, t) < t for d in dependencies(s, 0, k, i, p, 1, True))
            if pending[s] and (len(pending[s]) > s or not ready):
                act = (WEIGHT, pending[s].pop(0), 0)
            elif ready:
                act = seq[s][pos[s]]
                pos[s] += 1
                if act[0] == BACKWARD:
                    pending[s].append(act[1])
            if act is not None:
                now[(s, 0, act[0], act[1])] = t
                orders[s].append(act)
        done.update(now)
        t += 1
    return orders


def _zb_v(p: int, first: int, m: int) -> list[Order]:
    """ZB-V (Qi et al., ICLR 2024, §6) for all stages, two chunks each in the V placement
    (:func:`where`): the per-stage order of ``torch.distributed.pipelining``'s
    ``ScheduleZBVZeroBubble``. Stage ``s`` runs ``2(p-s)-1`` forwards of its first chunk, then
    ``s`` pairs of forwards (second chunk, first chunk), then ``p-s`` rounds of F, B, W on its
    second chunk; in the steady state F, B, W on the first chunk then on the second; it drains
    the input gradients first and the weight gradients last. The order is built for
    ``max(m, 2p-1)`` micro-batches (what fills the V) and the extra ones are dropped: a sub-order
    of a valid order is valid, the actions of one micro-batch depending only on each other."""
    n = max(2 * p - 1, m)
    orders: list[Order] = []
    for s in range(p):
        order: Order = []
        cnt = {(FORWARD, 0): 0, (FORWARD, 1): 0, (BACKWARD, 0): 0, (BACKWARD, 1): 0}

        def add(kind: str, chunk: int, order: Order = order, cnt: dict = cnt) -> None:
            """The next micro-batch's pass of ``kind`` on local ``chunk``."""
            order.append((kind, cnt[kind, chunk], chunk))
            cnt[kind, chunk] += 1

        def backward(chunk: int, order: Order = order, cnt: dict = cnt) -> None:
            """The next micro-batch's B on ``chunk``, then at once its W."""
            i = cnt[BACKWARD, chunk]
            order.extend([(BACKWARD, i, chunk), (WEIGHT, i, chunk)])
            cnt[BACKWARD, chunk] += 1

        for _ in range(2 * (p - s) - 1):
            add(FORWARD, 0)
        for _ in range(s):
            add(FORWARD, 1)
            add(FORWARD, 0)
        for _ in range(p - s):
            add(FORWARD, 1)
            backward(1)
        while cnt[FORWARD, 1] < cnt[FORWARD, 0] or cnt[FORWARD, 0] < n:
            if cnt[FORWARD, 0] < n:
                add(FORWARD, 0)
            backward(0)
            add(FORWARD, 1)
            backward(1)
        w0, w1 = cnt[BACKWARD, 0], cnt[BACKWARD, 1]  # the weight gradients still to run
        for _ in range(s):
            add(BACKWARD, 0)
            add(BACKWARD, 1)
        for _ in range(p - s):
            add(BACKWARD, 0)
            order.append((WEIGHT, w0, 0))
            w0 += 1
        order += [(WEIGHT, i, 1) for i in range(w1, cnt[BACKWARD, 1])]
        order += [(WEIGHT, i, 0) for i in range(w0, cnt[BACKWARD, 0])]
        orders.append([(k, first + i, c) for k, i, c in order if i < m])
    return orders


def stage_orders(name: str, stages: int, microbatches: int, batches: int = 1,
                 virtual_stages: int = 1) -> list[Order]:
    """Each stage's ``(kind, microbatch, chunk)`` sequence for a named schedule over ``batches`` batches."""
    p, m, v = stages, microbatches, virtual_stages
    if name not in TABLES:
        raise PipelineError(f"schedule {name!r} is not one of {TABLES}")
    if p < 1 or m < 1 or batches < 1 or v < 1:
        raise PipelineError(f"a pipeline needs >= 1 stage, micro-batch, batch and virtual stage, got {p}, "
                            f"{m}, {batches} and {v}")
    if name in V_SHAPED and v != 2:
        raise PipelineError(f"schedule {name!r} places exactly 2 model chunks on each stage (a V: chunk c "
                            f"and 2p-1-c on stage c): it needs virtual_stages=2, got {v}")
    if v > 1 and name not in ("interleaved", *V_SHAPED):
        raise PipelineError(f"schedule {name!r} runs one model chunk per stage; virtual_stages={v} needs "
                            "schedule='interleaved' (any v) or 'zbv' (v = 2)")
    if name == "interleaved" and m % p:
        raise PipelineError(f"interleaved 1F1B sends micro-batches through the chunks in rounds of {p} "
                            f"(the stages): microbatches={m} must be a multiple of stages={p}")
    if name == "2bw":  # no flush: one 1F1B sequence over every micro-batch of the run
        return [_one_f_one_b(p, s, 0, batches * m) for s in range(p)]
    orders: list[Order] = [[] for _ in range(p)]
    for b in range(batches):  # flushed: batch after batch
        first = b * m
        if name in ("zb", "zbv"):
            for s, o in enumerate(_zb_h1(p, first, m) if name == "zb" else _zb_v(p, first, m)):
                orders[s] += o
            continue
        for s in range(p):
            if name == "gpipe":
                orders[s] += [(FORWARD, first + i, 0) for i in range(m)] + \
                             [(BACKWARD, first + i, 0) for i in range(m)]
            elif name == "interleaved":
                orders[s] += _interleaved(p, v, s, first, m)
            else:
                orders[s] += _one_f_one_b(p, s, first, m)
    return orders


def from_orders(name: str, orders: Sequence[Sequence[tuple]], microbatches: int,
                batches: int = 1, virtual_stages: int = 1, placement: str | None = None) -> Schedule:
    """The table of per-stage orders of ``(kind, microbatch)`` or ``(kind, microbatch,
    chunk)``: each action in the first unit slot after its stage's previous action and
    its dependencies (unit-time list scheduling), and, for the flushed schedules, an action of
    batch ``b`` after the update of batch ``b - 1`` (after every backward and weight gradient of
    that batch, on any stage). Batch ``b`` computes with weight
    version ``b - 1`` under ``"2bw"``, ``b`` otherwise. ``placement`` (:func:`where`):
    ``"v"`` for the names in :data:`V_SHAPED`, ``"loop"`` otherwise, by default.

    Raises:
        PipelineError: the orders deadlock (an action waits on one that cannot run first),
            or the table is invalid (:meth:`Schedule.validate`).
    """
    p, v = len(orders), virtual_stages
    placement = placement or (V_SHAPE if name in V_SHAPED else LOOP)
    rows = [[(o[0], o[1], o[2] if len(o) > 2 else 0) for o in order] for order in orders]
    split = any(k == WEIGHT for row in rows for k, _, _ in row)
    delay = 1 if name == "2bw" else 0
    # the flushed tables wait here for the update of the batch before; 2BW's order keeps batch b+2
    # after batch b's update by itself when m >= p - 1, and validate() says what it needs otherwise
    flushed = name != "2bw"
    # per batch: its backwards and weight gradients still to place, and the last slot of those placed
    left = [0] * batches
    for row in rows:
        for k, i, _ in row:
            left[i // microbatches] += k != FORWARD
    last = [-1] * batches
    done: dict[Key, int] = {}
    pos = [0] * p
    free = [0] * p
    actions = []
    while any(pos[s] < len(rows[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] >= len(rows[s]):
                continue
            k, i, c = rows[s][pos[s]]
            deps = dependencies(s, c, k, i, p, v, split, placement)
            b = i // microbatches - 1 if flushed else -1  # the batch whose update it waits for
            if any(d not in done for d in deps) or (b >= 0 and left[b]):
                continue
            slot = max([free[s], last[b] + 1 if b >= 0 else 0] + [done[d] + 1 for d in deps])
            done[(s, c, k, i)] = slot
            free[s] = slot + 1
            if k != FORWARD:
                left[i // microbatches] -= 1
                last[i // microbatches] = max(last[i // microbatches], slot)
            actions.append(Action(slot, s, i, k, i // microbatches - delay, c))
            pos[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: rows[s][pos[s]] for s in range(p) if pos[s] < len(rows[s])}
            raise PipelineError(f"schedule {name!r} deadlocks: stages wait on {stuck} (stage: next action)")
    table = Schedule(name, p, microbatches, tuple(sorted(actions, key=lambda a: (a.slot, a.stage))), batches,
                     v, placement)
    table.validate()
    return table


def build(name: str, stages: int, microbatches: int, batches: int = 1, virtual_stages: int = 1) -> Schedule:
    """The table of schedule ``name`` (one of :data:`TABLES`) over ``batches`` batches;
    ``virtual_stages`` model chunks per stage for ``"interleaved"``.

    Example:
        >>> build("gpipe", 2, 2).order(0)
        [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
        >>> [str(a) for a in build("interleaved", 2, 2, virtual_stages=2).for_stage(0)][:4]
        ['F0@s0t0', 'F1@s0t1', 'F0c1@s0t2', 'F1c1@s0t3']
        >>> build("zb", 2, 2).order(0)
        [('F', 0), ('F', 1), ('B', 0), ('W', 0), ('B', 1), ('W', 1)]
        >>> [str(a) for a in build("zbv", 2, 1, virtual_stages=2).for_stage(0)]  # model chunks 0 and 3
        ['F0@s0t0', 'F0c1@s0t3', 'B0c1@s0t4', 'W0c1@s0t5', 'B0@s0t8', 'W0@s0t9']
    """
    return from_orders(name, stage_orders(name, stages, microbatches, batches, virtual_stages), microbatches,
                       batches, virtual_stages)
