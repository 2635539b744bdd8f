"""Differentiable collectives: each a ``torch.autograd.Function`` with its
conjugate backward. Every adapter the lowering uses lives here.

All functions act along one mesh axis, or a group of axes given in mesh order,
on *local* tensors and take the communicator explicitly, so backward never
depends on which thread runs it.

| function                 | forward            | backward                 |
|--------------------------|--------------------|--------------------------|
| ``all_reduce_sum``       | all_reduce(sum)    | identity                 |
| ``all_reduce_extreme``   | all_reduce(max/min)| grad to the arg-extreme  |
| ``identity_grad_sum``    | identity           | all_reduce(sum)          |
| ``reduce_scatter``       | reduce_scatter     | all_gather               |
| ``all_gather``           | all_gather         | reduce_scatter           |
| ``all_gather_sliced``    | all_gather         | local slice              |
| ``local_slice``          | local slice        | all_gather               |
| ``all_to_all``           | all_to_all         | all_to_all (reversed)    |
| ``shift``                | shift by k         | shift by -k              |
| ``permute``              | permute (sources)  | the inverse permutation  |
| ``broadcast``            | broadcast from src | to src, zeros elsewhere  |

**Higher-order gradients.** A backward run with ``create_graph=True`` (a gradient penalty, a
Hessian-vector product) runs in grad mode, and there each backward above computes its result
with the Function of its own adjoint collective (``.apply``), whose backward is the forward
collective again, so the backward is differentiable: a reduce_scatter by ``_ReduceScatter``, an
all_gather by ``_AllGather``, a local slice by ``_LocalSlice``, an identity (``all_reduce_sum``'s)
by ``identity_grad_sum`` and an all_reduce (``identity_grad_sum``'s) by ``all_reduce_sum``, a
shift or permutation by the reversed one. The usual backward (grad mode off) takes the raw
collective, one ``torch.is_grad_enabled()`` test more and no Python call.

The backward rules above assume the gradient arriving at a replicated output
is itself replicated (the same on every processor of the axis), as in the
lowering. Code where each processor has a loss of its own (data-parallel
replicas: :mod:`meshtorch.replicator`) passes ``grad_sum=True`` to the
reductions and ``broadcast``: the output's gradient is first summed over the
axis, the adjoint of "every processor receives the same value".

``comm`` is a :class:`~meshtorch.comm.base.Communicator`, or any object with
its collective methods and ``position``: the Replicator passes its ordered
channel, so these Functions also serve collectives that must queue behind
gradient buckets in flight.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.lowering import adapters as ca
    >>> def f():
    ...     comm = mt.current().comm
    ...     x = torch.ones(2, requires_grad=True)
    ...     ca.all_gather(x, comm, "b", 0).sum().backward()
    ...     return x.grad.tolist()
    >>> mt.launch(f, mesh="b:2")
    [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import threading

import torch

from meshtorch.comm.base import Communicator, as_axes
from meshtorch.layout import lengths, piece

#: Whether Dynamo is tracing this call, in one call into torch (:func:`meshtorch.caching.compiling`'s
#: test without its frame: the lowering, ops and layers ask it per op, paid cold between large
#: kernels). ``torch.compiler.is_dynamo_compiling`` (torch >= 2.3; its docs call it internal), else
#: ``is_compiling`` should a release drop it.
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling

# one axis, or a group of axes in mesh order (the collective runs over their sub-mesh)
AxisGroup = str | tuple[str, ...]


def _extent(comm: Communicator, total: int, prefix: tuple[str, ...]) -> int:
    """The length of a dim of global size ``total`` once gathered down to the ``prefix`` axes
    that still cut it (the same on every member of the gathering group)."""
    mesh = comm.mesh
    return piece(total, [(mesh.axis_size(a), comm.coords[a]) for a in prefix])[1]


def _slice(t: torch.Tensor, comm: Communicator, axes: str | tuple[str, ...], dim: int) -> torch.Tensor:
    # torch.chunk over each axis in turn, major first (meshtorch.layout.piece)
    mesh = comm.mesh
    start, length = piece(t.shape[dim], [(mesh.axis_size(a), comm.coords[a]) for a in as_axes(axes)])
    return t.narrow(dim, start, length).contiguous()


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, grad_sum):
        ctx.comm, ctx.axis, ctx.grad_sum = comm, axis, grad_sum
        return comm.all_reduce(t, axis, "sum")

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():  # create_graph: the adjoint differentiable (module docstring)
            return _sum_grad(g, ctx.comm, ctx.axis, ctx.grad_sum), None, None, None
        if ctx.grad_sum:
            g = ctx.comm.all_reduce(g.contiguous(), ctx.axis, "sum")
        return g, None, None, None


def _sum_grad(g: torch.Tensor, comm, axis, grad_sum: bool) -> torch.Tensor:
    """A replicated output's gradient as its input's, differentiably (``create_graph``): with
    ``grad_sum`` summed over ``axis`` (an all_reduce, whose adjoint is itself), else passed on (an
    identity, whose adjoint sums the second-order gradient over ``axis``: ``identity_grad_sum``)."""
    return _AllReduceSum.apply(g, comm, axis, True) if grad_sum else _IdentityGradSum.apply(g, comm, axis)


class _AllReduceSumLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, handles):
        # the result's storage, filled where it is read (Later.wait); the call gets its own copy
        # (reduced in place on the torch backend), prepared once (a loss's, every step)
        handles.append(comm.all_reduce_async(t.clone(memory_format=torch.contiguous_format), axis))
        ctx.comm, ctx.axis = comm, axis
        return torch.empty_like(t)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            return _IdentityGradSum.apply(g, ctx.comm, ctx.axis), None, None, None
        return g, None, None, None


class _IdentityGradSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            return _AllReduceSum.apply(g, ctx.comm, ctx.axis, False), None, None
        return ctx.comm.all_reduce(g.contiguous(), ctx.axis, "sum"), None, None


class _AllReduceExtreme(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, op, grad_sum):
        out = comm.all_reduce(t, axis, op)
        ctx.comm, ctx.axis, ctx.grad_sum = comm, axis, grad_sum
        ctx.save_for_backward(t == out)
        return out

    @staticmethod
    def backward(ctx, g):
        (hit,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            g = _sum_grad(g, ctx.comm, ctx.axis, ctx.grad_sum)
        elif ctx.grad_sum:
            g = ctx.comm.all_reduce(g.contiguous(), ctx.axis, "sum")
        hits = ctx.comm.all_reduce(hit.to(g.dtype), ctx.axis, "sum")
        # ties across processors share the gradient evenly, as torch.amax does
        return g * hit / hits.clamp_min(1), None, None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, src, grad_sum):
        ctx.comm, ctx.axis, ctx.grad_sum = comm, axis, grad_sum
        ctx.mine = comm.position(axis) == src
        return comm.broadcast(t.contiguous(), axis, src)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            # zeros off the source still from the summed gradient: its backward's collective
            # runs on every member
            g = _sum_grad(g, ctx.comm, ctx.axis, ctx.grad_sum)
            return (g if ctx.mine else torch.where(torch.zeros((), dtype=torch.bool, device=g.device), g, 0)
                    ), None, None, None, None
        if ctx.grad_sum:
            g = ctx.comm.all_reduce(g.contiguous(), ctx.axis, "sum")
        # only the source's value reached the output
        return (g if ctx.mine else torch.zeros_like(g)), None, None, None, None


def _gather(comm, t: torch.Tensor, axis, dim: int, sizes: list[int] | None) -> torch.Tensor:
    # sizes only for uneven pieces: the Replicator's channel takes the plain signature
    t = t.contiguous()
    return comm.all_gather(t, axis, dim) if sizes is None else comm.all_gather(t, axis, dim, sizes)


def _scatter(comm, t: torch.Tensor, axis, dim: int, sizes: list[int] | None) -> torch.Tensor:
    t = t.contiguous()
    if sizes is None:
        return comm.reduce_scatter(t, axis, dim)
    return comm.reduce_scatter(t, axis, dim, sizes=sizes)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, dim):
        sizes = lengths(comm.mesh, axis, t.shape[dim])
        ctx.comm, ctx.axis, ctx.dim, ctx.sizes = comm, axis, dim, sizes
        return _scatter(comm, t, axis, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            g = _AllGather.apply(g, ctx.comm, ctx.axis, ctx.dim, False, _whole(ctx.sizes), ())
            return g, None, None, None
        return _gather(ctx.comm, g, ctx.axis, ctx.dim, ctx.sizes), None, None, None


def _whole(sizes: list[int] | None) -> int | None:
    # the gathered length that gives _AllGather these uneven pieces (as its ``total``, no prefix)
    return None if sizes is None else sum(sizes)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, dim, sliced_backward, total, prefix):
        sizes = None if total is None else lengths(comm.mesh, axis, _extent(comm, total, prefix))
        ctx.comm, ctx.axis, ctx.dim, ctx.sliced, ctx.sizes = comm, axis, dim, sliced_backward, sizes
        return _gather(comm, t, axis, dim, sizes)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            g = (_LocalSlice if ctx.sliced else _ReduceScatter).apply(g, ctx.comm, ctx.axis, ctx.dim)
        elif ctx.sliced:
            g = _slice(g, ctx.comm, ctx.axis, ctx.dim)
        else:
            g = _scatter(ctx.comm, g, ctx.axis, ctx.dim, ctx.sizes)
        return g, None, None, None, None, None, None


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, dim):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        ctx.sizes = lengths(comm.mesh, axis, t.shape[dim])
        return _slice(t, comm, axis, dim)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            g = _AllGather.apply(g, ctx.comm, ctx.axis, ctx.dim, True, _whole(ctx.sizes), ())
            return g, None, None, None
        return _gather(ctx.comm, g, ctx.axis, ctx.dim, ctx.sizes), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, split_dim, concat_dim, total, prefix):
        mesh = comm.mesh
        splits = lengths(mesh, axis, t.shape[split_dim])
        concats = None if total is None else lengths(mesh, axis, _extent(comm, total, prefix))
        ctx.comm, ctx.axis, ctx.split, ctx.concat = comm, axis, split_dim, concat_dim
        ctx.sizes = splits, concats
        return comm.all_to_all(t.contiguous(), axis, split_dim, concat_dim, splits, concats)

    @staticmethod
    def backward(ctx, g):
        splits, concats = ctx.sizes
        if torch.is_grad_enabled():
            out = _AllToAll.apply(g, ctx.comm, ctx.axis, ctx.concat, ctx.split, _whole(splits), ())
            return out, None, None, None, None, None, None
        out = ctx.comm.all_to_all(g.contiguous(), ctx.axis, ctx.concat, ctx.split, concats, splits)
        return out, None, None, None, None, None, None


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, offset, wrap):
        ctx.comm, ctx.axis, ctx.offset, ctx.wrap = comm, axis, offset, wrap
        return comm.shift(t.contiguous(), axis, offset, wrap)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            return _Shift.apply(g, ctx.comm, ctx.axis, -ctx.offset, ctx.wrap), None, None, None, None
        return ctx.comm.shift(g.contiguous(), ctx.axis, -ctx.offset, ctx.wrap), None, None, None, None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm, axis, sources):
        ctx.comm, ctx.axis, ctx.inverse = comm, axis, list(inverse_sources(sources))
        return comm.permute(t.contiguous(), axis, list(sources))

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            return _Permute.apply(g, ctx.comm, ctx.axis, tuple(ctx.inverse)), None, None, None
        return ctx.comm.permute(g.contiguous(), ctx.axis, ctx.inverse), None, None, None


def all_reduce_sum(t: torch.Tensor, comm: Communicator, axis: AxisGroup,
                   grad_sum: bool = False) -> torch.Tensor:
    """Partial sums → replicated total; backward identity (with ``grad_sum``: all_reduce)."""
    return _AllReduceSum.apply(t, comm, axis, grad_sum)


class Later:
    """A scalar's ``all_reduce_sum`` in flight (:func:`all_reduce_sum_later`): ``tensor`` is the
    result, with its place in the autograd graph, and holds its value once :meth:`wait` ran."""

    __slots__ = ("tensor", "_handle", "_lock")

    def __init__(self, tensor: torch.Tensor, handle) -> None:
        self.tensor, self._handle, self._lock = tensor, handle, threading.Lock()

    def wait(self) -> torch.Tensor:
        """``tensor``, its value in (the first call waits for the collective; later ones return)."""
        with self._lock:  # two threads reading one loss: the second finds it filled
            if self._handle is not None:
                (out,) = self._handle.wait()
                with torch.no_grad():
                    self.tensor.copy_(out)
                self._handle = None
        return self.tensor


def all_reduce_sum_later(t: torch.Tensor, comm: Communicator, axis: AxisGroup) -> Later:
    """:func:`all_reduce_sum` issued asynchronously: the result's tensor exists at once (backward
    may start from it: its gradient does not depend on its value), its value once
    :meth:`Later.wait` ran. For a scalar (a loss, a metric), whose value is read after backward.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.lowering.adapters import all_reduce_sum_later
        >>> def f():
        ...     x = torch.tensor(float(mt.current().comm.rank + 1), requires_grad=True)
        ...     later = all_reduce_sum_later(x * 2, mt.current().comm, "b")
        ...     later.tensor.backward()
        ...     return later.wait().item(), x.grad.item()
        >>> mt.launch(f, mesh="b:2")
        [(6.0, 2.0), (6.0, 2.0)]
    """
    handles: list = []
    out = _AllReduceSumLater.apply(t, comm, axis, handles)
    return Later(out, handles[0])


def all_reduce_extreme(t: torch.Tensor, comm: Communicator, axis: AxisGroup, op: str,
                       grad_sum: bool = False) -> torch.Tensor:
    """Partial max/min → replicated; backward to where the extreme came from
    (with ``grad_sum``: the gradient summed over ``axis`` first)."""
    return _AllReduceExtreme.apply(t, comm, axis, op, grad_sum)


def identity_grad_sum(t: torch.Tensor, comm: Communicator, axis: AxisGroup) -> torch.Tensor:
    """A replicated input used whole by an op that varies along ``axis``."""
    return _IdentityGradSum.apply(t, comm, axis)


def reduce_scatter(t: torch.Tensor, comm: Communicator, axis: AxisGroup, dim: int) -> torch.Tensor:
    """Partial sums → summed and split on tensor dim ``dim``; backward all_gather."""
    return _ReduceScatter.apply(t, comm, axis, dim)


def all_gather(t: torch.Tensor, comm: Communicator, axis: AxisGroup, dim: int, total: int | None = None,
               prefix: tuple[str, ...] = ()) -> torch.Tensor:
    """Split → whole, for an op that varies along ``axis``; backward reduce_scatter.

    ``total`` and ``prefix``: for uneven pieces, the dim's global size and the axes that still
    cut it after the gather (``None``: the pieces are equal)."""
    return _AllGather.apply(t, comm, axis, dim, False, total, prefix)


def all_gather_sliced(t: torch.Tensor, comm: Communicator, axis: AxisGroup, dim: int,
                      total: int | None = None, prefix: tuple[str, ...] = ()) -> torch.Tensor:
    """Split → whole, for an op that does not vary along ``axis``; backward slices
    (``total``, ``prefix``: as for :func:`all_gather`)."""
    return _AllGather.apply(t, comm, axis, dim, True, total, prefix)


def local_slice(t: torch.Tensor, comm: Communicator, axis: AxisGroup, dim: int) -> torch.Tensor:
    """Replicated → this processor's slice of tensor dim ``dim``; backward all_gather."""
    return _LocalSlice.apply(t, comm, axis, dim)


def all_to_all(
    t: torch.Tensor, comm: Communicator, axis: AxisGroup, split_dim: int, concat_dim: int,
    total: int | None = None, prefix: tuple[str, ...] = ()
) -> torch.Tensor:
    """Move ``axis`` from tensor dim ``concat_dim`` to ``split_dim``; backward reversed
    (``total``, ``prefix``: ``concat_dim``'s global size and the axes that still cut it after
    the move, for uneven pieces; ``None``: equal pieces)."""
    return _AllToAll.apply(t, comm, axis, split_dim, concat_dim, total, prefix)


def shift(t: torch.Tensor, comm: Communicator, axis: str, offset: int, wrap: bool) -> torch.Tensor:
    """Receive the tensor of the processor ``offset`` places before; backward reversed."""
    return _Shift.apply(t, comm, axis, offset, wrap)


def permute(t: torch.Tensor, comm: Communicator, axis: AxisGroup,
            sources: tuple[int | None, ...]) -> torch.Tensor:
    """Member ``i`` receives member ``sources[i]``'s tensor (``sources``: distinct members of the
    axis, or of the group of axes; ``None``: zeros); backward sends each gradient back where its
    tensor came from (a member nobody received from gets zeros).

    Example (member 0 gets member 2's tensor; the gradient of ``y`` on member 0 goes to 2):
        >>> import torch, meshtorch as mt
        >>> from meshtorch.lowering.adapters import permute
        >>> def f():
        ...     me = mt.current().coords["b"]
        ...     x = torch.full((2,), float(me), requires_grad=True)
        ...     permute(x, mt.current().comm, "b", (2, 0, 1)).mul(10 + me).sum().backward()
        ...     return x.grad.tolist()
        >>> mt.launch(f, mesh="b:3")
        [[11.0, 11.0], [12.0, 12.0], [10.0, 10.0]]
    """
    return _Permute.apply(t, comm, axis, tuple(sources))


def inverse_sources(sources: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """The ``sources`` of the permutation that undoes ``permute(..., sources)`` (``None`` for
    a member whose tensor nobody received).

    Example:
        >>> inverse_sources((2, 0, 1)), inverse_sources((None, 0, 1))
        ((1, 2, 0), (1, 2, None))
    """
    inv: list[int | None] = [None] * len(sources)
    for i, s in enumerate(sources):
        if s is not None:
            inv[s] = i
    return tuple(inv)


def broadcast(t: torch.Tensor, comm: Communicator, axis: AxisGroup, src: int,
              grad_sum: bool = False) -> torch.Tensor:
    """Group member ``src``'s tensor on every member; backward to ``src``, zeros elsewhere
    (with ``grad_sum``: the gradient summed over ``axis`` first).

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.lowering import adapters as ca
        >>> def f():
        ...     comm = mt.current().comm
        ...     x = torch.tensor([1.0 + comm.rank], requires_grad=True)
        ...     y = ca.broadcast(x, comm, "b", 1, grad_sum=True)
        ...     (y * (comm.rank + 1)).sum().backward()      # losses y and 2y: d/dx_1 = 3
        ...     return y.item(), x.grad.item()
        >>> mt.launch(f, mesh="b:2")
        [(2.0, 0.0), (2.0, 3.0)]
    """
    return _Broadcast.apply(t, comm, axis, src, grad_sum)
