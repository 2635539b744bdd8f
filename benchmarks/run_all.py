"""Run every benchmark in benchmarks/ and write one table, ``benchmarks/results/README.md``.

Measures this machine's limits once (``limits.py``: one core's fp32 matmul
FLOP rate and memory bandwidth), stores them in ``results/limits.json`` and
hands them to each benchmark (``MESHTORCH_BENCH_LIMITS``), so every figure of
the run is held against the same yardstick. Each benchmark runs as its own
process and keeps writing its own ``results/<name>.{json,md}``; the table
collects the figures each one reports against the limits (its JSON's
``vs_limit``), and says which benchmarks failed or report no timed work.

``--quick`` runs each with small settings (a few minutes in all on 2 cores;
placement's MILP is capped): enough to check the suite and see the limits,
noisier than a full run.

    python benchmarks/run_all.py [--quick] [--only tp_mlp overhead ...]

``--only`` runs some of them and prints their figures, leaving the suite's table as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from limits import ENV, RESULTS, measure, save, table

HERE = Path(__file__).resolve().parent

# modules the benchmarks (and tests) import, not benchmarks themselves
MODULES = {"limits", "run_all", "allocator_peak", "rendezvous"}
# scripts in benchmarks/ that run_all leaves to others, and why
BY_HAND = {
    "abort_at_exit": "a loop counting rare aborts (minutes, no speed figure): run by hand",
    "plan_vs_gpu_step": "reads gpu_step.py's GPU measurements: gpu_check.sh runs it after them",
    "dp_phases": "a diagnosis of fsdp_vs_fsdp2's DP/DDP ratio (CPU time per phase): run by hand",
    "cold_python": "a diagnosis of the forward's per-op Python run cold after large kernels: run by hand",
    "heap_faults": "a diagnosis: page faults per step phase (counts, no speed figure): run by hand",
    "cross_entropy": ("the loss of LM logits, plain vs meshtorch's former formula vs cross_entropy_rows "
                      "(fwd+bwd ms, peak, bytes vs the bandwidth floor); [8192, 50304] on a GPU: by hand"),
    "forward_calls": ("a diagnosis: Python frames and ATen ops per forward and backward, meshtorch vs "
                      "plain and DDP (counts, no speed figure): by hand"),
    "replay_bound": ("a diagnosis: the forward replayed without the language's per-op Python, vs "
                     "meshtorch and its plain twin (CPU ms): by hand"),
    "compiled_saved": ("a diagnosis: what a step saves for its backward, eager and compiled, beside "
                       "the planner's peaks (a GPU's sizes): by hand"),
}

# name -> (arguments of a full run, arguments of a --quick run)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "tp_mlp": ([], ["--steps", "10"]),
    "overhead": ([], ["--steps", "10", "--warmup", "2"]),
    "compile": ([], ["--steps", "5", "--warmup", "1"]),
    "mesh_step": ([], ["--steps", "5", "--warmup", "1"]),
    "optim_fused": ([], ["--rounds", "2", "--steps", "2", "--no-plan"]),
    "init": ([], ["--repeats", "5"]),
    "async_checkpoint": ([], ["--steps", "8", "--every", "4", "--rounds", "1"]),
    "replicator_vs_ddp": ([], ["--repeats", "2", "--steps", "10", "--warmup", "3"]),
    "fsdp_vs_fsdp2": ([], ["--quick"]),
    "pipeline": ([], ["--micro", "2", "--steps", "2", "--repeats", "1"]),
    "pipeline_schedules": ([], ["--micro", "4", "--repeats", "1"]),
    "seqpar": ([], ["--length", "256"]),
    "attention_fused": ([], ["--length", "256", "--repeat", "3"]),
    "plan_vs_measured": ([], ["--only", "lm:data:fp32", "lm:pipeline:fp32"]),
    "planner": ([], ["--no-search"]),
    "plan_vs_h100": ([], []),  # the shared H100 rows; without them it says so and exits 0
    "placement": ([], ["--quick", "--milp-seconds", "5", "--part", "transformer"]),
    "placement_latency": ([], ["--milp-seconds", "5", "--subgraphs", "1"]),
    # the paper's graphs from ../shared (Inception-v3's row takes minutes); without them it says so
    "placement_interleave": ([], ["--microbatches", "8", "--max-v", "2"]),
    "host_step": ([], ["--steps", "10"]),
    "gpu_step": ([], ["--quick"]),  # without a GPU it says so and writes nothing (gpu_check.sh runs it)
}


# where a run writes its JSON when not results/<name>.json
STEMS = {("placement", True): "placement_quick_transformer"}


def run(name: str, args: list[str], timeout: float, quick: bool) -> dict:
    """Run one benchmark; return its status and the figures its JSON holds against the limits."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *args], capture_output=True,
                              text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"timed out after {timeout:.0f} s"
    status = {"name": name, "args": args, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
              "figures": [], "note": ""}
    if rc != 0:
        status["error"] = tail
        return status
    path = RESULTS / f"{STEMS.get((name, quick), name)}.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    if isinstance(report, dict):
        status["figures"] = report.get("vs_limit", [])
        status["note"] = report.get("vs_limit_note", "")
    return status


def readme(lim_text: str, statuses: list[dict], quick: bool, load: tuple[float, float]) -> str:
    rows = [{**f, "figure": f"{s['name']}: {f['figure']}"} for s in statuses for f in s["figures"]]
    lines = ["# Benchmark results", "",
             f"`python benchmarks/run_all.py{' --quick' if quick else ''}` on {os.cpu_count()} cores, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}"
             + (" (quick settings: fewer steps, noisier)" if quick else "")
             + f"; 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after (other jobs slow the "
             "limits and the figures alike).", "", lim_text, "",
             "Each timed figure against the limits: *limit ms* is the larger of its FLOPs over the FLOP "
             "rate and its bytes over the bandwidth (both times the cores it uses); *x limit* is the "
             "measured time over that (1.00 = at the limit). Bytes count every ATen op's operands and "
             "results, so the bandwidth bound is pessimistic for data that stays in cache.", "",
             table(rows), "", "## Benchmarks", "",
             "| benchmark | status | seconds | its report | about the figures |", "|---|---|---:|---|---|"]
    for s in statuses:
        about = s["note"] or f"{len(s['figures'])} figures above"
        state = "ok" if s["rc"] == 0 else ("timed out" if s["rc"] is None else f"failed (exit {s['rc']})")
        md = STEMS.get((s["name"], quick), s["name"]) + ".md"
        lines.append(f"| {s['name']} | {state} | {s['wall_s']} | [{md}]({md}) | "
                     f"{about} |")
    for s in statuses:
        if s["rc"] != 0:
            lines += ["", f"### {s['name']} did not finish", "", "```", s["error"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings: check the suite in minutes")
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS),
                    help="run these benchmarks only (their own results are written, the suite's table and "
                         "limits.json are not)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    lim = measure()
    # a partial run's limits go with its figures only, not over the suite's
    path = Path(tempfile.mkdtemp()) / "limits.json" if a.only else RESULTS / "limits.json"
    save(lim, path)
    os.environ[ENV] = str(path)
    print(lim.describe(), flush=True)
    statuses = []
    for name in a.only or BENCHMARKS:
        full, quick = BENCHMARKS[name]
        s = run(name, quick if a.quick else full, a.timeout, a.quick)
        statuses.append(s)
        print(f"{name}: {'ok' if s['rc'] == 0 else 'FAILED'} in {s['wall_s']} s, "
              f"{len(s['figures'])} figures against the limits", flush=True)
        if s["figures"]:
            print(table(s["figures"]), flush=True)
    load = (load_before, os.getloadavg()[0])
    if a.only:  # a partial run leaves the suite's table as it was
        print(f"--only: {RESULTS / 'README.md'} left as it was")
    else:
        (RESULTS / "README.md").write_text(readme(lim.describe(), statuses, a.quick, load))
        print(f"wrote {RESULTS / 'README.md'}")
    if any(s["rc"] != 0 for s in statuses):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
