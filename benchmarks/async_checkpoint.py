"""The step-time hiccup of a checkpoint: ``mt.save(..., background=True)`` against a synchronous save.

A DecoderLM trains with AdamW on thread-processors (``--mesh``, data parallel by default) and saves
model + optimizer every ``--every`` steps, three ways, in interleaved rounds (the machine's load
drifts): no saves, synchronous saves, background saves. Reported per save: the time the save call
holds the step loop (a synchronous save: everything; a background one: the collectives and the copy
of the state to host memory), and the stall, the extra time of the whole run over the run without
saves divided by the saves (for background saves this includes the steps slowed by the writer
thread; the wait for the last one at the end is reported apart). Ratios are against the
synchronous save. Writes benchmarks/results/async_checkpoint.{json,md}.

    PYTHONPATH=src python benchmarks/async_checkpoint.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from limits import RESULTS

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig

CONFIG = dict(vocab=264, d_model=256, heads=4, d_kv=64, d_ff=1024, layers=4, max_length=64)
BATCH, LENGTH = 8, 64


def run(mode: str, steps: int, every: int, root: str) -> dict:
    """Train ``steps`` steps, saving every ``every`` as ``mode``; per-step and per-save times."""
    cfg = TransformerConfig(**CONFIG)
    model = DecoderLM(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    shape = f"batch:{BATCH},length:{LENGTH}"
    step_s, call_s = [], []
    for i in range(steps + 1):  # step 0 warms up, untimed
        t = time.perf_counter()
        data = torch.randint(0, cfg.vocab, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(i))
        opt.zero_grad(set_to_none=True)
        loss = model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))
        loss.backward()
        opt.step()
        loss.item()
        if mode != "none" and i and i % every == 0:
            c = time.perf_counter()
            mt.save(root, model=model, optimizer=opt, step=i, keep=2, background=mode == "background")
            call_s.append(time.perf_counter() - c)
        if i:
            step_s.append(time.perf_counter() - t)
    w = time.perf_counter()
    mt.checkpoint.wait()
    return {"total_s": sum(step_s), "median_step_s": statistics.median(step_s), "call_s": call_s,
            "final_wait_s": time.perf_counter() - w}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="b:2", help="mesh of thread-processors")
    ap.add_argument("--rules", default="batch:b", help="layout rules")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per run")
    ap.add_argument("--every", type=int, default=4, help="a save every this many steps")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three runs")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = args.dir or tempfile.mkdtemp(prefix="async_ckpt_")
    modes = ("none", "sync", "background")
    got: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            root = os.path.join(base, f"{m}-{r}")
            out = mt.launch(lambda m=m, root=root: run(m, args.steps, args.every, root),
                            mesh=args.mesh, rules=args.rules)
            got[m].append(out[0])  # processor 0: it also writes the index and commits
            shutil.rmtree(root, ignore_errors=True)
    saves = args.steps // args.every
    probe = os.path.join(base, "probe")
    mt.launch(lambda: run("sync", args.every, args.every, probe) and None, mesh=args.mesh, rules=args.rules)
    ckpt = mt.checkpoint.latest(probe)
    ckpt_mb = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)) / 2**20
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)

    def med(m: str, key: str) -> float:
        return statistics.median(statistics.median(x[key]) if isinstance(x[key], list) else x[key]
                                 for x in got[m])

    step_ms = med("none", "median_step_s") * 1e3
    stall = {m: statistics.median((x["total_s"] - n["total_s"]) / saves for x, n in zip(got[m], got["none"]))
             for m in ("sync", "background")}
    call = {m: med(m, "call_s") for m in ("sync", "background")}
    result = {
        "mesh": args.mesh, "rules": args.rules, "steps": args.steps, "every": args.every,
        "rounds": args.rounds,
        "cpu_cores": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 1),
        "checkpoint_mb": round(ckpt_mb, 1), "median_step_ms": round(step_ms, 2),
        "save_call_ms": {m: round(v * 1e3, 2) for m, v in call.items()},
        "stall_per_save_ms": {m: round(v * 1e3, 2) for m, v in stall.items()},
        "background_final_wait_ms": round(med("background", "final_wait_s") * 1e3, 2),
        "call_ratio_background_vs_sync": round(call["background"] / call["sync"], 3),
        "stall_ratio_background_vs_sync": round(stall["background"] / stall["sync"], 3),
    }
    print(json.dumps(result, indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "async_checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "async_checkpoint.md").write_text(
        f"# Background vs synchronous checkpoint saves\n\n`python benchmarks/async_checkpoint.py --mesh "
        f"{args.mesh} --steps {args.steps} --every {args.every} --rounds {args.rounds}`: a "
        f"{ckpt_mb:.1f} MB checkpoint (model + AdamW) every {args.every} steps of a "
        f"{step_ms:.1f} ms step, medians over {args.rounds} interleaved rounds, on {os.cpu_count()} CPU "
        "cores "
        f"(load average {result['load_average_1min']}: other work shares them).\n\n"
        "| | synchronous | background | background / synchronous |\n|---|---|---|---|\n"
        f"| the save call holds the step loop (ms) | {call['sync'] * 1e3:.1f} | "
        f"{call['background'] * 1e3:.1f} "
        f"| {result['call_ratio_background_vs_sync']:.3f} |\n"
        f"| stall per save: the run's extra time / saves (ms) | {stall['sync'] * 1e3:.1f} | "
        f"{stall['background'] * 1e3:.1f} | {result['stall_ratio_background_vs_sync']:.3f} |\n\n"
        "The background run's wait for its last save at the end: "
        f"{result['background_final_wait_ms']:.1f} ms. The background save holds the step loop for its "
        "collectives and the host copy only; its writer thread (serialising, writing, hashing) then shares "
        "the CPU cores with the processors' threads, so where no core is spare the run's total stall is "
        "not smaller than a synchronous save's.\n")


if __name__ == "__main__":
    main()
