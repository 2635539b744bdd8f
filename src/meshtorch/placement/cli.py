"""The ``meshtorch place`` sub-command.

Example:
    $ meshtorch place model.json --devices 4 --memory 16GiB --algorithm dp
    $ meshtorch place mypkg.models:Net --input-shape 8,3,32,32 --devices 2 --json
    $ meshtorch place model.json --devices 4 --microbatches 8 --virtual-stages auto --training
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.problem import Problem
from meshtorch.placement.solve import ALGORITHMS, place

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184.0; plain numbers are bytes (``16GB`` is 1e9 · 16, ``16GiB`` 2**30 · 16).

    Example:
        >>> parse_bytes("1.5KiB")
        1536.0
    """
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PlacementError(f"cannot read a memory size from {text!r} (try 16GiB or 1e9)")
    try:
        return float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise PlacementError(f"cannot read a memory size from {text!r}") from None


def check_memory(graph: OpGraph, text: str, memory: float) -> None:
    """Refuse a ``--memory`` that no accelerator can use: one too small for a node it could hold.

    A plain number counts bytes, so ``--memory 16`` (meant as 16 GiB) is 16 bytes, which holds
    no node: every node then went to the CPUs (or the placement was infeasible) without a word
    about why. A unit-less number under a MiB and below the largest node an accelerator runs is
    named with that node and the unit; any bound below the smallest such node leaves the
    accelerators empty.

    Example:
        >>> g = OpGraph()
        >>> _ = g.add_node("conv1", acc_time=1.0, cpu_time=5.0, mem_bytes=2**20)
        >>> check_memory(g, "16", 16.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshtorch.errors.PlacementError: --memory 16 is 16 bytes ... node 'conv1' alone needs (1.00MiB): ...
        >>> check_memory(g, "16GiB", 16.0 * 2**30)  # fits
    """
    from meshtorch.placement.report import _bytes

    nodes = [n for n in graph.nodes if n.acc_time is not None]
    if not nodes or not memory > 0:  # Problem.resolve names a bound <= 0
        return
    biggest = max(nodes, key=lambda n: n.mem_bytes)
    smallest = min(nodes, key=lambda n: n.mem_bytes)
    unitless = re.fullmatch(r"\s*[0-9.eE+-]+\s*", text) is not None
    # (a plain number of a MiB or more is taken as the bytes it says: a node bigger than it goes to
    # the CPUs, as with a unit)
    if unitless and memory < min(biggest.mem_bytes, 2**20):
        raise PlacementError(
            f"--memory {text.strip()} is {memory:.6g} bytes (a plain number counts bytes), less than node "
            f"{biggest.name!r} alone needs ({_bytes(biggest.mem_bytes)}): write the unit, e.g. --memory "
            f"{text.strip()}GiB")
    if memory < smallest.mem_bytes:
        raise PlacementError(
            f"--memory {text.strip()} ({_bytes(memory)}) holds no node on an accelerator: the smallest, "
            f"{smallest.name!r}, needs {_bytes(smallest.mem_bytes)}, so every node would go to the CPUs; "
            "pass the accelerators' real memory")


def load_graph(spec: str, *, training: bool, input_shape: str | None, profile: bool) -> OpGraph:
    """A JSON file (ours or the paper's), or ``module:Class`` traced with torch.fx."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        return OpGraph.from_json(path)
    if ":" not in spec:
        raise PlacementError(f"{spec!r} is neither a JSON file nor module:Class")
    import torch

    from meshtorch.placement.trace import trace

    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, str(Path.cwd()))
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise PlacementError(f"cannot import {spec}: {e}") from None
    if isinstance(obj, type):
        _check_builds_without_arguments(obj, spec)
        module = obj()  # a TypeError from the constructor's own code shows as itself, with its traceback
    else:
        module = obj
    if input_shape is not None:
        inputs = (torch.randn(*parse_input_shape(input_shape)),)
        source = f"--input-shape {input_shape}"
    elif hasattr(module, "example_inputs"):
        inputs = tuple(module.example_inputs())
        source = f"{spec}.example_inputs()"
    else:
        raise PlacementError(f"{spec} has no example_inputs(); give --input-shape B,...")
    check_forward(module, inputs, spec, source)
    return trace(module, *inputs, training=training, profile=profile)


def _check_builds_without_arguments(cls: type, spec: str) -> None:
    """Refuse a class whose constructor has required parameters, naming them (its signature is
    asked, not the constructor run: a TypeError the constructor raises is the model's own bug).

    Example:
        >>> class Net:
        ...     def __init__(self, width, depth=2): ...
        >>> _check_builds_without_arguments(Net, "m:Net")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshtorch.errors.PlacementError: cannot build m:Net without arguments (missing ... 'width'): ...
    """
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a builtin): building it will tell
        return
    try:
        signature.bind()
    except TypeError as e:
        raise PlacementError(f"cannot build {spec} without arguments ({e}): give its arguments defaults, "
                             "or name a module instance built in that file (module:net, net = Net(...))"
                             ) from None


def parse_input_shape(text: str) -> list[int]:
    """``--input-shape``'s sizes, batch first, or a PlacementError naming the flag.

    Example:
        >>> parse_input_shape("8,3,32,32")
        [8, 3, 32, 32]
        >>> parse_input_shape("8,3,x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshtorch.errors.PlacementError: --input-shape '8,3,x' is not a list of positive integers: ...
    """
    try:
        shape = [int(x) for x in text.split(",")]
    except ValueError:
        shape = []
    if not shape or min(shape) < 1:
        raise PlacementError(
            f"--input-shape {text!r} is not a list of positive integers: give the input's sizes, batch "
            "first, separated by commas, e.g. --input-shape 8,3,32,32")
    return shape


def check_forward(module: Any, inputs: tuple, spec: str, source: str) -> None:
    """Run ``module`` once on ``inputs``, so that an input it cannot take is named here, with the
    layer that refused it, rather than as torch.fx's ShapeProp traceback from inside the tracer.

    Example (the error is one line):
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
        >>> check_forward(net, (torch.randn(8, 4),), "m:Net", "--input-shape 8,4")
        >>> bad = (torch.randn(8, 3),)
        >>> check_forward(net, bad, "m:Net", "--input-shape 8,3")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        meshtorch.errors.PlacementError: m:Net cannot run on --input-shape 8,3: its layer '0' (Linear)
        takes (batch, ..., 4); torch says: mat1 and mat2 shapes cannot be multiplied (8x3 and 4x2).
        Give --input-shape the sizes the model's forward takes, batch first (it makes one float tensor:
        for other inputs, e.g. token ids, give the model an example_inputs() method)
    """
    import torch

    running: list[tuple[str, torch.nn.Module]] = []  # the leaf layers entered and not yet left
    names = {m: name for name, m in module.named_modules()} if isinstance(module, torch.nn.Module) else {}
    hooks = []
    for m in names:
        if next(m.children(), None) is None:
            hooks.append(m.register_forward_pre_hook(lambda m, a: running.append((names[m], m))))
            hooks.append(m.register_forward_hook(lambda m, a, o: running.pop() and None))  # None: keep o
    # in eval mode, on a forked random stream: the check changes no BatchNorm statistics and
    # draws no dropout mask from the stream the trace that follows uses
    training = module.training if isinstance(module, torch.nn.Module) else None
    try:
        if training is not None:
            module.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module(*inputs)
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        where = f"{_wants(*running[-1])}; " if running else ""
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlacementError(
            f"{spec} cannot run on {source}: {where}torch says: {said}. Give --input-shape the sizes "
            "the model's forward takes, batch first (it makes one float tensor: for other inputs, e.g. "
            "token ids, give the model an example_inputs() method)") from None
    finally:
        for h in hooks:
            h.remove()
        if training is not None:
            module.train(training)


def _wants(name: str, layer: Any) -> str:
    """The input a layer takes, where its type says it: a convolution's channels, a Linear's features."""
    import torch

    kind = type(layer).__name__
    who = f"its layer {name!r} ({kind})" if name else f"the model ({kind})"
    nn = torch.nn
    if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                          nn.ConvTranspose3d)):
        space = {1: "L", 2: "H, W", 3: "D, H, W"}.get(len(layer.kernel_size), "...")
        return f"{who} takes (batch, {layer.in_channels}, {space})"
    if isinstance(layer, torch.nn.Linear):
        return f"{who} takes (batch, ..., {layer.in_features})"
    return f"it failed in {who}"


def run(args: argparse.Namespace) -> int:
    graph = load_graph(args.model, training=args.training, input_shape=args.input_shape,
                       profile=args.profile)
    graph.validate()  # every malformed field named before any flag or algorithm reads it
    if args.training and not graph.is_training:
        raise PlacementError(f"{args.model} has no backward nodes; it is an inference graph")
    virtual = _virtual_stages(args.virtual_stages)
    schedule = args.schedule or ("interleaved" if virtual is not None else "1f1b")
    if virtual is not None and schedule != "interleaved":
        raise PlacementError(f"--virtual-stages places chunks for the interleaved schedule; drop --schedule "
                             f"{schedule} or pass --schedule interleaved")
    memory = parse_bytes(args.memory) if args.memory else None
    if memory is not None:
        check_memory(graph, args.memory, memory)
    problem = Problem(
        devices=args.devices,
        memory=memory,
        cpus=args.cpus,
        training=True if args.training else None,
        stash=not args.no_stash,
        max_replicas=args.replicas,
        objective=args.objective,
        subgraphs=args.subgraphs,
        relay=args.relay,
        schedule=schedule,
        microbatches=args.microbatches,
        recompute=args.recompute,
        virtual_stages=virtual if isinstance(virtual, int) else 1,
    )
    if args.plan_2bw:
        return _plan_2bw(graph, args)
    kw = {}
    if args.algorithm == "ilp":
        kw = {"time_limit": args.time_limit, "contiguous": args.contiguous}
        if args.no_warm_start:
            kw["warm_start"] = False
    if virtual == "auto":
        return _auto_virtual_stages(graph, problem, args, kw)
    p = place(graph, problem, args.algorithm, **kw)
    if args.json:
        out = p.to_dict()
        if p.problem.interleaved:
            from meshtorch.placement.interleave import bubble, step_time

            out.update(virtual_stages=p.problem.virtual_stages, step_time=step_time(p), bubble=bubble(p))
        print(json.dumps(out))
    else:
        from meshtorch.placement.report import table

        print(table(p))
        if p.problem.interleaved:
            from meshtorch.placement.interleave import bubble, step_time

            print(f"interleaved 1F1B, {p.problem.virtual_stages} chunks per device: step time "
                  f"{step_time(p):.6g}, bubble {bubble(p):.1%}")
    if args.png:
        from meshtorch.placement.report import plot

        plot(p, args.png)
    return 0


def _virtual_stages(text: str | None) -> int | str | None:
    """``--virtual-stages``: a count >= 1, ``auto``, or not given."""
    if text is None or text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise PlacementError(f"--virtual-stages takes a chunk count >= 1 or 'auto', got {text!r}")
    return v


def _auto_virtual_stages(graph: OpGraph, problem: Problem, args: argparse.Namespace, kw: dict) -> int:
    from meshtorch.placement.interleave import compare_virtual_stages

    if args.max_virtual_stages < 1:
        raise PlacementError(f"--max-virtual-stages must be >= 1, got {args.max_virtual_stages}")
    choice = compare_virtual_stages(graph, problem, args.max_virtual_stages, args.algorithm, **kw)
    if args.json:
        print(json.dumps(choice.to_dict()))
    else:
        print(choice.table())
    if choice.best is None:
        raise PlacementError(choice.summary())
    return 0


def _plan_2bw(graph: OpGraph, args: argparse.Namespace) -> int:
    from meshtorch.placement.plan2bw import plan_2bw

    if args.batch is None:
        raise PlacementError("--plan-2bw needs the global batch size: --batch B")
    prob = Problem(devices=args.devices, memory=parse_bytes(args.memory) if args.memory else None,
                   training=True).resolve(graph)  # run() has checked --memory
    # resolve() caps devices at what one pipeline can use; 2BW also replicates it data-parallel
    workers = args.devices if args.devices is not None else int(graph.meta.get("devices", 1))
    try:
        sizes = [int(x) for x in args.microbatch_sizes.split(",")]
    except ValueError:
        raise PlacementError(f"--microbatch-sizes takes integers like 1,2,4, got "
                             f"{args.microbatch_sizes!r}") from None
    plan = plan_2bw(graph, devices=workers, memory=prob.memory, batch=args.batch,
                    microbatch_sizes=sizes, traced_size=args.traced_size,
                    recompute=args.recompute, relay=args.relay)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        from meshtorch.placement.report import table

        print(f"PipeDream-2BW: depth {plan.depth} x width {plan.width}, micro-batch size "
              f"{plan.microbatch_size}, {plan.microbatches} micro-batches per worker, "
              f"throughput {plan.throughput:.4g} samples per time unit")
        print(table(plan.placement))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``place`` to the ``meshtorch`` command line."""
    ap = subparsers.add_parser(
        "place", help="split an operator graph over devices (max throughput or min latency)",
        description="Place a DNN operator graph on devices, maximising pipeline throughput "
                    "or minimising one sample's latency.",
    )
    ap.add_argument("model", help="graph JSON (ours or dnn-partitioning) or module:Class")
    ap.add_argument("--devices", type=int, default=None, help="accelerators (default: file's)")
    ap.add_argument("--memory", default=None, help="memory per accelerator with its unit: 16GiB, 16GB, 512MB "
                    "(a plain number counts bytes)")
    ap.add_argument("--cpus", type=int, default=None, help="CPUs (default: file's, else 0)")
    ap.add_argument("--training", action="store_true", help="training mode (fwd+bwd)")
    ap.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="dp")
    ap.add_argument("--replicas", type=int, default=1, help="max data-parallel replicas/stage")
    ap.add_argument("--no-stash", action="store_true",
                    help="do not count stashed activations of in-flight micro-batches")
    ap.add_argument("--objective", choices=["throughput", "latency"], default="throughput",
                    help="minimise max load (pipeline) or one sample's end-to-end time")
    ap.add_argument("--subgraphs", type=int, default=1,
                    help="latency: subgraphs per accelerator (non-contiguous when > 1)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="ilp: seconds")
    ap.add_argument("--no-warm-start", action="store_true",
                    help="ilp: do not start from the DP's (latency: greedy's) placement")
    ap.add_argument("--contiguous", action="store_true", help="ilp: pipeline-ordered only")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "2bw", "interleaved"], default=None,
                    help="training: the pipeline schedule whose memory each stage must fit "
                         "(2bw: a second weight version; gpipe: all micro-batches stashed; "
                         "interleaved: --virtual-stages chunks per device); default 1f1b")
    ap.add_argument("--virtual-stages", default=None, metavar="V|auto",
                    help="cut the graph into devices x V contiguous chunks, chunk c on device c mod devices, "
                         "for interleaved 1F1B (needs --microbatches, a multiple of --devices); 'auto' "
                         "places V = 1 .. --max-virtual-stages and says which step time wins")
    ap.add_argument("--max-virtual-stages", type=int, default=4,
                    help="--virtual-stages auto: the largest V tried")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="training: micro-batches per batch (caps 1F1B's in-flight count; "
                         "needed by gpipe)")
    ap.add_argument("--recompute", action="store_true",
                    help="training: stages stash only their inputs and recompute the forward")
    ap.add_argument("--plan-2bw", action="store_true",
                    help="choose PipeDream-2BW's depth x width and micro-batch size (training)")
    ap.add_argument("--batch", type=int, default=None, help="--plan-2bw: global batch size")
    ap.add_argument("--microbatch-sizes", default="1",
                    help="--plan-2bw: micro-batch sizes to try, e.g. 1,2,4")
    ap.add_argument("--traced-size", type=int, default=1,
                    help="--plan-2bw: the micro-batch size the graph's costs are for")
    ap.add_argument("--relay", action=argparse.BooleanOptionalAction, default=None,
                    help="charge values that skip stages on every stage that relays them "
                         "(default: on for traced modules, off for the paper's JSON files)")
    ap.add_argument("--input-shape", default=None, help="module:Class: example input shape")
    ap.add_argument("--profile", action="store_true", help="module: time each op here")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--png", default=None, help="write a PNG of the stages")
    ap.set_defaults(func=run)
