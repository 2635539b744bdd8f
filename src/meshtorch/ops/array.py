"""Array ops along a dim: slice, concat, pad, shift, cumsum, range, one_hot, embedding.

``shift`` along a split dim receives the halo it needs from its neighbours (the lowering's
:func:`~meshtorch.lowering.shift.shift_slice`); ``cumsum`` along a split dim adds the totals of
the preceding processors' slices (:func:`~meshtorch.lowering.scan.cumsum_slice`); ``range``,
``one_hot`` and ``embedding`` work on a
split vocabulary without gathering it (each processor handles its range and
partial results are summed).

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.arange(4.0), "t:4")
    >>> mt.shift(x, "t", 1).to_global().tolist()
    [0.0, 0.0, 1.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from meshtorch.context import current, traced, untraced
from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.lower import align, lower
from meshtorch.lowering.scan import cumsum_slice
from meshtorch.lowering.shift import shift_slice
from meshtorch.ops.einsum import einsum
from meshtorch.shape import Dim, Shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def slice(x: MeshTensor, dim: str | Dim, begin: int, size: int, name: str | None = None) -> MeshTensor:  # noqa: A001
    """Elements ``begin .. begin+size-1`` of ``dim`` (the dim keeps its name).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(5.0), "t:5")
        >>> mt.slice(x, "t", 1, 3).to_global().tolist()
        [1.0, 2.0, 3.0]
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "slice")]
    if begin < 0 or size < 0 or begin + size > d.size:
        raise ShapeError(f"slice [{begin}, {begin + size}) is outside dim {d} of [{x.shape}]")
    i = x.shape.index(d.name)
    out = x.shape.replace(d.name, Dim(d.name, size))
    return lower("slice", [x], out, lambda view, t: t.narrow(i, begin, size),
                 whole={d.name}, name=name)


def concat(xs: Sequence[MeshTensor], dim: str | Dim, name: str | None = None) -> MeshTensor:
    """Concatenate along ``dim``; all other dims must agree.

    Example:
        >>> import meshtorch as mt
        >>> mt.concat([mt.ones("t:2"), mt.zeros("t:3")], "t").to_global().tolist()
        [1.0, 1.0, 0.0, 0.0, 0.0]
    """
    xs = [as_mesh_tensor(x) for x in xs]
    if not xs:
        raise ShapeError("concat needs at least one tensor")
    n = dim_name(dim)
    first = xs[0]
    for x in xs[1:]:
        if x.shape.without([n]) != first.shape.without([n]) or x.names != first.names:
            raise ShapeError(
                f"concat along {n!r}: shapes [{first.shape}] and [{x.shape}] differ elsewhere"
            )
    total = sum(x.shape[n].size for x in xs)
    out = first.shape.replace(n, Dim(n, total))
    if isinstance(dim, Dim) and any(x.shape[n].size != dim.size for x in xs):
        dim_name(dim, out, "concat", "the result")  # a Dim is the inputs' dim (all one size) or the result's
    i = first.shape.index(n)
    return lower("concat", xs, out, lambda view, *ts: torch.cat(ts, i), whole={n}, name=name)


def pad(x: MeshTensor, dim: str | Dim, before: int, after: int, value: float = 0.0,
        name: str | None = None) -> MeshTensor:
    """Pad ``dim`` with ``before`` and ``after`` elements of ``value``.

    Example:
        >>> import meshtorch as mt
        >>> mt.pad(mt.ones("t:2"), "t", 1, 2).to_global().tolist()
        [0.0, 1.0, 1.0, 0.0, 0.0]
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "pad")]
    if before < 0 or after < 0:
        raise ShapeError(f"pad of {d.name!r} needs before, after >= 0 (got {before}, {after})")
    i = x.shape.index(d.name)
    out = x.shape.replace(d.name, Dim(d.name, d.size + before + after))
    widths = [0, 0] * (x.shape.ndim - 1 - i) + [before, after]
    return lower("pad", [x], out, lambda view, t: F.pad(t, widths, value=value),
                 whole={d.name}, name=name)


def shift(x: MeshTensor, dim: str | Dim, offset: int, wrap: bool = False,
          name: str | None = None) -> MeshTensor:
    """``out[i] = x[i - offset]`` along ``dim``: zeros shift in at the edge, or
    with ``wrap`` the dim is cyclic. Along a split dim each processor receives
    only the halo it needs from its neighbours (one or two point-to-point
    shifts along the axis); a dim split over several axes, or unevenly, gets its
    halo from the neighbouring pieces too (gathered only when the offset reaches
    past a neighbour's slice).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(4.0), "t:4")
        >>> mt.shift(x, "t", -1, wrap=True).to_global().tolist()
        [1.0, 2.0, 3.0, 0.0]
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "shift")]
    i = x.shape.index(d.name)
    out = shift_slice(x.local, i, x.layout.axes_of(d.name), offset, wrap, d.size)
    return MeshTensor(out, x.shape, x.layout, name)


def one_hot(ids: MeshTensor, dim: Dim, dtype: torch.dtype = torch.float32,
            name: str | None = None, *, on_value: float = 1.0, off_value: float = 0.0) -> MeshTensor:
    """``out[..., v] = on_value if ids[...] == v else off_value`` for ``v`` in ``dim`` (Mesh-TF's
    ``mtf.one_hot``); works on a split ``dim`` without communication. Ids outside ``dim`` give
    ``off_value`` everywhere.

    Example:
        >>> import torch, meshtorch as mt
        >>> ids = mt.from_global(torch.tensor([2, 0]), "batch:2")
        >>> mt.one_hot(ids, mt.Dim("vocab", 3)).to_global().tolist()
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
        >>> mt.one_hot(ids, mt.Dim("vocab", 3), on_value=0.5, off_value=-1.0).to_global().tolist()[0]
        [-1.0, -1.0, 0.5]
    """
    ids = as_mesh_tensor(ids)
    if not isinstance(dim, Dim):
        raise ShapeError(f"one_hot needs a Dim (name and size) for the new dim, got {dim!r}")
    if dim.name in ids.shape:
        raise ShapeError(f"one_hot: ids [{ids.shape}] already have a dim named {dim.name!r}")
    out = ids.shape + [dim]
    plain = on_value == 1.0 and off_value == 0.0

    def local_fn(view, t):
        start, size = view.slices[dim.name]
        rng = torch.arange(start, start + size, device=t.device)
        hit = t.unsqueeze(-1) == rng
        if plain:
            return hit.to(dtype)
        return torch.where(hit, torch.tensor(on_value, dtype=dtype, device=t.device),
                           torch.tensor(off_value, dtype=dtype, device=t.device))

    return lower("one_hot", [ids], out, local_fn, name=name)


def cumsum(x: MeshTensor, dim: str | Dim, exclusive: bool = False, name: str | None = None) -> MeshTensor:
    """Cumulative sum along ``dim`` (``exclusive``: each element leaves itself out, so the first
    is 0), as Mesh-TF's ``mtf.cumsum``. Along a split ``dim`` each processor sums its slice and
    adds the totals of the slices before it: one ``all_gather`` of one element per position
    along ``dim`` over the axes that split it (a ``reduce_scatter`` of as many in backward).

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.arange(1.0, 5.0), "t:4")
        >>> mt.cumsum(x, "t").to_global().tolist(), mt.cumsum(x, "t", exclusive=True).to_global().tolist()
        ([1.0, 3.0, 6.0, 10.0], [0.0, 1.0, 3.0, 6.0])
    """
    x = as_mesh_tensor(x)
    d = x.shape[dim_name(dim, x, "cumsum")]
    out = cumsum_slice(x.local, x.shape.index(d.name), x.layout.axes_of(d.name), exclusive)
    return MeshTensor(out, x.shape, x.layout, name)


def range(dim: Dim, dtype: torch.dtype = torch.int64, name: str | None = None) -> MeshTensor:  # noqa: A001
    """The 1-D tensor ``0, 1, ..., dim.size - 1`` over ``dim`` (Mesh-TF's ``mtf.range``), each
    processor making only its slice.

    Example:
        >>> import meshtorch as mt
        >>> mt.range(mt.Dim("t", 4)).to_global().tolist()
        [0, 1, 2, 3]
    """
    if not isinstance(dim, Dim):
        raise ShapeError(f"range needs a Dim (name and size), got {dim!r}; e.g. mt.range(mt.Dim('t', 8))")

    def local_fn(view):
        start, size = view.slices[dim.name]
        # made on the processor's device: no host copy per call
        return torch.arange(start, start + size, dtype=dtype, device=current().device)

    return lower("range", [], Shape([dim]), local_fn, name=name)


def check_ids(ids: MeshTensor, dim: Dim, op: str, what: str = "ids", ignore: int | None = None) -> None:
    """Raise :class:`~meshtorch.errors.ArgumentError` if an id of ``ids`` (this processor's
    slice) is outside ``0 .. dim.size - 1`` and is not ``ignore``: what torch's own lookups
    raise, where a masked lookup over a split ``dim`` would give zeros silently.

    On the CPU it compares the ids with their clamp in place (the CPU computes synchronously
    anyway) and only a failing check reads the ids' range for the message, so a step reads no
    value into Python (``tests/test_syncs.py`` counts such reads); on an accelerator it is
    torch's assert on a device tensor, asynchronous, so the host never waits for the device
    (a failure surfaces at a later synchronisation, as torch's own index checks do there).
    Under a tracer (``make_fx``, ``torch.compile``) the assert is recorded, as on an accelerator.
    Meta tensors (planning) hold no values and are not checked.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.ops.array import check_ids
        >>> try:
        ...     check_ids(mt.from_global(torch.tensor([3, 9]), "batch:2"), mt.Dim("vocab", 8), "embedding")
        ... except mt.errors.ArgumentError as e:
        ...     print(str(e)[:59])
        embedding: ids hold 9, outside dim 'vocab' of size 8 (0..7)
    """
    t = ids.local
    if t.device.type == "meta" or t.numel() == 0:
        return
    if not traced:  # (no tracer anywhere: no block to hide the check from, and no call for one)
        _check_ids(t, dim, op, what, ignore)
        return
    with untraced():  # a guard, not the program's work: a plan (meta, no values) has no check to price
        _check_ids(t, dim, op, what, ignore)


def ids_read_on_host(t: torch.Tensor) -> bool:
    """Whether the values of ``t`` are read on the host as ops run: a CPU tensor outside any
    tracer (``make_fx``, ``torch.compile``, which cannot read a value). There an indexing op
    that bounds-checks every id (``gather``) raises at once for a bad one, so an op can leave
    :func:`check_ids` to word that failure instead of running it first.

    Example:
        >>> import torch
        >>> from meshtorch.ops.array import ids_read_on_host
        >>> ids_read_on_host(torch.tensor([1])), ids_read_on_host(torch.empty(1, device="meta"))
        (True, False)
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and get_proxy_mode() is None


def _check_ids(t: torch.Tensor, dim: Dim, op: str, what: str, ignore: int | None) -> None:
    if ignore is not None:
        t = torch.where(t == ignore, 0, t)
    # a tracer (make_fx, torch.compile) cannot read a value: it records the assert instead
    if not ids_read_on_host(t):
        ok = ((t >= 0) & (t < dim.size)).all()
        torch._assert_async(ok, f"{op}: {what} outside dim {dim.name!r} of size {dim.size}")
        return
    # on the host, two ops (not the assert's five: each a Python call paid cold after a large
    # kernel, issue 27): ids in range are their own clamp; torch.equal compares in C++ and answers
    # a bool, so no value of a tensor comes back to Python unless the check fails
    if torch.equal(t.clamp(0, dim.size - 1), t):
        return
    lo, hi = (int(v) for v in torch.aminmax(t))
    if lo < 0 or hi >= dim.size:
        skip = f" other than ignore_index={ignore}" if ignore is not None else ""
        raise ArgumentError(
            f"{op}: {what} hold {lo if lo < 0 else hi}, outside dim {dim.name!r} of size {dim.size} "
            f"(0..{dim.size - 1}){skip}; fix the ids or the {dim.name!r} size"
            + ("" if ignore is not None or op != "cross_entropy" else
               ", or pass ignore_index= for targets that take no part in the loss"))


def embedding(table: MeshTensor, ids: MeshTensor, dim: str | Dim, name: str | None = None) -> MeshTensor:
    """Embedding lookup: ``out[ids dims..., other dims] = table[ids[...], ...]`` along
    ``dim``. With ``dim`` split, each processor looks up the ids in its range and
    the partial results are summed (one all_reduce or reduce_scatter). An id outside
    ``dim`` raises :class:`~meshtorch.errors.ArgumentError` (see :func:`check_ids`).
    Dims the ids and the table share (``batch`` of ids ``[batch, k]`` into a table ``[batch,
    length, d]``) are matched, not crossed: row ``ids[b, k]`` of table ``b``, as Mesh-TF's
    ``gather`` (computed as its one-hot einsum).

    Example:
        >>> import torch, meshtorch as mt
        >>> table = mt.from_global(torch.arange(6.0).reshape(3, 2), "vocab:3,d:2")
        >>> ids = mt.from_global(torch.tensor([2, 0]), "batch:2")
        >>> mt.embedding(table, ids, "vocab").to_global().tolist()
        [[4.0, 5.0], [0.0, 1.0]]
    """
    table, ids = as_mesh_tensor(table), as_mesh_tensor(ids)
    v = dim_name(dim, table, "embedding", "the table")
    vi = table.shape.index(v)
    if ids.dtype.is_floating_point:
        raise ShapeError(f"embedding: ids must be integers, got {ids.dtype}; pass integer token ids")
    shared = [n for n in table.names if n in ids.shape]
    if v in shared:
        raise ShapeError(f"embedding: ids [{ids.shape}] have the dim {v!r} they index; name the ids' dim "
                         "otherwise (mt.rename)")
    out = ids.shape + table.shape.without([v, *shared])
    check_ids(ids, table.shape[v], "embedding")
    if shared:
        # a batched gather (ids and table share dims, matched rather than crossed), as Mesh-TF's
        # gather: the one-hot einsum it is written as there (the ids' sizes checked by einsum)
        return einsum(one_hot(ids, table.shape[v], dtype=table.dtype), table, output_shape=out, name=name)
    whole = table.shape[v].size

    def local_fn(view, tab, idx):
        start, size = view.slices[v]
        return _rows(tab, vi, idx, start, size, whole)

    return lower("embedding", [table, ids], out, local_fn, reduced={v: "sum"}, name=name)


def embedding_range(table: MeshTensor, dim: str | Dim, out: Dim, offset: int = 0,
                    name: str | None = None) -> MeshTensor:
    """Rows ``offset .. offset + out.size - 1`` of ``table`` along ``dim``, over the new dim
    ``out``: :func:`embedding` of the ids ``offset + i`` for ``i`` in ``out`` (a learned-position
    lookup), with the same communication and plan, made without the ids.

    Where this processor holds the whole ``dim`` its slice of the result is a slice (a view) of
    the table: the same values and gradient as the lookup, without making, checking and
    indexing the ids (about nine ops a forward, each a Python call paid cold after a large
    kernel, issue 27). Over a split ``dim`` it is :func:`embedding`'s masked lookup.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.ops.array import embedding_range
        >>> table = mt.from_global(torch.arange(8.0).reshape(4, 2), "positions:4,d:2")
        >>> embedding_range(table, "positions", mt.Dim("length", 2), offset=1).to_global().tolist()
        [[2.0, 3.0], [4.0, 5.0]]
    """
    table = as_mesh_tensor(table)
    v, vi, whole = _row_range(table, dim, out, offset, "embedding_range")

    def local_fn(view, tab):
        start, size = view.slices[out.name]
        first = offset + start
        vstart, vsize = view.slices[v]
        if vstart == 0 and vsize == whole:  # this processor's rows, as a view of the table
            rows = tab.narrow(vi, first, size)
            return rows.movedim(vi, 0) if vi else rows
        idx = torch.arange(first, first + size, device=tab.device)
        return _rows(tab, vi, idx, vstart, vsize, whole)

    shape = table.shape.derived(("embedding_range", v, out), lambda: Shape([out]) + table.shape.without([v]))
    return lower("embedding", [table], shape, local_fn, reduced={v: "sum"}, name=name)


def add_rows(x: MeshTensor, table: MeshTensor, dim: str | Dim, out: Dim, offset: int = 0,
             name: str | None = None) -> MeshTensor:
    """``x + embedding_range(table, dim, out, offset)`` (learned positions added to token vectors)
    as one op where ``table`` holds the whole ``dim``: each processor adds its rows of the table
    (a view) to its slice of ``x``. The table then is an input of an op that varies along ``x``'s
    split dims, so inside ``mt.overlap()`` its gradient is summed in the parameters' buckets with
    the others, not by an all_reduce of its own in backward; and a forward runs one op less.
    Elsewhere (a split ``dim``; dims or a dtype of ``x`` that differ from the rows') it is that
    sum of two ops. The values are the sum's, bitwise.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.ops.array import add_rows
        >>> table = mt.from_global(torch.arange(8.0).reshape(4, 2), "positions:4,d:2")
        >>> x = mt.ones("batch:2,length:2,d:2")
        >>> add_rows(x, table, "positions", mt.Dim("length", 2), offset=1).to_global()[0].tolist()
        [[3.0, 4.0], [5.0, 6.0]]
    """
    x, table = as_mesh_tensor(x), as_mesh_tensor(table)
    v, vi, _ = _row_range(table, dim, out, offset, "add_rows")
    xs = x.shape
    if (table.layout.axes_of(v) or x.dtype != table.dtype or out.name not in xs or xs[out.name] != out
            or any(n not in xs or xs[n] != d for n, d in zip(table.names, table.dims) if n != v)):
        return x + embedding_range(table, dim, out, offset, name)
    names = (out.name,) + tuple(n for n in table.names if n != v)

    def local_fn(view, xl, tab):
        start, size = view.slices[out.name]
        r = tab.narrow(vi, offset + start, size)
        return xl + align(r.movedim(vi, 0) if vi else r, names, x.names)

    return lower("add_rows", [x, table], xs, local_fn, reduced={v: "sum"}, name=name)


def _row_range(table: MeshTensor, dim: str | Dim, out: Dim, offset: int, op: str) -> tuple[str, int, int]:
    """``(name, index, size)`` of ``table``'s dim ``dim``, whose rows ``offset ..`` make the new
    dim ``out`` (checked)."""
    v = dim_name(dim, table, op, "the table")
    if not isinstance(out, Dim):
        raise ShapeError(f"{op} needs a Dim (name and size) for the new dim, got {out!r}")
    if out.name in table.shape:
        raise ShapeError(f"{op}: table [{table.shape}] already has a dim named {out.name!r}")
    vi = table.shape.index(v)
    whole = table.shape[v].size
    if offset < 0 or offset + out.size > whole:
        raise ArgumentError(f"{op}: rows {offset}..{offset + out.size - 1} are outside dim "
                            f"{v!r} of size {whole} (0..{whole - 1}); pass fewer rows or a larger {v!r}")
    return v, vi, whole


def _rows(tab: torch.Tensor, vi: int, idx: torch.Tensor, start: int, size: int, whole: int) -> torch.Tensor:
    """Rows ``idx`` (ids in range) of the local table ``tab`` holding ``start .. start + size - 1``
    of its dim ``vi`` (of size ``whole``), that dim moved to the front; ids another processor's
    slice holds give zeros."""
    if start == 0 and size == whole:
        # the whole table here and every id in range (check_ids): the clamp, the hit test and
        # the mask multiply would change nothing; skipping them saves three ops, a [ids, d]
        # multiply and its autograd node (on one processor, every step)
        return tab.movedim(vi, 0)[idx] if vi else tab[idx]
    if size == 0:  # an uneven split leaves this processor no rows: every id is another's
        rows = tab.movedim(vi, 0) if vi else tab
        # (a sum over the empty rows: zeros that keep the table in the graph, for the reduction's backward)
        return rows.sum(0).expand(idx.shape + rows.shape[1:])
    rel = idx - start if start else idx  # (each skipped no-op is an autograd node less)
    safe = rel.clamp(0, size - 1)
    hit = safe == rel  # ids outside this slice's range pick zeros: another slice holds their rows
    rows = (tab.movedim(vi, 0) if vi else tab)[safe]
    mask = hit.reshape(hit.shape + (1,) * (rows.dim() - hit.dim()))
    return rows * mask  # (the bool mask promotes to rows' dtype inside the kernel)
