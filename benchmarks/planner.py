"""The Mesh-TensorFlow paper's language models planned on TPU v2 cores, and a 512-core timing.

For each of the paper's sizes (6 layers, d_model 1024, d_kv 256, batch 256 x 256
tokens, vocab 32768, untied output layer; d_ff 4096..262144 with heads 4..256)
on the paper's mesh and rules (tensor2tensor ``mtf_transformer_paper_lm_*``),
``mt.plan.estimate`` reports parameters, per-core memory and step time on
``tpu-v2``; ``mt.plan.search`` then searches every mesh of the same number of
cores. Writes benchmarks/results/planner.{json,md}.

    python benchmarks/planner.py            # all sizes with search
    python benchmarks/planner.py --no-search
    python benchmarks/planner.py --d-ff 131072   # one size (the 2.48B model), printed, no files written
"""

from __future__ import annotations

import argparse
import json
import os
import time

from limits import attach, section

import meshtorch as mt
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import training_step

NOTE = ("planned TPU v2 step times and memory, and the search's own time: nothing here runs a step on "
        "this machine, so no figure is held against its limits")
PAPER = [(4096, 4, 0.14, "batch:32"), (8192, 8, 0.22, "batch:32"), (16384, 16, 0.37, "model:4,batch:8"),
         (32768, 32, 0.67, "model:4,batch:8"), (65536, 64, 1.28, "model:8,batch:16"),
         (131072, 128, 2.48, "batch:16,model:32"), (262144, 256, 4.90, "batch:16,model:32")]
RULES = "batch:batch; vocab:model; d_ff:model; heads:model"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--d-ff", type=int, action="append", choices=[p[0] for p in PAPER],
                    help="only this size (repeatable); prints its rows and writes no results file")
    args = ap.parse_args()
    rows = []
    for d_ff, heads, paper_b, mesh in PAPER:
        if args.d_ff and d_ff not in args.d_ff:
            continue
        cfg = TrainConfig.of(layers=6, d_model=1024, d_kv=256, d_ff=d_ff, heads=heads, batch=256, length=256,
                          tie_embeddings=False, optimizer="adafactor")
        step = training_step(cfg, 32768)
        rules = RULES if "model" in mesh else "batch:batch"
        t = time.perf_counter()
        est = mt.plan.estimate(step, mesh, rules, device="tpu-v2")
        row = {"d_ff": d_ff, "heads": heads, "paper_billions": paper_b, "mesh": mesh, "rules": rules,
               "parameters": est.parameters, "memory_gib": est.memory_bytes["total"] / 2 ** 30,
               "memory_by_kind_gib": {k: v / 2 ** 30 for k, v in est.memory_bytes.items()},
               "fits": est.fits, "step_s": est.step_seconds, "plan_s": time.perf_counter() - t,
               "reason": est.reason()}
        if not args.no_search:
            res = mt.plan.search(step, mt.Mesh(mesh).size, device="tpu-v2")
            b = res.best
            row.update(load_average=os.getloadavg()[0], search_mesh=b.mesh, search_rules=b.rules,
                       search_step_s=b.step_seconds,
                       search_memory_gib=b.memory_bytes["total"] / 2 ** 30, search_fits=b.fits,
                       search_candidates=res.space, search_traced=len(res.candidates), search_s=res.seconds)
            # the search's space holds the paper's layout (up to axis names): it can only tie or beat it
            assert b.step_seconds <= est.step_seconds * (1 + 1e-9), (row, b.table())
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.d_ff:  # a subset: the table of every size stays as the last whole run wrote it
        return
    out = os.path.join(os.path.dirname(__file__), "results")
    with open(os.path.join(out, "planner.json"), "w") as f:
        json.dump(attach({"rows": rows}, [], NOTE), f, indent=1)
    lines = ["| d_ff | heads | params (paper) | params (plan) | mesh | GiB/core | fits 8 GiB | step s "
             "| search: mesh, rules | step s | GiB | traced / candidates | search s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = (f"`{r['search_mesh']}` `{r['search_rules']}` | {r['search_step_s']:.3f} | "
             f"{r['search_memory_gib']:.2f} | {r['search_traced']} / {r['search_candidates']} | "
             f"{r['search_s']:.0f}"
             if "search_mesh" in r else "- | - | - | - | -")
        lines.append(f"| {r['d_ff']} | {r['heads']} | {r['paper_billions']:.2f}B | "
                     f"{r['parameters'] / 1e9:.2f}B | `{r['mesh']}` | {r['memory_gib']:.2f} | "
                     f"{'yes' if r['fits'] else 'no'} | "
                     f"{r['step_s']:.3f} | {s} |")
    with open(os.path.join(out, "planner.md"), "w") as f:
        f.write("\n".join(lines) + "\n" + section([], NOTE))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
