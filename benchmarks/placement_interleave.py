"""When interleaving pays: the paper's training layer graphs placed for interleaved 1F1B.

For every training graph in ``../shared/data/dnn-partitioning/throughput-inputs/LayerGraphs``
(skipped when absent), on ``--devices`` devices with the file's memory, and for each
micro-batch count: the exact placement into ``p·v`` chunks for ``v = 1 .. --max-v``
(:func:`meshtorch.placement.interleave.compare_virtual_stages`), its planned step time
``(v·m + p - 1) × slowest chunk``, the winning ``v`` and its gain over ``v = 1``. Writes
``benchmarks/results/placement_interleave.{json,md}`` after every row. Not part of CI
(Inception-v3 takes a minute a row on 2 cores).

    python benchmarks/placement_interleave.py [--devices 4] [--microbatches 4 8 32] [--max-v 4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from limits import attach, section

from meshtorch.placement import OpGraph, Problem
from meshtorch.placement.interleave import compare_virtual_stages

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / ".." / "shared" / "data" / "dnn-partitioning" / "throughput-inputs" / "LayerGraphs"
OUT = HERE / "results" / "placement_interleave"
NOTE = ("planned step times of placements (the paper's cost units): no measured step to hold against the "
        "FLOP and bandwidth limits")


def write(rows: list[dict], max_v: int) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(attach({"rows": rows}, [], NOTE), indent=1))
    head = " | ".join(f"v = {v}" for v in range(1, max_v + 1))
    lines = [f"| graph | p | m | {head} | best v | vs v = 1 | solve s |",
             "|" + "---|" * (max_v + 6)]
    for r in rows:
        steps = " | ".join("—" if s is None else f"{s:.1f}" for s in r["step_times"])
        gain = "—" if r["speedup"] is None else f"{r['speedup']:.3f}x"
        lines.append(f"| {r['graph']} | {r['devices']} | {r['microbatches']} | {steps} | {r['best']} | "
                     f"{gain} | {r['seconds']:.1f} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n" + section([], NOTE))
    print(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--max-v", type=int, default=4)
    ap.add_argument("--data", type=Path, default=DATA, help="the paper's LayerGraphs folder")
    args = ap.parse_args()
    files = sorted(args.data.glob("*training*.json"))
    if not files:
        print(f"no training layer graphs under {args.data}; nothing to do")
        return
    rows = []
    for f in files:
        g = OpGraph.from_json(f)
        for m in args.microbatches:
            t0 = time.perf_counter()
            choice = compare_virtual_stages(g, Problem(devices=args.devices, microbatches=m), args.max_v)
            rows.append({"graph": f.stem, "nodes": len(g), "devices": args.devices, "microbatches": m,
                         "step_times": [o.step_time for o in choice.options],
                         "exact": [o.placement.info.get("exact") if o.placement else None
                                   for o in choice.options],
                         "best": choice.best, "speedup": choice.speedup,
                         "seconds": time.perf_counter() - t0})
            write(rows, args.max_v)


if __name__ == "__main__":
    main()
