"""``mt.plan.search``: the fastest mesh shape and layout rules that fit in memory.

The search is *exact over its space*: every candidate is traced on the meta
backend and costed (:mod:`meshtorch.plan.estimate`); nothing is guessed from a
surrogate. The space, pruned by divisibility:

- meshes: the given one, or for ``N`` processors ``b:N`` and every
  ``b:x,m:N/x`` (two axes: a data axis ``b`` and a model axis ``m``);
- rules: on two axes, ``batch`` on ``b`` (data parallelism) and, each on
  ``m`` or not at all, the model dims (``heads, d_ff, vocab, experts`` when the
  model has them), and ``d_model`` on ``b`` or not at all (ZeRO/FSDP-style
  sharding of the parameters along the data axis); also data parallelism over
  the whole 2-D mesh, ``batch:(b,m)``, alone or with ``d_model:(b,m)``
  (ZeRO-3/FSDP over every processor); on one axis, each of those dims on it
  or not.

That is at most a few hundred candidates, so no integer program is needed
(``scipy.optimize.milp`` would need a separable cost model, which the
collective costs are not: the bytes an all_reduce moves along ``b`` depend on
how ``m`` splits the same tensor). To keep each candidate cheap, a step
function that can be rebuilt with fewer layers (one with ``layers`` and
``with_layers(n)`` attributes, as ``meshtorch plan``'s training step) is
traced at two shallow depths one *period* apart and extrapolated linearly.
The period is the step's ``period`` attribute (1 when absent): blocks repeat
with it, e.g. an MoE model whose every second block has an expert
feed-forward layer has period 2. For ``L`` layers, period ``p`` and
``a = p + L mod p``, the traces have ``a`` and ``a + p`` layers, which both
end a whole number of periods after the same remainder, so their difference
is exactly one period's cost: exact for parameters, FLOPs and bytes. The
best candidates are then traced in full, so the numbers reported for them
are not extrapolated.

Example:
    >>> import meshtorch as mt
    >>> def step():
    ...     ff = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256), bias=False)
    ...     x = mt.random.normal("batch:32,d_model:64", seed=1)
    ...     with mt.plan.measure():
    ...         mt.reduce_sum(ff(x)).backward()
    >>> res = mt.plan.search(step, 2, device="a100")
    >>> res.best.fits, res.best.step_seconds <= min(c.step_seconds for c in res.candidates)
    (True, True)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from meshtorch.errors import PlanError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.pipeline.simulate import step_time_bound
from meshtorch.plan.devices import DeviceSpec
from meshtorch.plan.devices import device as get_device
from meshtorch.plan.estimate import Estimate, _fmt_bytes, from_trace
from meshtorch.plan.pipeline import PipelineEstimate, estimate_pipeline, stage_traces
from meshtorch.plan.tracing import KINDS, Trace, trace

MODEL_DIMS = ("heads", "d_ff", "vocab", "experts")
# dims of the activations that may go on the model axis too (Megatron's sequence parallelism
# splits length; d_model on the model axis splits the residual stream and the parameters' rows)
ACTIVATION_DIMS = ("d_model", "length")


def meshes_for(n: int, axes: int = 2) -> list[str]:
    """``b:n`` and every two-axis ``b:x,m:n/x``; with ``axes=3`` also every three-axis
    ``b:x,m:y,x:z`` (each axis of at least 2 processors).

    Example:
        >>> from meshtorch.plan.search import meshes_for
        >>> meshes_for(8)
        ['b:8', 'b:2,m:4', 'b:4,m:2']
        >>> meshes_for(8, axes=3)[3:]
        ['b:2,m:2,x:2']
    """
    if n < 1:
        raise PlanError(f"num_processors must be >= 1, got {n}")
    if axes not in (1, 2, 3):
        raise PlanError(f"the search's meshes have 1, 2 or 3 axes, got axes={axes}")
    out = [f"b:{n}"]
    if axes >= 2:
        out += [f"b:{x},m:{n // x}" for x in range(2, n) if n % x == 0]
    if axes == 3:
        out += [f"b:{x},m:{y},x:{n // (x * y)}" for x in range(2, n) if n % x == 0
                for y in range(2, n // x) if (n // x) % y == 0 and n // (x * y) >= 2]
    return out


def _choices(names: list[str], options: list[list]) -> Iterable[list[tuple[str, Any]]]:
    for choice in itertools.product(*options):
        yield list(zip(names, choice))


def one_axis_family(axes: tuple[str, ...], dims: dict[str, int]) -> Iterable[list[tuple[str, Any]]]:
    """One axis: ``batch`` and each model dim on it or not."""
    if len(axes) != 1:
        return
    names = ["batch", *(d for d in MODEL_DIMS if d in dims)]
    yield from _choices(names, [[None, axes[0]]] * len(names))


def data_model_family(axes: tuple[str, ...], dims: dict[str, int]) -> Iterable[list[tuple[str, Any]]]:
    """Two axes: ``batch`` on the data axis, each model dim on the model axis or not, and
    ``d_model`` on the data axis or not (ZeRO/FSDP-style sharding of the parameters)."""
    if len(axes) != 2:
        return
    b, m = axes
    model = [d for d in MODEL_DIMS if d in dims]
    yield from _choices(["batch", *model, "d_model"], [[b]] + [[None, m]] * len(model) + [[None, b]])


def whole_mesh_data_family(axes: tuple[str, ...], dims: dict[str, int]) -> Iterable[list[tuple[str, Any]]]:
    """Two axes: data parallelism over the whole mesh, the parameters whole or sharded over
    every processor (ZeRO-3)."""
    if len(axes) != 2:
        return
    yield [("batch", axes)]
    yield [("batch", axes), ("d_model", axes)]


def activation_model_family(axes: tuple[str, ...], dims: dict[str, int]) -> Iterable[list[tuple[str, Any]]]:
    """Two axes: ``batch`` on the data axis and ``d_model`` or ``length`` on the model axis
    (with ``length``, causal attention runs as ring attention), with each of ``heads, d_ff,
    vocab`` on the model axis or not (an earlier dim of a tensor on the model axis wins)."""
    if len(axes) != 2:
        return
    b, m = axes
    model = [d for d in MODEL_DIMS if d in dims and d != "experts"]
    for act in ACTIVATION_DIMS:
        if act in dims:
            yield from _choices(["batch", act, *model], [[b], [m]] + [[None, m]] * len(model))


def experts_on_data_family(axes: tuple[str, ...], dims: dict[str, int]) -> Iterable[list[tuple[str, Any]]]:
    """Two axes, MoE: ``experts`` on the data axis with ``batch`` (Mesh-TF's MoE layout: the
    tokens of a group go to the processors holding their experts by all_to_all), each of
    ``heads, d_ff, vocab`` on the model axis or not."""
    if len(axes) != 2 or "experts" not in dims:
        return
    b, m = axes
    model = [d for d in MODEL_DIMS if d in dims and d != "experts"]
    yield from _choices(["batch", "experts", *model], [[b], [b]] + [[None, m]] * len(model))


def three_axis_family(axes: tuple[str, ...], dims: dict[str, int]) -> Iterable[list[tuple[str, Any]]]:
    """Three axes ``b, m, x``: ``batch`` over ``(b, x)``, each model dim on ``m`` or not, and
    ``d_model`` over ``(b, x)`` or not. Priced like its two-axis collapse unless the device
    gives the axes different links (``spec.with_links``)."""
    if len(axes) != 3:
        return
    b, m, x = axes
    model = [d for d in MODEL_DIMS if d in dims]
    options = [[(b, x)]] + [[None, m]] * len(model) + [[None, (b, x)]]
    yield from _choices(["batch", *model, "d_model"], options)


# each family proposes rule sets for the meshes it knows; rules_for keeps those that divide
FAMILIES: tuple[Callable[[tuple[str, ...], dict[str, int]], Iterable[list[tuple[str, Any]]]], ...] = (
    one_axis_family, data_model_family, whole_mesh_data_family, activation_model_family,
    experts_on_data_family, three_axis_family)


def rules_for(mesh: str, dims: dict[str, int]) -> list[str]:
    """Every rule set of the search space for ``mesh`` whose splits divide their dims: the
    union of what the :data:`FAMILIES` propose.

    Example:
        >>> from meshtorch.plan.search import rules_for
        >>> rules_for("b:2,m:2", {"batch": 8, "d_ff": 32, "d_model": 16, "length": 8})[5:7]
        ['batch:b; d_model:m', 'batch:b; length:m']
    """
    m = Mesh(mesh)
    axes = tuple(m.axis_names)
    out = set()
    for family in FAMILIES:
        for choice in family(axes, dims):
            rules = _divisible(m, dims, choice)
            if rules is not None:
                out.add(rules)
    return sorted(out, key=lambda r: (r.count(":"), r))


def _divisible(m: Mesh, dims: dict[str, int], choice: Iterable[tuple[str, str | tuple[str, ...] | None]]
               ) -> str | None:
    """The rules of ``choice`` (dim name, axes) for the dims the model has, or ``None`` if one
    does not divide."""
    rules = []
    for name, axes in choice:
        if axes is None or name not in dims:
            continue
        r = LayoutRules({name: axes})
        if dims[name] % r.pieces(name, m):
            return None
        rules.append(str(r))
    return "; ".join(rules)


PIPELINE_AXIS = "stage"


def stage_counts(n: int, layers: int) -> list[int]:
    """Pipeline depths the search tries on ``n`` processors: 2, 4, 8, ... dividing ``n``, at most
    ``layers`` (a stage holds at least one block).

    Example:
        >>> from meshtorch.plan.search import stage_counts
        >>> stage_counts(8, 6), stage_counts(6, 2), stage_counts(1, 4)
        ([2, 4], [2], [])
    """
    out, s = [], 2
    while s <= min(n, layers):
        if n % s == 0:
            out.append(s)
        s *= 2
    return out


def microbatch_counts(stages: int, batch: int) -> list[int]:
    """Micro-batch counts the search tries for ``stages`` stages: ``stages``, ``2·stages`` and
    ``4·stages`` (bubbles of about 1/2, 1/3 and 1/5 of a flushed schedule) that divide ``batch``
    (the batch each data-parallel slice of a stage cuts up).

    Example:
        >>> from meshtorch.plan.search import microbatch_counts
        >>> microbatch_counts(2, 8), microbatch_counts(4, 8), microbatch_counts(2, 6)
        ([2, 4, 8], [4, 8], [2])
    """
    return [m for m in (stages, 2 * stages, 4 * stages) if m <= batch and batch % m == 0]


def pipeline_layouts(n: int, dims: dict[str, int], layers: int) -> list[tuple[str, str, int]]:
    """The pipelined family: ``(mesh, rules, microbatches)`` for every stage count of
    :func:`stage_counts`, every SPMD layout of the search on the ``n / stages`` processors left
    (:func:`meshes_for`, :func:`rules_for` with each micro-batch's batch), the ``stage`` axis in
    front, and every micro-batch count of :func:`microbatch_counts`.

    Example:
        >>> from meshtorch.plan.search import pipeline_layouts
        >>> pipeline_layouts(2, {"batch": 8, "d_ff": 16}, layers=2)
        [('stage:2', '', 2), ('stage:2', '', 4), ('stage:2', '', 8)]
    """
    out = []
    for s in stage_counts(n, layers):
        rest = n // s
        for mesh in meshes_for(rest) if rest > 1 else [""]:
            for mb in microbatch_counts(s, dims.get("batch", 1)):
                micro = {**dims, "batch": dims.get("batch", 1) // mb} if "batch" in dims else dims
                full = f"{PIPELINE_AXIS}:{s}" + (f",{mesh}" if mesh else "")
                for rules in rules_for(mesh, micro) if mesh else [""]:
                    out.append((full, rules, mb))
    return out


@dataclass(frozen=True)
class Pruned:
    """A candidate the search ruled out without tracing it in full, and why.

    ``seconds`` and ``memory_bytes`` are lower bounds on its step time and peak
    memory; ``by`` is ``"time"`` (its time bound is no better than the best
    step time, ``best``) or ``"memory"`` (its parameters alone overflow the device).
    """

    mesh: str
    rules: str
    seconds: float
    memory_bytes: float
    by: str
    best: float = math.inf
    pipeline: str = ""  # a pipelined candidate's schedule and micro-batches, e.g. "1f1b x4"

    def reason(self) -> str:
        if self.by == "memory":
            return f"pruned: parameter bytes alone >= {_fmt_bytes(self.memory_bytes)} do not fit"
        return (f"pruned: step time >= {self.seconds * 1e3:.2f} ms (lower bound) >= best "
                f"{self.best * 1e3:.2f} ms")

    def to_json(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "rules": self.rules, "pipeline": self.pipeline, "pruned": self.by,
                "step_seconds_lower_bound": self.seconds, "memory_bytes_lower_bound": self.memory_bytes,
                "reason": self.reason()}


@dataclass
class SearchResult:
    """Candidates, best first (fitting ones by step time, then the others by memory).

    ``candidates`` holds the traced candidates only; ``space`` counts every
    candidate; ``pruned_candidates`` those a lower bound ruled out without a
    full trace (:class:`Pruned`, with the bound), and ``pruned`` counts them by
    reason (``{"time": n, "memory": n}``). Every candidate of the space is in
    exactly one of the two lists, and :meth:`table` ranks both.
    """

    candidates: list[Estimate]
    device: str
    seconds: float
    space: int = 0
    pruned_candidates: list[Pruned] = field(default_factory=list)

    @property
    def pruned(self) -> dict[str, int]:
        return {by: sum(p.by == by for p in self.pruned_candidates) for by in ("time", "memory")}

    @property
    def best(self) -> Estimate:
        return self.candidates[0]

    @property
    def mesh(self) -> str:
        return self.best.mesh

    @property
    def rules(self) -> str:
        """The best rules, ready to paste into ``mt.launch(..., rules=...)``."""
        return self.best.rules

    def ranking(self) -> list[Estimate | Pruned]:
        """Traced and pruned candidates in one ranking: fitting ones by step time (a pruned
        one by its bound), then those that do not fit by memory."""

        def key(c: Estimate | Pruned) -> tuple:
            if isinstance(c, Pruned):
                return (c.by == "memory", c.seconds if c.by == "time" else c.memory_bytes, 1)
            return (*_key(c), 0)

        return sorted([*self.candidates, *self.pruned_candidates], key=key)

    def why(self, c: Estimate | Pruned | None = None) -> str:
        """Why ``c`` ranks where it does, against the best: the best "fits memory (…); fastest,
        dominated by …"; another "12% slower: more all_reduce@m (+1.20 ms); less memory (…)";
        one that does not fit, by how much; a pruned one, its bound. Without ``c``: why the
        best won against the best of the other family (layouts with or without pipeline
        stages)."""
        if c is None:
            return self._why_chosen()
        if isinstance(c, Pruned):
            return c.reason()
        if not c.fits:
            return c.reason()
        best = self.best
        if c is best:
            return (f"fits memory ({_fmt_bytes(c.memory_bytes['total'])} of "
                    f"{_fmt_bytes(c.memory_capacity)}); fastest, {c.reason()}")
        slower = (c.step_seconds / best.step_seconds - 1) * 100 if best.step_seconds else 0.0
        mine = {"compute": c.compute_seconds, **c.comm_seconds}
        theirs = {"compute": best.compute_seconds, **best.comm_seconds}
        part, extra = max(((k, mine.get(k, 0.0) - theirs.get(k, 0.0)) for k in {*mine, *theirs}),
                          key=lambda kv: (kv[1], kv[0]))
        out = f"{slower:.0f}% slower than #1"
        if extra > 0:
            out += f": more {part} (+{extra * 1e3:.2f} ms)"
        less = best.memory_bytes["total"] - c.memory_bytes["total"]
        if less > 0:
            out += f"; {_fmt_bytes(less)} less memory"
        return out

    def reasons(self, top: int = 3) -> list[str]:
        """``"1st: …"``, ``"2nd: …"``: :meth:`why` for each of the ``top`` ranked candidates."""
        ordinal = {1: "1st", 2: "2nd", 3: "3rd"}
        return [f"{ordinal.get(i, f'{i}th')} {c.mesh} \"{c.rules}\": {self.why(c)}"
                for i, c in enumerate(self.ranking()[:top], 1)]

    def table(self, top: int = 10) -> str:
        """The ``top`` candidates of :meth:`ranking` with the reason for each (:meth:`why`);
        pruned ones show their lower bounds (``>=``)."""
        rows = [f"{'#':>3}  {'mesh':<14}{'rules':<48}{'step ms':>10}{'memory':>12}  fits  why"]
        for i, c in enumerate(self.ranking()[:top], 1):
            if isinstance(c, Pruned):
                rows.append(f"{i:>3}  {c.mesh:<14}{_what(c):<48}"
                            f"{'>=' + format(c.seconds * 1e3, '.2f'):>10}"
                            f"{'>=' + _fmt_bytes(c.memory_bytes):>12}  "
                            f"{'NO ' if c.by == 'memory' else '?':<4}  {c.reason()}")
                continue
            rows.append(f"{i:>3}  {c.mesh:<14}{_what(c):<48}{c.step_seconds * 1e3:>10.2f}"
                        f"{_fmt_bytes(c.memory_bytes['total']):>12}  {'yes' if c.fits else 'NO ':<4}  "
                        f"{self.why(c)}")
        n = self.pruned
        pruned = "" if not self.pruned_candidates else (
            f" ({n['time']} pruned: time bound >= the best step time; "
            f"{n['memory']} pruned: parameter bytes alone do not fit)")
        space = self.space or len(self.candidates)
        best = self.best
        flags = (f" --pipeline-stages {best.stages} --schedule {best.schedule} --microbatches "
                 f"{best.microbatches}" if isinstance(best, PipelineEstimate) else "")
        rows.append(f"{space} candidates, {len(self.candidates)} traced{pruned}, "
                    f"on {self.device} in {self.seconds:.1f} s; "
                    f"best: --mesh {self.mesh} --rules \"{self.rules}\"{flags}")
        rows.append(f"why: {self.why()}")
        return "\n".join(rows)

    def _why_chosen(self) -> str:
        best = self.best
        piped = isinstance(best, PipelineEstimate)
        rival = next((c for c in self.candidates if isinstance(c, PipelineEstimate) != piped), None)
        if not best.fits:
            return f"nothing fits; the smallest: {best.reason()}"
        what = (f"{best.label}: bubble {best.bubble:.0%}" if piped
                else f"no pipeline stages: {best.reason()}")
        if rival is None:
            return what + ("" if piped else " (no pipelined layout was searched or traced)")
        other = "the best layout without stages" if piped else f"the best pipelined layout ({rival.label})"
        if not rival.fits:
            return (f"{what}; fits memory where {other} does not ({_fmt_bytes(rival.memory_bytes['total'])} "
                    f"> {_fmt_bytes(rival.memory_capacity)})")
        return (f"{what}; {rival.step_seconds / best.step_seconds:.2f}x faster than {other} "
                f"(--mesh {rival.mesh} --rules \"{rival.rules}\": {rival.step_seconds * 1e3:.2f} ms)")

    def __str__(self) -> str:
        return self.table()


def _what(c: Estimate | Pruned) -> str:
    """A candidate's rules, and for a pipelined one its schedule and micro-batches."""
    rules = c.rules or "(replicated)"
    if isinstance(c, PipelineEstimate):
        return f"{rules} [{c.schedule} x{c.microbatches}]"
    return f"{rules} [{c.pipeline}]" if isinstance(c, Pruned) and c.pipeline else rules


def _key(e: Estimate) -> tuple:
    return (not e.fits, e.step_seconds if e.fits else e.memory_bytes["total"])


def _lin(a, b, k):
    return a + k * (b - a)


def shallow_depths(layers: int, period: int = 1) -> tuple[int, int] | None:
    """The two depths a ``layers``-deep step is extrapolated from, or None when tracing it
    whole is as cheap (at most one period deeper than the shallow trace).

    Example:
        >>> from meshtorch.plan.search import shallow_depths
        >>> shallow_depths(6), shallow_depths(6, period=2), shallow_depths(7, period=2), shallow_depths(4, 2)
        ((1, 2), (2, 4), (3, 5), None)
    """
    if period < 1:
        raise PlanError(f"a step's period of repeating blocks must be >= 1, got {period}")
    a = period + layers % period
    return None if layers <= a + period else (a, a + period)


def _extrapolate(t1: Trace, t2: Trace, periods: int) -> Trace:
    """The trace ``periods`` periods deeper than ``t1``, where ``t2`` is one period deeper."""

    def lin(a, b):
        return _lin(a, b, periods)

    comm = t1.comm.copy()
    for key in set(t1.comm._calls) | set(t2.comm._calls):
        comm._calls[key] = lin(t1.comm._calls.get(key, 0), t2.comm._calls.get(key, 0))
        comm._bytes[key] = lin(t1.comm._bytes.get(key, 0), t2.comm._bytes.get(key, 0))
    by_kind = {kd: lin(t1.peak_by_kind[kd], t2.peak_by_kind[kd]) for kd in KINDS}
    flops = {dt: lin(t1.flops_by_dtype.get(dt, 0), t2.flops_by_dtype.get(dt, 0))
             for dt in set(t1.flops_by_dtype) | set(t2.flops_by_dtype)}
    result = t2.result
    if isinstance(t1.result, dict) and "parameters" in t1.result:
        result = {"parameters": lin(t1.result["parameters"], t2.result["parameters"])}
    return replace(t2, comm=comm, peak_by_kind=by_kind, peak_bytes=sum(by_kind.values()),
                   flops_by_dtype=flops, flops=sum(flops.values()),
                   parameters=lin(t1.parameters, t2.parameters), result=result, ops=[], flop_ops=[],
                   param_shapes=[], aten_ops=lin(t1.aten_ops, t2.aten_ops))


def layered_trace(step_fn: Callable[[], Any], mesh: str, rules: str, staging: str = "none") -> Trace:
    """``step_fn``'s meta trace, extrapolated from two shallow depths when it can be
    rebuilt with fewer layers (what the search does to each candidate).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.steps import training_step
        >>> step = training_step(TrainConfig.of(model="moe", d_model=8, heads=2, d_kv=4, d_ff=16,
        ...                                     layers=6, batch=4, length=8, experts=2, top_k=1), vocab=16)
        >>> layered_trace(step, "b:2", "batch:b").parameters == mt.plan.trace(step, mesh="b:2").parameters
        True
    """
    shallow = _shallow_steps(step_fn)
    if shallow is None:
        return trace(step_fn, mesh=mesh, rules=rules, backend="meta", staging=staging)
    t1, t2 = (trace(f, mesh=mesh, rules=rules, backend="meta", staging=staging) for f in shallow[:2])
    return _extrapolate(t1, t2, shallow[2])


def _shallow_steps(step_fn: Callable[[], Any]) -> tuple[Callable, Callable, int] | None:
    """A deep step's two shallow copies (one period apart) and the periods to add to the
    shallower; None for a step that cannot be rebuilt with fewer layers or is shallow already."""
    rebuild = getattr(step_fn, "with_layers", None)
    layers, period = getattr(step_fn, "layers", 0), getattr(step_fn, "period", 1)
    depths = shallow_depths(layers, period) if rebuild is not None else None
    if depths is None:
        return None
    return rebuild(depths[0]), rebuild(depths[1]), (layers - depths[0]) // period


# A replicated reference trace runs on this mesh: two processors, so that the general
# lowering runs (a one-processor mesh takes shortcuts), and no rules, so every op is global.
REFERENCE_MESH = "ref:2"


def _dims(t: Trace) -> dict[str, int]:
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


def lower_bounds(ref: Trace, mesh: str | Mesh, rules: str, spec: DeviceSpec) -> tuple[float, float]:
    """Lower bounds on a layout's compute seconds and peak bytes, from a replicated trace.

    ``ref`` is the step traced with no rules (every op global). A FLOP op
    whose operands are MeshTensors with dims ``D`` is split over at most the
    distinct axes the rules give ``D`` (an axis splits a tensor once), so a
    processor runs at least its FLOPs over their product; an op with an
    operand that is no MeshTensor's (an autograd gradient) at least its
    FLOPs over the mesh size. Parameters (and their gradients, when the step
    holds both as its measured block begins) are held whole-step, so their
    slices bound the peak from below. And when ``batch`` is split over an
    axis, each such parameter's gradient whose dims do not use that axis is
    a sum over it: at least an all_reduce's bandwidth term, 2(n-1)/n bytes
    over the link (the bandwidth-optimal bound, below the tree's 2 log n).
    ``tests/test_plan_search_cli.py`` checks the bounds against the traces of
    whole search spaces.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.plan.search import REFERENCE_MESH, lower_bounds
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
    params = sum(b / split(frozenset(names)) for names, b, _ in ref.param_shapes)
    start = ref.start_by_kind
    held = 2 if start and start.get("gradients", 0) >= start.get("parameters", 0) > 0 else 1
    data = tuple(a for a in r.get("batch", ()) if a in m)
    k = math.prod(m.axis_size(a) for a in data)
    if k > 1:
        # a gradient whose dims use none of the data axes is summed over all of them
        summed = sum(b / split(frozenset(names)) for names, b, grad in ref.param_shapes
                     if grad and not any(set(r.get(d, ())) & set(data) for d in names))
        bandwidth = min(spec.link(a).bandwidth for a in data)
        seconds += 2 * (k - 1) / k * summed / bandwidth
    return seconds, held * params


def search(step_fn: Callable[[], Any], processors: int | str | Mesh, device: str | DeviceSpec = "tpu-v2",
           *, verify: int = 3, meshes: Iterable[str] | None = None,
           algorithm: str = "ring", max_candidates: int = 100_000, pipeline: bool = True,
           staging: str = "none", axes: int = 2) -> SearchResult:
    """Search mesh shapes and layout rules for the fastest step that fits ``device``'s memory.

    ``processors`` is a processor count (meshes are searched) or a mesh (only
    rules are). Returns a :class:`SearchResult` whose ``rules`` and ``mesh``
    can be pasted; ``result.table(top)`` ranks the ``top`` candidates with the
    reason for each (which collectives dominate, what does not fit).

    Branch and bound: every candidate gets cheap lower bounds (:func:`lower_bounds`);
    candidates are traced in order of their time bound until the bound reaches
    the best step time found, and those whose parameters alone overflow memory
    are not traced. The result is the same as tracing every candidate.

    With ``pipeline`` (the default), a step that can be pipelined (one with a ``pipelined(microbatches)``
    attribute giving its pipelined step, as ``meshtorch plan``'s LM training step) and a processor
    count also searches the pipelined family (:func:`pipeline_layouts`, priced by
    :func:`meshtorch.plan.pipeline.estimate_pipeline`), with the same bounds divided by the
    number of stages (the busiest stage does at least the average work and holds at least the
    average parameters); :meth:`SearchResult.why` compares the two families.

    ``staging``: the backend whose collective buffers the memory holds (see
    :func:`meshtorch.plan.estimate`). ``axes=3`` adds three-axis meshes
    (:func:`meshes_for`), worth it when the device's links differ per axis.
    """
    t0 = time.perf_counter()
    if isinstance(processors, int):
        mesh_list = list(meshes) if meshes is not None else meshes_for(processors, axes)
    else:
        mesh_list = [str(Mesh(processors))]
    n = Mesh(mesh_list[0]).size
    spec = get_device(device, processors=n)
    shallow = _shallow_steps(step_fn)
    quick = shallow is not None
    fns, periods = (shallow[:2], shallow[2]) if shallow is not None else ((step_fn,), 0)
    refs = [trace(f, mesh=REFERENCE_MESH, rules="", backend="meta") for f in fns]
    dims = _dims(refs[0])
    sizes = {m: len(rules_for(m, dims)) for m in mesh_list}
    total = sum(sizes.values())
    if not total:
        raise PlanError(f"no layout of the dims {dims} divides over the meshes {mesh_list}; "
                        "pick a processor count that divides the batch or the model dims")
    if total > max_candidates:
        raise PlanError(
            f"{total} candidates exceed max_candidates={max_candidates} (rule sets per mesh: {sizes}); "
            "pass meshes=[...] with fewer meshes, or a fixed mesh, or raise max_candidates (each "
            "candidate costs a lower bound, microseconds; only those that can win are traced)")
    space = [(m, r) for m in mesh_list for r in rules_for(m, dims)]

    def bounds(m: str, r: str) -> tuple[float, float, float]:
        """Time and memory bounds of the whole step, and the time bound of one period of blocks."""
        b = [lower_bounds(t, m, r, spec) for t in refs]
        if quick:
            return (_lin(b[0][0], b[1][0], periods), _lin(b[0][1], b[1][1], periods), b[1][0] - b[0][0])
        return (*b[0], 0.0)

    lb = {c: bounds(*c) for c in space}
    without_update = getattr(fns[0], "without_update", None)
    partial = without_update() if without_update is not None else None
    order = sorted(space, key=lambda c: lb[c][0])
    done: dict[tuple[str, str], Estimate] = {}
    full: set[tuple[str, str]] = set()
    cut: dict[tuple[str, str], Pruned] = {}

    # time bounds found by tracing part of a candidate, kept for when the loop comes back to it
    traced_bound: dict[tuple[str, str], float] = {}

    def loses(c: tuple[str, str], bound: float) -> bool:
        traced_bound[c] = max(bound, traced_bound.get(c, 0.0))
        if traced_bound[c] >= best_time() * (1 + 1e-9):
            cut[c] = Pruned(c[0], c[1], traced_bound[c], lb[c][1], "time")
            return True
        return False

    def run(c: tuple[str, str], whole: bool) -> Estimate | None:
        if not whole and partial is not None and c not in traced_bound:
            # the shallow step without its update is part of the step's work: if it and the
            # periods' bound already lose, the whole step does
            part = from_trace(trace(partial, mesh=c[0], rules=c[1], backend="meta", staging=staging),
                              c[0], spec, algorithm)
            if loses(c, part.step_seconds + periods * lb[c][2]):
                return None
        if whole or not quick:
            full.add(c)
            return from_trace(trace(step_fn, mesh=c[0], rules=c[1], backend="meta", staging=staging),
                              c[0], spec, algorithm)
        t1 = trace(fns[0], mesh=c[0], rules=c[1], backend="meta", staging=staging)
        e1 = from_trace(t1, c[0], spec, algorithm)
        # the bound per period is one too (it sums per-op and per-parameter bounds), so the
        # shallow step plus it may already lose: skip the deeper trace
        if loses(c, e1.step_seconds + periods * lb[c][2]):
            return None
        t2 = trace(fns[1], mesh=c[0], rules=c[1], backend="meta", staging=staging)
        return from_trace(_extrapolate(t1, t2, periods), c[0], spec, algorithm)

    def best_time() -> float:
        return min((e.step_seconds for e in done.values() if e.fits), default=math.inf)

    while True:
        cut.clear()
        for c in order:
            if c in done:
                continue
            if lb[c][1] > spec.memory_bytes:
                cut[c] = Pruned(c[0], c[1], lb[c][0], lb[c][1], "memory")
            elif lb[c][0] * (1 + 1e-9) >= best_time():
                cut[c] = Pruned(c[0], c[1], lb[c][0], lb[c][1], "time")
            elif c in traced_bound and loses(c, 0.0):
                pass
            elif (e := run(c, False)) is not None:
                done[c] = e
        if not any(e.fits for e in done.values()) and any(p.by == "memory" for p in cut.values()):
            for c in order:  # nothing fits: rank everything by memory
                if c not in done and (e := run(c, False)) is not None:  # no best: never cut
                    done[c] = e
                    cut.pop(c, None)
        # the reported best are traced in full, not extrapolated (their memory may differ a little)
        ranked = sorted(done, key=lambda c: _key(done[c]))[:verify]
        todo = [c for c in ranked if c not in full]
        if not todo:
            break
        for c in todo:
            done[c] = run(c, True)
    results = list(done.values())
    cuts = list(cut.values())
    n_space = len(space)
    pipelined = getattr(step_fn, "pipelined", None)
    if pipeline and pipelined is not None and isinstance(processors, int) and meshes is None:
        family = pipeline_layouts(n, dims, getattr(step_fn, "layers", 0))
        n_space += len(family)
        traced, cut_pipes = _search_pipelines(pipelined, family, spec, algorithm, best_time(),
                                              len(space) + len(family), max_candidates, staging)
        results += traced
        cuts += cut_pipes
    results.sort(key=_key)
    best = min((e.step_seconds for e in results if e.fits), default=math.inf)
    pruned = sorted((replace(p, best=best) for p in cuts), key=lambda p: (p.by == "memory", p.seconds))
    return SearchResult(results, spec.name, time.perf_counter() - t0, space=n_space,
                        pruned_candidates=pruned)


def _search_pipelines(pipelined: Callable[..., Callable[[], Any]], family: list[tuple[str, str, int]],
                      spec: DeviceSpec, algorithm: str, best: float, total: int, max_candidates: int,
                      staging: str = "none") -> tuple[list[Estimate], list[Pruned]]:
    """Branch and bound over the pipelined family, given the best step time found so far."""
    if total > max_candidates:
        raise PlanError(f"{total} candidates (with {len(family)} pipelined ones) exceed max_candidates="
                        f"{max_candidates}; pass pipeline=False (meshtorch plan --no-pipeline), fewer "
                        "processors, or raise max_candidates")
    works = _stage_bounds(pipelined, family, spec)
    lb = {c: (step_time_bound(works[c][0], c[2], spread=works[c][2]), works[c][1]) for c in family}
    traced: list[Estimate] = []
    cut: list[Pruned] = []
    for c in sorted(family, key=lambda c: lb[c][0]):
        mesh, rules, mb = c
        step = pipelined(mb)
        label = f"{step.pipeline['schedule']} x{mb}"
        if lb[c][1] > spec.memory_bytes:
            cut.append(Pruned(mesh, rules, lb[c][0], lb[c][1], "memory", pipeline=label))
        elif lb[c][0] * (1 + 1e-9) >= best:
            cut.append(Pruned(mesh, rules, lb[c][0], lb[c][1], "time", pipeline=label))
        else:
            # stage by stage, the traced work replaces the stage's bound: stop once that loses
            work = list(works[c][0])

            lead = works[c][2]

            def give_up(stage: int, w: float, work: list[float] = work, mb: int = mb,
                        limit: float = best, lead: list[float] = lead) -> bool:
                work[stage] = max(work[stage], w)
                return step_time_bound(work, mb, spread=lead) >= limit * (1 + 1e-9)

            e = estimate_pipeline(step, mesh, rules, spec, algorithm, staging=staging, give_up=give_up)
            if e is None:
                cut.append(Pruned(mesh, rules, step_time_bound(work, mb, spread=lead), lb[c][1], "time",
                                  pipeline=label))
                continue
            traced.append(e)
            if e.fits:
                best = min(best, e.step_seconds)
    return traced, cut


def pipeline_bounds(pipelined: Callable[..., Callable[[], Any]], family: list[tuple[str, str, int]],
                    spec: DeviceSpec) -> dict[tuple[str, str, int], tuple[float, float]]:
    """Lower bounds on the step time and the fullest stage's memory of every pipelined candidate
    ``(mesh, rules, microbatches)`` of ``family``.

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
        >>> from meshtorch.plan.search import pipeline_bounds
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
    bounds = _stage_bounds(pipelined, family, spec)
    return {c: (step_time_bound(work, c[2], spread=lead), mem) for c, (work, mem, lead) in bounds.items()}


def _stage_bounds(pipelined: Callable[..., Callable[[], Any]], family: list[tuple[str, str, int]],
                  spec: DeviceSpec) -> dict[tuple[str, str, int], tuple[list[float], float, list[float]]]:
    """Per candidate, lower bounds on each stage's work and on the fullest stage's memory, and
    on each stage's work between micro-batches (before its update: the FLOPs part of the work
    bound, when the update runs no FLOP op, else nothing)."""
    stages = sorted({Mesh(c[0]).axis_size(PIPELINE_AXIS) for c in family})
    refs = {s: stage_traces(pipelined(s), f"{PIPELINE_AXIS}:{s},{REFERENCE_MESH}", "") for s in stages}
    per_layout: dict[tuple[int, str, str], tuple[list[float], float, list[float]]] = {}
    out = {}
    for c in family:
        m = Mesh(c[0])
        s = m.axis_size(PIPELINE_AXIS)
        rest = ",".join(f"{a}:{m.axis_size(a)}" for a in m.axis_names if a != PIPELINE_AXIS) or "b:1"
        key = (s, rest, c[1])
        if key not in per_layout:
            b = [lower_bounds(t, rest, c[1], spec) for t in refs[s]]
            lead = [flop_bound(t, rest, c[1], spec) if not _update_flops(t) else 0.0 for t in refs[s]]
            per_layout[key] = ([w for w, _ in b], max(mem for _, mem in b), lead)
        out[c] = per_layout[key]
    return out


def _update_flops(t: Trace) -> int:
    up = t.phases.get("update")
    return 0 if up is None else sum(up.flops_by_dtype.values())
