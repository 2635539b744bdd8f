"""Candidate stages ``I \\ J`` of the DP over ideals, generated inside a pruning band.

A stage is the difference of two ideals ``J ⊂ I``. Only pairs whose stage could
carry a load of at most ``bound`` (an upper bound on the optimum) can be part of
an optimal pipeline, so for each ``J`` the candidate ``I`` are looked up by
bisection in the ideals sorted by accelerator and by CPU time, and then
filtered by inclusion, allowed device kind and memory, all vectorised.

Example:
    >>> import numpy as np
    >>> from meshtorch.placement import OpGraph, Problem
    >>> from meshtorch.placement.ideals import enumerate_ideals
    >>> from meshtorch.placement.pairs import CandidatePool, stage_pairs
    >>> from meshtorch.placement.prep import contract
    >>> g = OpGraph()
    >>> for n, t in zip("ab", [1.0, 2.0]):
    ...     _ = g.add_node(n, acc_time=t, cpu_time=t)
    >>> g.add_edge("a", "b")
    >>> ide = enumerate_ideals(contract(g))
    >>> pool = CandidatePool(ide, np.arange(ide.n))
    >>> prob = Problem(devices=2).resolve(g)
    >>> stage_pairs(ide, prob, 2.0, np.array([0]), pool).acc_cost  # {a}, and not {a, b} (load 3)
    array([1.])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtorch.placement.ideals import Ideals
from meshtorch.placement.problem import Problem

INF = np.inf
# relative slack for comparisons against memory and load bounds (float sums of costs)
TOL = 1e-9


@dataclass
class StagePairs:
    """The kept pairs ``J ⊂ I`` of one chunk of ``J``, grouped by ``J`` (runs of equal ``position``)."""

    position: np.ndarray  # index of J within the chunk
    bigger: np.ndarray  # the ideal I
    acc_cost: np.ndarray  # compute + comm of I \ J on an accelerator (inf: not allowed there)
    cpu_cost: np.ndarray  # compute of I \ J on a CPU (inf: not allowed there)
    memory: np.ndarray  # resident bytes of I \ J
    activations: np.ndarray  # bytes stashed per micro-batch in flight
    sync: np.ndarray  # gradient synchronisation time, paid by replicated stages

    @property
    def count(self) -> int:
        return int(self.position.size)


class CandidatePool:
    """Candidate ideals ``I``, sorted by accelerator and by CPU time for band queries."""

    def __init__(self, ide: Ideals, members: np.ndarray) -> None:
        self.by_acc = members[np.argsort(ide.acc[members], kind="stable")]
        self.acc = ide.acc[self.by_acc]
        self.by_cpu = members[np.argsort(ide.cpu[members], kind="stable")]
        self.cpu = ide.cpu[self.by_cpu]


def _in_band(ide: Ideals, prob: Problem, pool: CandidatePool, j: int, bound: float, eps: float,
             acc_band: float) -> np.ndarray:
    """Ideals of ``pool`` whose accelerator (or CPU) time exceeds ``J``'s by at most the band."""
    found = []
    acc_lo, acc_hi = ide.acc[j] - eps, ide.acc[j] + acc_band + eps
    if prob.devices:
        lo = np.searchsorted(pool.acc, acc_lo, "left")
        hi = np.searchsorted(pool.acc, acc_hi, "right")
        found.append(pool.by_acc[lo:hi])
    if prob.cpus:
        lo = np.searchsorted(pool.cpu, ide.cpu[j] - eps, "left")
        hi = np.searchsorted(pool.cpu, ide.cpu[j] + bound + eps, "right")
        cpu_only = pool.by_cpu[lo:hi]
        if prob.devices:  # drop those already in the accelerator band (no hashing)
            acc = ide.acc[cpu_only]
            cpu_only = cpu_only[(acc < acc_lo) | (acc > acc_hi)]
        found.append(cpu_only)
    return found[0] if len(found) == 1 else np.concatenate(found)


def _supersets(ide: Ideals, j: int, candidates: np.ndarray) -> np.ndarray:
    """The ``candidates`` that strictly contain ideal ``j``."""
    bits_j = ide.bits[j]
    keep = candidates != j
    for word in range(ide.bits.shape[1]):
        if bits_j[word]:
            keep &= (ide.bits[candidates, word] & bits_j[word]) == bits_j[word]
    return candidates[keep]


def stage_pairs(ide: Ideals, prob: Problem, bound: float, js: np.ndarray, pool: CandidatePool) -> StagePairs:
    """Pairs J ⊂ I (J in ``js``, I in ``pool``) whose stage could carry load <= ``bound``.

    A replicated accelerator stage divides its compute by up to ``max_replicas``,
    so the accelerator band is that many times wider.
    """
    acc_band = bound * (prob.max_replicas if prob.devices else 1)
    scale = max(1.0, float(np.max(ide.acc, initial=0.0)), float(np.max(ide.cpu, initial=0.0)))
    eps = 1e-9 * scale
    columns: dict[str, list[np.ndarray]] = {
        name: [] for name in ("position", "bigger", "acc_cost", "cpu_cost", "memory", "activations", "sync")
    }
    for position, j in enumerate(js.tolist()):
        candidates = _in_band(ide, prob, pool, j, bound, eps, acc_band)
        if candidates.size == 0:
            continue
        bigger = _supersets(ide, j, candidates)
        if bigger.size == 0:
            continue
        acc_ok = ide.acc_bad[bigger] == ide.acc_bad[j]
        memory = ide.mem[bigger] - ide.mem[j]
        acc_ok &= memory <= prob.memory * (1 + TOL)
        if prob.devices:
            # relayed values: the stage pays every transfer across its two borders
            comm = ide.cut[bigger] + ide.cut[j] if prob.relay else ide.comm(bigger, j)
            acc_cost = np.where(acc_ok, ide.acc[bigger] - ide.acc[j] + comm, INF)
        else:
            acc_cost = np.full(bigger.size, INF)
        if prob.cpus:
            cpu_cost = np.where(ide.cpu_bad[bigger] == ide.cpu_bad[j], ide.cpu[bigger] - ide.cpu[j], INF)
        else:
            cpu_cost = np.full(bigger.size, INF)
        keep = (acc_cost <= acc_band * (1 + TOL) + eps) | (cpu_cost <= bound * (1 + TOL) + eps)
        if not keep.any():
            continue
        bigger = bigger[keep]
        columns["position"].append(np.full(bigger.size, position, dtype=np.int64))
        columns["bigger"].append(bigger.astype(np.int64))
        columns["acc_cost"].append(acc_cost[keep])
        columns["cpu_cost"].append(cpu_cost[keep])
        columns["memory"].append(memory[keep])
        # recompute: a stage also stashes the values crossing its front border
        columns["activations"].append(ide.act[bigger] - ide.act[j] + ide.cut_inputs[j])
        columns["sync"].append(ide.sync[bigger] - ide.sync[j])
    if not columns["position"]:
        empty, empty_index = np.zeros(0), np.zeros(0, dtype=np.int64)
        return StagePairs(empty_index, empty_index, empty, empty, empty, empty, empty)
    return StagePairs(**{name: np.concatenate(parts) for name, parts in columns.items()})
