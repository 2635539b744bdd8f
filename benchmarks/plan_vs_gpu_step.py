"""Planned vs measured on the GPU this machine has: the planner's step time and peak memory for
every size and variant ``benchmarks/gpu_step.py`` measured (its ``gpu_step.json``), priced with
each ``--hardware`` given: the built-in spec of the GPU's kind (its data sheet's rates,
:data:`meshtorch.plan.gpus.GPUS`; the default, found by the GPU's name in the file), and the device
file ``meshtorch plan --calibrate --device cuda`` wrote on it (``benchmarks/gpu_check.sh`` passes both).

Each variant is planned as the step it ran: ``meshtorch-*`` is the trainer's own step
(``gpu_step.train_config``: the recipe's model, AdamW, clipping, the run's precision), traced for
the priced device (``device=spec.device_type``: the fused AdamW on a GPU), eager, or compiled for
the ``*-compiled`` variants (``trace(compiled=True)``); the ``plain-*`` variants (the same model
written in plain PyTorch, SDPA and fused AdamW) are compared with the same plans, as the shared
H100 rows are (``benchmarks/plan_vs_h100.py``). Prints, and writes to ``RESULTS/plan_vs_gpu_step.md``,
a table per hardware: measured and planned step ms and their ratio (within +-25% is the planner's
target on a GPU), measured (``max_memory_allocated``) and planned peak GiB and theirs; then each
plan's terms. A measurement, not a check: exit 0 whatever the ratios, 2 without the measurements.
With ``gpu_step.py --dry-run``'s file (the tiny model on the CPU) it runs the same code on the CPU.

    python benchmarks/plan_vs_gpu_step.py --results benchmarks/results --hardware h100-pcie \
        --hardware benchmarks/results/gpu-calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import train_config  # noqa: E402 - the one definition of the benchmark's run

from meshtorch.plan.devices import device  # noqa: E402
from meshtorch.plan.estimate import from_trace  # noqa: E402
from meshtorch.plan.gpus import gpu_kind  # noqa: E402
from meshtorch.plan.layered import whole_trace  # noqa: E402
from meshtorch.recipes.lm.steps import training_step  # noqa: E402


def plan(size: dict, precision: str, compiled: bool, hardware: str) -> dict:
    """The planned step of ``gpu_step.py``'s meshtorch variant at ``size`` on ``hardware``."""
    spec = device(hardware)
    cfg = train_config(size, precision, compiled, spec.device_type, lr=3e-4)
    t = whole_trace(training_step(cfg, vocab=size["vocab"]), "b:1", "batch:b", compiled=compiled,
                    device=spec.device_type)
    est = from_trace(t, "b:1", spec)
    return {"step_ms": est.step_seconds * 1e3, "peak_gib": est.memory_bytes["total"] / 2 ** 30,
            "terms_ms": {k: round(v * 1e3, 3) for k, v in est.compute_terms.items()}}


def table(report: dict, hardware: str) -> list[str]:
    precision = report.get("precision", "bf16")
    lines = [f"### planned on `{hardware}` vs measured on {report['environment']['device_name']} "
             f"({precision}, torch {report['environment']['torch']})", "",
             "| size | variant | measured ms | planned ms | planned / measured | measured peak GiB "
             "| planned peak GiB | planned / measured |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    terms = []
    for name, size in report["sizes"].items():
        plans = {}
        for variant, row in size["variants"].items():
            if row.get("status") != "ok":
                lines.append(f"| {name} | {variant} | {row.get('status')} | | | | | |")
                continue
            compiled = variant.endswith("compiled")
            if compiled not in plans:
                plans[compiled] = plan(size["config"], precision, compiled, hardware)
                terms.append(f"- {name} {'compiled' if compiled else 'eager'}: "
                             f"{json.dumps(plans[compiled]['terms_ms'])}")
            p = plans[compiled]
            ratio = p["step_ms"] / row["step_ms"]
            flag = "" if 0.75 <= ratio <= 1.25 else " (outside +-25%)"
            peak = row.get("peak_memory_gib")
            mem = f"{peak} | {p['peak_gib']:.2f} | {p['peak_gib'] / peak:.2f}" if peak else \
                f"n/a | {p['peak_gib']:.2f} | "
            lines.append(f"| {name} | {variant} | {row['step_ms']:.2f} | {p['step_ms']:.2f} | "
                         f"{ratio:.2f}{flag} | {mem} |")
    return [*lines, "", "plan terms, ms:", *terms, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results",
                    help="where gpu_step.json is (and the .md goes)")
    ap.add_argument("--hardware", action="append", default=None,
                    help="a spec name (h100, h100-pcie, l4, ...: meshtorch.plan.gpus) or a device file; "
                    "repeat to compare (default: the spec of the GPU gpu_step.py measured)")
    args = ap.parse_args(argv)
    src = Path(args.results) / "gpu_step.json"
    if not src.exists():
        print(f"plan_vs_gpu_step: no {src}: run benchmarks/gpu_step.py first")
        return 2
    report = json.loads(src.read_text())
    hardware_list = args.hardware
    if not hardware_list:   # the built-in spec of the GPU measured (its data sheet's rates)
        name = report["environment"]["device_name"]
        if report.get("dry_run"):
            hardware_list = ["h100"]   # the CPU stands in: any GPU spec runs the same code
        else:
            kind = gpu_kind(name)
            if kind is None:
                print(f"plan_vs_gpu_step: {name!r} is not in meshtorch.plan.gpus.GPUS: pass --hardware FILE "
                      "(meshtorch plan --calibrate --device cuda writes one)")
                return 2
            hardware_list = [kind.spec]
    out = []
    for hardware in hardware_list:
        out += table(report, hardware)
    text = "\n".join(out)
    print(text)
    (Path(args.results) / "plan_vs_gpu_step.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
