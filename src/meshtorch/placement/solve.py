"""One entry point for every placement algorithm.

Example:
    >>> from meshtorch.placement import OpGraph, Problem, place
    >>> g = OpGraph()
    >>> _ = g.add_node("a", acc_time=1.0, cpu_time=1.0)
    >>> place(g, Problem(devices=1), algorithm="dp").stages[0].nodes
    [0]
"""

from __future__ import annotations

from collections.abc import Callable

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.problem import Placement, Problem


def _dp(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.dp import solve_dp

    return solve_dp(g, p, **kw)


def _chain(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.dp import solve_chain

    return solve_chain(g, p, **kw)


def _ilp(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.milp import solve_milp

    return solve_milp(g, p, **kw)


def _greedy(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.baselines import equal_flops

    return equal_flops(g, p, **kw)


def _pipedream(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.baselines import pipedream

    return pipedream(g, p, **kw)


ALGORITHMS: dict[str, Callable[..., Placement]] = {
    "dp": _dp,
    "chain": _chain,
    "ilp": _ilp,
    "greedy": _greedy,
    "pipedream": _pipedream,
}


def place(graph: OpGraph, problem: Problem | None = None, algorithm: str = "dp", **kw) -> Placement:
    """Place ``graph`` with ``algorithm`` (one of :data:`ALGORITHMS`); kwargs go to it."""
    if algorithm not in ALGORITHMS:
        raise PlacementError(f"unknown algorithm {algorithm!r}; choose from {sorted(ALGORITHMS)}")
    return ALGORITHMS[algorithm](graph, problem or Problem(), **kw)
