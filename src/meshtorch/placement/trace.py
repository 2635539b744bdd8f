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

import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils.flop_counter import FlopCounterMode

from meshtorch.errors import PlacementError
from meshtorch.nn.parameter import plain_parameters
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.prep import UnionFind
from meshtorch.placement.problem import Placement
from meshtorch.plan.devices import DEVICES

# The default accelerator: the planner's built-in A100 (meshtorch.plan.devices, from its row of the GPU
# table meshtorch.plan.gpus), at the rates the planner prices it (bf16 matmuls at half the data
# sheet's peak: 156 TFLOP/s; 2.04 TB/s). The link and the CPU have no piece there: a GPU row's link
# joins the GPUs of one machine (the A100's NVLink, 300 GB/s), while a pipeline's stages may sit on
# other machines (25 GB/s, a 200 Gb/s network), and the planner's CPU is measured, not built in.
DEFAULT_ACCELERATOR = DEVICES["a100"]


@dataclass(frozen=True)
class DeviceSpec:
    """Speeds used to turn FLOPs and bytes into times (seconds).

    Defaults: the accelerator :data:`DEFAULT_ACCELERATOR`, the planner's ``a100`` (156 TFLOP/s,
    2.04 TB/s), a CPU of 1 TFLOP/s and 100 GB/s, links of 25 GB/s, 8 micro-batches per optimizer
    step.

    Example:
        >>> DeviceSpec().acc_flops / 1e12, DeviceSpec().acc_bandwidth / 1e12
        (156.0, 2.039)
    """

    acc_flops: float = DEFAULT_ACCELERATOR.flops_per_second("bfloat16")
    acc_bandwidth: float = DEFAULT_ACCELERATOR.achievable_bandwidth
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
    return _graph_of(gm, example_inputs, spec, training, profile, type(module).__name__)


def _graph_of(
    gm: torch.fx.GraphModule,
    example_inputs: tuple[Any, ...],
    spec: DeviceSpec,
    training: bool,
    profile: bool,
    source: str,
    groups: dict[str, str] | None = None,
    costless: frozenset[str] = frozenset(),
) -> OpGraph:
    """The costed graph of ``gm``; ``groups`` colours nodes, ``costless`` nodes cost nothing."""
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
            costs = _Costs(gm, profile)
            costs.run(*example_inputs)
    finally:
        gm.train(was_training)
    # relay: split() runs the placement by relaying values that skip stages; price that
    g = OpGraph(meta={"source": source, "training": training, "relay": True})
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
        if n.op in ("placeholder", "output", "get_attr") or n.name in costless:
            acc = cpu = 0.0
        elif getattr(n.target, "is_view", False):
            acc = cpu = 0.0  # an aten view moves no data
        elif profile:
            acc = cpu = costs.seconds[n.name]
        else:
            acc = max(flops / spec.acc_flops, touched / spec.acc_bandwidth)
            cpu = max(flops / spec.cpu_flops, touched / spec.cpu_bandwidth)
        out_b = costs.out_bytes.get(n.name, 0.0) if n.op != "output" else 0.0
        if n.name in costless:
            pbytes = out_b = 0.0
        g.add_node(
            n.name,
            acc_time=acc,
            cpu_time=cpu,
            mem_bytes=pbytes * (spec.train_state_factor if training else 1.0),
            weight_bytes=pbytes,
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
    if groups:
        _merge_colours(g, groups)
    for n in fx_nodes:
        for p in n.all_input_nodes:
            g.add_edge(p.name, n.name, costs.out_bytes.get(p.name, 0.0))
    if training:
        _add_backward(g, spec)
    return g


def _merge_colours(g: OpGraph, groups: dict[str, str]) -> None:
    """Union the colour classes of ``g`` with ``groups`` (node name -> group key)."""
    uf = UnionFind(len(g))
    first: dict[str, int] = {}
    for i, nd in enumerate(g.nodes):
        for key in (("c", nd.color), ("g", groups.get(nd.name))):
            if key[1] is not None:
                uf.union(i, first.setdefault(f"{key[0]}:{key[1]}", i))
    sizes: dict[int, int] = {}
    for i in range(len(g)):
        sizes[uf.find(i)] = sizes.get(uf.find(i), 0) + 1
    for i, nd in enumerate(g.nodes):
        r = uf.find(i)
        if sizes[r] > 1 or nd.color is not None:
            nd.color = g.nodes[r].name


def trace_function(
    fn: Callable[..., Any],
    *example_inputs: Any,
    spec: DeviceSpec | None = None,
    training: bool = False,
    profile: bool = False,
) -> tuple[torch.fx.GraphModule, OpGraph]:
    """Trace any function of tensors at the ATen level (``make_fx``) into a costed graph.

    For code that ``torch.fx.symbolic_trace`` cannot see through — a meshtorch
    model built of ``MeshTensor`` ops, data-dependent Python — this records the
    ATen ops that actually run on ``example_inputs``. Returns the traced
    ``GraphModule`` (give it to :func:`split`) and its :class:`OpGraph`.

    Two modelling choices make the operator graph placeable:

    * parameters (``nn.Parameter`` captured by ``fn``), and the ops that only
      reshape them, share a colour with the ops that consume them: a weight
      lives on the device that uses it (as :func:`split` puts it there);
    * tensors computed from neither inputs nor parameters (``arange``, masks,
      position tables) are folded into constants that cost nothing: every stage
      can hold or rebuild its own copy.

    Example:
        >>> import torch
        >>> from meshtorch.placement import Problem, place
        >>> from meshtorch.placement.trace import split, trace_function
        >>> w = torch.nn.Parameter(torch.randn(4, 4))
        >>> def f(x):
        ...     h = torch.relu(x @ w.t())
        ...     return (h @ w.t()) * torch.arange(4.0)
        >>> x = torch.randn(3, 4)
        >>> gm, g = trace_function(f, x)
        >>> parts = split(gm, place(g, Problem(devices=2)))
        >>> torch.allclose(parts(x), f(x))
        True
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = spec or DeviceSpec()
    try:
        with plain_parameters():  # make_fx takes parameters of the exact Parameter type only
            gm = make_fx(fn)(*example_inputs)
    except Exception as e:  # make_fx raises many types; say what failed and why
        raise PlacementError(
            f"make_fx cannot trace {getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}"
        ) from e
    folded = _fold_constants(gm, example_inputs)
    groups = _weight_groups(gm)
    name = getattr(fn, "__name__", type(fn).__name__)
    return gm, _graph_of(gm, example_inputs, spec, training, profile, name, groups, folded)


def _is_param(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op != "get_attr":
        return False
    obj: Any = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part)
    return isinstance(obj, torch.Tensor) and (isinstance(obj, torch.nn.Parameter)
                                              or obj.requires_grad)


def _fold_constants(gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> frozenset[str]:
    """Replace subgraphs that depend on neither inputs nor parameters by constants.

    Returns the names of the new ``get_attr`` nodes.
    """
    nodes = list(gm.graph.nodes)
    varying: set[torch.fx.Node] = set()  # depends on an input or a parameter
    for n in nodes:
        if n.op == "placeholder" or _is_param(gm, n) or any(
            a in varying for a in n.all_input_nodes
        ):
            varying.add(n)
    fold = [
        n for n in nodes
        if n not in varying and n.op not in ("output", "get_attr")
        and any(u in varying or u.op == "output" for u in n.users)
    ]
    if not fold:
        return frozenset()
    values: dict[str, Any] = {}

    class _Grab(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n in fold:
                values[n.name] = out
            return out

    with torch.no_grad():
        _Grab(gm).run(*example_inputs)
    names = []
    for k, n in enumerate(fold):
        value = values[n.name]
        if not isinstance(value, torch.Tensor):
            continue  # a Python value: leave it to the op that made it
        attr = f"_folded_constant{k}"
        gm.register_buffer(attr, value.detach().clone())
        with gm.graph.inserting_before(n):
            new = gm.graph.get_attr(attr)
        n.replace_all_uses_with(new)
        names.append(new.name)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return frozenset(names)


def _weight_groups(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Group every node computed from parameters alone with the nodes that consume it."""
    nodes = list(gm.graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}
    on_input: set[torch.fx.Node] = set()
    on_param: set[torch.fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder" or any(a in on_input for a in n.all_input_nodes):
            on_input.add(n)
        if _is_param(gm, n) or any(a in on_param for a in n.all_input_nodes):
            on_param.add(n)
    uf = UnionFind(len(nodes))
    for n in on_param - on_input:
        for u in n.users:
            if u.op != "output":
                uf.union(idx[n], idx[u])
    size: dict[int, int] = {}
    for i in range(len(nodes)):
        size[uf.find(i)] = size.get(uf.find(i), 0) + 1
    return {n.name: str(uf.find(i)) for i, n in enumerate(nodes) if size[uf.find(i)] > 1}


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
    """Cut a traced module into a chain of stages (``submod_0``, ``submod_1``, ...).

    Running the result computes the same function; each ``submod_i`` can be
    moved to its own device. The stages form a chain, as
    :class:`~meshtorch.pipeline.Pipeline` runs them: ``submod_0`` takes the
    module's inputs, every later stage takes exactly what the one before returns
    (a tuple when it is more than one value), the last returns the module's
    output. A value that skips stages (a residual feeding a stage further on)
    is *relayed*: every stage in between receives it and returns it unchanged,
    the transfers that the placement cost model charges with
    ``Problem(relay=True)``. Each stage owns the parameters and constants it
    uses (the same objects, so training updates reach the model). Needs a
    contiguous placement of the graph traced from ``gm``.

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
    if not placement.is_contiguous():
        raise PlacementError("only a contiguous placement can be cut into pipeline stages")
    where = placement.device_of()
    stage_of = {placement.graph.nodes[i].name: s for i, s in enumerate(where)}
    nodes = list(gm.graph.nodes)
    missing = [n.name for n in nodes if n.op not in ("placeholder", "output", "get_attr")
               and n.name not in stage_of]
    if missing:
        raise PlacementError(f"the placement does not cover traced nodes {missing[:5]}")
    count = len(placement.stages)
    stage: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            stage[n] = 0  # the inputs enter the chain at stage 0
        elif n.op == "get_attr":
            stage[n] = -1  # every stage that uses an attribute reads it itself
        elif n.op == "output":
            stage[n] = count - 1
        else:
            stage[n] = stage_of[n.name]
    for n in nodes:
        for a in n.all_input_nodes:
            if stage[a] > stage[n]:
                raise PlacementError(f"traced node {n.name!r} (stage {stage[n]}) uses {a.name!r} from a "
                                     f"later stage {stage[a]}; the placement must be contiguous")
    # live[s]: the values crossing from stage s - 1 into stage s, in graph order
    last_use = {n: max((stage[u] for u in n.users), default=stage[n]) for n in nodes}
    live = [[n for n in nodes if n.op == "placeholder"]]
    live += [[n for n in nodes if stage[n] >= 0 and stage[n] < s <= last_use[n]] for s in range(1, count)]
    top = torch.fx.Graph()
    values: list[Any] = [top.placeholder(n.name) for n in live[0]]
    subs: dict[str, Any] = {}
    for s in range(count):
        subs[f"submod_{s}"] = _stage_graph(gm, nodes, stage, s, live[s],
                                           live[s + 1] if s + 1 < count else None)
        out = top.call_module(f"submod_{s}", tuple(values))
        k = len(live[s + 1]) if s + 1 < count else 1
        values = [out] if k == 1 else [top.call_function(operator.getitem, (out, i)) for i in range(k)]
    top.output(values[0])
    return torch.fx.GraphModule(subs, top, class_name="Stages")


def _stage_graph(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], stage: dict[torch.fx.Node, int],
                 s: int, inputs: list[torch.fx.Node], outputs: list[torch.fx.Node] | None
                 ) -> torch.fx.GraphModule:
    """Stage ``s`` as its own module: ``inputs`` in, its nodes, ``outputs`` (``None``: the result) out."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {n: g.placeholder(n.name) for n in inputs}
    for n in nodes:
        if n.op == "get_attr" and any(stage[u] == s for u in n.users):
            env[n] = g.node_copy(n, env.__getitem__)
        elif n.op not in ("placeholder", "output", "get_attr") and stage[n] == s:
            env[n] = g.node_copy(n, env.__getitem__)
        elif n.op == "output" and outputs is None:
            g.node_copy(n, env.__getitem__)
    if outputs is not None:
        g.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    # the root gm lends every call_module/get_attr target: the same parameter objects
    return torch.fx.GraphModule(gm, g, class_name=f"Stage{s}")
