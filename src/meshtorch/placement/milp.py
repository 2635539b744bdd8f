"""Mixed-integer program for placement, solved by HiGHS through ``scipy.optimize.milp``.

The general (non-contiguous) problem, and, with ``contiguous=True``, the
pipeline-ordered one that the DP solves — so it certifies the DP. Formulation
(after contracting colour classes only, so it shares nothing else with the DP):

* ``x[g, p]`` binary: group ``g`` on slot ``p``; slots ``0..k+ℓ-1`` in pipeline
  order; ``y[p]`` binary: slot ``p`` is a CPU (``sum y = ℓ``; fixed to the first ``ℓ``
  slots only in the general problem without ``relay``, where the order changes no load);
* ``z[u, p] >= |x[v, p] - x[u, p]|`` for every consumer ``v`` of producer ``u``:
  ``u``'s output crosses the border of slot ``p`` (paid once per producer);
  with ``Problem.relay``, ``z[u, p]`` is instead the crossing of the border after
  slot ``p`` (``u`` and ``v`` on different sides: their prefix sums over slots
  ``0..p`` differ), and slot ``p`` pays ``z[u, p-1] + z[u, p]``;
* ``L >= sum acc·x + sum comm·z - B·y[p]`` and ``L >= sum cpu·x - B·(1 - y[p])``;
* memory ``sum mem·x (+ (S - p)·sum act·x) <= M + B·y[p]``, with used slots packed at
  the end of the pipeline when activations are stashed, so that slot ``p``
  holds ``S - p`` micro-batches in flight;
* contiguous: ``sum_p p·x[u, p] <= sum_p p·x[v, p]`` for each order constraint.

Interleaved (``Problem.schedule == "interleaved"``, ``v`` chunks per device): the
slots are the ``p·v`` chunks, contiguous, none empty; the memory row is one per
device ``d``, over its slots ``d, d + p, ...``, each group counting its chunk's
stashes (:func:`~meshtorch.placement.problem.in_flight`). Unlike the DP, which
bounds each chunk alone, this is the device sums exactly.

Data-parallel replication (``Problem.max_replicas = R > 1``, training): binary
``w[p, r]`` says slot ``p`` is an accelerator stage on ``r`` replicas
(``sum_r w[p, r] <= 1 - y[p]``, ``sum r·w <= k``, a group needs an active slot);
the load row of slot ``p`` is written once per ``r``, switched on by
``w[p, r]``: ``L >= (acc·x + comm·z) / r + 2 (r-1)/r · sync·x - B (1 - w[p, r])``.
With stashed activations the in-flight count becomes a variable: ``d[p]``, the
devices from slot ``p`` to the end (a replicated slot counts ``r``), integer
``f[p] >= d[p] / r`` when ``w[p, r]``, and ``v[g, p] >= f[p] - D (1 - x[g, p])``
replaces ``f[p]·x[g, p]`` in the memory row. An empty slot may stay "active"
in a solution, which only overstates ``d``; so the optimum is exact.

Example:
    >>> from meshtorch.placement import OpGraph, Problem
    >>> from meshtorch.placement.milp import solve_milp
    >>> g = OpGraph()
    >>> for n, t in zip("abc", [2.0, 2.0, 2.0]):
    ...     _ = g.add_node(n, acc_time=t, cpu_time=t, comm_time=0.1)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c")
    >>> round(solve_milp(g, Problem(devices=3)).max_load, 6)  # b: 2 + a's output in + its own out
    2.2
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.prep import colocated
from meshtorch.placement.problem import (
    ACC,
    CPU,
    Placement,
    Problem,
    evaluate,
    in_flight,
    order_constraints,
)


@contextmanager
def captured_stdout(into: dict[str, str]) -> Iterator[None]:
    """Send everything written to file descriptor 1 to ``into['text']``.

    HiGHS writes some lines (``HighsMipSolverData::...``) from C++ straight to the
    process's stdout, whatever ``disp`` says, which would corrupt ``--json`` output;
    redirecting ``sys.stdout`` cannot catch them, so this swaps the descriptor.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            into["text"] = tmp.read().decode(errors="replace")


def run_highs(cost, constraints, integrality, bounds, options) -> tuple[object, str]:
    """``scipy.optimize.milp`` with HiGHS's own console output captured, not printed."""
    out: dict[str, str] = {}
    with captured_stdout(out):
        res = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds,
                   options=options)
    return res, out.get("text", "").strip()


class Rows:
    """Sparse constraint rows ``lo <= A x <= hi`` built incrementally."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, coefs: dict[int, float] | list[tuple[int, float]], lo: float, hi: float) -> None:
        row = len(self.lo)
        items = coefs.items() if isinstance(coefs, dict) else coefs
        for c, v in items:
            self.r.append(row)
            self.c.append(c)
            self.v.append(v)
        self.lo.append(lo)
        self.hi.append(hi)

    def constraint(self, nvar: int) -> LinearConstraint:
        a = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lo), nvar)).tocsr()
        return LinearConstraint(a, np.array(self.lo), np.array(self.hi))


def solve_model(cost, rows: Rows, integrality, lb, ub, gap: float, time_limit: float | None,
                unit: float) -> tuple[Any, str, float | None]:
    """HiGHS on ``min cost·x`` over ``rows`` and the bounds (:func:`run_highs`), to the relative gap
    ``gap`` within ``time_limit`` seconds: the result, HiGHS's output, and the proven lower bound in
    the objective's units (``unit`` per model unit; None where HiGHS has none). Every placement MILP
    solves through it: HiGHS's presolve (scipy 1.17) can end in "Solve error" (status 4) on a
    feasible model (replicated stages with stashes), which then solves without it."""
    options = {"disp": False, "mip_rel_gap": gap}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    res, log = run_highs(cost, rows.constraint(len(cost)), integrality, Bounds(lb, ub), options)
    if res.status == 4 and res.x is None:
        options["presolve"] = False
        res, log = run_highs(cost, rows.constraint(len(cost)), integrality, Bounds(lb, ub), options)
    lower = getattr(res, "mip_dual_bound", None)
    return res, log, float(lower) * unit if lower is not None and np.isfinite(lower) else None


def solve_milp(
    graph: OpGraph,
    problem: Problem,
    *,
    contiguous: bool = False,
    time_limit: float | None = 60.0,
    gap: float = 0.0,
    warm_start: bool | Placement | None = None,
) -> Placement:
    """Best placement found within ``time_limit`` seconds (optimal when ``info['optimal']``).

    ``info['lower_bound']`` is HiGHS's dual bound, a certificate: no placement
    (contiguous or not, as asked) has a smaller max load; ``info['gap']`` is
    ``(max_load - lower_bound) / max_load``, the proven relative gap.

    ``warm_start`` (default: on for the general problem) is a placement to start
    from, or ``True`` for the DP's contiguous optimum. scipy's ``milp`` cannot
    hand HiGHS a starting point, so its objective becomes a cutoff row
    (``L <= start``), which prunes the search, and the start is returned
    whenever HiGHS finds nothing better in time: the result is never worse than
    the start (``info['start']`` says what it was and what it cost).
    """
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    if prob.objective != "throughput":
        raise PlacementError("solve_milp minimises max load; for latency use solve_latency_milp")
    stash_rule = prob.training and prob.stash and (
        prob.recompute or prob.schedule == "gpipe" or prob.microbatches is not None)
    if stash_rule and (prob.recompute or prob.max_replicas > 1):
        raise PlacementError("the MILP models stashed activations without recompute, and with "
                             "replicas only under 1F1B/2BW with unbounded micro-batches; use the "
                             "DP (--algorithm dp) for this schedule")
    inter = prob.interleaved
    contiguous = contiguous or inter  # chunks are contiguous by definition
    start = _warm_start(graph, prob, contiguous, warm_start)
    R = prob.max_replicas
    graph.validate()
    n = len(graph)
    uf = colocated(graph)
    roots = sorted({uf.find(i) for i in range(n)})
    gid = {r: k for k, r in enumerate(roots)}
    grp = [gid[uf.find(i)] for i in range(n)]
    G = len(roots)
    k, ell = prob.slots, prob.cpus
    S = k + ell
    acc = np.zeros(G)
    cpu = np.zeros(G)
    mem = np.zeros(G)
    act = np.zeros(G)
    sync = np.zeros(G)
    no_acc = np.zeros(G, dtype=bool)
    no_cpu = np.zeros(G, dtype=bool)
    for i, nd in enumerate(graph.nodes):
        g = grp[i]
        if nd.acc_time is None:
            no_acc[g] = True
        else:
            acc[g] += nd.acc_time
        if nd.cpu_time is None:
            no_cpu[g] = True
        else:
            cpu[g] += nd.cpu_time
        mem[g] += nd.mem_bytes + (nd.weight_bytes if prob.schedule == "2bw" else 0.0)
        sync[g] += nd.sync_time
        if not nd.backward:
            act[g] += nd.act_bytes
    stash = bool(prob.training and prob.stash and act.any())
    # producers: group of the producer and the groups of its consumers
    producers: list[tuple[int, list[int], float]] = []
    for u, outs in enumerate(graph.successors()):
        c = graph.nodes[u].comm_time
        gs = sorted({grp[v] for v in outs} - {grp[u]})
        if c > 0 and gs:
            producers.append((grp[u], gs, c))

    # HiGHS stops within an absolute gap of 1e-6, so loads of nanoseconds (traced
    # graphs) would all look optimal: solve in units where the total time is 1000.
    # (Memory stays in bytes: a scaled bound would let rows overshoot by 1e-7 of it.)
    total_time = max(acc.sum(), cpu.sum(), sum(c for _, _, c in producers), 2.0 * sync.sum())
    unit = total_time / 1000.0 if total_time > 0 else 1.0
    acc, cpu, sync = acc / unit, cpu / unit, sync / unit
    producers = [(gu, gs, c / unit) for gu, gs, c in producers]

    # variable layout
    rep = R > 1
    X = 0
    Y = X + G * S
    Z = Y + S
    U = Z + len(producers) * S
    W = U + (S if stash and not rep else 0)  # w[p, r]: slot p on r replicas
    C = W + (S * R if rep else 0)  # c[p]: slot p is an active CPU
    F = C + (S if rep else 0)  # f[p]: micro-batches in flight on slot p
    D = F + (S if rep and stash else 0)  # d[p]: devices from slot p to the end
    V = D + (S if rep and stash else 0)  # v[g, p] >= f[p] x[g, p]
    L = V + (G * S if rep and stash else 0)
    nvar = L + 1
    xi = lambda g, p: X + g * S + p
    zi = lambda q, p: Z + q * S + p
    wi = lambda p, r: W + p * R + (r - 1)
    vi = lambda g, p: V + g * S + p
    big_acc = acc.sum() + 2 * sum(c for _, _, c in producers) + 2.0 * sync.sum() + 1.0
    big_cpu = cpu.sum() + 1.0
    mem_bound = prob.memory if math.isfinite(prob.memory) else None
    big_mem = (mem.sum() + max(S, prob.microbatches or 0) * act.sum()) + 1.0

    rows = Rows()
    for g in range(G):
        rows.add({xi(g, p): 1.0 for p in range(S)}, 1.0, 1.0)
    rows.add({Y + p: 1.0 for p in range(S)}, ell, ell)
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    ub[Z : Z + len(producers) * S] = np.inf
    ub[L] = np.inf
    ub[F:L] = np.inf
    if rep:
        for p in range(S):
            # a group sits on an active slot; an accelerator slot picks one replica count
            rows.add({Y + p: 1.0, **{wi(p, r): 1.0 for r in range(1, R + 1)}}, -np.inf, 1.0)
            rows.add({C + p: 1.0, Y + p: -1.0}, -np.inf, 0.0)  # c <= y
            for g in range(G):
                rows.add({xi(g, p): 1.0, C + p: -1.0,
                          **{wi(p, r): -1.0 for r in range(1, R + 1)}}, -np.inf, 0.0)
        rows.add({wi(p, r): float(r) for p in range(S) for r in range(1, R + 1)}, -np.inf, k)
    if not contiguous and not prob.relay:
        # Without relaying, where a slot sits changes no load, and moving the CPUs to the
        # front only lowers the accelerators' in-flight micro-batches: fix them there.
        # With relaying it would be wrong: a slot between a producer and its consumers
        # pays the value twice, and a CPU slot (load: its CPU time only) relays for free,
        # so the best pipeline may have a CPU in the middle; y stays free then.
        for p in range(S):
            lb[Y + p] = ub[Y + p] = 1.0 if p < ell else 0.0
    for g in range(G):
        for p in range(S):
            if no_acc[g]:
                rows.add({xi(g, p): 1.0, Y + p: -1.0}, -np.inf, 0.0)  # x <= y
            if no_cpu[g]:
                rows.add({xi(g, p): 1.0, Y + p: 1.0}, -np.inf, 1.0)  # x <= 1 - y
    for q, (gu, gs, _) in enumerate(producers):
        for p in range(S):
            if prob.relay:
                # z[q, p]: u's output crosses the border after slot p (prefix sums differ)
                if p == S - 1:
                    ub[zi(q, p)] = 0.0
                    continue
                for gv in gs:
                    diff = {xi(gu, t): 1.0 for t in range(p + 1)}
                    for t in range(p + 1):
                        diff[xi(gv, t)] = -1.0
                    rows.add({zi(q, p): 1.0, **diff}, 0.0, np.inf)
                    rows.add({zi(q, p): 1.0, **{c: -v for c, v in diff.items()}}, 0.0, np.inf)
                continue
            for gv in gs:
                rows.add({zi(q, p): 1.0, xi(gv, p): -1.0, xi(gu, p): 1.0}, 0.0, np.inf)
                rows.add({zi(q, p): 1.0, xi(gu, p): -1.0, xi(gv, p): 1.0}, 0.0, np.inf)

    def comm_terms(p: int, scale: float) -> dict[int, float]:
        """``-comm / scale`` on the crossing variables slot ``p`` pays."""
        terms: dict[int, float] = {}
        for q, (_, _, c) in enumerate(producers):
            borders = [t for t in (p - 1, p) if 0 <= t < S - 1] if prob.relay else [p]
            for t in borders:
                terms[zi(q, t)] = -c / scale
        return terms
    for p in range(S):
        if not rep:
            load = {L: 1.0, Y + p: big_acc}
            for g in range(G):
                if acc[g]:
                    load[xi(g, p)] = -acc[g]
            load.update(comm_terms(p, 1.0))
            rows.add(load, 0.0, np.inf)
        for r in range(1, R + 1) if rep else ():
            # L >= (acc x + comm z) / r + 2 (r-1)/r sync x, when slot p has r replicas
            load = {L: 1.0, wi(p, r): -big_acc}
            for g in range(G):
                coef = acc[g] / r + 2.0 * (r - 1) / r * sync[g]
                if coef:
                    load[xi(g, p)] = -coef
            load.update(comm_terms(p, float(r)))
            rows.add(load, -big_acc, np.inf)
        load = {L: 1.0, Y + p: -big_cpu}
        for g in range(G):
            if cpu[g]:
                load[xi(g, p)] = -cpu[g]
        rows.add(load, -big_cpu, np.inf)
        if mem_bound is not None and not inter:
            memrow = {Y + p: -big_mem}
            for g in range(G):
                coef = mem[g] + (in_flight(prob, S - p) * act[g] if stash and not rep else 0.0)
                if coef:
                    memrow[xi(g, p)] = coef
                if stash and rep and act[g]:
                    memrow[vi(g, p)] = act[g]
            rows.add(memrow, -np.inf, mem_bound)
        if stash and rep:
            # d[p] = devices of the active slots from p to the end
            drow = {D + p: 1.0}
            for q in range(p, S):
                drow[C + q] = -1.0
                for r in range(1, R + 1):
                    drow[wi(q, r)] = -float(r)
            rows.add(drow, 0.0, 0.0)
            for r in range(1, R + 1):  # r f[p] >= d[p] when slot p has r replicas
                rows.add({F + p: float(r), D + p: -1.0, wi(p, r): -float(S)}, -float(S), np.inf)
            for g in range(G):
                if act[g]:
                    rows.add({vi(g, p): 1.0, F + p: -1.0, xi(g, p): -float(S)}, -float(S),
                             np.inf)
        if stash and not rep:
            for g in range(G):
                rows.add({xi(g, p): 1.0, U + p: -1.0}, -np.inf, 0.0)  # x <= used
            if p + 1 < S:
                rows.add({U + p: 1.0, U + p + 1: -1.0}, -np.inf, 0.0)  # packed at the end
    if inter:
        for p in range(S):  # exactly p·v chunks: none empty
            rows.add({xi(g, p): 1.0 for g in range(G)}, 1.0, np.inf)
        for d in range(prob.devices if mem_bound is not None else 0):
            memrow = {}
            for p in range(d, S, prob.devices):
                for g in range(G):
                    coef = mem[g] + (in_flight(prob, S - p) * act[g] if stash else 0.0)
                    if coef:
                        memrow[xi(g, p)] = coef
            rows.add(memrow, -np.inf, mem_bound)
    if contiguous:
        seen = set()
        for u, v in order_constraints(graph):
            a, b = grp[u], grp[v]
            if a == b or (a, b) in seen:
                continue
            seen.add((a, b))
            row = {}
            for p in range(1, S):
                row[xi(a, p)] = row.get(xi(a, p), 0.0) + p
                row[xi(b, p)] = row.get(xi(b, p), 0.0) - p
            rows.add(row, -np.inf, 0.0)

    if start is not None:
        # the start's own max load satisfies every row, so the cutoff keeps it feasible
        rows.add({L: 1.0}, -np.inf, start.max_load / unit * (1 + 1e-9) + 1e-9)

    cost = np.zeros(nvar)
    cost[L] = 1.0
    integrality = np.zeros(nvar)
    integrality[X:Z] = 1
    if stash and not rep:
        integrality[U:W] = 1
    if rep:
        integrality[W:F] = 1
        if stash:
            integrality[F:D] = 1
    res, log, lower = solve_model(cost, rows, integrality, lb, ub, gap, time_limit, unit)
    name = "ilp-contiguous" if contiguous else "ilp"
    if res.x is None and start is not None:
        # infeasible under the cutoff: nothing beats the start, which is then optimal
        proven = start.max_load if res.status == 2 else lower
        return from_start(start, name, t0, res, proven, log, nvar, len(rows.lo))
    if res.x is None:
        if res.status == 2:
            raise PlacementError(
                f"no placement fits: {k} accelerators with {prob.memory:.4g} bytes each and "
                f"{ell} CPUs (the MILP is infeasible)"
            )
        raise PlacementError(f"the MILP found no placement within {time_limit} s ({res.message})")
    x = res.x
    stages = []
    for p in range(S):
        members = [i for i in range(n) if x[xi(grp[i], p)] > 0.5]
        if members:
            if x[Y + p] > 0.5:
                stages.append((CPU, members, 1))
            else:
                r = next((r for r in range(1, R + 1) if rep and x[wi(p, r)] > 0.5), 1)
                stages.append((ACC, members, r))
    pl = evaluate(graph, prob, stages, algorithm=name)
    if start is not None and pl.max_load > start.max_load:
        return from_start(start, name, t0, res, lower, log, nvar, len(rows.lo))
    pl.solve_seconds = time.perf_counter() - t0
    pl.info = {**pl.info, **result_info(res, pl.value, lower, unit, nvar, len(rows.lo), log, start)}
    return pl


def result_info(res, value: float, lower: float | None, unit: float, nvar: int, ncons: int,
                log: str, start: Placement | None) -> dict:
    """``Placement.info`` of a MILP's own solution: status, bound, proven gap, size."""
    return {
        "optimal": res.status == 0,
        "status": res.message,
        "lower_bound": lower,
        "gap": proven_gap(value, lower),
        "objective": float(res.fun) * unit if res.fun is not None else None,
        "variables": nvar,
        "constraints": ncons,
        "solver_output": log,
        **({"start": start_info(start)} if start is not None else {}),
    }


def _warm_start(graph: OpGraph, prob: Problem, contiguous: bool,
                warm_start: bool | Placement | None) -> Placement | None:
    if isinstance(warm_start, Placement):
        return warm_start
    if warm_start is False or (warm_start is None and contiguous):
        return None
    from meshtorch.placement.dp import solve_dp

    try:
        return solve_dp(graph, prob)
    except PlacementError:
        return None  # no contiguous placement (or too many ideals): the MILP starts cold


def proven_gap(value: float, lower: float | None) -> float | None:
    """Proven relative gap ``(value - lower) / value`` (0 when the value is 0)."""
    if lower is None:
        return None
    return max(0.0, (value - lower) / value) if value > 0 else 0.0


def start_info(start: Placement) -> dict:
    return {"algorithm": start.algorithm, "value": start.value,
            "seconds": start.solve_seconds}


def from_start(start: Placement, name: str, t0: float, res, lower: float | None, log: str,
                nvar: int, ncons: int) -> Placement:
    """The warm start returned as the MILP's answer: HiGHS found nothing better in time."""
    pl = Placement(start.graph, start.problem, start.stages, name, violations=start.violations,
                   latency=start.latency, info=dict(start.info))
    pl.solve_seconds = time.perf_counter() - t0
    lower = None if lower is None else min(lower, start.value)
    pl.info = {
        **({"device_memory": start.info["device_memory"]} if "device_memory" in start.info else {}),
        "optimal": lower is not None and proven_gap(start.value, lower) == 0.0,
        "status": res.message,
        "lower_bound": lower,
        "gap": proven_gap(start.value, lower),
        "objective": start.value,
        "variables": nvar,
        "constraints": ncons,
        "solver_output": log,
        "start": start_info(start),
        "from_start": True,
    }
    return pl
