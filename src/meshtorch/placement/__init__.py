"""Device placement: split an operator graph into pipeline stages, optimally.

Build an :class:`OpGraph` (traced from an ``nn.Module``, or loaded from JSON in
our format or that of Tarnawski et al., NeurIPS 2020), describe the devices
with a :class:`Problem`, and call :func:`place`.

Example:
    >>> from meshtorch.placement import OpGraph, Problem, place
    >>> g = OpGraph()
    >>> for i, t in enumerate([1.0, 2.0, 3.0, 2.0]):
    ...     _ = g.add_node(f"l{i}", acc_time=t, cpu_time=10 * t)
    >>> for i in range(3):
    ...     g.add_edge(f"l{i}", f"l{i + 1}")
    >>> place(g, Problem(devices=2)).max_load
    5.0
"""

from meshtorch.placement.graph import OpGraph, OpNode, load_split
from meshtorch.placement.problem import (
    Placement,
    Problem,
    Stage,
    evaluate,
    is_contiguous,
    order_constraints,
)
from meshtorch.placement.solve import ALGORITHMS, place

__all__ = [
    "ALGORITHMS",
    "OpGraph",
    "OpNode",
    "Placement",
    "Problem",
    "Stage",
    "evaluate",
    "is_contiguous",
    "load_split",
    "order_constraints",
    "place",
]
