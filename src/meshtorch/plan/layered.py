"""A deep program's trace from two shallow ones: what keeps each of the search's candidates cheap.

A :class:`~meshtorch.plan.program.Program` with ``layers`` > 0 can be rebuilt
with fewer layers (``with_layers``). Its blocks repeat with its ``period`` (an
MoE model whose every second block has an expert feed-forward layer has period
2). For ``L`` layers, period ``p`` and ``a = p + L mod p``, the program is traced
at ``a`` and ``a + p`` layers (:func:`shallow_depths`), which both end a whole
number of periods after the same remainder, so their difference is exactly one
period's cost and :func:`extrapolate` adds ``(L - a) / p`` of them: exact for
parameters, FLOPs and bytes. Gradient buckets (``mt.overlap``) are no line in
depth (a bucket holds at most a quarter of the gradients), nor are FSDP's grouped
gathers (at most a third of the gathered bytes): they are cut from the deep model's
gradients and gathered parameters by the runtime's own rule (:func:`deep_bucket_calls`).

Example:
    >>> from meshtorch.plan.layered import shallow_depths
    >>> shallow_depths(24, period=2)
    (2, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.lowering.overlap_buckets import Cut
from meshtorch.plan.program import Program, program_of
from meshtorch.plan.tracing import KINDS, Trace, trace


def lin(a: Any, b: Any, k: float) -> Any:
    """``a`` plus ``k`` times the step from ``a`` to ``b``."""
    return a + k * (b - a)


def shallow_depths(layers: int, period: int = 1) -> tuple[int, int] | None:
    """The two depths a ``layers``-deep step is extrapolated from, or None when tracing it
    whole is as cheap (at most one period deeper than the shallow trace).

    Example:
        >>> from meshtorch.plan.layered import shallow_depths
        >>> shallow_depths(6), shallow_depths(6, period=2), shallow_depths(7, period=2), shallow_depths(4, 2)
        ((1, 2), (2, 4), (3, 5), None)
    """
    if period < 1:
        raise PlanError(f"a step's period of repeating blocks must be >= 1, got {period}")
    a = period + layers % period
    return None if layers <= a + period else (a, a + period)


def extrapolate(t1: Trace, t2: Trace, periods: float) -> Trace:
    """The trace ``periods`` periods deeper than ``t1``, where ``t2`` is one period deeper."""

    def lin_(a, b):
        return lin(a, b, periods)

    comm = t1.comm.copy()
    # gradient buckets and grouped gathers (mt.overlap): counted by cutting the deep model's
    # gradients and gathered parameters with the runtime's rule, whose count is no line in depth
    # (a bucket holds at most a quarter of them, a gather a third)
    deep = deep_bucket_calls(t1.cuts, t2.cuts, periods)
    b1, b2 = (bucket_calls(t.cuts) if deep is not None else {} for t in (t1, t2))
    if any(n > t.comm._calls.get(key, 0) for t, b in ((t1, b1), (t2, b2)) for key, n in b.items()):
        deep, b1, b2 = None, {}, {}  # buckets cut but not all launched (no gradient came): on a line
    for key in set(t1.comm._calls) | set(t2.comm._calls):
        comm._calls[key] = lin_(t1.comm._calls.get(key, 0) - b1.get(key, 0),
                                t2.comm._calls.get(key, 0) - b2.get(key, 0)) + (deep or {}).get(key, 0)
        comm._bytes[key] = lin_(t1.comm._bytes.get(key, 0), t2.comm._bytes.get(key, 0))
    by_kind = {kd: lin_(t1.peak_by_kind[kd], t2.peak_by_kind[kd]) for kd in KINDS}
    flops = {dt: lin_(t1.flops_by_dtype.get(dt, 0), t2.flops_by_dtype.get(dt, 0))
             for dt in set(t1.flops_by_dtype) | set(t2.flops_by_dtype)}
    kernels = {k: lin_(t1.kernels.get(k, 0), t2.kernels.get(k, 0)) for k in set(t1.kernels) | set(t2.kernels)}
    result = t2.result
    if isinstance(t1.result, dict) and "parameters" in t1.result:
        result = {"parameters": lin_(t1.result["parameters"], t2.result["parameters"])}
    return replace(t2, comm=comm, peak_by_kind=by_kind, peak_bytes=sum(by_kind.values()),
                   flops_by_dtype=flops, flops=sum(flops.values()),
                   parameters=lin_(t1.parameters, t2.parameters), result=result, ops=[], flop_ops=[],
                   param_shapes=[], aten_ops=lin_(t1.aten_ops, t2.aten_ops), aten_names=[],
                   kernels={k: c for k, c in kernels.items() if c}, timeline=None, end=None, cuts=[],
                   # where collectives overlap compute, what that hides is extrapolated too
                   shallow=(_lean(t1), _lean(t2), periods) if t1.timeline or t2.timeline else None)


#: Periods :func:`deep_bucket_calls` walks at most before it finds its cut repeating (else the
#: buckets are extrapolated on a line, as the other calls)
MAX_CUT_PERIODS = 100_000


def bucket_calls(cuts: list[tuple[list, tuple]]) -> dict[tuple[str, tuple[str, ...]], int]:
    """The bucket launches (calls per (kind, axes)) of a trace's cuts (:attr:`Trace.cuts`): a
    call per bucket, and a grouped gather's bucket marked as gathered again in backward one more
    (:meth:`~meshtorch.lowering.overlap_buckets.Cut.calls`).

    Example (ten gradients of 0.3 MB in all-reduce buckets of 1 MB at most, as ``bucket_mb=1``):
        >>> from meshtorch.plan.layered import bucket_calls
        >>> key, mb = ("all_reduce", ("b",), None, None), 2**20
        >>> caps = (mb, 4 * mb, mb, 4, 3)
        >>> bucket_calls([([(key, 3 * mb // 10, False)] * 10, caps)])
        {('all_reduce', ('b',)): 4}
    """
    out: dict = {}
    for items, caps in cuts:
        rule = Cut(caps, _totals(items))
        for item in items:
            rule.add(*item)
        for key, n in rule.calls().items():
            out[key[:2]] = out.get(key[:2], 0) + n
    return out


def deep_bucket_calls(cuts1: list, cuts2: list,
                      periods: float) -> dict[tuple[str, tuple[str, ...]], int] | None:
    """The bucket launches (calls per (kind, axes)) of the model ``periods`` periods deeper than
    the one whose cuts are ``cuts1``, where ``cuts2`` are those of one period deeper: each
    backward's gradients are the shallow one's with ``periods`` copies of one period's (the
    gradients by which ``cuts2``'s exceed ``cuts1``'s) in their place, cut by the runtime's rule
    (:class:`~meshtorch.lowering.overlap_buckets.Cut`) without making them: whole periods that fit
    in the open buckets are added at once, and once the cut repeats, its repetitions. None where
    the cuts do not line up so (then the buckets are extrapolated on a line).

    Example (a period's gradient of 0.3 MB, in buckets of 1 MB: three to a bucket; one and two
    periods traced, three billion made):
        >>> from meshtorch.plan.layered import deep_bucket_calls
        >>> key, mb = ("all_reduce", ("b",), None, None), 2**20
        >>> caps, grad = (mb, 4 * mb, mb, 4, 3), (key, 3 * mb // 10, False)
        >>> deep_bucket_calls([([grad], caps)], [([grad] * 2, caps)], periods=3 * 10**9 - 1)
        {('all_reduce', ('b',)): 1000000000}
    """
    if len(cuts1) != len(cuts2) or periods != int(periods) or periods < 0:
        return None
    out: dict = {}
    for (items1, caps1), (items2, caps2) in zip(cuts1, cuts2):
        split = _split(items1, items2)
        if caps1 != caps2 or split is None:
            return None
        count = _deep_count(*split, int(periods), caps1)
        if count is None:
            return None
        for key, n in count.items():
            out[key[:2]] = out.get(key[:2], 0) + n
    return out


def _totals(items) -> dict:
    totals: dict = {}
    for key, nbytes, *_ in items:
        totals[key] = totals.get(key, 0) + nbytes
    return totals


def _split(items1: list, items2: list) -> tuple[list, list, list] | None:
    """``items2`` as ``prefix + period + suffix`` where ``items1`` is ``prefix + suffix``, compared
    without a gather's mark (gathered again in backward: not a forward bucket's, but the last one's,
    which backward needs first, is never freed): the period as early as it goes, so that
    ``suffix`` holds the last block with its marks, as the deep model's last block has them
    (each part is ``items2``'s, marks included: its first blocks' are the deep model's)."""
    m = len(items2) - len(items1)
    if m < 0:
        return None
    s = 0
    while s < len(items1) and items1[-1 - s][:3] == items2[-1 - s][:3]:
        s += 1
    p = len(items1) - s
    if any(a[:3] != b[:3] for a, b in zip(items1[:p], items2[:p])):
        return None
    return items2[:p], items2[p:p + m], items2[p + m:]


def _deep_count(prefix: list, period: list, suffix: list, copies: int, caps: tuple) -> dict | None:
    """Calls per key (:meth:`Cut.calls`) of ``prefix + period * copies + suffix`` cut by
    :class:`Cut`."""
    totals = _totals(prefix + suffix)
    per = _totals(period)
    for key, nbytes in per.items():
        totals[key] = totals.get(key, 0) + copies * nbytes
    rule = Cut(caps, totals)
    for item in prefix:
        rule.add(*item)
    edged = {key for key, _, edge, *_ in period if edge}
    marked = {item[0] for item in period if item[3:] and item[3]}  # (gathers again in backward)
    seen: dict | None = {}  # the cut's state at a period's start -> (period, counts, buckets)
    j = steps = 0
    while j < copies:
        steps += 1
        if steps > MAX_CUT_PERIODS:
            return None
        if seen is not None:
            state = rule.state()
            if state in seen:  # the cut repeats from here: add its repetitions that fit
                j0, count0, marked0 = seen[state]
                length = j - j0
                times = (copies - j) // length
                for key in rule.count:
                    rule.count[key] += times * (rule.count[key] - count0.get(key, 0))
                for key in rule.marked:
                    rule.marked[key] += times * (rule.marked[key] - marked0.get(key, 0))
                j += times * length
                seen = None  # what is left is shorter than a repetition
                continue
            seen[state] = (j, dict(rule.count), dict(rule.marked))
        # whole periods that fit in every open bucket of the period's keys, at once
        fit = copies - j
        for key, nbytes in per.items():
            if key in edged or key not in rule.size:
                fit = 0
            elif nbytes:
                fit = min(fit, rule.room(key) // nbytes - 1)
            elif rule.size[key] > rule.cap(key):  # an empty gradient cuts a bucket already over its cap
                fit = 0
            if fit <= 0:
                break
        if fit > 0:
            for key, nbytes in per.items():
                rule.fill(key, fit * nbytes, key in marked)
            j += fit
            continue
        for item in period:
            rule.add(*item)
        j += 1
    for item in suffix:
        rule.add(*item)
    return rule.calls()


#: The deepest shallow trace :func:`settled_depth` moves the extrapolation to (beyond it, the
#: shallowest depths are kept, and an overlapped step's peak is approximate: tracing that deep
#: costs what tracing the step does)
MAX_SETTLED_LAYERS = 32


def _regime(caps: tuple, key: tuple, total: int) -> str:
    """Which bound caps a bucket of ``key`` (:meth:`Cut.cap`) when its kind holds ``total`` bytes:
    ``bucket_mb``/``gather_mb`` (``"top"``), :data:`FIRST_BUCKET` (``"first"``), or a share of the
    total (``"share"``: the bucket grows with the model)."""
    bucket, gather, first, share, gather_share = caps
    top, part = (bucket, total // share) if key[0] == "all_reduce" else (gather, total // gather_share)
    cap = min(top, max(first, part))
    return "top" if cap == top else "first" if cap == first else "share"


def settled_depth(t1: Trace, t2: Trace, depth: int, period: int, layers: int) -> int:
    """The shallowest depth, ``depth`` plus whole periods, at which every bucket of the step's
    (``mt.overlap``'s gradient buckets and grouped gathers: :attr:`Trace.cuts`) is capped by the
    bound that caps the ``layers``-deep step's (:func:`_regime`), given ``t1`` and ``t2`` traced at
    ``depth`` and one period deeper; ``depth`` for a step that cuts none.

    A bucket's cap is a share of its kind's bytes between a floor and a ceiling, so a shallow
    step's buckets may grow with depth where the deep step's are at the ceiling: its peak (the
    buckets in flight) then grows faster by depth than the deep step's, and a line through two
    shallow peaks misses the deep one (a 12-layer FSDP LM's by 41%). Traced where the caps
    are the deep step's, one period adds what it adds to the deep step.

    Example (gathers of a third of the gathered bytes, at least 1 MB and at most 4 MB: a period of
    3 MB reaches the 4 MB of a 12-period step at 4 periods; one of 12 MB at once):
        >>> from meshtorch.plan.layered import settled_depth
        >>> from meshtorch.plan.tracing import Trace
        >>> key, mb = ("all_gather", ("b",), None, None), 2**20
        >>> caps = (25 * mb, 4 * mb, mb, 4, 3)
        >>> def at(periods, size):
        ...     items = [(key, size, False)] * periods
        ...     return Trace(mesh="b:4", rules="", backend="meta", cuts=[(items, caps)])
        >>> [settled_depth(at(1, size), at(2, size), 1, 1, 12) for size in (3 * mb, 12 * mb)]
        [4, 1]
    """
    if len(t1.cuts) != len(t2.cuts):
        return depth
    last = (layers - depth) // period  # the deep step, in periods past depth
    need = 0
    for (items1, _), (items2, caps) in zip(t1.cuts, t2.cuts):
        totals1, totals2 = _totals(items1), _totals(items2)
        for key in totals1.keys() | totals2.keys():
            a, step = totals1.get(key, 0), totals2.get(key, 0) - totals1.get(key, 0)
            if step < 0:
                return depth
            deep = _regime(caps, key, a + last * step)
            lo, hi = 0, last  # the regimes rise with the bytes: the first period in the deep one's
            while lo < hi:
                mid = (lo + hi) // 2
                if _regime(caps, key, a + mid * step) == deep:
                    hi = mid
                else:
                    lo = mid + 1
            need = max(need, lo)
    return depth + need * period


def _lean(t: Trace) -> Trace:
    """``t`` without its op lists (kept only to price its overlap)."""
    return replace(t, ops=[], flop_ops=[], aten_names=[], param_shapes=[])


def shallow_programs(program: Program) -> tuple[Program, Program, int] | None:
    """A deep program's two shallow copies (one period apart) and the periods to add to the
    shallower; None for a program that cannot be rebuilt with fewer layers or is shallow already."""
    if program.layers <= 0:
        return None
    depths = shallow_depths(program.layers, program.period)
    if depths is None:
        return None
    return (program.with_layers(depths[0]), program.with_layers(depths[1]),
            (program.layers - depths[0]) // program.period)


#: The deepest program traced layer by layer when its whole trace is asked for (an estimate, the
#: search's verified best). Deeper ones are extrapolated from two shallow traces, as each search
#: candidate is: tracing costs time and memory per layer, and `meshtorch plan --layers 1000000000`
#: must answer in seconds, not grow to tens of GB. Real models stay far below (GPT-3: 96 layers).
MAX_TRACED_LAYERS = 256


def check_pipelined_depth(program: Program) -> None:
    """Refuse to price a pipeline of more than :data:`MAX_TRACED_LAYERS` layers: its stages are
    traced layer by layer (no extrapolation yet), which for a billion layers never ends."""
    if program.layers > MAX_TRACED_LAYERS:
        raise PlanError(
            f"a pipelined step of {program.layers} layers: pipelines are priced by tracing every "
            f"stage's layers, up to {MAX_TRACED_LAYERS} layers in all; plan it unpipelined "
            "(meshtorch plan --no-pipeline, or without --pipeline-stages: deep unpipelined steps are "
            "extrapolated from two shallow ones) or with fewer layers")


def whole_trace(step_fn: Callable[[], Any] | Program, mesh: str, rules: str, staging: str = "none",
                compiled: bool = False, device: str = "cpu") -> Trace:
    """``step_fn``'s meta trace: traced whole up to :data:`MAX_TRACED_LAYERS` layers, extrapolated
    (:func:`layered_trace`) beyond.

    Example:
        >>> from meshtorch.plan.layered import MAX_TRACED_LAYERS, whole_trace
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.steps import training_step
        >>> def lm(layers):
        ...     return training_step(TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=layers,
        ...                                         batch=4, length=8), vocab=16)
        >>> deep = whole_trace(lm(10**9), "b:2", "batch:b")  # seconds, not a billion layers
        >>> one, two = (whole_trace(lm(n), "b:2", "batch:b").parameters for n in (1, 2))
        >>> deep.parameters == one + (10**9 - 1) * (two - one)
        True
    """
    program = program_of(step_fn)
    if program.layers > MAX_TRACED_LAYERS:
        return layered_trace(program, mesh, rules, staging=staging, device=device, compiled=compiled)
    return trace(step_fn, mesh=mesh, rules=rules, backend="meta", staging=staging, compiled=compiled,
                 device=device)


def layered_trace(step_fn: Callable[[], Any] | Program, mesh: str, rules: str,
                  staging: str = "none", device: str = "cpu", compiled: bool = False) -> Trace:
    """``step_fn``'s meta trace, extrapolated from two shallow depths when it can be
    rebuilt with fewer layers (what the search does to each candidate); ``device``: what the
    meta tensors stand for (:func:`meshtorch.plan.tracing.device_type`).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.steps import training_step
        >>> step = training_step(TrainConfig.of(model="moe", d_model=8, heads=2, d_kv=4, d_ff=16,
        ...                                     layers=6, batch=4, length=8, experts=2, top_k=1), vocab=16)
        >>> layered_trace(step, "b:2", "batch:b").parameters == mt.plan.trace(step, mesh="b:2").parameters
        True
    """
    program = program_of(step_fn)
    shallow = shallow_programs(program)

    def traced(f: Callable[[], Any]) -> Trace:
        return trace(f, mesh=mesh, rules=rules, backend="meta", staging=staging, device=device,
                     compiled=compiled)

    if shallow is None:
        return traced(step_fn)
    t1, t2 = (traced(f) for f in shallow[:2])
    return settled_extrapolation(program, t1, t2, shallow[2], traced)


def settled_extrapolation(program: Program, t1: Trace, t2: Trace, periods: int,
                          traced: Callable[[Program], Trace]) -> Trace:
    """``program``'s trace from ``t1`` and ``t2``, its shallow copies ``periods`` and ``periods - 1``
    periods shallower (:func:`shallow_programs`), traced by ``traced``: extrapolated from them, or
    where their buckets are not capped as the deep step's are (:func:`settled_depth`), from two
    traced where they are (up to :data:`MAX_SETTLED_LAYERS` layers), or the whole step where that is
    as deep."""
    p, layers = program.period, program.layers
    depth = layers - periods * p
    settled = settled_depth(t1, t2, depth, p, layers)
    if settled + p >= layers and layers <= MAX_SETTLED_LAYERS:
        return traced(program)
    if settled == depth or settled + p > min(layers - 1, MAX_SETTLED_LAYERS):
        return extrapolate(t1, t2, periods)
    t1, t2 = traced(program.with_layers(settled)), traced(program.with_layers(settled + p))
    return extrapolate(t1, t2, (layers - settled) // p)


__all__ = ["MAX_CUT_PERIODS", "MAX_SETTLED_LAYERS", "MAX_TRACED_LAYERS", "bucket_calls",
           "check_pipelined_depth", "deep_bucket_calls", "extrapolate", "layered_trace", "lin",
           "settled_depth", "settled_extrapolation", "shallow_depths", "shallow_programs", "whole_trace"]
