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


def _throughput_only(name: str, p: Problem) -> None:
    if p.objective != "throughput":
        raise PlacementError(
            f"algorithm {name!r} minimises max load; for --objective {p.objective} "
            "use 'ilp' (exact) or 'greedy' (the paper's baseline)"
        )


def _dp(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.dp import solve_dp

    _throughput_only("dp", p)
    if p.interleaved:
        from meshtorch.placement.interleave import place_chunks

        return place_chunks(g, p, **kw)
    return solve_dp(g, p, **kw)


def _chain(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.dp import solve_chain

    _throughput_only("chain", p)
    return solve_chain(g, p, **kw)


def _ilp(g: OpGraph, p: Problem, **kw) -> Placement:
    if p.objective == "latency":
        from meshtorch.placement.latency_milp import solve_latency_milp

        kw.pop("contiguous", None)
        return solve_latency_milp(g, p, **kw)
    from meshtorch.placement.milp import solve_milp

    return solve_milp(g, p, **kw)


def _greedy(g: OpGraph, p: Problem, **kw) -> Placement:
    if p.objective == "latency":
        from meshtorch.placement.latency import greedy_latency

        return greedy_latency(g, p, **kw)
    from meshtorch.placement.baselines import equal_flops

    return equal_flops(g, p, **kw)


def _pipedream(g: OpGraph, p: Problem, **kw) -> Placement:
    from meshtorch.placement.baselines import pipedream

    _throughput_only("pipedream", p)
    return pipedream(g, p, **kw)


ALGORITHMS: dict[str, Callable[..., Placement]] = {
    "dp": _dp,
    "chain": _chain,
    "ilp": _ilp,
    "greedy": _greedy,
    "pipedream": _pipedream,
}


def place(graph: OpGraph, problem: Problem | None = None, algorithm: str = "dp", **kw) -> Placement:
    """Place ``graph`` with ``algorithm`` (one of :data:`ALGORITHMS`); kwargs go to it.

    ``problem.objective`` picks what is minimised: ``"throughput"`` (max load;
    every algorithm) or ``"latency"`` (``ilp`` and ``greedy``).
    """
    if algorithm not in ALGORITHMS:
        raise PlacementError(f"unknown algorithm {algorithm!r}; choose from {sorted(ALGORITHMS)}")
    problem = problem or Problem()
    graph.validate()  # a cycle or a NaN/negative cost is named here, whichever algorithm runs
    resolved = problem.resolve(graph)  # bad fields are reported as such, before any algorithm runs
    if resolved.interleaved and algorithm not in ("dp", "ilp"):
        raise PlacementError(f"algorithm {algorithm!r} places one stage per device; chunks for the "
                             "interleaved schedule are placed by 'dp' (the DP, and the MILP when memory "
                             "binds across a device's chunks) or 'ilp' (the MILP)")
    return ALGORITHMS[algorithm](graph, problem, **kw)
