"""The paper's integer program for latency, solved by HiGHS through ``scipy.optimize.milp``.

Written from Tarnawski et al. (NeurIPS 2020, §5); the model is that of
:mod:`meshtorch.placement.latency`. Accelerator ``d`` owns the subgraph slots
``d q .. d q + q - 1``, run in that order. Times are scaled so that the total
is 1000 (HiGHS's absolute tolerances), and ``B`` is an upper bound on any
finishing time (the warm start's latency when there is one).

* ``x[v, m]`` binary: node ``v`` in slot ``m``; ``h[v]`` binary: ``v`` on the
  host; ``sum_m x[v, m] + h[v] = 1``;
* convexity: ``c[., m]`` is a down-closed set holding slot ``m`` and none of
  its outside successors (``c[v] >= x[v]``, ``c[v] <= c[u]``,
  ``c[v] <= 1 + x[v] - x[u]`` per edge ``u -> v``);
* ``a[u, m] >= |x[v, m] - x[u, m]|`` per consumer ``v``: ``u``'s output crosses
  slot ``m``'s border;
* ``s[m] >= t[u] - B (1 - x[v, m] + x[u, m])`` per edge (wait for outside inputs),
  ``f[m] = s[m] + sum acc x + sum comm a``, ``t[v] >= f[m] - B (1 - x[v, m])``,
  ``s[m] >= f[m - 1]`` on one accelerator;
* host: ``t[v] >= cpu[v] h[v]`` and ``t[v] >= t[u] + cpu[v] h[v]`` per edge;
* memory per accelerator over its slots; a colour on one accelerator (or the host);
* minimise ``T >= t[v]``; two families of valid cuts tighten the LP bound
  without big-M: ``T >= p[v] >= p[u] + acc[v] (1 - h[v]) + cpu[v] h[v]`` (a
  path takes at least its nodes' times) and ``T >= f[m]``.

Example:
    >>> from meshtorch.placement import OpGraph, Problem
    >>> from meshtorch.placement.latency_milp import solve_latency_milp
    >>> g = OpGraph()
    >>> for n, acc, cpu in [("a", 1.0, 4.0), ("b", 2.0, 3.0), ("c", 1.0, 5.0)]:
    ...     _ = g.add_node(n, acc_time=acc, cpu_time=cpu, comm_time=0.5)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c")
    >>> p = solve_latency_milp(g, Problem(devices=1, cpus=1, objective="latency"))
    >>> round(p.latency, 6)  # all three on the accelerator, nothing to ship
    4.0
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.latency import evaluate_latency, greedy_latency
from meshtorch.placement.milp import Rows, from_start, result_info, solve_model
from meshtorch.placement.problem import ACC, CPU, Placement, Problem


def solve_latency_milp(
    graph: OpGraph,
    problem: Problem,
    *,
    time_limit: float | None = 60.0,
    gap: float = 0.0,
    warm_start: bool | Placement = True,
) -> Placement:
    """Least-latency placement found within ``time_limit`` s (``info['optimal']``: proven).

    ``warm_start`` is a latency placement to start from, or ``True`` for the
    greedy baseline's: its latency becomes a cutoff (and ``B``), and it is
    returned when HiGHS finds nothing better, so the result is never worse.
    ``info['lower_bound']`` and ``info['gap']`` are what HiGHS proved.
    """
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    if prob.objective != "latency":
        prob = replace(prob, objective="latency").resolve(graph)
    graph.validate()
    start = warm_start if isinstance(warm_start, Placement) else None
    if warm_start is True:
        try:
            start = greedy_latency(graph, prob)
        except PlacementError:
            start = None
    n = len(graph)
    k, q = prob.devices, prob.subgraphs
    M = k * q
    nodes = graph.nodes
    succ = graph.successors()
    edges = [(u, v) for u in range(n) for v in succ[u]]
    producers = [u for u in range(n) if succ[u] and nodes[u].comm_time > 0]
    total = sum(max(nd.acc_time or 0.0, nd.cpu_time or 0.0) for nd in nodes) \
        + sum(nodes[u].comm_time for u in producers)
    unit = total / 1000.0 if total > 0 else 1.0
    acc = [(nd.acc_time or 0.0) / unit for nd in nodes]
    cpu = [(nd.cpu_time or 0.0) / unit for nd in nodes]
    comm = {u: nodes[u].comm_time / unit for u in producers}
    big = (start.latency / unit * (1 + 1e-6) + 1.0 if start is not None
           else sum(cpu) + sum(acc) + M * sum(comm.values()) + 1.0)

    X = 0
    H = X + n * M
    C = H + n
    A = C + n * M
    T = A + len(producers) * M
    S = T + n
    F = S + M
    P = F + M  # p[v]: longest path of node times into v, a big-M-free lower bound on t[v]
    LAT = P + n
    nvar = LAT + 1
    xi = lambda v, m: X + v * M + m
    ci = lambda v, m: C + v * M + m
    ai = {u: A + i * M for i, u in enumerate(producers)}
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    ub[T:] = np.inf
    rows = Rows()
    for v, nd in enumerate(nodes):
        rows.add({**{xi(v, m): 1.0 for m in range(M)}, H + v: 1.0}, 1.0, 1.0)
        if nd.acc_time is None:
            ub[xi(v, 0):xi(v, 0) + M] = 0.0
        if nd.cpu_time is None or prob.cpus == 0:
            ub[H + v] = 0.0
        rows.add({T + v: 1.0, H + v: -cpu[v]}, 0.0, np.inf)
        rows.add({LAT: 1.0, T + v: -1.0}, 0.0, np.inf)
    for u, v in edges:
        rows.add({T + v: 1.0, T + u: -1.0, H + v: -cpu[v]}, 0.0, np.inf)
    # valid cuts that tighten the LP bound: a path takes at least its nodes' own times
    # (a subgraph finishes after all its nodes), and an accelerator runs its slots in turn
    for v in range(n):
        rows.add({P + v: 1.0, H + v: acc[v] - cpu[v]}, acc[v], np.inf)
        rows.add({LAT: 1.0, P + v: -1.0}, 0.0, np.inf)
    for u, v in edges:
        rows.add({P + v: 1.0, P + u: -1.0, H + v: acc[v] - cpu[v]}, acc[v], np.inf)
    for m in range(M):
        rows.add({LAT: 1.0, F + m: -1.0}, 0.0, np.inf)
    if math.isfinite(prob.memory):
        for d in range(k):
            row = {xi(v, m): nodes[v].mem_bytes for v in range(n) if nodes[v].mem_bytes
                   for m in range(d * q, d * q + q)}
            if row:
                rows.add(row, -np.inf, prob.memory)
    colours: dict[str, list[int]] = {}
    for v, nd in enumerate(nodes):
        if nd.color is not None:
            colours.setdefault(nd.color, []).append(v)
    for members in colours.values():
        for v, w in zip(members, members[1:]):
            rows.add({H + v: 1.0, H + w: -1.0}, 0.0, 0.0)
            for d in range(k):
                row: dict[int, float] = {}
                for m in range(d * q, d * q + q):
                    row[xi(v, m)] = 1.0
                    row[xi(w, m)] = -1.0
                rows.add(row, 0.0, 0.0)
    for m in range(M):
        for v in range(n):
            rows.add({ci(v, m): 1.0, xi(v, m): -1.0}, 0.0, np.inf)
            rows.add({T + v: 1.0, F + m: -1.0, xi(v, m): -big}, -big, np.inf)
        for u, v in edges:
            rows.add({ci(v, m): 1.0, ci(u, m): -1.0}, -np.inf, 0.0)
            rows.add({ci(v, m): 1.0, xi(v, m): -1.0, xi(u, m): 1.0}, -np.inf, 1.0)
            rows.add({S + m: 1.0, T + u: -1.0, xi(v, m): -big, xi(u, m): big}, -big, np.inf)
            if u in ai:
                rows.add({ai[u] + m: 1.0, xi(v, m): -1.0, xi(u, m): 1.0}, 0.0, np.inf)
                rows.add({ai[u] + m: 1.0, xi(u, m): -1.0, xi(v, m): 1.0}, 0.0, np.inf)
        busy = {F + m: 1.0, S + m: -1.0}
        for v in range(n):
            if acc[v]:
                busy[xi(v, m)] = -acc[v]
        for u, a in ai.items():
            busy[a + m] = -comm[u]
        rows.add(busy, 0.0, 0.0)
        if m % q:
            rows.add({S + m: 1.0, F + m - 1: -1.0}, 0.0, np.inf)
    if start is not None:
        rows.add({LAT: 1.0}, -np.inf, start.latency / unit * (1 + 1e-9) + 1e-9)

    cost = np.zeros(nvar)
    cost[LAT] = 1.0
    integrality = np.zeros(nvar)
    integrality[X:C] = 1
    res, log, lower = solve_model(cost, rows, integrality, lb, ub, gap, time_limit, unit)
    name = "ilp-latency"
    if res.x is None:
        if start is not None:
            proven = start.latency if res.status == 2 else lower
            return from_start(start, name, t0, res, proven, log, nvar, len(rows.lo))
        if res.status == 2:
            raise PlacementError(
                f"no latency placement fits: {k} accelerators of {prob.memory:.4g} bytes, "
                f"{q} subgraphs each, and {'a' if prob.cpus else 'no'} host"
            )
        raise PlacementError(f"the latency MILP found no placement within {time_limit} s "
                             f"({res.message})")
    x = res.x
    subgraphs: list = []
    for m in range(M):
        members = [v for v in range(n) if x[xi(v, m)] > 0.5]
        if members:
            subgraphs.append((ACC, members, m // q))
    host = [v for v in range(n) if x[H + v] > 0.5]
    if host:
        subgraphs.append((CPU, host))
    pl = evaluate_latency(graph, prob, subgraphs, algorithm=name, strict=start is None)
    if start is not None and (pl.violations or pl.latency > start.latency):
        return from_start(start, name, t0, res, lower, log, nvar, len(rows.lo))
    pl.solve_seconds = time.perf_counter() - t0
    pl.info.update(result_info(res, pl.latency, lower, unit, nvar, len(rows.lo), log, start))
    return pl
