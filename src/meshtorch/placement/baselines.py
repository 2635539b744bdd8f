"""Two baselines to compare the exact algorithms with.

* :func:`equal_flops` — the split a person makes by hand: walk a topological
  order and cut whenever a stage holds ``1/k`` of the accelerator compute (moving
  the cut earlier when memory runs out). Accelerators only.
* :func:`pipedream` — PipeDream's partitioner (Narayanan et al., SOSP 2019): its
  dynamic program over a linear order of layers, in its own cost model, where a
  stage costs ``max(compute / r (+ all-reduce), 2 · boundary communication)``
  (communication overlapped with compute), with optional data-parallel replicas.
  Its split is then evaluated in our model, like any other placement.

Both work on the colour-contracted graph in the same topological order as the
chain solver, so colocation always holds.

Example:
    >>> from meshtorch.placement import OpGraph, Problem
    >>> from meshtorch.placement.baselines import equal_flops
    >>> g = OpGraph()
    >>> for i, t in enumerate([1.0, 1.0, 1.0, 1.0]):
    ...     _ = g.add_node(f"l{i}", acc_time=t, cpu_time=t)
    >>> for i in range(3):
    ...     g.add_edge(f"l{i}", f"l{i + 1}")
    >>> equal_flops(g, Problem(devices=2)).max_load
    2.0
"""

from __future__ import annotations

import math
import time

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.prep import Contracted, contract, place_free
from meshtorch.placement.problem import ACC, Placement, Problem, evaluate

INF = math.inf


def _stages_from_cuts(c: Contracted, graph: OpGraph, cuts: list[tuple[int, int, int]]):
    """Stages from consecutive supernode ranges ``(lo, hi, replicas)``."""
    where = [-1] * len(graph)
    for s, (lo, hi, _) in enumerate(cuts):
        for v in range(lo, hi):
            for i in c.members[v]:
                where[i] = s
    place_free(c, where)
    stages = [[ACC, [], r] for _, _, r in cuts]
    for i, s in enumerate(where):
        stages[s][1].append(i)
    return [tuple(s) for s in stages]


def _boundary_comm(c: Contracted) -> list[float]:
    """comm[i]: cost of the hyperedges cut between supernodes ``< i`` and ``>= i``."""
    out = [0.0] * (c.m + 1)
    for mask, cost in c.hyper:
        lo = (mask & -mask).bit_length() - 1
        hi = mask.bit_length() - 1
        for i in range(lo + 1, hi + 1):
            out[i] += cost
    return out


def equal_flops(graph: OpGraph, problem: Problem) -> Placement:
    """Greedy equal-compute split along a topological order (see module docstring)."""
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    if prob.devices == 0:
        raise PlacementError("the equal-FLOPs baseline needs at least one accelerator")
    c = contract(graph, trivial=False)
    bad = [graph.nodes[c.members[v][0]].name for v in range(c.m) if math.isinf(c.acc[v])]
    if bad:
        raise PlacementError(f"equal-FLOPs places on accelerators only; {bad[:5]} cannot run there")
    total = sum(c.acc)
    target = total / prob.devices
    cuts: list[tuple[int, int, int]] = []
    lo, run, mem = 0, 0.0, 0.0
    for v in range(c.m):
        full = run >= target * (1 - 1e-12) and len(cuts) < prob.devices - 1
        too_big = mem + c.mem[v] > prob.memory
        if v > lo and (full or too_big):
            cuts.append((lo, v, 1))
            lo, run, mem = v, 0.0, 0.0
        run += c.acc[v]
        mem += c.mem[v]
    cuts.append((lo, c.m, 1))
    stages = _stages_from_cuts(c, graph, cuts)
    p = evaluate(graph, prob, stages, algorithm="greedy", strict=False)
    p.solve_seconds = time.perf_counter() - t0
    return p


def pipedream(graph: OpGraph, problem: Problem) -> Placement:
    """PipeDream's partitioner on a linear order of the graph (see module docstring)."""
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    k = prob.devices
    if k == 0:
        raise PlacementError("the PipeDream baseline needs at least one accelerator")
    c = contract(graph, trivial=False)
    m = c.m
    pre_t = [0.0]
    pre_mem = [0.0]
    pre_sync = [0.0]
    for v in range(m):
        pre_t.append(pre_t[-1] + c.acc[v])
        pre_mem.append(pre_mem[-1] + c.mem[v])
        pre_sync.append(pre_sync[-1] + c.sync[v])
    comm = _boundary_comm(c)
    rmax = prob.max_replicas

    def stage_cost(i: int, j: int, r: int) -> float:
        # PipeDream's T(i -> j, r): compute split over r replicas plus its weight sync
        if pre_mem[j] - pre_mem[i] > prob.memory:
            return INF
        t = (pre_t[j] - pre_t[i]) / r
        if r > 1:
            t += 2.0 * (r - 1) / r * (pre_sync[j] - pre_sync[i])
        return t

    # A[j][d]: best max stage time for the first j supernodes on d devices
    A = [[INF] * (k + 1) for _ in range(m + 1)]
    back: list[list[tuple[int, int] | None]] = [[None] * (k + 1) for _ in range(m + 1)]
    for j in range(1, m + 1):
        for d in range(1, k + 1):
            for r in range(1, min(rmax, d) + 1):
                whole = stage_cost(0, j, r)
                if d == r and whole < A[j][d]:
                    A[j][d], back[j][d] = whole, (0, r)
            for i in range(1, j):
                boundary = 2.0 * comm[i]
                for r in range(1, min(rmax, d - 1) + 1):
                    prev = A[i][d - r]
                    if prev == INF:
                        continue
                    val = max(prev, boundary, stage_cost(i, j, r))
                    if val < A[j][d]:
                        A[j][d], back[j][d] = val, (i, r)
    best_d = min(range(1, k + 1), key=lambda d: A[m][d])
    if A[m][best_d] == INF:
        raise PlacementError(
            f"PipeDream finds no split of {graph!r} into {k} stages within "
            f"{prob.memory:.4g} bytes each"
        )
    cuts = []
    j, d = m, best_d
    while j > 0:
        i, r = back[j][d]
        cuts.append((i, j, r))
        j, d = i, d - r
    cuts.reverse()
    stages = _stages_from_cuts(c, graph, cuts)
    p = evaluate(graph, prob, stages, algorithm="pipedream", strict=False)
    p.solve_seconds = time.perf_counter() - t0
    p.info = {"pipedream_model_load": A[m][best_d]}
    return p
