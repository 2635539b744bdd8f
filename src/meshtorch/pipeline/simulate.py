"""Predict a pipeline's step time, bubble and per-stage memory from stage costs.

:func:`simulate` replays a :class:`~meshtorch.pipeline.schedule.Schedule`
with real durations: each action starts when its stage has finished the
previous action of its order and its inputs have arrived (the dependency's
end plus ``comm`` seconds for a hop between stages). The per-stage order is
the table's, so the executor and the simulator run the same schedule.

A table of ``T`` batches (``build_schedule(name, p, m, batches=T)``) is
replayed whole: ``total_time`` covers the run and ``step_time`` is the time
per batch, so flushed schedules (GPipe, 1F1B) and 2BW, which never flushes,
compare directly: for uniform stages the bubble is ``(p-1)/(m+p-1)`` for the
flushed ones and ``(p-1)/(T·m+p-1)`` for 2BW.

:func:`memory` is PipeDream-2BW's memory model (Narayanan et al., ICML 2021,
§3): a stage holds its weights (two versions under 2BW, one otherwise),
optimizer state, and the stashed activations of every micro-batch in flight
on it (``Schedule.max_in_flight``: ``m`` under GPipe, ``p - s`` under 1F1B and
2BW, with or without flushes). With activation recomputation only each
in-flight micro-batch's *input* is stashed, plus one micro-batch's full
activations while it is recomputed. :func:`simulate` reports the two counts
the model needs (``weight_versions``, ``in_flight``).

Example:
    >>> from meshtorch.pipeline import build_schedule, simulate
    >>> r = simulate(build_schedule("gpipe", 4, 4), forward=1.0, backward=2.0)
    >>> r.step_time, round(r.bubble_fraction, 4), round(3 / (4 + 3), 4)
    (21.0, 0.4286, 0.4286)
    >>> w = simulate(build_schedule("2bw", 4, 4, batches=5), forward=1.0, backward=2.0)
    >>> w.total_time, w.step_time, round(w.bubble_fraction, 4), round(3 / (5 * 4 + 3), 4), w.in_flight
    (69.0, 13.8, 0.1304, 0.1304, [4, 3, 2, 1])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshtorch.errors import PipelineError
from meshtorch.pipeline.schedule import BACKWARD, FORWARD, V_SHAPED, WEIGHT, Action, Schedule, dependencies


@dataclass
class Simulation:
    """What :func:`simulate` predicts for a table.

    Attributes:
        step_time: seconds per batch (``total_time / batches``).
        bubble_fraction: idle share of ``stages × total_time``.
        busy: seconds of work per stage (all batches).
        start, end: each action's predicted start and end (seconds).
        total_time: seconds from the first action's start to the last's end.
        batches: batches in the table.
        weight_versions: weight versions each stage holds (2 under 2BW).
        in_flight: most stashed micro-batches per stage (the activation term of :func:`memory`);
            (micro-batch, chunk) stashes with virtual stages.
        messages: point-to-point messages per batch (activations and gradients): ``2m(p·v - 1)``
            for ``v`` chunks per stage, ``v`` times 1F1B's ``2m(p-1)`` and then some.
    """

    step_time: float
    bubble_fraction: float
    busy: list[float]
    start: dict[Action, float] = field(repr=False)
    end: dict[Action, float] = field(repr=False)
    total_time: float = 0.0
    batches: int = 1
    weight_versions: int = 1
    in_flight: list[int] = field(default_factory=list)
    messages: int = 0


def _per_stage(x: float | Sequence[float], p: int, what: str, v: int = 1) -> list[float]:
    vals = [float(x)] * p if isinstance(x, (int, float)) else [float(c) for c in x]
    chunks = f" or per model chunk ({p * v})" if v > 1 else ""
    if len(vals) not in (p, p * v) or any(c < 0 for c in vals):
        raise PipelineError(f"{what} needs one non-negative cost per stage ({p}){chunks}, got {x!r}")
    return vals


def _chunk_costs(vals: list[float], schedule: Schedule) -> list[float]:
    """Seconds per model chunk: given per chunk, or ``1/v`` of its stage's (chunk ``c`` on the
    stage :meth:`Schedule.where` says: ``c mod p``, or the V's)."""
    p, v = schedule.stages, schedule.virtual_stages
    return vals if len(vals) == p * v else [vals[schedule.where(c)[0]] / v for c in range(p * v)]


def simulate(schedule: Schedule, forward: float | Sequence[float],
             backward: float | Sequence[float] | None = None, comm: float = 0.0,
             weight: float | Sequence[float] | None = None) -> Simulation:
    """Replay ``schedule`` with per-stage forward/backward durations (seconds per
    micro-batch through the whole stage, all its chunks; a number means the same for
    every stage; ``backward`` defaults to ``forward``) and ``comm`` seconds per
    stage-to-stage transfer. With ``v`` virtual stages each chunk's pass takes ``1/v``
    of its stage's time, or, given ``p·v`` costs, model chunk ``c``'s own (chunks of
    unequal cost, as the placer cuts them); every chunk boundary is a hop. A table with weight-gradient
    actions (``"zb"``) needs ``weight``, the ``W`` time; ``backward`` is then ``B``'s,
    the input gradient's.

    Example:
        >>> from meshtorch.pipeline import build_schedule
        >>> simulate(build_schedule("1f1b", 2, 2), forward=[1, 3], backward=[1, 3]).step_time
        14.0
        >>> z = simulate(build_schedule("zb", 4, 8), forward=1.0, backward=1.0, weight=1.0)
        >>> z.step_time, round(z.bubble_fraction, 4), round(3 / (3 * 8 + 3), 4)
        (27.0, 0.1111, 0.1111)
    """
    p, v = schedule.stages, schedule.virtual_stages
    split = schedule.split_backward
    if split and weight is None:
        raise PipelineError(f"schedule {schedule.name!r} splits the backward into B and W: give simulate the "
                            "weight-gradient time weight=... (backward= is then the input gradient's)")
    f = _chunk_costs(_per_stage(forward, p, "forward", v), schedule)
    b = _chunk_costs(_per_stage(forward if backward is None else backward, p, "backward", v), schedule)
    w = _chunk_costs(_per_stage(weight if split else 0.0, p, "weight", v), schedule)
    cost = {FORWARD: f, BACKWARD: b, WEIGHT: w}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    by_key: dict[tuple[int, int, str, int], float] = {}
    free = [0.0] * p
    messages = 0
    # batch b's update, on every stage at once (it may use collectives over the stages), after its
    # last backward or weight gradient anywhere: batch b + versions computes with the weights it makes
    versions, m = schedule.weight_versions, schedule.microbatches
    drained = [0.0] * schedule.batches
    # the table is sorted by slot, and every dependency (and batch b's update) sits in an earlier slot
    for a in sorted(schedule.actions, key=lambda a: (a.slot, a.stage)):
        s = a.stage
        ready = free[s]
        if a.microbatch // m >= versions:
            ready = max(ready, drained[a.microbatch // m - versions])
        for d in dependencies(s, a.chunk, a.kind, a.microbatch, p, v, split, schedule.placement):
            hop = d[0] != s
            messages += hop
            ready = max(ready, by_key[d] + (comm if hop else 0.0))
        start[a] = ready
        end[a] = ready + cost[a.kind][schedule.model_chunk(a)]
        by_key[(s, a.chunk, a.kind, a.microbatch)] = end[a]
        free[s] = end[a]
        if a.kind != FORWARD:
            drained[a.microbatch // m] = max(drained[a.microbatch // m], end[a])
    t = max(end.values()) - min(start.values())
    n = schedule.microbatches * schedule.batches
    busy = [0.0] * p
    for c in range(p * v):
        busy[schedule.where(c)[0]] += n * (f[c] + b[c] + w[c])
    bubble = 1.0 - sum(busy) / (p * t) if t > 0 else 0.0
    return Simulation(t / schedule.batches, bubble, busy, start, end, t, schedule.batches,
                      schedule.weight_versions, [schedule.max_in_flight(s) for s in range(p)],
                      messages // schedule.batches)


def chain_share(schedule: str, virtual_stages: int = 1) -> float:
    """The share of a stage's work per micro-batch that :func:`step_time_bound` may count as
    passing the stages before stage ``k`` ahead of its first action and after its last one.

    GPipe, 1F1B, 2BW: 1 (micro-batch 0's forward and the last one's backward pass the whole
    stages). Interleaved 1F1B: ``1/v`` (one chunk's forward and backward of each stage). ZB-H1:
    ``1/3``, the forward only, as the planner's replay splits a stage's work (F, B and W a third
    each): the weight gradients may run after a stage's last input gradient, so nothing is
    certain to follow it. ZB-V: ``1/6``, the forward of the first chunk (half the stage's).

    Example:
        >>> chain_share("1f1b"), chain_share("interleaved", 4), chain_share("zb"), chain_share("zbv", 2)
        (1.0, 0.25, 0.3333333333333333, 0.16666666666666666)
    """
    if schedule == "zb":
        return 1 / 3
    if schedule in V_SHAPED:
        return 1 / 6
    return 1.0 / virtual_stages


def step_time_bound(work: Sequence[float], microbatches: int, batches: int = 1,
                    spread: Sequence[float] | None = None, share: float = 1.0) -> float:
    """A lower bound on :func:`simulate`'s ``step_time`` for a schedule of ``len(work)`` stages
    whose stage ``s`` does ``work[s]`` seconds per batch (forward and backward of its
    ``microbatches`` micro-batches, split between them in any way; any ``comm``): any GPipe,
    1F1B or 2BW table with ``share=1``, another's with ``share=chain_share(name, v)``.

    Stage ``k`` cannot start before the first micro-batch's forward has passed the stages
    before it, and after its last backward that micro-batch's backward still has to pass them:
    ``T · step_time >= T · work[k] + share · sum(work[:k]) / microbatches`` for ``T`` batches.
    With even stages and ``share = 1`` that is the flushed schedules' bubble, ``(p-1)/m`` of a
    stage's work. Without ``share`` the bound does not hold for interleaved 1F1B, ZB-H1 or ZB-V
    (their first actions wait for only a chunk's forward, their last may be weight gradients).

    ``spread``: when part of a stage's work runs once after its micro-batches (a pipeline's
    update, which the planner adds after the replay), a lower bound per stage on the rest,
    the part spread over the micro-batches; only that part delays the stages after it, so
    the bound is ``max_k work[k] + share · sum(spread[:k]) / microbatches``. By default all of it.

    Example:
        >>> from meshtorch.pipeline import build_schedule
        >>> step_time_bound([3.0, 3.0], 4), simulate(build_schedule("1f1b", 2, 4), 0.25, 0.5).step_time
        (3.75, 3.75)
        >>> step_time_bound([1.0, 4.0, 2.0], 2) <= simulate(build_schedule("gpipe", 3, 2), [.2, .8, .4],
        ...                                                  [.3, 1.2, .6], comm=0.1).step_time
        True
    """
    if microbatches < 1 or batches < 1:
        raise PipelineError(f"step_time_bound needs microbatches and batches >= 1, got {microbatches} "
                            f"and {batches}")
    out, before = 0.0, 0.0
    for w, lead in zip(work, work if spread is None else spread):
        out = max(out, w + share * before / (microbatches * batches))
        before += lead
    return out


def memory(schedule: Schedule, weights: float | Sequence[float], activations: float | Sequence[float],
           inputs: float | Sequence[float] = 0.0, optimizer: float | Sequence[float] = 0.0,
           recompute: bool = False) -> list[float]:
    """Peak bytes per stage (PipeDream-2BW's model).

    Args:
        weights: bytes of one weight version per stage.
        activations: bytes a stage stashes for one micro-batch's backward (all its chunks;
            each of ``v`` chunks stashes ``1/v`` of it).
        inputs: bytes of one micro-batch's input to the stage (the stash under
            recomputation; with virtual stages, to each chunk).
        optimizer: bytes of optimizer state per stage.
        recompute: activation recomputation (stash inputs only).

    Returns ``versions·weights + optimizer + in_flight·activations/v`` per stage,
    or ``... + in_flight·inputs + activations/v`` with ``recompute``, where
    ``versions`` is 2 for ``"2bw"`` and 1 otherwise, ``v`` the virtual stages and
    ``in_flight`` counts (micro-batch, chunk) stashes, freed by the weight gradient
    under ``"zb"`` (:meth:`Schedule.max_in_flight`).

    Example:
        >>> from meshtorch.pipeline import build_schedule
        >>> memory(build_schedule("2bw", 4, 8), weights=10, activations=1)
        [24.0, 23.0, 22.0, 21.0]
        >>> memory(build_schedule("gpipe", 4, 8), weights=10, activations=1)
        [18.0, 18.0, 18.0, 18.0]
    """
    p = schedule.stages
    w, a = _per_stage(weights, p, "weights"), _per_stage(activations, p, "activations")
    x, o = _per_stage(inputs, p, "inputs"), _per_stage(optimizer, p, "optimizer")
    versions = schedule.weight_versions
    out = []
    for s in range(p):
        # with v chunks a stash is one chunk's: 1/v of the stage's activations, but a whole input
        k, v = schedule.max_in_flight(s), schedule.virtual_stages
        stash = k * x[s] + a[s] / v if recompute else k * a[s] / v
        out.append(versions * w[s] + o[s] + stash)
    return out
