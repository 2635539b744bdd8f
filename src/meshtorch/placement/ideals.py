"""Ideals (down-closed node sets) of a supernode DAG, with per-ideal cost sums.

A contiguous stage is the difference ``I \\ J`` of two ideals ``J ⊂ I``; the DP
walks over ideals. They are enumerated node by node in topological order: the
ideals of the first ``v+1`` nodes are those of the first ``v`` plus, for each of
them that holds all predecessors of ``v``, the same set with ``v`` added. Each
intermediate family is a sub-family of the final one, so the work is
``O(m · N)`` bit tests, done on packed ``uint64`` words with numpy.

Example:
    >>> from meshtorch.placement import OpGraph
    >>> from meshtorch.placement.prep import contract
    >>> from meshtorch.placement.ideals import enumerate_ideals
    >>> g = OpGraph()
    >>> for n in "abcd":
    ...     _ = g.add_node(n, acc_time=1.0, cpu_time=1.0, comm_time=1.0)
    >>> for u, v in ["ab", "ac", "bd", "cd"]:
    ...     g.add_edge(u, v)
    >>> enumerate_ideals(contract(g)).n  # {}, a, ab, ac, abc, abcd
    6
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshtorch.errors import PlacementError
from meshtorch.placement.prep import Contracted, set_bits


@dataclass
class Ideals:
    """``n`` ideals: packed membership bits and the sums the DP needs."""

    bits: np.ndarray  # (n, words) uint64
    acc: np.ndarray  # accelerator time of supported members
    acc_bad: np.ndarray  # number of members an accelerator cannot run
    cpu: np.ndarray
    cpu_bad: np.ndarray
    mem: np.ndarray
    act: np.ndarray
    sync: np.ndarray
    cover: np.ndarray  # (n, H) members of each communication hyperedge inside the ideal
    hsize: np.ndarray  # (H,) size of each hyperedge
    hcost: np.ndarray  # (H,) comm time of each hyperedge
    cut: np.ndarray  # comm time of the hyperedges the ideal cuts (partially covers)
    cut_inputs: np.ndarray  # bytes of the stash-input hyperedges the ideal cuts (recompute)

    @property
    def n(self) -> int:
        return int(self.bits.shape[0])

    def comm(self, big: np.ndarray, small: int) -> np.ndarray:
        """Communication time of the stages ``big[k] \\ small`` (``small`` ⊆ each ``big``).

        A hyperedge cut by ``big`` and untouched by ``small`` is cut by the stage; of
        those cut by ``small``, one covered equally by both is not, one that
        ``big`` covers fully is, and one in between is cut by ``big`` already.
        """
        out = self.cut[big].copy()
        part = np.nonzero((self.cover[small] > 0) & (self.cover[small] < self.hsize))[0]
        if part.size:
            cb = self.cover[np.ix_(big, part)]
            cs = self.cover[small, part]
            sign = (cb == self.hsize[part]).astype(np.float64) - (cb == cs)
            out += sign @ self.hcost[part]
        return out


def prefix_masks(c: Contracted, order: list[int]) -> list[int]:
    """The ideals formed by the prefixes of a topological ``order`` (a chain of ideals)."""
    out, cur = [0], 0
    for v in order:
        cur |= 1 << v
        out.append(cur)
    return out


def enumerate_ideals(c: Contracted, limit: int = 3_000_000) -> Ideals:
    """All ideals of the contracted DAG; raises :class:`PlacementError` past ``limit``."""
    m = c.m
    words = max(1, (m + 63) // 64)
    bits = np.zeros((1, words), dtype=np.uint64)
    for v in range(m):
        pm = c.preds[v]
        sel = np.ones(bits.shape[0], dtype=bool)
        for w in range(words):
            chunk = (pm >> (64 * w)) & 0xFFFFFFFFFFFFFFFF
            if chunk:
                ck = np.uint64(chunk)
                sel &= (bits[:, w] & ck) == ck
        new = bits[sel]
        new[:, v // 64] |= np.uint64(1 << (v % 64))
        bits = np.concatenate([bits, new])
        if bits.shape[0] > limit:
            raise PlacementError(
                f"the graph has more than {limit} ideals after {v + 1} of {m} supernodes; "
                "the exact DP would not finish: use --algorithm ilp or a coarser graph"
            )
    return _with_sums(c, bits)


def ideals_from_masks(c: Contracted, masks: list[int]) -> Ideals:
    """Ideals given as Python-int bitmasks (e.g. :func:`prefix_masks`)."""
    words = max(1, (c.m + 63) // 64)
    bits = np.zeros((len(masks), words), dtype=np.uint64)
    for i, mk in enumerate(masks):
        for w in range(words):
            bits[i, w] = np.uint64((mk >> (64 * w)) & 0xFFFFFFFFFFFFFFFF)
    return _with_sums(c, bits)


def _with_sums(c: Contracted, bits: np.ndarray) -> Ideals:
    m = c.m
    n = bits.shape[0]
    # unpack to an (n, m) 0/1 matrix in slabs, so sums are matrix products
    acc = np.array([0.0 if math.isinf(x) else x for x in c.acc])
    acc_bad = np.array([1.0 if math.isinf(x) else 0.0 for x in c.acc])
    cpu = np.array([0.0 if math.isinf(x) else x for x in c.cpu])
    cpu_bad = np.array([1.0 if math.isinf(x) else 0.0 for x in c.cpu])
    node_attrs = np.stack([acc, acc_bad, cpu, cpu_bad, np.array(c.mem, dtype=float),
                           np.array(c.act, dtype=float), np.array(c.sync, dtype=float)], axis=1)
    hmask = [h for h, _ in c.hyper]
    inc = np.zeros((m, len(hmask)), dtype=np.float32)
    for j, h in enumerate(hmask):
        for v in set_bits(h):
            inc[v, j] = 1.0
    sums = np.empty((n, node_attrs.shape[1]))
    cover = np.empty((n, len(hmask)), dtype=np.int32)
    slab = max(1, 2_000_000 // max(m, 1))
    for s in range(0, n, slab):
        x = _unpack(bits[s : s + slab], m)
        sums[s : s + slab] = x @ node_attrs
        cover[s : s + slab] = np.rint(x.astype(np.float32) @ inc).astype(np.int32)
    hsize = inc.sum(axis=0).astype(np.int32)
    hcost = np.array([cst for _, cst in c.hyper], dtype=float)
    cut = ((cover > 0) & (cover < hsize)).astype(np.float64) @ hcost if len(hmask) else np.zeros(n)
    return Ideals(
        bits, sums[:, 0], np.rint(sums[:, 1]), sums[:, 2], np.rint(sums[:, 3]), sums[:, 4],
        sums[:, 5], sums[:, 6], cover, hsize, hcost, np.asarray(cut, dtype=float),
        _cut_of(bits, m, c.inputs_hyper),
    )


def _cut_of(bits: np.ndarray, m: int, hyper: list[tuple[int, float]]) -> np.ndarray:
    """Per ideal, the summed weight of the hyperedges it partially covers."""
    out = np.zeros(bits.shape[0])
    if not hyper:
        return out
    inc = np.zeros((m, len(hyper)), dtype=np.float32)
    for j, (h, _) in enumerate(hyper):
        for v in set_bits(h):
            inc[v, j] = 1.0
    size = inc.sum(axis=0)
    weight = np.array([w for _, w in hyper])
    slab = max(1, 2_000_000 // max(m, 1))
    for s in range(0, bits.shape[0], slab):
        cover = np.rint(_unpack(bits[s : s + slab], m).astype(np.float32) @ inc)
        out[s : s + slab] = ((cover > 0) & (cover < size)).astype(np.float64) @ weight
    return out


def _unpack(bits: np.ndarray, m: int) -> np.ndarray:
    as_bytes = bits.astype("<u8").view(np.uint8).reshape(bits.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :m].astype(np.float64)
