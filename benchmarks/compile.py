"""torch.compile on one processor: the `meshtorch train` default LM's step, eager and compiled,
meshtorch vs the same LM in plain PyTorch compiled the same way.

Four steppers train copies of one model (:class:`overhead.PlainLM` holds a
:class:`~meshtorch.models.DecoderLM`'s weights): plain PyTorch and meshtorch,
each eager and with its loss under ``torch.compile(..., backend, dynamic=False)``
(meshtorch's through :func:`meshtorch.compiler.compile_step`, what
``meshtorch train --compile`` runs). The step is the same everywhere: forward,
mean cross-entropy, backward (compiled by AOTAutograd where the forward is),
global-norm clipping, ``torch.optim.AdamW`` (eager). The first call of a
compiled step compiles: its time is reported as the compile time. Steps are
then interleaved (each round runs the four in a rotating order) and each
figure is a median; the ratios to read are meshtorch compiled / plain compiled
(what meshtorch adds once both are compiled) and compiled / eager for each.

The work of a step (FLOPs, bytes of ATen operands) is counted on the eager
steps and held against this machine's limits (``limits.py``); a compiled step
does the same FLOPs and moves fewer bytes (fused kernels), so its "x limit"
against the eager byte count is a bound, not a measurement.

Writes ``benchmarks/results/compile.{json,md}``.

Run:
    python benchmarks/compile.py [--steps 20] [--warmup 3] [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from limits import attach, count, figure, section
from overhead import BATCH, CONFIG, LENGTH, PlainLM, batch

import meshtorch as mt
from meshtorch.compiler import compile_step, graph_breaks
from meshtorch.models import DecoderLM, TransformerConfig

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = ("plain eager", "plain compiled", "meshtorch eager", "meshtorch compiled")


def stepper(model: torch.nn.Module, loss_fn, mesh: bool):
    """One training step of ``model`` with ``loss_fn`` (a meshtorch model's takes MeshTensors)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    shape = f"batch:{BATCH},length:{LENGTH}"

    def step(ids, tgt):
        if mesh:
            ids, tgt = mt.from_global(ids, shape), mt.from_global(tgt, shape)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ids, tgt)
        loss.backward()
        if mesh:
            mt.optim.clip_grad_norm_(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (each runs the four steps)")
    ap.add_argument("--warmup", type=int, default=3, help="rounds after the compiling first step")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noisy)")
    ap.add_argument("--out", default=str(RESULTS / "compile"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    cfg = TransformerConfig(**CONFIG)
    models = {}
    for name in NAMES:
        ours = DecoderLM(cfg, seed=0)
        models[name] = ours if name.startswith("meshtorch") else PlainLM(ours)
    steps = {}
    for name, model in models.items():
        loss_fn = model.loss
        if name.endswith("compiled"):
            loss_fn = (compile_step(model.loss, args.backend) if name.startswith("meshtorch")
                       else torch.compile(model.loss, backend=args.backend, dynamic=False))
        steps[name] = stepper(model, loss_fn, name.startswith("meshtorch"))
    first = {}
    for name, step in steps.items():
        t = time.perf_counter()
        step(*batch(0, cfg.vocab))
        first[name] = time.perf_counter() - t
    for i in range(args.warmup):
        for step in steps.values():
            step(*batch(1 + i, cfg.vocab))
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for i in range(args.steps):
        data = batch(1 + args.warmup + i, cfg.vocab)
        for k in range(len(NAMES)):
            name = NAMES[(i + k) % len(NAMES)]
            t = time.perf_counter()
            steps[name](*data)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}

    def pair_ratio(a: str, b: str) -> float:  # median over rounds of a / b timed in the same round
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    ratios = {"meshtorch compiled / plain compiled": pair_ratio("meshtorch compiled", "plain compiled"),
              "meshtorch eager / plain eager": pair_ratio("meshtorch eager", "plain eager"),
              "plain compiled / plain eager": pair_ratio("plain compiled", "plain eager"),
              "meshtorch compiled / meshtorch eager": pair_ratio("meshtorch compiled", "meshtorch eager")}
    # the four copies trained on the same batches: compiled or not, they must still agree
    final = {name: step(*batch(10_000, cfg.vocab)) for name, step in steps.items()}
    spread = max(final.values()) - min(final.values())
    work = {name: count(lambda s=steps[name]: s(*batch(20_000, cfg.vocab)))[1]
            for name in ("plain eager", "meshtorch eager")}
    figures = [figure(f"{name} step", med[name], work[name.split()[0] + " eager"], processors=args.threads)
               for name in NAMES]
    breaks = graph_breaks()
    result = {
        "model": {**CONFIG, "batch": BATCH, "length": LENGTH,
                  "parameters": models["meshtorch eager"].num_parameters()},
        "backend": args.backend,
        "median_step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "first_step_s": {k: round(v, 2) for k, v in first.items()},
        "ratios": {k: round(v, 4) for k, v in ratios.items()},
        "graph_breaks": breaks,
        "final_loss_spread": spread,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    note = ("Work counted on the eager steps; a compiled step does the same FLOPs and moves fewer "
            "bytes, so its x limit is held against the eager step's bytes.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(attach(result, figures, note), indent=1) + "\n")
    rows = "\n".join(f"| {k} | {med[k] * 1e3:.2f} | {first[k]:.1f} |" for k in NAMES)
    ratio_rows = "\n".join(f"| {k} | {v:.3f} |" for k, v in ratios.items())
    md = f"""# torch.compile on one processor (CPU)

`python benchmarks/compile.py --steps {args.steps} --backend {args.backend} --threads {args.threads}`:
a training step (forward, cross-entropy, backward, clip, AdamW) of the `meshtorch train` default LM
({result['model']['parameters']:,} parameters, batch {BATCH}x{LENGTH}), the loss eager or under
`torch.compile(backend="{args.backend}", dynamic=False)`, meshtorch vs the same LM in plain PyTorch.

| step | median (ms) | first step, compiling (s) |
|---|---|---|
{rows}

| ratio (median over rounds) | |
|---|---|
{ratio_rows}

Graph breaks met: {len(breaks)} ({sum(breaks.values())} in all). Spread of the four copies' losses
after training: {spread:.1e}. torch {torch.__version__}, {args.threads} intra-op thread(s),
{os.cpu_count()} CPUs, 1-minute load {load_before:.1f} before / {os.getloadavg()[0]:.1f} after.
""" + section(figures, note)
    Path(args.out + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
