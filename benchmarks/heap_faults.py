"""Minor page faults per training step phase, meshtorch's DecoderLM against its plain twin
(``fsdp_vs_fsdp2.BlockLM``), one process, one thread: counts, not times, so a loaded machine
does not move them.

glibc's malloc gives the top of its heap back (``brk`` down) when a free leaves 16 MiB free there
(its trim threshold: twice the largest mmapped block freed, the 8 MiB logits) and the next large
allocation takes it back, paying a fault per 4 KiB page. Whether a free trims depends on the exact
heap layout, so the counts change with Python's hash seed and address randomisation; each run
here fixes both (``PYTHONHASHSEED``, ``setarch -R`` where present) and the table is over seeds.

    python benchmarks/heap_faults.py [--seeds 4] [--steps 24] [--alone]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys

VARIANTS = ("meshtorch", "twin")


def measure(steps: int, which: list[str]) -> dict[str, list[float]]:
    """Mean faults per step (forward+loss, backward, optimizer) of each variant, in this process."""
    import fsdp_vs_fsdp2 as bench
    import torch

    import meshtorch as mt
    from meshtorch.models import DecoderLM, TransformerConfig

    torch.set_num_threads(1)
    cfg = TransformerConfig(**bench.CONFIG)
    rows = bench.BATCH // 2
    model = DecoderLM(cfg, seed=0)
    twin = bench.BlockLM(model)
    opts = {"meshtorch": torch.optim.AdamW(model.parameters(), lr=bench.LR),
            "twin": torch.optim.AdamW(twin.parameters(), lr=bench.LR)}
    data = bench.batch(0, cfg.vocab, rows, bench.LENGTH)
    shape = f"batch:{rows},length:{bench.LENGTH}"
    losses = {"meshtorch": lambda: model.loss(mt.from_global(data[:, :-1], shape),
                                              mt.from_global(data[:, 1:], shape)),
              "twin": lambda: twin.loss(data[:, :-1], data[:, 1:])}

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    out: dict[str, list[list[int]]] = {k: [] for k in which}
    for r in range(steps + 2):
        for k in (which if r % 2 else which[::-1]):  # balanced order when interleaved
            f0 = faults()
            loss = losses[k]()
            f1 = faults()
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            f2 = faults()
            opts[k].step()
            loss.item()
            del loss
            f3 = faults()
            if r >= 2:  # the first steps fault in the heap's high-water mark
                out[k].append([f1 - f0, f2 - f1, f3 - f2])
    return {k: [statistics.mean(s[i] for s in v) for i in range(3)] for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=4, help="PYTHONHASHSEED values 0..seeds-1")
    p.add_argument("--steps", type=int, default=24, help="measured steps of each variant per seed")
    p.add_argument("--alone", action="store_true", help="each variant in its own process")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.steps, a.child.split(","))))
        return
    groups = [[v] for v in VARIANTS] if a.alone else [list(VARIANTS)]
    prefix = ["setarch", "-R"] if shutil.which("setarch") else []
    here = os.path.dirname(os.path.abspath(__file__))
    res: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for seed in range(a.seeds):
        for g in groups:
            env = dict(os.environ, PYTHONHASHSEED=str(seed),
                       PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
            cmd = [*prefix, sys.executable, __file__, "--steps", str(a.steps), "--child", ",".join(g)]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items():
                res[k].append(v)
    print(f"Minor page faults per step, mean over {a.steps} steps x {a.seeds} hash seeds "
          f"({'each variant alone' if a.alone else 'interleaved in one process'})\n")
    print("| variant | forward+loss | backward | opt.step | per seed (forward) |\n|---|---|---|---|---|")
    for k, v in res.items():
        cols = [statistics.mean(x[i] for x in v) for i in range(3)]
        seeds = ", ".join(f"{x[0]:.0f}" for x in v)
        print(f"| {k} | " + " | ".join(f"{c:.0f}" for c in cols) + f" | {seeds} |")


if __name__ == "__main__":
    main()
