"""Reductions over named dims: sum, mean, max, min, logsumexp; and ``add_n`` over a list.

``dims`` names the dims to reduce (a name, a ``Dim`` or a list); ``None``
reduces every dim. Alternatively ``output_shape=`` names the dims to keep, in the order the
result has them (as Mesh-TF's ``output_shape``).

``reduce_max``/``reduce_min`` pass the gradient to the extreme elements as ``torch.amax`` does:
``k`` tied elements each get ``1/k`` of it, ``k`` counted over the whole reduced dims, so the
gradient is the same on every mesh and layout.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,b:3")
    >>> mt.reduce_sum(x, "b").to_global().tolist(), mt.reduce_max(x).item()
    ([3.0, 12.0], 5.0)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from meshtorch.errors import ArgumentError, MeshTorchError, ShapeError
from meshtorch.lowering.fused import Fused
from meshtorch.lowering.lower import lower
from meshtorch.ops.elementwise import add, exp, log, nary, unary
from meshtorch.ops.reshape import transpose
from meshtorch.shape import Dim, Shape, as_shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def _reduced_names(x: MeshTensor, dims, output_shape, op: str) -> list[str]:
    if output_shape is not None:
        keep = {dim_name(d, x, op) for d in (as_shape(output_shape) if isinstance(
            output_shape, (Shape, str)) else output_shape)}
        for k in keep:
            x.shape.index(k)
        names = [n for n in x.names if n not in keep]
        if dims is not None and set(_reduced_names(x, dims, None, op)) != set(names):
            # both given and one would be ignored: say so rather than pick
            raise ArgumentError(
                f"{op} of [{x.shape}] was given dims={dims!r} to reduce but output_shape={output_shape!r} "
                f"keeps {sorted(keep)}; pass the dims to reduce or the dims to keep (output_shape=)")
        return names
    if dims is None:
        return list(x.names)
    if isinstance(dims, (str, Dim)):
        dims = [dims]
    names = [dim_name(d, x, op) for d in dims]
    for n in names:
        x.shape.index(n)
    return names


def _extreme(fn, identity: str, t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    # a processor whose slice of a reduced dim is an empty piece of an uneven split contributes
    # the reduction's identity (the dtype's lowest value for max), which the all_reduce drops
    if any(t.shape[i] == 0 for i in idx):
        info = torch.finfo(t.dtype) if t.dtype.is_floating_point else torch.iinfo(t.dtype)
        value = getattr(info, identity)
        if t.dtype.is_floating_point:
            value = -math.inf if identity == "min" else math.inf
        keep = [n for i, n in enumerate(t.shape) if i not in idx]
        return t.new_full(keep, value) + t.sum(idx).to(t.dtype)  # the sum keeps the graph
    return fn(t, idx)


_LOCAL = {"sum": lambda t, i: t.sum(i), "max": functools.partial(_extreme, torch.amax, "min"),
          "min": functools.partial(_extreme, torch.amin, "max")}


def _kept_order(x: MeshTensor, output_shape) -> list[str] | None:
    """The dim names ``output_shape`` keeps, in its order (``None``: no ``output_shape``)."""
    if output_shape is None:
        return None
    dims = as_shape(output_shape) if isinstance(output_shape, str) else output_shape
    return [dim_name(d) for d in dims]


def _in_order(r: MeshTensor, x: MeshTensor, output_shape) -> MeshTensor:
    """``r`` (the reduction of ``x``, dims in ``x``'s order) with its dims in ``output_shape``'s order."""
    order = _kept_order(x, output_shape)
    if order is None or order == r.names:
        return r
    return transpose(r, order)


def _reduce(x: MeshTensor, dims, output_shape, how: str, name, lower_fn=lower, op: str | None = None):
    x = as_mesh_tensor(x)
    names = _reduced_names(x, dims, output_shape, op or f"reduce_{how}")
    out = x.shape.without(names)
    idx = [x.shape.index(n) for n in names]
    if not idx:
        # a mean over no dims is a new tensor, floating as a mean is (fused or not); a sum, max
        # or min over none is the tensor itself
        return _in_order(x / 1 if how == "mean" else x, x, output_shape)
    if how == "mean":
        # each processor divides its partial sum by the global count and the partial means are
        # summed: the all_reduce is the op's last step (inside mt.overlap(), a loss's is read later)
        count = math.prod([x.shape[n].size for n in names])
        # float16/bfloat16 accumulate in float32, as torch.mean does (131072 twos summed in
        # float16 overflow to inf); the partial mean, no larger than the elements, goes back to
        # the input dtype, so the all_reduce and the result keep it
        acc = torch.float32 if x.dtype.is_floating_point and x.dtype.itemsize < 4 else None

        def local_fn(view, t):
            m = t.sum(idx, dtype=acc) / count
            return m if acc is None else m.to(t.dtype)
    else:
        torch_fn = _LOCAL[how]

        def local_fn(view, t):
            return torch_fn(t, idx)

    if how in ("max", "min") and lower_fn is lower and x.requires_grad and torch.is_grad_enabled() and any(
            x.layout.axes_of(n) for n in names):
        return _in_order(_split_extreme(x, names, out, how, name), x, output_shape)
    kind = "sum" if how == "mean" else how  # a mean's partial means are summed
    r = lower_fn(f"reduce_{how}", [x], out, local_fn, reduced=dict.fromkeys(names, kind), name=name)
    return r if lower_fn is not lower else _in_order(r, x, output_shape)


class _Hits(torch.autograd.Function):
    """``t == m`` as 0/1 numbers (in ``dtype``), whose gradient passes to ``t`` where it holds."""

    @staticmethod
    def forward(ctx, t, m, dtype):
        hit = t == m
        ctx.save_for_backward(hit)
        ctx.dtype = t.dtype
        return hit.to(dtype)

    @staticmethod
    def backward(ctx, g):
        (hit,) = ctx.saved_tensors
        return torch.where(hit, g, 0).to(ctx.dtype), None, None


class _Share(torch.autograd.Function):
    """The value ``m``; its gradient goes to ``count`` divided by ``count``, so that each of the
    ``count`` tied elements behind it gets an equal share."""

    @staticmethod
    def forward(ctx, m, count):
        ctx.save_for_backward(count)
        return m.clone()

    @staticmethod
    def backward(ctx, g):
        (count,) = ctx.saved_tensors
        return None, (g / count.clamp_min(1)).to(count.dtype)


def _split_extreme(x: MeshTensor, names: list[str], out, how: str, name) -> MeshTensor:
    # Along a split reduced dim the lowering's all_reduce shares the gradient between the
    # processors holding the extreme, and each splits its share between its own ties: the shares
    # then depend on the layout. Counting the ties over the whole reduced dims instead gives
    # torch.amax's rule on every mesh, for the same two all_reduces (max, then the count).
    idx = [x.shape.index(n) for n in names]
    m = lower(f"reduce_{how}", [x.detach()], out, lambda view, t: _LOCAL[how](t, idx),
              reduced=dict.fromkeys(names, how), name=name)
    count_dtype = torch.promote_types(x.dtype, torch.float32)
    hits = nary(lambda t, mm: _Hits.apply(t, mm, count_dtype), x, m, op=f"reduce_{how}")
    count = _reduce(hits, names, None, "sum", None)
    return MeshTensor(_Share.apply(m.local, count.local), m.shape, m.layout, name)


def reduce_sum(x: MeshTensor, dims=None, *, output_shape=None, name=None) -> MeshTensor:
    """Sum over ``dims`` (all if ``None``), or over every dim ``output_shape`` leaves out, the
    result's dims then in ``output_shape``'s order.

    Example:
        >>> import torch, meshtorch as mt
        >>> mt.reduce_sum(mt.ones("a:2,b:3")).item()
        6.0
        >>> mt.reduce_sum(mt.ones("a:2,b:3,c:4"), output_shape=["c", "a"]).shape
        Shape('c:4,a:2')
    """
    return _reduce(x, dims, output_shape, "sum", name)


def reduce_max(x: MeshTensor, dims=None, *, output_shape=None, name=None) -> MeshTensor:
    """Maximum over ``dims``. The gradient goes to the maximal elements, shared evenly among
    ties counted over the whole reduced dims (``torch.amax``'s rule), on every mesh and layout.

    Example:
        >>> import torch, meshtorch as mt
        >>> def f():
        ...     x = mt.from_global(torch.tensor([5.0, 5.0, 5.0, 1.0]), "m:4", requires_grad=True)
        ...     mt.reduce_max(x).backward()
        ...     return [round(g, 3) for g in x.grad.to_global().tolist()]
        >>> mt.launch(f, mesh="p:2", rules="m:p")[0]
        [0.333, 0.333, 0.333, 0.0]
    """
    return _reduce(x, dims, output_shape, "max", name)


def reduce_min(x: MeshTensor, dims=None, *, output_shape=None, name=None) -> MeshTensor:
    """Minimum over ``dims``; the gradient is shared as :func:`reduce_max`'s.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([[3.0, 1.0], [0.0, 2.0]]), "a:2,c:2")
        >>> mt.reduce_min(x, output_shape=["c"]).to_global().tolist()
        [0.0, 1.0]
    """
    return _reduce(x, dims, output_shape, "min", name)


def reduce_any(x: MeshTensor, dims=None, *, output_shape=None, name=None) -> MeshTensor:
    """Whether any element over ``dims`` is true (non-zero), as a bool MeshTensor; a split
    dim costs one small ``all_reduce``. Use it where Python needs a truth value:
    ``if mt.reduce_any(x > 0).item(): ...``.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([[0, 1], [0, 0]]), "a:2,b:2")
        >>> mt.reduce_any(x, "b").to_global().tolist(), mt.reduce_any(x).item()
        ([True, False], True)
    """
    return _truth(x, dims, output_shape, "max", "reduce_any", name)


def reduce_all(x: MeshTensor, dims=None, *, output_shape=None, name=None) -> MeshTensor:
    """Whether every element over ``dims`` is true (non-zero), as a bool MeshTensor.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([[1, 1], [0, 1]]), "a:2,b:2")
        >>> mt.reduce_all(x, "b").to_global().tolist(), mt.reduce_all(x).item()
        ([True, False], False)
    """
    return _truth(x, dims, output_shape, "min", "reduce_all", name)


def _truth(x, dims, output_shape, how: str, op: str, name) -> MeshTensor:
    # collectives reduce numbers, not bools: any/all are max/min of 0/1 flags
    flags = unary(lambda t: (t.detach() != 0).to(torch.int32), as_mesh_tensor(x), op)
    return unary(lambda t: t.bool(), _reduce(flags, dims, output_shape, how, name, op=op), op)


def reduce_mean(x: MeshTensor, dims=None, *, output_shape=None, name=None) -> MeshTensor:
    """Mean over ``dims`` (global count, whatever the layout). A float16/bfloat16 ``x`` is
    summed in float32, as ``torch.mean`` does, and its mean returned in its own dtype; a mean
    over no dims is a floating copy of ``x``.

    Example:
        >>> import torch, meshtorch as mt
        >>> mt.reduce_mean(mt.full("a:4", 2.0)).item()
        2.0
    """
    return _reduce(x, dims, output_shape, "mean", name)


def reduce_logsumexp(x: MeshTensor, dims=None, *, output_shape=None, extra_logit=None,
                     name=None) -> MeshTensor:
    """``log(sum(exp(x)))`` over ``dims``, computed stably across split dims.

    ``extra_logit`` (a number, or a MeshTensor whose dims the result has) adds one more term
    ``exp(extra_logit)`` to the sum, as Mesh-TF's ``extra_logit``: a logit of that value
    that is not in ``x``.

    Example:
        >>> import torch, math, meshtorch as mt
        >>> round(mt.reduce_logsumexp(mt.zeros("a:4")).item(), 6) == round(math.log(4), 6)
        True
        >>> round(mt.reduce_logsumexp(mt.zeros("a:4"), extra_logit=0.0).item(), 6) == round(math.log(5), 6)
        True
    """
    x = as_mesh_tensor(x)
    names = _reduced_names(x, dims, output_shape, "reduce_logsumexp")
    out = x.shape.without(names)
    if isinstance(extra_logit, MeshTensor) and not all(n in out for n in extra_logit.names):
        raise ShapeError(f"reduce_logsumexp: extra_logit has dims [{extra_logit.shape}], but the result "
                         f"has only [{out}]; drop the other dims from extra_logit")
    if names and not any(x.layout.axes_of(n) for n in names):
        # no reduced dim is split (always so on one processor): one fused local kernel
        idx = [x.shape.index(n) for n in names]
        r = lower("reduce_logsumexp", [x], out, lambda view, t: torch.logsumexp(t, idx), whole=names,
                  name=name)
    else:
        # the shift cancels in value and gradient, so it needs no gradient of its own
        m = reduce_max(x.detach(), names)
        finite = MeshTensor(torch.where(torch.isfinite(m.local), m.local, 0.0), m.shape, m.layout)
        r = log(reduce_sum(exp(x - finite), names)) + finite
    r = _in_order(r, x, output_shape)
    return r if extra_logit is None else nary(_logaddexp, r, extra_logit, op="reduce_logsumexp")


def _logaddexp(a: torch.Tensor, b) -> torch.Tensor:
    # a number takes the result's dtype, so a bfloat16 logsumexp stays bfloat16
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype, device=a.device)
    return torch.logaddexp(a, b)


def add_n(xs: Sequence[MeshTensor], name: str | None = None) -> MeshTensor:
    """The sum of the tensors ``xs``, broadcast by dim name as ``+`` does (Mesh-TF's
    ``mtf.add_n``).

    Example:
        >>> import meshtorch as mt
        >>> mt.add_n([mt.ones("a:2"), mt.ones("a:2"), mt.full("b:3", 2.0)]).to_global().tolist()
        [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
    """
    xs = list(xs)
    if not xs:
        raise MeshTorchError("add_n needs at least one tensor")
    out = functools.reduce(add, [as_mesh_tensor(x) for x in xs])
    return MeshTensor(out.local, out.shape, out.layout, name) if name else out


class Reductions:
    """Several reductions whose collectives run together: one ``all_reduce`` per mesh axis,
    reduce op and dtype, instead of one per reduction.

    ``sum``/``mean``/``max``/``min`` take the arguments of :func:`reduce_sum` and friends,
    compute the local part at once and return a handle; :meth:`run` issues the fused
    collectives and returns the results, indexed by the handles. The values are those of
    the reductions run one by one. For many small reductions (an optimizer's statistics),
    where each collective costs its latency rather than its bytes.

    Example:
        >>> import torch, meshtorch as mt
        >>> def f():
        ...     x = mt.from_global(torch.arange(8.0).reshape(4, 2), "batch:4,d:2")
        ...     batch = mt.Reductions()
        ...     total, rows, top = batch.sum(x), batch.mean(x, "batch"), batch.max(x)
        ...     out = batch.run()
        ...     return (out[total].item(), out[rows].to_global().tolist(), out[top].item(),
        ...             mt.comm_stats().calls(kind="all_reduce"))
        >>> mt.launch(f, mesh="b:2", rules="batch:b")[0]   # one sum and one max all_reduce
        (28.0, [3.0, 4.0], 7.0, 2)
    """

    def __init__(self) -> None:
        self._fused = Fused()
        # per handle: (index into the fused results, or the finished value; the output_shape
        # order of the dims kept, if one was given)
        self._entries: list[tuple[int | MeshTensor, list[str] | None]] = []
        self._done = False

    def _add(self, x, dims, output_shape, how: str, name) -> int:
        if self._done:
            raise MeshTorchError("this mt.Reductions has already run; start a new one for more reductions")
        x = as_mesh_tensor(x)
        r = _reduce(x, dims, output_shape, how, name, lower_fn=self._fused.lower)
        self._entries.append((r, _kept_order(x, output_shape)))
        return len(self._entries) - 1

    def sum(self, x: MeshTensor, dims=None, *, output_shape=None, name=None) -> int:
        """Add ``reduce_sum(x, dims)``; returns its index in :meth:`run`'s list."""
        return self._add(x, dims, output_shape, "sum", name)

    def mean(self, x: MeshTensor, dims=None, *, output_shape=None, name=None) -> int:
        """Add ``reduce_mean(x, dims)``; returns its index in :meth:`run`'s list."""
        return self._add(x, dims, output_shape, "mean", name)

    def max(self, x: MeshTensor, dims=None, *, output_shape=None, name=None) -> int:
        """Add ``reduce_max(x, dims)``; returns its index in :meth:`run`'s list."""
        return self._add(x, dims, output_shape, "max", name)

    def min(self, x: MeshTensor, dims=None, *, output_shape=None, name=None) -> int:
        """Add ``reduce_min(x, dims)``; returns its index in :meth:`run`'s list."""
        return self._add(x, dims, output_shape, "min", name)

    def run(self) -> list[MeshTensor]:
        """Run the fused collectives (every processor must call it) and return the results."""
        if self._done:
            raise MeshTorchError("this mt.Reductions has already run; keep the list its run() returned")
        self._done = True
        fused = self._fused.run()
        out = []
        for r, order in self._entries:
            v = fused[r] if isinstance(r, int) else r
            if order is not None and order != v.names:
                v = transpose(v, order)
            out.append(v)
        return out
