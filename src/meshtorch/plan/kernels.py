"""What an aten op is as a GPU kernel: its bytes moved, matmul shape, launches and host syncs.

The tracer (:mod:`meshtorch.plan.tracing`) describes each counted aten op by a
:data:`Kernel` key and counts the keys; :func:`roofline_seconds` prices them on a
device spec with kernel numbers (``launch_seconds > 0``). Per op:

- bytes = the tensors it reads (its inputs, each once; a broadcast input by its distinct
  elements) plus those it writes (its outputs, and the inputs it mutates in place);
  ``copy_``/``fill_``/``zero_`` and the random fills only write their target; ``gather``,
  ``index`` and ``embedding`` read only the rows they pick (as many bytes as they write);
- ``scatter_``, ``scatter_add_``, ``index_put_`` and the like, in place, read their index and values
  and write as many elements of their target;
- views and metadata ops (``view``, ``t``, ``expand``, ``detach``...), ``empty`` and ops
  on host tensors launch nothing and move nothing (their host time still counts);
- ``_local_scalar_dense`` (``.item()``) of a device tensor is a host sync;
- a ``_foreach_`` or fused optimizer op launches one kernel per chunk of its tensor lists
  (torch's ``multi_tensor_apply``: at most 48 tensors or 320 blocks of 65,536 elements); a fused
  AdamW reads parameters, gradients and both moments and writes parameters and moments.

Example:
    >>> import torch
    >>> from meshtorch.plan.kernels import kernel_of
    >>> a, b = torch.empty(64, 32, device="meta"), torch.empty(32, 16, device="meta")
    >>> out = torch.ops.aten.mm.default(a, b)
    >>> kernel_of(torch.ops.aten.mm.default, (a, b), {}, out, 2 * 64 * 32 * 16, "float32")
    ('mm', 'float32', 65536, 14336, (1, 64, 16, 32), 1, 0)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshtorch.plan.shape_memo import tensors_in

# (aten name, dtype, FLOPs, bytes read + written, shape, kernel launches, host syncs); shape is
# (batch, M, N, K) of a matmul, (1,) / (0,) for fused attention with / without a causal mask, ()
Kernel = tuple[str, str, int, int, tuple[int, ...], int, int]

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul"})
ATTENTION = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward"})
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                       "_record_function_enter_new", "_record_function_exit", "lift_fresh",
                       "resize_", "set_", "sym_size", "sym_stride", "sym_numel", "is_same_size",
                       # a view its schema does not mark (a matmul's result reshaped): aliases, copies nothing
                       "_unsafe_view"})
WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_",
                        "exponential_"})
PICKS = frozenset({"gather", "index", "index_select", "embedding"})
# in place at the positions an index names: they read the index and the values and write as many
# elements of their target, not the whole target (a loss's "minus one at the target" of a chunk)
PUTS = frozenset({"scatter_", "scatter_add_", "scatter_reduce_", "index_put_", "index_add_", "index_copy_"})
# of those, the ones that read the target elements they update (read, combine, write)
ACCUMULATING_PUTS = frozenset({"scatter_add_", "scatter_reduce_", "index_add_"})
FUSED_OPTIMIZERS = frozenset({"_fused_adam_", "_fused_adamw_"})
_LIST_TENSORS, _LIST_ELEMENTS = 48, 320 * 65536   # multi_tensor_apply's chunking

_schema_info: dict[Any, tuple[bool, tuple[int, ...], tuple[str, ...]]] = {}


def _info(func) -> tuple[bool, tuple[int, ...], tuple[str, ...]]:
    """(is a view, positions of the arguments it writes, argument names), once per overload."""
    got = _schema_info.get(func)
    if got is None:
        schema = func._schema
        view = getattr(func, "is_view", None)
        if view is None:   # older torch: a view returns an alias of an argument it does not write
            view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        written = tuple(i for i, a in enumerate(schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
        got = (bool(view), written, tuple(a.name for a in schema.arguments))
        _schema_info[func] = got
    return got


def footprint(t: torch.Tensor) -> int:
    """Bytes of ``t``'s distinct elements (a broadcast dimension, stride 0, counts once)."""
    try:
        strides = t.stride()
    except RuntimeError:   # a layout without strides (sparse, nested): its elements
        return t.numel() * t.element_size()
    if 0 not in strides:
        return t.numel() * t.element_size()
    return math.prod(s for s, st in zip(t.shape, strides) if st != 0) * t.element_size()


def _unique(ts) -> list[torch.Tensor]:
    return list({id(t): t for t in ts}.values())


def kernel_of(func, args: tuple, kwargs: dict, out: Any, flops: int, dtype: str) -> Kernel:
    """The :data:`Kernel` key of one aten op ``func(*args, **kwargs) -> out`` with ``flops``."""
    name = func._overloadpacket.__name__
    view, written, names = _info(func)
    if view or name in NO_KERNEL:
        return (name, dtype, 0, 0, (), 0, 0)
    ins = _unique(tensors_in((args, kwargs)))
    if name == "_local_scalar_dense":
        return (name, dtype, 0, 0, (), 0, int(any(t.device.type != "cpu" for t in ins)))
    seen = {id(t) for t in ins}
    outs = [t for t in _unique(tensors_in(out)) if id(t) not in seen]
    if all(t.device.type == "cpu" for t in ins + outs):
        return (name, dtype, 0, 0, (), 0, 0)
    if name in FUSED_OPTIMIZERS and (kwargs.get("grad_scale") is None):
        # the schema marks the gradients written: only an unscale (grad_scale) writes them
        written = tuple(i for i in written if names[i] != "grads")
    targets = [t for i in written if i < len(args) for t in tensors_in(args[i])]
    if name in WRITE_ONLY:
        read = [t for t in ins if all(t is not w for w in targets)]
    elif name in PICKS:   # the picked rows: as many bytes as written, and the indices
        read = [t for t in ins if not t.is_floating_point()]
        read_bytes = sum(footprint(t) for t in read) + sum(footprint(t) for t in outs)
        return (name, dtype, flops, read_bytes + sum(footprint(t) for t in outs), (), 1, 0)
    elif name in PUTS and targets:
        read = [t for t in ins if all(t is not w for w in targets)]
        try:  # index_put_'s indices and values broadcast to the positions written
            elements = math.prod(torch.broadcast_shapes(*(t.shape for t in read)))
        except RuntimeError:  # index_add_/index_copy_: an index along one dim of the source
            elements = max(t.numel() for t in read)
        written = elements * targets[0].element_size()
        accumulates = name in ACCUMULATING_PUTS or (name == "index_put_" and bool(
            kwargs.get("accumulate", len(args) > 3 and args[3])))
        return (name, dtype, flops, sum(footprint(t) for t in read) + written * (2 if accumulates else 1),
                (), 1, 0)
    else:
        read = ins
    nbytes = sum(footprint(t) for t in read) + sum(footprint(t) for t in (*targets, *outs))
    shape: tuple[int, ...] = ()
    kernels = 1
    if name in MATMULS and flops:
        a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]
        shape = (math.prod(a.shape[:-2]), a.shape[-2], b.shape[-1], a.shape[-1])
    elif name in ATTENTION:
        bound = dict(zip(names, args)) | kwargs
        shape = (int(bool(bound.get("is_causal", False))),)
    elif name.startswith("_foreach_") or name.startswith("_fused_"):
        lists = [a for a in args if isinstance(a, (list, tuple))]
        longest = max((len(a) for a in lists), default=1)
        elements = sum(t.numel() for t in tensors_in(lists[0])) if lists else 0
        kernels = max(1, math.ceil(longest / _LIST_TENSORS), math.ceil(elements / _LIST_ELEMENTS))
    return (name, dtype, flops, nbytes, shape, kernels, 0)


def matmul_efficiency(m: int, n: int, k: int, knee: float) -> float:
    """The fraction of a device's best matmul rate a ``[m, k] @ [k, n]`` product reaches:
    ``x / (x + knee)`` for each of ``m, n, k`` (small dimensions leave tensor cores idle and
    tiles half full; ``knee`` is where a dimension alone costs half the rate).

    Example:
        >>> from meshtorch.plan.kernels import matmul_efficiency
        >>> matmul_efficiency(4096, 4096, 4096, 0.0), round(matmul_efficiency(64, 2 ** 40, 2 ** 40, 64), 6)
        (1.0, 0.5)
    """
    return (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee)) if knee else 1.0


# one op of a traced sequence: its kernel, and the (storage serial, bytes) it reads and writes
SequenceOp = tuple[Kernel, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]


def _no_kernel(k: Kernel) -> bool:
    """A view, a detach, ...: no kernel and no sync (it holds nothing up); not a host read
    (``.item()``, a graph break even where no device waits for it)."""
    return k[5] == 0 and k[6] == 0 and k[0] != "_local_scalar_dense"


def _fusible(k: Kernel) -> bool:
    name = k[0]
    return (k[5] == 1 and not k[2] and k[3] > 0 and name not in ATTENTION
            and not name.startswith(("_foreach_", "_fused_")))


def fusible_runs(sequence: list[SequenceOp], backward: list[bool] | None = None) -> list[tuple[int, int]]:
    """The ``[start, end)`` op ranges of ``sequence`` that ``torch.compile`` fuses into one kernel
    each: the maximal runs of consecutive memory-bound ops (:func:`fuse_elementwise`); ops that
    launch no kernel (views, ``detach``) between two of them do not end a run. ``backward``
    (whether each op ran in autograd's backward) ends a run where the backward begins: the forward
    and the backward are two compiled graphs.

    Example:
        >>> from meshtorch.plan.kernels import fusible_runs
        >>> mul, mm = ("mul", "float32", 0, 12, (), 1, 0), ("mm", "float32", 8, 12, (1, 1, 1, 1), 1, 0)
        >>> view = ("view", "float32", 0, 0, (), 0, 0)
        >>> fusible_runs([(mul, (), ()), (view, (), ()), (mul, (), ()), (mm, (), ()), (mul, (), ())])
        [(0, 3), (4, 5)]
        >>> fusible_runs([(mul, (), ()), (mul, (), ())], backward=[False, True])
        [(0, 1), (1, 2)]
    """
    runs, i = [], 0
    while i < len(sequence):
        if not _fusible(sequence[i][0]):
            i += 1
            continue
        j = end = i + 1
        # a view (or a detach) between them launches nothing and does not end the run
        while j < len(sequence) and (_fusible(sequence[j][0]) or _no_kernel(sequence[j][0])) and (
                backward is None or backward[j] == backward[i]):
            j += 1
            if _fusible(sequence[j - 1][0]):
                end = j
        runs.append((i, end))
        i = end
    return runs


def fuse_elementwise(sequence: list[SequenceOp], backward: list[bool] | None = None) -> dict[Kernel, int]:
    """The kernels of a compiled step (``torch.compile``'s inductor): each maximal run of
    consecutive memory-bound ops (no matmul, attention, tensor-list op or sync between) is one
    ``fused`` kernel that reads what the run did not make itself and writes what is read after
    it, is never read (a result) or was there before it (an update in place); the other ops
    stay as they are. ``backward``: as :func:`fusible_runs` takes it (no run spans the two graphs).

    Example:
        >>> from meshtorch.plan.kernels import fuse_elementwise
        >>> mul = ("mul", "float32", 0, 12, (), 1, 0)
        >>> x, y, z = (1, 4), (2, 4), (3, 4)          # storages 1-3 of 4 bytes
        >>> fuse_elementwise([(mul, (x,), (y,)), (mul, (y,), (z,)), (("sum",) + mul[1:], (z,), ((4, 4),))])
        {('fused', 'float32', 0, 8, (), 1, 0): 1}
    """
    last_read: dict[int, int] = {}
    made_at: dict[int, int] = {}
    for i, (_, reads, writes) in enumerate(sequence):
        for serial, _ in reads:
            last_read[serial] = i
        for serial, _ in writes:
            made_at.setdefault(serial, i)
    out: dict[Kernel, int] = {}
    runs = dict(fusible_runs(sequence, backward))
    i = 0
    while i < len(sequence):
        key = sequence[i][0]
        if i not in runs:
            out[key] = out.get(key, 0) + 1
            i += 1
            continue
        j = runs[i]
        read: dict[int, int] = {}
        written: dict[int, int] = {}
        for _, reads, writes in sequence[i:j]:
            for serial, b in reads:
                if serial not in written:
                    read[serial] = max(read.get(serial, 0), b)
            for serial, b in writes:
                written[serial] = max(written.get(serial, 0), b)
        # written out: what is read after the run, never read (a result), or was there before
        kept = sum(b for serial, b in written.items()
                   if not i <= last_read.get(serial, -1) < j or made_at.get(serial, i) < i)
        fused: Kernel = ("fused", key[1], 0, sum(read.values()) + kept, (), 1, 0)
        out[fused] = out.get(fused, 0) + 1
        i = j
    return out


TERMS = ("matmul", "attention", "memory", "launch", "device", "host", "sync", "step")


def roofline_seconds(kernels: dict[Kernel, float], aten_ops: float, spec) -> dict[str, float]:
    """The step's seconds on ``spec`` (a :class:`~meshtorch.plan.devices.DeviceSpec` with
    kernel numbers) by term: ``matmul``, ``attention`` and ``memory`` are the device time of
    the ops their roofline puts there (each op takes max(FLOPs / its rate, bytes / the
    achievable bandwidth)), ``launch`` the kernels' fixed cost, ``device`` their sum, ``host``
    the aten ops' host time (``op_seconds`` each), ``sync`` the host syncs', and ``step`` =
    max(device, host) + sync: the host runs ahead of the device's queue until a sync drains it.

    Example:
        >>> from meshtorch.plan.devices import device
        >>> from meshtorch.plan.kernels import roofline_seconds
        >>> spec = device("h100")
        >>> add = ("add", "bfloat16", 0, 3 * 2 ** 30, (), 1, 0)    # 3 GiB moved: bandwidth-bound
        >>> t = roofline_seconds({add: 1}, 1, spec)
        >>> t["memory"] == 3 * 2 ** 30 / spec.achievable_bandwidth, t["launch"] == spec.launch_seconds
        (True, True)
    """
    out = dict.fromkeys(TERMS, 0.0)
    bw = spec.achievable_bandwidth
    for (name, dtype, flops, nbytes, shape, launches, syncs), count in kernels.items():
        moved = nbytes / bw
        if name in ATTENTION and flops:
            work = flops * (0.5 if shape and shape[0] else 1.0) / spec.attention_flops_per_second(dtype)
            term = "attention"
        elif flops:
            eff = matmul_efficiency(*shape[1:], spec.matmul_knee) if len(shape) == 4 else 1.0
            work = flops / (spec.flops_per_second(dtype) * eff)
            term = "matmul"
        else:
            work, term = 0.0, "memory"
        if moved > work:
            term = "memory"
        out[term] += count * max(work, moved)
        out["launch"] += count * launches * spec.launch_seconds
        out["sync"] += count * syncs * spec.sync_seconds
    out["device"] = out["matmul"] + out["attention"] + out["memory"] + out["launch"]
    out["host"] = aten_ops * spec.op_seconds
    out["step"] = max(out["device"], out["host"]) + out["sync"]
    return out


__all__ = ["Kernel", "SequenceOp", "footprint", "fuse_elementwise", "fusible_runs", "kernel_of",
           "matmul_efficiency", "roofline_seconds"]
