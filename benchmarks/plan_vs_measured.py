"""Planned vs measured: the planner's meta trace against real steps on the threads backend.

For the LM, seq2seq and MoE under data-parallel, model-parallel and FSDP-style
layouts, in fp32 and bf16, on 4 thread-processors of this machine:

- bytes and calls per axis: the plan vs a real steady-state step counted by
  the communicator alone (``mt.comm_stats()`` around ``train_step``);
- peak memory: the plan vs the tracer following real storages (processor 0);
- step time: the plan on ``--device cpu`` (this machine's stored calibration,
  shared by 4 processors) vs the median wall time of 3 real steps (processor 0).

Pipeline rows: the LM on ``stage:2,b:2`` (2 stages, each data-parallel over
``b``, 4 micro-batches) as ``meshtorch train --pipeline-stages 2`` runs it
(its ``PipelinedStep``), one row per stage: the plan traces each stage's
processor alone (``meshtorch.plan.pipeline``), the measured side is that
processor of a real run. Only the LM is pipelined by the runtime (seq2seq and
MoE are not), so there are no seq2seq or MoE pipeline rows.

Bytes, calls and memory are exact by construction of the tests
(tests/test_plan_trace.py, tests/test_meta_autocast.py); step time is a model
(compute plus communication, no overlap, calibrated with a 256x256 matmul and a
copy) and the ratio is what it is. Writes benchmarks/results/plan_vs_measured.{json,md}
and the table of docs/planner.md ("Planned vs measured").

    python benchmarks/plan_vs_measured.py [--pipeline-only]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from limits import Work, attach, count, figure, section

import meshtorch as mt
from meshtorch.mesh import Mesh
from meshtorch.plan import trace
from meshtorch.plan.estimate import from_trace
from meshtorch.plan.pipeline import estimate_pipeline
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.steps import (
    pipelined_training_step,
    prepare,
    prepare_pipelined,
    train_step,
    training_step,
)

VOCAB = 256
BASE = TrainConfig.of(batch=8, length=32, d_model=64, heads=4, d_kv=16, d_ff=256, layers=2, encoder_layers=1,
                      experts=4, top_k=2, optimizer="adafactor")
LAYOUTS = {"data": ("b:4", "batch:b"),
           "model": ("b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"),
           "fsdp": ("b:4", "batch:b; d_model:b")}
PIPELINE = ("stage:2,b:2", "batch:b", 4)  # mesh, rules, micro-batches
PIPELINE_RUNS = [("1f1b", "fp32"), ("1f1b", "bf16"), ("gpipe", "fp32"), ("2bw", "fp32")]
DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "planner.md")
BEGIN, END = "<!-- plan_vs_measured table: begin -->", "<!-- plan_vs_measured table: end -->"


COLUMNS = [
    ("model", lambda r: r["model"]),
    ("layout", lambda r: f"{r['layout']} `{r['mesh']}`"),
    ("precision", lambda r: r["precision"]),
    ("bytes plan / measured", lambda r: f"{r['planned_bytes']} / {r['measured_bytes']}"),
    ("calls plan / measured", lambda r: f"{r['planned_calls']} / {r['measured_calls']}"),
    ("per axis and kind equal", lambda r: "yes" if r["collectives_equal"] else "NO"),
    ("peak KiB plan / measured",
     lambda r: f"{r['planned_peak'] / 1024:.1f} / {r['measured_peak'] / 1024:.1f}"),
    ("step ms plan / measured",
     lambda r: f"{r['planned_step_s'] * 1e3:.1f} / {r['measured_step_s'] * 1e3:.1f}"),
]


NOTE = ("Measured steps: the work of all 4 thread-processors' steps added up, on the machine's cores; "
        "bf16 rows are held against the fp32 matmul rate too (CPUs without bf16 units run bf16 slower).")


def measured(cfg: TrainConfig, mesh: str, rules: str) -> dict:
    """Processor 0's collectives in one real step (communicator counts) and its median step time."""

    def program():
        model, opt, batch = prepare(cfg, VOCAB)
        train_step(cfg, model, opt, batch)  # the first step after the warm-up allocates
        before = mt.comm_stats().copy()
        train_step(cfg, model, opt, batch)
        comm = (mt.comm_stats() - before).as_dict()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            train_step(cfg, model, opt, batch)
            times.append(time.perf_counter() - t0)
        work = count(lambda: train_step(cfg, model, opt, batch))[1]  # this processor's ops only
        return comm, statistics.median(times), work

    per_proc = mt.launch(program, mesh=mesh, rules=rules, backend="threads")
    comm, seconds, _ = per_proc[0]
    work = Work(sum(w.flops for _, _, w in per_proc), sum(w.bytes for _, _, w in per_proc))
    peak = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, backend="threads").peak_bytes
    return {"comm": comm, "seconds": seconds, "peak": peak, "work": work,
            "processors": min(len(per_proc), os.cpu_count() or 1)}


def measured_pipeline(cfg: TrainConfig, mesh: str, rules: str) -> dict:
    """Every processor's collectives in one real pipelined step (communicator counts) and its
    median step time; each stage's processor (the others' coordinates 0) traced for its peak."""

    def program():
        step, batch = prepare_pipelined(cfg, VOCAB)
        step.run([batch], 1)  # the first step after the warm-up allocates
        before = mt.comm_stats().copy()
        step.run([batch], 2)
        comm = (mt.comm_stats() - before).as_dict()
        times = []
        for i in range(3):
            t0 = time.perf_counter()
            step.run([batch], 3 + i)
            times.append(time.perf_counter() - t0)
        work = count(lambda: step.run([batch], 6))[1]
        return comm, statistics.median(times), work

    per_proc = mt.launch(program, mesh=mesh, rules=rules, backend="threads")
    m = Mesh(mesh)
    ranks = [m.rank({a: s if a == "stage" else 0 for a in m.axis_names}) for s in range(m.axis_size("stage"))]
    peaks = [trace(pipelined_training_step(cfg, VOCAB), mesh=mesh, rules=rules, backend="threads",
                   rank=r).peak_bytes for r in ranks]
    work = Work(sum(w.flops for _, _, w in per_proc), sum(w.bytes for _, _, w in per_proc))
    return {"comm": [per_proc[r][0] for r in ranks], "seconds": [per_proc[r][1] for r in ranks],
            "peak": peaks, "work": work, "processors": min(len(per_proc), os.cpu_count() or 1)}


def pipeline_rows(spec) -> tuple[list[dict], list[dict]]:
    rows, figures = [], []
    mesh, rules, mb = PIPELINE
    for schedule, precision in PIPELINE_RUNS:
        cfg = BASE.replace(model="lm", precision=precision, schedule=schedule, microbatches=mb)
        est = estimate_pipeline(pipelined_training_step(cfg, VOCAB), mesh, rules, device=spec)
        real = measured_pipeline(cfg, mesh, rules)
        for s, e in enumerate(est.stage_estimates):
            comm = e.trace.comm.as_dict()
            row = {"model": "lm", "layout": f"pipeline {schedule} x{mb}, stage {s}", "mesh": mesh,
                   "rules": rules, "precision": precision,
                   "planned_bytes": sum(v["bytes"] for v in comm.values()),
                   "measured_bytes": sum(v["bytes"] for v in real["comm"][s].values()),
                   "planned_calls": sum(v["calls"] for v in comm.values()),
                   "measured_calls": sum(v["calls"] for v in real["comm"][s].values()),
                   "collectives_equal": comm == real["comm"][s],
                   "planned_peak": e.trace.peak_bytes, "measured_peak": real["peak"][s],
                   "planned_step_s": est.step_seconds, "measured_step_s": real["seconds"][s],
                   "bubble": est.bubble, "in_flight": est.in_flight[s],
                   "flops_by_dtype": e.trace.flops_by_dtype}
            rows.append(row)
            print(json.dumps(row), flush=True)
        figures.append(figure(f"lm pipeline {schedule} {precision}", real["seconds"][0], real["work"],
                              processors=real["processors"]))
    return rows, figures


def write_doc(table: str) -> None:
    """Put ``table`` between the markers of docs/planner.md's "Planned vs measured"."""
    with open(DOC) as f:
        text = f.read()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{DOC} has no '{BEGIN}' marker: put it and '{END}' around the table")
    with open(DOC, "w") as f:
        f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main() -> None:
    """``--pipeline-only``: measure the pipeline rows only and keep the others from the last results."""
    spec = mt.plan.device("cpu", processors=4)
    rows, figures = [], []
    out = os.path.join(os.path.dirname(__file__), "results")
    if "--pipeline-only" in sys.argv[1:]:
        with open(os.path.join(out, "plan_vs_measured.json")) as f:
            last = json.load(f)
        rows = [r for r in last["rows"] if not r["layout"].startswith("pipeline")]
        figures = [f for f in last.get("vs_limit", []) if " pipeline " not in f.get("figure", "")]
    for model in ("lm", "seq2seq", "moe") if not rows else ():
        for layout, (mesh, rules) in LAYOUTS.items():
            if model == "moe" and layout == "model":
                rules += "; experts:m"
            for precision in ("fp32", "bf16"):
                cfg = BASE.replace(model=model, precision=precision)
                planned = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules)
                est = from_trace(planned, mesh, spec)
                real = measured(cfg, mesh, rules)
                comm = planned.comm.as_dict()
                row = {"model": model, "layout": layout, "mesh": mesh, "rules": rules, "precision": precision,
                       "planned_bytes": sum(v["bytes"] for v in comm.values()),
                       "measured_bytes": sum(v["bytes"] for v in real["comm"].values()),
                       "planned_calls": sum(v["calls"] for v in comm.values()),
                       "measured_calls": sum(v["calls"] for v in real["comm"].values()),
                       "collectives_equal": comm == real["comm"],
                       "planned_peak": planned.peak_bytes, "measured_peak": real["peak"],
                       "planned_step_s": est.step_seconds, "measured_step_s": real["seconds"],
                       "flops_by_dtype": planned.flops_by_dtype}
                rows.append(row)
                figures.append(figure(f"{model} {layout} {precision}", real["seconds"], real["work"],
                                      processors=real["processors"]))
                print(json.dumps(row), flush=True)
    more, more_figures = pipeline_rows(spec)
    rows += more
    figures += more_figures
    with open(os.path.join(out, "plan_vs_measured.json"), "w") as f:
        json.dump(attach({"device": {"float32_flops": spec.peak_flops["float32"],
                                     "bfloat16_flops": spec.peak_flops.get("bfloat16"),
                                     "copy_bandwidth": spec.default_link.bandwidth}, "rows": rows},
                         figures, NOTE), f, indent=1)
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |" for r in rows]
    with open(os.path.join(out, "plan_vs_measured.md"), "w") as f:
        f.write("\n".join(lines) + "\n" + section(figures, NOTE))
    write_doc("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
