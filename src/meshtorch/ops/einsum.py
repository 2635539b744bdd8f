"""``einsum`` over named dims, and ``matmul``.

Dims are matched by name: the equation ``"batch d_model, d_model d_ff -> batch
d_ff"`` names each operand's dims (in any order) and the output's. Dims that
appear in an input but not in the output are summed over. With
``output_shape=`` instead of an equation, the output's dims are given and
every other dim is contracted. An output dim that no operand has (given as a ``Dim``, with its
size) is broadcast, as in Mesh-TF. Operands of different dtypes are promoted as elementwise ops
and ``torch.result_type`` promote them (a float64 input to a float32 ``Dense`` gives float64),
except under autocast, which chooses the matmul's dtype itself.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.ones(2, 3), "batch:2,d:3")
    >>> w = mt.from_global(torch.ones(3, 4), "d:3,h:4")
    >>> mt.einsum("batch d, d h -> batch h", x, w).to_global()[0].tolist()
    [3.0, 3.0, 3.0, 3.0]
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Iterable

import torch

from meshtorch.caching import BoundedCache
from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.lower import align, is_dynamo_compiling, lower, resolved
from meshtorch.meta_autocast import autocast_enabled
from meshtorch.ops.elementwise import broadcast_shape, cast
from meshtorch.shape import Dim, Shape, as_shape, dim_name
from meshtorch.tensor import MeshTensor


def _parse(equation: str, xs: tuple[MeshTensor, ...]) -> list[str]:
    lhs, arrow, rhs = equation.partition("->")
    if not arrow:
        raise ShapeError(f"einsum equation {equation!r} has no '->'; write 'a b, b c -> a c'")
    parts = [p.split() for p in lhs.split(",")]
    if len(parts) != len(xs):
        raise ShapeError(f"einsum {equation!r} names {len(parts)} operands but got {len(xs)}")
    for i, (names, x) in enumerate(zip(parts, xs)):
        if sorted(names) != sorted(x.names):
            raise ShapeError(
                f"einsum {equation!r}: operand {i} is named '{' '.join(names)}' but its shape is "
                f"[{x.shape}]; name exactly its dims"
            )
    return rhs.split()


def einsum(
    equation: str | MeshTensor,
    *xs: MeshTensor,
    output_shape: Shape | str | Iterable[Dim | str] | None = None,
    name: str | None = None,
) -> MeshTensor:
    """Generalised contraction of MeshTensors by dim name.

    Args:
        equation: ``"a b, b c -> a c"`` (names, space separated), or omit it and
            pass the first operand here with ``output_shape=``.
        output_shape: the output's dims (``Dim``s or names of operand dims).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,b:3")
        >>> mt.einsum(x, output_shape=["b"]).to_global().tolist()
        [3.0, 5.0, 7.0]
        >>> mt.einsum(x, output_shape=["b", mt.Dim("c", 2)]).to_global().tolist()  # broadcast
        [[3.0, 3.0], [5.0, 5.0], [7.0, 7.0]]
    """
    by_equation = isinstance(equation, str)
    if by_equation and output_shape is not None:
        # both: the equation names the operands' dims, output_shape= gives the result's sizes (a
        # dim no operand has); they must name the same output dims, else one would be ignored
        _check_operands(xs)
        named = _parse(equation, xs)
        spec = output_shape if isinstance(output_shape, (Shape, str)) else tuple(output_shape)
        given = list(as_shape(spec).names) if isinstance(spec, str) else [dim_name(d) for d in spec]
        if named != given:
            raise ArgumentError(
                f"einsum {equation!r} names the output dims {named}, but output_shape= names {given}; "
                "make them agree, or pass only one of them")
        by_equation = False
    elif by_equation:
        spec = equation
    else:  # the first operand: checked with the others below
        xs = (equation,) + xs
        if output_shape is None:
            raise ShapeError("einsum without an equation needs output_shape=")
        spec = output_shape if isinstance(output_shape, (Shape, str)) else tuple(output_shape)
    _check_operands(xs)
    compiled = is_dynamo_compiling()
    if compiled:  # planned outside the trace, from the shapes' names and sizes
        out, local_fn, reduced = resolved(
            _einsum_of_constants, tuple([(x.shape.names, x.shape.sizes) for x in xs]),
            _spec_constant(spec), by_equation)
    else:
        out, local_fn, reduced = _einsum_plan(xs, spec, by_equation)
    return lower("einsum", _promoted(xs), out, local_fn, reduced=reduced, name=name, compiled=compiled)


def _check_operands(xs: tuple) -> None:
    """Raise a ShapeError naming the first operand of ``xs`` that is not a MeshTensor."""
    for i, x in enumerate(xs):  # (a loop, not a generator: einsum runs once per layer)
        if not isinstance(x, MeshTensor):
            raise ShapeError(
                f"einsum operand {i} is a {type(x).__name__}, not a MeshTensor; pass a "
                f"MeshParameter's .mesh_tensor, and wrap a torch tensor with mt.from_global(t, shape)")


def _einsum_plan(xs: tuple, spec: str | Shape | tuple, by_equation: bool
                 ) -> tuple[Shape, Callable, dict[str, str]]:
    # the plan (and the checks made when building it) depends only on the operand shapes and
    # the equation or output dims, so they are the key
    # the shapes by their names and sizes (equal exactly when the shapes are), which hash in C
    if len(xs) == 2:  # (a Dense, an attention product: no comprehension's frame)
        a, b = xs[0].shape, xs[1].shape
        key = (((a.names, a.sizes), (b.names, b.sizes)), spec)
    else:
        key = (tuple([(x.shape.names, x.shape.sizes) for x in xs]), spec)
    plan = _PLANS.get(key)
    if plan is None:
        if by_equation:
            out_dims = _parse(spec, xs)
        else:
            out_dims = list(spec.dims if isinstance(spec, Shape) else as_shape(spec).dims
                            if isinstance(spec, str) else spec)
        plan = _PLANS.put(key, _broadcast_plan(xs, out_dims))
    return plan


class _Operand:
    """What einsum's planner reads of an operand, rebuilt from a compiled program's constants."""

    __slots__ = ("shape", "names")

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...]):
        self.shape = Shape(zip(names, sizes))
        self.names = names


def _spec_constant(spec: str | Shape | tuple) -> tuple:
    """``spec`` as constants (strings, numbers, tuples), for :func:`_einsum_of_constants`."""
    if isinstance(spec, str):
        return ("str", spec)
    if isinstance(spec, Shape):
        return ("shape", spec.names, spec.sizes)
    return ("dims", tuple([("dim", d.name, d.size) if isinstance(d, Dim) else d for d in spec]))


def _einsum_of_constants(shapes: tuple, spec: tuple, by_equation: bool
                         ) -> tuple[Shape, Callable, dict[str, str]]:
    if spec[0] == "str":
        out = spec[1]
    elif spec[0] == "shape":
        out = Shape(zip(spec[1], spec[2]))
    else:
        out = tuple([Dim(d[1], d[2]) if isinstance(d, tuple) and d[:1] == ("dim",) else d
                     for d in spec[1]])
    return _einsum_plan(tuple([_Operand(*s) for s in shapes]), out, by_equation)


def _promoted(xs: tuple[MeshTensor, ...]) -> tuple[MeshTensor, ...]:
    """The operands in one dtype, ``torch.promote_types`` of theirs, as elementwise ops promote
    (torch's matmuls refuse mixed dtypes). Autocast chooses the matmul's dtype itself."""
    first = xs[0].local.dtype
    for x in xs:  # (a loop, not all() of a generator: no Python frame per operand)
        if x.local.dtype != first:
            break
    else:
        return xs
    if autocast_enabled(xs[0].local.device.type):
        return xs
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in xs])
    return tuple(x if x.dtype == dtype else cast(x, dtype) for x in xs)


# A model calls einsum with the same few shapes every step: the output shape, equation and
# reduced dims are a pure function of the operand shapes and output names, so they are
# computed once (the Python of building them was a large part of einsum's cost on one processor).
# ``lower`` only reads the reduced dict, so the cached one is passed as it is.
_PLANS = BoundedCache(4096)


def _tensordot_dims(xs: tuple[MeshTensor, ...], out_names: list[str]) -> tuple[list[int], list[int]] | None:
    """For ``x · w`` contracting exactly the dims they share, with the output ``x``'s other dims
    then ``w``'s (every Dense layer): the contracted positions for ``torch.tensordot``, which
    runs one matmul on reshaped views, where einsum adds permutes, copies and autograd nodes."""
    if len(xs) != 2:
        return None
    a, b = xs[0].names, xs[1].names
    shared = [n for n in a if n in b]
    if not shared or [n for n in a if n not in shared] + [n for n in b if n not in shared] != out_names:
        return None
    return [a.index(n) for n in shared], [b.index(n) for n in shared]


def _broadcast_plan(xs: tuple[MeshTensor, ...], out_dims: list[Dim | str]
                    ) -> tuple[Shape, Callable, dict[str, str]]:
    """:func:`_plan`, where output dims that no operand has (given as ``Dim`` objects, so their size is known)
    are broadcast: the contraction over the others, repeated over them, as Mesh-TF's einsum."""
    every = broadcast_shape(*(x.shape for x in xs))
    new = []
    for d in out_dims:
        if isinstance(d, Dim):  # an operand's dim: its size too
            for i, x in enumerate(xs):
                dim_name(d, x, "einsum", f"operand {i}")
        n = dim_name(d)
        if n in every.names:
            continue
        if not isinstance(d, Dim):
            raise ShapeError(
                f"einsum output dim {n!r} is in no operand ({[str(x.shape) for x in xs]}); to "
                f"broadcast over it, give its size: output_shape=[..., mt.Dim({n!r}, size)]"
            )
        new.append(d)
    out_names = [dim_name(d) for d in out_dims]
    if not new:
        return _plan(xs, out_names)
    core_names = [n for n in out_names if n in every.names]
    core, core_fn, reduced = _plan(xs, core_names)
    out = Shape([every[n] if n in every.names else d for n, d in zip(out_names, out_dims)])
    out_names_t = tuple(out_names)

    def local_fn(view, *ls):
        y = align(core_fn(view, *ls), core_names, out_names_t)
        return y.expand([view.size(n) for n in out_names_t])

    return out, local_fn, reduced


def _plan(xs: tuple[MeshTensor, ...], out_names: list[str]) -> tuple[Shape, Callable, dict[str, str]]:
    every = broadcast_shape(*(x.shape for x in xs))
    for n in out_names:
        if n not in every.names:
            raise ShapeError(f"einsum output dim {n!r} is in no operand ({[str(x.shape) for x in xs]})")
    out = Shape([every[n] for n in out_names])
    letters = dict(zip(every.names, string.ascii_letters))
    if len(every) > len(string.ascii_letters):
        raise ShapeError("einsum supports at most 52 distinct dims")
    spec = ",".join("".join(letters[n] for n in x.names) for x in xs)
    spec += "->" + "".join(letters[n] for n in out_names)
    reduced = {n: "sum" for n in every.names if n not in out_names}
    dot = _tensordot_dims(xs, out_names)
    if dot is not None:
        ia, ib = dot
        k, na, nb = len(ia), len(xs[0].names), len(xs[1].names)
        x_trailing = ia == list(range(na - k, na))
        w_leading, w_trailing = ib == list(range(k)), ib == list(range(nb - k, nb))
        # the local slices have the operands' dims, in their order: their ranks are na and nb
        # (asked here once, not per call with .dim(): each call into C runs cold, issue 27)
        x_flat, w_flat = na == 2 and k == 1, nb == 2 and k == 1
        # w's contracted dims or its free ones (not both) several, x with dims besides the contracted
        one_side = na > k and nb > k and (k == 1) != (nb - k == 1)

        def local_dot(view, x, w):
            # the layouts PyTorch code would use need no permute at all: x @ W (Dense), x @ Tᵀ (tied
            # output layer); the local slices keep the shape's dim order, so this holds on any mesh
            if x_trailing and (w_leading or w_trailing):
                if w_flat:
                    # x @ W (or x @ Tᵀ) as one call into torch: matmul folds x's leading dims into
                    # the same mm (a view of x, an _unsafe_view of the result) in C++; spelling
                    # the reshape, mm and view out here cost three Python-to-torch calls and a
                    # torch.Size per layer, which run cold between large kernels (issue 27)
                    return torch.matmul(x, w if w_leading else w.t())
                if one_side and (w.requires_grad or x.is_contiguous()):
                    # contracted or free dims of w several, not both (attention's projections:
                    # [d] x [d, heads, kv] and [heads, kv] x [heads, kv, d]): one flatten of w
                    # (and of x's contracted dims), then torch.matmul, whose fold is the mm
                    # below on the same operands (it folds whenever w needs a gradient, and for
                    # a contiguous x): the same values in two to three calls into torch, where
                    # the mm path makes five (issue 25: 48 of them a 124M forward)
                    if k == 1:
                        if w_leading:
                            return torch.matmul(x, w.flatten(1)).view(*x.shape[:-1], *w.shape[1:])
                        return torch.matmul(x, w.flatten(0, -2).t()).view(*x.shape[:-1], *w.shape[:-1])
                    return torch.matmul(x.flatten(na - k), w.flatten(0, k - 1) if w_leading
                                        else w.flatten(1).t())
                # one mm on [rows, k] x [k, n], reshaping (viewing, where the slices allow) only
                # what is not 2-D already: the mm that torch.matmul folds x @ W into. Sizes are
                # spelled out, never -1: an uneven split leaves some processors an empty piece of
                # a contracted dim, and reshape cannot infer -1 beside a 0
                if w_leading:
                    size_k, out = math.prod(w.shape[:k]), (*x.shape[: na - k], *w.shape[k:])
                    w2 = w if w_flat else w.reshape(size_k, math.prod(w.shape[k:]))
                else:
                    size_k, out = math.prod(w.shape[nb - k:]), (*x.shape[: na - k], *w.shape[: nb - k])
                    w2 = (w if w_flat else w.reshape(math.prod(w.shape[: nb - k]), size_k)).t()
                y = torch.mm(x if x_flat else x.reshape(math.prod(x.shape[: na - k]), size_k), w2)
                return y if y.shape == out else y.view(out)
            return torch.tensordot(x, w, dims=dot)

        return out, local_dot, reduced
    bmm = _bmm_dims(xs, out_names)
    if bmm is not None:
        return out, _local_bmm(spec, *bmm), reduced
    return out, lambda view, *ls: torch.einsum(spec, *ls), reduced


def _bmm_dims(xs: tuple[MeshTensor, ...], out_names: list[str]):
    """For two operands whose every dim is either shared with the other (batch if in the
    output, else contracted) or in the output (attention's scores and context): the permutations
    that bring ``x`` to [batch, x's free, contracted] and ``w`` to [batch, contracted, w's free],
    the output permutation from [batch, x's free, w's free], and the group sizes."""
    if len(xs) != 2:
        return None
    a, b = xs[0].names, xs[1].names
    if any(n not in b and n not in out_names for n in a) or any(n not in a and n not in out_names for n in b):
        return None  # a dim summed within one operand: torch.einsum
    batch = [n for n in out_names if n in a and n in b]
    free_a = [n for n in out_names if n in a and n not in b]
    free_b = [n for n in out_names if n in b and n not in a]
    contracted = [n for n in a if n in b and n not in out_names]
    if not contracted:
        return None
    pa = tuple(a.index(n) for n in batch + free_a + contracted)
    pb = tuple(b.index(n) for n in batch + contracted + free_b)
    natural = batch + free_a + free_b
    po = tuple(natural.index(n) for n in out_names)
    ident = tuple(range(len(a))), tuple(range(len(b))), tuple(range(len(out_names)))
    return (None if pa == ident[0] else pa, None if pb == ident[1] else pb,
            None if po == ident[2] else po, len(batch), len(free_a), len(contracted))


def _local_bmm(spec, pa, pb, po, nb, nfa, nc):
    def local_bmm(view, x, w):
        # one bmm on [batch, m, k] x [batch, k, n], as PyTorch attention code does it (q @ kᵀ,
        # a @ v): torch.einsum reaches the same bmm through more permutes, unsqueezes and views
        x = x.permute(pa) if pa is not None else x
        w = w.permute(pb) if pb is not None else w
        bs, ms, ns = x.shape[:nb], x.shape[nb:nb + nfa], w.shape[nb + nc:]
        # sizes spelt out, not -1: an empty piece of an uneven split leaves -1 ambiguous
        ks = math.prod(x.shape[nb + nfa:])
        y = torch.bmm(x.reshape(math.prod(bs), math.prod(ms), ks),
                      w.reshape(math.prod(bs), ks, math.prod(ns)))
        y = y.view(*bs, *ms, *ns)
        return y.permute(po) if po is not None else y

    return local_bmm


def matmul(x: MeshTensor, y: MeshTensor, output_shape=None, name: str | None = None) -> MeshTensor:
    """Contract the dims ``x`` and ``y`` share (or as ``output_shape`` says).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.ones(2, 3), "a:2,b:3")
        >>> y = mt.from_global(torch.ones(3), "b:3")
        >>> mt.matmul(x, y).to_global().tolist()
        [3.0, 3.0]
    """
    if output_shape is None:
        shared = set(x.names) & set(y.names)
        output_shape = [n for n in broadcast_shape(x.shape, y.shape).names if n not in shared]
    return einsum(x, y, output_shape=output_shape, name=name)
