"""Grouped collectives: many tensors of one axis group in one flat call, and their handles.

A grouped collective packs the tensors into one flat buffer, runs one collective on it and
unpacks the result (FSDP2's flat all-gather and reduce-scatter, DDP's gradient buckets). The
communicator counts it as the one call it is. Started with ``async_op=True`` it returns a
:class:`Handle`; :meth:`Handle.wait` gives the unpacked tensors once the call is done (on the
``torch`` backend the call runs while this processor computes; on CUDA, NCCL runs it on its own
stream and ``wait`` orders the current stream after it). Backends that complete calls eagerly
(``threads``, ``meta``) return a handle that is already done: the same code runs everywhere.

Layouts of the flat buffer (``n`` group members, tensor ``i`` with dim ``d_i``):

- all_gather: each member sends the concatenation of its tensors, each with ``d_i`` moved
  first and flattened; the ``(n, total)`` result's columns of tensor ``i`` are its ``n``
  pieces, concatenated back along ``d_i``.
- reduce_scatter: tensor ``i`` is cut along ``d_i`` into ``n`` equal chunks; the buffer is
  ``(n, total)`` with row ``j`` holding member ``j``'s chunk of every tensor, each chunk
  flattened in its own (contiguous) layout.
- all_reduce: the concatenation of the flattened tensors.

The tensors a reduce_scatter or all_reduce gives back are contiguous *views* of the call's one
flat result, which is exactly their bytes: kept together they cost nothing more than separate
tensors (DDP's ``gradient_as_bucket_view``, FSDP2's reduce output), and the buffer dies with the
last of them. Keeping only some of them keeps the whole buffer: copy those (``clone``) instead.

Pieces must be equal (a dim the group does not divide raises :class:`~meshtorch.errors.CommError`;
the per-tensor collectives handle uneven pieces), and the tensors must share one dtype.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     comm = mt.current().comm
    ...     a, b = torch.full((1, 2), comm.rank + 1.0), torch.full((3,), comm.rank + 1.0)
    ...     work = comm.all_reduce_grouped([a, b], "b", async_op=True)
    ...     return [t.tolist() for t in work.wait()], mt.comm_stats().calls()
    >>> mt.launch(f, mesh="b:2")[0]
    ([[[3.0, 3.0]], [3.0, 3.0, 3.0]], 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from meshtorch.errors import CommError

GROUPED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class Handle:
    """A grouped collective in flight: :meth:`wait` gives its tensors (the same list each time).

    Args:
        finish: called once, by the first :meth:`wait`; waits for the call and unpacks it.
        done: whether the call has already completed (an eager backend).
    """

    def __init__(self, finish: Callable[[], list[torch.Tensor]], done: Callable[[], bool] | None = None):
        self._finish: Callable[[], list[torch.Tensor]] | None = finish
        self._done = done
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        """The call's result tensors, in the order given (waits for the call first)."""
        if self._finish is not None:
            finish, self._finish, self._done = self._finish, None, None
            self._result = finish()
        if self._result is None:  # a handle whose call raised: its result never came
            raise CommError("this grouped collective failed before its result came; its error was raised "
                            "where it was waited on first")
        return self._result

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return without waiting."""
        return self._finish is None or self._done is None or self._done()


def done(result: list[torch.Tensor]) -> Handle:
    """A handle of a call that has completed with ``result``."""
    return Handle(lambda: result)


def _check(kind: str, tensors: Sequence[torch.Tensor], axes) -> torch.dtype:
    if not tensors:
        raise CommError(f"grouped {kind} over {axes} needs at least one tensor")
    bad = [i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)]
    if bad:
        raise CommError(f"grouped {kind} over {axes}: item {bad[0]} is {type(tensors[bad[0]]).__name__}, "
                        "not a torch.Tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise CommError(f"grouped {kind} over {axes} packs one dtype into one buffer, got "
                        f"{sorted(map(str, dtypes))}; group the tensors by dtype")
    return tensors[0].dtype


def pack_gather(tensors: Sequence[torch.Tensor], dims: Sequence[int], axes) -> tuple[torch.Tensor, list]:
    """The flat buffer a member sends to a grouped all_gather, and how to unpack the result."""
    _check("all_gather", tensors, axes)
    scalars = [i for i, t in enumerate(tensors) if not t.dim()]
    if scalars:
        raise CommError(f"grouped all_gather over {axes}: tensor {scalars[0]} is a scalar, with no "
                        "dim to gather along")
    moved = [t.detach().movedim(d % t.dim(), 0) for t, d in zip(tensors, dims)]
    layout = [(tuple(m.shape), d % t.dim()) for t, m, d in zip(tensors, moved, dims)]
    return _flat(moved, tensors[0].dtype), layout


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype, release: bool = False) -> torch.Tensor:
    """One flat buffer of ``tensors`` in order, each copied into its place once (``cat`` of
    ``reshape``s would first copy every tensor that is not contiguous, all of them alive beside
    the buffer); with ``release``, each is dropped from the list ``tensors`` once copied."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    at = 0
    for i, t in enumerate(tensors):
        flat[at:at + t.numel()].view(t.shape).copy_(t.detach())
        at += t.numel()
        if release:
            tensors[i] = None  # type: ignore[index]  # the caller's list held it last: freed now
    return flat


def unpack_gather(out: torch.Tensor, n: int, layout: list) -> list[torch.Tensor]:
    got = Gathered(out, n, layout)
    return [got.take(i) for i in range(len(got))]


class Gathered:
    """A grouped all_gather's flat result, unpacked one tensor at a time: :meth:`take` copies
    tensor ``i`` out, into a tensor of the caller's (a storage it refills) without a copy in
    between; the flat result is let go once every tensor has been taken.

    Example:
        >>> import torch
        >>> out = torch.arange(8.0)  # each of 2 members sent [a (1 x 2) | b (1 x 2)], a gathered on dim 1
        >>> got = Gathered(out, 2, [((2, 1), 1), ((1, 2), 0)])  # (shape with the dim first, the dim)
        >>> got.take(0).tolist(), got.take(1, into=torch.empty(2, 2)).tolist()
        ([[0.0, 1.0, 4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]])
    """

    def __init__(self, out: torch.Tensor, n: int, layout: list):
        self._rows: torch.Tensor | None = out.view(n, -1)
        self._n, self._layout = n, layout
        self._at = [0]
        for shape, _ in layout:
            self._at.append(self._at[-1] + math.prod(shape))
        self._left = set(range(len(layout)))

    def __len__(self) -> int:
        return len(self._layout)

    def take(self, i: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``i`` gathered (written into ``into``, of its shape, where given)."""
        rows = self._rows
        if rows is None or i not in self._left:
            raise CommError(f"member {i} of this grouped all_gather was taken already")
        (shape, d), n = self._layout[i], self._n
        piece = rows[:, self._at[i]:self._at[i + 1]]
        self._left.discard(i)
        if not self._left:
            self._rows = None
        if into is None and d == 0 and piece.is_contiguous():
            return piece.view((n * shape[0],) + shape[1:])  # one member in the call: no copy
        if into is None:
            whole = [*shape[1:d + 1], n * shape[0], *shape[d + 1:]]  # the gathered tensor's shape
            into = torch.empty(whole, dtype=rows.dtype, device=rows.device)
        # the caller's tensor seen as the pieces: (n, *shape) with d first, a view (no copy)
        into.movedim(d, 0).unflatten(0, (n, shape[0])).copy_(piece.unflatten(1, shape))
        return into


def pack_scatter(tensors: Sequence[torch.Tensor], dims: Sequence[int], axes, n: int, release: bool = False
                 ) -> tuple[torch.Tensor, list]:
    """The ``(n, total)`` buffer a member hands a grouped reduce_scatter, and how to unpack its row:
    row ``j`` is member ``j``'s chunk of each tensor, in that chunk's own layout. Each tensor is
    copied into the buffer once (no copy in between); with ``release`` (``tensors`` a list) each
    is dropped from the list once copied, so that a bucket costs its buffer and not twice that."""
    dtype = _check("reduce_scatter", tensors, axes)
    moved, shapes = [], []
    for i, (t, d) in enumerate(zip(tensors, dims)):
        if not t.dim():
            raise CommError(f"grouped reduce_scatter over {axes}: tensor {i} is a scalar, with no dim "
                            "to scatter along")
        d = d % t.dim()
        if t.shape[d] % n:
            raise CommError(
                f"grouped reduce_scatter over {axes}: tensor {i} of shape {list(t.shape)} has dim {d} of "
                f"size {t.shape[d]}, not divisible by the group size {n}; reduce uneven pieces one "
                "tensor at a time (Communicator.reduce_scatter with sizes=)")
        # the n chunks along d as a leading dim, each keeping its dims in order: unpacked, a
        # chunk is a contiguous view of the row (no copy, and no row kept alive for a copy)
        moved.append((d, t.shape[d] // n))
        shapes.append(tuple(t.shape[:d]) + (t.shape[d] // n,) + tuple(t.shape[d + 1:]))
    sizes = [math.prod(s) for s in shapes]
    buf = torch.empty((n, sum(sizes)), dtype=dtype, device=tensors[0].device)
    at = 0
    for i, ((d, piece), shape, size) in enumerate(zip(moved, shapes, sizes)):
        chunks = tensors[i].detach().unflatten(d, (n, piece)).movedim(d, 0)
        buf[:, at:at + size].unflatten(1, shape).copy_(chunks)
        at += size
        if release:
            tensors[i] = None  # type: ignore[index]  # the caller's list held it last: freed now
    return buf, shapes


def unpack_scatter(row: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """This member's chunks: contiguous views of its reduced ``row`` (see the module), laid out
    as a grouped all_reduce's result."""
    return unpack_reduce(row.reshape(-1), shapes)


def pack_reduce(tensors: Sequence[torch.Tensor], axes, release: bool = False) -> tuple[torch.Tensor, list]:
    """The flat buffer of a grouped all_reduce, and the tensors' shapes to unpack it (``release``:
    as :func:`pack_scatter`'s)."""
    dtype = _check("all_reduce", tensors, axes)
    shapes = [tuple(t.shape) for t in tensors]
    whole = _packed(tensors)
    if whole is not None:
        return whole, shapes  # packed already (overlap's buckets): no copy
    return _flat(tensors, dtype, release), shapes  # type: ignore[arg-type]


def _packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The flat buffer ``tensors`` are, in order, the consecutive contiguous views of (all of it),
    or None."""
    base = tensors[0]._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    at = base.storage_offset()
    for t in tensors:
        if t._base is not base or not t.is_contiguous() or t.storage_offset() != at:
            return None
        at += t.numel()
    return base if at == base.storage_offset() + base.numel() else None


def unpack_reduce(out: torch.Tensor, shapes: list, sizes: list[int] | None = None) -> list[torch.Tensor]:
    """The reduced tensors: contiguous views of the flat ``out`` (see the module); ``sizes``: their
    numbers of elements, where the caller has them."""
    if sizes is None:
        sizes = [math.prod(s) for s in shapes]
    # (split_with_sizes: Tensor.split is a Python wrapper around it)
    return [p.view(s) for p, s in zip(out.split_with_sizes(sizes), shapes)]
