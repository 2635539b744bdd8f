"""The PipeDream-2BW planner: pipeline depth × data-parallel width and micro-batch size.

PipeDream-2BW (Narayanan et al., ICML 2021) runs ``d`` pipeline stages, each
replicated on ``w`` data-parallel workers, with no pipeline flush and two
weight versions per stage. Its planner picks ``d``, ``w`` and the micro-batch
size ``b`` for a global batch ``B`` (so ``m = B / (w·b)`` micro-batches per
worker and batch) that maximise throughput within each worker's memory.

Here every candidate ``(d, w, b)`` is an exact placement problem: the graph's
costs, given per micro-batch of the traced size ``b0``, are scaled by ``b /
b0`` (compute, transfers, activations; weights do not scale), each stage's
gradient all-reduce over its ``w`` replicas, ``2 (w-1)/w`` times the node's
all-reduce time, is spread over the ``m`` micro-batches of an update, and the
DP finds the best contiguous split into at most ``d`` stages under the 2BW
memory model (two weight versions, ``d - s`` micro-batches in flight on stage
``s``, or only stage inputs with ``recompute``; see
:class:`~meshtorch.placement.Problem`). A batch takes ``m × max load`` and the
throughput is ``B / (m × max load) = w·b / max load`` samples per time unit. 2BW
needs ``m >= d - 1`` micro-batches (the runtime's table; a batch's update must
land before the batch after next starts).

A node's all-reduce time is ``sync_time × graph.meta["micro_batches"]``
(``trace`` amortises it over that many micro-batches; 1 when absent).

Example:
    >>> from meshtorch.placement import OpGraph
    >>> from meshtorch.placement.plan2bw import plan_2bw
    >>> g = OpGraph()
    >>> for i in range(4):
    ...     _ = g.add_node(f"f{i}", acc_time=1.0, mem_bytes=4.0, weight_bytes=1.0, act_bytes=1.0,
    ...                    comm_time=0.5, color=f"c{i}")
    ...     _ = g.add_node(f"b{i}", acc_time=2.0, backward=True, color=f"c{i}")
    >>> for i in range(3):
    ...     g.add_edge(f"f{i}", f"f{i + 1}"); g.add_edge(f"b{i + 1}", f"b{i}")
    >>> plan = plan_2bw(g, devices=4, memory=16.0, batch=16)  # one stage (24 bytes) does not fit
    >>> plan.depth, plan.width, plan.microbatches, round(plan.throughput, 4)
    (2, 2, 8, 0.3077)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.problem import Placement, Problem


@dataclass
class Plan2BW:
    """The chosen configuration, its placement and every candidate considered."""

    depth: int
    width: int
    microbatches: int
    microbatch_size: int
    throughput: float
    time_per_batch: float
    placement: Placement
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object of ``meshtorch place --plan-2bw``."""
        return {
            "plan": "2bw",
            "depth": self.depth,
            "width": self.width,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "throughput": self.throughput,
            "time_per_batch": self.time_per_batch,
            "placement": self.placement.to_dict(),
            "candidates": self.candidates,
        }


def scaled_graph(graph: OpGraph, scale: float, width: int, microbatches: int) -> OpGraph:
    """``graph`` per micro-batch of ``scale`` × the traced size, on ``width`` replicas whose
    gradient all-reduce is spread over ``microbatches`` micro-batches (folded into compute)."""
    per_update = float(graph.meta.get("micro_batches", 1))
    share = 2.0 * (width - 1) / width / microbatches * per_update
    nodes = []
    for nd in graph.nodes:
        acc = None if nd.acc_time is None else nd.acc_time * scale + share * nd.sync_time
        nodes.append(replace(nd, acc_time=acc, cpu_time=None, comm_time=nd.comm_time * scale,
                             act_bytes=nd.act_bytes * scale, sync_time=0.0))
    return OpGraph(nodes=nodes, edges=list(graph.edges), meta=dict(graph.meta))


def plan_2bw(graph: OpGraph, *, devices: int, memory: float, batch: int,
             microbatch_sizes: Sequence[int] = (1,), traced_size: int = 1, recompute: bool = False,
             relay: bool | None = None) -> Plan2BW:
    """Best ``(depth, width, micro-batch size)`` for PipeDream-2BW on ``devices`` workers.

    ``batch`` is the global batch ``B`` in samples; ``microbatch_sizes`` the
    sizes ``b`` to try, ``traced_size`` the micro-batch size ``graph``'s costs
    are for. Raises :class:`PlacementError` when no candidate fits ``memory``.
    """
    if not graph.is_training:
        raise PlacementError("the 2BW planner plans training: trace the graph with training=True")
    if devices < 1 or batch < 1:
        raise PlacementError(f"need devices >= 1 and batch >= 1, got {devices} and {batch}")
    from meshtorch.placement.dp import solve_dp

    best: Plan2BW | None = None
    candidates: list[dict[str, Any]] = []
    # a stage holds at least one node and a replica at least one sample, so depths past the node
    # count and widths past the batch are never feasible: bounding them keeps the search (and
    # `--devices 1000000000`) to the graph's size
    for depth in range(1, min(devices, max(len(graph.nodes), 1)) + 1):
        for width in range(1, min(devices // depth, batch) + 1):
            for b in microbatch_sizes:
                if batch % (width * b):
                    continue
                m = batch // (width * b)
                if m < depth - 1:
                    continue
                g = scaled_graph(graph, b / traced_size, width, m)
                prob = Problem(devices=depth, cpus=0, memory=memory, training=True,
                               schedule="2bw", microbatches=m, recompute=recompute, relay=relay)
                try:
                    p = solve_dp(g, prob)
                except PlacementError:
                    candidates.append({"depth": depth, "width": width, "microbatch_size": b,
                                       "microbatches": m, "fits": False})
                    continue
                throughput = width * b / p.max_load if p.max_load > 0 else math.inf
                candidates.append({"depth": depth, "width": width, "microbatch_size": b,
                                   "microbatches": m, "fits": True, "stages": len(p.stages),
                                   "throughput": throughput})
                if best is None or throughput > best.throughput * (1 + 1e-12):
                    best = Plan2BW(len(p.stages), width, m, b, throughput, m * p.max_load, p)
    if best is None:
        raise PlacementError(
            f"no depth x width x micro-batch size fits {memory:.4g} bytes per worker on {devices} "
            f"workers with batch {batch}: try smaller micro-batches, recompute, or more memory")
    best.candidates = candidates
    return best
