"""Seconds of a collective from its payload, group size and link (alpha-beta model).

``B`` is the payload one processor hands to the collective (what
:class:`~meshtorch.comm.stats.CommStats` counts), ``n`` the group size, ``bw``
the link's bytes per second each way and ``lat`` its latency per hop.

Ring (bandwidth-optimal; Patarasuk & Yuan 2009, Thakur et al. 2005):

| kind | seconds |
|---|---|
| all_reduce | 2(n-1)/n · B/bw + 2(n-1)·lat |
| reduce_scatter (B = whole input) | (n-1)/n · B/bw + (n-1)·lat |
| all_gather (B = one piece) | (n-1) · B/bw + (n-1)·lat |
| all_to_all (B = whole input) | (n-1)/n · B/bw + (n-1)·lat |
| broadcast (pipelined) | B/bw + (n-1)·lat |
| permute / shift (B = bytes sent) | B/bw + lat |
| send (B = bytes sent; point-to-point) | B/bw + lat |
| recv | 0 (its time is the matching send's) |

Ring attention (a split ``length``) is a sequence of such shifts, each costed as one call:
its bytes are what a real run sends, so the formula needs nothing of its own.

Tree (latency-optimal, binomial; ``algorithm="tree"``): all_reduce
2⌈log2 n⌉·(lat + B/bw), broadcast ⌈log2 n⌉·(lat + B/bw); the other kinds
keep their ring cost. Each formula is linear in ``B``, so ``calls`` calls of
``nbytes`` payload in total cost ``f(nbytes)`` plus ``calls - 1`` more latency terms.

Example:
    >>> from meshtorch.plan.cost import collective_seconds
    >>> collective_seconds("all_reduce", 8e9, 4, bandwidth=1e9, latency=0.0)   # 2·3/4·8
    12.0
    >>> collective_seconds("all_reduce", 8e9, 4, bandwidth=1e9, latency=0.0, algorithm="tree")
    32.0
"""

from __future__ import annotations

import math

from meshtorch.errors import PlanError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "broadcast", "send", "recv")
ALGORITHMS = ("ring", "tree")


def _terms(kind: str, n: int, algorithm: str) -> tuple[float, float]:
    """(bytes multiplier of B/bw, number of latency hops) of one call."""
    if n <= 1:
        return 0.0, 0.0
    log = math.ceil(math.log2(n))
    if kind == "all_reduce":
        return (2.0 * log, 2.0 * log) if algorithm == "tree" else (2.0 * (n - 1) / n, 2.0 * (n - 1))
    if kind == "broadcast":
        return (float(log), float(log)) if algorithm == "tree" else (1.0, float(n - 1))
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n, float(n - 1)
    if kind == "all_gather":
        return float(n - 1), float(n - 1)
    if kind in ("permute", "send"):
        return 1.0, 1.0
    if kind == "recv":
        return 0.0, 0.0
    raise PlanError(f"no cost formula for collective {kind!r}; known: {KINDS}")


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float, latency: float,
                       calls: int = 1, algorithm: str = "ring") -> float:
    """Seconds of ``calls`` collectives of ``kind`` moving ``nbytes`` payload in all over ``n``."""
    if algorithm not in ALGORITHMS:
        raise PlanError(f"algorithm {algorithm!r} is not one of {ALGORITHMS}")
    per_byte, hops = _terms(kind, n, algorithm)
    return per_byte * nbytes / bandwidth + hops * latency * calls
