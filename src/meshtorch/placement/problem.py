"""The placement problem, a placement, and the one reference cost model.

A placement is a pipeline: an ordered list of stages, each on one CPU or on
``replicas`` accelerators. The load of a stage is the time it spends per
sample; the pipeline's throughput is ``1 / max load``.

* accelerator stage ``S``: ``(compute(S) + comm(S)) / r + 2 (r-1)/r * sync(S)``,
  where ``comm(S)`` sums, once per producer, the ``comm_time`` of every node
  ``u`` whose output crosses the stage boundary in either direction (``u`` in
  ``S`` with a consumer outside, or ``u`` outside with a consumer in ``S``) —
  the paper's definition — and ``r`` is the data-parallel replica count.
  With ``relay`` (a pipeline that runs: :func:`~meshtorch.placement.trace.split`
  passes a value that skips stages through every stage in between), ``comm(S)``
  is instead every transfer ``S`` takes part in: the ``comm_time`` of each
  producer whose output crosses the border in front of ``S`` (received) plus
  each one crossing the border behind it (sent), so a relayed value costs a
  stage it passes through twice (in and out), and the stages form a chain.
* CPU stage: the CPUs' compute time only (host memory: no transfer, no bound).
* memory of an accelerator stage: ``sum(mem_bytes)``, plus ``sum(weight_bytes)``
  under 2BW (its second weight version), plus, in training with ``stash``, the
  activations of the micro-batches in flight (:func:`in_flight`): ``f ·
  sum(act_bytes)``, or with ``recompute`` (only stage inputs are stashed, the
  forward re-runs at backward time) ``f · inputs + sum(act_bytes)``, ``inputs``
  being the activation bytes crossing the border in front of the stage (and
  the graph's inputs that the stage holds).

A placement is *contiguous* when every forward edge goes to the same or a
later stage (see :func:`order_constraints`): the stages then form a pipeline
in which activations only flow one way, and gradients the other.

Example:
    >>> from meshtorch.placement import OpGraph, Problem, evaluate
    >>> g = OpGraph()
    >>> for name, t in [("a", 2.0), ("b", 3.0), ("c", 1.0)]:
    ...     _ = g.add_node(name, acc_time=t, cpu_time=10 * t, comm_time=0.5)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c")
    >>> p = evaluate(g, Problem(devices=2), [("acc", [0, 1]), ("acc", [2])])
    >>> p.max_load, [s.load for s in p.stages]
    (5.5, [5.5, 1.5])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph

ACC, CPU = "acc", "cpu"
OBJECTIVES = ("throughput", "latency")
SCHEDULES = ("gpipe", "1f1b", "2bw", "interleaved")


#: The most devices a placement plans for once capped at what the graph can use: the DP's
#: tables grow with the square of the device count (4096 devices take ~20 s and ~2 GB).
MAX_DEVICES = 4096


@dataclass(frozen=True)
class Problem:
    """What to place on: ``devices`` accelerators of ``memory`` bytes and ``cpus`` CPUs.

    ``None`` fields take the graph's defaults (``graph.meta``) in :meth:`resolve`,
    else 1 device, 0 CPUs, unlimited memory. ``training=None`` means "the graph
    has backward nodes". ``max_replicas > 1`` lets the DP replicate a stage
    data-parallel (training only).

    ``objective`` is ``"throughput"`` (minimise the max load of a pipeline) or
    ``"latency"`` (minimise one sample's end-to-end time, the paper's second
    problem, with up to ``subgraphs`` subgraphs per accelerator; see
    :mod:`meshtorch.placement.latency`).

    ``relay`` prices the transfers of the pipeline that runs (values that skip
    stages are relayed through the stages in between, which pay for them);
    ``None`` takes ``graph.meta["relay"]``: on for graphs traced from modules,
    off (the paper's definition) for the paper's JSON files.

    ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"2bw"``, ``"interleaved"``),
    ``microbatches`` (per batch; ``None``: as many as stages, at least) and
    ``recompute`` say what a training stage holds in memory (see the module
    docstring and :func:`in_flight`), as :class:`~meshtorch.pipeline.Pipeline`
    runs it.

    ``virtual_stages`` ``v`` (with ``schedule="interleaved"``): the graph is cut
    into exactly ``devices · v`` contiguous chunks, chunk ``c`` on device
    ``c mod devices`` (:mod:`~meshtorch.placement.interleave`); a placement's
    stages are then the chunks in model order, and each device's memory is the
    sum over its chunks.

    Example:
        >>> Problem(devices=4, memory=16 * 2**30).devices
        4
    """

    devices: int | None = None
    memory: float | None = None
    cpus: int | None = None
    training: bool | None = None
    stash: bool = True
    max_replicas: int = 1
    objective: str = "throughput"
    subgraphs: int = 1
    relay: bool | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    recompute: bool = False
    virtual_stages: int = 1

    @property
    def slots(self) -> int:
        """Pipeline stages a placement has at most: ``devices · virtual_stages`` chunks
        (exactly that many when interleaved), else ``devices`` accelerators (resolved)."""
        return (self.devices or 0) * self.virtual_stages

    @property
    def interleaved(self) -> bool:
        return self.schedule == "interleaved"

    def resolve(self, graph: OpGraph) -> Problem:
        """Fill the ``None`` fields from ``graph.meta`` and check the values."""
        devices = self.devices if self.devices is not None else int(graph.meta.get("devices", 1))
        cpus = self.cpus if self.cpus is not None else int(graph.meta.get("cpus", 0))
        memory = self.memory if self.memory is not None else graph.meta.get("memory")
        memory = math.inf if memory is None else float(memory)
        training = graph.is_training if self.training is None else bool(self.training)
        for name, n in (("devices", devices), ("cpus", cpus)):
            if n < 0:  # named alone: "need at least one device (devices=6, cpus=-1)" blamed the total
                raise PlacementError(f"{name}={n} (--{name}) must be >= 0: how many there are to place on")
        if devices + cpus == 0:
            raise PlacementError(f"need at least one device (devices={devices}, cpus={cpus})")
        if not memory > 0:
            raise PlacementError(f"memory bound must be positive, got {memory}")
        if self.max_replicas < 1:
            raise PlacementError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if self.max_replicas > 1 and not training:
            raise PlacementError("data-parallel replication of a stage needs training mode")
        if self.objective not in OBJECTIVES:
            raise PlacementError(
                f"unknown objective {self.objective!r}; choose from {list(OBJECTIVES)}"
            )
        if self.schedule not in SCHEDULES:
            raise PlacementError(f"unknown schedule {self.schedule!r}; choose from {list(SCHEDULES)}")
        if self.microbatches is not None and self.microbatches < 1:
            raise PlacementError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.schedule == "gpipe" and self.microbatches is None and training and self.stash:
            raise PlacementError("GPipe stashes all micro-batches of a batch: give microbatches= "
                                 "(--microbatches)")
        if self.virtual_stages < 1:
            raise PlacementError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise PlacementError(f"{self.virtual_stages} virtual stages (chunks per device) need the "
                                 f"interleaved schedule, not {self.schedule!r}: pass schedule='interleaved' "
                                 "(--schedule interleaved)")
        if self.interleaved:
            self._check_interleaved(graph, devices, cpus)
            cpus = 0  # a graph file's CPUs: chunks run round-robin on the accelerators only
        if self.subgraphs < 1:
            raise PlacementError(f"subgraphs per accelerator must be >= 1, got {self.subgraphs}")
        if self.objective == "latency" and training:
            raise PlacementError(
                "the latency objective is for inference (one sample's forward pass), but the "
                "graph has backward nodes: drop --training or use --objective throughput"
            )
        # every stage holds at least one node (and at most max_replicas copies of it), so devices
        # past that can never be used: capping them keeps `--devices 1000000000` from sizing the
        # algorithms' tables by the request instead of by the graph
        usable = max(len(graph.nodes), 1) * max(1, min(self.max_replicas, devices))
        if self.interleaved:  # devices are the round-robin's p: never capped (checked above)
            usable = devices
        devices, cpus = min(devices, usable), min(cpus, max(len(graph.nodes), 1))
        if devices > MAX_DEVICES:
            raise PlacementError(
                f"{devices} usable devices ({len(graph.nodes)} nodes x up to {self.max_replicas} replicas "
                f"each) is more than the {MAX_DEVICES} a placement plans for: the algorithms' tables "
                "grow with the device count; pass fewer --devices or --replicas")
        relay = bool(graph.meta.get("relay", False)) if self.relay is None else bool(self.relay)
        return replace(
            self, devices=devices, cpus=cpus, memory=memory, training=training, relay=relay,
            max_replicas=min(self.max_replicas, max(devices, 1)),
        )


    def _check_interleaved(self, graph: OpGraph, devices: int, cpus: int) -> None:
        """What the interleaved schedule needs: micro-batches in rounds of ``devices``, one
        accelerator per chunk, and at least ``devices · v`` nodes to cut into chunks."""
        v = self.virtual_stages
        if self.cpus:
            raise PlacementError(f"the interleaved schedule runs its chunks on accelerators only; drop "
                                 f"cpus={self.cpus} (--cpus)")
        if devices < 1:
            raise PlacementError("the interleaved schedule needs at least one accelerator (--devices)")
        if self.max_replicas > 1 or self.objective != "throughput":
            raise PlacementError("the interleaved schedule places chunks for throughput, one device each: "
                                 "drop max_replicas (--replicas) and the latency objective")
        if self.microbatches is None or self.microbatches % devices:
            raise PlacementError(f"interleaved 1F1B sends micro-batches through the chunks in rounds of "
                                 f"{devices} (the devices): give microbatches= (--microbatches) a multiple "
                                 f"of {devices}, got {self.microbatches}")
        if devices * v > MAX_DEVICES:
            raise PlacementError(f"{devices} devices x {v} virtual stages = {devices * v} chunks is more "
                                 f"than the {MAX_DEVICES} a placement plans for: fewer --devices or "
                                 "--virtual-stages")
        if devices * v > len(graph.nodes):
            raise PlacementError(f"{devices} devices x {v} virtual stages = {devices * v} chunks, but the "
                                 f"graph has only {len(graph.nodes)} nodes: fewer --devices or "
                                 "--virtual-stages")


@dataclass
class Stage:
    """One pipeline stage and its cost breakdown (filled by :func:`evaluate`)."""

    kind: str
    nodes: list[int]
    replicas: int = 1
    compute: float = 0.0
    comm: float = 0.0
    sync: float = 0.0
    memory: float = 0.0
    load: float = 0.0
    in_flight: int = 1
    device: int | None = None  # latency: the accelerator holding this subgraph
    start: float = 0.0  # latency: when the subgraph starts / finishes
    finish: float = 0.0

    @property
    def devices(self) -> int:
        return self.replicas if self.kind == ACC else 1


@dataclass
class Placement:
    """A pipeline placement: stages in order, their loads, and how it was found."""

    graph: OpGraph
    problem: Problem
    stages: list[Stage]
    algorithm: str = ""
    solve_seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    latency: float | None = None  # one sample's end-to-end time (latency placements)

    @property
    def objective(self) -> str:
        """``"throughput"`` or ``"latency"``: what :attr:`value` measures."""
        return "latency" if self.latency is not None else "throughput"

    @property
    def value(self) -> float:
        """The objective's value: :attr:`latency`, else :attr:`max_load` (lower is better)."""
        return self.latency if self.latency is not None else self.max_load

    @property
    def max_load(self) -> float:
        return max((s.load for s in self.stages), default=0.0)

    @property
    def bottleneck(self) -> int:
        """Index of the stage with the largest load."""
        return max(range(len(self.stages)), key=lambda i: self.stages[i].load)

    @property
    def throughput(self) -> float:
        """Samples per time unit: 1 / max load."""
        return 1.0 / self.max_load if self.max_load > 0 else math.inf

    def device_of(self) -> list[int]:
        """Stage index of every node."""
        where = [-1] * len(self.graph)
        for s, st in enumerate(self.stages):
            for v in st.nodes:
                where[v] = s
        return where

    def is_contiguous(self) -> bool:
        return is_contiguous(self.graph, self.device_of())

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: objective, value, max_load, solve_seconds, algorithm, stages."""
        names = [n.name for n in self.graph.nodes]
        return {
            "algorithm": self.algorithm,
            "objective": self.objective,
            "value": self.value,
            "max_load": self.max_load,
            "throughput": self.throughput,
            "solve_seconds": self.solve_seconds,
            "bottleneck": self.bottleneck if self.stages else None,
            "contiguous": self.is_contiguous(),
            "violations": self.violations,
            "info": self.info,
            "stages": [
                {
                    "device": st.kind,
                    "replicas": st.replicas,
                    "nodes": [names[v] for v in sorted(st.nodes)],
                    "compute": st.compute,
                    "comm": st.comm,
                    "sync": st.sync,
                    "memory": st.memory,
                    "in_flight": st.in_flight,
                    "load": st.load,
                    **({"accelerator": st.device, "start": st.start, "finish": st.finish}
                       if self.latency is not None else {}),
                }
                for st in self.stages
            ],
        }


def order_constraints(graph: OpGraph) -> list[tuple[int, int]]:
    """Pairs ``(u, v)`` of nodes whose stages must satisfy ``stage(u) <= stage(v)``.

    Every forward edge; and, as in the paper, every edge between backward nodes
    that touches an *orphan* backward node (one whose colour has no forward node,
    so nothing else ties it to the pipeline) taken in reverse, since gradients
    flow from later stages to earlier ones.
    """
    nodes = graph.nodes
    fwd_colours = {nd.color for nd in nodes if not nd.backward and nd.color is not None}
    orphan = [nd.backward and (nd.color is None or nd.color not in fwd_colours) for nd in nodes]
    out = []
    for u, v, _ in graph.edges:
        bu, bv = nodes[u].backward, nodes[v].backward
        if not bu and not bv:
            out.append((u, v))
        elif bu and bv and (orphan[u] or orphan[v]):
            out.append((v, u))
    return out


def is_contiguous(graph: OpGraph, where: Sequence[int]) -> bool:
    """Whether stage indices ``where`` respect :func:`order_constraints` (a one-way pipeline)."""
    return all(where[u] <= where[v] for u, v in order_constraints(graph))


def comm_of(graph: OpGraph, members: set[int] | Sequence[bool], succ: list[list[int]]) -> float:
    """Communication time of the node set ``members`` under the paper's definition."""
    inside = members if not isinstance(members, set) else None
    has = (lambda x: inside[x]) if inside is not None else (lambda x: x in members)
    total = 0.0
    for u, outs in enumerate(succ):
        if not outs:
            continue
        hu = has(u)
        if any(has(v) != hu for v in outs):
            total += graph.nodes[u].comm_time
    return total


def in_flight(prob: Problem, devices_after: int, replicas: int = 1) -> int:
    """Micro-batches whose activations an accelerator stage holds at its peak.

    ``devices_after`` counts the devices from the stage to the end of the
    pipeline (itself included); a stage on ``replicas`` devices gives each one
    every ``replicas``-th micro-batch. GPipe: all ``m`` of a batch; 1F1B:
    ``min(d, m)``; 2BW: ``d`` (no flush: the next batch enters while this one
    drains, so ``m`` does not cap it).

    Interleaved: a stage is a chunk, ``devices_after`` counts the chunks from it
    to the last, and the count is the chunk's own peak of stashed micro-batches
    in the interleaved table (:func:`chunk_in_flight`).

    Example:
        >>> [in_flight(Problem(schedule=s, microbatches=8), 3) for s in ("gpipe", "1f1b", "2bw")]
        [8, 3, 3]
        >>> prob = Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=4)
        >>> [in_flight(prob, after) for after in (4, 3, 2, 1)]
        [4, 3, 2, 1]
    """
    m = prob.microbatches
    if prob.interleaved:
        counts = chunk_in_flight(prob.devices, prob.virtual_stages, m)
        return counts[prob.slots - devices_after]
    if prob.schedule == "gpipe":
        count = m if m is not None else devices_after
    elif prob.schedule == "1f1b" and m is not None:
        count = min(devices_after, m)
    else:
        count = devices_after
    return -(-count // replicas)


@functools.lru_cache(maxsize=64)
def chunk_in_flight(devices: int, virtual_stages: int, microbatches: int) -> tuple[int, ...]:
    """Most micro-batches whose activations each model chunk stashes at once under interleaved
    1F1B (chunk ``c`` on device ``c mod devices``), read off the executor's own table.

    A device's peak is at most the sum over its chunks (the chunks need not peak together),
    so the placer's memory, which adds them, never underestimates.

    Example:
        >>> chunk_in_flight(2, 2, 4)
        (4, 3, 2, 1)
    """
    from meshtorch.pipeline.schedule import BACKWARD, FORWARD
    from meshtorch.pipeline.schedule import build as build_schedule

    p, v = devices, virtual_stages
    table = build_schedule("interleaved", p, microbatches, virtual_stages=v)
    peak = [0] * (p * v)
    for s in range(p):
        live = [0] * v
        for a in table.for_stage(s):
            live[a.chunk] += 1 if a.kind == FORWARD else -1 if a.kind == BACKWARD else 0
            c = a.chunk * p + s
            peak[c] = max(peak[c], live[a.chunk])
    return tuple(peak)


def stage_inputs(graph: OpGraph, where: Sequence[int], stages: int) -> list[float]:
    """Activation bytes each stage receives (forward values crossing the border in front of
    it, relayed ones included) plus those of the graph inputs it holds: what it stashes
    per micro-batch under ``recompute``."""
    out = [0.0] * stages
    succ: list[list[int]] = [[] for _ in graph.nodes]
    has_pred = [False] * len(graph)
    for u, v, _ in graph.edges:
        if not graph.nodes[u].backward and not graph.nodes[v].backward:
            succ[u].append(v)
            has_pred[v] = True
    for u, nd in enumerate(graph.nodes):
        if nd.backward or not nd.act_bytes or where[u] < 0:
            continue
        if not has_pred[u]:
            out[where[u]] += nd.act_bytes
        span = [where[u], *(where[v] for v in succ[u] if where[v] >= 0)]
        for s in range(min(span) + 1, max(span) + 1):
            out[s] += nd.act_bytes
    return out


def relay_comm(graph: OpGraph, where: Sequence[int], succ: list[list[int]], stages: int) -> list[float]:
    """Communication time of every stage when skipped stages relay values (``Problem.relay``).

    A producer whose output (with its consumers) spans stages ``lo..hi`` crosses
    the borders between them: each stage pays it once per border crossed in front
    of it (received) and once per border behind it (sent).
    """
    out = [0.0] * stages
    for u, outs in enumerate(succ):
        c = graph.nodes[u].comm_time
        if not outs or c == 0 or where[u] < 0:
            continue
        span = [where[u], *(where[v] for v in outs if where[v] >= 0)]
        lo, hi = min(span), max(span)
        for s in range(lo, hi + 1):
            out[s] += c * ((s > lo) + (s < hi))
    return out


def evaluate(
    graph: OpGraph,
    problem: Problem,
    stages: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], int] | Stage],
    *,
    strict: bool = True,
    algorithm: str = "",
    solve_seconds: float = 0.0,
) -> Placement:
    """Compute every stage's load and memory from the definition, and check feasibility.

    ``stages`` are ``(kind, node_indices[, replicas])`` in pipeline order. With
    ``strict`` a violated constraint (a node placed twice or not at all, split
    colours, unsupported op, memory, device counts) raises
    :class:`PlacementError`; otherwise it is listed in ``Placement.violations``.
    """
    prob = problem.resolve(graph)
    n = len(graph)
    norm: list[Stage] = []
    for st in stages:
        if isinstance(st, Stage):
            norm.append(Stage(st.kind, list(st.nodes), st.replicas))
        else:
            kind, nodes = st[0], list(st[1])
            norm.append(Stage(kind, nodes, int(st[2]) if len(st) > 2 else 1))
    violations: list[str] = []
    where = [-1] * n
    for s, st in enumerate(norm):
        if st.kind not in (ACC, CPU):
            raise PlacementError(f"stage {s}: kind must be 'acc' or 'cpu', got {st.kind!r}")
        for v in st.nodes:
            if where[v] != -1:
                violations.append(f"node {graph.nodes[v].name!r} is placed twice")
            where[v] = s
    missing = [graph.nodes[v].name for v in range(n) if where[v] == -1]
    if missing:
        violations.append(f"nodes not placed: {missing[:10]}")
    n_acc = sum(st.devices for st in norm if st.kind == ACC)
    n_cpu = sum(1 for st in norm if st.kind == CPU)
    if prob.interleaved:
        if n_acc != prob.slots or len(norm) != prob.slots:
            violations.append(f"the interleaved schedule needs exactly {prob.slots} chunks on accelerators "
                              f"({prob.devices} devices x {prob.virtual_stages}), got {len(norm)} stages")
    elif n_acc > prob.devices:
        violations.append(f"uses {n_acc} accelerators, only {prob.devices} available")
    if n_cpu > prob.cpus:
        violations.append(f"uses {n_cpu} CPUs, only {prob.cpus} available")
    colour_home: dict[str, int] = {}
    for v, nd in enumerate(graph.nodes):
        if nd.color is not None and where[v] != -1:
            h = colour_home.setdefault(nd.color, where[v])
            if h != where[v]:
                violations.append(f"colocated nodes of colour {nd.color!r} are split")
    succ = graph.successors()
    relayed = relay_comm(graph, where, succ, len(norm)) if prob.relay else None
    stashed = stage_inputs(graph, where, len(norm)) if prob.recompute else None
    devices_after = 0
    for s_index, st in zip(reversed(range(len(norm))), reversed(norm)):
        devices_after += st.devices
        members = [False] * n
        for v in st.nodes:
            members[v] = True
        nodes = [graph.nodes[v] for v in st.nodes]
        if st.kind == CPU:
            if st.replicas != 1:
                violations.append("a CPU stage cannot be replicated")
            bad = [x.name for x in nodes if x.cpu_time is None]
            if bad:
                violations.append(f"nodes {bad[:10]} cannot run on a CPU")
            st.compute = sum(x.cpu_time or 0.0 for x in nodes)
            st.load = st.compute
            st.in_flight = devices_after
            continue
        bad = [x.name for x in nodes if x.acc_time is None]
        if bad:
            violations.append(f"nodes {bad[:10]} cannot run on an accelerator")
        r = st.replicas
        if r > 1 and not prob.training:
            violations.append("replicated stages need training mode")
        st.compute = sum(x.acc_time or 0.0 for x in nodes)
        st.comm = relayed[s_index] if relayed is not None else comm_of(graph, members, succ)
        st.sync = 2.0 * (r - 1) / r * sum(x.sync_time for x in nodes) if r > 1 else 0.0
        st.load = (st.compute + st.comm) / r + st.sync
        st.in_flight = in_flight(prob, devices_after, r)
        st.memory = sum(x.mem_bytes for x in nodes)
        if prob.schedule == "2bw":
            st.memory += sum(x.weight_bytes for x in nodes)
        if prob.training and prob.stash:
            act = sum(x.act_bytes for x in nodes if not x.backward)
            if stashed is not None:
                st.memory += st.in_flight * stashed[s_index] + act
            else:
                st.memory += st.in_flight * act
        if not prob.interleaved and st.memory > prob.memory * (1 + 1e-9):
            violations.append(
                f"stage with {len(nodes)} nodes needs {st.memory:.4g} bytes, "
                f"bound is {prob.memory:.4g}"
            )
    info: dict[str, Any] = {}
    if prob.interleaved:  # a device holds its chunks c, c + p, c + 2p, ...
        p = max(prob.devices, 1)
        device_memory = [sum(st.memory for st in norm[d::p]) for d in range(p)]
        for d, used in enumerate(device_memory):
            if used > prob.memory * (1 + 1e-9):
                violations.append(f"device {d} (chunks {d}, {d} + {p}, ...) needs {used:.4g} bytes, "
                                  f"bound is {prob.memory:.4g}")
        info["device_memory"] = device_memory
    if strict and violations:
        raise PlacementError("infeasible placement: " + "; ".join(violations))
    return Placement(graph, prob, norm, algorithm, solve_seconds, violations, info)
