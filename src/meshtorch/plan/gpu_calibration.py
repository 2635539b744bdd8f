"""``meshtorch plan --calibrate`` on a GPU: the kernel numbers of the roofline, measured on it.

:func:`measure_gpu` measures the device a run computes on and returns a
:class:`~meshtorch.plan.devices.DeviceSpec` priced op by op (:mod:`meshtorch.plan.kernels`):

- **matmul rates by shape and dtype**: the best of three windows of ``m×k @ k×n`` products per
  shape (squares and a Transformer's skinny shapes), in bfloat16 and float32; one ``matmul_knee``
  and a rate per dtype (``peak_flops``, with ``achievable`` 1) fitted so that
  ``rate × matmul_efficiency(m, n, k, knee)`` meets them (:func:`fit_matmul`, least squares
  of the logs);
- **fused attention**: ``F.scaled_dot_product_attention(is_causal=True)`` forward and backward
  at a Transformer's shape, its FLOPs as ``torch.utils.flop_counter`` counts them (what the
  planner's tracer counts), halved for the causal mask as the roofline halves them:
  ``attention_efficiency`` is that rate over the bfloat16 rate;
- **bandwidth**: a device-to-device copy, bytes read and written per second (``copy_bandwidth``);
- **launch cost**: tiny kernels queued behind a long matmul, so that the device runs them back to
  back while the host is ahead: their extra time each (``launch_seconds``);
- **host time**: one tiny op's dispatch from Python with the device's queue never drained
  (``op_seconds``), and a host sync (``.item()``) beyond that (``sync_seconds``);
- **memory**: the device's total, and what the CUDA context takes outside torch's allocator
  (``context_bytes``: total - free - reserved, on an otherwise idle GPU).

With one GPU no collective is measured: the link is the data sheet's of the GPU's kind
(:func:`unmeasured_link`: its row of :data:`meshtorch.plan.gpus.GPUS`, NVLink or PCIe; a GPU not
in that table is given :data:`~meshtorch.plan.gpus.FALLBACK_LINK`, PCIe 4.0 x16, and ``meshtorch
plan --calibrate`` says so). The allocator's fragmentation margin is every GPU spec's
(:data:`~meshtorch.plan.devices.GPU_MEMORY`). The same code runs on the CPU
(``device="cpu"``, ``quick=True``: tiny sizes, well under a second), which is how it is tested; a
CPU run is planned with ``--hardware cpu``'s own calibration, not this.

Example:
    >>> from meshtorch.plan.gpu_calibration import measure_gpu
    >>> spec = measure_gpu("cpu", quick=True)
    >>> spec.roofline, spec.matmul_knee >= 0, sorted(spec.peak_flops)
    (True, True, ['bfloat16', 'float16', 'float32'])
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from meshtorch.errors import PlanError
from meshtorch.plan.cost import collective_seconds
from meshtorch.plan.devices import DEVICES, GPU_MEMORY, DeviceSpec, Link
from meshtorch.plan.gpus import FALLBACK_LINK, gpu_kind
from meshtorch.plan.kernels import matmul_efficiency

Shape = tuple[int, int, int]  # (m, n, k) of an [m, k] @ [k, n] product

# squares, and a GPT-2-small step's products (8 x 1024 tokens, d_model 768, d_ff 3072, its vocabulary)
SHAPES: dict[str, tuple[Shape, ...]] = {
    "bfloat16": ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                 (8192, 3072, 768), (8192, 768, 3072), (768, 3072, 8192), (8192, 2304, 768),
                 (8192, 50304, 768), (256, 256, 256), (8192, 64, 64)),
    "float32": ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 3072, 768)),
}
QUICK_SHAPES: dict[str, tuple[Shape, ...]] = {
    "bfloat16": ((32, 32, 32), (64, 64, 64), (64, 16, 32)), "float32": ((32, 32, 32), (64, 64, 64))}
ATTENTION = (8, 12, 1024, 64)   # batch, heads, length, head dim: the GPT-2-small step's
QUICK_ATTENTION = (1, 2, 32, 16)
KNEES = (0.0, *(2.0 ** (i / 2) for i in range(0, 21)))   # 1 .. 1024 by factors of sqrt(2)


class Clock(Protocol):
    """How the calibration reads time on the device it measures.

    ``mark()``/``since(mark)``: seconds of device work between the two calls (``since`` waits for
    the work queued before it); ``host()``: the host's clock; ``drain()``: wait for every queued
    kernel; ``ahead(seconds)``: queue device work lasting at least ``seconds`` first, so that the
    host queues what follows before the device reaches it and the device runs it back to back (on
    a CPU, with no queue, nothing). :class:`CudaClock` (CUDA events) and :class:`HostClock`
    (``time.perf_counter``) are the real ones; a test passes a simulated device's.
    """

    def mark(self) -> Any: ...
    def since(self, mark: Any) -> float: ...
    def host(self) -> float: ...
    def drain(self) -> None: ...
    def ahead(self, seconds: float) -> None: ...


class HostClock:
    """The CPU's clock: device time is host time, and there is no queue to drain or run ahead of.

    Example:
        >>> from meshtorch.plan.gpu_calibration import HostClock
        >>> c = HostClock()
        >>> m = c.mark(); c.since(m) >= 0
        True
    """

    def mark(self) -> float:
        return time.perf_counter()

    def since(self, mark: float) -> float:
        return time.perf_counter() - mark

    def host(self) -> float:
        return time.perf_counter()

    def drain(self) -> None:
        pass

    def ahead(self, seconds: float) -> None:
        pass


class CudaClock:
    """A GPU's clock: ``torch.cuda.Event(enable_timing=True)`` recorded on the device's current
    stream (``elapsed_time`` is in milliseconds), so that what is timed is the kernels' time on the
    device, not the host's dispatch; ``ahead`` queues 4096² bfloat16 products (about 0.2 ms each
    on an H100)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._busy: tuple[torch.Tensor, float] | None = None

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self) -> torch.cuda.Event:
        return self._event()

    def since(self, mark: torch.cuda.Event) -> float:
        end = self._event()
        end.synchronize()
        return mark.elapsed_time(end) / 1e3

    def host(self) -> float:
        return time.perf_counter()

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)

    def ahead(self, seconds: float) -> None:
        if self._busy is None:
            a = torch.randn(4096, 4096, device=self.device).to(torch.bfloat16)
            a @ a
            self.drain()
            m = self.mark()
            for _ in range(5):
                a @ a
            self._busy = (a, max(self.since(m) / 5, 1e-6))
        a, each = self._busy
        for _ in range(math.ceil(seconds / each) + 1):
            a @ a


def clock_for(device: str | torch.device) -> Clock:
    """The clock that times ``device``: :class:`CudaClock` on a GPU, else :class:`HostClock`."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()


MAX_REPS = 1000


def best_seconds(fn: Callable[[], object], clock: Clock, window: float) -> float:
    """Least device seconds of one ``fn()`` run back to back: after a warm-up call, the best of
    three batches of about ``window`` seconds, each queued behind ``clock.ahead`` work long enough
    that the host's dispatch of the batch is hidden (other work on the machine only slows a
    batch down)."""
    fn()
    clock.drain()
    h0 = clock.host()
    m = clock.mark()
    fn()
    host_one = clock.host() - h0
    one = clock.since(m)
    reps = max(1, min(MAX_REPS, math.ceil(window / max(one, 1e-9))))
    best = math.inf
    for _ in range(3):
        clock.ahead(1.5 * reps * host_one)
        m = clock.mark()
        for _ in range(reps):
            fn()
        best = min(best, clock.since(m) / reps)
    return best


def work_seconds(seconds: float, launch: float, nbytes: float, bandwidth: float) -> float | None:
    """The part of a kernel's measured ``seconds`` that its FLOPs take, as the roofline prices a
    kernel (max(FLOPs / rate, bytes / bandwidth) + launch): ``seconds`` less the launch; ``None``
    where that says nothing of the rate (the launch is most of it, or the bytes could take it all).

    Example:
        >>> from meshtorch.plan.gpu_calibration import work_seconds
        >>> work_seconds(10.0, 2.0, 1e3, 1e3), work_seconds(2.2, 2.0, 0, 1e3)
        (8.0, None)
        >>> work_seconds(10.0, 2.0, 1e4, 1e3)   # its 10 kB at 1 kB/s could take it all
    """
    work = seconds - launch
    if work <= 0.25 * seconds or work <= 1.25 * nbytes / bandwidth:
        return None
    return work


def matmul_rates(device: torch.device, shapes: dict[str, tuple[Shape, ...]], window: float,
                 clock: Clock | None = None, launch: float = 0.0,
                 bandwidth: float = math.inf) -> dict[tuple[str, Shape], float]:
    """FLOP/s of ``[m, k] @ [k, n]`` per dtype and shape on ``device``: its FLOPs over its
    device time less a kernel's ``launch`` (the roofline adds that apart); a shape whose time says
    nothing of the rate (:func:`work_seconds`: launch-bound, or its bytes at ``bandwidth`` could
    take it all) is left out, unless every shape of its dtype is, then they count whole."""
    clock = clock or clock_for(device)
    out = {}
    for dtype_name, group in shapes.items():
        dtype = getattr(torch, dtype_name)
        whole = {}
        for m, n, k in group:
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            seconds = best_seconds(lambda a=a, b=b: a @ b, clock, window)
            flops = 2 * m * n * k
            whole[(dtype_name, (m, n, k))] = flops / seconds
            work = work_seconds(seconds, launch, (m * k + k * n + m * n) * a.element_size(), bandwidth)
            if work is not None:
                out[(dtype_name, (m, n, k))] = flops / work
        if not any(dt == dtype_name for dt, _ in out):
            out.update(whole)
    return out


def fit_matmul(rates: dict[tuple[str, Shape], float]) -> tuple[dict[str, float], float]:
    """The rate per dtype and the one knee whose ``rate × matmul_efficiency(m, n, k, knee)`` is
    nearest the measured ``rates`` (least squares of the logs; the knee from :data:`KNEES`).

    Example:
        >>> from meshtorch.plan.gpu_calibration import fit_matmul
        >>> from meshtorch.plan.kernels import matmul_efficiency
        >>> shapes = [(64, 64, 64), (512, 512, 512), (4096, 768, 3072)]
        >>> made = {("bfloat16", s): 7e14 * matmul_efficiency(*s, 32.0) for s in shapes}
        >>> peak, knee = fit_matmul(made)
        >>> knee, round(peak["bfloat16"] / 7e14, 6)
        (32.0, 1.0)
    """
    best: tuple[float, dict[str, float], float] = (math.inf, {}, 0.0)
    dtypes = sorted({dt for dt, _ in rates})
    for knee in KNEES:
        peaks, err = {}, 0.0
        for dt in dtypes:
            logs = [math.log(r) - math.log(matmul_efficiency(*s, knee))
                    for (d, s), r in rates.items() if d == dt]
            mean = sum(logs) / len(logs)
            peaks[dt] = math.exp(mean)
            err += sum((x - mean) ** 2 for x in logs)
        if err < best[0] - 1e-12:
            best = (err, peaks, knee)
    return best[1], best[2]


def attention_flops(shape: tuple[int, int, int, int]) -> int:
    """FLOPs of fused attention's forward and backward at ``shape`` (batch, heads, length, head
    dim) without a mask, as ``torch.utils.flop_counter`` counts the fused kernels: forward two
    products of 2·b·h·s²·d, backward five (the scores remade)."""
    b, h, s, d = shape
    return (4 + 10) * b * h * s * s * d


def attention_rate(device: torch.device, shape: tuple[int, int, int, int], window: float,
                   dtype: torch.dtype = torch.bfloat16, clock: Clock | None = None,
                   launch: float = 0.0) -> float:
    """FLOP/s of causal fused attention's forward and backward at ``shape`` (batch, heads,
    length, head dim), its FLOPs as the planner counts them (``torch.utils.flop_counter``; the
    formula of :func:`attention_flops` where the counter does not know the kernel this device
    ran), halved for the mask as :func:`~meshtorch.plan.kernels.roofline_seconds` halves them,
    over its device time less two launches (the forward and backward kernels the roofline
    prices)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from torch.utils.flop_counter import FlopCounterMode

    import meshtorch.ops.attention  # noqa: F401  (teaches the flop counter the CPU's fused kernels)

    clock = clock or clock_for(device)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dy = torch.randn(*shape, device=device, dtype=dtype)

    def step() -> None:
        torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), dy)

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops() or attention_flops(shape)
    seconds = best_seconds(step, clock, window)
    work = seconds - 2 * launch
    return 0.5 * flops / (work if work > 0.25 * seconds else seconds)


def copy_bandwidth(device: torch.device, nbytes: int, window: float, clock: Clock | None = None,
                   launch: float = 0.0) -> float:
    """Bytes read and written per second by a device-to-device copy of ``nbytes`` (its device
    time less a kernel's ``launch``)."""
    clock = clock or clock_for(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), clock, window)
    work = seconds - launch
    return 2 * nbytes / (work if work > 0.25 * seconds else seconds)


def host_seconds(device: torch.device, ops: int, clock: Clock | None = None) -> tuple[float, float]:
    """Seconds of the host for one tiny op (dispatched from Python, the queue never drained) and
    for a host sync beyond the aten ops it runs (``.item()``: one more aten op,
    ``_local_scalar_dense``, that waits for the queue and copies 4 bytes back; the planner prices
    it as an op of the host and a sync)."""
    clock = clock or clock_for(device)
    x = torch.zeros(1, device=device)

    def queued() -> float:
        t0 = clock.host()
        for _ in range(ops):
            x.add_(1)
        return (clock.host() - t0) / ops

    def synced() -> float:
        t0 = clock.host()
        for _ in range(ops):
            x.add_(1).item()
        return (clock.host() - t0) / ops

    clock.drain()
    op = min(queued() for _ in range(3))
    clock.drain()
    sync = min(synced() for _ in range(3))
    return op, max(0.0, sync - 2 * op)


def launch_seconds(device: torch.device, window: float, clock: Clock | None = None) -> float:
    """A kernel's fixed device time: a one-element ``add_`` run back to back (queued behind
    :meth:`Clock.ahead` work so that the host's dispatch is hidden), whose 8 bytes take no time.
    (On a CPU, with no queue, it is a tiny op's whole time.)"""
    clock = clock or clock_for(device)
    x = torch.zeros(1, device=device)
    return best_seconds(lambda: x.add_(1), clock, window)


def _collective_program(sizes: tuple[int, ...], repeats: int) -> list[float]:
    """One processor's least seconds of an all_reduce over the mesh axis ``b`` of each of ``sizes``
    float32 elements on its device, wall time over ``repeats`` calls (waited for at the end:
    NCCL runs them on a stream of its own)."""
    from meshtorch.context import current, processor_device

    comm, dev = current().comm, processor_device()
    clock = clock_for(dev)
    out = []
    for n in sizes:
        x = torch.ones(n, device=dev)
        for _ in range(3):
            comm.all_reduce(x, ("b",))
        best = math.inf
        for _ in range(3):
            clock.drain()
            t0 = clock.host()
            for _ in range(repeats):
                comm.all_reduce(x, ("b",))
            clock.drain()
            best = min(best, (clock.host() - t0) / repeats)
        out.append(best)
    return out


def fit_link(n: int, small: tuple[float, float], big: tuple[float, float]) -> Link:
    """The link whose ring all_reduce over ``n`` processors (:func:`~meshtorch.plan.cost.
    collective_seconds`, as the planner prices one) takes the measured ``(bytes, seconds)`` of a
    ``small`` and a ``big`` payload: the bandwidth from their difference, the latency per hop from
    the small one.

    Example:
        >>> from meshtorch.plan.gpu_calibration import fit_link
        >>> # 2 processors: a ring all_reduce sends the payload once and takes 2 hops
        >>> fit_link(2, (4, 4 / 1e11 + 2 * 5e-6), (2 ** 28, 2 ** 28 / 1e11 + 2 * 5e-6))
        Link(bandwidth=100000000000.0, latency=5e-06)
    """
    per_byte = collective_seconds("all_reduce", 1.0, n, 1.0, 0.0)
    hops = collective_seconds("all_reduce", 0.0, n, 1.0, 1.0)
    (b0, t0), (b1, t1) = small, big
    bandwidth = per_byte * (b1 - b0) / max(t1 - t0, 1e-12)
    latency = max(0.0, t0 - per_byte * b0 / bandwidth) / hops
    return Link(float(f"{bandwidth:.6g}"), float(f"{latency:.6g}"))


def measure_collectives(device_type: str, processors: int, quick: bool = False) -> Link:
    """The link between this machine's ``processors`` devices of ``device_type``, as a ring
    all_reduce over all of them meets it (NCCL between GPUs, gloo between CPU processes): one
    process per device (``mt.launch(backend="torch")``), a 4-byte and a 256 MiB payload (1 MiB
    ``quick``), the slowest processor's least time, fitted by :func:`fit_link`."""
    from meshtorch.launcher import launch

    small, big = 1, (2 ** 18 if quick else 2 ** 26)
    runs = launch(_collective_program, (small, big), 5 if quick else 20, mesh=f"b:{processors}",
                  backend="torch", device=device_type, timeout=300)
    t_small = max(r[0] for r in runs)
    t_big = max(r[1] for r in runs)
    return fit_link(processors, (4 * small, t_small), (4 * big, t_big))


def context_bytes(device: torch.device) -> int:
    """Bytes of the device taken outside torch's allocator (the CUDA context, and anything else on
    it): total - free - reserved; 0 on a CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2 ** 30


def device_name(device: torch.device) -> str:
    """A file-name-safe name of ``device``'s kind, e.g. ``nvidia-h100-80gb-hbm3`` (``cpu-roofline``
    for the CPU: not the ``cpu.json`` of ``--hardware cpu``)."""
    text = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-roofline"
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or device.type


def measure_gpu(device: str | torch.device = "cuda", quick: bool = False, clock: Clock | None = None,
                processors: int | None = None) -> DeviceSpec:
    """The roofline's numbers of ``device``, measured now (see the module's notes); ``quick``:
    tiny sizes and short windows (the CPU test; a GPU's full measurement takes about a minute).
    ``clock``: what times it (default :func:`clock_for` the device); ``processors``: how many
    devices of its kind the collective is measured over (default: every local GPU on a GPU, 1 on a
    CPU; 1 measures none and keeps the built-in spec's link).

    The host is measured first, then a kernel's launch, then the bandwidth (both less a launch),
    so that the matmul rates and attention are their FLOPs' time alone, as the roofline adds the
    three apart."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():  # torch's own says "not compiled with CUDA"
        raise PlanError(f"measuring {str(device)!r}: this machine has no CUDA GPU that torch can use "
                        f"(torch {torch.__version__}, torch.cuda.is_available() is False); run `meshtorch "
                        "plan --calibrate --device cuda` on the machine with the GPU (its device file then "
                        "plans anywhere with --hardware FILE), or --calibrate alone for this machine's CPU")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    clock = clock or clock_for(dev)
    window = 0.002 if quick else 0.1
    op, sync = host_seconds(dev, 50 if quick else 2000, clock)
    launch = launch_seconds(dev, window, clock)
    bandwidth = copy_bandwidth(dev, 2 ** 20 if quick else 2 ** 30, window, clock, launch)
    rates = matmul_rates(dev, QUICK_SHAPES if quick else SHAPES, window, clock, launch, bandwidth)
    peaks, knee = fit_matmul(rates)
    peaks.setdefault("float16", peaks["bfloat16"])  # the same tensor-core rate (H100, A100)
    attention = attention_rate(dev, QUICK_ATTENTION if quick else ATTENTION, window, clock=clock,
                               launch=launch)
    name = device_name(dev)
    if processors is None:
        processors = torch.cuda.device_count() if dev.type == "cuda" else 1
    link = measure_collectives(dev.type, processors, quick) if processors > 1 else unmeasured_link(name)
    return DeviceSpec(
        name, peaks, _memory(dev), bandwidth, link, achievable=1.0, copy_bandwidth=bandwidth,
        matmul_knee=knee,
        attention_efficiency=attention / peaks["bfloat16"],
        launch_seconds=max(launch, 1e-9),  # above 0: the spec is priced op by op
        sync_seconds=sync, op_seconds=op, memory_margin=GPU_MEMORY["memory_margin"],
        context_bytes=context_bytes(dev))


def unmeasured_link(name: str) -> Link:
    """The link of a GPU called ``name`` (:func:`device_name`'s spelling) where the calibration has no
    second GPU to measure one over: its data sheet's (:data:`meshtorch.plan.gpus.GPUS`: NVLink or
    PCIe), or for a GPU not in that table :data:`~meshtorch.plan.gpus.FALLBACK_LINK` (PCIe 4.0 x16),
    which ``meshtorch plan --calibrate`` says it assumed.

    Example:
        >>> from meshtorch.plan.gpu_calibration import unmeasured_link
        >>> unmeasured_link("nvidia-h100-80gb-hbm3").bandwidth / 1e9
        450.0
        >>> unmeasured_link("cpu-roofline").bandwidth / 1e9
        32.0
    """
    kind = gpu_kind(name)
    if kind is not None:
        return DEVICES[kind.spec].default_link
    return Link(FALLBACK_LINK["link_bandwidth"], FALLBACK_LINK["link_latency"])


def gpu_calibration_path(name: str) -> Path:
    """Where ``meshtorch plan --calibrate`` stores the measurement of a GPU named ``name``
    (:func:`device_name`): ``<cache>/<name>.json`` beside the CPU's ``cpu.json``; ``meshtorch
    train --rules auto`` prices a run on that GPU with it when it is there."""
    from meshtorch.caching import cache_root

    return cache_root() / f"{name}.json"


__all__ = ["Clock", "CudaClock", "HostClock", "attention_flops", "attention_rate", "best_seconds",
           "clock_for", "copy_bandwidth", "fit_link", "fit_matmul", "gpu_calibration_path", "host_seconds",
           "launch_seconds",
           "matmul_rates", "measure_collectives", "measure_gpu", "unmeasured_link", "work_seconds"]
