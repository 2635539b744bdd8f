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
