"""Pareto frontiers that answer ``min_I max(g(I), alpha(I) + beta(J))`` for many ``J`` at once.

The DP over ideals needs, for a remaining-set ideal ``J``, the best next ideal
``I``: the one minimising the larger of the load already placed beyond ``I``
(``g(I)``) and the load of the stage ``I \\ J``. Across a separator that stage
load splits as ``alpha(I) + beta(J)``, so only the Pareto-optimal points
``(alpha, g)`` matter and one bisection per query finds the best.
:class:`ParetoFrontier` does this when memory cannot bind;
:class:`MemoryFrontier` adds the stage's memory limit.

Example:
    >>> import numpy as np
    >>> from meshtorch.placement.frontier import ParetoFrontier
    >>> fr = ParetoFrontier()
    >>> fr.merge(alpha=np.array([1.0, 2.0, 3.0]), g=np.array([5.0, 3.0, 4.0]), idx=np.arange(3))
    >>> fr.query(np.array([0.0, 2.5]))  # ideal 2 is dominated by ideal 1
    (array([3. , 4.5]), array([1, 1]))
"""

from __future__ import annotations

import math

import numpy as np

INF = math.inf


class ParetoFrontier:
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
        """Add the points ``(alpha[i], g[i])`` of ideals ``idx`` (infinite ones are dropped)."""
        finite = np.isfinite(g) & np.isfinite(alpha)
        all_alpha = np.concatenate([self.alpha, alpha[finite]])
        all_g = np.concatenate([self.g, g[finite]])
        all_idx = np.concatenate([self.idx, idx[finite]])
        order = np.lexsort((all_g, all_alpha))
        all_alpha, all_g, all_idx = all_alpha[order], all_g[order], all_idx[order]
        # by rising alpha, a point survives when its g is below every earlier one
        lowest_before = np.r_[INF, np.minimum.accumulate(all_g)[:-1]]
        keep = all_g < lowest_before
        self.alpha, self.g, self.idx = all_alpha[keep], all_g[keep], all_idx[keep]
        self.key = self.alpha - self.g

    def query(self, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each ``beta``: ``min_i max(g_i, alpha_i + beta)`` and the ideal reaching it (-1: none)."""
        size = self.alpha.size
        if size == 0:
            return np.full(beta.size, INF), np.full(beta.size, -1, dtype=np.int64)
        # first point where alpha + beta >= g; the optimum is it or the one before
        cross = np.searchsorted(self.key, -beta, "left")
        after = np.minimum(cross, size - 1)
        before = np.maximum(cross - 1, 0)
        load_after = np.where(cross < size, self.alpha[after] + beta, INF)
        load_before = np.where(cross > 0, self.g[before], INF)
        take_after = load_after <= load_before
        return (np.where(take_after, load_after, load_before),
                np.where(take_after, self.idx[after], self.idx[before]))


class MemoryFrontier:
    """``min max(g(I), alpha(I) + beta)`` over the inserted ``I`` with ``mu(I) <= thr``.

    The memory-aware version of :class:`ParetoFrontier`, for accelerator stages when
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
        self.length = [np.zeros((n >> lv) + 1, dtype=np.int64) for lv in range(self.levels)]
        self.end = 0

    def insert(self, count: int, alpha: np.ndarray, g: np.ndarray) -> None:
        """Positions ``[end, end + count)`` become active (``alpha``, ``g`` per ideal)."""
        new_end = self.end + count
        for lv in range(self.levels):
            width = 1 << lv
            first_node, end_node = self.end // width, new_end // width  # completed by this insertion
            if end_node <= first_node:
                continue
            ids = self.order[first_node * width : end_node * width]
            node = np.arange(first_node * width, end_node * width) >> lv
            ids, node, point_alpha, point_g = _pareto_per_node(ids, node, alpha[ids], g[ids], end_node)
            counts = np.bincount(node - first_node, minlength=end_node - first_node)
            used = self.fill[lv]
            added = ids.size
            if used + added > self.alpha.shape[1]:
                self._grow(used + added)
            self.alpha[lv, used : used + added] = point_alpha
            self.g[lv, used : used + added] = point_g
            self.idx[lv, used : used + added] = ids
            self.start[lv][first_node:end_node] = used + np.r_[0, np.cumsum(counts)[:-1]]
            self.length[lv][first_node:end_node] = counts
            self.fill[lv] = used + added
        self.end = new_end

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.alpha.shape[1])
        for name in ("alpha", "g", "idx"):
            old = getattr(self, name)
            new = np.zeros((self.levels, cap), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def _cover(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tree nodes covering each position range ``[lo[q], hi[q])``: (query, level, node)."""
        queries, levels, nodes = [], [], []
        query_id = np.arange(lo.size)
        for lv in range(self.levels):
            live = lo < hi
            if not live.any():
                break
            left = live & ((lo & 1) == 1)
            queries.append(query_id[left])
            levels.append(np.full(int(left.sum()), lv))
            nodes.append(lo[left])
            lo = lo + left
            right = live & ((hi & 1) == 1)
            hi = hi - right
            queries.append(query_id[right])
            levels.append(np.full(int(right.sum()), lv))
            nodes.append(hi[right])
            lo >>= 1
            hi >>= 1
        if not queries:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(queries), np.concatenate(levels), np.concatenate(nodes)

    def query(self, beta: np.ndarray, js: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray]:
        """For each ``J`` in ``js``: the best inserted ``I`` with ``mu(I) <= mu(J) + budget``.

        ``beta`` is indexed by ideal (all of them).
        """
        beta = beta[js]
        lo = np.searchsorted(self.neg_mu, -(self.mu[js] + budget), "left")
        lo = np.minimum(lo, self.end)
        hi = np.full(js.size, self.end, dtype=np.int64)
        best = np.full(js.size, INF)
        arg = np.full(js.size, -1, dtype=np.int64)
        query, level, node = self._cover(lo, hi)
        if query.size == 0:
            return best, arg
        load, who = self._node_minima(level, node, beta[query])
        # the best node of each query
        order = np.lexsort((load, query))
        query, load, who = query[order], load[order], who[order]
        firsts = np.r_[True, query[1:] != query[:-1]]
        best[query[firsts]] = load[firsts]
        arg[query[firsts]] = who[firsts]
        arg[~np.isfinite(best)] = -1
        return best, arg

    def _node_minima(self, level: np.ndarray, node: np.ndarray, beta: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """``min max(g, alpha + beta)`` over the frontier of each (level, node), by bisection."""
        start = np.empty(level.size, dtype=np.int64)
        length = np.empty(level.size, dtype=np.int64)
        for lv in np.unique(level).tolist():
            at_level = level == lv
            start[at_level] = self.start[lv][node[at_level]]
            length[at_level] = self.length[lv][node[at_level]]
        flat_alpha = self.alpha.reshape(-1)
        flat_g = self.g.reshape(-1)
        base = level * self.alpha.shape[1] + start
        lo = np.zeros(level.size, dtype=np.int64)
        hi = length.copy()
        # bisection for the first frontier point with alpha + beta >= g
        while True:
            open_ = lo < hi
            if not open_.any():
                break
            mid = (lo + hi) >> 1
            at = np.minimum(base + mid, flat_alpha.size - 1)
            go = (flat_alpha[at] - flat_g[at]) < -beta
            lo = np.where(open_ & go, mid + 1, lo)
            hi = np.where(open_ & ~go, mid, hi)
        top = flat_alpha.size - 1
        after = np.minimum(base + lo, top)
        before = np.maximum(np.minimum(base + lo - 1, top), 0)
        load_after = np.where(lo < length, flat_alpha[after] + beta, INF)
        load_before = np.where(lo > 0, flat_g[before], INF)
        take_after = load_after <= load_before
        flat_idx = self.idx.reshape(-1)
        return (np.where(take_after, load_after, load_before),
                np.where(take_after, flat_idx[after], flat_idx[before]))


def _pareto_per_node(ids: np.ndarray, node: np.ndarray, alpha: np.ndarray, g: np.ndarray, end_node: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The finite points of each tree node that no point of the same node dominates.

    Returned sorted by node, then by rising ``alpha`` (falling ``g``).
    """
    finite = np.isfinite(alpha) & np.isfinite(g)
    ids, node, alpha, g = ids[finite], node[finite], alpha[finite], g[finite]
    order = np.lexsort((g, alpha, node))
    ids, node, alpha, g = ids[order], node[order], alpha[order], g[order]
    # Keep a point when its g is below every earlier one of its node. Exact segmented
    # running minimum on integer ranks of g, offset so that an earlier node never
    # undercuts a later one. Equal g get ranks rising with position (stable sort), so
    # a tie is never kept twice.
    rank = np.empty(g.size, dtype=np.int64)
    rank[np.argsort(g, kind="stable")] = np.arange(g.size)
    offset_rank = rank + (end_node - node) * (g.size + 1)
    running_min = np.minimum.accumulate(offset_rank) if offset_rank.size else offset_rank
    first = np.r_[True, node[1:] != node[:-1]] if offset_rank.size else np.zeros(0, bool)
    keep = first | (offset_rank < np.r_[0, running_min[:-1]])
    return ids[keep], node[keep], alpha[keep], g[keep]
