"""Which of an op's inputs its backward never reads: a gathered value that only an autocast's
cast or an embedding's row lookup reads can be freed right after the op's forward
(:func:`meshtorch.lowering.overlap.after_forward`), since autograd keeps the copy, not the value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Autograd nodes whose result is new storage and whose backward reads no value of the input
# (a cast, a copy, a sum, a row lookup: those two save only the integer indices)
_COPIES = frozenset({"ToCopyBackward0", "CloneBackward0", "AddBackward0", "SubBackward0", "NegBackward0",
                     "IndexBackward0", "EmbeddingBackward0"})
_MAX_NODES = 256  # an op's own autograd graph is a few nodes; past this, assume it reads everything
_saves: dict[type, bool] = {}


def _saves_tensors(node: object) -> bool:
    """Whether autograd nodes of ``node``'s kind keep tensors for backward (``_raw_saved_*``)."""
    kind = type(node)
    saves = _saves.get(kind)
    if saves is None:
        saves = _saves[kind] = any(a.startswith("_raw_saved_") for a in dir(kind))
    return saves


def unread_by_backward(result: torch.Tensor, leaves: Sequence[torch.Tensor],
                       args: Sequence[torch.Tensor] = ()) -> list[bool]:
    """For each leaf an op read to compute ``result``, whether the op's backward leaves the
    leaf's storage unread: every path from the leaf up through the op's autograd graph (that
    between ``result`` and the op's inputs ``args``) reaches a cast or copy (:data:`_COPIES`)
    before any node that keeps tensors, passing only nodes that keep none (views, which share
    the leaf's storage). Unknown kinds count as reading it: a freed storage that backward reads
    would fail, a kept one costs only memory.

    Example (an autocast's cast keeps its bf16 copy; a matmul keeps its fp32 operand):
        >>> import torch
        >>> from meshtorch.lowering.overlap_reads import unread_by_backward
        >>> w = torch.ones(3, 2, requires_grad=True)
        >>> x = torch.ones(4, 3)
        >>> unread_by_backward(x.bfloat16() @ w.t().bfloat16().t(), [w]), unread_by_backward(x @ w, [w])
        ([True], [False])
    """
    stop = {a.grad_fn for a in args if a.grad_fn is not None}
    consumers: dict = {}  # node -> the nodes of this op whose input it makes
    accumulators: dict = {}  # id(leaf) -> its AccumulateGrad node
    wanted = {id(t) for t in leaves}
    start = result.grad_fn
    seen, todo = {start}, [start] if start is not None else []
    while todo:
        n = todo.pop()
        if len(seen) > _MAX_NODES:
            return [False] * len(leaves)
        for child, _ in n.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(n)
            if child in seen:
                continue
            seen.add(child)
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                if id(variable) in wanted:
                    accumulators[id(variable)] = child
            elif child not in stop:
                todo.append(child)

    # (no nested function: a recursive closure is a reference cycle, and it would keep these
    # nodes, and the activations they save, alive until the garbage collector runs)
    if start is None:
        return [True] * len(leaves)  # no backward runs through the op
    # a leaf the walk did not reach counts as read: a freed storage that backward reads would fail
    return [id(t) in accumulators and not _reads(consumers.get(accumulators[id(t)], ()), consumers)
            for t in leaves]


def _reads(first: Sequence, consumers: dict) -> bool:
    """Whether a node among ``first`` (the nodes that take a leaf's value), or one after a node that
    keeps no tensor (a view: its result shares the storage), keeps tensors for backward."""
    todo, seen = list(first), set()
    while todo:
        n = todo.pop()
        if n in seen or type(n).__name__ in _COPIES:
            continue
        if _saves_tensors(n) or len(seen) > _MAX_NODES:
            return True
        seen.add(n)
        todo.extend(consumers.get(n, ()))
    return False

