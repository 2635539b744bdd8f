"""Pipeline schedules on gloo: 1F1B, interleaved 1F1B, ZB-H1, ZB-V, the measured bubble next to the simulated.

The decoder LM (split into chunks by layers, :mod:`meshtorch.pipeline.lm`) trains
on ``p`` gloo processes (``backend="torch"``, mesh ``stage:p``), one batch per
table, for each schedule and micro-batch count ``m``. From the executor's trace
of the best of ``--repeats`` steps (its clock, ``time.perf_counter``, is the
machine's monotonic clock, so the processes' times line up):

- measured bubble: ``1 - busy / (p · span)``, ``busy`` the stages' compute time
  (forwards, backwards, weight gradients; the executor times the compute only)
  and ``span`` the time from the first action's start to the last one's end on
  any stage (the optimizer update after it is left out of both);
- simulated bubble: :func:`meshtorch.pipeline.simulate` of the same table with
  each model chunk's mean measured action times, with ``comm=0`` (the stages wait
  only for each other's compute) and with ``comm`` = the measured hop: the
  mean time from a dependency's end on one stage to the start of the action
  that needs it on another, where that stage had nothing else to do (the
  message's transfer and the Python around it); and the published formula
  for uniform stages.

Writes ``benchmarks/results/<--results>.{json,md}`` and, with
``--timelines DIR``, the unit-slot timelines of the tables and the measured
timeline of each run at the first ``--micro`` (PNG, :func:`meshtorch.pipeline.plot.timeline`).
``--schedules`` picks the schedules (``name`` or ``name:v``).

    python benchmarks/pipeline_schedules.py [--stages 2 --micro 4 8 --repeats 3 --timelines docs/images]
    python benchmarks/pipeline_schedules.py --schedules 1f1b zb zbv:2 --results pipeline_schedules_zbv
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

import meshtorch as mt
from meshtorch.models import TransformerConfig
from meshtorch.pipeline import Simulation, build_schedule, simulate
from meshtorch.pipeline.lm import lm_pipeline
from meshtorch.pipeline.plot import timeline
from meshtorch.pipeline.schedule import dependencies

RESULTS = Path(__file__).parent / "results"
SCHEDULES = ("1f1b", "interleaved:2", "zb")  # the default --schedules


def run(cfg: TransformerConfig, schedule: str, v: int, m: int, batch: int, length: int, repeats: int) -> dict:
    """One stage's process: train ``repeats + 1`` single-batch tables, keep the trace of each."""
    torch.set_num_threads(1)  # one core per process: the stages do not fight over intra-op threads
    pipe = lm_pipeline(cfg, microbatches=m, schedule=schedule, virtual_stages=v,
                       optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab, (batch, length + 1), generator=g)
    shape = f"batch:{batch},length:{length}"
    ids, tgt = mt.from_global(seq[:, :-1].contiguous(), shape), mt.from_global(seq[:, 1:].contiguous(), shape)
    traces = []
    for r in range(repeats + 1):  # the first is a warm-up
        mt.current().comm.barrier()
        pipe.step(ids, tgt)
        if r:
            traces.append([(*t, c) for t, c in zip(pipe.trace, pipe.executor.trace_chunks)])
    return {"stage": pipe.stage, "traces": traces}


def _formula(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble for uniform stages (unit F = B = W for ZB-H1, whose formula needs m >= p, and for
    ZB-V, which needs m >= 2p - 1)."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb":
        return (p - 1) / (3 * m + p - 1) if m >= p else float("nan")
    if schedule == "zbv":
        return (p - 1) / (6 * m + p - 1) if m >= 2 * p - 1 else float("nan")
    return (p - 1) / (m + p - 1)


def _waits(table, start, end, key) -> list[float]:
    """Each cross-stage wait: from a dependency's end to the start of the action needing it, where
    the action's stage was free before the dependency ended (so the gap is the message's)."""
    hops = []
    for s in range(table.stages):
        prev = None
        for a in table.for_stage(s):
            deps = [key[d] for d in dependencies(s, a.chunk, a.kind, a.microbatch, table.stages,
                                                 table.virtual_stages, table.split_backward, table.placement)
                    if d[0] != s]
            for d in deps:
                if prev is None or end[prev] <= end[d]:
                    hops.append(start[a] - end[d])
            prev = a
    return hops


def measure(out: list[dict], schedule: str, p: int, m: int, v: int) -> tuple[dict, Simulation, dict]:
    """The measured and simulated bubble of the best repeat; the simulation of the measured times
    (for the timeline: its start/end replaced by the measured ones)."""
    table = build_schedule(schedule, p, m, virtual_stages=v)
    best = None
    for r in range(len(out[0]["traces"])):
        acts = [a for o in out for a in o["traces"][r]]
        span = max(a[3] for a in acts) - min(a[2] for a in acts)
        if best is None or span < best[0]:
            best = (span, r)
    span, r = best
    rows = {o["stage"]: o["traces"][r] for o in out}
    busy = sum(t1 - t0 for tr in rows.values() for _, _, t0, t1, *_ in tr)
    per_kind = {k: [statistics.mean(t1 - t0 for kk, _, t0, t1, *_ in rows[s] if kk == k) if any(
        kk == k for kk, *_ in rows[s]) else 0.0 for s in range(p)] for k in "FBW"}
    # simulate() takes each model chunk's own mean times: the LM's chunks differ (the first embeds, the
    # last projects onto the vocabulary and takes the loss), and under ZB-V both sit on stage 0
    per_chunk = {k: [0.0] * (p * v) for k in "FBW"}
    for c in range(p * v):
        s, local = table.where(c)
        for k in "FBW":
            times = [t1 - t0 for kk, _, t0, t1, _, cc in rows[s] if kk == k and cc == local]
            per_chunk[k][c] = statistics.mean(times) if times else 0.0
    scale = per_chunk["F"], per_chunk["B"]
    kw = {"weight": per_chunk["W"]} if table.split_backward else {}
    # the measured timeline as a Simulation of the table: each action's measured start and end
    t_min = min(a[2] for tr in rows.values() for a in tr)
    start, end, key = {}, {}, {}
    for s, tr in rows.items():
        for act, (k, i, t0, t1, _, c) in zip(table.for_stage(s), tr):
            if (act.kind, act.microbatch, act.chunk) != (k, i, c):
                raise RuntimeError(f"stage {s} ran {k}{i}.{c} where the table has {act}")
            start[act], end[act] = t0 - t_min, t1 - t_min
            key[(s, c, k, i)] = act
    hop = statistics.mean(_waits(table, start, end, key) or [0.0])
    sim = simulate(table, forward=scale[0], backward=scale[1], **kw)
    sim_hop = simulate(table, forward=scale[0], backward=scale[1], comm=hop, **kw)
    measured_bubble = 1 - busy / (p * span)
    shown = Simulation(span, measured_bubble, [], start, end, span)
    row = {"schedule": schedule, "virtual_stages": v, "microbatches": m, "step_ms": round(span * 1e3, 1),
           "sim_step_ms": round(sim.step_time * 1e3, 1), "sim_hop_step_ms": round(sim_hop.step_time * 1e3, 1),
           "hop_ms": round(hop * 1e3, 2), "bubble_measured": round(measured_bubble, 3),
           "bubble_sim": round(sim.bubble_fraction, 3), "bubble_sim_hop": round(sim_hop.bubble_fraction, 3),
           "bubble_formula": round(_formula(schedule, p, m, v), 3),
           "mean_ms": {k: [round(x * 1e3, 2) for x in vals] for k, vals in per_kind.items()},
           "messages": sim.messages}
    return row, sim, {"table": table, "measured": shown}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--timelines", default=None, help="write the PNG timelines into this directory")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), help="name or name:v each")
    ap.add_argument("--results", default="pipeline_schedules", help="file name in benchmarks/results")
    args = ap.parse_args()
    schedules = [(n, int(v or 1)) for n, _, v in (s.partition(":") for s in args.schedules)]
    p = args.stages
    cfg = TransformerConfig(vocab=256, d_model=args.d_model, heads=4, d_kv=args.d_model // 4,
                            d_ff=4 * args.d_model, layers=args.layers, max_length=args.length)
    rows = []
    for m in args.micro:
        for schedule, v in schedules:
            out = mt.launch(run, cfg, schedule, v, m, args.batch, args.length, args.repeats,
                            mesh=f"stage:{p}", backend="torch", timeout=600)
            row, sim, shown = measure(out, schedule, p, m, v)
            rows.append(row)
            print(f"{schedule:>11} v={v} m={m}: step {row['step_ms']:7.1f} ms measured, "
                  f"{row['sim_step_ms']:7.1f} simulated ({row['sim_hop_step_ms']:7.1f} with the measured hop "
                  f"{row['hop_ms']} ms); bubble {row['bubble_measured']:.3f} measured, "
                  f"{row['bubble_sim']:.3f} simulated ({row['bubble_sim_hop']:.3f}), "
                  f"{row['bubble_formula']:.3f} formula", flush=True)
            if args.timelines and m == args.micro[0]:
                d = Path(args.timelines)
                d.mkdir(parents=True, exist_ok=True)
                name = schedule if v == 1 else f"{schedule}-v{v}"
                timeline(shown["table"], str(d / f"pipeline-{name}-p{p}-m{m}.png"))
                timeline(shown["table"], str(d / f"pipeline-{name}-p{p}-m{m}-gloo.png"), shown["measured"],
                         xlabel="seconds (measured on gloo)",
                         title=f"{name}, {p} gloo processes, {m} micro-batches: measured, bubble "
                               f"{row['bubble_measured']:.1%} (simulated {row['bubble_sim']:.1%}, with the "
                               f"measured hop {row['bubble_sim_hop']:.1%})")
    RESULTS.mkdir(exist_ok=True)
    meta = {"model": {"d_model": args.d_model, "layers": args.layers, "batch": args.batch,
                      "length": args.length}, "mesh": f"stage:{p}", "backend": "torch (gloo)",
            "repeats": args.repeats, "torch": torch.__version__, "cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    (RESULTS / f"{args.results}.json").write_text(json.dumps(meta, indent=1))
    lines = ["| schedule | m | step ms measured | simulated | simulated + hop | hop ms (mean) "
             "| bubble measured | simulated | simulated + hop | formula (uniform) |", "|---" * 10 + "|"]
    for r in rows:
        name = r["schedule"] + (f" (v={r['virtual_stages']})" if r["virtual_stages"] > 1 else "")
        lines.append(f"| {name} | {r['microbatches']} | {r['step_ms']} | {r['sim_step_ms']} | "
                     f"{r['sim_hop_step_ms']} | {r['hop_ms']} | {r['bubble_measured']:.3f} | "
                     f"{r['bubble_sim']:.3f} | {r['bubble_sim_hop']:.3f} | {r['bubble_formula']:.3f} |")
    (RESULTS / f"{args.results}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
