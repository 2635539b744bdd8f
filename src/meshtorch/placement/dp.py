"""The exact dynamic program over ideals (Tarnawski et al., NeurIPS 2020, section 4).

``load[a, c][J]`` is the smallest max-load with which the nodes *outside* the ideal
``J`` can be placed on exactly ``a`` accelerators and ``c`` CPUs (every stage
non-empty). A stage is ``I \\ J`` for an ideal ``I ⊋ J``; it is the first of the
remaining ones, so under a 1F1B schedule it holds ``a + c`` micro-batches in
flight (divided by its replica count), which makes the stashed-activation
memory exact. The answer is ``min load[a, c][∅]`` over ``a <= k, c <= ℓ``.

Speed: the pairs ``J ⊂ I`` are generated once, vectorised, and only inside a
band (:mod:`~meshtorch.placement.pairs`): a pair whose compute alone exceeds an
upper bound ``U`` on the optimum (from the same DP restricted to the prefixes of
a topological order, which is fast) cannot be a stage of an optimal pipeline.
Across a separator the stage load splits, and Pareto frontiers
(:mod:`~meshtorch.placement.frontier`) replace the pairs. Each DP layer is then
a few numpy passes over the pair arrays.

Example:
    >>> from meshtorch.placement import OpGraph, Problem
    >>> from meshtorch.placement.dp import solve_dp
    >>> g = OpGraph()
    >>> for n, t in zip("abcd", [4.0, 1.0, 1.0, 2.0]):
    ...     _ = g.add_node(n, acc_time=t, cpu_time=10 * t)
    >>> for u, v in ["ab", "ac", "bd", "cd"]:
    ...     g.add_edge(u, v)
    >>> solve_dp(g, Problem(devices=2)).max_load
    4.0
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import networkx as nx
import numpy as np

from meshtorch.errors import PlacementError
from meshtorch.placement.frontier import MemoryFrontier, ParetoFrontier
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.ideals import (
    Ideals,
    enumerate_ideals,
    ideals_from_masks,
    prefix_masks,
)
from meshtorch.placement.pairs import TOL, CandidatePool, StagePairs, stage_pairs
from meshtorch.placement.prep import Contracted, contract, place_free, set_bits
from meshtorch.placement.problem import ACC, CPU, Placement, Problem, evaluate, in_flight

INF = math.inf
# ideals from which the DP answers cross-segment pairs through Pareto frontiers
FRONTIER_MIN_IDEALS = 2000
# what solve_dp says when, interleaved, its restriction (each chunk within 1/v of a device) finds nothing
CHUNKS_OVERFLOW = "no placement fits with each chunk within 1/"

# Layers of the DP: ``(a, c)``, a pipeline of exactly ``a`` accelerators and ``c`` CPUs.
Layer = tuple[int, int]
# The first stage of a layer's pipeline: (replicas, the layer left for the other stages);
# 0 replicas is a CPU stage.
Move = tuple[int, Layer]


@dataclass
class _Tables:
    """The DP's tables, one array over the ideals ``J`` per layer.

    ``load[a, c][J]`` is the smallest max-load with which the nodes outside ``J``
    fill exactly ``a`` accelerators and ``c`` CPUs; ``next_ideal`` and
    ``replicas`` record the first stage ``I \\ J`` that reaches it (``-1``: none).
    """

    load: dict[Layer, np.ndarray]
    next_ideal: dict[Layer, np.ndarray]
    replicas: dict[Layer, np.ndarray]


@dataclass
class _Best:
    """The best first stage found so far for each ``J`` of one chunk, in one layer."""

    load: np.ndarray
    next_ideal: np.ndarray
    replicas: np.ndarray

    @classmethod
    def none_yet(cls, size: int) -> _Best:
        return cls(np.full(size, INF), np.full(size, -1, dtype=np.int64), np.zeros(size, dtype=np.int32))

    def improve(self, where: np.ndarray, load: np.ndarray, next_ideal: np.ndarray, replicas: int) -> None:
        self.load[where] = load
        self.next_ideal[where] = next_ideal
        self.replicas[where] = replicas


class _Runs(NamedTuple):
    """Where each ``J``'s pairs start in a :class:`StagePairs` (they are contiguous)."""

    starts: np.ndarray  # first pair of each run
    position: np.ndarray  # the J (position in the chunk) of each run
    of_pair: np.ndarray  # the run of each pair

    @classmethod
    def of(cls, pairs: StagePairs) -> _Runs:
        starts = np.flatnonzero(np.r_[True, pairs.position[1:] != pairs.position[:-1]])
        of_pair = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, pairs.count]))
        return cls(starts, pairs.position[starts], of_pair)


def _layers(prob: Problem) -> list[Layer]:
    """Every ``(a, c)`` with ``1 <= a + c``, ``a <= k``, ``c <= ℓ``, by rising ``a + c``."""
    k, ell = prob.slots, prob.cpus  # interleaved: one "device" per chunk
    return [(d - cpus, cpus) for d in range(1, k + ell + 1) for cpus in range(min(ell, d) + 1)
            if d - cpus <= k]


def _moves(layers: list[Layer], max_replicas: int) -> dict[Layer, list[Move]]:
    """For each layer, the possible first stages: one CPU, or ``r`` replicated accelerators."""
    moves = {}
    for accs, cpus in layers:
        options: list[Move] = [(0, (accs, cpus - 1))] if cpus > 0 else []
        options += [(r, (accs - r, cpus)) for r in range(1, min(max_replicas, accs) + 1)]
        moves[(accs, cpus)] = options
    return moves


def _empty_tables(n: int, full: int, layers: list[Layer]) -> _Tables:
    """All loads infinite, except the empty pipeline after the full ideal (load 0)."""
    load = {(0, 0): np.full(n, INF)}
    load[(0, 0)][full] = 0.0
    next_ideal, replicas = {}, {}
    for layer in layers:
        load[layer] = np.full(n, INF)
        next_ideal[layer] = np.full(n, -1, dtype=np.int64)
        replicas[layer] = np.zeros(n, dtype=np.int32)  # int8 overflowed past 127 replicas
    return _Tables(load, next_ideal, replicas)


def _split_costs(
    ide: Ideals, replica_counts: set[int]
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """``alpha[r](I)`` and ``beta[r](J)`` with stage load ``alpha(I) + beta(J)`` across a separator.

    ``r = 0`` is a CPU stage; ``r >= 1`` an accelerator stage with ``r`` replicas,
    whose compute and cut are divided by ``r`` and which pays ``2 (r - 1) / r``
    gradient synchronisations.
    """
    alpha, beta = {}, {}
    for r in replica_counts:
        if r == 0:
            alpha[r], beta[r] = ide.cpu, -ide.cpu
        else:
            sync = 2.0 * (r - 1) / r * ide.sync
            alpha[r] = (ide.acc + ide.cut) / r + sync
            beta[r] = (ide.cut - ide.acc) / r - sync
    return alpha, beta


def _separators(c: Contracted) -> list[int]:
    """Supernodes comparable with all others that no communication hyperedge jumps over.

    An ideal without separator ``b`` lies strictly above it, one with ``b`` holds
    everything below it, so for ideals ``J ⊂ I`` on different sides of ``b`` the
    stage ``I \\ J`` cuts exactly the hyperedges cut by ``I`` or by ``J``: its cost
    is ``alpha(I) + beta(J)``, which the frontier handles without pairs.
    """
    m = c.m
    ancestors = [0] * m
    for v in range(m):
        for u in set_bits(c.preds[v]):
            ancestors[v] |= ancestors[u] | 1 << u
    descendants = [0] * m
    for v in range(m):
        for u in set_bits(ancestors[v]):
            descendants[u] |= 1 << v
    found = []
    for b in range(m):
        if ancestors[b].bit_count() + descendants[b].bit_count() + 1 != m:
            continue
        if any((h & ancestors[b]) and (h & descendants[b]) for h, _ in c.hyper):
            continue
        found.append(b)
    return found


def _segments(ide: Ideals, c: Contracted) -> np.ndarray:
    """For each ideal, how many separators it holds: ideals of a higher segment contain all lower ones."""
    segment = np.zeros(ide.n, dtype=np.int64)
    for b in _separators(c):
        segment += ((ide.bits[:, b // 64] >> np.uint64(b % 64)) & np.uint64(1)).astype(np.int64)
    return segment


def _frontiers(ide: Ideals, prob: Problem, moves: dict[Layer, list[Move]], segment: np.ndarray,
               stash: bool, mem_binds: bool) -> dict[tuple[Layer, int], ParetoFrontier | MemoryFrontier]:
    """One frontier per move ``(layer left, replicas)``, over the ideals of the segments done so far."""
    frontiers: dict[tuple[Layer, int], ParetoFrontier | MemoryFrontier] = {}
    for layer, options in moves.items():
        for r, rest in options:
            if r > 0 and mem_binds:
                # accelerator stages hold their weights and ceil((a + c) / r) stashed inputs
                count = in_flight(prob, layer[0] + layer[1], r) if stash else 0
                frontiers[(rest, r)] = MemoryFrontier(ide.mem + count * ide.act, segment)
            else:
                frontiers[(rest, r)] = ParetoFrontier()
    return frontiers


def _popcount(bits: np.ndarray) -> np.ndarray:
    as_bytes = bits.astype("<u8").view(np.uint8).reshape(bits.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1).sum(axis=1, dtype=np.int64)


def _stage_load(pairs: StagePairs, r: int, layer: Layer, stash: bool, prob: Problem) -> np.ndarray:
    """Load of each pair's stage run on a CPU (``r = 0``) or on ``r`` accelerators (inf: does not fit).

    As the first of the ``a + c`` stages of ``layer`` it holds
    ``in_flight(prob, a + c, r)`` micro-batches' activations per replica.
    """
    if r == 0:
        return pairs.cpu_cost
    load = pairs.acc_cost / r
    if r > 1:
        load = load + 2.0 * (r - 1) / r * pairs.sync
    if stash:
        count = in_flight(prob, layer[0] + layer[1], r)
        over = pairs.memory + count * pairs.activations > prob.memory * (1 + TOL)
        load = np.where(over, INF, load)
    return load


def _relax_pairs(pairs: StagePairs, runs: _Runs, stage_load: np.ndarray, load_after: np.ndarray,
                 r: int, best: _Best) -> None:
    """Improve ``best`` with the kept pairs: ``min_I max(stage load, load after I)`` per ``J``.

    Ties go to the first pair of the run.
    """
    loads = np.maximum(stage_load, load_after[pairs.bigger])
    run_min = np.minimum.reduceat(loads, runs.starts)
    better = run_min < best.load[runs.position]
    if not better.any():
        return
    hit = np.flatnonzero(loads <= run_min[runs.of_pair])
    first_run, first_hit = np.unique(runs.of_pair[hit], return_index=True)
    arg = np.empty(runs.starts.size, dtype=np.int64)
    arg[first_run] = pairs.bigger[hit[first_hit]]
    best.improve(runs.position[better], run_min[better], arg[better], r)


def _relax_frontier(frontier: ParetoFrontier | MemoryFrontier, beta: np.ndarray, js: np.ndarray,
                    budget: float | np.ndarray, r: int, best: _Best) -> None:
    """Improve ``best`` with the ideals ``I`` of lower segments, whose stage load splits."""
    if isinstance(frontier, MemoryFrontier):
        load, next_ideal = frontier.query(beta, js, budget)
    else:
        load, next_ideal = frontier.query(beta[js])
    better = load < best.load
    if better.any():
        best.improve(better, load[better], next_ideal[better], r)


def _run_dp(ide: Ideals, prob: Problem, c: Contracted, bound: float, full: int, frontier: bool,
            mem_binds: bool = False, chunk: int = 1024):
    """Fill the tables from the sink side, segment by segment and chunk by chunk of ``J``.

    Within a segment, ``J`` go by falling size so that every ``I ⊋ J`` of the
    segment is final before ``J`` reads it; ideals of earlier (higher) segments
    are reached through the frontiers, which each segment joins once it is done.
    Returns ``(value, layer, tables, pairs kept)`` with ``layer`` the best
    ``(a, c)`` for the empty ideal (``None``: nothing feasible).
    """
    layers = _layers(prob)
    moves = _moves(layers, prob.max_replicas)
    tables = _empty_tables(ide.n, full, layers)
    stash = bool(prob.training and prob.stash and (np.any(ide.act > 0) or np.any(ide.cut_inputs > 0)))
    if frontier:
        alpha, beta = _split_costs(ide, {r for options in moves.values() for r, _ in options})
        segment = _segments(ide, c)
        frontiers = _frontiers(ide, prob, moves, segment, stash, mem_binds)
    else:
        segment = np.zeros(ide.n, dtype=np.int64)
        frontiers = {}
    budget = prob.memory * (1 + TOL)
    size = _popcount(ide.bits)
    total_pairs = 0
    for seg in sorted(set(segment.tolist()), reverse=True):
        members = np.flatnonzero(segment == seg)
        members = members[np.argsort(-size[members], kind="stable")]
        pool = CandidatePool(ide, members if frontier else np.arange(ide.n))
        for first in range(0, members.size, chunk):
            js = members[first : first + chunk]
            pairs = stage_pairs(ide, prob, bound, js, pool)
            total_pairs += pairs.count
            runs = _Runs.of(pairs) if pairs.count else None
            for layer in layers:
                best = _Best.none_yet(js.size)
                for r, rest in moves[layer]:
                    if runs is not None:
                        stage_load = _stage_load(pairs, r, layer, stash, prob)
                        _relax_pairs(pairs, runs, stage_load, tables.load[rest], r, best)
                    if frontier:
                        room = budget
                        if stash and r > 0 and prob.recompute:  # J's outputs are stashed inputs
                            room = budget - in_flight(prob, layer[0] + layer[1], r) * ide.cut_inputs[js]
                        _relax_frontier(frontiers[(rest, r)], beta[r], js, room, r, best)
                tables.load[layer][js] = best.load
                tables.next_ideal[layer][js] = best.next_ideal
                tables.replicas[layer][js] = best.replicas
        if frontier:
            done = np.flatnonzero(segment == seg)
            for (rest, r), front in frontiers.items():
                if isinstance(front, MemoryFrontier):
                    front.insert(done.size, alpha[r], tables.load[rest])
                else:
                    front.merge(alpha[r][done], tables.load[rest][done], done)
    best_load, best_layer = INF, None
    for layer in layers:
        if prob.interleaved and layer != (prob.slots, 0):
            continue  # the round-robin needs all p·v chunks (fewer would leave a device idle a round)
        if tables.load[layer][0] < best_load:
            best_load, best_layer = float(tables.load[layer][0]), layer
    return best_load, best_layer, tables, total_pairs


def _backtrack(tables: _Tables, layer: Layer, full: int) -> list[tuple[str, int, int, int]]:
    """Stages in pipeline order as (kind, replicas, ideal I, ideal J), from the empty ideal on."""
    stages = []
    j = 0
    accs, cpus = layer
    while j != full:
        i = int(tables.next_ideal[(accs, cpus)][j])
        if i < 0:
            raise PlacementError("internal error: DP backtracking lost its way")
        r = int(tables.replicas[(accs, cpus)][j])
        stages.append((CPU if r == 0 else ACC, max(r, 1), i, j))
        if r == 0:
            cpus -= 1
        else:
            accs -= r
        j = i
    return stages


def _members(ide: Ideals, c: Contracted, i: int, j: int) -> list[int]:
    """The original nodes of the stage ``I \\ J``."""
    diff = ide.bits[i] & ~ide.bits[j]
    nodes = []
    for w, word in enumerate(diff.tolist()):
        for bit in set_bits(word):
            nodes.extend(c.members[64 * w + bit])
    return nodes


def _memory_never_binds(graph: OpGraph, prob: Problem) -> bool:
    """Whether the whole graph, with every stage's in-flight activations, fits on one device.

    ``graph`` is the :func:`memory_view` (weights and recomputed activations in ``mem_bytes``).
    """
    total = graph.total("mem_bytes")
    if prob.training and prob.stash:
        # recompute: every forward value may be stashed (crossing a border); else only act_bytes
        per = sum(n.act_bytes for n in graph.nodes if not n.backward)
        if prob.recompute:
            per = graph.total("mem_bytes")
        first = prob.slots + prob.cpus
        total += max(in_flight(prob, after) for after in range(1, first + 1)) * per
    return total <= prob.memory


def memory_view(graph: OpGraph, prob: Problem) -> tuple[OpGraph, list[float] | None]:
    """``graph`` with the schedule's memory folded into node sums, and the stash inputs.

    Under 2BW a node's ``mem_bytes`` gains its ``weight_bytes`` (the second
    version). With ``recompute`` a stage holds one micro-batch's activations
    (moved into ``mem_bytes``) and stashes per micro-batch in flight only its
    inputs: the graph inputs it holds (left in ``act_bytes``) and the values
    crossing its front border (returned per producer, for
    :func:`~meshtorch.placement.prep.contract`).
    """
    two_bw = prob.schedule == "2bw" and graph.total("weight_bytes") > 0
    recompute = bool(prob.recompute and prob.training and prob.stash)
    if not two_bw and not recompute:
        return graph, None
    has_pred = [False] * len(graph)
    for u, v, _ in graph.edges:
        if not graph.nodes[u].backward:
            has_pred[v] = True
    nodes = [replace(nd) for nd in graph.nodes]
    inputs = [0.0 if nd.backward else nd.act_bytes for nd in graph.nodes]
    for i, nd in enumerate(nodes):
        if two_bw:
            nd.mem_bytes += nd.weight_bytes
        if recompute and not nd.backward:
            nd.mem_bytes += nd.act_bytes
            nd.act_bytes = nd.act_bytes if not has_pred[i] else 0.0
    view = OpGraph(nodes=nodes, edges=list(graph.edges), meta=dict(graph.meta))
    return view, inputs if recompute else None


def solve_on_ideals(
    graph: OpGraph, prob: Problem, c: Contracted, ide: Ideals, bound: float
) -> tuple[float, list[tuple[str, list[int], int]], dict]:
    """Run the DP on a given family of ideals (all of them, or a chain of prefixes)."""
    want = np.zeros(ide.bits.shape[1], dtype=np.uint64)
    for v in range(c.m):
        want[v // 64] |= np.uint64(1 << (v % 64))
    full = int(np.flatnonzero((ide.bits == want).all(axis=1))[0])
    empty = 0
    if ide.bits[empty].any():
        raise PlacementError("internal error: ideal 0 must be the empty set")
    # the separator shortcut needs every stage cost to split as alpha(I) + beta(J),
    # which an op that some device kind cannot run breaks
    splits = not any(math.isinf(x) for x in c.acc) and not any(math.isinf(x) for x in c.cpu)
    # On a few thousand ideals, all pairs in a handful of vectorised chunks beat the
    # frontiers' per-segment numpy calls (ResNet-50's layer graph: 242 ideals in 139
    # segments took 5x longer through the frontiers)
    frontier = splits and ide.n >= FRONTIER_MIN_IDEALS
    mem_binds = not _memory_never_binds(graph, prob)
    val, layer, tables, npairs = _run_dp(ide, prob, c, bound, full, frontier, mem_binds)
    info = {"ideals": ide.n, "pairs": npairs, "supernodes": c.m, "frontier": frontier}
    if layer is None or not math.isfinite(val):
        return INF, [], info
    raw = _backtrack(tables, layer, full)
    where = [-1] * len(graph)
    stages = []
    for s, (kind, r, i, j) in enumerate(raw):
        for v in _members(ide, c, i, j):
            where[v] = s
        stages.append([kind, [], r])
    place_free(c, where)
    for v, s in enumerate(where):
        stages[s][1].append(v)
    return val, [tuple(s) for s in stages], info


def _infeasible(graph: OpGraph, prob: Problem, c: Contracted) -> PlacementError:
    too_big = [
        graph.nodes[c.members[s][0]].name
        for s in range(c.m)
        if c.mem[s] > prob.memory and (prob.cpus == 0 or math.isinf(c.cpu[s]))
    ]
    no_dev = [
        graph.nodes[c.members[s][0]].name
        for s in range(c.m)
        if (prob.devices == 0 or math.isinf(c.acc[s])) and (prob.cpus == 0 or math.isinf(c.cpu[s]))
    ]
    if no_dev:
        return PlacementError(f"nodes {no_dev[:10]} (with their colocated nodes) fit on no device")
    if prob.interleaved and c.m < prob.slots:
        return PlacementError(
            f"{prob.devices} devices x {prob.virtual_stages} virtual stages = {prob.slots} chunks, but the "
            f"graph has only {c.m} nodes once colocated ones are merged: fewer --devices or --virtual-stages")
    if too_big:
        return PlacementError(
            f"nodes {too_big[:10]} (with their colocated nodes) need more than the "
            f"memory bound of {prob.memory:.4g} bytes"
        )
    return PlacementError(
        f"no contiguous placement on {prob.devices} accelerators with {prob.memory:.4g} bytes "
        f"each and {prob.cpus} CPUs exists (total memory {graph.total('mem_bytes'):.4g} bytes)"
    )


def solve_chain(graph: OpGraph, problem: Problem, *, order: list[int] | None = None) -> Placement:
    """The DP restricted to the prefixes of one topological order of the supernodes.

    Exact when the contracted graph is a chain (then every ideal is a prefix);
    otherwise the best placement whose stages are consecutive in that order,
    an upper bound. ``O(m^2)`` pairs at most.

    Example:
        >>> from meshtorch.placement import OpGraph, Problem
        >>> g = OpGraph()
        >>> for i, t in enumerate([3.0, 1.0, 1.0, 3.0]):
        ...     _ = g.add_node(f"l{i}", acc_time=t, cpu_time=t)
        >>> for i in range(3):
        ...     g.add_edge(f"l{i}", f"l{i + 1}")
        >>> solve_chain(g, Problem(devices=2)).max_load
        4.0
    """
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    view, inputs = memory_view(graph, prob)
    c = contract(view, pendant=_memory_never_binds(view, prob), inputs=inputs)
    order = list(range(c.m)) if order is None else order
    ide = ideals_from_masks(c, prefix_masks(c, order))
    val, stages, info = solve_on_ideals(view, prob, c, ide, INF)
    if not stages:
        raise _infeasible(view, prob, c)
    is_chain = all(c.preds[v] >> (v - 1) & 1 for v in range(1, c.m))
    info["exact"] = is_chain
    return _finish(graph, prob, stages, val, "chain", t0, info)


def solve_dp(graph: OpGraph, problem: Problem, *, ideal_limit: int = 3_000_000) -> Placement:
    """The exact contiguous optimum (both modes), by the DP over ideals.

    ``info`` of the result holds the DP's size: supernodes, ideals, pairs kept,
    and the upper bound used to prune. When memory can bind, weights and other
    zero-time "pendant" nodes are first tried merged into their only neighbour;
    that solution is returned when the relaxation without their memory reaches
    the same value (``info['certificate']``), which proves it optimal.

    With ``schedule="interleaved"`` the stages are the ``p·v`` chunks and the
    DP minimises the slowest chunk's load (what the interleaved step time grows
    with, :mod:`~meshtorch.placement.interleave`). It bounds each chunk's memory
    on its own, a relaxation of the device sums; when its answer fits every
    device it is optimal, else the DP is rerun with ``1/v`` of the memory per
    chunk (feasible, not proven optimal: ``info['exact']`` is ``False`` and
    ``info['lower_bound']`` the relaxation's value).
    """
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    val, stages, info = _solve_dp(graph, prob, ideal_limit)
    if prob.interleaved and evaluate(graph, prob, stages, strict=False).violations:
        low = val
        share = replace(prob, memory=prob.memory / prob.virtual_stages)
        try:
            val, stages, info = _solve_dp(graph, share, ideal_limit)
        except PlacementError:
            raise PlacementError(
                f"the fastest chunks that fit one at a time overflow a device's {prob.memory:.4g} bytes, and "
                f"{CHUNKS_OVERFLOW}{prob.virtual_stages} of it: try fewer "
                "--virtual-stages, more --devices or --recompute") from None
        info.update(exact=False, lower_bound=low)
    return _finish(graph, prob, stages, val, "dp", t0, info)


def _solve_dp(graph: OpGraph, prob: Problem, ideal_limit: int) -> tuple[float, list, dict]:
    view, inputs = memory_view(graph, prob)
    never = _memory_never_binds(view, prob)
    if not never:
        quick = _pendant_certified(view, prob, ideal_limit, inputs)
        if quick is not None:
            return quick
    c = contract(view, pendant=never, inputs=inputs)
    return _solve_contracted(view, prob, c, ideal_limit)


def _solve_contracted(graph: OpGraph, prob: Problem, c: Contracted, ideal_limit: int):
    t0 = time.perf_counter()
    # an upper bound from the best of a few linear extensions, to prune pairs
    bound = INF
    seeds: list[tuple[float, list]] = []
    for order in _orders(c):
        ide_c = ideals_from_masks(c, prefix_masks(c, order))
        v, st, _ = solve_on_ideals(graph, prob, c, ide_c, INF)
        if v < bound:
            bound = v
            seeds.append((v, st))
    t1 = time.perf_counter()
    ide = enumerate_ideals(c, ideal_limit)
    t2 = time.perf_counter()
    val, stages, info = solve_on_ideals(graph, prob, c, ide, bound)
    if not stages:
        if seeds:  # cannot happen: the chain solution is in the band
            raise PlacementError("internal error: DP lost the chain solution")
        raise _infeasible(graph, prob, c)
    info.update(bound=bound, bound_seconds=t1 - t0, ideal_seconds=t2 - t1, exact=True)
    return val, stages, info


def _pendant_certified(graph: OpGraph, prob: Problem, ideal_limit: int, inputs: list[float] | None):
    """Solve with pendant nodes merged; return it if the memory-free relaxation agrees."""
    cp = contract(graph, pendant=True, inputs=inputs)
    if not cp.pendant_nodes:
        return None
    relaxed = OpGraph(nodes=[replace(nd) for nd in graph.nodes], edges=list(graph.edges),
                      meta=dict(graph.meta))
    for i in cp.pendant_nodes:
        relaxed.nodes[i].mem_bytes = 0.0
        relaxed.nodes[i].act_bytes = 0.0
    try:
        # the restriction (pendants stay with their neighbour): feasible, an upper bound
        val, stages, info = _solve_contracted(graph, prob, cp, ideal_limit)
        # the relaxation (their memory dropped, so merging them is exact): a lower bound
        cr = contract(relaxed, pendant=_memory_never_binds(relaxed, prob), inputs=inputs)
        low, _, _ = _solve_contracted(relaxed, prob, cr, ideal_limit)
    except PlacementError:
        return None  # too many ideals, or the restriction is infeasible: solve in full
    if not val <= low * (1 + 1e-12) + 1e-12:
        return None
    info["certificate"] = {"pendant_nodes": len(cp.pendant_nodes), "relaxation": low}
    return val, stages, info


def _orders(c: Contracted) -> list[list[int]]:
    """Two linear extensions: the contraction's and a depth-first one."""
    first = list(range(c.m))
    dg = nx.DiGraph()
    dg.add_nodes_from(range(c.m))
    for v in range(c.m):
        for u in set_bits(c.preds[v]):
            dg.add_edge(u, v)
    # depth-first: finish a branch before starting the next
    order, done = [], [False] * c.m
    indeg = {v: dg.in_degree(v) for v in dg}
    stack = sorted((v for v in dg if indeg[v] == 0), reverse=True)
    while stack:
        v = stack.pop()
        if done[v]:
            continue
        done[v] = True
        order.append(v)
        for w in sorted(dg.successors(v), reverse=True):
            indeg[w] -= 1
            if indeg[w] == 0:
                stack.append(w)
    return [first] if order == first else [first, order]


def _finish(graph, prob, stages, val, name, t0, info) -> Placement:
    p = evaluate(graph, prob, stages, algorithm=name)
    p.solve_seconds = time.perf_counter() - t0
    info["objective"] = val
    p.info = {**p.info, **info}  # evaluate's (interleaved: each device's memory) and the solver's
    if abs(p.max_load - val) > 1e-6 * max(1.0, abs(val)):
        raise PlacementError(
            f"internal error: {name} predicted max load {val}, recomputation gives {p.max_load}"
        )
    return p
