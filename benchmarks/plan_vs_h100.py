"""Planned vs measured on one H100: the planner's ``h100`` spec against the shared H100 rows.

Reads the measurements file (default ``../shared/data/gpu/h100-2026-11-26.json`` next to the
repository; pass another with ``--data``), plans the 124M GPT-2-small step it measured (and
the 86M byte-vocabulary one) on the meta backend for the GPU (``device="cuda"``: the fused AdamW
the trainer runs there, each storage a caching-allocator block), eager, and compiled for the
compiled row (``trace(compiled=True)``), and prints, per row the planner can express, measured
and planned step ms and their ratio, and measured and planned peak memory (the allocator's peak,
``max_memory_allocated``) and theirs; then the plan's terms (matmul, attention, memory-bound ops,
launches, host, syncs). The planner's step is meshtorch's own (SDPA attention, fused AdamW on a
GPU): the plain rows are compared with it. ``--hardware FILE`` prices with a device file instead
(``meshtorch plan --calibrate --device cuda`` on an H100 writes one). Exits non-zero if an SDPA
row's step time is outside +-25%; without the file it says so and exits 0.

    python benchmarks/plan_vs_h100.py [--data PATH] [--hardware h100|FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshtorch.plan.devices import device
from meshtorch.plan.estimate import from_trace
from meshtorch.plan.tracing import trace
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import training_step

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu" / "h100-2026-11-26.json"


def plan(config: dict, compiled: bool = False, hardware: str = "h100") -> dict:
    cfg = TrainConfig.of(model="lm", d_model=config["d_model"], heads=config["heads"], d_kv=config["d_kv"],
                         d_ff=config["d_ff"], layers=config["layers"], batch=config["batch"],
                         length=config["length"], optimizer="adamw", precision="bf16", mesh="b:1",
                         rules="batch:b")
    spec = device(hardware)
    t = trace(training_step(cfg, vocab=config["vocab"]), mesh="b:1", rules="batch:b", compiled=compiled,
              device=spec.device_type)
    est = from_trace(t, "b:1", spec)
    terms = {k: v * 1e3 for k, v in est.compute_terms.items()}
    return {"parameters": est.parameters, "step_ms": est.step_seconds * 1e3, "terms_ms": terms,
            "peak_gib": est.memory_bytes["total"] / 2 ** 30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT))
    ap.add_argument("--hardware", default="h100", help="h100, or a device file (meshtorch plan --calibrate)")
    args = ap.parse_args()
    if not Path(args.data).exists():   # a checkout without the shared measurements
        print(f"plan_vs_h100: no H100 measurements at {args.data}; nothing to compare (pass --data)")
        return 0
    data = json.loads(Path(args.data).read_text())
    ok = True
    planned = plan(data["config_124m"], hardware=args.hardware)
    fused = plan(data["config_124m"], compiled=True, hardware=args.hardware)
    ok &= planned["parameters"] == data["config_124m"]["parameters"]
    print(f"hardware {args.hardware}\n")
    print("| 124M row | measured ms | planned ms | planned / measured | measured peak GiB | planned peak GiB "
          "| planned / measured |\n|---|---|---|---|---|---|---|")
    for row in data["steps_124m"]:
        sdpa = "scaled_dot_product_attention" in row["what"] or "SDPA" in row["what"]
        compiled = "compile" in row["what"]
        if not sdpa:
            print(f"| {row['what']} | {row['step_ms']} | n/a | not expressible (math attention) | "
                  f"{row.get('peak_gib', 'n/a')} | n/a | |")
            continue
        mine = fused if compiled else planned
        ratio = mine["step_ms"] / row["step_ms"]
        ok &= 0.75 <= ratio <= 1.25
        peak = row.get("peak_gib")
        mem = f"{peak} | {mine['peak_gib']:.2f} | {mine['peak_gib'] / peak:.2f}" if peak else \
            f"n/a | {mine['peak_gib']:.2f} | "
        print(f"| {row['what']} | {row['step_ms']} | {mine['step_ms']:.1f} | {ratio:.2f} | {mem} |")
    for name, p in (("eager", planned), ("compiled", fused)):
        print(f"124M plan {name}, ms:", {k: round(v, 2) for k, v in p["terms_ms"].items()},
              f"peak {p['peak_gib']:.2f} GiB")
    small = plan(data["config_86m_bytes"], hardware=args.hardware)
    lo, hi = data["meshtorch_train_86m_bytes"]["step_ms_range"]
    run_params = data["config_86m_bytes"]["parameters"]
    print(f"86M bytes ({small['parameters']:,} parameters planned, {run_params:,} "
          f"run: the run's tokenizer has a few more ids): measured {lo}-{hi} ms (einsum attention, "
          "host syncs), planned now "
          f"{small['step_ms']:.1f} ms:", {k: round(v, 2) for k, v in small["terms_ms"].items()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
