"""Preprocessing for the exact algorithms: contract the graph into supernodes.

Three exact reductions (none can change the optimum of the contiguous problem):

1. colocation: all nodes of a colour form one supernode (forward with backward);
2. pipeline cycles: supernodes on a cycle of the stage-order constraints
   (:func:`~meshtorch.placement.problem.order_constraints`) must share a stage, so
   strongly connected components are fused;
3. trivial nodes: a supernode with no cost at all (time, memory, activations) that
   touches a single other supernode is merged into it — moving it there never
   increases any load — and a costless node in the middle of a two-node chain
   ``u -> s -> v`` joins the side whose cut is cheaper;
4. free nodes: a costless supernode that no communication cost involves is taken
   out of the DAG (its order constraints are kept transitively) and put back after
   solving, in the latest stage of its predecessors.

One more reduction is exact only when memory does not bind, and is optional
(``pendant=True``): a node with no compute time that touches a single other
supernode (a stored state, a sink of zero-cost outputs) joins that supernode.
When memory can bind, the DP certifies such a solution by also solving the
relaxation in which those nodes' memory is dropped (then every merge is exact):
equal values prove it optimal; otherwise it solves the uncontracted problem.

The result is a DAG on supernodes (``preds`` as bitmasks) plus the paper's
communication hyperedges: for each producer ``u``, the set of supernodes holding
``u`` or one of its consumers; ``u`` pays ``comm_time`` on every accelerator stage
that this set straddles.

Example:
    >>> from meshtorch.placement import OpGraph
    >>> from meshtorch.placement.prep import contract
    >>> g = OpGraph()
    >>> for n in "abc":
    ...     _ = g.add_node(n, acc_time=1.0, cpu_time=1.0)
    >>> _ = g.add_node("w")  # a costless weight feeding b
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("w", "b")
    >>> contract(g).m
    3
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import networkx as nx

from meshtorch.errors import PlacementError
from meshtorch.placement.graph import OpGraph
from meshtorch.placement.problem import order_constraints

INF = math.inf


def set_bits(mask: int) -> Iterator[int]:
    """The indices of the bits set in ``mask``, lowest first.

    Example:
        >>> list(set_bits(0b10110))
        [1, 2, 4]
    """
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class UnionFind:
    """Disjoint sets over ``0..n-1``; the root of a set is its smallest member.

    Example:
        >>> uf = UnionFind(3)
        >>> uf.union(2, 1)
        >>> [uf.find(i) for i in range(3)]
        [0, 1, 1]
    """

    def __init__(self, n: int) -> None:
        self.p = list(range(n))

    def find(self, a: int) -> int:
        while self.p[a] != a:
            self.p[a] = self.p[self.p[a]]
            a = self.p[a]
        return a

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.p[max(a, b)] = min(a, b)


def colocated(graph: OpGraph) -> UnionFind:
    """The nodes of ``graph`` joined by colour: nodes of one colour must share a stage."""
    uf = UnionFind(len(graph))
    first_of_colour: dict[str, int] = {}
    for i, nd in enumerate(graph.nodes):
        if nd.color is not None:
            uf.union(i, first_of_colour.setdefault(nd.color, i))
    return uf


@dataclass
class Contracted:
    """Supernode DAG in topological order (supernode ``i`` only has preds ``< i``)."""

    graph: OpGraph
    members: list[list[int]]  # original nodes of each supernode
    preds: list[int]  # bitmask of predecessor supernodes
    acc: list[float]  # inf when some member cannot run on an accelerator
    cpu: list[float]  # inf when some member cannot run on a CPU
    mem: list[float]
    act: list[float]  # forward activation bytes (stashed in training)
    sync: list[float]
    hyper: list[tuple[int, float]]  # (bitmask of supernodes, comm time)
    of_node: list[int]  # supernode of every original node (-1 for free nodes)
    free: list[list[int]]  # groups of free original nodes, in a topological order
    pendant_mem: float = 0.0  # memory moved by pendant merges (0: the contraction is exact)
    pendant_nodes: list[int] = field(default_factory=list)  # original nodes merged as pendants
    # (bitmask, bytes): forward values a stage stashes when they cross its front border (recompute)
    inputs_hyper: list[tuple[int, float]] = field(default_factory=list)

    @property
    def m(self) -> int:
        return len(self.members)


def _check_edges(graph: OpGraph) -> None:
    for u, v, _ in graph.edges:
        if graph.nodes[u].backward and not graph.nodes[v].backward:
            raise PlacementError(
                f"edge from backward node {graph.nodes[u].name!r} to forward node "
                f"{graph.nodes[v].name!r}: the forward pass cannot wait for the backward pass"
            )


def _order_edges(cons: list[tuple[int, int]], group: list[int]) -> set[tuple[int, int]]:
    """Stage-order constraints between groups: (a, b) means stage(a) <= stage(b)."""
    return {(group[u], group[v]) for u, v in cons if group[u] != group[v]}


def contract(graph: OpGraph, *, trivial: bool = True, pendant: bool = False,
             inputs: list[float] | None = None) -> Contracted:
    """Contract ``graph`` into the supernode DAG used by the DP and the chain solver.

    ``inputs`` (recompute): bytes per node of the forward value a stage stashes
    when it crosses its front border; they become ``inputs_hyper``, and the
    nodes they involve are never taken out or moved by cheaper-cut merges.
    """
    graph.validate()
    _check_edges(graph)
    n = len(graph)
    cons = order_constraints(graph)
    uf = colocated(graph)

    # fuse strongly connected components of the stage-order constraints
    group = [uf.find(i) for i in range(n)]
    dg = nx.DiGraph()
    dg.add_nodes_from(set(group))
    dg.add_edges_from(_order_edges(cons, group))
    for comp in nx.strongly_connected_components(dg):
        if len(comp) > 1:
            first = min(comp)
            for c in comp:
                uf.union(first, c)

    pendant_mem, pendant_nodes = 0.0, []
    if trivial:
        pendant_mem, pendant_nodes = _merge_trivial(graph, uf, pendant, chain_links=inputs is None)

    group = [uf.find(i) for i in range(n)]
    roots = sorted(set(group))
    # communication hyperedges, on groups for now
    hyper_cost: dict[frozenset[int], float] = {}
    for u, outs in enumerate(graph.successors()):
        c = graph.nodes[u].comm_time
        if not outs or c == 0:
            continue
        key = frozenset([group[u], *(group[v] for v in outs)])
        if len(key) > 1:  # at least two supernodes, so it can be cut
            hyper_cost[key] = hyper_cost.get(key, 0.0) + c
    inputs_cost: dict[frozenset[int], float] = {}
    for u, outs in enumerate(graph.successors()) if inputs is not None else ():
        if not inputs[u] or graph.nodes[u].backward:
            continue
        key = frozenset([group[u], *(group[v] for v in outs if not graph.nodes[v].backward)])
        if len(key) > 1:
            inputs_cost[key] = inputs_cost.get(key, 0.0) + inputs[u]
    in_hyper = set().union(*hyper_cost, *inputs_cost) if hyper_cost or inputs_cost else set()

    # free groups leave the DAG; their order constraints are kept transitively
    dg = nx.DiGraph()
    dg.add_nodes_from(roots)
    dg.add_edges_from(_order_edges(cons, group))
    members_of: dict[int, list[int]] = {r: [] for r in roots}
    for i in range(n):
        members_of[group[i]].append(i)
    free_groups = [r for r in roots if r not in in_hyper and _costless(graph, members_of[r])]
    if len(free_groups) == len(roots):
        free_groups = free_groups[1:]  # keep one group so that there is something to place
    for r in free_groups:
        preds, succs = list(dg.predecessors(r)), list(dg.successors(r))
        dg.remove_node(r)
        dg.add_edges_from((p, q) for p in preds for q in succs)
    topo_all = {r: k for k, r in enumerate(nx.lexicographical_topological_sort(
        _group_dag(cons, group, roots)))}
    free = [members_of[r] for r in sorted(free_groups, key=topo_all.__getitem__)]

    order = list(nx.lexicographical_topological_sort(dg))
    num = {r: k for k, r in enumerate(order)}
    m = len(order)
    of_node = [num.get(group[i], -1) for i in range(n)]
    members: list[list[int]] = [members_of[r] for r in order]
    preds_mask = [0] * m
    for a, b in dg.edges:
        preds_mask[num[b]] |= 1 << num[a]
    acc = [0.0] * m
    cpu = [0.0] * m
    mem = [0.0] * m
    act = [0.0] * m
    sync = [0.0] * m
    for i, nd in enumerate(graph.nodes):
        s = of_node[i]
        if s < 0:
            continue
        acc[s] += INF if nd.acc_time is None else nd.acc_time
        cpu[s] += INF if nd.cpu_time is None else nd.cpu_time
        mem[s] += nd.mem_bytes
        if not nd.backward:
            act[s] += nd.act_bytes
        sync[s] += nd.sync_time
    hyper = sorted(
        (sum(1 << num[r] for r in key), c) for key, c in hyper_cost.items()
    )
    inputs_hyper = sorted(
        (sum(1 << num[r] for r in key), c) for key, c in inputs_cost.items()
    )
    return Contracted(
        graph, members, preds_mask, acc, cpu, mem, act, sync, hyper, of_node, free, pendant_mem,
        pendant_nodes, inputs_hyper,
    )


def _group_dag(cons: list[tuple[int, int]], group: list[int], roots: list[int]) -> nx.DiGraph:
    dg = nx.DiGraph()
    dg.add_nodes_from(roots)
    dg.add_edges_from(_order_edges(cons, group))
    return dg


def _costless(graph: OpGraph, members: list[int]) -> bool:
    return all(_free_node(graph.nodes[i]) for i in members)


def _free_node(nd) -> bool:
    return (
        nd.acc_time == 0 and nd.cpu_time == 0 and nd.mem_bytes == 0 and nd.act_bytes == 0
        and nd.sync_time == 0
    )


def place_free(c: Contracted, where: list[int]) -> None:
    """Give every free group the latest stage among its constraint predecessors (else 0)."""
    cons_pred: dict[int, list[int]] = {}
    for u, v in order_constraints(c.graph):
        cons_pred.setdefault(v, []).append(u)
    for grp in c.free:
        inside = set(grp)
        s = max(
            (where[p] for i in grp for p in cons_pred.get(i, []) if p not in inside),
            default=0,
        )
        for i in grp:
            where[i] = s


def _merge_trivial(graph: OpGraph, uf: UnionFind, pendant: bool,
                   chain_links: bool = True) -> tuple[float, list[int]]:
    """Merge costless supernodes into a neighbour (see the module docstring).

    Returns the memory moved by pendant merges (0 when every merge was exact) and
    the original nodes so moved.
    """
    n = len(graph)
    cost_free: dict[int, bool] = {}
    timeless: dict[int, bool] = {}
    gmem: dict[int, float] = {}
    for i, nd in enumerate(graph.nodes):
        r = uf.find(i)
        cost_free[r] = cost_free.get(r, True) and _free_node(nd)
        timeless[r] = timeless.get(r, True) and (
            nd.acc_time == 0 and nd.cpu_time == 0 and nd.sync_time == 0
        )
        gmem[r] = gmem.get(r, 0.0) + nd.mem_bytes + nd.act_bytes

    def join(g: int, target: int) -> None:
        """Merge group ``g`` into ``target``; the union is costless/timeless if both were."""
        free_t, tl_t, mem_t = cost_free[target], timeless[target], gmem[target]
        uf.union(g, target)
        r = uf.find(g)
        cost_free[r] = free_t and cost_free[g]
        timeless[r] = tl_t and timeless[g]
        gmem[r] = mem_t + gmem[g]

    moved = 0.0
    moved_nodes: list[int] = []
    changed = True
    while changed:
        changed = False
        group = [uf.find(i) for i in range(n)]
        nbrs: dict[int, set[int]] = {g: set() for g in set(group)}
        succ_groups: dict[int, set[int]] = {g: set() for g in set(group)}
        pred_groups: dict[int, set[int]] = {g: set() for g in set(group)}
        # comm_time of the producers in a group whose consumers lie elsewhere
        for u, v, _ in graph.edges:
            a, b = group[u], group[v]
            if a != b:
                nbrs[a].add(b)
                nbrs[b].add(a)
                succ_groups[a].add(b)
                pred_groups[b].add(a)
        for g in sorted(nbrs):
            if uf.find(g) != g:
                continue
            if len(nbrs[g]) == 1 and (cost_free[g] or (pendant and timeless[g])):
                (t,) = nbrs[g]
                if not cost_free[g]:
                    moved += gmem[g]
                    moved_nodes.extend(i for i in range(n) if group[i] == g)
                join(g, t)
                changed = True
                break
            if not cost_free[g] or not chain_links:
                continue
            if len(pred_groups[g]) == 1 and len(succ_groups[g]) == 1 and len(nbrs[g]) == 2:
                (a,) = pred_groups[g]
                (b,) = succ_groups[g]
                if succ_groups[a] != {g} or _has_backward(graph, uf, g):
                    continue
                # cutting a|g costs a's producers, g|b costs g's: keep the cheaper cut
                cut_before = _out_cost(graph, uf, a, g)
                cut_after = _out_cost(graph, uf, g, b)
                target = b if cut_before <= cut_after else a
                join(g, target)  # g is costless: no memory to add
                changed = True
                break
    return moved, moved_nodes


def _has_backward(graph: OpGraph, uf: UnionFind, g: int) -> bool:
    return any(nd.backward for i, nd in enumerate(graph.nodes) if uf.find(i) == g)


def _out_cost(graph: OpGraph, uf: UnionFind, a: int, b: int) -> float:
    """comm_time of the producers in group ``a`` with a consumer in group ``b``."""
    prods = {u for u, v, _ in graph.edges if uf.find(u) == a and uf.find(v) == b}
    return sum(graph.nodes[u].comm_time for u in prods)
