"""Operator graphs: the input of every placement algorithm.

An :class:`OpGraph` is a DAG of operators. Each node carries its compute time on
an accelerator and on a CPU (``None`` when the op cannot run there), the bytes
it keeps resident on a device (``mem_bytes``: weights, and in training their
gradients and optimizer state), the bytes of its output activation
(``act_bytes``, stashed per in-flight micro-batch in training), the time to
ship its output over one link (``comm_time``) and the time per sample to
all-reduce its gradients between two replicas (``sync_time``). Each edge
carries the bytes it moves. Nodes sharing a ``color`` must share a device
(forward with backward, shared parameters).

Example:
    >>> from meshtorch.placement import OpGraph
    >>> g = OpGraph()
    >>> a = g.add_node("a", acc_time=1.0, cpu_time=5.0, mem_bytes=10)
    >>> b = g.add_node("b", acc_time=2.0, cpu_time=9.0, comm_time=0.5)
    >>> g.add_edge("a", "b", nbytes=4)
    >>> len(g), g.num_edges
    (2, 1)
    >>> OpGraph.from_json(g.to_json()).node("b").acc_time
    2.0
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshtorch.errors import PlacementError
from meshtorch.files import write_atomic

FORMAT = "meshtorch.opgraph/1"


@dataclass
class OpNode:
    """One operator. Times are seconds per sample (or any unit, used consistently)."""

    name: str
    acc_time: float | None = 0.0
    cpu_time: float | None = 0.0
    mem_bytes: float = 0.0
    act_bytes: float = 0.0
    weight_bytes: float = 0.0  # the weights alone (part of mem_bytes): 2BW keeps a second copy
    comm_time: float = 0.0
    sync_time: float = 0.0
    backward: bool = False
    color: str | None = None
    flops: float = 0.0
    op: str = ""
    label: str = ""


_PAPER_FIELDS = ('the paper\'s format: nodes with "id", "fpgaLatency" and "cpuLatency", '
                 'edges with "sourceId", "destId" and "cost"')
# how the paper's format spells what it has of ours (edge "bytes" are the edges' "size"; a node's
# comm_time is the "cost" of its outgoing edges), so that an error names a field as the user's file does
_PAPER_NAMES = {"acc_time": '"fpgaLatency"', "cpu_time": '"cpuLatency"', "mem_bytes": '"size"',
                "comm_time": 'outgoing "cost"', "bytes": '"size"', "devices": '"maxFPGAs"',
                "cpus": '"maxCPUs"', "memory": '"maxSizePerFPGA"',
                # how the file says an op cannot run there (the paper's cpuLatency is always a number)
                "acc_time unsupported": ', or "supportedOnFpga": 0 where the op cannot run on an accelerator',
                "cpu_time unsupported": ""}


@dataclass
class OpGraph:
    """A DAG of :class:`OpNode` with byte-weighted edges; ``meta`` holds file defaults.

    ``meta`` may hold ``devices``, ``cpus`` and ``memory`` (bytes per accelerator),
    used by :class:`~meshtorch.placement.Problem` when the caller gives none.
    """

    nodes: list[OpNode] = field(default_factory=list)
    edges: list[tuple[int, int, float]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    # the graph file's names of our fields where it spells them otherwise (the paper's format): the
    # errors of :meth:`validate` name a field as the user's file does
    spelling: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            if n.name in self._index:
                raise PlacementError(f"duplicate node name {n.name!r}")
            self._index[n.name] = i

    # -- construction -------------------------------------------------------------------
    def add_node(self, name: str, **attrs: Any) -> int:
        """Add a node and return its index; ``attrs`` are :class:`OpNode` fields."""
        if name in self._index:
            raise PlacementError(f"duplicate node name {name!r}")
        self._index[name] = len(self.nodes)
        self.nodes.append(OpNode(name=name, **attrs))
        return len(self.nodes) - 1

    def add_edge(self, src: str | int, dst: str | int, nbytes: float = 0.0) -> None:
        """Add the edge ``src -> dst`` (names or indices) moving ``nbytes``."""
        u, v = self.index(src), self.index(dst)
        if u == v:
            raise PlacementError(f"self-loop on node {self.nodes[u].name!r}")
        self.edges.append((u, v, float(nbytes)))

    # -- access --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    def index(self, key: str | int) -> int:
        """Index of a node given by name or index."""
        if isinstance(key, int):
            if not 0 <= key < len(self.nodes):
                raise PlacementError(f"no node with index {key}")
            return key
        try:
            return self._index[key]
        except KeyError:
            raise PlacementError(f"no node named {key!r}") from None

    def node(self, key: str | int) -> OpNode:
        return self.nodes[self.index(key)]

    def successors(self) -> list[list[int]]:
        """Adjacency lists (deduplicated, in insertion order)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        seen: set[tuple[int, int]] = set()
        for u, v, _ in self.edges:
            if (u, v) not in seen:
                seen.add((u, v))
                out[u].append(v)
        return out

    def predecessors(self) -> list[list[int]]:
        inn: list[list[int]] = [[] for _ in self.nodes]
        for u, succ in enumerate(self.successors()):
            for v in succ:
                inn[v].append(u)
        return inn

    @property
    def is_training(self) -> bool:
        """True when the graph has backward nodes."""
        return any(n.backward for n in self.nodes)

    def topological_order(self) -> list[int]:
        """Kahn's order; raises :class:`PlacementError` naming nodes on a cycle."""
        succ = self.successors()
        indeg = [0] * len(self.nodes)
        for s in succ:
            for v in s:
                indeg[v] += 1
        ready = [i for i, d in enumerate(indeg) if d == 0]
        order: list[int] = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v in succ[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != len(self.nodes):
            cycle = self._find_cycle(succ, {i for i, d in enumerate(indeg) if d > 0})
            names = " -> ".join(self.nodes[i].name for i in cycle)
            raise PlacementError(f"the operator graph has a cycle: {names}")
        return order

    @staticmethod
    def _find_cycle(succ: list[list[int]], left: set[int]) -> list[int]:
        # every node Kahn left behind still has a predecessor that was left behind too (else its
        # in-degree would have reached 0), so walking backwards inside `left` always meets a node
        # twice; walking forwards need not (a node downstream of a cycle has no successor in it)
        pred: dict[int, list[int]] = {u: [] for u in left}
        for u in left:
            for v in succ[u]:
                if v in left:
                    pred[v].append(u)
        pos: dict[int, int] = {}
        path: list[int] = []
        u = min(left)
        while u not in pos:
            pos[u] = len(path)
            path.append(u)
            u = pred[u][0]
        cycle = path[pos[u] :] + [u]
        return cycle[::-1]

    def validate(self) -> None:
        """Check acyclicity, finite non-negative costs and backward/forward colours."""
        if not self.nodes:
            raise PlacementError("the operator graph has no nodes: there is nothing to place")
        for key, want in (("devices", int), ("cpus", int), ("memory", (int, float))):
            x = self.meta.get(key)
            if x is not None and (not isinstance(x, want) or isinstance(x, bool) or x < 0):
                name = self.spelling.get(key, f"meta {key}")
                raise PlacementError(f"the graph's {name}={x!r} must be a number >= 0 "
                                     f"({'a whole number' if want is int else 'bytes'}), or absent")
        self.topological_order()
        for n in self.nodes:
            if not isinstance(n.name, str) or not isinstance(n.backward, bool) or not (
                    n.color is None or isinstance(n.color, str)):
                raise PlacementError(f"node {n.name!r}: name must be a string, backward true or false, "
                                     f"color a string or null; got name={n.name!r}, backward={n.backward!r}, "
                                     f"color={n.color!r}")
            for attr in ("mem_bytes", "act_bytes", "weight_bytes", "comm_time", "sync_time"):
                x = getattr(n, attr)
                if not _cost(x):
                    raise PlacementError(f"node {n.name!r}: {self.spelling.get(attr, attr)}={x!r} must be a "
                                         "finite number >= 0")
            for attr in ("acc_time", "cpu_time"):
                x = getattr(n, attr)
                if x is not None and not _cost(x):
                    unsupported = self.spelling.get(f"{attr} unsupported",
                                                    ", or None (null in JSON) where the op cannot run")
                    raise PlacementError(f"node {n.name!r}: {self.spelling.get(attr, attr)}={x!r} must be a "
                                         f"finite number >= 0{unsupported}")
            if n.acc_time is None and n.cpu_time is None:
                raise PlacementError(f"node {n.name!r} can run neither on an accelerator nor a CPU")
        for u, v, b in self.edges:
            if not _cost(b):
                raise PlacementError(f"edge {self.nodes[u].name!r} -> {self.nodes[v].name!r}: "
                                     f"{self.spelling.get('bytes', 'bytes')}={b} must be finite and >= 0")

    # -- summaries -----------------------------------------------------------------------
    def total(self, attr: str) -> float:
        return float(sum(getattr(n, attr) or 0.0 for n in self.nodes))

    def __repr__(self) -> str:
        kind = "training" if self.is_training else "inference"
        return f"OpGraph({len(self.nodes)} nodes, {len(self.edges)} edges, {kind})"

    # -- our JSON format -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "meta": self.meta,
            "nodes": [asdict(n) for n in self.nodes],
            "edges": [[self.nodes[u].name, self.nodes[v].name, b] for u, v, b in self.edges],
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise (and write to ``path`` when given, whole: a reader sees the old file or the new
        one, through :func:`meshtorch.files.write_atomic`); inverse of :meth:`from_json`."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            write_atomic(path, text.encode())
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpGraph:
        if d.get("format") != FORMAT:
            raise PlacementError(f"not a {FORMAT} graph (format={d.get('format')!r})")
        fields = set(OpNode.__dataclass_fields__)
        nodes = []
        for raw in d["nodes"]:
            unknown = set(raw) - fields
            if unknown:
                raise PlacementError(f"node {raw.get('name')!r}: unknown fields {sorted(unknown)}")
            nodes.append(OpNode(**raw))
        g = cls(nodes=nodes, meta=dict(d.get("meta", {})))
        for u, v, b in d["edges"]:
            g.add_edge(u, v, b)
        return g

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> OpGraph:
        """Load our format, or the paper's (detected by its ``maxFPGAs`` key)."""
        d = _read_json(text_or_path)
        paper = "maxFPGAs" in d or ("nodes" in d and "format" not in d)
        try:
            return cls.from_dnn_partitioning_dict(d) if paper else cls.from_dict(d)
        # AttributeError: a node that is no JSON object (a string has no .get)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            where = "graph" if str(text_or_path).lstrip().startswith("{") else str(text_or_path)
            expected = (_PAPER_FIELDS if paper else
                        f'{{"format": "{FORMAT}", "nodes": [{{"name": ...}}], "edges": [[src, dst, bytes]]}}')
            detail = str(e) if isinstance(e, PlacementError) else f"{type(e).__name__}: {e}"
            raise PlacementError(f"{where}: cannot read the graph ({detail}); "
                                 f"expected {expected}") from None

    # -- the paper's format (msr-fiddle/dnn-partitioning) ---------------------------------
    @classmethod
    def from_dnn_partitioning(cls, path: str | Path) -> OpGraph:
        """Load a graph in the format of Tarnawski et al. (NeurIPS 2020).

        Node names are the file's integer ids as strings (``label`` keeps the file's
        name), ``fpgaLatency`` becomes ``acc_time``, ``size`` becomes ``mem_bytes``,
        the per-source edge ``cost`` becomes the source's ``comm_time`` and
        ``colorClass`` the ``color``. The file has no activation sizes, so
        ``act_bytes`` is 0 and the paper's definition of load is reproduced exactly.
        """
        return cls.from_dnn_partitioning_dict(_read_json(path))

    @classmethod
    def from_dnn_partitioning_dict(cls, d: dict[str, Any]) -> OpGraph:
        g = cls(spelling=dict(_PAPER_NAMES))
        for i, raw in enumerate(d["nodes"]):
            supported = bool(raw.get("supportedOnFpga", True))
            cc = raw.get("colorClass")
            _require(raw, ("id", "cpuLatency", *(("fpgaLatency",) if supported else ())),
                     f'node "id" {raw["id"]!r}' if "id" in raw else f"node {i + 1} of \"nodes\"")
            if str(raw["id"]) in g._index:  # in the file's words: add_node's says "duplicate node name"
                raise PlacementError(f'two nodes have "id" {raw["id"]!r}: each node needs its own')
            g.add_node(
                str(raw["id"]),
                acc_time=float(raw["fpgaLatency"]) if supported else None,
                cpu_time=float(raw["cpuLatency"]),
                mem_bytes=float(raw.get("size", 0.0)),
                backward=bool(raw.get("isBackwardNode", False)),
                color=None if cc is None else str(cc),
                label=str(raw.get("name", "")),
            )
        cost: dict[int, float] = {}
        for i, e in enumerate(d["edges"]):
            _require(e, ("sourceId", "destId", "cost"), f'edge {i + 1} of "edges"')
            for end in ("sourceId", "destId"):  # in the file's words: index's says "no node named"
                if str(e[end]) not in g._index:
                    raise PlacementError(f'the edge "sourceId" {e["sourceId"]!r} -> "destId" '
                                         f'{e["destId"]!r}: no node has "id" {e[end]!r}; an edge joins '
                                         "two nodes' ids")
            u, v, c = g.index(str(e["sourceId"])), g.index(str(e["destId"])), float(e["cost"])
            if u in cost and abs(cost[u] - c) > 1e-6 * max(1.0, abs(c)):
                raise PlacementError(
                    f"node {g.nodes[u].name!r} has two different outgoing edge costs "
                    f"({cost[u]} and {c}); the paper's model needs one per source"
                )
            cost[u] = c
            g.add_edge(u, v, float(e.get("size", 0.0)))
        for u, c in cost.items():
            g.nodes[u].comm_time = c
        for key, ours in (("maxFPGAs", "devices"), ("maxCPUs", "cpus"), ("maxSizePerFPGA", "memory")):
            if key in d:
                g.meta[ours] = int(d[key]) if ours != "memory" else float(d[key])
        return g

    def to_dnn_partitioning_dict(self) -> dict[str, Any]:
        """Export in the paper's format (ids are node indices + 1)."""
        nodes = []
        for i, n in enumerate(self.nodes):
            nodes.append(
                {
                    "id": i + 1,
                    "name": n.label or n.name,
                    "supportedOnFpga": int(n.acc_time is not None),
                    "cpuLatency": n.cpu_time if n.cpu_time is not None else 1e30,
                    "fpgaLatency": n.acc_time or 0.0,
                    "isBackwardNode": int(n.backward),
                    "size": n.mem_bytes,
                    **({"colorClass": _color_id(n.color)} if n.color is not None else {}),
                }
            )
        edges = [
            {"sourceId": u + 1, "destId": v + 1, "cost": self.nodes[u].comm_time, "size": b}
            for u, v, b in self.edges
        ]
        return {
            "maxSizePerFPGA": float(self.meta.get("memory", 1e30)),
            "maxFPGAs": int(self.meta.get("devices", 1)),
            "maxCPUs": int(self.meta.get("cpus", 0)),
            "nodes": nodes,
            "edges": edges,
        }


def _require(entry: dict[str, Any], fields: tuple[str, ...], where: str) -> None:
    """Refuse an entry of a paper-format file that lacks one of ``fields``, naming the entry (a
    KeyError named the field only, not which of hundreds of nodes lacked it)."""
    missing = [f for f in fields if f not in entry]
    if missing:
        quoted = ", ".join(f'"{f}"' for f in missing)
        raise PlacementError(f"{where} has no {quoted}")


def _cost(x: Any) -> bool:
    """A time or a size: a real number, finite, not negative (NaN fails every comparison)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


_COLOR_IDS: dict[str, int] = {}


def _color_id(color: str) -> int:
    # the paper's format needs integer colour classes
    try:
        return int(color)
    except ValueError:
        return _COLOR_IDS.setdefault(color, 10**9 + len(_COLOR_IDS))


def _read_json(text_or_path: str | Path) -> dict[str, Any]:
    if isinstance(text_or_path, Path) or not str(text_or_path).lstrip().startswith("{"):
        path = Path(text_or_path)
        if not path.exists():
            raise PlacementError(f"no such graph file: {path}")
        text = path.read_text()
    else:
        text = str(text_or_path)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlacementError(f"not valid JSON: {e}") from None
    if not isinstance(d, dict):
        where = "the graph" if text is text_or_path else str(text_or_path)
        raise PlacementError(
            f"{where} holds a JSON {type(d).__name__}, not an object: a graph file is "
            f'{{"format": "{FORMAT}", "nodes": [...], "edges": [...]}} or {_PAPER_FIELDS}')
    return d


def load_split(path: str | Path, graph: OpGraph) -> list[tuple[str, list[int]]]:
    """Read a split in the paper's result format (e.g. a human-expert split).

    Returns ``[(kind, node_indices)]`` with kind ``"acc"`` or ``"cpu"``, in file
    order (CPUs first). Nodes missing from the split (backward nodes of a
    forward-only expert split) are added to the device of a node of the same colour.
    """
    d = _read_json(path)
    stages: list[tuple[str, list[int]]] = []
    where: dict[int, int] = {}
    for kind, key in (("cpu", "cpus"), ("acc", "fpgas")):
        for m in d.get(key, []):
            if not m["nodes"]:
                continue
            idx = [graph.index(str(x)) for x in m["nodes"]]
            for i in idx:
                where[i] = len(stages)
            stages.append((kind, idx))
    by_color: dict[str, set[int]] = {}
    for i, n in enumerate(graph.nodes):
        if i in where and n.color is not None:
            by_color.setdefault(n.color, set()).add(where[i])
    for i, n in enumerate(graph.nodes):
        if i not in where:
            homes = by_color.get(n.color, set()) if n.color is not None else set()
            if len(homes) != 1:
                raise PlacementError(f"split {path} does not place node {n.name!r}")
            s = next(iter(homes))
            stages[s][1].append(i)
    return stages
