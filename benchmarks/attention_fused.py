"""Fused attention vs the einsum path it replaced, on this machine's device (CPU here; CUDA where one is).

One forward and backward of causal self-attention (``[batch, length, heads, d_kv]``) on one processor:

- ``einsum``: ``mt.einsum`` scores + a float32 causal bias + ``mt.softmax`` + ``mt.einsum`` (what
  ``Attention`` ran before, and still runs for training-time attention dropout);
- ``fused``: ``mt.attention(..., causal=True)`` (one ``scaled_dot_product_attention``);
- ``ring/math`` and ``ring/fused``: ``mt.ring_attention`` on ``m:2`` (threads) with its blocks by
  the math or by the fused kernel that returns the log-sum-exp.

Prints milliseconds per step (median of ``--repeat``), the ratios, and each figure against this
machine's FLOP and bandwidth limits (``limits.py``: the FLOPs of the dense step, counted by
``FlopCounterMode``, at the measured matmul rate); writes ``benchmarks/results/attention_fused.{json,md}``.
No assertion: speed is measured here, never in tests.

    python benchmarks/attention_fused.py [--batch 2 --length 512 --heads 4 --d-kv 32 --repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from limits import attach, count, figure, section  # noqa: E402  (benchmarks/ is the script's folder)

import meshtorch as mt
import meshtorch.lowering.ring as ring
from meshtorch.models.layers import LENGTH, MEMORY, causal_bias

RESULTS = Path(__file__).resolve().parent / "results"


def einsum_attention(q, k, v, scale):
    k, v = mt.rename(k, LENGTH, MEMORY), mt.rename(v, LENGTH, MEMORY)
    scores = mt.einsum(q * scale, k, output_shape=["batch", "heads", LENGTH, MEMORY])
    w = mt.softmax(scores + causal_bias(q.shape[LENGTH].size), MEMORY)
    return mt.einsum(w, v, output_shape=["batch", LENGTH, "heads", "d_kv"])


def fused_attention(q, k, v, scale):
    k, v = mt.rename(k, LENGTH, MEMORY), mt.rename(v, LENGTH, MEMORY)
    return mt.attention(q, k, v, causal=True, scale=scale)


def ring_attention(q, k, v, scale):
    return mt.ring_attention(q, k, v, causal=True, scale=scale)


def step_ms(fn, shape, repeat, device, mesh="", rules=""):
    def program():
        q, k, v = (mt.random.normal(shape, seed=s).requires_grad_() for s in range(3))
        scale = q.shape["d_kv"].size ** -0.5
        times = []
        for _ in range(repeat + 1):  # the first run warms up
            t0 = time.perf_counter()
            out = fn(q, k, v, scale)
            mt.reduce_sum(out * out).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[1:])

    return mt.launch(program, mesh=mesh, rules=rules, device=device)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-kv", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = f"batch:{args.batch},length:{args.length},heads:{args.heads},d_kv:{args.d_kv}"
    einsum = step_ms(einsum_attention, shape, args.repeat, device)
    fused = step_ms(fused_attention, shape, args.repeat, device)
    ring_fused = step_ms(ring_attention, shape, args.repeat, device, "m:2", "length:m")
    kernels = ring.FUSED
    ring.FUSED = {}
    try:
        ring_math = step_ms(ring_attention, shape, args.repeat, device, "m:2", "length:m")
    finally:
        ring.FUSED = kernels
    header = f"{device}, torch {torch.__version__}, [{shape}], forward + backward, median of {args.repeat}"
    lines = [header,
             f"einsum      {einsum:8.2f} ms",
             f"fused       {fused:8.2f} ms   einsum/fused {einsum / fused:.2f}x",
             f"ring/math   {ring_math:8.2f} ms   (m:2, threads)",
             f"ring/fused  {ring_fused:8.2f} ms   math/fused {ring_math / ring_fused:.2f}x"]
    print("\n".join(lines))
    # the limit: the fused step's own FLOPs and bytes (the attention's, not the math path's) on one
    # processor; ring attention's two processors share the same work
    work = dense_work(shape, device)
    figures = [figure("einsum", einsum / 1e3, work), figure("fused", fused / 1e3, work),
               figure("ring/math (m:2)", ring_math / 1e3, work, processors=2),
               figure("ring/fused (m:2)", ring_fused / 1e3, work, processors=2)]
    md = "# Fused attention\n\n" + "\n".join(f"    {line}" for line in lines) + "\n" + section(figures)
    print(md)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention_fused.md").write_text(md)
    (RESULTS / "attention_fused.json").write_text(json.dumps(attach({
        "config": vars(args), "device": device, "torch": torch.__version__,
        "ms": {"einsum": einsum, "fused": fused, "ring_math": ring_math, "ring_fused": ring_fused}},
        figures), indent=1) + "\n")


def dense_work(shape: str, device: str):
    """The FLOPs and bytes of one fused forward and backward, counted on one processor."""
    def program():
        q, k, v = (mt.random.normal(shape, seed=s).requires_grad_() for s in range(3))
        scale = q.shape["d_kv"].size ** -0.5
        return count(lambda: mt.reduce_sum(fused_attention(q, k, v, scale) ** 2).backward())[1]

    return mt.launch(program, device=device)[0]


if __name__ == "__main__":
    main()
