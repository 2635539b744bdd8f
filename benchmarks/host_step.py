"""meshtorch's host time per training step on the one-GPU configuration, phase by phase, vs plain PyTorch.

On a GPU, a small model's step is paid in host time: the GPU waits while Python issues each op
(issue 25: at GPT-2-small size on an H100, ~4.5 ms of meshtorch's 35 ms step is the GPU waiting).
This benchmark runs the SAME op structure on the CPU at tiny sizes, where nearly all of a step is
host time, so what it measures is the host's share of a GPU step:

* ``meshtorch``: the step ``meshtorch train --device cuda`` takes (``gpu_step.py``'s
  ``meshtorch-eager``: the recipe's :class:`~meshtorch.models.DecoderLM`, bf16
  :func:`meshtorch.amp.autocast`, ``mt.overlap()``, mean cross-entropy, backward,
  :func:`meshtorch.optim.clip_grad_norm_` 1.0, the recipe's AdamW) on one processor ``b:1``;
  the recipe picks the fused AdamW for a CUDA parameter, so this run makes it pick it here too;
* ``plain``: ``gpu_step.py``'s ``plain-eager`` (``overhead.PlainLM`` with SDPA,
  ``torch.optim.AdamW(fused=True)``, ``torch.nn.utils.clip_grad_norm_``), same weights.

Per phase of a step (zero_grad, forward+loss under autocast, backward, clip, optimizer step):
Python frames and calls into C functions (``sys.setprofile``, as ``forward_calls.py`` counts them:
counts do not move with the machine's load) in one step, and the thread's CPU time
(``time.thread_time``, one torch thread), the minimum over ``--steps`` steps per phase.

Against the limit (the README's rule): the step's FLOPs (``gpu_step.work_of``: 6·N + attention)
at this machine's matmul rate (``limits.json``) take microseconds: the rest is host time, which is
what this measures; the target is meshtorch's host time <= 1.1x plain's.

With ``--compile`` both sides compile the loss as ``gpu_step.py``'s compiled variants do
(``meshtorch.compiler.compile_step(model.loss)`` vs ``torch.compile(model.loss)``; backward through
AOTAutograd, clip and step eager): the forward phase is then one compiled call (guards, the wrappers,
Inductor's kernels), the backward the compiled backward's. ``--size ce`` keeps the tiny model's ops
but GPT-2's vocabulary over 256 rows, where the loss's float32 [rows, vocab] passes dominate (the
CPU's picture of a cross-entropy that costs GPU time, issue 25).

Run:
    python benchmarks/host_step.py [--steps 30] [--precision bf16|fp32] [--size tiny|small|ce] [--compile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import meshtorch as mt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step as G  # noqa: E402 - the GPU benchmark's variants, which this one mirrors
from forward_calls import frames_of  # noqa: E402 - one way to count a step's Python
from limits import Work, attach, count, figure, section  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "host_step"
PHASES = ("zero_grad", "forward", "backward", "clip", "step")
# the 124m configuration's op structure (12 layers, 12 heads) at sizes where the host dominates
SIZES = {
    "tiny": dict(layers=12, d_model=48, heads=12, d_kv=4, d_ff=192, vocab=512, batch=1, length=16),
    "small": dict(layers=2, d_model=48, heads=4, d_kv=12, d_ff=192, vocab=512, batch=1, length=16),
    "ce": dict(layers=12, d_model=48, heads=12, d_kv=4, d_ff=192, vocab=50304, batch=1, length=256),
}
TARGET = 1.10  # issue 25 (host12): meshtorch host time per step <= 1.1x plain


class Phases:
    """Per-phase counters of one run: frames and C calls of a counted step, CPU seconds of every step."""

    def __init__(self) -> None:
        self.counting = False
        self.counts: dict[str, list[int]] = {p: [0, 0] for p in PHASES}
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}
        self.work = None  # limits.Work of one step

    def run(self, phase: str, fn: Callable[[], Any]) -> Any:
        if self.counting:
            out, frames, calls = frames_of(fn)
            self.counts[phase][0] += frames
            self.counts[phase][1] += calls
            return out
        t = time.thread_time()
        out = fn()
        self.times[phase].append(time.thread_time() - t)
        return out


def _loop(steps: dict[str, Callable[[int, Phases], float]], n: int, warmup: int) -> dict[str, Phases]:
    """For each variant's ``step``: ``warmup`` steps, one counted (frames and calls), one counted in
    FLOPs and bytes (``limits.count``); then ``n`` timed steps of each, the variants taking turns
    (a load that comes and goes on a shared machine slows both alike)."""
    out = {}
    for name, step in steps.items():
        ph = out[name] = Phases()
        for i in range(warmup):
            step(i, Phases())
        ph.counting = True
        step(warmup, ph)
        ph.counting = False
        # (a compiled loss runs eagerly while FLOPs are counted: Dynamo refuses the counter's mode)
        with torch.compiler.set_stance("force_eager"):
            _, ph.work = count(lambda step=step: step(warmup + 1, Phases()))
    for i in range(n):
        for name, step in steps.items():
            step(warmup + 2 + i, out[name])
    return out


def _meshtorch(cfg, vocab: int, data: list) -> Callable[[int, Phases], float]:
    """PlainStep.run's body (strategies.py), one phase at a time, on a PlainStep's model, optimizer
    and parameter list."""
    from meshtorch import optim
    from meshtorch.recipes.lm.optimizer import make_optimizer, optimizer_step
    from meshtorch.recipes.lm.steps import build_model
    from meshtorch.recipes.lm.strategies import PlainStep, overlapped, precision_context

    model = build_model(cfg, vocab)
    plain = PlainStep(cfg, model, make_optimizer(cfg, model))  # (compile_step(model.loss) with --compile)
    opt = plain.opt
    shape = f"batch:{cfg.run.batch},length:{cfg.run.length}"
    meshed = [(mt.from_global(i, shape), mt.from_global(t, shape)) for i, t in data]

    def step(i: int, ph: Phases) -> float:
        ids, tgt = meshed[i % len(meshed)]
        ph.run("zero_grad", lambda: opt.zero_grad(set_to_none=True))
        with overlapped(cfg):
            with precision_context(cfg):
                loss = ph.run("forward", lambda: plain.loss(ids, tgt))
            ph.run("backward", loss.backward)
        ph.run("clip", lambda: optim.clip_grad_norm_(plain.params, cfg.optimizer.clip))
        ph.run("step", lambda: optimizer_step(opt))
        return loss.item()

    return step


def _plain(twin: G.Twin, precision: str, data: list, compiled: bool = False
           ) -> Callable[[int, Phases], float]:
    """gpu_step.run_plain's step, one phase at a time."""
    model, opt, params = G.plain_twin(twin, "cpu")
    loss_fn = torch.compile(model.loss) if compiled else model.loss
    autocast = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16"
                else contextlib.nullcontext)

    def step(i: int, ph: Phases) -> float:
        ids, tgt = data[i % len(data)]
        ph.run("zero_grad", lambda: opt.zero_grad(set_to_none=True))
        with autocast():
            loss = ph.run("forward", lambda: loss_fn(ids, tgt))
        ph.run("backward", loss.backward)
        ph.run("clip", lambda: torch.nn.utils.clip_grad_norm_(params, twin.clip))
        ph.run("step", opt.step)
        return loss.item()

    return step


def _both(cfg, vocab: int, data: list, twin: G.Twin, n: int, warmup: int) -> dict[str, Phases]:
    """Both variants in one launch (one processor runs in the caller's thread: plain PyTorch's steps
    run there as outside it), their steps interleaved."""
    # one intra-op thread: mt.launch gives its processor the process's threads (OMP_NUM_THREADS,
    # else every core), which the caller's set_num_threads does not set
    torch.set_num_threads(1)
    steps = {"meshtorch": _meshtorch(cfg, vocab, data),
             "plain": _plain(twin, cfg.run.precision, data, cfg.run.compile)}
    return _loop(steps, n, warmup)


@contextlib.contextmanager
def fused_adamw():
    """The recipe's optimizer as it is on a GPU: it picks the fused AdamW for CUDA parameters only
    (``make_optimizer`` asks ``meshtorch.plan.tracing.device_type``); torch's fused AdamW runs on the
    CPU too, so make the recipe see a GPU here."""
    import meshtorch.plan.tracing as T

    before = T.device_type
    T.device_type = lambda t: "cuda"
    try:
        yield
    finally:
        T.device_type = before


def measure(size_name: str, precision: str, steps: int, warmup: int, size: dict[str, int] | None = None,
            compiled: bool = False) -> dict[str, Any]:
    """Both variants' per-phase counts and CPU times, and their figures against this machine's limits
    (``size``: the model's sizes, in place of :data:`SIZES`' entry ``size_name``; ``compiled``: both
    losses compiled, the first of the ``warmup`` steps compiling)."""
    size = size or SIZES[size_name]
    cfg = G.train_config(size, precision, compiled, "cpu", 3e-4)
    data = G.batches(size["vocab"], size["batch"], size["length"], 8)
    with fused_adamw():
        twin = mt.launch(G._twin_program, cfg, size["vocab"], mesh="b:1", rules="batch:b")[0]
        runs = mt.launch(_both, cfg, size["vocab"], data, twin, steps, warmup, mesh="b:1", rules="batch:b")[0]
    out: dict[str, Any] = {"size": size, "precision": precision, "compiled": compiled, "steps": steps,
                           "warmup": warmup, "phases": {}}
    for p in PHASES:
        out["phases"][p] = {k: {"frames": r.counts[p][0], "c_calls": r.counts[p][1],
                                "cpu_ms": round(1e3 * min(r.times[p]), 4)} for k, r in runs.items()}
    out["total"] = {k: {m: round(sum(out["phases"][p][k][m] for p in PHASES), 4)
                        for m in ("frames", "c_calls", "cpu_ms")} for k in runs}
    out["ratio_cpu"] = round(out["total"]["meshtorch"]["cpu_ms"] / out["total"]["plain"]["cpu_ms"], 3)
    out["work"] = {k: {"flops": r.work.flops, "bytes": r.work.bytes} for k, r in runs.items()}
    return out


def against_limits(r: dict[str, Any], size_name: str) -> dict[str, Any]:
    """``r`` with each variant's step against this machine's limits (``limits.py``): a step's CPU
    time is the sum of its phases' minima, what the host spends at best."""
    figures = [figure(f"{k} step host time ({size_name}, {r['precision']})", r["total"][k]["cpu_ms"] / 1e3,
                      Work(**r["work"][k])) for k in r["total"]]
    return attach(r, figures, "CPU time of one thread per step (sum of the phases' minima); the "
                  "limit is what the step's FLOPs and bytes allow: the rest is host time.")


def markdown(r: dict[str, Any]) -> str:
    s = r["size"]
    how = ", compiled loss" if r.get("compiled") else ""
    lines = [f"# Host time per step, meshtorch vs plain PyTorch ({r['precision']}{how}, one CPU thread)", "",
             f"`python benchmarks/host_step.py`: the one-GPU step's op structure ({s['layers']} layers, "
             f"{s['heads']} heads) at d_model {s['d_model']}, vocab {s['vocab']}, batch {s['batch']} x "
             f"{s['length']}, where the step is host time. Frames and C calls of one step (sys.setprofile); "
             f"CPU ms the minimum over {r['steps']} steps (time.thread_time).", "",
             "| phase | frames mt / plain | C calls mt / plain | CPU ms mt / plain | ratio |",
             "|---|---:|---:|---:|---:|"]
    rows = [(p, r["phases"][p]) for p in PHASES] + [("**step**", r["total"])]
    for name, v in rows:
        m, q = v["meshtorch"], v["plain"]
        ratio = m["cpu_ms"] / q["cpu_ms"] if q["cpu_ms"] else float("inf")
        lines.append(f"| {name} | {m['frames']} / {q['frames']} | {m['c_calls']} / {q['c_calls']} | "
                     f"{m['cpu_ms']:.3f} / {q['cpu_ms']:.3f} | {ratio:.2f} |")
    ok = "meets" if r["ratio_cpu"] <= TARGET else "misses"
    lines += ["", f"meshtorch / plain host time per step: **{r['ratio_cpu']:.2f}** ({ok} <= {TARGET}); "
              f"torch {torch.__version__}."]
    return "\n".join(lines) + section(r["vs_limit"], r["vs_limit_note"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant (CPU ms: the minimum)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--size", choices=tuple(SIZES), default="tiny")
    ap.add_argument("--compile", action="store_true",
                    help="compile both losses (compile_step vs torch.compile) as gpu_step's compiled ones")
    ap.add_argument("--out", default=None, help="directory for host_step.{json,md} (default: results)")
    a = ap.parse_args(argv)
    r = against_limits(measure(a.size, a.precision, a.steps, a.warmup, compiled=a.compile), a.size)
    r["torch"] = torch.__version__
    text = markdown(r)
    print(text)
    out = Path(a.out) if a.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    # (the runs before these options keep their files' names)
    stem = STEM + ("_compiled" if a.compile else "") + ("_ce" if a.size == "ce" else "")
    (out / f"{stem}.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
