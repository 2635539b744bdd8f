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

Collectives are not measured (one GPU): the links are those of the built-in spec of the same
GPU kind (``h100``, ``a100``; another is given the ``h100``'s) and so is the allocator's
fragmentation margin. The same code runs on the CPU (``device="cpu"``, ``quick=True``: tiny sizes,
well under a second), which is how it is tested; a CPU run is planned with ``--hardware cpu``'s
own calibration, not this.

Example:
    >>> from meshtorch.plan.gpu_calibration import measure_gpu
    >>> spec = measure_gpu("cpu", quick=True)
    >>> spec.roofline, spec.matmul_knee >= 0, sorted(spec.peak_flops)
    (True, True, ['bfloat16', 'float16', 'float32'])
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshtorch.plan.devices import DEVICES, DeviceSpec
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


def _timer(device: torch.device) -> Callable[[], float]:
    """A clock that first waits for the device's queue (on a GPU) to drain."""
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def best_seconds(fn: Callable[[], object], device: torch.device, window: float) -> float:
    """Least seconds of one ``fn()``: after a warm-up call, the best of three ``window``-second runs
    (other work on the machine only slows a run down)."""
    now = _timer(device)
    fn()
    best = math.inf
    for _ in range(3):
        t0, reps = now(), 0
        while True:
            fn()
            reps += 1
            elapsed = now() - t0
            if elapsed >= window:
                break
        best = min(best, elapsed / reps)
    return best


def matmul_rates(device: torch.device, shapes: dict[str, tuple[Shape, ...]],
                 window: float) -> dict[tuple[str, Shape], float]:
    """FLOP/s of ``[m, k] @ [k, n]`` per dtype and shape on ``device``."""
    out = {}
    for dtype_name, group in shapes.items():
        dtype = getattr(torch, dtype_name)
        for m, n, k in group:
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            seconds = best_seconds(lambda a=a, b=b: a @ b, device, window)
            out[(dtype_name, (m, n, k))] = 2 * m * n * k / seconds
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


def attention_rate(device: torch.device, shape: tuple[int, int, int, int], window: float,
                   dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of causal fused attention's forward and backward at ``shape`` (batch, heads,
    length, head dim), its FLOPs as the planner counts them (``torch.utils.flop_counter``),
    halved for the mask as :func:`~meshtorch.plan.kernels.roofline_seconds` halves them."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from torch.utils.flop_counter import FlopCounterMode

    import meshtorch.ops.attention  # noqa: F401  (teaches the flop counter the CPU's fused kernels)

    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dy = torch.randn(*shape, device=device, dtype=dtype)

    def step() -> None:
        torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), dy)

    with FlopCounterMode(display=False) as counter:
        step()
    return 0.5 * counter.get_total_flops() / best_seconds(step, device, window)


def copy_bandwidth(device: torch.device, nbytes: int, window: float) -> float:
    """Bytes read and written per second by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device, window)


def host_seconds(device: torch.device, ops: int) -> tuple[float, float]:
    """Seconds of the host for one tiny op (dispatched from Python, the queue never drained) and
    for a host sync beyond it (``.item()``: wait for the queue, copy 4 bytes back)."""
    x = torch.zeros(1, device=device)
    now = _timer(device)

    def queued() -> float:
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        return (time.perf_counter() - t0) / ops

    def synced() -> float:
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1).item()
        return (time.perf_counter() - t0) / ops

    now()
    op = min(queued() for _ in range(3))
    now()
    sync = min(synced() for _ in range(3))
    return op, max(0.0, sync - op)


def launch_seconds(device: torch.device, kernels: int, op_seconds: float, window: float) -> float:
    """A kernel's fixed device time: ``kernels`` tiny ones queued behind matmuls long enough that
    the host queues them all first, so the device runs them back to back; their time beyond the
    matmuls', each. (On a CPU, with no queue, it is a tiny op's whole time.)"""
    # on a GPU a few long bf16 products (~0.2 ms each on an H100): the host queues them in
    # microseconds and is then far ahead of the device
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (32, torch.float32)
    a = torch.randn(n, n, device=device).to(dtype)
    x = torch.zeros(1, device=device)
    now = _timer(device)
    one = best_seconds(lambda: a @ a, device, window)
    reps = max(1, math.ceil(2 * kernels * op_seconds / max(one, 1e-9)))   # twice the host's queuing time

    def busy() -> None:
        for _ in range(reps):
            a @ a

    def busy_then_tiny() -> None:
        busy()
        for _ in range(kernels):
            x.add_(1)

    best = math.inf
    for _ in range(3):
        t0 = now()
        busy()
        t_busy = now() - t0
        t0 = now()
        busy_then_tiny()
        best = min(best, max(0.0, now() - t0 - t_busy) / kernels)
    return best


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


def _nearest_builtin(name: str) -> DeviceSpec:
    for key in ("h100", "a100"):
        if key in name:
            return DEVICES[key]
    return DEVICES["h100"]


def measure_gpu(device: str | torch.device = "cuda", quick: bool = False) -> DeviceSpec:
    """The roofline's numbers of ``device``, measured now (see the module's notes); ``quick``:
    tiny sizes and short windows (the CPU test; a GPU's full measurement takes about a minute)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    window = 0.002 if quick else 0.1
    rates = matmul_rates(dev, QUICK_SHAPES if quick else SHAPES, window)
    peaks, knee = fit_matmul(rates)
    peaks.setdefault("float16", peaks["bfloat16"])  # the same tensor-core rate (H100, A100)
    attention = attention_rate(dev, QUICK_ATTENTION if quick else ATTENTION, window)
    op, sync = host_seconds(dev, 50 if quick else 2000)
    launch = launch_seconds(dev, 20 if quick else 2000, op, window)
    bandwidth = copy_bandwidth(dev, 2 ** 20 if quick else 2 ** 30, window)
    name = device_name(dev)
    like = _nearest_builtin(name)
    return dataclasses.replace(
        like, name=name, peak_flops=peaks, achievable=1.0, memory_bytes=_memory(dev),
        memory_bandwidth=bandwidth, copy_bandwidth=bandwidth, matmul_knee=knee,
        attention_efficiency=attention / peaks["bfloat16"],
        launch_seconds=max(launch, 1e-9),  # above 0: the spec is priced op by op
        sync_seconds=sync, op_seconds=op, context_bytes=context_bytes(dev))


def gpu_calibration_path(name: str) -> Path:
    """Where ``meshtorch plan --calibrate`` stores the measurement of a GPU named ``name``
    (:func:`device_name`): ``<cache>/<name>.json`` beside the CPU's ``cpu.json``; ``meshtorch
    train --rules auto`` prices a run on that GPU with it when it is there."""
    from meshtorch.caching import cache_root

    return cache_root() / f"{name}.json"


__all__ = ["attention_rate", "copy_bandwidth", "fit_matmul", "gpu_calibration_path", "host_seconds",
           "launch_seconds", "matmul_rates", "measure_gpu"]
