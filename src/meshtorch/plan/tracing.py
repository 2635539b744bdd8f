"""A named-dim trace of one SPMD step: FLOPs, collectives and live memory by kind.

:class:`Tracer` is a ``TorchDispatchMode`` that sees every aten op one
processor runs. For each op it records the FLOPs (``torch.utils.flop_counter``'s
formulas, by dtype), and it follows every storage the op creates from birth to
death (a ``weakref.finalize`` on the storage), so the live bytes at any moment
are known on ``meta`` tensors as on real ones. Storages are classified as

- ``parameters``: registered to a ``torch.nn.Module`` while tracing,
- ``gradients``: a parameter's ``.grad`` (post-accumulate-grad hook),
- ``optimizer``: held in a ``torch.optim.Optimizer``'s ``state`` after ``step()``,
- ``activations``: everything else,

and the peak is reported split by kind. The tracer also watches the
MeshTensor layer: each MeshTensor created is one entry of the named-dim trace
(its shape, layout, the aten ops and collectives that made it, their FLOPs).

FLOPs and collectives are counted only inside :func:`measure` blocks when the
traced program has any (so a warm-up step can create optimizer state first),
and so is the memory peak (counting what was alive when the block began:
the peak of a steady-state step, not of the model's initialisation).

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.plan import measure, trace
    >>> def step():
    ...     w = mt.nn.Dense(mt.Dim("d_model", 64), mt.Dim("d_ff", 256), bias=False)
    ...     x = mt.random.normal("batch:32,d_model:64", seed=1)
    ...     with measure():
    ...         mt.reduce_sum(w(x)).backward()
    >>> t = trace(step, mesh="b:2,m:4", rules="batch:b; d_ff:m")
    >>> t.flops == 2 * (2 * 16 * 64 * 64)   # forward and weight-gradient matmuls of the slices
    True
    >>> t.comm.bytes("b", "all_reduce"), t.peak_by_kind["parameters"], t.peak_by_kind["gradients"]
    (16384, 16384, 16384)
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from meshtorch.comm.meta import STAGING, MetaCommunicator
from meshtorch.comm.stats import CommStats
from meshtorch.context import current, use_tracer
from meshtorch.errors import PlanError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh
from meshtorch.plan.allocator import block_bytes
from meshtorch.plan.compiled_memory import compiled_timeline, peak_of
from meshtorch.plan.kernels import Kernel, SequenceOp, footprint, fuse_elementwise, kernel_of
from meshtorch.plan.shape_memo import run as run_op
from meshtorch.plan.shape_memo import tensors_in
from meshtorch.plan.timeline import Mark, Timeline

KINDS = ("parameters", "gradients", "optimizer", "activations")

_install_lock = threading.Lock()
_installed = 0
_undo: list[Callable[[], None]] = []


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now (``False`` where this
    torch has no ``_current_graph_task_id``: every op is then taken for a forward one)."""
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task is not None and graph_task() != -1


def active() -> Tracer | None:
    """The planner's tracer of the processor running this code, if it is traced."""
    tr = current().tracer
    return tr if isinstance(tr, Tracer) else None


@dataclass
class TraceOp:
    """One MeshTensor made by the traced program: its named shape and what it cost."""

    shape: str
    layout: str
    local_bytes: int
    aten: tuple[str, ...]
    flops: int
    collectives: tuple[tuple[str, tuple[str, ...], int], ...]

    def __str__(self) -> str:
        comm = ", ".join(f"{k}@{','.join(a)}:{b}B" for k, a, b in self.collectives)
        return (f"[{self.shape}] {self.layout} {'+'.join(self.aten) or '-'} flops={self.flops}"
                + (f" comm={comm}" if comm else ""))


@dataclass
class Phase:
    """The counted work of the blocks marked :func:`meshtorch.context.phase` ``(name)``
    (included in the trace's totals too): aten ops, FLOPs by dtype, collectives."""

    aten_ops: int = 0
    flops_by_dtype: dict[str, int] = field(default_factory=dict)
    comm: CommStats = field(default_factory=CommStats)
    kernels: dict[Kernel, float] = field(default_factory=dict)


@dataclass
class Trace:
    """What one processor did: FLOPs, collectives, memory peak by kind, and the op list.

    ``parameters`` counts the global elements of every parameter registered
    while tracing (each once, whatever its layout); ``aten_ops`` the aten ops
    counted (what the host's share of a step scales with, priced by a device's
    ``op_seconds``), ``aten_names`` their names in the order they ran, ``kernels`` how many
    times each :data:`~meshtorch.plan.kernels.Kernel` (an op's bytes moved, matmul shape,
    launches, syncs) ran: what a GPU's roofline prices (``compiled``: the kernels of the step
    as ``torch.compile`` runs it, whose host launches kernels rather than running aten ops).
    """

    mesh: str
    rules: str
    backend: str
    parameters: int = 0
    flops: int = 0
    flops_by_dtype: dict[str, int] = field(default_factory=dict)
    comm: CommStats = field(default_factory=CommStats)
    peak_bytes: int = 0
    peak_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    ops: list[TraceOp] = field(default_factory=list)
    result: Any = None
    wall_s: float = 0.0
    flop_ops: list[tuple[str, int, frozenset[str] | None]] = field(default_factory=list, repr=False)
    # (dim names, global bytes, whether it has a gradient as the step begins or is given one in it)
    param_shapes: list[tuple[tuple[str, ...], int, bool]] = field(default_factory=list, repr=False)
    start_by_kind: dict[str, int] = field(default_factory=dict)
    aten_ops: int = 0
    phases: dict[str, Phase] = field(default_factory=dict)
    aten_names: list[str] = field(default_factory=list, repr=False)
    kernels: dict[Kernel, float] = field(default_factory=dict, repr=False)
    compiled: bool = False  # kernels of the step as torch.compile runs it
    # the step's collectives in order with the compute between them, where any of them was
    # asynchronous (mt.overlap): what the planner prices as overlapped (meshtorch.plan.timeline)
    timeline: Timeline | None = field(default=None, repr=False)
    end: Mark | None = field(default=None, repr=False)  # the compute counted at the end
    # an extrapolated trace's two shallow traces and the periods added (meshtorch.plan.layered)
    shallow: tuple[Trace, Trace, float] | None = field(default=None, repr=False)
    # under mt.overlap, each counted backward's gradients as its buckets were cut ((key, bytes,
    # edge) in backward order) and the caps (meshtorch.lowering.overlap_buckets.Cut), and each
    # counted step's gathered parameters as its grouped gathers were cut ((key, bytes, edge,
    # gathered again in backward) in forward order): what a deeper model's bucket launches and
    # gathers are counted from (meshtorch.plan.layered)
    cuts: list[tuple[list, tuple]] = field(default_factory=list, repr=False)

    def table(self, limit: int = 40) -> str:
        """The named-dim trace, one MeshTensor per line (the first ``limit``)."""
        lines = [str(op) for op in self.ops[:limit]]
        if len(self.ops) > limit:
            lines.append(f"... {len(self.ops) - limit} more")
        return "\n".join(lines)



def _optimizer_read(t: torch.Tensor) -> bool:
    """Whether ``.item()`` of ``t`` is a torch optimizer reading a number it keeps on the device,
    on the meta backend. Its host counters are host tensors there (``torch.optim``'s factories
    keep torch's own default device, :mod:`meshtorch.launcher.meta`), but ``ASGD`` keeps its
    counters and ``eta`` on the parameters' device, and ``Adafactor`` reads norms of its tensors.
    These numbers only set the update's size, which a trace never computes: 1 stands in. Any
    other ``.item()`` of a meta tensor still raises, as the values it would branch on are unknown."""
    if t.device.type != "meta" or t.dim() != 0:
        return False
    frame = sys._getframe(2)
    for _ in range(8):  # (the optimizer's frame is a few above: _get_value, its caller)
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("torch.optim."):
            return True
        frame = frame.f_back
    return False

class Tracer(TorchDispatchMode):
    """Dispatch mode recording FLOPs and storage lifetimes of one processor's ops; the
    processor's tracer (:class:`meshtorch.context.ProcessorTracer`) while it traces."""

    def __init__(self, fuse: bool = False, device: str = "cpu") -> None:
        super().__init__()
        self.device = device  # the kind of device the traced meta tensors stand for
        # with fuse, the counted ops in order with the storages they read and write (what
        # fuse_elementwise prices a compiled step from)
        self.sequence: list[SequenceOp] | None = [] if fuse else None
        self.sequence_at: list[int] = []         # per op of the sequence: the events once it ran
        self.sequence_backward: list[bool] = []  # and whether it ran in autograd's backward
        self._paused = 0  # inside paused() blocks: ops run unseen
        self.stepping = 0  # inside measure() blocks, after their set-up
        self.flops_by_dtype: dict[str, int] = defaultdict(int)
        self.kind: dict[int, str] = {}          # storage serial -> kind (when not activations)
        self.dtypes: dict[int, torch.dtype] = {}  # storage serial -> the dtype it was made for
        self.live: dict[int, tuple[int, int]] = {}  # id(storage) -> (serial, nbytes)
        self.events: list[tuple[int, int]] = []  # (serial, +nbytes | -nbytes) in time order
        self.serial = 0
        self.regions = 0      # measure() blocks entered; when any, count only inside them
        self.windows: list[tuple[int, int]] = []  # event index ranges of measure() blocks
        self.params: list[weakref.ref] = []
        self.param_numel: dict[int, int] = {}  # global elements of each parameter seen
        self.inside = 0
        self.comm = CommStats()
        self.all_comm = CommStats()
        self.all_flops: dict[str, int] = defaultdict(int)
        self.aten_ops = 0  # aten ops run while counting: what a CPU step's dispatch costs scale with
        self.aten_names: list[str] = []  # their names, in order
        self.kernels: dict[Kernel, int] = defaultdict(int)  # each op as a kernel: how often
        self.ops: list[TraceOp] = []
        self._pending_aten: list[str] = []
        self._pending_flops = 0
        self._pending_comm: list[tuple[str, tuple[str, ...], int]] = []
        # for the search's lower bounds: the named dims of every MeshTensor's storage, and of
        # every counted FLOP op, the dims of its operands and result (None: an operand that is
        # no MeshTensor's, e.g. an autograd gradient, so any axis may split it)
        self.names: dict[int, frozenset[str]] = {}
        self.flop_ops: list[list] = []
        self._pending_flop_ops: list[int] = []
        self.param_shapes: dict[int, tuple[tuple[str, ...], int]] = {}  # dim names, global bytes
        self.grad_at_start: set[int] = set()  # parameters with a gradient as the first block began
        self.phases: dict[str, Phase] = {}
        self.grad_in_step: set[int] = set()  # parameters given a gradient inside a measured block
        self.start_by_kind: dict[str, int] = {}
        self.timeline = Timeline()
        self._epoch = 0  # a wait of a call issued before start_counting is not this step's
        self.cuts: list[tuple[list, tuple]] = []  # each counted backward's cut of buckets (Trace.cuts)

    # -------------------------------------------------------------- storages
    def track(self, t: torch.Tensor) -> int:
        """Start following ``t``'s storage (no-op if already followed); its serial."""
        st = t.untyped_storage()
        key = id(st)
        hit = self.live.get(key)
        if hit is not None:
            return hit[0]
        self.serial += 1
        n = st.nbytes()
        if self.device == "cuda" and st.device.type == "meta":
            n = block_bytes(n)  # a GPU's storage is a caching-allocator block (plan/allocator.py)
        self.live[key] = (self.serial, n)
        self.dtypes[self.serial] = t.dtype
        self.events.append((self.serial, n))
        weakref.finalize(st, self._free, key)
        return self.serial

    def _free(self, key: int) -> None:
        serial, n = self.live.pop(key)
        self.names.pop(key, None)
        self.events.append((serial, -n))

    def resized(self, t: torch.Tensor) -> None:
        """``t``'s storage changed size in place (``UntypedStorage.resize_``, which no dispatch
        mode sees: :mod:`meshtorch.lowering.overlap_runtime` frees a gathered parameter after forward and
        fills it again for backward): its old bytes die, its new ones are born, of the same kind."""
        st = t.untyped_storage()
        hit = self.live.get(id(st))
        if hit is None or hit[1] == st.nbytes():
            return
        serial, old = hit
        self.events.append((serial, -old))
        self.serial += 1
        self.live[id(st)] = (self.serial, st.nbytes())
        if serial in self.kind:
            self.kind[self.serial] = self.kind[serial]
        self.dtypes[self.serial] = t.dtype
        self.events.append((self.serial, st.nbytes()))

    def mark(self, t: torch.Tensor | None, kind: str) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        serial = self.track(t)
        # a gradient stolen from an activation buffer is a gradient from then on;
        # parameters stay parameters (an optimizer may list them in its state)
        if self.kind.get(serial) != "parameters":
            self.kind[serial] = kind

    # -------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and _optimizer_read(args[0]):
            return 1.0 if args[0].is_floating_point() else 1
        out = run_op(func, args, kwargs)
        if self._paused:
            return out
        packet = func._overloadpacket
        n, dtype = 0, None
        if packet in flop_registry:
            n = int(flop_registry[packet](*args, **kwargs, out_val=out))
            dtype = next((str(a.dtype).replace("torch.", "") for a in tensors_in(args)), "float32")
            self.all_flops[dtype] += n
            if self.counting:
                self.flops_by_dtype[dtype] += n
                dims: set[str] | None = set()
                for a in tensors_in(args):
                    names = self.names.get(id(a.untyped_storage()))
                    if names is None:
                        dims = None
                        break
                    dims |= names
                self._pending_flop_ops.append(len(self.flop_ops))
                self.flop_ops.append([dtype, n, dims])
            self._pending_flops += n
        self._pending_aten.append(packet.__name__)
        outs = list(tensors_in(out))
        if outs:
            # a view of an input is not new memory, also when the input is not ours
            # (another thread-processor's payload, read during a collective)
            seen = {id(a.untyped_storage()) for a in tensors_in((args, kwargs))}
            for t in outs:
                if id(t.untyped_storage()) not in seen:
                    self.track(t)
        if self.counting:
            self.aten_ops += 1
            self.aten_names.append(packet.__name__)
            if dtype is None:
                dtype = next((str(a.dtype).replace("torch.", "") for a in tensors_in(args)), "float32")
            key = kernel_of(func, args, kwargs, out, n, dtype)
            self.kernels[key] += 1
            if self.sequence is not None:
                self.sequence.append(self._io(key, func, args, kwargs, out))
                self.sequence_at.append(len(self.events))
                self.sequence_backward.append(_in_backward())
        return out

    def _io(self, key: Kernel, func, args, kwargs, out) -> SequenceOp:
        """``key`` with the (storage serial, bytes) its op reads and writes."""
        def serial(t: torch.Tensor) -> int:
            try:
                return self.live.get(id(t.untyped_storage()), (-id(t), 0))[0]
            except RuntimeError:   # no storage (a sparse or nested layout): its own
                return -id(t)

        if not key[5]:
            return key, (), ()
        ins = {id(t): t for t in tensors_in((args, kwargs))}
        mutable = [a for a in func._schema.arguments]
        written = [t for i, a in enumerate(mutable) if a.alias_info is not None and a.alias_info.is_write
                   and i < len(args) for t in tensors_in(args[i])]
        written += [t for t in tensors_in(out) if id(t) not in ins]
        return (key, tuple((serial(t), footprint(t)) for t in ins.values()),
                tuple((serial(t), footprint(t)) for t in written))

    @contextmanager
    def drawing(self) -> Iterator[bool]:
        """Random numbers drawn: initialisation is paused; inside a measured step (a dropout
        mask) the draw's temporaries are followed as the step's memory."""
        if self.stepping:
            yield True
            return
        with self.paused():
            yield False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops of this block are neither counted nor followed as memory (random number
        drawing, a backend's staging copies): they are not the traced program's work."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count this block's work apart too, under ``name`` (:class:`Phase`)."""
        ops, flops, comm = self.aten_ops, dict(self.flops_by_dtype), self.comm.copy()
        kernels = dict(self.kernels)
        try:
            yield
        finally:
            got = self.phases.setdefault(name, Phase())
            got.aten_ops += self.aten_ops - ops
            for k, c in self.kernels.items():
                if c != kernels.get(k, 0):
                    got.kernels[k] = got.kernels.get(k, 0) + c - kernels.get(k, 0)
            for dt, n in self.flops_by_dtype.items():
                got.flops_by_dtype[dt] = got.flops_by_dtype.get(dt, 0) + n - flops.get(dt, 0)
            got.comm = got.comm + (self.comm - comm)

    def observe(self, tensor: Any) -> None:
        """One MeshTensor made: an entry of the named-dim trace."""
        self.record_mesh_tensor(tensor.local, tensor.shape, tensor.layout)

    def start_counting(self) -> None:
        """Forget the FLOPs and collectives counted so far: the measured step starts now."""
        self.comm = CommStats()
        self.flops_by_dtype.clear()
        self.aten_ops = 0
        self.aten_names = []
        self.kernels.clear()
        if self.sequence is not None:
            self.sequence.clear()
            self.sequence_at.clear()
            self.sequence_backward.clear()
        self.flop_ops.clear()
        self._pending_flop_ops = []
        self.phases = {}
        self.timeline = Timeline()
        self.cuts = []
        self._epoch += 1

    @property
    def counting(self) -> bool:
        return self.inside > 0 or self.regions == 0

    def record_collective(self, kind: str, axes: tuple[str, ...], nbytes: int) -> None:
        self.all_comm.record(kind, axes, nbytes)
        if self.counting:
            self.comm.record(kind, axes, nbytes)
            self.timeline.events.append((len(self.timeline.calls), False, self.counted()))
            self.timeline.calls.append([kind, axes, int(nbytes), False])
        self._pending_comm.append((kind, axes, int(nbytes)))

    def cut_buckets(self, items: list, caps: tuple) -> None:
        """A backward's gradient buckets were cut (:class:`meshtorch.lowering.overlap_buckets.Cut`)
        from ``items``, ``(key, bytes, edge)`` in backward order, with ``caps``; or a step's grouped
        gathers, ``(key, bytes, edge, mark)`` in forward order."""
        if self.counting:
            self.cuts.append((items, caps))

    def started(self) -> Callable[[], None]:
        """The call just recorded runs asynchronously (:meth:`meshtorch.comm.stats.CommStats.started`);
        what its wait calls, to put the wait on the timeline."""
        tl = self.timeline
        if not (self.counting and tl.events and tl.events[-1][0] == len(tl.calls) - 1):
            return lambda: None
        call, epoch = len(tl.calls) - 1, self._epoch
        tl.calls[call][3] = True

        def waited() -> None:
            if self._epoch == epoch and self.counting:
                tl.events.append((call, True, self.counted()))

        return waited

    def counted(self) -> Mark:
        """The compute counted so far (a :data:`~meshtorch.plan.timeline.Mark`)."""
        return self.aten_ops, dict(self.flops_by_dtype), dict(self.kernels)

    def record_mesh_tensor(self, local: torch.Tensor, shape, layout) -> None:
        if isinstance(local, torch.Tensor):
            self.track(local)
            nbytes = local.numel() * local.element_size()
            key = id(local.untyped_storage())
            names = frozenset(shape.names)
            self.names[key] = self.names.get(key, frozenset()) | names  # views share storage
            for i in self._pending_flop_ops:
                if self.flop_ops[i][2] is not None:
                    self.flop_ops[i][2] |= names
        else:
            nbytes = 0
        self._pending_flop_ops = []
        self.ops.append(TraceOp(str(shape), str(layout), nbytes, tuple(self._pending_aten),
                                self._pending_flops, tuple(self._pending_comm)))
        self._pending_aten, self._pending_flops, self._pending_comm = [], 0, []

    # -------------------------------------------------------------- results
    def live_by_kind(self) -> dict[str, int]:
        """Bytes alive now, by kind."""
        out = dict.fromkeys(KINDS, 0)
        for serial, n in self.live.values():
            out[self.kind.get(serial, "activations")] += n
        return out

    def compiled_peak(self) -> tuple[int, dict[str, int]]:
        """:meth:`peak` of the step as ``torch.compile`` holds it (:mod:`meshtorch.plan.compiled_memory`:
        fused runs' own storages never made, forward results the backward can remake from less
        not saved); needs the op sequence (``Tracer(fuse=True)``)."""
        if self.sequence is None:
            raise PlanError("compiled_peak needs the op sequence: trace with compiled=True")
        timeline = compiled_timeline(self.sequence, self.sequence_at, self.sequence_backward, self.events,
                                     self.kind, self.dtypes)
        return peak_of(timeline, self.windows, self.kind, KINDS)

    def peak(self) -> tuple[int, dict[str, int]]:
        """Peak live bytes in the measured windows and their split by kind at that moment
        (:func:`~meshtorch.plan.compiled_memory.peak_of` of the events as they happened)."""
        return peak_of([(float(i), serial, delta) for i, (serial, delta) in enumerate(self.events)],
                       self.windows, self.kind, KINDS)


@contextmanager
def measure() -> Iterator[None]:
    """Count FLOPs and collectives of this block only (e.g. the step after a warm-up).

    Outside a trace it does nothing, so a step function can always use it.
    """
    tr = active()
    if tr is None:
        yield
        return
    tr.regions += 1
    tr.inside += 1
    first = not tr.windows and tr.inside == 1
    if first:  # what ran before the first block (a warm-up) was counted in case no block came
        tr.start_counting()
    for ref in tr.params:  # gradients kept from before (assigned, not accumulated)
        p = ref()
        if p is not None:
            if getattr(p, "materialized", True) is False:
                p.materialize()  # a parameter not read yet is initialised now: not part of the step
            tr.mark(p.grad, "gradients")
            if first and p.grad is not None:
                tr.grad_at_start.add(id(p))
    start = len(tr.events)
    if not tr.start_by_kind:
        tr.start_by_kind = tr.live_by_kind()
    tr.stepping += 1
    try:
        yield
    finally:
        tr.stepping -= 1
        tr.inside -= 1
        tr.windows.append((start, len(tr.events)))
        # gradients assigned, not accumulated (mt.overlap adds a reduced bucket into p.grad):
        # kinds are read when the peak is, so their storage counts as gradients all along
        for ref in tr.params:
            p = ref()
            if p is not None and p.grad is not None:
                tr.mark(p.grad, "gradients")
                tr.grad_in_step.add(id(p))


# ------------------------------------------------------------------ global hooks
def _install() -> None:
    """torch's module and optimizer hooks, which route parameters, grads and optimizer
    state to the tracer of the processor that made them (installed while any tracer runs)."""
    global _installed
    with _install_lock:
        _installed += 1
        if _installed > 1:
            return
        from torch.nn.modules.module import register_module_parameter_registration_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def on_param(module, name, param):
            tr = active()
            if tr is not None and param is not None:
                tr.mark(param, "parameters")
                if id(param) not in tr.param_numel:
                    tr.params.append(weakref.ref(param))
                shape = getattr(param, "mesh_shape", None)
                tr.param_numel[id(param)] = param.numel() if shape is None else math.prod(shape.sizes)
                if shape is not None:
                    tr.param_shapes[id(param)] = (tuple(shape.names),
                                                  math.prod(shape.sizes) * param.element_size())
                if param.requires_grad and not getattr(param, "_mt_plan_hooked", False):
                    param.register_post_accumulate_grad_hook(_on_grad)
                    param._mt_plan_hooked = True

        def on_step(opt, args, kwargs):
            tr = active()
            if tr is not None:
                for st in opt.state.values():
                    for v in st.values():
                        tr.mark(v, "optimizer")

        h1 = register_module_parameter_registration_hook(on_param)
        h2 = register_optimizer_step_post_hook(on_step)

        def undo():
            h1.remove()
            h2.remove()

        _undo.append(undo)


def _uninstall() -> None:
    global _installed
    with _install_lock:
        _installed -= 1
        if _installed == 0:
            _undo.pop()()


def _on_grad(param: torch.Tensor) -> None:
    tr = active()
    if tr is not None:
        tr.mark(param.grad, "gradients")
        if tr.inside:
            tr.grad_in_step.add(id(param))


@contextmanager
def tracing(fuse: bool = False, device: str = "cpu") -> Iterator[Tracer]:
    """Trace this processor's ops and collectives for the block (``fuse``: also the op
    sequence, to price the step compiled; ``device``: what its meta tensors stand for,
    :func:`device_type`)."""
    tr = Tracer(fuse, device)
    _install()
    try:
        with use_tracer(tr), current().comm.stats.watching(tr.record_collective, waits=tr.started), tr:
            yield tr
    finally:
        _uninstall()


def device_type(t: torch.Tensor) -> str:
    """The kind of device ``t`` computes on: its own, or for a meta tensor of a trace, the
    device the plan stands for (``trace(device=)``: ``"cuda"`` when a GPU is priced). Code
    that picks a kernel by device (the trainer's fused AdamW) asks this, so that the plan
    traces what the run runs.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.plan.tracing import device_type
        >>> def step():
        ...     return device_type(torch.empty(2, device="meta"))
        >>> device_type(torch.empty(2)), mt.plan.trace(step, mesh="b:1", device="cuda").result
        ('cpu', 'cuda')
    """
    tr = active()
    return tr.device if t.device.type == "meta" and tr is not None else t.device.type


def _traced(fn, args, kwargs, mesh, rules, backend, rank=0, staging="none", compiled=False, device="cpu"):
    if current().rank != rank:  # the trace is one processor's; the others only take part
        return fn(*args, **kwargs)
    comm = current().comm
    if isinstance(comm, MetaCommunicator):
        comm.staging = staging
    t0 = time.perf_counter()
    with tracing(fuse=compiled, device=device) as tr:
        result = fn(*args, **kwargs)
    peak, by_kind = tr.compiled_peak() if compiled else tr.peak()
    return Trace(mesh=str(mesh), rules=str(rules), backend=backend,
                 parameters=sum(tr.param_numel.values()),
                 flops=sum(tr.flops_by_dtype.values()), flops_by_dtype=dict(tr.flops_by_dtype),
                 comm=tr.comm, peak_bytes=peak, peak_by_kind=by_kind, ops=tr.ops, result=result,
                 wall_s=time.perf_counter() - t0,
                 flop_ops=[(dt, n, None if d is None else frozenset(d)) for dt, n, d in tr.flop_ops],
                 param_shapes=[(*v, k in tr.grad_at_start or k in tr.grad_in_step)
                               for k, v in tr.param_shapes.items()],
                 start_by_kind=tr.start_by_kind, aten_ops=tr.aten_ops, phases=tr.phases,
                 aten_names=tr.aten_names,
                 kernels=(fuse_elementwise(tr.sequence, tr.sequence_backward) if compiled
                          else dict(tr.kernels)),
                 compiled=compiled,
                 timeline=tr.timeline if tr.timeline.asynchronous and not compiled else None,
                 end=tr.counted(), cuts=tr.cuts)


def staging_for(backend: str = "threads", device: str = "cpu") -> str:
    """The collective buffers a run on ``backend`` and ``device`` holds, as the meta backend
    plans them (:data:`meshtorch.comm.meta.STAGING`): ``"gloo"`` for the torch backend on
    the CPU, ``"torch"`` for it on GPUs (NCCL), ``"none"`` for the threads backend.

    Example:
        >>> from meshtorch.plan.tracing import staging_for
        >>> staging_for("torch"), staging_for("torch", "cuda"), staging_for("threads")
        ('gloo', 'torch', 'none')
    """
    if backend != "torch":
        return "none"
    return "torch" if str(device).startswith("cuda") else "gloo"


def trace(fn: Callable[..., Any], *args: Any, mesh: str = "", rules: str = "", backend: str = "meta",
          rank: int = 0, staging: str = "none", compiled: bool = False, device: str = "cpu",
          **kwargs: Any) -> Trace:
    """Run ``fn`` as one processor of ``mesh`` under ``rules`` and return its :class:`Trace`.

    ``backend="meta"`` (default) runs processor ``rank`` (default 0) alone on
    meta tensors (no storage, collectives counted, not run): planning.
    ``backend="threads"`` (or ``"torch"``, for a picklable ``fn``) runs every
    processor for real and returns processor ``rank``'s trace: measuring.
    ``staging`` is, on the meta backend, the backend whose collective buffers
    the plan holds (:func:`staging_for`; ``"gloo"`` plans a run on the torch
    backend on CPUs). ``fn`` must build everything it uses (model, optimizer,
    data) so that their memory is seen. ``compiled=True`` gives the ``kernels`` of the
    step compiled by ``torch.compile`` (:func:`meshtorch.plan.kernels.fuse_elementwise`:
    runs of memory-bound ops fused), for a GPU's roofline; the rest of the trace is the same.
    ``device`` (``"cpu"`` or ``"cuda"``) is the device the meta tensors stand for
    (:func:`device_type`): where the planned run computes, so that it picks the same kernels;
    for ``"cuda"`` each storage is followed as the caching allocator's block that holds it
    (:func:`meshtorch.plan.allocator.block_bytes`), so the peak is ``max_memory_allocated``'s.
    """
    from meshtorch.launcher import launch
    from meshtorch.launcher.meta import run_meta

    if staging not in STAGING:
        raise PlanError(f"staging {staging!r} is not one of {STAGING}; staging_for(backend, device) "
                        "gives the one of a run")
    m = Mesh(mesh)
    if not 0 <= rank < m.size:
        raise PlanError(f"rank {rank} is not a processor of the mesh '{m}' (0 to {m.size - 1})")
    if backend == "meta" and rank:
        r = LayoutRules(rules)
        r.check(m)
        return run_meta(_traced, (fn, args, kwargs, mesh, rules, backend, rank, staging, compiled, device),
                        {}, m, r, rank=rank)
    results = launch(_traced, fn, args, kwargs, mesh, rules, backend, rank, staging, compiled, device,
                     mesh=mesh, rules=rules, backend=backend)
    return results[rank if backend != "meta" else 0]
