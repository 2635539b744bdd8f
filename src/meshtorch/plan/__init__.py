"""``mt.plan``: predict and choose layouts before renting the machines (see docs/design.md, Around the core).

The ``meta`` backend runs one representative processor on meta tensors;
:func:`trace` records what that processor does (FLOPs, collectives, memory by
kind, the named shape of every MeshTensor); :func:`estimate` turns it into
bytes per axis, peak memory and a step time on a :class:`DeviceSpec`;
:func:`search` finds the fastest mesh and rules that fit. A step is any callable, or a
:class:`Program` that also says what a search may do with it (:mod:`meshtorch.plan.program`).

Example:
    >>> import meshtorch as mt
    >>> def step():
    ...     w = mt.random.normal("d_model:1024,d_ff:4096", seed=0, requires_grad=True)
    ...     x = mt.random.normal("batch:512,d_model:1024", seed=1)
    ...     with mt.plan.measure():
    ...         mt.reduce_sum(mt.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w)).backward()
    >>> t = mt.plan.trace(step, mesh="b:64,m:8", rules="batch:b; d_ff:m")
    >>> t.comm.bytes("b", "all_reduce"), t.flops == 2 * 2 * 8 * 1024 * 512
    (2097152, True)
"""

from meshtorch.plan.devices import DEVICES, DeviceSpec, Link, device
from meshtorch.plan.estimate import Estimate, estimate
from meshtorch.plan.program import Pipelining, Program, SpaceDims
from meshtorch.plan.ranking import SearchResult
from meshtorch.plan.search import search
from meshtorch.plan.tracing import Trace, measure, trace

__all__ = ["DEVICES", "DeviceSpec", "Estimate", "Link", "Pipelining", "Program", "SearchResult", "SpaceDims",
           "Trace", "device", "estimate", "measure", "search", "trace"]
