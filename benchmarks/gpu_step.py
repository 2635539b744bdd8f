"""One GPU at full speed: meshtorch's training step vs plain PyTorch's, eager and compiled, at
GPT-2-small size and at ~1.3B, with model-FLOP utilisation against the GPU's nominal and measured peak.

Four variants per size, each a fresh model from the SAME initial weights on the SAME batches:

- ``meshtorch-eager``: the step ``meshtorch train --device cuda`` takes, through the public API:
  ``mt.launch(program, mesh="b:1", rules="batch:b", device="cuda")`` running the recipe's own
  model (:func:`~meshtorch.recipes.lm.steps.build_model`: a :class:`~meshtorch.models.DecoderLM`),
  optimizer (:func:`~meshtorch.recipes.lm.optimizer.make_optimizer`) and step
  (:class:`~meshtorch.recipes.lm.strategies.PlainStep`: ``zero_grad(set_to_none=True)``, bf16 autocast
  forward, mean cross-entropy, backward, global-norm clip 1.0, AdamW with the recipe's weight-decay
  groups);
- ``meshtorch-compiled``: the same with ``--compile`` (the recipe compiles the loss; its
  backward follows; the optimizer step stays eager);
- ``plain-eager``: the same model written as one writes it in PyTorch for speed
  (``benchmarks/overhead.py``'s :class:`PlainLM` with ``sdpa=True``:
  ``F.scaled_dot_product_attention(is_causal=True)``), its weights copied from meshtorch's, the
  same step with ``torch.optim.AdamW(fused=True)`` over the same groups, lr, betas and decay;
- ``plain-compiled``: the same with ``torch.compile`` of the loss, as the recipe compiles its own.

So whatever the recipe's step gains (SDPA attention, fused AdamW, one compiled graph) shows up
here without editing this script.

Timing: after ``--warmup`` steps, the median of ``--steps`` steps, each ending in
``loss.item()`` (as the training loop's) and ``torch.cuda.synchronize()``. A variant's compile
seconds are what its warm-up steps took beyond that many median steps (the first step compiles;
a recompile in a later warm-up step is counted too). Peak memory is
``torch.cuda.max_memory_allocated`` over the variant's steps (weights, gradients, optimizer state,
activations). The losses of every variant are held against ``plain-eager``'s, step by step.

Model-FLOP utilisation (MFU) has ONE convention here, PaLM's (appendix B) as nanoGPT counts it,
the one ``meshtorch train`` reports (:func:`~meshtorch.recipes.lm.report.step_flops`)::

    FLOPs per token = 6·N + 12·layers·heads·d_kv·length

with N the parameters less the learned position table (a lookup, not a matmul); the tied token
table is counted once, as the output projection's matmul. The second term is attention's two
score products (QK^T and AV, forward and backward) over the whole length: the half the causal
mask skips is counted, as PaLM does. MFU = FLOPs per step / step time / peak, against (a) the
GPU's nominal dense rate in the run's precision (bf16 tensor cores, or plain fp32 with
``--precision fp32``: the library's table :data:`meshtorch.plan.gpus.GPUS` by
``torch.cuda.get_device_name()``, or ``--peak-tflops``) and (b) the rate of 8192³ bf16 matmuls
measured at the start of the run: what the GPU's matmuls reach at best here, so "% of matmul peak"
says how believable a figure is.

Writes ``benchmarks/results/gpu_step.{json,md}`` after every variant (a run stopped part-way keeps
what it measured). Without a GPU it says so and exits 0. ``--dry-run`` runs every variant of a
tiny model on the CPU (no CUDA call) and writes to a temporary directory unless ``--out`` is given.
Exit status 1 when a variant failed or its losses left plain-eager's.

Run:
    python benchmarks/gpu_step.py                      # both sizes, all four variants
    python benchmarks/gpu_step.py --quick              # fewer steps (benchmarks/gpu_check.sh)
    python benchmarks/gpu_step.py --sizes 124m --variants plain-eager,meshtorch-eager
    python benchmarks/gpu_step.py --dry-run            # the tiny model on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import meshtorch as mt
from meshtorch.compiler import compile_step
from meshtorch.models import TransformerConfig
from meshtorch.plan.devices import matmul_rate
from meshtorch.plan.gpus import gpu_kind
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.optimizer import make_optimizer
from meshtorch.recipes.lm.report import step_flops
from meshtorch.recipes.lm.steps import build_model
from meshtorch.recipes.lm.strategies import PlainStep

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import PlainLM  # noqa: E402 - the one plain-PyTorch twin of DecoderLM

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "gpu_step"

# the model sizes: GPT-2 small, a ~1.3B model (1.21B without embeddings), and the dry run's
SIZES: dict[str, dict[str, int]] = {
    "124m": dict(layers=12, d_model=768, heads=12, d_kv=64, d_ff=3072, vocab=50304, batch=8, length=1024),
    "1b": dict(layers=24, d_model=2048, heads=16, d_kv=128, d_ff=8192, vocab=50304, batch=8, length=1024),
    "tiny": dict(layers=2, d_model=64, heads=4, d_kv=16, d_ff=256, vocab=512, batch=4, length=64),
}
# in order of importance, so that a run out of time has the pair that matters most first
VARIANTS = ("meshtorch-eager", "plain-eager", "plain-compiled", "meshtorch-compiled")
# issue 25's targets: meshtorch step / plain step, eager and compiled, and peak memory
TARGETS = {"eager": 1.05, "compiled": 1.10, "memory": 1.10}

def amount(flops: float, unit: str = "FLOP") -> str:
    """FLOPs (or FLOP/s with ``unit="FLOP/s"``) in T or G, as suits them (a dry run's CPU makes G).

    Example:
        >>> amount(7.0032e12), amount(3.1e10, "FLOP/s")
        ('7.00 TFLOP', '31.00 GFLOP/s')
    """
    return f"{flops / 1e12:.2f} T{unit}" if flops >= 1e12 else f"{flops / 1e9:.2f} G{unit}"


def rate(flops_per_s: float) -> str:
    return amount(flops_per_s, "FLOP/s")


# ---------------------------------------------------------------- the work of a step
@dataclasses.dataclass(frozen=True)
class Work:
    """The FLOPs of one training step under this benchmark's one MFU convention."""

    params: int  # all parameters
    matmul_params: int  # N: less the position table (and an untied input table)
    per_token: float  # 6·N + attention
    attention_per_token: float  # 12·layers·heads·d_kv·length
    tokens: int

    @property
    def per_step(self) -> float:
        return self.per_token * self.tokens

    def formula(self, mcfg: TransformerConfig, length: int) -> str:
        return (f"FLOPs/token = 6·N + 12·layers·heads·d_kv·length = 6·{self.matmul_params:,} + "
                f"12·{mcfg.layers}·{mcfg.heads}·{mcfg.d_kv}·{length} = "
                f"{6 * self.matmul_params / 1e6:,.1f}M + "
                f"{self.attention_per_token / 1e6:,.1f}M = {self.per_token / 1e6:,.1f} MFLOP; "
                f"x {self.tokens:,} tokens = {amount(self.per_step)} per step")


def work_of(mcfg: TransformerConfig, params: int, batch: int, length: int) -> Work:
    """A step's FLOPs as :func:`~meshtorch.recipes.lm.report.step_flops` counts them, in parts.

    Example (GPT-2 small: 124,392,960 parameters, 854.9 MFLOP a token):
        >>> cfg = TransformerConfig(vocab=50304, d_model=768, heads=12, d_kv=64, d_ff=3072, layers=12,
        ...                         max_length=1024)
        >>> w = work_of(cfg, 124_392_960, batch=8, length=1024)
        >>> w.matmul_params, int(w.attention_per_token), int(w.per_token)
        (123606528, 113246208, 854885376)
    """
    per_token = step_flops(mcfg, 1, length, params)
    attention = 12.0 * mcfg.layers * mcfg.heads * mcfg.d_kv * length
    n = round((per_token - attention) / 6)
    return Work(params, n, per_token, attention, batch * length)


# ---------------------------------------------------------------- data and configuration
def batches(vocab: int, batch: int, length: int, n: int, seed: int = 0
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of (ids, next ids), on the host: token ids drawn from a Zipf law over the
    vocabulary (as words in text), so the loss falls as the model learns the frequencies and the
    losses of two variants can part if their training differs."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    ids = torch.multinomial(weights, n * batch * (length + 1), replacement=True, generator=g)
    ids = ids.view(n, batch, length + 1)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in ids]


def train_config(size: dict[str, int], precision: str, compiled: bool, device: str, lr: float) -> TrainConfig:
    """``meshtorch train``'s options for one processor at ``size`` (constant learning rate)."""
    return TrainConfig.of(
        layers=size["layers"], d_model=size["d_model"], heads=size["heads"], d_kv=size["d_kv"],
        d_ff=size["d_ff"], batch=size["batch"], length=size["length"], precision=precision,
        compile=compiled, mesh="b:1", rules="batch:b", device=device, lr=lr, warmup=0,
        lr_schedule="constant", seed=0)


@dataclasses.dataclass
class Twin:
    """What the plain variants copy from meshtorch's: the model (on the host) and its optimizer."""

    model: PlainLM
    decayed: set[str]  # DecoderLM parameter names in the weight-decay group
    options: dict[str, Any]  # lr, betas, eps, weight_decay of the recipe's AdamW
    params: int
    clip: float  # the recipe's global-norm bound (0: none)


def _twin_program(cfg: TrainConfig, vocab: int) -> Twin:
    model = build_model(cfg, vocab)
    opt = make_optimizer(cfg, model)
    if not isinstance(opt, torch.optim.AdamW):
        raise TypeError(f"the recipe's optimizer is {type(opt).__name__}; this benchmark mirrors AdamW")
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    g = opt.param_groups[0]
    options = {"lr": g["lr"], "betas": g["betas"], "eps": g["eps"],
               "weight_decay": max(g["weight_decay"] for g in opt.param_groups)}
    return Twin(PlainLM(model, sdpa=True).to("cpu"), decayed, options, model.num_parameters(),
                cfg.optimizer.clip)


# ---------------------------------------------------------------- running the variants
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_steps(step: Callable[[int], float], n: int, device: torch.device, profile: int = 0
              ) -> dict[str, Any]:
    """Run ``step(i)`` for i < n (each returns the loss as a float), timing each to a synchronize;
    then ``profile`` more steps under ``torch.profiler`` (:func:`profile_steps`), after the peak is read."""
    times, losses = [], []
    for i in range(n):
        _sync(device)
        t = time.perf_counter()
        losses.append(step(i))
        _sync(device)
        times.append(time.perf_counter() - t)
    out = {"times": times, "losses": losses, "peak_bytes": _peak(device)}
    if profile:
        out["profile"] = profile_steps(lambda i: step((n + i) % n), profile, device)
    return out


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals ``spans`` merged where they overlap, in order (kernels on several streams at
    once count once).

    Example:
        >>> merged([(2, 6), (0, 4), (10, 11)]), merged([])
        ([(0, 6), (10, 11)], [])
    """
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals ``spans`` (:func:`merged`).

    Example:
        >>> covered([(0, 4), (2, 6), (10, 11)]), covered([])
        (7.0, 0.0)
    """
    return float(sum(b - a for a, b in merged(spans)))


def device_kernels(events: list) -> list:
    """The GPU kernels and copies of a profile's events: its CUDA events less the user annotations
    Kineto also gives a CUDA device type (``record_function`` ranges: ``ProfilerStep``,
    ``Optimizer.step#AdamW.step``, torch.compile's regions), which span the gaps between kernels;
    torch's own totals leave them out the same way (``is_user_annotation``).

    Example:
        >>> from types import SimpleNamespace as E
        >>> cuda = torch.autograd.DeviceType.CUDA
        >>> events = [E(name="sgemm", device_type=cuda, is_user_annotation=False),
        ...           E(name="Optimizer.step#AdamW.step", device_type=cuda, is_user_annotation=True),
        ...           E(name="aten::mm", device_type=torch.autograd.DeviceType.CPU, is_user_annotation=False)]
        >>> [e.name for e in device_kernels(events)]
        ['sgemm']
    """
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


def idle_gaps(kernels: list, host: list, top: int = 5, least_us: float = 20.0) -> dict[str, Any]:
    """Where the GPU waited: the gaps between the union of ``kernels``' intervals (profiler events
    with ``time_range`` in µs) of at least ``least_us``, their count and total, and the ``top``
    longest, each with the host's innermost events running at its middle (``host``: CPU events,
    user annotations such as ``Optimizer.step#AdamW.step`` among them), what the host was doing
    while the GPU had nothing queued.

    Example:
        >>> from types import SimpleNamespace as E
        >>> def ev(name, a, b):
        ...     return E(name=name, time_range=E(start=a, end=b))
        >>> kernels = [ev("gemm", 0, 100), ev("add", 90, 120), ev("gemm", 400, 500)]
        >>> host = [ev("step", 0, 600), ev("aten::item", 130, 390), ev("aten::_local_scalar_dense", 140, 380)]
        >>> g = idle_gaps(kernels, host)
        >>> g["count"], g["total_us"], g["top"][0]["us"], g["top"][0]["host"]
        (1, 280.0, 280.0, ['aten::_local_scalar_dense', 'aten::item', 'step'])
    """
    busy = merged([(e.time_range.start, e.time_range.end) for e in kernels])
    gaps = [(end, a) for (_, end), (a, _) in zip(busy, busy[1:]) if a - end >= least_us]
    out: dict[str, Any] = {"count": len(gaps), "total_us": float(sum(b - a for a, b in gaps)), "top": []}
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        mid = (a + b) / 2
        around = sorted((e for e in host if e.time_range.start <= mid <= e.time_range.end),
                        key=lambda e: e.time_range.end - e.time_range.start)
        out["top"].append({"us": float(b - a), "host": [e.name[:80] for e in around[:3]]})
    return out


def profile_steps(step: Callable[[int], float], n: int, device: torch.device, top: int = 8) -> dict[str, Any]:
    """Where ``n`` steps' time goes, from ``torch.profiler`` (CPU, and CUDA on a GPU): the wall time
    per step (to a synchronize, the profiler's own overhead included), the time per step at least one
    GPU kernel or copy ran (``device_busy_ms``, the union of their intervals) and the rest
    (``device_idle_ms``: the GPU waiting for the host, or for a sync), the ``top`` kernels by GPU
    time per step (on the CPU: the ops by self CPU time), and on a GPU the idle gaps with what the
    host was running in the longest (:func:`idle_gaps`, over all ``n`` steps). Issue 25 used this to
    find that a 124M step's GPU waited ~4 ms on meshtorch's host and spent 2.6 ms in a float32
    log-softmax.

    Example (the CPU: no device figures):
        >>> import torch
        >>> r = profile_steps(lambda i: float(torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()), 2,
        ...                   torch.device("cpu"))
        >>> r["steps"], r["device_busy_ms"], r["top"][0]["name"]
        (2, None, 'aten::mm')
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _sync(device)
        t = time.perf_counter()
        for i in range(n):
            step(i)
        _sync(device)
        wall = time.perf_counter() - t
    out: dict[str, Any] = {"steps": n, "wall_ms": round(1e3 * wall / n, 3), "device_busy_ms": None,
                           "device_idle_ms": None}
    if cuda:
        kernels = device_kernels(prof.events())
        busy = covered([(e.time_range.start, e.time_range.end) for e in kernels])
        out["device_busy_ms"] = round(busy / 1e3 / n, 3)
        out["device_idle_ms"] = round(max(out["wall_ms"] - out["device_busy_ms"], 0.0), 3)
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            acc = by_name.setdefault(e.name, [0.0, 0])
            acc[0] += e.time_range.end - e.time_range.start
            acc[1] += 1
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
        out["top"] = [{"name": k[:120], "ms": round(v[0] / 1e3 / n, 3), "calls": round(v[1] / n, 1)}
                      for k, v in ranked[:top]]
        cpu = torch.autograd.DeviceType.CPU
        out["gaps"] = idle_gaps(kernels, [e for e in prof.events() if e.device_type == cpu])
    else:
        rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)
        out["top"] = [{"name": r.key[:120], "ms": round(r.self_cpu_time_total / 1e3 / n, 3),
                       "calls": round(r.count / n, 1)} for r in rows[:top]]
    return out


def trainer_step(cfg: TrainConfig, vocab: int, data: list) -> tuple[PlainStep, list]:
    """``meshtorch train``'s step of ``cfg`` on one processor (run inside ``mt.launch``) and the
    batches ``data`` as its MeshTensors: ``step.run([meshed[i]], i)`` takes step ``i``."""
    model = build_model(cfg, vocab)
    step = PlainStep(cfg, model, make_optimizer(cfg, model))
    shape = f"batch:{cfg.run.batch},length:{cfg.run.length}"
    return step, [(mt.from_global(i, shape), mt.from_global(t, shape)) for i, t in data]


def _mesh_program(cfg: TrainConfig, vocab: int, data: list, backend: str, profile: int = 0) -> dict[str, Any]:
    device = mt.current().device or torch.get_default_device()
    step, meshed = trainer_step(cfg, vocab, data)
    if cfg.run.compile and backend != "inductor":  # the recipe compiles with inductor
        step.loss = compile_step(step.model.loss, backend=backend)
    _reset_peak(device)
    return run_steps(lambda i: step.run([meshed[i]], i), len(meshed), device, profile)


def run_meshtorch(cfg: TrainConfig, vocab: int, data: list, device: torch.device, backend: str = "inductor",
                  profile: int = 0) -> dict[str, Any]:
    """The recipe's step of ``cfg`` on one processor, as ``meshtorch train`` launches it (``profile``:
    that many more steps under the profiler, :func:`profile_steps`)."""
    return mt.launch(_mesh_program, cfg, vocab, data, backend, profile, mesh="b:1", rules="batch:b",
                     device=device.type)[0]


def plain_twin(twin: Twin, device: torch.device | str
               ) -> tuple[PlainLM, torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """A copy of the twin on ``device``, its ``AdamW(fused=True)`` over the recipe's weight-decay
    groups (lr, betas, eps, decay), and its parameters in order (what the clip reads)."""
    model = copy.deepcopy(twin.model).to(device)
    decay = [p for n, p in model.named_parameters() if model.names[n] in twin.decayed]
    keep = [p for n, p in model.named_parameters() if model.names[n] not in twin.decayed]
    opts = {k: v for k, v in twin.options.items() if k != "weight_decay"}
    groups = [g for g in ({"params": decay, "weight_decay": twin.options["weight_decay"]},
                          {"params": keep, "weight_decay": 0.0}) if g["params"]]
    return model, torch.optim.AdamW(groups, fused=True, **opts), list(model.parameters())


def run_plain(twin: Twin, compiled: bool, backend: str, precision: str, data: list, device: torch.device,
              profile: int = 0) -> dict[str, Any]:
    """The same step in plain PyTorch: the twin's weights, ``AdamW(fused=True)``, optional compile."""
    model, opt, params = plain_twin(twin, device)
    loss_fn = torch.compile(model.loss, backend=backend) if compiled else model.loss
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else (
        contextlib.nullcontext)

    def step(i: int) -> float:
        ids, tgt = data[i]
        opt.zero_grad(set_to_none=True)  # before the forward, as the trainer (PlainStep.run) does
        with autocast():
            loss = loss_fn(ids, tgt)
        loss.backward()
        if twin.clip:
            torch.nn.utils.clip_grad_norm_(params, twin.clip)
        opt.step()
        return loss.item()

    _reset_peak(device)
    return run_steps(step, len(data), device, profile)


def compile_counters() -> dict[str, int] | None:
    """Graphs and graph breaks Dynamo counted since the last :func:`clear_compile_counters`
    (``torch._dynamo.utils.counters``, private: ``None`` where a torch version lacks it)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def clear_compile_counters() -> None:
    try:
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
    except (AttributeError, ImportError):
        pass


def summarise(raw: dict[str, Any], warmup: int, work: Work, nominal: float | None, measured: float,
              compiled: bool) -> dict:
    """A variant's figures from its steps; ``compile_s`` (compiled variants) is what the warm-up
    steps took beyond as many median steps."""
    timed = raw["times"][warmup:]
    t = statistics.median(timed)
    extra = sum(raw["times"][:warmup]) - warmup * t
    peak = raw["peak_bytes"]
    out = {"step_ms": round(1e3 * t, 3), "step_ms_min": round(1e3 * min(timed), 3),
           "step_ms_max": round(1e3 * max(timed), 3), "tokens_per_s": round(work.tokens / t, 1),
           "flops_per_s": round(work.per_step / t),
           "mfu_nominal": round(work.per_step / t / nominal, 4) if nominal else None,
           "mfu_measured_matmul": round(work.per_step / t / measured, 4),
           "peak_memory_gib": None if peak is None else round(peak / 2 ** 30, 3),
           "first_step_s": round(raw["times"][0], 3), "warmup_excess_s": round(extra, 2),
           "compile_s": round(extra, 1) if compiled else None,
           "losses": [round(v, 6) for v in raw["losses"]]}
    if "profile" in raw:
        out["profile"] = p = dict(raw["profile"])
        # the profiler's own per-op cost lengthens a host-bound step: the idle time of the timed
        # (unprofiled) steps is their median less the profiled busy time
        busy = p.get("device_busy_ms")
        p["device_idle_unprofiled_ms"] = None if busy is None else round(max(out["step_ms"] - busy, 0.0), 3)
    return out


def compare_losses(runs: dict[str, dict], rtol: float) -> None:
    """Hold every variant's losses against plain-eager's (or, without it, the first plain one's)."""
    ok = {k: r for k, r in runs.items() if r.get("status") == "ok"}
    ref_name = next((k for k in ("plain-eager", "plain-compiled") if k in ok), None)
    if ref_name is None:
        return
    ref = ok[ref_name]["losses"]
    for r in ok.values():
        rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref)]
        r["loss_reference"] = ref_name
        r["loss_max_rel_diff"] = max(rel)
        r["loss_first_rel_diff"] = rel[0]
        r["losses_agree"] = max(rel) <= rtol


def ratios(runs: dict[str, dict]) -> dict[str, float | None]:
    def ratio(a: str, b: str, key: str) -> float | None:
        ra, rb = runs.get(a, {}), runs.get(b, {})
        if ra.get("status") != "ok" or rb.get("status") != "ok" or not ra.get(key) or not rb.get(key):
            return None
        return round(ra[key] / rb[key], 4)

    return {"eager": ratio("meshtorch-eager", "plain-eager", "step_ms"),
            "compiled": ratio("meshtorch-compiled", "plain-compiled", "step_ms"),
            "memory_eager": ratio("meshtorch-eager", "plain-eager", "peak_memory_gib"),
            "memory_compiled": ratio("meshtorch-compiled", "plain-compiled", "peak_memory_gib")}


# ---------------------------------------------------------------- the report
def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"




def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    nominal = env["nominal_peak_flops"]
    lines = [
        f"# One GPU: meshtorch vs plain PyTorch training steps ({env['device_name']})", "",
        f"`{report['command']}` on {report['date']}, torch {env['torch']}"
        + (" (**dry run on the CPU**: the tiny model; not GPU figures)" if report["dry_run"] else "")
        + f". Median of {report['steps']} steps after {report['warmup']} warm-up steps, each ending in "
        f"`loss.item()` and a synchronize; "
        + ("bf16 autocast, fp32 weights" if report["precision"] == "bf16" else "fp32")
        + ", clip 1.0, AdamW; the same "
        "initial weights and batches on every row. Variants: see `benchmarks/gpu_step.py`.", "",
        (f"Peak: nominal {rate(nominal)} (dense bf16, {env['nominal_source']})" if nominal else
         f"Peak: nominal unknown ({env['nominal_source']})")
        + f"; measured {rate(env['measured_matmul_flops'])} ({env['matmul_n']}³ "
        f"{report['precision_matmul']} matmuls, the three layouts of a training step).", "",
        "MFU convention: FLOPs/token = 6·N + 12·layers·heads·d_kv·length (PaLM, as nanoGPT and "
        "`meshtorch train` count it): N = parameters less the position table, the tied token table "
        "counted once (the output matmul); attention's score products over the whole length "
        "(the causally masked half counted).", ""]
    for size, s in report["sizes"].items():
        c = s["config"]
        lines += [f"## {size}: {c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads x d_kv "
                  f"{c['d_kv']}, d_ff {c['d_ff']}, vocab {c['vocab']}, batch {c['batch']} x {c['length']}",
                  "",
                  (f"{s['parameters']:,} parameters. {s['formula']}. At the measured matmul peak a step "
                   f"would take {s['matmul_bound_ms']:.2f} ms." if "formula" in s else "No model was built."),
                  "",
                  "| variant | step ms | tokens/s | FLOP/s | MFU (nominal) | % of matmul peak | "
                  f"peak GiB | compile s | graphs / breaks | loss vs {s.get('loss_reference', 'plain')} |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for name in VARIANTS:
            r = s["variants"].get(name)
            if r is None:
                continue
            if r["status"] != "ok":
                why = r.get("error", r.get("reason"))
                lines.append(f"| {name} | {r['status']}{': ' + why if why else ''} |" + " |" * 9)
                continue
            mem = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
            comp = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
            graphs = (f"{r['compile']['graphs']} / {r['compile']['graph_breaks']}"
                      if r.get("compile") else "-")
            agree = ("n/a" if "losses_agree" not in r else
                     f"{'ok' if r['losses_agree'] else 'DIFFER'} (max {r['loss_max_rel_diff']:.1e})")
            lines.append(f"| {name} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
                         f"{rate(r['flops_per_s'])} | {_pct(r['mfu_nominal'])} | "
                         f"{_pct(r['mfu_measured_matmul'])} | {mem} | {comp} | {graphs} | {agree} |")
        profiled = [(n, r["profile"]) for n, r in s["variants"].items() if r.get("profile")]
        if profiled:
            lines += ["", f"Profile ({profiled[0][1]['steps']} more steps each, under `torch.profiler`; wall "
                      "includes its overhead): *busy* is the time some GPU kernel or copy ran, *idle* the "
                      "rest (the GPU waiting for the host or a sync); *idle of the timed steps* is the "
                      "median step less that busy time (the profiler's per-op cost lengthens a host-bound "
                      "step); top kernels by GPU time per step (on the CPU: ops by self CPU time).", "",
                      "| variant | wall ms | GPU busy ms | GPU idle ms | idle of the timed steps ms | top |",
                      "|---|---:|---:|---:|---:|---|"]
            for n, p in profiled:
                top = "; ".join(f"{k['name'][:60]} {k['ms']:.2f} ms ({k['calls']:g}x)" for k in p["top"][:5])
                busy, idle, timed = ("n/a" if p.get(k) is None else f"{p[k]:.2f}" for k in
                                     ("device_busy_ms", "device_idle_ms", "device_idle_unprofiled_ms"))
                lines.append(f"| {n} | {p['wall_ms']:.2f} | {busy} | {idle} | {timed} | {top} |")
            gapped = [(n, p["gaps"]) for n, p in profiled if p.get("gaps")]
            if gapped:
                lines += ["", "The GPU's idle gaps of 20 µs or more over the profiled steps (their count and "
                          "sum), and in the longest what the host was running (its innermost events at the "
                          "gap's middle):", ""]
                for n, g in gapped:
                    longest = "; ".join(f"{t['us'] / 1e3:.2f} ms in {' < '.join(t['host']) or '?'}"
                                        for t in g["top"])
                    lines.append(f"- {n}: {g['count']} gaps, {g['total_us'] / 1e3:.2f} ms; {longest}")
        q = s["ratios"]
        fmt = (lambda x, t: "n/a" if x is None else f"**{x:.3f}** ({'meets' if x <= t else 'misses'} <= {t})")
        lines += ["", f"meshtorch / plain step: eager {fmt(q['eager'], TARGETS['eager'])}, compiled "
                  f"{fmt(q['compiled'], TARGETS['compiled'])}; peak memory: eager "
                  f"{fmt(q['memory_eager'], TARGETS['memory'])}, compiled "
                  f"{fmt(q['memory_compiled'], TARGETS['memory'])}.", ""]
    lines += ["Columns: *% of matmul peak* is the step's FLOP rate over the measured matmul rate (how far "
              "the step is from what this GPU's matmuls reach); *compile s* is what the warm-up steps took "
              "beyond as many median steps; *graphs / breaks* are Dynamo's counts for the variant; *loss* "
              f"compares every step's loss (relative tolerance {report['loss_rtol']:g}).", ""]
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{STEM}.md").write_text(markdown(report))


# ---------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer timed steps (the 5-minute check)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per variant (default 15; 5 with --quick, 3 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first: compiles, allocator (default 3; 2 with --dry-run)")
    ap.add_argument("--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)} (default 124m,1b)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch at every size")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                    help="bf16 autocast (default) or fp32 (the default of --dry-run: CPUs run bf16 slowly)")
    ap.add_argument("--lr", type=float, default=3e-4, help="constant learning rate (no warm-up)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="nominal peak, for a GPU not in the table")
    ap.add_argument("--loss-rtol", type=float, default=None,
                    help="relative loss tolerance against plain-eager (default 1e-2 in bf16, 1e-4 in fp32)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no variant after this many seconds (the rest are marked skipped)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="N more steps per variant under torch.profiler: GPU busy and idle time per step, "
                    "top kernels (the report's profile section)")
    ap.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU; no CUDA call")
    ap.add_argument("--out", default=None,
                    help="directory for gpu_step.{json,md} (default benchmarks/results)")
    a = ap.parse_args(argv)
    a.steps = a.steps if a.steps is not None else (3 if a.dry_run else 5 if a.quick else 15)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.dry_run else 3)
    a.precision = a.precision or ("fp32" if a.dry_run else "bf16")
    a.sizes = (a.sizes or ("tiny" if a.dry_run else "124m,1b")).split(",")
    a.variants = a.variants.split(",")
    for s in a.sizes:
        if s not in SIZES:
            ap.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    for v in a.variants:
        if v not in VARIANTS:
            ap.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    a.loss_rtol = a.loss_rtol if a.loss_rtol is not None else (1e-2 if a.precision == "bf16" else 1e-4)
    return a


def _error(e: BaseException) -> dict[str, str]:
    oom = isinstance(e, torch.cuda.OutOfMemoryError)
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return {"status": "out of memory" if oom else "error", "error": f"{type(e).__name__}: {first}"}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_variant(v: str, size: dict[str, int], a: argparse.Namespace, twin: Twin, data: list, work: Work,
                device: torch.device, nominal: float | None, measured: float) -> dict[str, Any]:
    """One variant's row: its figures, or why it has none."""
    compiled = v.endswith("compiled")
    if compiled:
        clear_compile_counters()
    t = time.perf_counter()
    try:
        if v.startswith("meshtorch"):
            raw = run_meshtorch(train_config(size, a.precision, compiled, device.type, a.lr), size["vocab"],
                                data, device, a.compile_backend, a.profile)
        else:
            raw = run_plain(twin, compiled, a.compile_backend, a.precision, data, device, a.profile)
        r = {"status": "ok", **summarise(raw, a.warmup, work, nominal, measured, compiled)}
        if compiled:
            r["compile"] = compile_counters()
    except Exception as e:  # noqa: BLE001 - a failing variant is a row of the report
        traceback.print_exc()
        r = _error(e)
    r["wall_s"] = round(time.perf_counter() - t, 1)
    if compiled:
        clear_compile_counters()
    _free(device)
    return r


def run_size(size_name: str, a: argparse.Namespace, report: dict[str, Any], out: Path, device: torch.device,
             nominal: float | None, measured: float, t0: float) -> bool:
    """Every variant of one size, the report written after each; whether one failed or differed."""
    size = dict(SIZES[size_name])
    if a.batch:
        size["batch"] = a.batch
    base = train_config(size, a.precision, False, device.type, a.lr)
    vocab = size["vocab"]
    mcfg = base.model_config(vocab)
    entry: dict[str, Any] = {"config": size, "variants": {v: {"status": "not run yet"}
                                                          for v in VARIANTS if v in a.variants}}
    entry["ratios"] = ratios(entry["variants"])
    report["sizes"][size_name] = entry
    spent = a.budget_s is not None and time.perf_counter() - t0 > a.budget_s
    try:
        if spent:
            raise TimeoutError(f"--budget-s {a.budget_s:g} spent")
        twin = mt.launch(_twin_program, base, vocab, mesh="b:1", rules="batch:b", device=device.type)[0]
    except Exception as e:  # noqa: BLE001 - no model: every variant of this size says why
        if not spent:
            traceback.print_exc()
        why = {"status": "skipped", "reason": str(e)} if spent else _error(e)
        entry["variants"] = {v: dict(why) for v in entry["variants"]}
        write(report, out)
        print(f"\n{size_name}: {why['status']}: {why.get('error', why.get('reason'))}", flush=True)
        _free(device)
        return not spent
    work = work_of(mcfg, twin.params, size["batch"], size["length"])
    data = [(i.to(device), t.to(device)) for i, t in batches(vocab, size["batch"], size["length"],
                                                              a.warmup + a.steps)]
    entry.update({"parameters": work.params, "matmul_parameters": work.matmul_params,
                  "flops_per_token": work.per_token, "attention_flops_per_token": work.attention_per_token,
                  "flops_per_step": work.per_step, "formula": work.formula(mcfg, size["length"]),
                  "matmul_bound_ms": round(1e3 * work.per_step / measured, 3)})
    print(f"\n{size_name}: {work.params:,} parameters; {entry['formula']}", flush=True)
    failed = False
    for v in entry["variants"]:
        if a.budget_s is not None and time.perf_counter() - t0 > a.budget_s:
            entry["variants"][v] = {"status": "skipped", "reason": f"--budget-s {a.budget_s:g} spent"}
            print(f"  {v}: skipped (--budget-s spent)", flush=True)
            continue
        # a run stopped from outside (gpu_check.sh's time budget) leaves this in the report
        entry["variants"][v] = {"status": "running", "reason": f"started {time.perf_counter() - t0:.0f} s "
                                "into the run, which stopped first"}
        write(report, out)
        r = entry["variants"][v] = run_variant(v, size, a, twin, data, work, device, nominal, measured)
        failed |= r["status"] != "ok"
        compare_losses(entry["variants"], a.loss_rtol)
        entry["ratios"] = ratios(entry["variants"])
        entry["loss_reference"] = next((r["loss_reference"] for r in entry["variants"].values()
                                        if "loss_reference" in r), "plain-eager")
        write(report, out)
        if r["status"] == "ok":
            mem = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f} GiB"
            print(f"  {v}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
                  f"{rate(r['flops_per_s'])}: MFU {_pct(r['mfu_nominal'])} of nominal, "
                  f"{_pct(r['mfu_measured_matmul'])} of the measured matmul peak; peak memory {mem}; "
                  f"warm-up {r['warmup_excess_s']:.1f} s beyond steady steps; {r['wall_s']} s in all",
                  flush=True)
        else:
            print(f"  {v}: {r['status']}: {r['error']}", flush=True)
    bad = [k for k, r in entry["variants"].items() if r.get("losses_agree") is False]
    if bad:
        print(f"  losses differ from {entry['loss_reference']}'s beyond {a.loss_rtol:g}: " + ", ".join(bad))
    return failed or bool(bad)



def nominal_rate(name: str, precision: str) -> tuple[float | None, str]:
    """The data sheet's dense FLOP/s of the GPU called ``name`` for the run's matmuls (``precision``
    bf16: its tensor cores; fp32: plain fp32, PyTorch leaving TF32 off), and where it comes from;
    ``None`` for a GPU not in :data:`meshtorch.plan.gpus.GPUS`.

    Example:
        >>> nominal_rate("NVIDIA H100 PCIe", "bf16")
        (756000000000000.0, 'meshtorch.plan.gpus.GPUS: H100 PCIe, dense bf16')
        >>> nominal_rate("NVIDIA L4", "fp32")[0], nominal_rate("NVIDIA GeForce RTX 4090", "bf16")[0]
        (30300000000000.0, None)
    """
    kind = gpu_kind(name)
    if kind is None:
        return None, f"'{name}' is not in meshtorch.plan.gpus.GPUS: pass --peak-tflops"
    return (kind.bf16_flops if precision == "bf16" else kind.fp32_flops,
            f"meshtorch.plan.gpus.GPUS: {kind.word}, dense {precision}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_step.py needs a CUDA GPU (torch sees none); nothing measured. "
              "`--dry-run` runs it on the CPU with a tiny model.")
        return 0
    t0 = time.perf_counter()
    device = torch.device("cpu") if a.dry_run else torch.device("cuda", torch.cuda.current_device())
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="gpu_step_dry_run_")) if a.dry_run
                                     else RESULTS)
    name = "CPU (dry run)" if a.dry_run else torch.cuda.get_device_name(device)
    if a.peak_tflops:
        nominal, source = a.peak_tflops * 1e12, "--peak-tflops"
    elif a.dry_run:
        nominal, source = None, "none on the CPU"
    else:
        nominal, source = nominal_rate(name, a.precision)
    mm_dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    mm_n = 256 if a.dry_run else 8192
    with torch.device(device):
        measured = matmul_rate(mm_n, mm_dtype, 0.02 if a.dry_run else 0.1)
    report: dict[str, Any] = {
        "command": "python benchmarks/gpu_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "dry_run": a.dry_run,
        "steps": a.steps, "warmup": a.warmup, "precision": a.precision, "precision_matmul": str(mm_dtype)[6:],
        "loss_rtol": a.loss_rtol, "compile_backend": a.compile_backend,
        "environment": {"device_name": name, "torch": torch.__version__,
                        "cuda": torch.version.cuda, "nominal_peak_flops": nominal, "nominal_source": source,
                        "measured_matmul_flops": round(measured), "matmul_n": mm_n},
        "sizes": {}}
    print(f"{name}: nominal peak {rate(nominal) if nominal else 'unknown'} ({source}), "
          f"measured {rate(measured)} ({mm_n}^3 {report['precision_matmul']} matmuls)", flush=True)
    failed = False
    for size_name in a.sizes:
        failed |= run_size(size_name, a, report, out, device, nominal, measured, t0)
    write(report, out)
    print("\n" + markdown(report))
    print(f"wrote {out / (STEM + '.json')} and {out / (STEM + '.md')} ({time.perf_counter() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
