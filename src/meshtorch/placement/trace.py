"""Operator graphs from ``nn.Module`` by ``torch.fx`` tracing, and running a placement.

Every fx node (placeholders and parameters included) becomes an :class:`OpNode`.
Shapes come from running the graph once on the example inputs; FLOPs from
``torch.utils.flop_counter`` while each node runs. Times follow a simple
roofline on a :class:`DeviceSpec` (``max(flops / peak, bytes touched / memory
bandwidth)``), or, with ``profile=True``, the measured time of each op on this
machine (for both device kinds). Times are per call of the module on the
example inputs (one micro-batch).

In training mode each op gets a backward node (twice its forward time, the
usual estimate; same colour, so it stays on the same device), edges mirrored,
and ``mem_bytes`` counts weights, gradients and two Adam moments.

Example:
    >>> import torch
    >>> from meshtorch.placement.trace import trace
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> g = trace(net, torch.randn(2, 8))
    >>> [n.name for n in g.nodes]
    ['input_1', '_0', '_1', '_2', 'output']
    >>> g.node("_0").flops
    512.0
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils.flop_counter import FlopCounterMode

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.problem import Placement


@dataclass(frozen=True)
class DeviceSpec:
    """Peak speeds used to turn FLOPs and bytes into times (seconds).

    Defaults: an accelerator of 100 TFLOP/s and 2 TB/s, a CPU of 1 TFLOP/s and
    100 GB/s, links of 25 GB/s, 8 micro-batches per optimizer step.
    """

    acc_flops: float = 100e12
    acc_bandwidth: float = 2e12
    cpu_flops: float = 1e12
    cpu_bandwidth: float = 100e9
    link_bandwidth: float = 25e9
    micro_batches: int = 8
    train_state_factor: float = 4.0  # weights + gradients + two Adam moments


def _bytes(x: Any) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.numel() * x.element_size())
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_bytes(y) for y in x.values())
    return 0.0


class _Costs(torch.fx.Interpreter):
    """Runs the graph once, recording per node: flops, output and input bytes, time."""

    def __init__(self, gm: torch.fx.GraphModule, profile: bool, repeats: int = 3):
        super().__init__(gm)
        self.profile = profile
        self.repeats = repeats
        self.flops: dict[str, float] = {}
        self.out_bytes: dict[str, float] = {}
        self.in_bytes: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.in_bytes[n.name] = _bytes(args) + _bytes(kwargs)
        with FlopCounterMode(display=False) as fc:
            out = super().run_node(n)
        self.flops[n.name] = float(fc.get_total_flops())
        self.out_bytes[n.name] = _bytes(out)
        if self.profile and n.op in ("call_module", "call_function", "call_method"):
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                super().run_node(n)
                times.append(time.perf_counter() - t0)
            self.seconds[n.name] = statistics.median(times)
        else:
            self.seconds[n.name] = 0.0
        return out


def _params_of(gm: torch.fx.GraphModule, n: torch.fx.Node) -> list[tuple[str, torch.Tensor]]:
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        return [(f"{n.target}.{k}", v) for k, v in
                list(mod.named_parameters()) + list(mod.named_buffers())]
    if n.op == "get_attr":
        obj = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return [(str(n.target), obj)] if isinstance(obj, torch.Tensor) else []
    return []


def trace(
    module: torch.nn.Module | torch.fx.GraphModule,
    *example_inputs: Any,
    spec: DeviceSpec | None = None,
    training: bool = False,
    profile: bool = False,
) -> OpGraph:
    """Trace ``module`` on ``example_inputs`` into a costed :class:`OpGraph`.

    Parameters shared by several ops (the same tensor object) give those ops a
    common colour, so they are placed together.
    """
    spec = spec or DeviceSpec()
    try:
        gm = module if isinstance(module, torch.fx.GraphModule) else torch.fx.symbolic_trace(module)
    except Exception as e:  # fx raises many types; say which module failed and why
        raise PlacementError(f"torch.fx cannot trace {type(module).__name__}: {e}") from e
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
            costs = _Costs(gm, profile)
            costs.run(*example_inputs)
    finally:
        gm.train(was_training)
    g = OpGraph(meta={"source": type(module).__name__, "training": training})
    owner: dict[int, str] = {}  # id(tensor) -> colour of the first node using it
    colours: dict[str, str] = {}
    fx_nodes = list(gm.graph.nodes)
    for n in fx_nodes:
        params = _params_of(gm, n)
        pbytes = sum(_bytes(t) for _, t in params)
        for _, t in params:
            key = id(t)
            if key in owner:
                colours[n.name] = owner[key]
            else:
                owner[key] = colours.get(n.name, n.name)
        flops = costs.flops.get(n.name, 0.0)
        touched = costs.in_bytes.get(n.name, 0.0) + costs.out_bytes.get(n.name, 0.0)
        if n.op in ("placeholder", "output", "get_attr"):
            acc = cpu = 0.0
        elif profile:
            acc = cpu = costs.seconds[n.name]
        else:
            acc = max(flops / spec.acc_flops, touched / spec.acc_bandwidth)
            cpu = max(flops / spec.cpu_flops, touched / spec.cpu_bandwidth)
        out_b = costs.out_bytes.get(n.name, 0.0) if n.op != "output" else 0.0
        g.add_node(
            n.name,
            acc_time=acc,
            cpu_time=cpu,
            mem_bytes=pbytes * (spec.train_state_factor if training else 1.0),
            act_bytes=out_b if training else 0.0,
            comm_time=out_b / spec.link_bandwidth,
            sync_time=(pbytes / spec.link_bandwidth / spec.micro_batches) if training else 0.0,
            flops=flops,
            op=f"{n.op}:{getattr(n.target, '__name__', n.target)}",
        )
    for n in fx_nodes:
        if n.name in colours:
            g.nodes[g.index(n.name)].color = colours[n.name]
            first = colours[n.name]
            g.nodes[g.index(first)].color = first
    for n in fx_nodes:
        for p in n.all_input_nodes:
            g.add_edge(p.name, n.name, costs.out_bytes.get(p.name, 0.0))
    if training:
        _add_backward(g, spec)
    return g


def _add_backward(g: OpGraph, spec: DeviceSpec) -> None:
    fwd = list(range(len(g.nodes)))
    edges = list(g.edges)
    for i in fwd:
        f = g.nodes[i]
        if f.color is None:
            f.color = f.name
        in_bytes = sum(b for u, v, b in edges if v == i)
        g.add_node(
            f"{f.name}.grad",
            acc_time=2.0 * (f.acc_time or 0.0) if f.acc_time is not None else None,
            cpu_time=2.0 * (f.cpu_time or 0.0) if f.cpu_time is not None else None,
            comm_time=in_bytes / spec.link_bandwidth,  # gradients of its inputs
            backward=True,
            color=f.color,
            flops=2.0 * f.flops,
            op=f"grad:{f.op}",
        )
    for u, v, b in edges:
        g.add_edge(f"{g.nodes[v].name}.grad", f"{g.nodes[u].name}.grad", b)
    for i in fwd:
        g.add_edge(i, f"{g.nodes[i].name}.grad", g.nodes[i].act_bytes)


def split(gm: torch.fx.GraphModule, placement: Placement) -> torch.fx.GraphModule:
    """Cut a traced module into one submodule per stage (``submod_0``, ``submod_1``, ...).

    Running the result computes the same function; each ``submod_i`` can be
    moved to its own device. Needs a contiguous placement of the graph traced
    from ``gm``.

    Example:
        >>> import torch
        >>> from meshtorch.placement import Problem, place
        >>> from meshtorch.placement.trace import split, trace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> gm = torch.fx.symbolic_trace(net)
        >>> x = torch.randn(3, 4)
        >>> parts = split(gm, place(trace(gm, x), Problem(devices=2)))
        >>> torch.allclose(parts(x), net(x))
        True
    """
    from torch.fx.passes.split_module import split_module

    if not placement.is_contiguous():
        raise PlacementError("only a contiguous placement can be cut into pipeline stages")
    where = placement.device_of()
    stage = {placement.graph.nodes[i].name: s for i, s in enumerate(where)}
    missing = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")
               and n.name not in stage]
    if missing:
        raise PlacementError(f"the placement does not cover traced nodes {missing[:5]}")
    return split_module(gm, gm, lambda n: stage[n.name])
