"""Planned vs measured: the planner against real steps on the torch backend (gloo, 2 processes).

For the LM, seq2seq and MoE under data-parallel (``b:2``), model-parallel (``m:2``),
FSDP-style (``b:2``, ``d_model`` on ``b``) and pipelined (``stage:2``) layouts, in fp32
and bf16, each cell is planned on the meta backend and run for real, and compared:

- **bytes and calls** per axis and kind: the plan's trace vs processor 0's communicator
  counting one steady-state step (``mt.comm_stats()`` around it, no tracer). Tolerance: none.
- **peak memory**: the plan with gloo's staging buffers (``staging="gloo"``) vs the most
  bytes torch's CPU allocator held during a step (``allocator_peak.py``: the profiler's
  record of every allocation and free, the least of 3 steps). Tolerance: 5%.
- **step time**: the plan on the device file ``results/cpu_device.json`` (this machine
  measured once: one core's matmul rate per dtype, an aten op's dispatch, gloo's latency per
  hop and bandwidth, each the least of several runs; ``--calibrate`` measures it again) vs
  the least wall time of 15 steps (other jobs on this shared machine only slow a step down;
  the median, the CPU time and the load are recorded too). Tolerance: 25%.

Pipeline cells: ``meshtorch train --pipeline-stages 2``'s step of the LM (1F1B, 4
micro-batches), one row per stage: the plan traces each stage's processor alone
(``meshtorch.plan.pipeline``), the measured side is that processor of a real run. The
runtime pipelines only the LM, so seq2seq and MoE pipeline cells are "n/a".

Writes benchmarks/results/plan_vs_measured.{json,md} and the table of benchmarks/results/planner-history.md
("Planned vs measured"); exits non-zero if a cell is out of tolerance.

    python benchmarks/plan_vs_measured.py [--calibrate] [--only lm:data:fp32 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from allocator_peak import step_peaks
from limits import Work, attach, count, figure, section

import meshtorch as mt
from meshtorch.mesh import Mesh
from meshtorch.plan import trace
from meshtorch.plan.devices import calibrate, load_spec, share
from meshtorch.plan.estimate import from_trace
from meshtorch.plan.pipeline import estimate_pipeline
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import (
    pipelined_training_step,
    prepare,
    training_step,
)

VOCAB = 256
BASE = TrainConfig.of(batch=8, length=32, d_model=64, heads=4, d_kv=16, d_ff=256, layers=2, encoder_layers=1,
                      experts=4, top_k=2, optimizer="adafactor")
MODELS = ("lm", "seq2seq", "moe")
LAYOUTS = {"data": ("b:2", "batch:b"),
           "model": ("m:2", "heads:m; d_ff:m; vocab:m"),
           "fsdp": ("b:2", "batch:b; d_model:b"),
           "pipeline": ("stage:2", "")}
PRECISIONS = ("fp32", "bf16")
SCHEDULE, MICROBATCHES = "1f1b", 4
TIMED_STEPS = 15
TOLERANCE = {"bytes": 0.0, "calls": 0.0, "memory": 0.05, "step": 0.25}
NOT_PIPELINED = "n/a: only the LM is pipelined (meshtorch train --pipeline-stages)"
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DEVICE_FILE = os.path.join(RESULTS, "cpu_device.json")
DOC = os.path.join(HERE, "results", "planner-history.md")
BEGIN, END = "<!-- plan_vs_measured table: begin -->", "<!-- plan_vs_measured table: end -->"
NOTE = ("Measured steps: processor 0's median step, the work of both processes' steps added up, "
        "on the machine's cores; bf16 matmuls run without bf16 units on this CPU.")


def _timed(run, steps: int) -> tuple[float, float, float]:
    """Median wall seconds of ``steps`` calls, their least, and the median CPU seconds of this
    process. Other jobs on the machine only slow a step down: the least is the step with its
    cores, what the plan (calibrated the same way) predicts."""
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), min(wall), statistics.median(cpu)


def _measure(setup, run) -> dict:
    """Peak (allocator), one step's collectives (communicator), median step time, work."""
    held = []

    def made():
        held.append(setup())
        return held[-1]

    peak = min(step_peaks(made, run))
    state = held[-1]
    run(state)  # out of the profiler: the first step's allocations are again the steady ones
    before = mt.comm_stats().copy()
    run(state)
    comm = (mt.comm_stats() - before).as_dict()
    load = os.getloadavg()[0]
    seconds, least, cpu = _timed(lambda: run(state), TIMED_STEPS)
    work = count(lambda: run(state))[1]
    return {"comm": comm, "peak": peak, "seconds": seconds, "least_s": least, "cpu_s": cpu, "load": load,
            "work": work}


def spmd_program(cfg: TrainConfig) -> dict:
    return _measure(lambda: prepare(cfg, VOCAB), lambda s: s[0].run([s[1]], 1))


def pipeline_program(cfg: TrainConfig) -> dict:
    steps = iter(range(1, 1000))
    return _measure(lambda: prepare(cfg, VOCAB, pipelined=True), lambda s: s[0].run([s[1]], next(steps)))


def _row(model, layout, stage, mesh, rules, precision, planned, est_seconds, real) -> dict:
    comm = planned.comm.as_dict()

    def total(c, what):
        return sum(v[what] for v in c.values())

    row = {"model": model, "layout": layout, "stage": stage, "mesh": mesh, "rules": rules,
           "precision": precision,
           "planned_bytes": total(comm, "bytes"), "measured_bytes": total(real["comm"], "bytes"),
           "planned_calls": total(comm, "calls"), "measured_calls": total(real["comm"], "calls"),
           "collectives_equal": comm == real["comm"],
           "planned_peak": planned.peak_bytes, "measured_peak": real["peak"],
           "planned_step_s": est_seconds, "measured_step_s": real["seconds"],
           "measured_least_step_s": real["least_s"], "measured_cpu_s": real["cpu_s"], "load": real["load"],
           "flops_by_dtype": planned.flops_by_dtype, "aten_ops": planned.aten_ops,
           "planned_comm": comm}
    row["memory_ratio"] = row["planned_peak"] / row["measured_peak"]
    row["step_ratio"] = row["planned_step_s"] / row["measured_least_step_s"]
    row["ok"] = bool(row["collectives_equal"] and abs(row["memory_ratio"] - 1) <= TOLERANCE["memory"]
                     and abs(row["step_ratio"] - 1) <= TOLERANCE["step"])
    return row


def run_cell(model: str, layout: str, precision: str, spec) -> tuple[list[dict], dict | None]:
    mesh, rules = LAYOUTS[layout]
    if model == "moe" and layout == "model":
        rules += "; experts:m"
    cfg = BASE.replace(model=model, precision=precision)
    n = Mesh(mesh).size
    if layout == "pipeline":
        if model != "lm":
            return [{"model": model, "layout": layout, "mesh": mesh, "precision": precision,
                     "na": NOT_PIPELINED}], None
        cfg = cfg.replace(schedule=SCHEDULE, microbatches=MICROBATCHES)
        est = estimate_pipeline(pipelined_training_step(cfg, VOCAB), mesh, rules, device=spec,
                                staging="gloo")
        real = mt.launch(pipeline_program, cfg, mesh=mesh, rules=rules, backend="torch", timeout=600)
        m = Mesh(mesh)
        ranks = [m.rank({a: s if a == "stage" else 0 for a in m.axis_names}) for s in range(est.stages)]
        rows = [_row(model, f"pipeline {SCHEDULE} x{MICROBATCHES}", s, mesh, rules, precision,
                     e.trace, est.step_seconds, real[r])
                for s, (e, r) in enumerate(zip(est.stage_estimates, ranks))]
    else:
        planned = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, staging="gloo")
        est = from_trace(planned, mesh, spec)
        real = mt.launch(spmd_program, cfg, mesh=mesh, rules=rules, backend="torch", timeout=600)
        rows = [_row(model, layout, None, mesh, rules, precision, planned, est.step_seconds, real[0])]
    work = Work(sum(r["work"].flops for r in real), sum(r["work"].bytes for r in real))
    fig = figure(f"{model} {layout} {precision}", real[0]["seconds"], work,
                 processors=min(n, os.cpu_count() or 1))
    return rows, fig


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def cell_line(r: dict) -> str:
    where = f"{r['layout']}" + (f", stage {r['stage']}" if r.get("stage") is not None else "")
    head = f"| {r['model']} | {where} `{r['mesh']}` | {r['precision']} |"
    if "na" in r:
        return head + f" {r['na']} |" + " |" * 5
    eq = "yes" if r["collectives_equal"] else "NO"
    return (head + f" {r['planned_bytes']} / {r['measured_bytes']} | "
            f"{r['planned_calls']} / {r['measured_calls']} | {eq} | "
            f"{r['planned_peak'] / 1024:.1f} / {r['measured_peak'] / 1024:.1f} ({r['memory_ratio']:.3f}) | "
            f"{r['planned_step_s'] * 1e3:.1f} / {r['measured_least_step_s'] * 1e3:.1f} "
            f"({r['step_ratio']:.2f}); "
            f"{r['measured_step_s'] * 1e3:.0f} | {'ok' if r['ok'] else 'OUT'} |")


def table(rows: list[dict]) -> str:
    b, m, s = (f"{TOLERANCE[k] * 100:g}%" for k in ("bytes", "memory", "step"))
    lines = [f"| model | layout | precision | bytes plan / measured | calls plan / measured "
             f"| per axis and kind equal (tolerance {b}) | peak KiB plan / measured (ratio; tolerance {m}) "
             f"| step ms plan / least of {TIMED_STEPS} (ratio; tolerance {s}); median | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [cell_line(r) for r in rows])


def write_doc(text: str) -> None:
    """Put ``text`` between the markers of benchmarks/results/planner-history.md's "Planned vs measured"."""
    with open(DOC) as f:
        doc = f.read()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{DOC} has no '{BEGIN}' marker: put it and '{END}' around the table")
    with open(DOC, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def device_spec(recalibrate: bool, processors: int):
    """The calibration the plans use: the stored device file (measured and stored when absent)."""
    if recalibrate or not os.path.exists(DEVICE_FILE):
        calibrate(DEVICE_FILE, backend="torch")
    return share(load_spec(DEVICE_FILE), processors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibrate", action="store_true",
                    help=f"measure this machine again into {DEVICE_FILE}")
    ap.add_argument("--only", nargs="*", default=None,
                    help="cells model:layout:precision, e.g. lm:data:fp32; the table keeps the others "
                    "from the last results")
    args = ap.parse_args()
    spec = device_spec(args.calibrate, 2)
    load_before = os.getloadavg()
    cells = [(m, lay, p) for m in MODELS for lay in LAYOUTS for p in PRECISIONS]
    last = {}
    out_json = os.path.join(RESULTS, "plan_vs_measured.json")
    if args.only is not None and os.path.exists(out_json):
        with open(out_json) as f:
            for r in json.load(f)["rows"]:
                last.setdefault((r["model"], r["layout"].split()[0], r["precision"]), []).append(r)
    rows, figures = [], []
    for cell in cells:
        if args.only is not None and ":".join(cell) not in args.only:
            rows += last.get(cell, [])
            continue
        got, fig = run_cell(*cell, spec)
        rows += got
        figures += [fig] if fig else []
        for r in got:
            print(json.dumps({k: v for k, v in r.items() if k != "planned_comm"}), flush=True)
    load_after = os.getloadavg()
    with open(DEVICE_FILE) as f:
        device = json.load(f)
    real = [r for r in rows if "na" not in r]
    bad = [r for r in real if not r["ok"]]
    peak = device["peak_flops"]
    load = (f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
            f"({os.cpu_count()} cores); calibration `benchmarks/results/cpu_device.json`: "
            f"{peak['float32'] / 1e9:.1f} / {peak.get('bfloat16', 0) / 1e9:.1f} GFLOP/s fp32 / bf16 "
            f"matmuls, {device.get('op_seconds', 0) * 1e6:.0f} µs an aten op, "
            f"{device['link']['latency'] * 1e6:.0f} µs a hop, {device['link']['bandwidth'] / 1e9:.2f} GB/s")
    text = table(rows) + f"\n\n{len(real) - len(bad)} of {len(real)} measured rows within tolerance; {load}."
    with open(out_json, "w") as f:
        json.dump(attach({"tolerance": TOLERANCE, "load_before": load_before, "load_after": load_after,
                          "device": device, "rows": rows}, figures, NOTE), f, indent=1)
    with open(os.path.join(RESULTS, "plan_vs_measured.md"), "w") as f:
        f.write(text + "\n\n" + section(figures, NOTE))
    write_doc(text)
    print(text)
    if bad:
        sys.exit(f"{len(bad)} rows out of tolerance")


if __name__ == "__main__":
    main()
