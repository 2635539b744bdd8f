"""Lower bounds on a layout's step time and memory, from one replicated trace: the search's pruning.

The step is traced once with no rules on :data:`REFERENCE_MESH` (every op
global); :func:`lower_bounds` then bounds any layout's compute seconds and peak
bytes without tracing it, and :func:`pipeline_bounds` does the same for the
pipelined family from one trace per stage. ``tests/test_plan_search_cli.py``
and ``tests/test_plan_pipeline.py`` check the bounds against the traces of
whole search spaces.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.plan.bounds import REFERENCE_MESH, dims_of
    >>> def step():
    ...     ff = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256), bias=False)
    ...     with mt.plan.measure():
    ...         mt.reduce_sum(ff(mt.random.normal("batch:32,d_model:64", seed=1))).backward()
    >>> dims_of(mt.plan.trace(step, mesh=REFERENCE_MESH)) == {"batch": 32, "d_model": 64, "d_ff": 256}
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable

from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.pipeline.simulate import chain_share, step_time_bound
from meshtorch.plan.devices import DeviceSpec
from meshtorch.plan.pipeline import stage_traces
from meshtorch.plan.program import TRANSFORMER_DIMS, Program, SpaceDims
from meshtorch.plan.space import PIPELINE_AXIS
from meshtorch.plan.tracing import Trace

# A replicated reference trace runs on this mesh: two processors, so that the general
# lowering runs (a one-processor mesh takes shortcuts), and no rules, so every op is global.
REFERENCE_MESH = "ref:2"

Candidate = tuple[str, str, int]  # a pipelined candidate: (mesh with a stage axis, rules, micro-batches)


def dims_of(t: Trace) -> dict[str, int]:
    """Every dim of the MeshTensors ``t`` saw, with its size (the first size seen)."""
    dims: dict[str, int] = {}
    for op in t.ops:
        for part in op.shape.split(","):
            if ":" in part:
                name, size = part.split(":")
                dims.setdefault(name, int(size))
    return dims


def _splitter(m: Mesh, r: dict) -> Callable[[frozenset[str] | None], int]:
    """The most processors the rules ``r`` can split a tensor of the given dims over on ``m``
    (None: any, the whole mesh)."""
    cache: dict[frozenset[str] | None, int] = {}

    def split(dims: frozenset[str] | None) -> int:
        if dims not in cache:
            cache[dims] = m.size if dims is None else math.prod(
                m.axis_size(a) for a in {a for d in dims for a in r.get(d, ()) if a in m})
        return cache[dims]

    return split


def flop_bound(ref: Trace, mesh: str | Mesh, rules: str, spec: DeviceSpec) -> float:
    """The FLOP part of :func:`lower_bounds`: each counted FLOP op of the replicated trace ``ref``
    over the most processors the rules can split its operands over, at ``spec``'s rate."""
    m = Mesh(mesh) if not isinstance(mesh, Mesh) else mesh
    split = _splitter(m, LayoutRules(rules).rules)
    return sum(n / split(d) / spec.flops_per_second(dt) for dt, n, d in ref.flop_ops)


def lower_bounds(ref: Trace, mesh: str | Mesh, rules: str, spec: DeviceSpec,
                 names: SpaceDims = TRANSFORMER_DIMS) -> tuple[float, float]:
    """Lower bounds on a layout's compute seconds and peak bytes, from a replicated trace.

    ``ref`` is the step traced with no rules (every op global). A FLOP op
    whose operands are MeshTensors with dims ``D`` is split over at most the
    distinct axes the rules give ``D`` (an axis splits a tensor once), so a
    processor runs at least its FLOPs over their product; an op with an
    operand that is no MeshTensor's (an autograd gradient) at least its
    FLOPs over the mesh size. Parameters (and their gradients, when the step
    holds both as its measured block begins) are held whole-step, so their
    slices bound the peak from below. And when the batch (``names.batch``) is
    split over an axis, each such parameter's gradient whose dims do not use
    that axis is a sum over it: at least an all_reduce's bandwidth term,
    2(n-1)/n bytes over the link (the bandwidth-optimal bound, below the
    tree's 2 log n). The step takes at least the larger of the two (a step
    that overlaps its collectives with compute, :func:`meshtorch.overlap`, no more).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.plan.bounds import REFERENCE_MESH, lower_bounds
        >>> def step():
        ...     w = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256), bias=False)
        ...     x = mt.random.normal("batch:32,d_model:64", seed=1)
        ...     with mt.plan.measure():
        ...         mt.reduce_sum(w(x)).backward()
        >>> ref = mt.plan.trace(step, mesh=REFERENCE_MESH)
        >>> spec = mt.plan.device("a100")
        >>> t, m = lower_bounds(ref, "b:2,m:4", "batch:b; d_ff:m", spec)
        >>> est = mt.plan.estimate(step, "b:2,m:4", "batch:b; d_ff:m", device=spec)
        >>> t <= est.step_seconds, m <= est.memory_bytes["total"], m == 64 * 256 * 4 / 4
        (True, True, True)
    """
    m = Mesh(mesh) if not isinstance(mesh, Mesh) else mesh
    r = LayoutRules(rules).rules
    split = _splitter(m, r)
    seconds = flop_bound(ref, m, rules, spec)
    params = sum(b / split(frozenset(names_)) for names_, b, _ in ref.param_shapes)
    start = ref.start_by_kind
    held = 2 if start and start.get("gradients", 0) >= start.get("parameters", 0) > 0 else 1
    data = tuple(a for a in r.get(names.batch, ()) if a in m)
    k = math.prod(m.axis_size(a) for a in data)
    if k > 1:
        # a gradient whose dims use none of the data axes is summed over all of them
        summed = sum(b / split(frozenset(dims)) for dims, b, grad in ref.param_shapes
                     if grad and not any(set(r.get(d, ())) & set(data) for d in dims))
        bandwidth = min(spec.link(a).bandwidth for a in data)
        # the larger, not the sum: a step that overlaps (mt.overlap) reduces during backward
        seconds = max(seconds, 2 * (k - 1) / k * summed / bandwidth)
    return seconds, held * params


def pipeline_bounds(pipelined: Callable[[int], Program], family: list[Candidate], spec: DeviceSpec,
                    names: SpaceDims = TRANSFORMER_DIMS) -> dict[Candidate, tuple[float, float]]:
    """Lower bounds on the step time and the fullest stage's memory of every pipelined candidate
    ``(mesh, rules, microbatches)`` of ``family``; ``pipelined(microbatches)`` is the program
    pipelined (:meth:`meshtorch.plan.program.Program.pipelined`).

    Each stage count's step is traced once per stage, replicated (``stage:S`` with
    :data:`REFERENCE_MESH`, no rules, ``S`` micro-batches); :func:`lower_bounds` of a stage's
    trace under a candidate's rules on the mesh without ``stage`` bounds that stage's work and
    memory. Neither depends on the micro-batch count (a micro-batch's FLOPs are its share of the
    batch's; the gradients are reduced once a step), so one trace serves every count; the
    schedule's replay then takes at least :func:`meshtorch.pipeline.simulate.step_time_bound` of
    the stage bounds (the first micro-batch passes the stages before the busiest one forward and
    back: the bubble).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.plan.pipeline import estimate_pipeline
        >>> from meshtorch.plan.bounds import pipeline_bounds
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.steps import training_step
        >>> step = training_step(TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, batch=8,
        ...                                     length=8), vocab=16)
        >>> spec = mt.plan.device("a100")
        >>> c = ("stage:2,b:2", "batch:b", 4)
        >>> t, m = pipeline_bounds(step.pipelined, [c], spec)[c]
        >>> e = estimate_pipeline(step.pipelined(4), c[0], c[1], spec)
        >>> 0 < t <= e.step_seconds, 0 < m <= e.memory_bytes["total"]
        (True, True)
    """
    bounds = stage_bounds(pipelined, family, spec, names)
    info = pipelined(family[0][2]).pipeline if family else None
    share = chain_share(info.schedule, info.virtual_stages) if info is not None else 1.0
    return {c: (step_time_bound(work, c[2], spread=lead, share=share), mem)
            for c, (work, mem, lead) in bounds.items()}


def stage_bounds(pipelined: Callable[[int], Program], family: list[Candidate], spec: DeviceSpec,
                 names: SpaceDims = TRANSFORMER_DIMS
                 ) -> dict[Candidate, tuple[list[float], float, list[float]]]:
    """Per candidate, lower bounds on each stage's work and on the fullest stage's memory, and
    on each stage's work between micro-batches (before its update: the FLOPs part of the work
    bound, when the update runs no FLOP op, else nothing)."""
    stages = sorted({Mesh(c[0]).axis_size(PIPELINE_AXIS) for c in family})
    refs = {s: stage_traces(pipelined(s), f"{PIPELINE_AXIS}:{s},{REFERENCE_MESH}", "",
                            device=spec.device_type) for s in stages}
    per_layout: dict[tuple[int, str, str], tuple[list[float], float, list[float]]] = {}
    out = {}
    for c in family:
        m = Mesh(c[0])
        s = m.axis_size(PIPELINE_AXIS)
        rest = ",".join(f"{a}:{m.axis_size(a)}" for a in m.axis_names if a != PIPELINE_AXIS) or "b:1"
        key = (s, rest, c[1])
        if key not in per_layout:
            b = [lower_bounds(t, rest, c[1], spec, names) for t in refs[s]]
            lead = [flop_bound(t, rest, c[1], spec) if not _update_flops(t) else 0.0 for t in refs[s]]
            per_layout[key] = ([w for w, _ in b], max(mem for _, mem in b), lead)
        out[c] = per_layout[key]
    return out


def _update_flops(t: Trace) -> int:
    up = t.phases.get("update")
    return 0 if up is None else sum(up.flops_by_dtype.values())


__all__ = ["REFERENCE_MESH", "dims_of", "flop_bound", "lower_bounds", "pipeline_bounds", "stage_bounds"]
