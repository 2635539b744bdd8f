"""Per-step time of a DecoderLM training step on a mesh of thread-processors.

The same step as benchmarks/overhead.py (forward, cross-entropy, backward, global-norm clipping,
AdamW) of the same LM, run SPMD on ``--mesh`` (default ``b:2,m:2``: four thread-processors) under
Megatron-style rules. With tiny per-processor slices most of a step is meshtorch's per-op Python
(planning and replaying the lowering) and the collectives' synchronisation, which is what this
script watches. Prints one JSON line: the median wall time of a step and the median CPU time of
processor 0's thread per step, in milliseconds; writes ``benchmarks/results/mesh_step.{json,md}``
with the step held against this machine's limits (``limits.py``: the work of every processor's
step added up, on as many cores as there are processors, at most all of them).

To compare two versions of meshtorch, run it alternately under each (interleaved pairs, since the
machine's load drifts) and compare the medians of the per-pair ratios:

    for i in 1 2 3; do PYTHONPATH=old/src python benchmarks/mesh_step.py; \
                       PYTHONPATH=src python benchmarks/mesh_step.py; done
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from limits import RESULTS, Work, attach, count, figure, section

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig

CONFIG = dict(vocab=264, d_model=128, heads=4, d_kv=32, d_ff=512, layers=2, max_length=64)
BATCH, LENGTH = 16, 64
RULES = "batch:b; d_ff:m; heads:m; vocab:m"


def run(steps: int, warmup: int) -> dict[str, float]:
    """Train ``warmup + steps`` steps on this processor; times of the last ``steps``."""
    cfg = TransformerConfig(**CONFIG)
    model = DecoderLM(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    shape = f"batch:{BATCH},length:{LENGTH}"
    wall, cpu = [], []

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        data = torch.randint(0, cfg.vocab, (BATCH, LENGTH + 1), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))
        loss.backward()
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        loss.item()

    for i in range(warmup + steps):
        t, c = time.perf_counter(), time.thread_time()
        step(i)
        if i >= warmup:
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - t)
    _, work = count(lambda: step(warmup + steps))  # this processor's ops only: the mode is per thread
    return {"step_ms": statistics.median(wall) * 1e3, "step_cpu_ms": statistics.median(cpu) * 1e3,
            "flops": work.flops, "bytes": work.bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="b:2,m:2", help="mesh of thread-processors, e.g. b:2,m:2")
    ap.add_argument("--rules", default=RULES, help="layout rules")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    per_proc = mt.launch(lambda: run(args.steps, args.warmup), mesh=args.mesh, rules=args.rules)
    out = per_proc[0]
    print(json.dumps({"mesh": args.mesh, **{k: round(v, 3) for k, v in out.items() if k.startswith("step")}}))
    work = Work(sum(r["flops"] for r in per_proc), sum(r["bytes"] for r in per_proc))
    cores = min(len(per_proc), os.cpu_count() or 1)
    figures = [figure(f"LM step on {args.mesh}", out["step_ms"] / 1e3, work, processors=cores)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mesh_step.json").write_text(json.dumps(attach(
        {"mesh": args.mesh, "rules": args.rules, "steps": args.steps, "median_step_ms": out["step_ms"],
         "median_step_cpu_ms_processor0": out["step_cpu_ms"]}, figures), indent=2) + "\n")
    (RESULTS / "mesh_step.md").write_text(
        f"# LM training step on {args.mesh} thread-processors\n\n`python benchmarks/mesh_step.py --mesh "
        f"{args.mesh} --steps {args.steps}`, rules `{args.rules}`: median step {out['step_ms']:.2f} ms "
        f"(processor 0's CPU time {out['step_cpu_ms']:.2f} ms)." + section(figures))


if __name__ == "__main__":
    main()
