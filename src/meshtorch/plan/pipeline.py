"""``mt.plan.pipeline``: price a pipelined step, stage by stage.

A pipelined step runs on a mesh with a pipeline axis (``stage``): the
processors along it hold consecutive stages of the model, and along the
other axes each stage is an SPMD program laid out by the rules. The planner
traces the step once per stage on the meta backend, as the processor at
that stage (the others' coordinates 0), running the pipeline runtime
itself: each stage's layers (the runtime's partition), its micro-batches in
the schedule's order, the activations it stashes for every micro-batch in
flight (2BW's second weight version included), its own collectives on the
other axes, and the sends along the pipeline axis. Nobody else runs on the
meta backend, so the planner answers the stage's receives: the activations
the previous stage's trace sent it, and for the gradients coming back, a
tensor of each sent activation's shape and dtype
(:func:`meshtorch.pipeline.transport.gradient_message`). Bytes, calls and
peak memory per stage are therefore those of a real run's processor at that
stage, not a model of it.

Time: a stage's traced work (FLOPs at the device's rate, host time per aten
op, and its collectives off the pipeline axis, :mod:`meshtorch.plan.estimate`)
less its update is spread evenly over its micro-batches, one third forward
and two thirds backward (a backward multiplies twice per forward multiply;
with recomputation, one quarter and three quarters), and
:func:`meshtorch.pipeline.simulate` replays the schedule with those durations
and the link time of one activation message per hop, which gives the
schedule's time and the bubble. The update (the runtime marks it with
:func:`meshtorch.context.phase`: optimizer, clipping) runs once per batch,
after a stage's last micro-batch, so the slowest stage's update is added,
and so are the collectives *over* the pipeline axis (the tied embedding's
gradient, the global gradient norm, the loss), which run in it.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.plan.pipeline import estimate_pipeline
    >>> from meshtorch.recipes.lm import TrainConfig
    >>> from meshtorch.recipes.lm.steps import pipelined_training_step
    >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, batch=8, length=8,
    ...                      microbatches=4, schedule="1f1b")
    >>> est = estimate_pipeline(pipelined_training_step(cfg, vocab=16), "stage:2,b:2", "batch:b",
    ...                         device="a100")
    >>> est.stages, est.microbatches, round(est.bubble, 2) > 0, est.transfer_bytes["activations"]
    (2, 4, True, 256)
    >>> 8 // 4 // 2 * 8 * 8 * 4   # one micro-batch's [batch, length, d_model] slice, float32
    256
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtorch.context import current, untraced
from meshtorch.errors import PlanError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.pipeline.executor import BACKWARD_TAG, CHUNK_TAGS, FORWARD_TAG
from meshtorch.pipeline.schedule import build as build_schedule
from meshtorch.pipeline.simulate import simulate
from meshtorch.pipeline.transport import gradient_message, read_header
from meshtorch.plan.cost import collective_seconds
from meshtorch.plan.devices import DeviceSpec
from meshtorch.plan.devices import device as get_device
from meshtorch.plan.estimate import Estimate, _fmt_bytes, collectives_seconds, compute_seconds, from_trace
from meshtorch.plan.program import Pipelining, Program
from meshtorch.plan.tracing import KINDS, Trace, active, trace

POINT_TO_POINT = ("send", "recv")


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor like ``t`` (its bytes too, for a host tensor such as a message header)."""
    if t.device.type == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t.clone()


def _messages(sent: list, dst: int | None, tag: int | None) -> deque[torch.Tensor]:
    """The tensors sent to ``dst`` (any stage for ``None``) with ``tag`` (any forward tag, of any
    chunk, for ``None``)."""
    return deque(t for _, d, g, t in sent if (dst is None or d == dst) and (
        g == tag if tag is not None else g % CHUNK_TAGS == FORWARD_TAG))


class _Inbox:
    """Answers the recvs of the stage ``stage`` of ``stages`` traced alone: forward activations
    from the previous stage replay what its trace sent (per tag: one per model chunk boundary);
    gradients, and activations from a stage traced later (interleaving's wrap-around from the last
    stage into stage 0, ZB-V's way back up the V from stage ``s+1``), mirror what this stage sent on
    (every chunk boundary carries the same shapes)."""

    def __init__(self, stage: int, stages: int, sent_before: list):
        self.stage, self.stages, self.sent_before = stage, stages, sent_before
        self.forward: dict[int, deque[torch.Tensor]] = {}
        self.replies: deque[torch.Tensor] = deque()
        self.echoes: deque[torch.Tensor] = deque()
        self.answered = 0  # this stage's forward messages already mirrored as gradients
        self.echoed = 0  # ... and as activations coming round from the last stage

    def __call__(self, axes: tuple[str, ...], src: int, tag: int) -> torch.Tensor:
        got = None
        kind = tag % CHUNK_TAGS
        with untraced():  # arriving data: made by the transport, not by the program's ops
            if kind == FORWARD_TAG:
                if src < self.stage:  # the stage traced just before this one
                    if tag not in self.forward:  # the previous stage's messages of this chunk boundary
                        self.forward[tag] = _messages(self.sent_before, self.stage, tag)
                    queue = self.forward[tag]
                    got = _stand_in(queue.popleft()) if queue else None
                else:  # from a stage traced later: interleaving's wrap-around into stage 0, the V's way up
                    if not self.echoes:
                        self.echoed = self._mirror(self.echoes, self.echoed, gradients=False)
                    got = self.echoes.popleft() if self.echoes else None
            elif kind == BACKWARD_TAG:
                if not self.replies:
                    self.answered = self._mirror(self.replies, self.answered, gradients=True)
                if self.replies:
                    got = self.replies.popleft()
        if got is not None:
            tr = active()
            if tr is not None and current().comm.staging != "none":
                # torch.distributed receives into a tensor it allocates (the allocator sees it); the
                # threads backend hands over a copy made unseen, so there it is not counted
                tr.track(got)
            return got
        raise PlanError(f"stage {self.stage} waits for a message (tag {tag}) from stage {src} along {axes} "
                        "that no traced stage sends: the step is not a pipeline of the meshtorch runtime "
                        "(meshtorch.pipeline.Pipeline) along this axis")

    def _mirror(self, into: deque, done: int, gradients: bool) -> int:
        """Queue stand-ins of the next forward message this stage sent on: its gradient
        (:func:`gradient_message`) or itself; returns the tensors of sent messages used so far."""
        out = list(_messages(current().comm.sent, None, None))[done:]
        if not out:
            return done
        spec = read_header(out[0])
        k = sum(leaf is not None for leaf in spec["leaves"])
        into.extend(gradient_message(out[0], out[1:1 + k]) if gradients else map(_stand_in, out[:1 + k]))
        return done + 1 + k


def stage_traces(step_fn: Callable[[], Any], mesh: Mesh | str, rules: LayoutRules | str = "",
                 axis: str = "stage", staging: str = "none", device: str = "cpu") -> list[Trace]:
    """The meta trace of every stage of a pipelined step: stage ``s`` as the processor at
    coordinate ``s`` of ``axis`` (0 on the other axes).

    ``step_fn`` runs one step of a :class:`meshtorch.pipeline.Pipeline` along ``axis``
    (e.g. :func:`meshtorch.recipes.lm.steps.pipelined_training_step`); see the module docstring
    for how the stages' receives are answered. ``staging`` is the backend whose collective
    buffers the peak memory holds (:func:`meshtorch.plan.tracing.staging_for`); ``device`` what
    the meta tensors stand for (:func:`meshtorch.plan.tracing.device_type`).
    """
    return _trace_stages(step_fn, mesh, rules, axis, staging, device)[0]


def _trace_stages(step_fn: Callable[[], Any], mesh: Mesh | str, rules: LayoutRules | str, axis: str,
                  staging: str = "none", device: str = "cpu") -> tuple[list[Trace], tuple[int, int]]:
    """The stage traces, and the header and leaf bytes of one activation message of stage 0."""
    pairs = list(_stage_by_stage(step_fn, mesh, rules, axis, staging, device))
    return [t for t, _ in pairs], pairs[-1][1]


def _stage_by_stage(step_fn: Callable[[], Any], mesh: Mesh | str, rules: LayoutRules | str,
                    axis: str, staging: str = "none",
                    device: str = "cpu") -> Iterator[tuple[Trace, tuple[int, int]]]:
    """Each stage's trace in turn (a stage needs what the ones before it sent), with the header
    and leaf bytes of one activation message of stage 0."""
    m = Mesh(mesh)
    if axis not in m.axis_names:
        raise PlanError(f"the pipeline axis {axis!r} is not an axis of the mesh '{m}'; plan a pipeline "
                        f"on a mesh like '{axis}:2,{m}'")
    sent: list = []
    message = (0, 0)
    p = m.axis_size(axis)
    for s in range(p):
        inbox = _Inbox(s, p, sent)
        kept: list = []

        def stage_step(inbox: _Inbox = inbox, kept: list = kept) -> Any:
            comm = current().comm
            comm.inbox = inbox
            kept.append(comm)
            return step_fn()

        rank = m.rank({a: s if a == axis else 0 for a in m.axis_names})
        t = trace(stage_step, mesh=str(m), rules=str(LayoutRules(rules)), backend="meta", rank=rank,
                  staging=staging, device=device)
        sent = kept[0].sent
        if s == 0 and sent:  # a header leads each message, then its leaves
            out = list(_messages(sent, 1, FORWARD_TAG))
            k = sum(leaf is not None for leaf in read_header(out[0])["leaves"])
            message = (int(out[0].numel()), sum(x.numel() * x.element_size() for x in out[1:1 + k]))
        yield t, message


def _on_axis(key: str, axis: str) -> bool:
    return axis in key.split("@")[1].split(",")


def _off_axis(comm_seconds: dict[str, float], axis: str) -> float:
    return sum(v for k, v in comm_seconds.items() if not _on_axis(k, axis))


def stage_work(e: Estimate, axis: str = "stage") -> float:
    """A stage's work per step, as the schedule's replay spreads it over the micro-batches: its
    compute and its collectives off the pipeline ``axis``."""
    return e.compute_seconds + _off_axis(e.comm_seconds, axis)


@dataclass
class PipelineEstimate(Estimate):
    """A pipelined layout's predicted cost: an :class:`Estimate` per stage, and the schedule's.

    The :class:`Estimate` fields describe the busiest processor: ``memory_bytes`` are the
    fullest stage's (``fits``: every stage fits), ``flops``, ``compute_seconds`` and the bytes,
    calls and seconds per axis are the most of any stage; ``step_seconds`` is the replayed
    schedule's step plus the update's collectives over the pipeline axis.

    Attributes:
        axis, stages, schedule, microbatches, recompute, virtual_stages: the pipeline.
        stage_estimates: one :class:`Estimate` per stage (its processor's trace).
        bubble: the schedule's idle share (:func:`meshtorch.pipeline.simulate`).
        in_flight: most micro-batches whose activations a stage holds at once (with virtual
            stages, (micro-batch, chunk) stashes of a chunk's activations each).
        transfer_bytes: one micro-batch's message between neighbouring stages (per processor):
            ``{"activations": bytes, "header": bytes}``.
        messages: point-to-point messages per batch over all stages: ``2m(p·v - 1)``, ``v`` times
            (and then some) one chunk per stage's ``2m(p - 1)``.
        transfer_seconds: link time of one such message (one hop).
        stage_seconds: each stage's work per step (compute plus its collectives off the axis).
        update_seconds: the part of it each stage spends in its update (optimizer, clipping),
            after its last micro-batch.
    """

    axis: str = "stage"
    stages: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    recompute: bool = False
    stage_estimates: list[Estimate] = field(default_factory=list, repr=False)
    bubble: float = 0.0
    in_flight: list[int] = field(default_factory=list)
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    transfer_seconds: float = 0.0
    stage_seconds: list[float] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)
    virtual_stages: int = 1
    messages: int = 0

    @property
    def label(self) -> str:
        chunks = f" of {self.virtual_stages} chunks" if self.virtual_stages > 1 else ""
        return f"pipeline {self.stages}x{self.schedule}{chunks}, {self.microbatches} micro-batches"

    @property
    def _stashes(self) -> str:
        return "(micro-batch, chunk) stashes" if self.virtual_stages > 1 else "micro-batches"

    def reason(self) -> str:
        busiest = max(range(self.stages), key=lambda s: self.stage_seconds[s])
        fullest = max(range(self.stages), key=lambda s: self.stage_estimates[s].memory_bytes["total"])
        text = (f"{self.label}: bubble {self.bubble:.0%}, stage {busiest} busiest "
                f"({self.stage_seconds[busiest] * 1e3:.1f} ms), "
                f"{_fmt_bytes(self.transfer_bytes['activations'])} per micro-batch between stages; "
                f"stage {fullest} fullest "
                f"({self.in_flight[fullest]} {self._stashes} in flight)")
        if not self.fits:
            over = self.memory_bytes["total"] - self.memory_capacity
            return (f"does not fit: stage {fullest} needs {_fmt_bytes(self.memory_bytes['total'])} > "
                    f"{_fmt_bytes(self.memory_capacity)} by {_fmt_bytes(over)}; {text}")
        return text

    def table(self) -> str:
        lines = [f"mesh '{self.mesh}'  rules '{self.rules}'  device {self.device}  "
                 f"{self.label}{' (recompute)' if self.recompute else ''}",
                 f"parameters        {self.parameters:,} ({self.parameters / 1e9:.2f}B)",
                 f"{'stage':<7}{'FLOPs':>12}{'work ms':>10}{'update':>8}{'in flight':>11}"
                 f"{'memory':>12}  fits  "
                 f"bytes over '{self.axis}' (send/collectives)"]
        for s, e in enumerate(self.stage_estimates):
            on_axis = sum(b for axes, kinds in e.bytes_per_axis.items() if self.axis in axes.split(",")
                          for b in kinds.values())
            lines.append(f"{s:<7}{e.flops:>12.3e}{self.stage_seconds[s] * 1e3:>10.2f}"
                         f"{self.update_seconds[s] * 1e3:>8.2f}{self.in_flight[s]:>11}"
                         f"{_fmt_bytes(e.memory_bytes['total']):>12}  {'yes' if e.fits else 'NO ':<4}  "
                         f"{on_axis}")
        lines.append(f"transfer          {self.transfer_bytes['activations']} B activations + "
                     f"{self.transfer_bytes['header']} B header per micro-batch and hop "
                     f"({self.transfer_seconds * 1e3:.3f} ms); {self.messages} messages per batch")
        lines.append(f"step time         {self.step_seconds * 1e3:.2f} ms; {self.reason()}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "pipeline": {
            "axis": self.axis, "stages": self.stages, "schedule": self.schedule,
            "microbatches": self.microbatches, "recompute": self.recompute, "bubble": self.bubble,
            "virtual_stages": self.virtual_stages, "messages": self.messages,
            "in_flight": self.in_flight, "transfer_bytes": self.transfer_bytes,
            "transfer_seconds": self.transfer_seconds, "stage_seconds": self.stage_seconds,
            "update_seconds": self.update_seconds,
            "per_stage": [e.to_json() for e in self.stage_estimates]}}


def program_pipeline(program: Program) -> Pipelining:
    """How ``program`` is pipelined (its ``pipeline``); :class:`PlanError` for an SPMD program."""
    if program.pipeline is None:
        raise PlanError("this program is not pipelined: a pipelined step is a meshtorch.plan.program.Program "
                        "whose 'pipeline' is a Pipelining(schedule, microbatches, axis, recompute), as "
                        "meshtorch.recipes.lm.steps.pipelined_training_step(cfg) is")
    return program.pipeline


def _most(dicts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for d in dicts:
        for axes, kinds in d.items():
            for kind, v in kinds.items():
                out.setdefault(axes, {})[kind] = max(out.get(axes, {}).get(kind, 0), v)
    return out


def from_stage_traces(traces: list[Trace], mesh: Mesh | str, spec: DeviceSpec, *, schedule: str,
                      microbatches: int, axis: str = "stage", recompute: bool = False,
                      algorithm: str = "ring", header: int = 0, virtual_stages: int = 1,
                      activation: int | None = None) -> PipelineEstimate:
    """Cost the stage traces of :func:`stage_traces` on ``spec`` (see the module docstring);
    ``header``: the bytes of an activation message's header (reported apart), ``activation``
    its leaves' (by default stage 0's sends per message less the header)."""
    m = Mesh(mesh)
    p, mb, v = m.axis_size(axis), microbatches, virtual_stages
    ests = [from_trace(t, m, spec, algorithm) for t in traces]
    work, update, sync = [], [], []
    for t, e in zip(traces, ests):
        work.append(stage_work(e, axis))
        sync.append(sum(v for k, v in e.comm_seconds.items() if _on_axis(k, axis)
                        and k.split("@")[0] not in POINT_TO_POINT))
        # the update (optimizer, clipping) runs once, after the stage's last micro-batch
        up = t.phases.get("update")
        update.append(0.0 if up is None else compute_seconds(up.flops_by_dtype, up.aten_ops, spec, up.kernels)
                      + _off_axis(collectives_seconds(up.comm, m, spec, algorithm), axis))
    table = build_schedule(schedule, p, mb, virtual_stages=v)
    # a send occupies its sender too (gloo's isend hands the message to the transport before it
    # returns): a chunk's forward ends with one unless the next model chunk is on the same stage (or
    # there is none), its backward unless the previous one is (simulate gives each of a stage's v
    # chunk passes 1/v of its time). Interleaved: v per stage but the last stage's forwards and stage
    # 0's backwards; ZB-V: one each way but at the V's turn (stage p-1) and its ends (stage 0).
    n = p * v
    sends_f, sends_b = [0] * p, [0] * p
    for c in range(n):
        s = table.where(c)[0]
        sends_f[s] += c < n - 1 and table.where(c + 1)[0] != s
        sends_b[s] += c > 0 and table.where(c - 1)[0] != s
    # stage 0's messages per micro-batch (header + leaves each, of one activation's size)
    first = traces[0].comm
    calls, nbytes = first.calls(axis, "send"), first.bytes(axis, "send")
    messages = mb * (sends_f[0] + sends_b[0])
    hop = 0.0
    if p > 1 and calls:
        link = spec.link(axis)
        hop = collective_seconds("send", nbytes / messages, 2, link.bandwidth, link.latency,
                                 calls // messages, algorithm)
    per_mb = [(w - u) / mb for w, u in zip(work, update)]
    # a backward multiplies twice per forward multiply: one third forward, and under ZB-H1 the
    # backward's two thirds are the input gradient B and the weight gradient W, one third each
    # (with recomputation a quarter each, B also running the forward again)
    share = 0.25 if recompute else 1 / 3
    forward = [w * share + hop * sends_f[s] for s, w in enumerate(per_mb)]
    if table.split_backward:
        sim = simulate(table, forward=forward, comm=hop,
                       backward=[w * (1 - 2 * share) + hop * sends_b[s] for s, w in enumerate(per_mb)],
                       weight=[w * share for w in per_mb])
    else:
        sim = simulate(table, forward=forward, comm=hop,
                       backward=[w * (1 - share) + hop * sends_b[s] for s, w in enumerate(per_mb)])
    fullest = max(ests, key=lambda e: e.memory_bytes["total"])
    comm_seconds: dict[str, float] = {}
    for e in ests:
        for k, sec in e.comm_seconds.items():
            comm_seconds[k] = max(comm_seconds.get(k, 0.0), sec)
    params = ests[0].parameters
    return PipelineEstimate(
        mesh=str(m), rules=traces[0].rules, device=spec.name, parameters=params,
        flops=max(e.flops for e in ests),
        flops_by_dtype=max(ests, key=lambda e: e.flops).flops_by_dtype,
        bytes_per_axis=_most([e.bytes_per_axis for e in ests]),
        calls_per_axis=_most([e.calls_per_axis for e in ests]),
        memory_bytes=dict(fullest.memory_bytes), memory_capacity=spec.usable_memory,
        fits=all(e.fits for e in ests), compute_seconds=max(e.compute_seconds for e in ests),
        comm_seconds=comm_seconds, step_seconds=sim.step_time + max(update) + max(sync),
        axis=axis, stages=p, schedule=schedule, microbatches=mb, recompute=recompute,
        stage_estimates=ests, bubble=sim.bubble_fraction, in_flight=sim.in_flight,
        transfer_bytes={"activations": 0 if p == 1 else activation if activation is not None
                        else (nbytes - header * messages) // messages, "header": header},
        transfer_seconds=hop, stage_seconds=work, update_seconds=update, virtual_stages=v,
        messages=sim.messages)


def microbatch_work(probe: Program, microbatches: int, mesh: Mesh | str, rules: LayoutRules | str = "",
                    device: str | DeviceSpec = "tpu-v2", algorithm: str = "ring",
                    staging: str = "none") -> Iterator[float]:
    """Lower bounds on each stage's work (:func:`stage_work`) of a pipelined step of ``microbatches``
    micro-batches, stage by stage, from the stage traces of ``probe``: the step's one micro-batch
    (the program's ``one_microbatch()``, e.g.
    :meth:`meshtorch.recipes.lm.steps.TrainingProgram.one_microbatch`), whose measured block runs
    one micro-batch's forwards and backwards and nothing else.

    The step runs each of the probe's ops and collectives once per micro-batch, on tensors of the
    same shapes (the first micro-batch's backward makes the gradients that the later ones add to:
    the step has more ops, never fewer), besides its update. A stage's compute seconds are sums
    over its ops (FLOPs at the rate of their dtype and shape, host time per op, kernel rooflines),
    or the larger of two such sums plus syncs, and its collectives' seconds are linear in their
    bytes and calls; so the stage's work is at least ``microbatches`` times the probe's. One
    micro-batch costs a fraction of the step's trace (no warm-up step, no update, ``1 /
    microbatches`` of its forwards and backwards): the search (:func:`meshtorch.plan.search`)
    prunes with it before it traces a pipelined candidate whole.

    Example:
        >>> from meshtorch.plan.pipeline import estimate_pipeline, microbatch_work
        >>> from meshtorch.recipes.lm import TrainConfig
        >>> from meshtorch.recipes.lm.steps import pipelined_training_step
        >>> cfg = TrainConfig.of(d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, batch=8, length=8,
        ...                      microbatches=4)
        >>> step = pipelined_training_step(cfg, vocab=16)
        >>> bound = list(microbatch_work(step.one_microbatch(), 4, "stage:2,b:2", "batch:b", "a100"))
        >>> work = estimate_pipeline(step, "stage:2,b:2", "batch:b", "a100").stage_seconds
        >>> all(0 < b <= w for b, w in zip(bound, work)), len(bound)
        (True, 2)
    """
    m = Mesh(mesh)
    spec = get_device(device, processors=m.size)
    axis = program_pipeline(probe).axis
    for t, _ in _stage_by_stage(probe, m, rules, axis, staging, spec.device_type):
        yield microbatches * stage_work(from_trace(t, m, spec, algorithm), axis)


def estimate_pipeline(step_fn: Program, mesh: Mesh | str, rules: LayoutRules | str = "",
                      device: str | DeviceSpec = "tpu-v2", algorithm: str = "ring",
                      staging: str = "none", *, give_up: Callable[[int, float], bool] | None = None
                      ) -> PipelineEstimate | None:
    """Predict a pipelined step's per-stage bytes, calls and peak memory, its bubble and step time.

    ``step_fn`` is a :class:`~meshtorch.plan.program.Program` that runs one step of a pipeline
    along the mesh axis its ``pipeline`` (:class:`~meshtorch.plan.program.Pipelining`) names, e.g.
    ``meshtorch.recipes.lm.steps.pipelined_training_step(cfg)``; ``mesh`` has that axis.
    ``staging`` names the backend whose collective buffers each stage's peak memory holds
    (:func:`meshtorch.plan.tracing.staging_for`). ``give_up(stage, work)``, if given, is called with
    each stage's work (:func:`stage_work`) as soon as that stage is traced; when it returns True
    the rest is not traced and the result is None (a search that already knows the layout loses).
    """
    from meshtorch.plan.layered import check_pipelined_depth

    check_pipelined_depth(step_fn)
    m = Mesh(mesh)
    info = program_pipeline(step_fn)
    spec = get_device(device, processors=m.size)
    traces, message = [], (0, 0)
    for t, h in _stage_by_stage(step_fn, m, rules, info.axis, staging, spec.device_type):
        traces.append(t)
        message = h
        if give_up is not None and give_up(len(traces) - 1,
                                           stage_work(from_trace(t, m, spec, algorithm), info.axis)):
            return None
    return from_stage_traces(traces, m, spec, schedule=info.schedule, microbatches=info.microbatches,
                             axis=info.axis, recompute=info.recompute, algorithm=algorithm,
                             header=message[0], activation=message[1], virtual_stages=info.virtual_stages)


__all__ = ["KINDS", "PipelineEstimate", "estimate_pipeline", "from_stage_traces", "microbatch_work",
           "program_pipeline", "stage_traces", "stage_work"]
