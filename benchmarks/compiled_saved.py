"""What a training step saves for its backward, eager and compiled, beside the planner's peaks.

A diagnosis of the planner's model of a ``torch.compile``'d step's memory
(``meshtorch.plan.compiled_memory``: what Inductor fuses away, remakes in the backward, saves, and
writes in place). For meshtorch's trainer step at one size (``gpu_step.py``'s model and step:
the recipe's DecoderLM, AdamW, clip 1.0, bf16 autocast), eager and then compiled, it runs two
warm-up steps and one more under ``torch.autograd.graph.saved_tensors_hooks``, and prints:

- every storage the step saved for its backward, by dtype and size (counted once per storage,
  whatever view it was saved through; one of its shapes shown);
- the step's peak (``torch.cuda.max_memory_allocated``; ``n/a`` on the CPU) and the planner's
  (``mt.plan``'s trace of the same step for this device, eager or ``compiled=True``);
- the storages one variant saves and the other does not: where Inductor's partitioner and the
  eager step differ, which the planner's rules must follow.

On an H200 (torch 2.11, ~1.3B's width, 4 layers) compiled saved both [tokens, d_ff] tensors of
every layer and every bf16 weight copy, as eager, and two bf16 [tokens, d_model] copies a layer
fewer (``benchmarks/results/h200/compiled_saved.md``; docs/planner.md, "Re-measured on a lent
H200"). No assertion; writes
``RESULTS/compiled_saved.{json,md}``.

    python benchmarks/compiled_saved.py                       # on CUDA: ~1.3B's width, 4 layers
    python benchmarks/compiled_saved.py --device cpu --d-model 256 --layers 2 --batch 1   # a look on the CPU
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from gpu_step import batches, train_config, trainer_step  # noqa: E402 - the benchmark's one step
from plan_vs_gpu_step import plan  # noqa: E402 - its one plan

import meshtorch as mt
from meshtorch.plan.gpus import gpu_kind

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2 ** 20


def _saved_step(cfg, vocab: int, data: list, device: str) -> dict[str, Any]:
    """The trainer's step (run by mt.launch): two warm-up steps, then one whose saved storages are
    listed (shape, dtype, bytes), with its peak on CUDA."""
    step, meshed = trainer_step(cfg, vocab, data)
    for i in range(2):
        step.run([meshed[i]], i)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    saved: dict[int, tuple[list[int], str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved.setdefault(storage.data_ptr(), (list(t.shape), str(t.dtype).replace("torch.", ""),
                                              storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step.run([meshed[2]], 2)
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    # a storage by its dtype and bytes (the view it was saved through varies: a weight's bf16 copy
    # is saved transposed by one variant and not the other), with the first shape seen as its label
    counts = collections.Counter((d, n) for _, d, n in saved.values())
    shapes = {}
    for s, d, n in saved.values():
        shapes.setdefault((d, n), s)
    return {"peak_bytes": peak, "saved_bytes": sum(n for *_, n in saved.values()),
            "saved": [[shapes[d, n], d, n, c]
                      for (d, n), c in sorted(counts.items(), key=lambda kv: -kv[0][1])]}


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Saved for the backward, eager and compiled ({report['device_name']}, "
             f"torch {report['torch']})",
             "", f"`{report['command']}`: {json.dumps(report['size'])}", "",
             "| variant | saved MiB | measured peak GiB | planned peak GiB | planned / measured |",
             "|---|---:|---:|---:|---:|"]
    for name, r in report["variants"].items():
        peak = r["peak_bytes"]
        measured = f"{peak / 2 ** 30:.3f}" if peak else "n/a"
        ratio = f"{r['planned_bytes'] / peak:.3f}" if peak else ""
        lines.append(f"| {name} | {r['saved_bytes'] / MIB:.1f} | {measured} | "
                     f"{r['planned_bytes'] / 2 ** 30:.3f} | {ratio} |")
    for name, r in report["variants"].items():
        lines += ["", f"{name} saved (dtype, size each, storages; a shape one of them was saved as):", ""]
        lines += [f"- {d} {_size(n)} x {c} (e.g. {s})" for s, d, n, c in r["saved"]]
    if len(report["variants"]) == 2:
        (a, ra), (b, rb) = report["variants"].items()
        ca = collections.Counter({(d, n): c for _, d, n, c in ra["saved"]})
        cb = collections.Counter({(d, n): c for _, d, n, c in rb["saved"]})

        def said(diff: collections.Counter) -> str:
            return ", ".join(f"{c} x {d} {_size(n)}" for (d, n), c in sorted(diff.items())) or "none"

        lines += ["", f"saved by {a} and not by {b} (storages, by dtype and size): {said(ca - cb)}",
                  f"saved by {b} and not by {a} (storages, by dtype and size): {said(cb - ca)}"]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--d-model", type=int, default=2048, help="heads d_model/128 of 128, d_ff 4 x d_model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--variants", default="eager,compiled", help="eager, compiled or both")
    ap.add_argument("--hardware", default=None,
                    help="the spec the plan prices (default: this GPU's kind; on the CPU, h100)")
    ap.add_argument("--out", default=None, help=f"results folder (default {RESULTS} on CUDA, a temporary "
                                                "one on the CPU)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("compiled_saved.py: torch sees no CUDA GPU; pass --device cpu (small sizes) instead")
        return 2
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    hardware = a.hardware
    if hardware is None:
        kind = gpu_kind(name) if a.device == "cuda" else None
        hardware = kind.spec if kind else "h100"
    size = {"layers": a.layers, "d_model": a.d_model, "heads": max(1, a.d_model // 128),
            "d_kv": min(128, a.d_model), "d_ff": 4 * a.d_model, "vocab": a.vocab, "batch": a.batch,
            "length": a.length}
    data = batches(a.vocab, a.batch, a.length, 3)
    report: dict[str, Any] = {"command": "python benchmarks/compiled_saved.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "device_name": name, "torch": torch.__version__,
        "hardware": hardware, "size": size, "variants": {}}
    for variant in [v.strip() for v in a.variants.split(",") if v.strip()]:
        compiled = variant == "compiled"
        cfg = train_config(size, "bf16", compiled, a.device, lr=3e-4)
        got = mt.launch(_saved_step, cfg, a.vocab, data, a.device, mesh="b:1", rules="batch:b",
                        device=a.device)[0]
        got["planned_bytes"] = round(plan(size, "bf16", compiled, hardware)["peak_gib"] * 2 ** 30)
        report["variants"][variant] = got
        print(f"{variant}: saved {got['saved_bytes'] / MIB:.1f} MiB, peak "
              + (f"{got['peak_bytes'] / 2 ** 30:.3f} GiB" if got["peak_bytes"] else "n/a")
              + f", planned {got['planned_bytes'] / 2 ** 30:.3f} GiB on {hardware}", flush=True)
    text = markdown(report)
    print("\n" + text)
    out = Path(a.out) if a.out else (RESULTS if a.device == "cuda" else Path(tempfile.mkdtemp(
        prefix="compiled_saved_")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled_saved.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "compiled_saved.md").write_text(text)
    print(f"wrote {out / 'compiled_saved.json'} and {out / 'compiled_saved.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
