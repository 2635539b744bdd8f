"""The loss of a language model's logits, forward and backward: plain PyTorch under autocast,
meshtorch's former float32 formula, and ``cross_entropy_rows`` (meshtorch's fused hard-target path).

Per example ``-log softmax(x)[y]`` of logits ``x`` [rows, vocab], the mean over rows, and its
gradient, on CUDA where there is one (default [8192, 50304] bf16: GPT-2-small's batch 8 x 1024) and
on the CPU otherwise (default [4096, 16384], 4 chunks of rows; one intra-op thread, as ``limits.py``
measures a core):

- ``plain``: ``F.cross_entropy(x, y)`` under the device's bf16 autocast (on CUDA autocast runs its
  ``log_softmax`` in float32 and keeps the float32 log-probabilities);
- ``formula``: ``-log_softmax(x, dtype=float32).gather(y)`` (meshtorch's fused path before
  ``cross_entropy_rows``): autograd keeps the float32 [rows, vocab] log-probabilities;
- ``rows``: :func:`meshtorch.ops.cross_entropy_rows.cross_entropy_rows`, float32 precision, the
  logits kept for the backward; on the CPU in chunks of float32 rows, on CUDA the rows whole in two
  kernels ``torch.compile`` generates (``chunk_bytes`` 0);
- ``rows fp32`` / ``formula fp32``: the same two on float32 logits (meshtorch's float32 logits take
  rows on the CPU, where it measured 1.4-2.2x faster than the formula, and on CUDA, 2.1x on an H200;
  the formula elsewhere: ``meshtorch.ops.cross_entropy_rows.FLOAT32_DEVICES``);
- with ``--chunk-mib 0 1 4 16 256``: ``rows`` in chunks of other sizes (``chunk_bytes``; 0: the
  generated kernels; ``rows`` has the device's default, ``CHUNK_BYTES``: on the CPU 2 MiB, in the
  caches, measured at a few shapes; on CUDA 0: on an H100 chunks of 16 to 1024 MiB took 9.1-11.3 ms
  where plain PyTorch took 4.6);
- with ``--compile``: ``plain``, ``formula`` and ``rows`` under ``torch.compile`` (inductor).

Prints, for each: milliseconds per forward + backward (median of ``--repeat``), the peak memory
allocated during it beyond the logits (``torch.cuda.max_memory_allocated`` on CUDA; the CPU
allocator's as ``allocator_peak.py`` measures it), the ATen bytes it moved (``limits.count``), and its
time over the bandwidth floor: the least traffic any implementation needs, reading the logits in the
forward and again in the backward and writing their gradient (3 x the logits' bytes), at this
device's memory bandwidth (the CPU's measured by ``limits.py`` for one core; a GPU's from
``meshtorch.plan.gpus``). Writes ``benchmarks/results/cross_entropy.{json,md}``. No assertion.

    python benchmarks/cross_entropy.py [--rows 4096 --vocab 16384 --repeat 5 --compile --chunk-mib 1 4 16 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from allocator_peak import step_peaks
from limits import attach, count, figure, limits, section  # noqa: E402  (benchmarks/ is the script's folder)

from meshtorch.ops.cross_entropy_rows import CHUNK_BYTES, chunk_bytes, cross_entropy_rows
from meshtorch.plan.gpus import gpu_kind

RESULTS = Path(__file__).resolve().parent / "results"


def plain(x, y):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        return F.cross_entropy(x, y)


def formula(x, y):
    return -torch.log_softmax(x, -1, dtype=torch.float32).gather(-1, y[:, None]).mean()


def rows(x, y):
    return cross_entropy_rows(x, y).mean()


def rows_in(mib: float):
    """``rows`` in chunks of ``mib`` MiB of float32 (``chunk_bytes`` for the call)."""
    def fn(x, y):
        with chunk_bytes(int(mib * 2 ** 20)):
            return rows(x, y)
    return fn


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(fn, x0, y, repeat: int, device: str) -> float:
    x = x0.clone().requires_grad_(True)
    times = []
    for _ in range(repeat + 2):  # two warm-ups (a compile's first calls)
        x.grad = None
        sync(device)
        t0 = time.perf_counter()
        fn(x, y).backward()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def peak_bytes(fn, x0, y, device: str) -> int:
    """Bytes allocated at the peak of one forward + backward beyond the logits (made before)."""
    if device == "cuda":
        x = x0.clone().requires_grad_(True)
        fn(x, y).backward()  # (a compile's first call outside the measurement)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, y).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def step(x):
        x.grad = None
        fn(x, y).backward()

    fn(x0.clone().requires_grad_(True), y).backward()  # (compile outside the profile)
    # the logits are made inside the profile (step_peaks' setup): their bytes are taken off
    peak = min(step_peaks(lambda: x0.clone().requires_grad_(True), step, 2))
    return peak - x0.numel() * x0.element_size()


def bandwidth(device: str) -> tuple[float, str]:
    if device == "cuda":
        name = torch.cuda.get_device_name()
        kind = gpu_kind(name)
        if kind is not None:
            return kind.memory_bandwidth, f"{name}: {kind.memory_bandwidth / 1e12:.2f} TB/s (data sheet)"
        return float("nan"), f"{name}: not in meshtorch.plan.gpus"
    lim = limits()
    return lim.bytes_per_core, f"one CPU core: {lim.bytes_per_core / 1e9:.1f} GB/s (limits.py, read + write)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None, help="default: 8192 on CUDA, 4096 on the CPU")
    ap.add_argument("--vocab", type=int, default=None, help="default: 50304 on CUDA, 16384 on the CPU")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also each under torch.compile (inductor)")
    ap.add_argument("--no-fp32", action="store_true", help="leave out the float32-logits rows")
    ap.add_argument("--chunk-mib", type=float, nargs="*", default=[],
                    help="also rows in chunks of these MiB of float32 (the default: CHUNK_BYTES[device])")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.rows or (8192 if device == "cuda" else 4096)
    v = args.vocab or (50304 if device == "cuda" else 16384)
    if device == "cpu":
        torch.set_num_threads(1)  # one core, as limits.py measures it
    g = torch.Generator(device=device).manual_seed(0)
    x32 = torch.randn(n, v, device=device, generator=g) * 2
    x16 = x32.bfloat16()
    y = torch.randint(0, v, (n,), device=device, generator=g)
    variants = [("plain (autocast)", plain, x16), ("formula", formula, x16), ("rows", rows, x16)]
    variants += [(f"rows, {mib:g} MiB chunks" if mib else "rows, kernels (0)", rows_in(mib), x16)
                 for mib in args.chunk_mib]
    if not args.no_fp32:
        variants += [("formula fp32", formula, x32), ("rows fp32", rows, x32)]
    if args.compile:
        variants += [(f"{name} compiled", torch.compile(fn, fullgraph=True), x16)
                     for name, fn in (("plain", plain), ("formula", formula), ("rows", rows))]
    bw, bw_text = bandwidth(device)
    results, figures = {}, []
    for name, fn, x in variants:
        ms = step_ms(fn, x, y, args.repeat, device)
        peak = peak_bytes(fn, x, y, device)
        work = None
        if "compiled" not in name:  # (a dispatch mode counts ATen ops; Dynamo refuses to run under one)
            xx = x.clone().requires_grad_(True)
            _, work = count(lambda fn=fn, xx=xx: fn(xx, y).backward())
        floor_s = 3 * x.numel() * x.element_size() / bw
        results[name] = {"ms": ms, "peak_bytes_beyond_logits": peak, "aten_bytes": work and work.bytes,
                         "floor_ms": floor_s * 1e3, "x_floor": ms / 1e3 / floor_s}
        if device == "cpu" and work is not None:
            figures.append(figure(name, ms / 1e3, work))
    base = results["formula"]
    logit_bytes = x16.numel() * x16.element_size()
    header = (f"{device}, torch {torch.__version__}, logits [{n}, {v}] ({logit_bytes / 2**20:.0f} MiB in "
              f"bf16), forward + backward, median of {args.repeat}; rows' chunk "
              f"{CHUNK_BYTES[device] / 2**20:g} MiB of float32 (0: none, generated kernels); "
              f"bandwidth floor = 3 x the logits' bytes at "
              f"{bw_text}; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end (the CPU's times are only as "
              f"steady as that)")
    lines = [header, f"{'variant':24s} {'ms':>9s} {'vs formula':>10s} {'peak MiB':>9s} {'vs logits':>9s} "
             f"{'ATen MB':>9s} {'x floor':>8s}"]
    for name, r in results.items():
        scale = 2 if "fp32" in name else 1
        lines.append(f"{name:24s} {r['ms']:9.2f} {base['ms'] / r['ms']:9.2f}x "
                     f"{r['peak_bytes_beyond_logits'] / 2**20:9.1f} "
                     f"{r['peak_bytes_beyond_logits'] / (scale * logit_bytes):8.2f}x "
                     + (f"{r['aten_bytes'] / 1e6:9.1f}" if r["aten_bytes"] else f"{'-':>9s}")
                     + f" {r['x_floor']:8.2f}")
    lines.append("(vs formula: its time over each one's, >1 faster; vs logits: peak beyond the logits over "
                 "the logits' own bytes; x floor: time over the bandwidth floor)")
    print("\n".join(lines))
    md = "# Cross-entropy of bf16 logits\n\n" + "\n".join(f"    {line}" for line in lines) + "\n"
    if figures:
        md += section(figures)
    RESULTS.mkdir(exist_ok=True)
    stem = "cross_entropy" if device == "cpu" else "cross_entropy_gpu"
    (RESULTS / f"{stem}.md").write_text(md)
    report = {"config": {**vars(args), "rows": n, "vocab": v, "chunk_bytes": CHUNK_BYTES[device]},
              "device": device, "torch": torch.__version__, "bandwidth": bw_text, "results": results}
    (RESULTS / f"{stem}.json").write_text(json.dumps(attach(report, figures) if figures else report, indent=1)
                                          + "\n")


if __name__ == "__main__":
    main()
