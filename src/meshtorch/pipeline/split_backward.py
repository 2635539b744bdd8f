"""The backward split into the input gradient (``B``) and the weight gradient (``W``), each computed once.

``B`` is ``torch.autograd.grad`` of the stage's outputs with respect to its
inputs, keeping the graph. A weight gradient needs the gradient of every op
output a parameter feeds, and ``B`` already computed those on its way to the
inputs: before running it, a pre-hook goes on each **frontier** node (a node on
the path from the outputs to the inputs, reached from a parameter by the
nodes off that path) and keeps the gradient that flows into it. ``W`` then runs
``torch.autograd.grad`` from those nodes (:class:`torch.autograd.graph.GradientEdge`)
to the parameters they reach, one call per group of parameters that share
frontier nodes (one call for all would run the chain between the layers again,
since each layer's frontier leads to the earlier layers' parameters), with
pre-hooks that hand each frontier node the kept gradient (so a gradient
reaching it again from another frontier node of the group is not counted
twice): the input-gradient chain is not run a second time. This is
``torch.distributed.pipelining``'s ``stage_backward_input``/``stage_backward_weight``,
written here on public autograd APIs (``Node.register_prehook``, ``GradientEdge``).

A parameter no path through the inputs reaches (or a stage whose inputs need
no gradient, such as the first, which takes token ids) gets its gradient in
``W`` from the outputs directly.

Example:
    >>> import torch
    >>> from meshtorch.pipeline.split_backward import input_gradient, weight_gradient
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(5, 3, requires_grad=True)
    >>> y = net(x)
    >>> g = torch.ones_like(y)
    >>> kept = input_gradient([y], [g], [x], list(net.parameters()))
    >>> weight_gradient(kept)
    >>> x2 = x.detach().requires_grad_(True)
    >>> want = torch.autograd.grad(net(x2), [x2, *net.parameters()], g)
    >>> torch.allclose(x.grad, want[0]) and all(torch.allclose(p.grad, w) for p, w in
    ...                                         zip(net.parameters(), want[1:]))
    True
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node gradients of ``t`` reach: its ``grad_fn``, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """Each node of the graph below ``roots`` -> the nodes that feed it gradients."""
    out: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return out


def _closure(starts: list[Node], reverse: dict[Node, list[Node]],
             stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes gradients reach ``starts`` through (walking towards the outputs), not past ``stop``;
    and the ``stop`` nodes met."""
    seen, met, queue = set(starts), set(), deque(starts)
    while queue:
        for node in reverse.get(queue.popleft(), ()):
            if node in seen:
                continue
            if node in stop:
                met.add(node)
                continue
            seen.add(node)
            queue.append(node)
    return seen, met


@dataclass
class Kept:
    """What ``B`` leaves for ``W``: groups of (frontier nodes, the parameters they reach), the
    gradients that flowed into the frontier nodes, and the outputs for the parameters no frontier
    node reaches."""

    groups: list[tuple[list[Node], list[torch.Tensor]]] = field(default_factory=list)
    grads: dict[Node, tuple] = field(default_factory=dict)
    outputs: list[torch.Tensor] = field(default_factory=list)
    output_grads: list[Any] = field(default_factory=list)
    rest: list[torch.Tensor] = field(default_factory=list)  # parameters W reaches from the outputs


def input_gradient(outputs: list[torch.Tensor], grads: list[Any], inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> Kept:
    """``B``: put the gradient of ``outputs`` (given ``grads``) with respect to ``inputs`` (those
    that require it) in their ``.grad``; return what :func:`weight_gradient` needs for ``params``."""
    params = [p for p in params if p.requires_grad]
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    kept = Kept(outputs=outputs, output_grads=grads)
    if not outputs or not wanted:
        kept.rest = params  # nothing to share: W runs the whole backward to the parameters
        return kept
    reverse = _reverse_edges([n for n in map(grad_node, outputs) if n is not None])
    on_path, _ = _closure([n for n in map(grad_node, wanted) if n is not None], reverse, set())
    # parameters whose frontiers overlap form one group (a node's kept gradient is used once)
    group_of: dict[Node, int] = {}
    groups: list[tuple[set[Node], list[torch.Tensor]] | None] = []
    for p in params:
        node = grad_node(p)
        met = _closure([node], reverse, on_path)[1] if node in reverse else set()
        if not met:
            kept.rest.append(p)
            continue
        nodes, members = set(met), [p]
        for g in sorted({group_of[n] for n in met if n in group_of}):
            nodes |= groups[g][0]
            members = groups[g][1] + members
            groups[g] = None
        groups.append((nodes, members))
        for n in nodes:
            group_of[n] = len(groups) - 1
    kept.groups = [(list(nodes), members) for nodes, members in filter(None, groups)]
    frontier = [n for nodes, _ in kept.groups for n in nodes]

    def keep(node: Node):
        def hook(grad_outputs: tuple) -> None:
            kept.grads[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keep(node)) for node in frontier]
    try:
        got = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for x, g in zip(wanted, got):
        x.grad = g
    return kept


def _accumulate(params: list[torch.Tensor], grads: tuple) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def weight_gradient(kept: Kept) -> None:
    """``W``: accumulate the parameters' gradients in their ``.grad`` from what :func:`input_gradient`
    kept, and free the graph."""
    if kept.rest and kept.outputs:
        _accumulate(kept.rest, torch.autograd.grad(kept.outputs, kept.rest, kept.output_grads,
                                                   retain_graph=bool(kept.groups), allow_unused=True))
    for k, (nodes, params) in enumerate(kept.groups):
        edges, seeds = [], []
        for node in nodes:
            for i, g in enumerate(kept.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            continue
        # a frontier node also downstream of another of the group gets the kept gradient, not the kept
        # one plus what flows in again from the other
        handles = [node.register_prehook(lambda _, g=kept.grads[node]: g) for node in nodes
                   if len(nodes) > 1 and node in kept.grads]
        try:
            last = k == len(kept.groups) - 1
            _accumulate(params, torch.autograd.grad(edges, params, seeds, retain_graph=not last,
                                                    allow_unused=True))
        finally:
            for h in handles:
                h.remove()
    kept.grads.clear()
