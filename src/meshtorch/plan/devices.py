"""Device specs: what a processor computes, holds and sends per second.

Each :class:`DeviceSpec` is one *processor* of a mesh (a TPU core, a GPU, a
CPU thread-processor). Sources of the numbers:

- TPU v2 core: 8 GiB HBM (16 GiB per 2-core chip), 22.5 TFLOP/s bf16 (45 per
  chip, 180 per 4-chip board); the Mesh-TensorFlow paper (arXiv 1811.02084,
  §8) quotes 11.5 PFLOP/s peak for 512 cores = 22.5 TFLOP/s a core. HBM
  700 GB/s a chip. Inter-chip links 496 Gbit/s each (Jouppi et al., "A
  domain-specific supercomputer for training deep neural networks", CACM 2020).
- TPU v3 core: 16 GiB HBM (32 GiB a chip), 61.5 TFLOP/s bf16 (123 a chip),
  HBM 900 GB/s a chip, links 656 Gbit/s (same source).
- GPUs: every kind in :data:`meshtorch.plan.gpus.GPUS` (``h100``, ``h100-pcie``, ``h100-nvl``,
  ``h200``, ``h200-nvl``, ``h800``, ``h800-pcie``, ``b200``, ``a100``, ``a100-40gb``,
  ``a100-pcie``, ``a100-pcie-40gb``, ``a800``, ``a800-pcie``, ``l40s``, ``l4``) is a spec of its
  own data sheet's rates (dense bf16 and fp32 FLOP/s, memory, memory bandwidth, NVLink or PCIe;
  sources there), built by :func:`gpu_spec`. fp32 is the plain fp32 rate: PyTorch leaves TF32
  matmuls off by default.
- ``cpu``: this machine, measured once (a matmul and a copy, well under a
  second) and stored (:func:`calibrate`, ``meshtorch plan --calibrate``), so
  plans do not change with the load; the threads backend's processors share it.
- any other device: a JSON device file (:func:`load_spec`).

On TPUs XLA multiplies float32 matrices in bfloat16 passes by default, so the
float32 rate is the bfloat16 rate there. Latencies are per message hop:
a few microseconds for ICI/NVLink (NCCL's small-message all_reduce).

Example:
    >>> from meshtorch.plan.devices import device
    >>> d = device("tpu-v2")
    >>> d.memory_bytes / 2**30, d.peak_flops["bfloat16"] / 1e12, d.link("model").bandwidth / 1e9
    (8.0, 22.5, 62.0)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtorch.context import processor_device
from meshtorch.errors import PlanError
from meshtorch.files import write_atomic
from meshtorch.plan.allocator import CUDA_CONTEXT_BYTES, FRAGMENTATION, usable_bytes
from meshtorch.plan.cost import collective_seconds
from meshtorch.plan.gpus import GPUS, GPUKind, gpu_kind

GiB = 2 ** 30


@dataclass(frozen=True)
class Link:
    """One mesh axis's link: bytes per second each way, and seconds per message hop."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class DeviceSpec:
    """One processor: peak FLOP/s by dtype, the fraction of it achieved, memory, links.

    ``links`` may give a :class:`Link` per mesh axis name; other axes use ``default_link``.
    ``op_seconds`` is the host time each aten op of a step costs besides its FLOPs (Python,
    dispatch, autograd): what a CPU step of small tensors is mostly made of.

    A GPU (a spec with ``launch_seconds > 0``) is priced by the roofline of
    :mod:`meshtorch.plan.kernels` instead: each op takes max(FLOPs / its matmul rate,
    bytes / ``achievable_bandwidth``) plus ``launch_seconds`` a kernel, the host's
    ``op_seconds`` an aten op run ahead of the device's queue, and each host sync costs
    ``sync_seconds``. The matmul rate is ``achievable`` of the peak, times
    :func:`~meshtorch.plan.kernels.matmul_efficiency` at the product's shape (``matmul_knee``);
    fused attention runs at ``attention_efficiency`` of the peak. ``copy_bandwidth`` is what a
    device-to-device copy reaches, bytes read and written per second (0: ``memory_bandwidth``).

    A GPU's memory is held by torch's caching allocator (:mod:`meshtorch.plan.allocator`): a
    step's allocated peak plus ``memory_margin`` of it (fragmentation) plus ``context_bytes``
    (the CUDA context) must fit ``memory_bytes``; :attr:`usable_memory` is the most the
    allocated peak may be. Both are 0 on a CPU, whose plans compare the peak with the memory.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth: float
    default_link: Link
    achievable: float = 0.5
    links: dict[str, Link] = field(default_factory=dict)
    op_seconds: float = 0.0
    launch_seconds: float = 0.0
    sync_seconds: float = 0.0
    copy_bandwidth: float = 0.0
    matmul_knee: float = 0.0
    attention_efficiency: float = 0.0
    memory_margin: float = 0.0
    context_bytes: int = 0

    @property
    def usable_memory(self) -> int:
        """The most a step's allocated peak may be on this device: its memory less the CUDA
        context, over 1 + the allocator's fragmentation margin
        (:func:`~meshtorch.plan.allocator.usable_bytes`)."""
        return usable_bytes(self.memory_bytes, self.memory_margin, self.context_bytes)

    @property
    def roofline(self) -> bool:
        """Whether steps on this device are priced op by op (:mod:`meshtorch.plan.kernels`)."""
        return self.launch_seconds > 0

    @property
    def device_type(self) -> str:
        """Where a run priced on this spec computes, as torch names it: ``"cuda"`` for a device
        priced op by op (a GPU), else ``"cpu"``; what a plan's meta trace stands for
        (``mt.plan.trace(device=)``), so that it picks the run's kernels (a fused AdamW)."""
        return "cuda" if self.roofline else "cpu"

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes read and written per second that a memory-bound kernel reaches."""
        return self.copy_bandwidth or self.memory_bandwidth

    def attention_flops_per_second(self, dtype: str) -> float:
        """FLOP/s of a fused attention kernel in ``dtype``."""
        peak = self.peak_flops.get(dtype, self.peak_flops["float32"])
        return peak * (self.attention_efficiency or self.achievable)

    def flops_per_second(self, dtype: str) -> float:
        """Achievable FLOP/s for matmuls in ``dtype`` (float32 when not listed)."""
        peak = self.peak_flops.get(dtype, self.peak_flops["float32"])
        return peak * self.achievable

    def link(self, axis: str) -> Link:
        return self.links.get(axis, self.default_link)

    def with_links(self, **links: Link) -> DeviceSpec:
        """The same device with per-axis links, e.g. ``spec.with_links(model=Link(300e9, 3e-6))``."""
        return dataclasses.replace(self, links={**self.links, **links})


# The H100's kernel numbers (the roofline of plan/kernels.py). Measured on an H100 SXM 80GB,
# torch 2.11+cu130 (2026-11-26, ../shared/data/gpu/h100-2026-11-26.json): bf16 matmuls of
# 4096^3 at 737 TFLOP/s and 8192^3 at 720, the 124M GPT-2 step's mm kernels (dims 768-50304)
# at 680 on average, a device-to-device copy at 3.0 TB/s. ``achievable`` = 745/989 and the knee
# of 24 put 4096^3 at 732 TFLOP/s, 8192^3 at 738 and [8192, 768] x [768, 3072] at 714.
# Fused attention: FlashAttention-2 reaches 335 TFLOP/s forward at best on an H100 (Dao,
# arXiv 2307.08691) and less at head dim 64, causal, 1k tokens; 0.25 of the peak (247) is our
# assumption for those, not a measurement. A kernel's fixed cost (launch, ramp, tail) of ~3 us
# and a host sync (cudaStreamSynchronize and a 4-byte copy back) of ~15 us are typical of
# CUDA 12 on H100s; the host's ~8 us an aten op is eager PyTorch's dispatch from Python.
KERNEL_FIELDS = ("launch_seconds", "sync_seconds", "copy_bandwidth", "matmul_knee", "attention_efficiency")
# A GPU's memory as its caching allocator holds it (plan/allocator.py; assumptions stated there)
MEMORY_FIELDS = ("memory_margin", "context_bytes")
GPU_MEMORY: dict[str, float] = {"memory_margin": FRAGMENTATION, "context_bytes": CUDA_CONTEXT_BYTES}
H100_KERNELS: dict[str, float] = {
    "achievable": 745 / 989, "copy_bandwidth": 3.0e12, "matmul_knee": 24.0,
    "attention_efficiency": 0.25, "launch_seconds": 3e-6, "sync_seconds": 15e-6, "op_seconds": 8e-6}
# What the H100 SXM's copy reached of its data sheet's 3.35 TB/s: the fraction another GPU priced
# with the H100's kernel numbers is assumed to reach of its own bandwidth
H100_COPY_FRACTION = 3.0e12 / 3.35e12


def gpu_spec(kind: GPUKind) -> DeviceSpec:
    """The built-in spec of one kind of GPU (a row of :data:`meshtorch.plan.gpus.GPUS`): its data
    sheet's peak FLOP/s (bf16 = fp16, and fp32), memory, memory bandwidth and link, with the
    caching allocator's margins (:data:`GPU_MEMORY`). A ``roofline`` kind is priced op by op
    with the H100 SXM's measured kernel numbers (:data:`H100_KERNELS`) as fractions of its own
    rates: matmuls at ``achievable`` = 745/989 of its own peak, copies at
    :data:`H100_COPY_FRACTION` of its own bandwidth, the same knee, attention share, launch,
    sync and host costs. On any GPU but the H100 SXM those are an assumption until ``meshtorch
    plan --calibrate --device cuda`` measures it. The A100 rows keep the ``a100`` spec's model
    (FLOPs at half the peak; ``roofline=False``).

    Example:
        >>> from meshtorch.plan.devices import gpu_spec
        >>> from meshtorch.plan.gpus import gpu_kind
        >>> l4 = gpu_spec(gpu_kind("NVIDIA L4"))
        >>> l4.name, round(l4.flops_per_second("bfloat16") / 1e12, 1), round(l4.achievable_bandwidth / 1e9)
        ('l4', 91.1, 269)
    """
    spec = DeviceSpec(kind.spec, {"bfloat16": kind.bf16_flops, "float16": kind.bf16_flops,
                                  "float32": kind.fp32_flops},
                      kind.memory_bytes, kind.memory_bandwidth, Link(kind.link_bandwidth, kind.link_latency),
                      **GPU_MEMORY)
    if not kind.roofline:
        return spec
    return dataclasses.replace(
        spec, **{**H100_KERNELS, "copy_bandwidth": kind.memory_bandwidth * H100_COPY_FRACTION})


def _spec(name, bf16, fp32, mem, hbm, bw, lat) -> DeviceSpec:
    return DeviceSpec(name, {"bfloat16": bf16, "float16": bf16, "float32": fp32}, mem, hbm,
                      Link(bw, lat))


DEVICES: dict[str, DeviceSpec] = {
    "tpu-v2": _spec("tpu-v2", 22.5e12, 22.5e12, 8 * GiB, 350e9, 62e9, 2e-6),
    "tpu-v3": _spec("tpu-v3", 61.5e12, 61.5e12, 16 * GiB, 450e9, 82e9, 2e-6),
    **{kind.spec: gpu_spec(kind) for kind in GPUS},
}


def matmul_rate(n: int, dtype: torch.dtype = torch.float32, window: float = 0.1,
                device: torch.device | str | None = None) -> float:
    """FLOP/s of ``n``×``n`` ``dtype`` matmuls on ``device`` (default: the processor's, see
    ``mt.launch(device=)``, else torch's default device), in the three operand layouts
    of a dense layer's training step (``x @ w.T`` forward, ``dy @ w`` and ``dy.T @ x`` backward),
    one of each: the best of three ``window``-second runs after one warm-up round (on a GPU,
    timed once its queue drains). The layouts matter: on a CPU without bf16 units, bf16
    ``a @ b`` ran at 1.3 GFLOP/s here, ``a @ b.T`` at 8 and ``a.T @ b`` at 24.

    Example:
        >>> from meshtorch.plan.devices import matmul_rate
        >>> matmul_rate(64, window=0.01) > 0
        True
    """
    device = device if device is not None else processor_device()
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    cuda = a.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def products() -> None:
        a @ b.T
        a @ b
        a.T @ b

    products()  # warm-up: a BLAS library picks its kernels once
    best = 0.0
    for _ in range(3):  # best of three: other work on the machine only slows a run down
        sync()
        t0, reps = time.perf_counter(), 0
        while time.perf_counter() - t0 < window:
            products()
            reps += 1
        sync()
        best = max(best, 3 * 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def measure_cpu(n: int = 256, copy_bytes: int = 8 * 2 ** 20,
                dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> DeviceSpec:
    """This whole machine, measured now with torch's current threads: the best of three
    ``n``×``n`` matmul rates per dtype (bfloat16 by default too, which CPUs without bf16 units
    run far slower), the bandwidth of a ``copy_bytes`` copy (bytes copied per second), memory.

    The defaults are the planner's calibration (well under a second); a larger copy than the
    caches hold measures main memory rather than cache.

    Example:
        >>> import torch
        >>> from meshtorch.plan.devices import measure_cpu
        >>> spec = measure_cpu(n=64, copy_bytes=2 ** 20, dtypes=(torch.float32,))
        >>> sorted(spec.peak_flops), spec.memory_bandwidth > 0
        (['float32'], True)
    """
    rates = {str(dtype).replace("torch.", ""): matmul_rate(n, dtype, 0.05) for dtype in dtypes}
    src = torch.empty(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - t0)
    bw = src.numel() / max(copy, 1e-9)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * GiB
    # a thread collective is a copy through shared memory and a rendezvous (~tens of µs)
    return DeviceSpec("cpu", rates, mem, bw, Link(bw, 2e-5), achievable=1.0)


def _tiny_lm_step() -> Callable[[], None]:
    """A two-layer Transformer LM of tiny dims and its Adafactor step: the models' own mix of
    ops, at sizes where their FLOPs cost nothing (a step of a thousand-odd ops, tens of ms:
    as long as a small real step, so that its least time is as lucky as theirs)."""
    from meshtorch import random
    from meshtorch.models import DecoderLM
    from meshtorch.models.config import TransformerConfig
    from meshtorch.ops.elementwise import cast
    from meshtorch.optim import Adafactor

    model = DecoderLM(TransformerConfig(vocab=32, d_model=16, heads=2, d_kv=8, d_ff=32, layers=2,
                                        max_length=8), seed=0)
    opt = Adafactor(model)
    ids = cast(random.uniform("batch:4,length:8", 0, 32, seed=1) * 0.999, torch.int64)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(ids, ids)
        loss.backward()
        opt.step()

    step()  # the optimizer's state exists from now on
    return step


def _tiny_step_program(repeats: int) -> tuple[float, int, dict[str, dict[str, int]]]:
    """The least time of ``repeats`` steps of :func:`_tiny_lm_step`, and the aten ops and
    collectives the planner's tracer counts in one."""
    from meshtorch.plan.tracing import measure, tracing

    # one intra-op thread, as each of a run's processes has: on a machine other jobs share, an op
    # split over two threads waits for the one descheduled (20-100x slower here)
    torch.set_num_threads(1)
    step = _tiny_lm_step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with tracing() as tr, measure():
        step()
    return min(times), tr.aten_ops, tr.comm.as_dict()


def measure_op_seconds(repeats: int = 15, backend: str = "threads") -> float:
    """Seconds an aten op of a meshtorch training step costs on this machine's host, FLOPs
    aside: the least time of a tiny two-layer LM's step (Adafactor) with one intra-op thread
    (other work on the machine only slows a step down, as for :func:`matmul_rate`),
    over the aten ops the planner's tracer counts in it. On the ``threads`` backend one processor
    runs it; on ``torch`` a process per core runs it at once (replicated, no collectives), so
    the cores are as busy as in a run.

    Example:
        >>> from meshtorch.plan.devices import measure_op_seconds
        >>> 0 < measure_op_seconds(repeats=1) < 0.01
        True
    """
    from meshtorch.launcher import launch

    mesh = f"b:{os.cpu_count() or 1}" if backend == "torch" else "b:1"
    runs = launch(_tiny_step_program, repeats, mesh=mesh, backend=backend, timeout=300)
    return max(seconds / max(ops, 1) for seconds, ops, _ in runs)


def _link_program(sizes: tuple[int, ...], repeats: int) -> list[float]:
    from meshtorch.context import current

    comm, out = current().comm, []
    for n in sizes:
        x = torch.ones(n)
        for _ in range(3):
            comm.all_reduce(x, ("b",))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            comm.all_reduce(x, ("b",))
            times.append(time.perf_counter() - t0)
        out.append(min(times))
    return out


def measure_link(backend: str = "torch", op_seconds: float = 0.0, repeats: int = 15) -> Link:
    """The latency per hop and bandwidth of ``backend``'s collectives between two processors of
    this machine (gloo over loopback for ``"torch"``).

    Bandwidth: from the least all_reduce of 4 bytes and of 1 MiB (a 2-processor ring all_reduce
    moves its payload once). Latency: as a step meets it, between compute, where one processor
    reaches a collective before the other and waits to be woken: the tiny LM's FSDP-style step
    (``batch:b; d_model:b``: all_gathers, reduce_scatters and all_reduces) less its aten ops at
    ``op_seconds`` and its bytes at that bandwidth, over its collectives' hops; at least the
    latency of back-to-back all_reduces (2 hops each).
    """
    from meshtorch.launcher import launch

    small, big = 1, 2 ** 18
    t_small, t_big = launch(_link_program, (small, big), repeats, mesh="b:2", backend=backend, timeout=300)[0]
    bandwidth = 4 * (big - small) / max(t_big - t_small, 1e-9)
    runs = launch(_tiny_step_program, repeats, mesh="b:2", rules="batch:b; d_model:b", backend=backend,
                  timeout=300)
    seconds, ops, comm = max(runs, key=lambda r: r[0])
    hops = moved = 0.0
    for key, v in comm.items():
        kind = key.split("@")[0]
        hops += collective_seconds(kind, 0, 2, 1.0, 1.0, v["calls"])
        moved += collective_seconds(kind, v["bytes"], 2, bandwidth, 0.0)
    waited = (seconds - ops * op_seconds - moved) / hops if hops else 0.0
    return Link(bandwidth, max(t_small / 2, waited))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def gpu_free_memory(gpus: int) -> tuple[int, str] | None:
    """Free bytes on the fullest of the first ``gpus`` CUDA devices (``torch.cuda.mem_get_info``)
    and which device says so; ``None`` without CUDA. A run gives each processor its own GPU,
    so one processor's peak must fit the least free of them.

    Example:
        >>> from meshtorch.plan.devices import gpu_free_memory
        >>> free = gpu_free_memory(1)
        >>> free is None or free[0] >= 0
        True
    """
    import torch

    if not torch.cuda.is_available():
        return None
    free = [(torch.cuda.mem_get_info(i)[0], f"free memory of cuda:{i}")
            for i in range(min(gpus, torch.cuda.device_count()))]
    return min(free) if free else None


def available_memory() -> tuple[int, str] | None:
    """Bytes of host memory this process can still take, and which limit says so; ``None``
    where no limit is known.

    The least of: the kernel's ``MemAvailable`` (``/proc/meminfo``), a cgroup's memory limit
    less its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and ``ulimit -v``
    (``RLIMIT_AS``) less this process's address space.

    Example:
        >>> from meshtorch.plan.devices import available_memory
        >>> free = available_memory()
        >>> free is None or free[0] >= 0
        True
    """
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 2 ** 60:  # v1 writes "no limit" as ~2^63
            found.append((max(0, cap - used), f"the cgroup memory limit {limit}"))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            found.append((max(0, soft - size), "ulimit -v (RLIMIT_AS) less this process's address space"))
    except (ImportError, OSError, ValueError):
        pass
    return min(found) if found else None


def share(machine: DeviceSpec, processors: int) -> DeviceSpec:
    """One of ``processors`` processors sharing ``machine``: its FLOP/s and memory split evenly,
    and its host's time per aten op stretched when there are more processors than cores."""
    p = max(1, processors)
    crowd = max(1.0, p / (os.cpu_count() or 1))
    return dataclasses.replace(machine, peak_flops={k: v / p for k, v in machine.peak_flops.items()},
                               memory_bytes=machine.memory_bytes // p, op_seconds=machine.op_seconds * crowd)


def calibration_path() -> Path:
    """Where ``meshtorch plan --calibrate`` stores this machine's measurement:
    ``$MESHTORCH_CACHE_DIR`` or ``$XDG_CACHE_HOME/meshtorch`` (``~/.cache/meshtorch``), ``cpu.json``."""
    from meshtorch.caching import cache_root

    return cache_root() / "cpu.json"


def measure_machine(backend: str = "threads") -> DeviceSpec:
    """This machine as the planner prices it: one core's matmul rates times the cores, an aten
    op's host time (:func:`measure_op_seconds`), and for ``backend="torch"`` gloo's link between
    processes (:func:`measure_link`) instead of a copy through shared memory.

    One core, not all: a matmul on every core of a machine other jobs share waits for its
    slowest thread, and measured anything from 2 to 60 GFLOP/s here from one run to the next
    where one core gave 56-63; a run's processors take a core each.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        core = measure_cpu()
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    spec = dataclasses.replace(core, peak_flops={k: v * cores for k, v in core.peak_flops.items()},
                               op_seconds=measure_op_seconds(backend=backend))
    if backend == "torch":
        spec = dataclasses.replace(spec, default_link=measure_link("torch", spec.op_seconds))
    return spec


def calibrate(path: str | os.PathLike | None = None, backend: str = "threads") -> DeviceSpec:
    """Measure this machine once (:func:`measure_machine`) and store it (:func:`calibration_path`
    by default), so that ``device("cpu")`` gives the same numbers whatever the load when a plan
    runs. ``backend="torch"`` prices collectives as gloo between processes (store it in a
    device file of its own and plan with ``device=path``)."""
    spec = measure_machine(backend)
    save_spec(spec, path or calibration_path())
    return spec


def spec_to_json(spec: DeviceSpec) -> dict[str, Any]:
    """The JSON object of a device file (what :func:`load_spec` reads)."""
    return {"name": spec.name, "peak_flops": dict(spec.peak_flops), "memory_bytes": spec.memory_bytes,
            "memory_bandwidth": spec.memory_bandwidth, "achievable": spec.achievable,
            "op_seconds": spec.op_seconds, "link": dataclasses.asdict(spec.default_link),
            **{k: getattr(spec, k) for k in (*KERNEL_FIELDS, *MEMORY_FIELDS)},
            "links": {a: dataclasses.asdict(lk) for a, lk in spec.links.items()}}


def save_spec(spec: DeviceSpec, path: str | os.PathLike) -> None:
    """Write ``spec`` as a device file (directories made as needed), through
    :func:`meshtorch.files.write_atomic`: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(spec_to_json(spec), indent=1, sort_keys=True).encode())


def _number(path: Path, where: str, v: Any, positive: bool = False) -> float:
    """A device file's number ``where``, or a :class:`PlanError` naming the file and the field."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or (positive and v <= 0):
        raise PlanError(f"device file {path}: {where} must be a {'positive' if positive else 'non-negative'} "
                        f"number, got {v!r}")
    return float(v)


def _link(path: Path, where: str, v: Any) -> Link:
    if not isinstance(v, dict) or set(v) != {"bandwidth", "latency"}:
        raise PlanError(f"device file {path}: {where} must be {{\"bandwidth\": bytes/s, \"latency\": s}}, "
                        f"got {v!r}")
    return Link(_number(path, f"{where}.bandwidth", v["bandwidth"], positive=True),
                _number(path, f"{where}.latency", v["latency"]))


def load_spec(path: str | os.PathLike) -> DeviceSpec:
    """A :class:`DeviceSpec` from a JSON device file: one processor's ``peak_flops`` by dtype
    (``float32`` required), ``memory_bytes``, ``link`` (``bandwidth`` bytes/s each way,
    ``latency`` s per hop), and optionally ``links`` per mesh axis, ``memory_bandwidth``,
    ``achievable`` (fraction of peak, default 0.5), ``op_seconds`` (host seconds per aten op,
    default 0), ``name``, a GPU's kernel numbers (:data:`KERNEL_FIELDS`, default 0: a
    ``launch_seconds`` above 0 prices the step op by op, see :class:`DeviceSpec`) and its
    allocator's ``memory_margin`` and ``context_bytes`` (default 0).

    Example:
        >>> import json, tempfile, os
        >>> from meshtorch.plan.devices import load_spec
        >>> f = os.path.join(tempfile.mkdtemp(), "gpu.json")
        >>> _ = open(f, "w").write(json.dumps({"peak_flops": {"float32": 6e13, "bfloat16": 9e14},
        ...     "memory_bytes": 8e10, "link": {"bandwidth": 4e11, "latency": 5e-6},
        ...     "links": {"b": {"bandwidth": 5e10, "latency": 1e-5}}}))
        >>> spec = load_spec(f)
        >>> spec.name, spec.flops_per_second("bfloat16") / 1e12, spec.link("b").latency, spec.link("m")
        ('gpu', 450.0, 1e-05, Link(bandwidth=400000000000.0, latency=5e-06))
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise PlanError(f"cannot read device file {path}: {e.strerror}; pass a JSON device file, or one "
                        f"of {sorted(DEVICES) + ['cpu']}") from e
    except json.JSONDecodeError as e:
        raise PlanError(f"device file {path} is not JSON: {e}") from e
    known = {"name", "peak_flops", "memory_bytes", "memory_bandwidth", "achievable", "link", "links",
             "op_seconds", *KERNEL_FIELDS, *MEMORY_FIELDS}
    if not isinstance(d, dict):
        raise PlanError(f"device file {path} must hold one JSON object, got {type(d).__name__}")
    missing, unknown = {"peak_flops", "memory_bytes", "link"} - set(d), set(d) - known
    if missing:
        raise PlanError(f"device file {path}: needs the field(s) {sorted(missing)}")
    if unknown:
        raise PlanError(f"device file {path}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    flops = d["peak_flops"]
    if not isinstance(flops, dict) or "float32" not in flops:
        raise PlanError(f"device file {path}: peak_flops must map dtypes to FLOP/s and include "
                        f"\"float32\", got {flops!r}")
    links = d.get("links", {})
    if not isinstance(links, dict):
        raise PlanError(f"device file {path}: links must map mesh axes to links, got {links!r}")

    def num(field: str, default: float, positive: bool = False) -> float:
        return _number(path, field, d.get(field, default), positive)

    return DeviceSpec(str(d.get("name", path.stem)),
                      {str(k): _number(path, f"peak_flops.{k}", v, positive=True) for k, v in flops.items()},
                      int(num("memory_bytes", 0, positive=True)), num("memory_bandwidth", 0.0),
                      _link(path, "link", d["link"]), num("achievable", 0.5, positive=True),
                      {str(a): _link(path, f"links.{a}", v) for a, v in links.items()},
                      num("op_seconds", 0.0),
                      **{k: num(k, 0.0) for k in KERNEL_FIELDS},
                      memory_margin=num("memory_margin", 0.0), context_bytes=int(num("context_bytes", 0)))


def cpu(processors: int = 1) -> DeviceSpec:
    """This machine as ``processors`` thread-processors, from its stored calibration (measured
    and stored first if there is none): plans do not change with the machine's load."""
    path = calibration_path()
    if path.exists():
        return share(load_spec(path), processors)
    machine = measure_machine()
    try:
        save_spec(machine, path)
    except OSError:
        pass  # a read-only home: measured each time, as before
    return share(machine, processors)


def device(spec: str | os.PathLike | DeviceSpec, processors: int = 1) -> DeviceSpec:
    """The :class:`DeviceSpec` named ``spec``: a key of :data:`DEVICES` (``tpu-v2``, ``tpu-v3``, a
    GPU's: ``h100``, ``h100-pcie``, ``a100``, ``l4``, ``b200``...), a GPU's name as CUDA gives it
    (``"NVIDIA H100 PCIe"``: its row of :data:`meshtorch.plan.gpus.GPUS`), ``cpu``, or a JSON
    device file (see :func:`load_spec`).

    Example:
        >>> from meshtorch.plan.devices import device
        >>> device("h100").peak_flops["bfloat16"], device("NVIDIA H100 PCIe").name
        (989000000000000.0, 'h100-pcie')
    """
    if isinstance(spec, DeviceSpec):
        return spec
    text = os.fspath(spec)
    if text.endswith(".json") or os.sep in text:
        return load_spec(text)
    key = text.lower().replace("_", "-")
    if key == "cpu":
        return cpu(processors)
    if key in DEVICES:
        return DEVICES[key]
    kind = gpu_kind(text)
    if kind is not None:
        return DEVICES[kind.spec]
    raise PlanError(f"unknown device {text!r}; use one of {sorted(DEVICES) + ['cpu']} (or a GPU's name as "
                    "torch.cuda.get_device_name() gives it), a JSON device file, or pass a "
                    "meshtorch.plan.DeviceSpec; a GPU that is none of these has no rates here: `meshtorch "
                    "plan --calibrate --device cuda` on one measures it and writes its device file")
