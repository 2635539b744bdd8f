"""The exact dynamic program over ideals (Tarnawski et al., NeurIPS 2020, section 4).

``g[a, c][J]`` is the smallest max-load with which the nodes *outside* the ideal
``J`` can be placed on exactly ``a`` accelerators and ``c`` CPUs (every stage
non-empty). A stage is ``I \\ J`` for an ideal ``I ⊋ J``; it is the first of the
remaining ones, so under a 1F1B schedule it holds ``a + c`` micro-batches in
flight (divided by its replica count), which makes the stashed-activation
memory exact. The answer is ``min g[a, c][∅]`` over ``a <= k, c <= ℓ``.

Speed: the pairs ``J ⊂ I`` are generated once, vectorised, and only inside a
band: a pair whose compute alone exceeds an upper bound ``U`` on the optimum
(from the same DP restricted to the prefixes of a topological order, which is
fast) cannot be a stage of an optimal pipeline. Each DP layer is then a few
numpy passes over the pair arrays.

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

import networkx as nx
import numpy as np

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.ideals import (
    Ideals,
    enumerate_ideals,
    ideals_from_masks,
    prefix_masks,
)
from meshtorch.placement.prep import Contracted, contract, place_free
from meshtorch.placement.problem import ACC, CPU, Placement, Problem, evaluate

INF = math.inf
_TOL = 1e-9


@dataclass
class _Pairs:
    pos: np.ndarray  # position of J in the chunk
    big: np.ndarray  # I
    acc_cost: np.ndarray  # compute + comm on an accelerator (inf: not allowed)
    cpu_cost: np.ndarray  # compute on a CPU (inf: not allowed)
    mem: np.ndarray
    act: np.ndarray
    sync: np.ndarray

    @property
    def count(self) -> int:
        return int(self.pos.size)


class _Pool:
    """Candidate ideals ``I``, sorted by accelerator and by CPU time for band queries."""

    def __init__(self, ide: Ideals, members: np.ndarray) -> None:
        self.by_acc = members[np.argsort(ide.acc[members], kind="stable")]
        self.acc = ide.acc[self.by_acc]
        self.by_cpu = members[np.argsort(ide.cpu[members], kind="stable")]
        self.cpu = ide.cpu[self.by_cpu]


def _pairs(ide: Ideals, prob: Problem, bound: float, js: np.ndarray, pool: _Pool) -> _Pairs:
    """Pairs J ⊂ I (J in ``js``, I in ``pool``) whose stage could carry load <= ``bound``."""
    rmax = prob.max_replicas if prob.devices else 1
    acc_band = bound * rmax
    scale = max(1.0, float(np.max(ide.acc, initial=0.0)), float(np.max(ide.cpu, initial=0.0)))
    eps = 1e-9 * scale
    use_cpu = bool(prob.cpus)
    words = ide.bits.shape[1]
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("s", "b", "a", "c", "m", "x", "y")}
    for pos, j in enumerate(js.tolist()):
        cands = []
        a_lo, a_hi = ide.acc[j] - eps, ide.acc[j] + acc_band + eps
        if prob.devices:
            lo = np.searchsorted(pool.acc, a_lo, "left")
            hi = np.searchsorted(pool.acc, a_hi, "right")
            cands.append(pool.by_acc[lo:hi])
        if use_cpu:
            lo = np.searchsorted(pool.cpu, ide.cpu[j] - eps, "left")
            hi = np.searchsorted(pool.cpu, ide.cpu[j] + bound + eps, "right")
            extra = pool.by_cpu[lo:hi]
            if prob.devices:  # drop those already in the accelerator band (no hashing)
                x = ide.acc[extra]
                extra = extra[(x < a_lo) | (x > a_hi)]
            cands.append(extra)
        cand = cands[0] if len(cands) == 1 else np.concatenate(cands)
        if cand.size == 0:
            continue
        bj = ide.bits[j]
        sub = cand != j
        for w in range(words):
            if bj[w]:
                sub &= (ide.bits[cand, w] & bj[w]) == bj[w]
        big = cand[sub]
        if big.size == 0:
            continue
        acc_ok = ide.acc_bad[big] == ide.acc_bad[j]
        mem = ide.mem[big] - ide.mem[j]
        acc_ok &= mem <= prob.memory * (1 + _TOL)
        if prob.devices:
            acc_cost = np.where(acc_ok, ide.acc[big] - ide.acc[j] + ide.comm(big, j), INF)
        else:
            acc_cost = np.full(big.size, INF)
        if use_cpu:
            cpu_cost = np.where(ide.cpu_bad[big] == ide.cpu_bad[j], ide.cpu[big] - ide.cpu[j], INF)
        else:
            cpu_cost = np.full(big.size, INF)
        keep = (acc_cost <= acc_band * (1 + _TOL) + eps) | (cpu_cost <= bound * (1 + _TOL) + eps)
        if not keep.any():
            continue
        big = big[keep]
        out["s"].append(np.full(big.size, pos, dtype=np.int64))
        out["b"].append(big.astype(np.int64))
        out["a"].append(acc_cost[keep])
        out["c"].append(cpu_cost[keep])
        out["m"].append(mem[keep])
        out["x"].append(ide.act[big] - ide.act[j])
        out["y"].append(ide.sync[big] - ide.sync[j])
    if not out["s"]:
        e = np.zeros(0)
        ei = np.zeros(0, dtype=np.int64)
        return _Pairs(ei, ei, e, e, e, e, e)
    cat = {k: np.concatenate(v) for k, v in out.items()}
    return _Pairs(cat["s"], cat["b"], cat["a"], cat["c"], cat["m"], cat["x"], cat["y"])


class _Frontier:
    """Pareto frontier of points (alpha, g): ``min_i max(g_i, alpha_i + beta)`` by bisection.

    Along the frontier alpha rises and g falls, so ``max(g, alpha + beta)`` is
    smallest where the two cross: one ``searchsorted`` per query.
    """

    def __init__(self) -> None:
        self.alpha = np.zeros(0)
        self.g = np.zeros(0)
        self.idx = np.zeros(0, dtype=np.int64)
        self.key = np.zeros(0)

    def merge(self, alpha: np.ndarray, g: np.ndarray, idx: np.ndarray) -> None:
        ok = np.isfinite(g) & np.isfinite(alpha)
        a = np.concatenate([self.alpha, alpha[ok]])
        gg = np.concatenate([self.g, g[ok]])
        ii = np.concatenate([self.idx, idx[ok]])
        order = np.lexsort((gg, a))
        a, gg, ii = a[order], gg[order], ii[order]
        prev_min = np.r_[INF, np.minimum.accumulate(gg)[:-1]]
        keep = gg < prev_min
        self.alpha, self.g, self.idx = a[keep], gg[keep], ii[keep]
        self.key = self.alpha - self.g

    def query(self, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        f = self.alpha.size
        if f == 0:
            return np.full(beta.size, INF), np.full(beta.size, -1, dtype=np.int64)
        p = np.searchsorted(self.key, -beta, "left")
        hi = np.minimum(p, f - 1)
        lo = np.maximum(p - 1, 0)
        v1 = np.where(p < f, self.alpha[hi] + beta, INF)
        v2 = np.where(p > 0, self.g[lo], INF)
        use1 = v1 <= v2
        return np.where(use1, v1, v2), np.where(use1, self.idx[hi], self.idx[lo])


class _MemFrontier:
    """``min max(g(I), alpha(I) + beta)`` over the inserted ``I`` with ``mu(I) <= thr``.

    The memory-aware version of :class:`_Frontier`, for accelerator stages when
    memory can bind (``mu`` = resident bytes plus in-flight activations). Ideals
    get fixed positions, sorted by segment and then by ``mu``, both descending.
    Since ``mu`` grows with inclusion and separators order the segments, ``mu``
    never rises along the positions, and the segments inserted so far (the DP
    goes from the sink side) are always a prefix ``[0, end)``: a query is the
    position range ``[first position with mu <= thr, end)``. A segment tree over
    the positions keeps one Pareto frontier per node (built once, when the node
    is complete); a range is ``O(log n)`` nodes, each answered by bisection, all
    queries at once.
    """

    def __init__(self, mu: np.ndarray, seg: np.ndarray) -> None:
        n = mu.size
        self.mu = mu
        self.order = np.lexsort((-mu, -seg))  # position -> ideal
        self.neg_mu = -mu[self.order]  # ascending along the positions
        self.levels = max(1, (n - 1).bit_length() + 1)
        # frontier points of every level, packed node after node; grown on demand, since
        # frontiers are usually far smaller than their nodes
        cap = max(16, n // 8)
        self.alpha = np.zeros((self.levels, cap))
        self.g = np.zeros((self.levels, cap))
        self.idx = np.zeros((self.levels, cap), dtype=np.int64)
        self.fill = [0] * self.levels  # slots used per level
        self.start = [np.zeros((n >> lv) + 1, dtype=np.int64) for lv in range(self.levels)]
        self.flen = [np.zeros((n >> lv) + 1, dtype=np.int64) for lv in range(self.levels)]
        self.end = 0

    def insert(self, count: int, alpha: np.ndarray, g: np.ndarray) -> None:
        """Positions ``[end, end + count)`` become active (``alpha``, ``g`` per ideal)."""
        new_end = self.end + count
        for lv in range(self.levels):
            w = 1 << lv
            j0, j1 = self.end // w, new_end // w  # nodes completed by this insertion
            if j1 <= j0:
                continue
            ids = self.order[j0 * w : j1 * w]
            node = np.arange(j0 * w, j1 * w) >> lv
            a, gg = alpha[ids], g[ids]
            ok = np.isfinite(a) & np.isfinite(gg)
            ids, node, a, gg = ids[ok], node[ok], a[ok], gg[ok]
            srt = np.lexsort((gg, a, node))
            ids, node, a, gg = ids[srt], node[srt], a[srt], gg[srt]
            # Pareto within each node: keep a point when its g is below every earlier
            # one of its node. Exact segmented running minimum on integer ranks of g,
            # offset so that an earlier node never undercuts a later one. Equal g get
            # ranks rising with position (stable sort), so a tie is never kept twice.
            rank = np.empty(gg.size, dtype=np.int64)
            rank[np.argsort(gg, kind="stable")] = np.arange(gg.size)
            big = gg.size + 1
            val = rank + (j1 - node) * big
            run = np.minimum.accumulate(val) if val.size else val
            first = np.r_[True, node[1:] != node[:-1]] if val.size else np.zeros(0, bool)
            keep = first | (val < np.r_[0, run[:-1]])
            ids, node, a, gg = ids[keep], node[keep], a[keep], gg[keep]
            counts = np.bincount(node - j0, minlength=j1 - j0)
            f0 = self.fill[lv]
            k = ids.size
            if f0 + k > self.alpha.shape[1]:
                self._grow(f0 + k)
            self.alpha[lv, f0 : f0 + k] = a
            self.g[lv, f0 : f0 + k] = gg
            self.idx[lv, f0 : f0 + k] = ids
            self.start[lv][j0:j1] = f0 + np.r_[0, np.cumsum(counts)[:-1]]
            self.flen[lv][j0:j1] = counts
            self.fill[lv] = f0 + k
        self.end = new_end

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.alpha.shape[1])
        for name in ("alpha", "g", "idx"):
            old = getattr(self, name)
            new = np.zeros((self.levels, cap), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def query(self, beta: np.ndarray, js: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray]:
        """For each ``J`` in ``js``: the best inserted ``I`` with ``mu(I) <= mu(J) + budget``.

        ``beta`` is indexed by ideal (all of them).
        """
        q = js.size
        beta = beta[js]
        lo_pos = np.searchsorted(self.neg_mu, -(self.mu[js] + budget), "left")
        lo_pos = np.minimum(lo_pos, self.end)
        hi_pos = np.full(q, self.end, dtype=np.int64)
        qs, lvs, nodes = [], [], []
        qid = np.arange(q)
        for lv in range(self.levels):
            live = lo_pos < hi_pos
            if not live.any():
                break
            left = live & ((lo_pos & 1) == 1)
            qs.append(qid[left])
            lvs.append(np.full(int(left.sum()), lv))
            nodes.append(lo_pos[left])
            lo_pos = lo_pos + left
            right = live & ((hi_pos & 1) == 1)
            hi_pos = hi_pos - right
            qs.append(qid[right])
            lvs.append(np.full(int(right.sum()), lv))
            nodes.append(hi_pos[right])
            lo_pos >>= 1
            hi_pos >>= 1
        best = np.full(q, INF)
        arg = np.full(q, -1, dtype=np.int64)
        if not qs:
            return best, arg
        qq, lv, nd = np.concatenate(qs), np.concatenate(lvs), np.concatenate(nodes)
        if qq.size == 0:
            return best, arg
        start = np.empty(qq.size, dtype=np.int64)
        length = np.empty(qq.size, dtype=np.int64)
        for v in np.unique(lv).tolist():
            sel = lv == v
            start[sel] = self.start[v][nd[sel]]
            length[sel] = self.flen[v][nd[sel]]
        n = self.alpha.shape[1]
        flat_a = self.alpha.reshape(-1)
        flat_g = self.g.reshape(-1)
        base = lv * n + start
        target = -beta[qq]
        lo = np.zeros(qq.size, dtype=np.int64)
        hi = length.copy()
        # bisection for the first frontier point with alpha + beta >= g
        while True:
            open_ = lo < hi
            if not open_.any():
                break
            mid = (lo + hi) >> 1
            at = np.minimum(base + mid, flat_a.size - 1)
            go = (flat_a[at] - flat_g[at]) < target
            lo = np.where(open_ & go, mid + 1, lo)
            hi = np.where(open_ & ~go, mid, hi)
        top = flat_a.size - 1
        at_p = np.minimum(base + lo, top)
        at_q = np.minimum(base + lo - 1, top)
        v1 = np.where(lo < length, flat_a[at_p] + beta[qq], INF)
        v2 = np.where(lo > 0, flat_g[np.maximum(at_q, 0)], INF)
        use1 = v1 <= v2
        val = np.where(use1, v1, v2)
        who = np.where(use1, self.idx.reshape(-1)[at_p], self.idx.reshape(-1)[np.maximum(at_q, 0)])
        srt = np.lexsort((val, qq))
        qq, val, who = qq[srt], val[srt], who[srt]
        firsts = np.r_[True, qq[1:] != qq[:-1]]
        best[qq[firsts]] = val[firsts]
        arg[qq[firsts]] = who[firsts]
        arg[~np.isfinite(best)] = -1
        return best, arg


def _separators(c: Contracted) -> list[int]:
    """Supernodes comparable with all others that no communication hyperedge jumps over.

    An ideal without separator ``b`` lies strictly above it, one with ``b`` holds
    everything below it, so for ideals ``J ⊂ I`` on different sides of ``b`` the
    stage ``I \\ J`` cuts exactly the hyperedges cut by ``I`` or by ``J``: its cost
    is ``alpha(I) + beta(J)``, which the frontier handles without pairs.
    """
    m = c.m
    anc = [0] * m
    for v in range(m):
        x, a = c.preds[v], 0
        while x:
            low = x & -x
            a |= anc[low.bit_length() - 1] | low
            x ^= low
        anc[v] = a
    desc = [0] * m
    for v in range(m):
        a = anc[v]
        while a:
            low = a & -a
            desc[low.bit_length() - 1] |= 1 << v
            a ^= low
    out = []
    for b in range(m):
        if anc[b].bit_count() + desc[b].bit_count() + 1 != m:
            continue
        if any((h & anc[b]) and (h & desc[b]) for h, _ in c.hyper):
            continue
        out.append(b)
    return out


def _popcount(bits: np.ndarray) -> np.ndarray:
    as_bytes = bits.astype("<u8").view(np.uint8).reshape(bits.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1).sum(axis=1, dtype=np.int64)


def _run_dp(ide: Ideals, prob: Problem, c: Contracted, bound: float, full: int, frontier: bool,
            mem_binds: bool = False, chunk: int = 1024):
    """Layered DP, chunk by chunk from the sink side; returns (value, key, choices, pairs)."""
    n = ide.n
    k, ell, rmax = prob.devices, prob.cpus, prob.max_replicas
    layers = [(d - cc, cc) for d in range(1, k + ell + 1) for cc in range(min(ell, d) + 1)
              if d - cc <= k]
    g: dict[tuple[int, int], np.ndarray] = {(0, 0): np.full(n, INF)}
    g[(0, 0)][full] = 0.0
    src: dict[tuple[int, int], np.ndarray] = {}
    rep: dict[tuple[int, int], np.ndarray] = {}
    for key in layers:
        g[key] = np.full(n, INF)
        src[key] = np.full(n, -1, dtype=np.int64)
        rep[key] = np.zeros(n, dtype=np.int8)
    opts = {}
    for a, cc in layers:
        o = [(0, (a, cc - 1))] if cc > 0 else []
        o += [(r, (a - r, cc)) for r in range(1, min(rmax, a) + 1)]
        opts[(a, cc)] = o
    stash = bool(prob.training and prob.stash and np.any(ide.act > 0))
    alpha, beta = {}, {}
    if frontier:
        for r in {r for o in opts.values() for r, _ in o}:
            if r == 0:
                alpha[r], beta[r] = ide.cpu, -ide.cpu
            else:
                sy = 2.0 * (r - 1) / r * ide.sync
                alpha[r] = (ide.acc + ide.cut) / r + sy
                beta[r] = (ide.cut - ide.acc) / r - sy
    seg = np.zeros(n, dtype=np.int64)
    if frontier:
        for b in _separators(c):
            seg += ((ide.bits[:, b // 64] >> np.uint64(b % 64)) & np.uint64(1)).astype(np.int64)
    fronts: dict = {}
    for key, o in opts.items() if frontier else ():
        for r, prev in o:
            if r > 0 and mem_binds:
                # accelerator stages hold their weights and ceil((a + c) / r) stashed inputs
                in_flight = -(-(key[0] + key[1]) // r) if stash else 0
                fronts[(prev, r)] = _MemFrontier(ide.mem + in_flight * ide.act, seg)
            else:
                fronts[(prev, r)] = _Frontier()
    budget = prob.memory * (1 + _TOL)
    pop = _popcount(ide.bits)
    total_pairs = 0
    for t in sorted(set(seg.tolist()), reverse=True):
        members = np.flatnonzero(seg == t)
        members = members[np.argsort(-pop[members], kind="stable")]
        pool = _Pool(ide, members if frontier else np.arange(n))
        for s0 in range(0, members.size, chunk):
            js = members[s0 : s0 + chunk]
            pairs = _pairs(ide, prob, bound, js, pool)
            total_pairs += pairs.count
            if pairs.count:
                starts = np.flatnonzero(np.r_[True, pairs.pos[1:] != pairs.pos[:-1]])
                run_pos = pairs.pos[starts]
                run_of = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, pairs.count]))
            for key in layers:
                a, cc = key
                best = np.full(js.size, INF)
                bsrc = np.full(js.size, -1, dtype=np.int64)
                brep = np.zeros(js.size, dtype=np.int8)
                for r, prev in opts[key]:
                    gp = g[prev]
                    if pairs.count:
                        if r == 0:
                            cost = pairs.cpu_cost
                        else:
                            cost = pairs.acc_cost / r
                            if r > 1:
                                cost = cost + 2.0 * (r - 1) / r * pairs.sync
                            if stash:
                                in_flight = -(-(a + cc) // r)
                                over = pairs.mem + in_flight * pairs.act > prob.memory * (1 + _TOL)
                                cost = np.where(over, INF, cost)
                        vals = np.maximum(cost, gp[pairs.big])
                        gmin = np.minimum.reduceat(vals, starts)
                        better = gmin < best[run_pos]
                        if better.any():
                            hit = np.flatnonzero(vals <= gmin[run_of])
                            first_run, first_idx = np.unique(run_of[hit], return_index=True)
                            arg = np.empty(starts.size, dtype=np.int64)
                            arg[first_run] = pairs.big[hit[first_idx]]
                            where = run_pos[better]
                            best[where] = gmin[better]
                            bsrc[where] = arg[better]
                            brep[where] = r
                    if frontier:
                        fr = fronts[(prev, r)]
                        if isinstance(fr, _MemFrontier):
                            val, idx = fr.query(beta[r], js, budget)
                        else:
                            val, idx = fr.query(beta[r][js])
                        better = val < best
                        best[better] = val[better]
                        bsrc[better] = idx[better]
                        brep[better] = r
                g[key][js] = best
                src[key][js] = bsrc
                rep[key][js] = brep
        if frontier:
            everything = np.flatnonzero(seg == t)
            for (prev, r), fr in fronts.items():
                if isinstance(fr, _MemFrontier):
                    fr.insert(everything.size, alpha[r], g[prev])
                else:
                    fr.merge(alpha[r][everything], g[prev][everything], everything)
    best_val, best_key = INF, None
    for key in layers:
        if g[key][0] < best_val:
            best_val, best_key = float(g[key][0]), key
    return best_val, best_key, (src, rep), total_pairs


def _backtrack(choice, key, full: int):
    """Stages in pipeline order as (kind, replicas, ideal I, ideal J)."""
    src, rep = choice
    stages = []
    j = 0
    a, c = key
    while j != full:
        i = int(src[(a, c)][j])
        if i < 0:
            raise PlacementError("internal error: DP backtracking lost its way")
        r = int(rep[(a, c)][j])
        stages.append((CPU if r == 0 else ACC, max(r, 1), i, j))
        if r == 0:
            c -= 1
        else:
            a -= r
        j = i
    return stages


def _members(ide: Ideals, c: Contracted, i: int, j: int) -> list[int]:
    diff = ide.bits[i] & ~ide.bits[j]
    nodes = []
    for w, word in enumerate(diff.tolist()):
        while word:
            low = word & -word
            nodes.extend(c.members[64 * w + low.bit_length() - 1])
            word ^= low
    return nodes


def _memory_never_binds(graph: OpGraph, prob: Problem) -> bool:
    total = graph.total("mem_bytes")
    if prob.training and prob.stash:
        total += (prob.devices + prob.cpus) * sum(
            n.act_bytes for n in graph.nodes if not n.backward
        )
    return total <= prob.memory


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
    frontier = not any(math.isinf(x) for x in c.acc) and not any(math.isinf(x) for x in c.cpu)
    mem_binds = not _memory_never_binds(graph, prob)
    val, key, choice, npairs = _run_dp(ide, prob, c, bound, full, frontier, mem_binds)
    info = {"ideals": ide.n, "pairs": npairs, "supernodes": c.m, "frontier": frontier}
    if key is None or not math.isfinite(val):
        return INF, [], info
    raw = _backtrack(choice, key, full)
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
    c = contract(graph, pendant=_memory_never_binds(graph, prob))
    order = list(range(c.m)) if order is None else order
    ide = ideals_from_masks(c, prefix_masks(c, order))
    val, stages, info = solve_on_ideals(graph, prob, c, ide, INF)
    if not stages:
        raise _infeasible(graph, prob, c)
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
    """
    t0 = time.perf_counter()
    prob = problem.resolve(graph)
    never = _memory_never_binds(graph, prob)
    if not never:
        quick = _pendant_certified(graph, prob, ideal_limit)
        if quick is not None:
            val, stages, info = quick
            return _finish(graph, prob, stages, val, "dp", t0, info)
    c = contract(graph, pendant=never)
    val, stages, info = _solve_contracted(graph, prob, c, ideal_limit)
    return _finish(graph, prob, stages, val, "dp", t0, info)


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


def _pendant_certified(graph: OpGraph, prob: Problem, ideal_limit: int):
    """Solve with pendant nodes merged; return it if the memory-free relaxation agrees."""
    cp = contract(graph, pendant=True)
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
        cr = contract(relaxed, pendant=_memory_never_binds(relaxed, prob))
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
        x = c.preds[v]
        while x:
            low = x & -x
            dg.add_edge(low.bit_length() - 1, v)
            x ^= low
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
    p.info = info
    if abs(p.max_load - val) > 1e-6 * max(1.0, abs(val)):
        raise PlacementError(
            f"internal error: {name} predicted max load {val}, recomputation gives {p.max_load}"
        )
    return p
