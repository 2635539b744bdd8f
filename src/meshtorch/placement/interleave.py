"""Chunks for interleaved 1F1B, and when ``v`` chunks per device beat one.

Interleaved 1F1B (Narayanan et al., SC 2021) cuts the model into ``p·v``
contiguous chunks, chunk ``c`` on device ``c mod p``. With ``m`` micro-batches
and every chunk taking ``t`` per micro-batch (forward and backward), a step
takes ``(v·m + p - 1) · t``: the bubble ``(p - 1) / (v·m + p - 1)`` shrinks
with ``v``, which is the published formula (1F1B is ``v = 1``). A chunk's load
here is its compute plus its transfers (:func:`~meshtorch.placement.evaluate`:
every chunk border is a hop, so ``v`` chunks per device send ``v`` times the
point-to-point messages of one stage per device). With chunks of unequal loads
every slot of the schedule waits for the slowest, so

    ``step_time = (v·m + p - 1) · max_c load(c)``,

exact for equal chunks and otherwise an upper bound on the replay of the
executor's own table (:func:`simulated_step_time`, which the tests check). The
placer (``Problem(schedule="interleaved", virtual_stages=v)``, :func:`place_chunks`:
the DP of :mod:`~meshtorch.placement.dp`, and the MILP when memory binds)
minimises ``max_c load(c)`` under each device's memory: the sum over its
chunks of their weights and of their stashed activations
(:func:`~meshtorch.placement.problem.chunk_in_flight`).

Interleaving pays when the bubble it removes, ``(p - 1) · (t₁ - t_v)`` with
``t_v`` the slowest chunk at ``v``, outweighs what the finer cut costs: more
transfers per chunk, and a slowest chunk that cannot shrink below the
graph's largest node. :func:`compare_virtual_stages` places the graph for
every ``v`` up to a limit and names the winner.

Example:
    >>> from meshtorch.placement import OpGraph, Problem
    >>> g = OpGraph()
    >>> for i in range(8):
    ...     _ = g.add_node(f"l{i}", acc_time=1.0, comm_time=0.0)
    >>> for i in range(7):
    ...     g.add_edge(f"l{i}", f"l{i + 1}")
    >>> choice = compare_virtual_stages(g, Problem(devices=2, microbatches=2), max_virtual_stages=5)
    >>> [(o.virtual_stages, o.step_time) for o in choice.options]  # 3: chunks of 2 and 1 node
    [(1, 12.0), (2, 10.0), (3, 14.0), (4, 9.0), (5, None)]
    >>> choice.best, round(choice.speedup, 3)
    (4, 1.333)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.problem import Placement, Problem


def place_chunks(graph: OpGraph, problem: Problem, *, ideal_limit: int = 3_000_000,
                 time_limit: float | None = 60.0) -> Placement:
    """The fastest ``p·v`` chunks (``problem.schedule == "interleaved"``): the DP, which is exact
    unless memory binds across a device's chunks; then the MILP (exact in its ``time_limit``),
    started from the DP's feasible answer when there is one.

    ``info['exact']`` is ``False`` only when neither proves its answer optimal
    (``info['lower_bound']`` then bounds the optimum from below).

    Example:
        >>> from meshtorch.placement import OpGraph, Problem
        >>> g = OpGraph()
        >>> for i, (t, mem) in enumerate([(2, 4), (2, 2), (2, 4), (2, 4), (1, 0), (2, 0)]):
        ...     _ = g.add_node(f"l{i}", acc_time=float(t), mem_bytes=float(mem))
        >>> for i in range(5):
        ...     g.add_edge(i, i + 1)
        >>> prob = Problem(devices=2, memory=8.0, schedule="interleaved", virtual_stages=2, microbatches=2)
        >>> pl = place_chunks(g, prob)  # the DP's chunks overflow a device; 4 bytes a chunk costs 5
        >>> pl.max_load, pl.algorithm, pl.info["device_memory"], pl.info["exact"]
        (4.0, 'dp+ilp', [8.0, 6.0], True)
    """
    from meshtorch.placement.dp import CHUNKS_OVERFLOW, solve_dp
    from meshtorch.placement.milp import solve_milp

    try:
        found: Placement | None = solve_dp(graph, problem, ideal_limit=ideal_limit)
    except PlacementError as e:
        if CHUNKS_OVERFLOW not in str(e):
            raise
        found = None
    if found is not None and found.info.get("exact", True):
        found.info["exact"] = True
        return found
    low = found.info["lower_bound"] if found is not None else 0.0
    try:
        milp = solve_milp(graph, problem, time_limit=time_limit, warm_start=found or False)
    except PlacementError:
        if found is None:
            raise
        return found
    proven = milp.info.get("lower_bound")
    milp.info["exact"] = bool(milp.info.get("optimal"))
    milp.info["lower_bound"] = max(low, proven if proven is not None else low)
    milp.algorithm = "dp+ilp"
    return milp


def _shape(placement: Placement) -> tuple[int, int, int]:
    """``(p, v, m)`` of a placement: devices, chunks per device, micro-batches."""
    prob = placement.problem
    if prob.interleaved:
        return prob.devices, prob.virtual_stages, int(prob.microbatches)
    p = len(placement.stages)
    return p, 1, int(prob.microbatches or p)


def step_time(placement: Placement) -> float:
    """``(v·m + p - 1) · max chunk load``: the interleaved (or, ``v = 1``, 1F1B) step.

    Example:
        >>> from meshtorch.placement import OpGraph, Problem, evaluate
        >>> g = OpGraph()
        >>> for i, t in enumerate([1.0, 2.0, 1.0, 1.0]):
        ...     _ = g.add_node(f"l{i}", acc_time=t)
        >>> prob = Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=2)
        >>> step_time(evaluate(g, prob, [("acc", [i]) for i in range(4)]))
        10.0
    """
    p, v, m = _shape(placement)
    return (v * m + p - 1) * placement.max_load


def bubble(placement: Placement) -> float:
    """Idle share of ``p ×`` :func:`step_time`: the devices' work is ``m`` times the chunk loads' sum."""
    p, _, m = _shape(placement)
    total = step_time(placement)
    return 1.0 - m * sum(st.load for st in placement.stages) / (p * total) if total > 0 else 0.0


def simulated_step_time(placement: Placement, backward_share: float = 2 / 3) -> float:
    """The step time of the executor's table replayed with each chunk's own load
    (:func:`~meshtorch.pipeline.simulate`), ``backward_share`` of it in the backward.

    Never more than :func:`step_time`; equal when the chunks' loads are equal.
    """
    from meshtorch.pipeline.schedule import build as build_schedule
    from meshtorch.pipeline.simulate import simulate

    p, v, m = _shape(placement)
    table = build_schedule("interleaved" if v > 1 else "1f1b", p, m, virtual_stages=v)
    loads = [st.load for st in placement.stages]
    return simulate(table, forward=[(1 - backward_share) * x for x in loads],
                    backward=[backward_share * x for x in loads]).step_time


@dataclass
class Option:
    """One ``v`` tried by :func:`compare_virtual_stages`: its placement, or why there is none."""

    virtual_stages: int
    placement: Placement | None = None
    reason: str = ""

    @property
    def step_time(self) -> float | None:
        return None if self.placement is None else step_time(self.placement)

    @property
    def bubble(self) -> float | None:
        return None if self.placement is None else bubble(self.placement)


@dataclass
class Choice:
    """What :func:`compare_virtual_stages` found: every option, the best ``v``, and its gain.

    ``speedup`` is ``step_time(v = 1) / step_time(best)`` (``None`` when ``v = 1`` has no placement).
    """

    devices: int
    microbatches: int
    options: list[Option]

    @property
    def best(self) -> int | None:
        placed = [o for o in self.options if o.placement is not None]
        return min(placed, key=lambda o: (o.step_time, o.virtual_stages)).virtual_stages if placed else None

    @property
    def speedup(self) -> float | None:
        one = self.options[0] if self.options and self.options[0].virtual_stages == 1 else None
        if self.best is None or one is None or one.placement is None:
            return None
        best = next(o for o in self.options if o.virtual_stages == self.best)
        return one.step_time / best.step_time if best.step_time else None

    def summary(self) -> str:
        """One line: which ``v`` wins and by how much."""
        if self.best is None:
            return f"no v places the graph on {self.devices} devices: " + "; ".join(
                f"v={o.virtual_stages}: {o.reason}" for o in self.options)
        if self.best == 1:
            return (f"v = 1 wins on {self.devices} devices with {self.microbatches} micro-batches: "
                    "more chunks per device do not pay for this graph")
        gain = f"{self.speedup:.3g}x the step rate of v = 1" if self.speedup else "v = 1 does not fit"
        return (f"v = {self.best} chunks per device wins ({gain}, {self.devices} devices, "
                f"{self.microbatches} micro-batches)")

    def table(self) -> str:
        """A text table: v, step time, bubble, slowest chunk, fullest device, or why not."""
        rows = [f"{'v':>3} {'step time':>12} {'bubble':>7} {'max chunk':>12} {'max memory':>12}"]
        for o in self.options:
            if o.placement is None:
                rows.append(f"{o.virtual_stages:>3} {'-':>12} {'-':>7} {'-':>12} {'-':>12}  {o.reason}")
                continue
            mem = max(o.placement.info.get("device_memory") or [0.0])
            exact = "" if o.placement.info.get("exact", True) else \
                "  (not proven optimal: the MILP ran out of time)"
            rows.append(f"{o.virtual_stages:>3} {o.step_time:>12.6g} {o.bubble:>7.1%} "
                        f"{o.placement.max_load:>12.6g} {mem:>12.4g}{exact}")
        return "\n".join([*rows, self.summary()])

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "microbatches": self.microbatches, "best": self.best,
            "speedup": self.speedup,
            "options": [{"virtual_stages": o.virtual_stages, "step_time": o.step_time, "bubble": o.bubble,
                         "reason": o.reason or None,
                         "placement": o.placement.to_dict() if o.placement is not None else None}
                        for o in self.options],
        }


def compare_virtual_stages(graph: OpGraph, problem: Problem, max_virtual_stages: int = 4,
                           algorithm: str = "dp", **kw) -> Choice:
    """Place ``graph`` for ``v = 1 .. max_virtual_stages`` chunks per device (interleaved
    1F1B, ``problem.devices`` devices, ``problem.microbatches`` micro-batches) and compare
    their :func:`step_time`; ``v`` that cannot be placed (too few nodes, memory) say why.
    """
    from meshtorch.placement.milp import solve_milp

    if max_virtual_stages < 1:
        raise PlacementError(f"max_virtual_stages must be >= 1, got {max_virtual_stages}")
    solvers = {"dp": place_chunks, "ilp": solve_milp}
    if algorithm not in solvers:
        raise PlacementError(f"chunks for the interleaved schedule are placed by {sorted(solvers)}, "
                             f"not {algorithm!r}")
    graph.validate()
    base = replace(problem, schedule="interleaved", virtual_stages=1).resolve(graph)
    options = []
    for v in range(1, max_virtual_stages + 1):
        try:
            chunked = replace(problem, schedule="interleaved", virtual_stages=v)
            options.append(Option(v, solvers[algorithm](graph, chunked, **kw)))
        except PlacementError as e:
            options.append(Option(v, reason=str(e)))
    return Choice(base.devices, int(base.microbatches), options)
