"""``mt.plan.estimate``: per-processor FLOPs, bytes, memory and step time of one layout.

The step is traced on the ``meta`` backend (:mod:`meshtorch.plan.tracing`);
the device spec turns the trace into seconds. On a CPU (a spec without kernel numbers):
matmul FLOPs at the device's achievable rate for their dtype plus the host's time per
aten op (``op_seconds``, measured). On a GPU (``launch_seconds > 0``): each op's roofline,
max(FLOPs / its matmul rate, bytes / bandwidth) plus its launches, the host's time run
ahead of the device, and the host syncs (:func:`meshtorch.plan.kernels.roofline_seconds`).
Every collective is priced by the ring (or tree) formulas of :mod:`meshtorch.plan.cost`
over its axes' links. Compute and communication add up, except where the step runs a
collective asynchronously (:func:`meshtorch.overlap`: prefetched gathers, gradient buckets): there
a window costs the larger of its compute and its communication (:mod:`meshtorch.plan.timeline`),
and ``overlap_seconds`` is the communication hidden behind compute.

Example:
    >>> import meshtorch as mt
    >>> def step():
    ...     ff = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256), bias=False)
    ...     x = mt.random.normal("batch:32,d_model:64", seed=1)
    ...     with mt.plan.measure():
    ...         mt.reduce_sum(ff(x)).backward()
    >>> est = mt.plan.estimate(step, "b:4,m:2", "batch:b; d_ff:m", device="a100")
    >>> est.fits, est.parameters == 64 * 256
    (True, True)
    >>> sorted(est.bytes_per_axis)   # the loss's sum over batch and d_ff: one all_reduce over (b,m)
    ['b', 'b,m']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshtorch.comm.stats import CommStats
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.plan.cost import collective_seconds
from meshtorch.plan.devices import DeviceSpec
from meshtorch.plan.devices import device as get_device
from meshtorch.plan.kernels import Kernel, roofline_seconds
from meshtorch.plan.layered import lin
from meshtorch.plan.timeline import simulate
from meshtorch.plan.tracing import KINDS, Trace


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class Estimate:
    """A layout's predicted cost on one processor (all numbers per processor, per step).

    Attributes:
        mesh, rules, device: what was planned.
        parameters: global parameter count.
        flops: FLOPs of the measured step on one processor (by dtype in ``flops_by_dtype``).
        bytes_per_axis: ``{axes: {kind: payload bytes}}`` (axes joined by ``,``).
        calls_per_axis: the same, counting calls.
        memory_bytes: peak bytes split into ``parameters, gradients, optimizer,
            activations``, and their ``total``.
        memory_capacity: what the peak may be: the device's memory, on a GPU less its CUDA
            context and its allocator's fragmentation margin (``DeviceSpec.usable_memory``).
        fits: whether ``memory_bytes["total"]`` fits ``memory_capacity``.
        compute_seconds, comm_seconds (``{"kind@axes": s}``), step_seconds.
        compute_terms: on a GPU, the compute's parts (``matmul``, ``attention``, ``memory``,
            ``launch``, ``device``, ``host``, ``sync``; :func:`~meshtorch.plan.kernels.roofline_seconds`).
        overlap_seconds: the communication that runs while the step computes (asynchronous
            collectives, :mod:`meshtorch.plan.timeline`): ``step_seconds`` is compute plus
            communication minus it.
        reshard_after_forward: the step frees gathered parameters after forward and gathers them
            again for backward (:func:`meshtorch.overlap`): what a search picks where memory is tight.
    """

    mesh: str
    rules: str
    device: str
    parameters: int
    flops: int
    flops_by_dtype: dict[str, int]
    bytes_per_axis: dict[str, dict[str, int]]
    calls_per_axis: dict[str, dict[str, int]]
    memory_bytes: dict[str, int]
    memory_capacity: int
    fits: bool
    compute_seconds: float
    comm_seconds: dict[str, float]
    step_seconds: float
    trace: Trace | None = field(default=None, repr=False, compare=False)
    compute_terms: dict[str, float] = field(default_factory=dict)
    overlap_seconds: float = 0.0
    reshard_after_forward: bool = False

    @property
    def comm_total_seconds(self) -> float:
        return sum(self.comm_seconds.values())

    def dominant(self, k: int = 2) -> list[tuple[str, float]]:
        """The ``k`` costliest parts of the step: ``compute`` or ``kind@axes``, with seconds."""
        parts = [("compute", self.compute_seconds), *self.comm_seconds.items()]
        return sorted(parts, key=lambda p: -p[1])[:k]

    def reason(self) -> str:
        """Why this layout costs what it costs, in a few words."""
        parts = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in self.dominant(2) if s > 0)
        if not self.fits:
            over = self.memory_bytes["total"] - self.memory_capacity
            big = max(("parameters", "gradients", "optimizer", "activations"),
                      key=lambda k: self.memory_bytes[k])
            return (f"does not fit: {_fmt_bytes(self.memory_bytes['total'])} > "
                    f"{_fmt_bytes(self.memory_capacity)} by {_fmt_bytes(over)} (mostly {big}); {parts}")
        return f"dominated by {parts}"

    def table(self) -> str:
        """A human-readable report."""
        m = self.memory_bytes
        lines = [
            f"mesh '{self.mesh}'  rules '{self.rules}'  device {self.device}",
            f"parameters        {self.parameters:,} ({self.parameters / 1e9:.2f}B)",
            f"FLOPs/processor   {self.flops:.3e}  -> {self.compute_seconds * 1e3:.2f} ms",
            "memory/processor  " + "  ".join(f"{k} {_fmt_bytes(m[k])}" for k in KINDS)
            + f"  = {_fmt_bytes(m['total'])} of {_fmt_bytes(self.memory_capacity)}"
            + ("" if self.fits else "  DOES NOT FIT"),
            f"{'collective':<16}{'axes':<14}{'calls':>7}{'bytes':>14}{'ms':>10}",
        ]
        if self.compute_terms:
            c = self.compute_terms
            lines.insert(3, "compute           " + "  ".join(
                f"{k} {c[k] * 1e3:.2f}" for k in ("matmul", "attention", "memory", "launch")) +
                f" = device {c['device'] * 1e3:.2f} ms; host {c['host'] * 1e3:.2f} ms; "
                f"syncs {c['sync'] * 1e3:.2f} ms")
        for axes, kinds in sorted(self.bytes_per_axis.items()):
            for kind, b in sorted(kinds.items()):
                s = self.comm_seconds.get(f"{kind}@{axes}", 0.0)
                # the header's columns, each after a space: a number wider than its column (a
                # billion-layer plan's) pushes the rest right instead of running into its neighbour
                lines.append(f"{kind:<15} {axes:<13} {self.calls_per_axis[axes][kind]:>6} {b:>13}"
                             f" {s * 1e3:>9.2f}")
        hidden = (f" - {self.overlap_seconds * 1e3:.2f} overlapped with compute"
                  if self.overlap_seconds else "")
        lines.append(f"step time         {self.step_seconds * 1e3:.2f} ms "
                     f"(compute {self.compute_seconds * 1e3:.2f} + communication "
                     f"{self.comm_total_seconds * 1e3:.2f}{hidden}); {self.reason()}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``meshtorch plan --json`` object)."""
        return {
            "mesh": self.mesh, "rules": self.rules, "device": self.device,
            "parameters": self.parameters, "fits": self.fits,
            "memory_bytes": {**self.memory_bytes, "capacity": self.memory_capacity},
            "bytes_per_axis": self.bytes_per_axis, "calls_per_axis": self.calls_per_axis,
            "flops": self.flops, "flops_by_dtype": self.flops_by_dtype,
            "compute_seconds": self.compute_seconds, "comm_seconds": self.comm_seconds,
            "step_seconds": self.step_seconds, "overlap_seconds": self.overlap_seconds,
            **({"reshard_after_forward": True} if self.reshard_after_forward else {}),
            "reason": self.reason(),
            **({"compute_terms": self.compute_terms} if self.compute_terms else {}),
        }

    def __str__(self) -> str:
        return self.table()


def compute_seconds(flops_by_dtype: dict[str, int], aten_ops: int, spec: DeviceSpec,
                    kernels: dict[Kernel, float] | None = None) -> float:
    """Seconds of ``flops_by_dtype`` at ``spec``'s rates plus ``aten_ops`` host ops at its ``op_seconds``;
    on a GPU spec, given the trace's ``kernels``, their roofline step instead
    (:func:`meshtorch.plan.kernels.roofline_seconds`).

    Example:
        >>> from meshtorch.plan.devices import device
        >>> from meshtorch.plan.estimate import compute_seconds
        >>> spec = device("a100")
        >>> compute_seconds({"float32": 10 ** 12}, 0, spec) == 10 ** 12 / spec.flops_per_second("float32")
        True
    """
    if spec.roofline and kernels:
        return roofline_seconds(kernels, aten_ops, spec)["step"]
    # on a CPU the host's per-op work (Python, dispatch, autograd) is most of a small step
    return sum(f / spec.flops_per_second(dt) for dt, f in flops_by_dtype.items()) + aten_ops * spec.op_seconds


def collectives_seconds(comm: CommStats, mesh: Mesh | str, spec: DeviceSpec,
                        algorithm: str = "ring") -> dict[str, float]:
    """Seconds of each ``"kind@axes"`` of ``comm`` over ``mesh``'s links on ``spec``: the
    slowest link's bandwidth and latency of its axes (:mod:`meshtorch.plan.cost`).

    Example:
        >>> from meshtorch.comm.stats import CommStats
        >>> from meshtorch.plan.devices import Link, device
        >>> from meshtorch.plan.estimate import collectives_seconds
        >>> c = CommStats()
        >>> c.record("all_reduce", ("b",), 4000)
        >>> spec = device("a100").with_links(b=Link(bandwidth=1e9, latency=1e-5))
        >>> collectives_seconds(c, "b:2", spec)   # 2·(1/2)·4000 B / 1 GB/s + 2 hops of 10 µs
        {'all_reduce@b': 2.4e-05}
    """
    mesh = Mesh(mesh)
    out: dict[str, float] = {}
    for key, v in comm.as_dict().items():
        kind, axes_s = key.split("@")
        out[key] = _call_seconds(kind, axes_s.split(","), v["bytes"], mesh, spec, algorithm, v["calls"])
    return out


def _call_seconds(kind: str, axes, nbytes: float, mesh: Mesh, spec: DeviceSpec, algorithm: str,
                  calls: int = 1) -> float:
    """Seconds of ``calls`` calls of ``kind`` over ``axes`` moving ``nbytes``: the slowest link's."""
    n = math.prod(mesh.axis_size(a) for a in axes)
    links = [spec.link(a) for a in axes]
    bw, lat = min(lk.bandwidth for lk in links), max(lk.latency for lk in links)
    return collective_seconds(kind, nbytes, n, bw, lat, calls, algorithm)


def overlap_seconds(t: Trace, mesh: Mesh | str, spec: DeviceSpec, algorithm: str = "ring") -> float:
    """The communication of ``t`` that runs while it computes: compute plus communication minus
    the step's time on :func:`meshtorch.plan.timeline.simulate`'s two clocks (0 where no call is
    asynchronous); for an extrapolated trace, extrapolated from its two shallow ones.

    Example (data parallel under mt.overlap: gradients' all_reduces run during backward, the
    loss's until it is read):
        >>> import meshtorch as mt
        >>> from meshtorch.plan.estimate import from_trace, overlap_seconds
        >>> def step():
        ...     a = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256))
        ...     b = mt.nn.Dense(mt.Dim("d_ff", 256), mt.Dim("d_model", 64))
        ...     with mt.plan.measure(), mt.overlap(bucket_mb=0.01):  # a bucket per parameter
        ...         mt.reduce_sum(b(a(mt.random.normal("batch:32,d_model:64", seed=1))) ** 2).backward()
        >>> t = mt.plan.trace(step, mesh="b:2", rules="batch:b")
        >>> [kind for kind, axes, nbytes, asynchronous in t.timeline.calls if asynchronous]
        ['all_reduce', 'all_reduce', 'all_reduce', 'all_reduce', 'all_reduce']
        >>> spec = mt.plan.device("tpu-v2")
        >>> est = from_trace(t, "b:2", spec)
        >>> est.overlap_seconds > 0, est.overlap_seconds == overlap_seconds(t, "b:2", spec)
        (True, True)
    """
    mesh = Mesh(mesh)
    if t.shallow is not None:
        return _deep_overlap_seconds(t, mesh, spec, algorithm)
    if t.timeline is None or t.end is None:
        return 0.0
    terms = roofline_seconds(t.kernels, t.aten_ops, spec) if spec.roofline and t.kernels else {}
    total = terms["step"] if terms else compute_seconds(t.flops_by_dtype, t.aten_ops, spec)

    def compute(ops: int, flops: dict[str, int], kernels: dict) -> float:
        if terms:
            return roofline_seconds(kernels, ops, spec)["step"] if kernels or ops else 0.0
        return compute_seconds(flops, ops, spec)

    def comm(kind: str, axes: tuple[str, ...], nbytes: int) -> float:
        return _call_seconds(kind, axes, nbytes, mesh, spec, algorithm)

    step = simulate(t.timeline.order(t.end, compute, comm, total))
    summed = total + sum(collectives_seconds(t.comm, mesh, spec, algorithm).values())
    return max(0.0, summed - step)


def _deep_overlap_seconds(t: Trace, mesh: Mesh, spec: DeviceSpec, algorithm: str) -> float:
    """The overlap of ``t``, extrapolated ``periods`` periods deeper than its shallow trace ``t1``
    from ``t2``, one period deeper (``t.shallow``). Where every period adds the same calls (the
    deep step's counts lie on the shallow ones' line), the timeline repeats by period and so
    does what it hides: a line through the two overlaps (exact). Where it does not (gradient
    buckets cut at a quarter of the gradients: :mod:`meshtorch.plan.layered` counts them), ``t2``'s
    overlap plus the asynchronous communication that the added periods add, up to the compute
    they add: their gradient buckets are issued amid their compute and hide behind it, while
    what ``t2`` leaves exposed stays as it is (the buckets launched after backward's last op, the
    loss's reduction); their grouped gathers (FSDP's, and regathers after resharding) hide at the
    share that ``t2`` hides of its asynchronous communication. A line was 16% short for a
    6-layer LM whose shallowest depth has too little compute to hide its buckets behind and cuts
    them differently. Blocking calls grow on a line, as counted."""
    t1, t2, periods = t.shallow
    keys = set(t1.comm._calls) | set(t2.comm._calls)
    if all(t.comm._calls.get(k, 0) == lin(t1.comm._calls.get(k, 0), t2.comm._calls.get(k, 0), periods)
           for k in keys):
        return lin(*(overlap_seconds(s, mesh, spec, algorithm) for s in (t1, t2)), periods)

    def compute(s: Trace) -> float:
        if spec.roofline and s.kernels:
            return roofline_seconds(s.kernels, s.aten_ops, spec)["step"]
        return compute_seconds(s.flops_by_dtype, s.aten_ops, spec)

    def comm(s: Trace, reduce: bool) -> float:  # (reduce: the gradients' kinds, else gathers)
        return sum(v for k, v in collectives_seconds(s.comm, mesh, spec, algorithm).items()
                   if (k.split("@")[0] != "all_gather") == reduce)

    def blocking(s: Trace, reduce: bool) -> float:
        if s.timeline is None:
            return comm(s, reduce)
        return sum(_call_seconds(kind, axes, nbytes, mesh, spec, algorithm)
                   for kind, axes, nbytes, asynchronous in s.timeline.calls
                   if not asynchronous and (kind != "all_gather") == reduce)

    def added(reduce: bool) -> float:  # asynchronous communication added (gradients' or gathers')
        blocked = lin(blocking(t1, reduce), blocking(t2, reduce), periods)
        return (comm(t, reduce) - blocked) - (comm(t2, reduce) - blocking(t2, reduce))

    hidden = overlap_seconds(t2, mesh, spec, algorithm)
    # grouped gathers (FSDP's, prefetched a bucket ahead) are waited on at the next bucket: each
    # period's hide as much of themselves as t2's asynchronous calls do of theirs (all of them
    # made the 6- and 12-layer FSDP LM's step 7.6% and 10.3% short of its whole trace), while
    # gradient buckets (all_reduce, reduce_scatter) hide behind the compute added before they
    # are waited on, as t2's: reshard_after_forward -2.3% / -2.6%, without 0.5% / 1.7%
    # (tests/test_plan_overlap.py)
    asynchronous = sum(comm(t2, r) - blocking(t2, r) for r in (True, False))
    share = min(1.0, hidden / asynchronous) if asynchronous > 0 else 0.0
    more = added(True) + share * added(False)
    return hidden + max(0.0, min(more, compute(t) - compute(t2)))


def from_trace(t: Trace, mesh: Mesh | str, spec: DeviceSpec, algorithm: str = "ring") -> Estimate:
    """Cost a trace on ``spec``."""
    mesh = Mesh(mesh)
    bytes_per_axis: dict[str, dict[str, int]] = {}
    calls_per_axis: dict[str, dict[str, int]] = {}
    for key, v in t.comm.as_dict().items():
        kind, axes_s = key.split("@")
        bytes_per_axis.setdefault(axes_s, {})[kind] = v["bytes"]
        calls_per_axis.setdefault(axes_s, {})[kind] = v["calls"]
    comm_seconds = collectives_seconds(t.comm, mesh, spec, algorithm)
    # a compiled step's host launches its kernels (one call each) instead of dispatching aten ops
    host_ops = sum(c for k, c in t.kernels.items() if k[5]) if t.compiled else t.aten_ops
    terms = roofline_seconds(t.kernels, host_ops, spec) if spec.roofline and t.kernels else {}
    compute = terms["step"] if terms else compute_seconds(t.flops_by_dtype, t.aten_ops, spec)
    memory = dict(t.peak_by_kind)
    memory["total"] = t.peak_bytes
    params = t.parameters
    if isinstance(t.result, dict) and "parameters" in t.result:
        params = int(t.result["parameters"])
    # hidden communication is at most the communication and at most the compute it hides behind:
    # an extrapolated trace's overlap (a line through two shallow traces' overlaps, whose slope may
    # exceed the communication's) could otherwise make a deep step faster than its compute
    comm = sum(comm_seconds.values())
    hidden = min(overlap_seconds(t, mesh, spec, algorithm), compute, comm)
    return Estimate(
        mesh=str(mesh), rules=t.rules, device=spec.name, parameters=params, flops=t.flops,
        flops_by_dtype=t.flops_by_dtype, bytes_per_axis=bytes_per_axis, calls_per_axis=calls_per_axis,
        memory_bytes=memory, memory_capacity=spec.usable_memory, fits=t.peak_bytes <= spec.usable_memory,
        compute_seconds=compute, comm_seconds=comm_seconds,
        step_seconds=max(compute + comm - hidden, compute, comm), trace=t, compute_terms=terms,
        overlap_seconds=hidden)


def estimate(step_fn: Callable[[], Any], mesh: Mesh | str, rules: LayoutRules | str = "",
             device: str | DeviceSpec = "tpu-v2", algorithm: str = "ring", staging: str = "none",
             compiled: bool = False) -> Estimate:
    """Predict one processor's FLOPs, bytes per axis and kind, peak memory and step time.

    ``step_fn`` is an SPMD program that builds its model, optimizer and data
    and runs one step (put the step in :func:`meshtorch.plan.measure` to leave
    a warm-up out of the counts; ``meshtorch plan``'s training step
    does). It runs once, on meta tensors: planning a 512-processor mesh needs
    no storage. ``staging`` names the backend whose collective buffers the
    peak memory holds (:func:`meshtorch.plan.tracing.staging_for`: ``"gloo"``
    for a run on the torch backend on CPUs, ``"none"`` for threads).
    """
    mesh = Mesh(mesh)
    spec = get_device(device, processors=mesh.size)
    from meshtorch.plan.layered import whole_trace

    # a program deeper than MAX_TRACED_LAYERS is extrapolated from two shallow traces
    t = whole_trace(step_fn, mesh=str(mesh), rules=str(LayoutRules(rules)), staging=staging,
                    compiled=compiled, device=spec.device_type)
    return from_trace(t, mesh, spec, algorithm)

