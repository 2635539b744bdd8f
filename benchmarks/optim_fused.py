"""Adafactor with fused small collectives vs one collective per reduction, on a 4-processor mesh.

The LM step of benchmarks/mesh_step.py (forward, backward, global-norm clipping) with
``mt.optim.Adafactor``, run SPMD on four thread-processors (``b:2,m:2``, Megatron-style rules).
"fused" is meshtorch as it is: the optimizer's reductions share one all_reduce per mesh axis and
round (``meshtorch.lowering.fused``). "one by one" runs the same reductions with the held-back
all_reduces issued one per reduction (what the optimizer did before fusion). Reports the
collectives of the optimizer part (clipping + ``opt.step()``) per step, and the median times of
the optimizer part and of the whole step, over interleaved rounds (the machine's load drifts).
Also plans the step on a 512-processor mesh (meta backend, ``device="tpu-v2"``) both ways: the
model axis's planned communication time. The measured steps are held against this machine's
limits (``limits.py``). Writes benchmarks/results/optim_fused.{json,md}.

    PYTHONPATH=src python benchmarks/optim_fused.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from limits import Work, attach, count, figure, section

import meshtorch as mt
from meshtorch.lowering import fused as fused_module
from meshtorch.lowering.redistribute import run_steps
from meshtorch.models import DecoderLM, TransformerConfig

CONFIG = dict(vocab=264, d_model=128, heads=4, d_kv=32, d_ff=512, layers=2, max_length=64)
BATCH, LENGTH = 16, 64
MESH, RULES = "b:2,m:2", "batch:b; d_ff:m; heads:m; vocab:m"
BIG = dict(vocab=32768, d_model=1024, heads=32, d_kv=32, d_ff=4096, layers=6, max_length=256)
BIG_MESH, BIG_BATCH = "b:16,m:32", 512


@contextmanager
def one_by_one():
    """The held-back all_reduces issued one per reduction, as before fusion."""
    fused = fused_module.run_bucketed
    fused_module.run_bucketed = lambda ts, steps: [run_steps(t, s) for t, s in zip(ts, steps)]
    try:
        yield
    finally:
        fused_module.run_bucketed = fused


def train(cfg: dict, batch: int, length: int, steps: int, warmup: int, counted: bool = False) -> dict:
    """``warmup + steps`` clipped Adafactor steps; the optimizer part's calls and the times (and,
    when ``counted``, the work of one more step on this processor)."""
    c = TransformerConfig(**cfg)
    model = DecoderLM(c, seed=0)
    opt = mt.optim.Adafactor(model, lr=1e-3)
    shape = f"batch:{batch},length:{length}"
    step_s, opt_s, calls = [], [], {}

    def one(i: int) -> tuple[float, float, float, mt.comm.CommStats]:
        g = torch.Generator().manual_seed(i)
        data = torch.randint(0, c.vocab, (batch, length + 1), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))
        loss.backward()
        before = mt.comm_stats().copy()
        t1 = time.perf_counter()
        with mt.plan.measure() if i == warmup else _nothing():
            mt.optim.clip_grad_norm_(model, 1.0)
            opt.step()
        if loss.local.device.type != "meta":  # (planning runs on meta tensors)
            loss.item()
        return t0, t1, time.perf_counter(), before

    for i in range(warmup + steps):
        t0, t1, t2, before = one(i)
        if i >= warmup:
            step_s.append(t2 - t0)
            opt_s.append(t2 - t1)
            calls = {k: v["calls"] for k, v in (mt.comm_stats() - before).as_dict().items()}
    work = count(lambda: one(warmup + steps))[1] if counted else Work(0, 0)  # this thread's ops only
    return {"calls": calls, "step_ms": statistics.median(step_s) * 1e3 if step_s else 0.0,
            "opt_ms": statistics.median(opt_s) * 1e3 if opt_s else 0.0, "work": work}


@contextmanager
def _nothing():
    yield


def planned(fused: bool) -> dict:
    """The optimizer part of the big LM's step planned on ``BIG_MESH`` (meta backend)."""
    def step():
        train(BIG, BIG_BATCH, BIG["max_length"], 1, 1)
    with _nothing() if fused else one_by_one():
        est = mt.plan.estimate(step, BIG_MESH, RULES, device="tpu-v2")
    return {"calls_m": sum(est.calls_per_axis.get("m", {}).values()),
            "comm_m_ms": sum(s for k, s in est.comm_seconds.items() if k.endswith("@m")) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved fused / one-by-one rounds")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--no-plan", action="store_true", help="skip planning the 512-processor step")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "optim_fused"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    def once(fused: bool) -> dict:
        with _nothing() if fused else one_by_one():
            per = mt.launch(lambda: train(CONFIG, BATCH, LENGTH, args.steps, 2, counted=True), mesh=MESH,
                            rules=RULES)
        # every processor's work added up: the step's work on the machine
        return {**per[0], "work": Work(sum(r["work"].flops for r in per), sum(r["work"].bytes for r in per))}

    runs = {True: [], False: []}
    for _ in range(args.rounds):
        for fused in (False, True):
            runs[fused].append(once(fused))
    ratio = {k: statistics.median(b[k] / f[k] for b, f in zip(runs[False], runs[True]))
             for k in ("opt_ms", "step_ms")}
    result = {
        "mesh": MESH, "rules": RULES, "config": CONFIG,
        "calls_per_step": {"one_by_one": runs[False][0]["calls"], "fused": runs[True][0]["calls"]},
        "opt_ms": {"one_by_one": statistics.median(r["opt_ms"] for r in runs[False]),
                   "fused": statistics.median(r["opt_ms"] for r in runs[True])},
        "step_ms": {"one_by_one": statistics.median(r["step_ms"] for r in runs[False]),
                    "fused": statistics.median(r["step_ms"] for r in runs[True])},
        "speedup": ratio,
    }
    if not args.no_plan:
        result["planned_512"] = {"mesh": BIG_MESH, "config": BIG, "batch": BIG_BATCH, "device": "tpu-v2",
                                 "one_by_one": planned(False), "fused": planned(True)}
    cores = min(4, os.cpu_count() or 1)
    figures = [figure(f"{name} step", result["step_ms"][name] / 1e3, runs[fused][0]["work"], processors=cores)
               for name, fused in (("one_by_one", False), ("fused", True))]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(attach(result, figures), indent=1) + "\n")
    cb, cf = result["calls_per_step"]["one_by_one"], result["calls_per_step"]["fused"]
    lines = [f"# Adafactor + clipping: fused small collectives ({MESH}, `{RULES}`)", "",
             "| | one by one | fused | ratio |", "|---|---:|---:|---:|"]
    for k in sorted(set(cb) | set(cf)):
        lines.append(f"| calls/step {k} | {cb.get(k, 0)} | {cf.get(k, 0)} | "
                     f"{cb.get(k, 0) / max(cf.get(k, 0), 1):.1f}x |")
    for k in ("opt_ms", "step_ms"):
        lines.append(f"| {k} (median) | {result[k]['one_by_one']:.1f} | {result[k]['fused']:.1f} | "
                     f"{ratio[k]:.2f}x |")
    if "planned_512" in result:
        p = result["planned_512"]
        lines.append(f"| planned optimizer calls/step on m, {BIG_MESH} | {p['one_by_one']['calls_m']} | "
                     f"{p['fused']['calls_m']} | |")
        lines.append(f"| planned optimizer m-axis comm ms, {BIG_MESH} | {p['one_by_one']['comm_m_ms']:.1f} | "
                     f"{p['fused']['comm_m_ms']:.1f} | "
                     f"{p['one_by_one']['comm_m_ms'] / max(p['fused']['comm_m_ms'], 1e-9):.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n" + section(figures))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
