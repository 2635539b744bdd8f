"""meshtorch's overhead on one processor: a DecoderLM training step vs the same LM in plain PyTorch.

Both models compute the same function from the same weights (:class:`PlainLM`
copies a :class:`~meshtorch.models.DecoderLM`'s parameters; tests check that
losses and gradients agree), and take the same step: forward, mean
cross-entropy, backward, global-norm clipping to 1.0, ``torch.optim.AdamW``.
The plain model is written the way one would write it in PyTorch:
``F.layer_norm``, ``softmax``, ``F.cross_entropy``, matmuls on ``[batch,
length, ...]`` tensors. So the ratio holds everything meshtorch adds on one
processor: the Python of naming, layouts and lowering per op, and any local
op that is not the one a PyTorch user would call.

Timing: steps are interleaved one by one (plain, meshtorch, meshtorch, plain,
...: who goes first alternates) after a warm-up, so machine noise hits both
alike; the figure to read is the median over pairs of (meshtorch step / the
plain step timed next to it), in wall-clock time and in the CPU time of the
stepping thread (with one intra-op thread, the whole step runs there; CPU
time leaves out the time other processes held the core).

Memory: the peak, over one training step after warm-up, of the bytes of live
tensor storage on the host: parameters, gradients and optimizer state that
exist when the step starts, plus every storage an ATen op creates during it
(activations kept for backward, temporaries, gradients), counted while it is
alive. Storages are seen through a ``TorchDispatchMode`` (every op output, also
in backward) and tracked with weak references, each storage once however
many views it has. This is what the two programs hold in tensors; allocator
caching and Python objects are not included (they are alike for both).

Writes ``benchmarks/results/overhead.{json,md}``.

Run:
    python benchmarks/overhead.py [--steps 40] [--warmup 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from limits import attach, count, figure, section
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 1.05
# the default model of `meshtorch train` on its byte tokenizer (`--tokenizer bytes`: 264 ids, 436,480
# parameters; the default BPE's 2048 ids make 664,832): 2 blocks of d_model 128, batch 16 x 64 tokens
CONFIG = dict(vocab=264, d_model=128, heads=4, d_kv=32, d_ff=512, layers=2, max_length=64)
BATCH, LENGTH = 16, 64


class PlainLM(torch.nn.Module):
    """:class:`DecoderLM` (learned positions, pre-LayerNorm, GELU, tied or untied head, optional
    biases) written in plain PyTorch, with the weights of ``model``.

    ``sdpa=False`` computes attention as meshtorch's einsum path does (scores, a causal mask,
    softmax, values); ``sdpa=True`` as one writes it for speed,
    ``F.scaled_dot_product_attention(is_causal=True)`` (flash/cuDNN kernels on a GPU). The mask
    and every tensor of the forward are made on the device of ``ids``: the model runs wherever
    ``.to(device)`` put it.
    """

    def __init__(self, model: DecoderLM, sdpa: bool = False):
        super().__init__()
        cfg = self.cfg = model.cfg
        if cfg.positions != "learned" or cfg.norm != "layer" or cfg.experts:
            raise ValueError("PlainLM covers learned positions, LayerNorm and dense feed-forward layers")
        self.sdpa = sdpa
        P = {n: v.to_global().detach().clone() for n, v in model.named_mesh_parameters()}
        d, hk = cfg.d_model, cfg.heads * cfg.d_kv
        self.names: dict[str, str] = {}  # our parameter name -> DecoderLM's, to compare gradients

        def param(ours: str, theirs: str, shape=None) -> str:
            # blocks hold names, not Parameter objects: forward looks each up in this module, so
            # copies (deepcopy) and moves (.to(device)) of the model keep working
            name = ours.replace(".", "_")
            value = P[theirs].reshape(shape) if shape else P[theirs]
            self.register_parameter(name, torch.nn.Parameter(value))
            self.names[name] = theirs
            return name

        self.wte_name = param("wte", "embed.table")
        self.wpe_name = param("wpe", "decoder.pos.table")
        self.blocks = []
        for i in range(cfg.layers):
            p = f"decoder.blocks.{i}."
            b = {"ln1": (param(f"h{i}.ln1.w", p + "ln_attn.weight"),
                         param(f"h{i}.ln1.b", p + "ln_attn.bias")),
                 "ln2": (param(f"h{i}.ln2.w", p + "ln_ffn.weight"),
                         param(f"h{i}.ln2.b", p + "ln_ffn.bias"))}
            for w in "qkv":
                b[w] = param(f"h{i}.{w}", p + f"attn.{w}.kernel", (d, hk))
                b[w + "_b"] = param(f"h{i}.{w}_b", p + f"attn.{w}.bias", (hk,)) if cfg.bias else None
            b["o"] = param(f"h{i}.o", p + "attn.o.kernel", (hk, d))
            b["o_b"] = param(f"h{i}.o_b", p + "attn.o.bias") if cfg.bias else None
            b["wi"] = param(f"h{i}.wi", p + "ffn.wi.kernel")
            b["wi_b"] = param(f"h{i}.wi_b", p + "ffn.wi.bias") if cfg.bias else None
            b["wo"] = param(f"h{i}.wo", p + "ffn.wo.kernel")
            b["wo_b"] = param(f"h{i}.wo_b", p + "ffn.wo.bias") if cfg.bias else None
            self.blocks.append(b)
        self.ln_f = (param("ln_f.w", "decoder.ln_f.weight"), param("ln_f.b", "decoder.ln_f.bias"))
        self.head_name = None if cfg.tie_embeddings else param("head", "head.kernel")
        self.act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                    "relu": F.relu, "silu": F.silu}[cfg.activation]

    def _p(self, name: str | None) -> torch.Tensor | None:
        return None if name is None else self._parameters[name]

    def _linear(self, x, w, b):
        w, b = self._p(w), self._p(b)
        return x @ w if b is None else torch.addmm(b, x.flatten(0, -2), w).view(*x.shape[:-1], -1)

    def _attend(self, q, k, v):
        """Causal attention of ``[batch, heads, length, d_kv]`` queries, keys and values."""
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    def _norm(self, x, wb):
        return F.layer_norm(x, (self.cfg.d_model,), *(self._p(n) for n in wb), self.cfg.eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, t = ids.shape
        h, k = cfg.heads, cfg.d_kv
        wte = self._p(self.wte_name)
        x = wte[ids] + self._p(self.wpe_name)[:t]
        for b in self.blocks:
            y = self._norm(x, b["ln1"])
            q, kk, v = (self._linear(y, b[w], b[w + "_b"]).view(bsz, t, h, k).transpose(1, 2) for w in "qkv")
            o = self._attend(q, kk, v).transpose(1, 2).reshape(bsz, t, h * k)
            x = x + self._linear(o, b["o"], b["o_b"])
            y = self._norm(x, b["ln2"])
            x = x + self._linear(self.act(self._linear(y, b["wi"], b["wi_b"])), b["wo"], b["wo_b"])
        x = self._norm(x, self.ln_f)
        return x @ (wte.T if self.head_name is None else self._p(self.head_name))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- steps
def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, vocab, (BATCH, LENGTH + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def plain_stepper(model: PlainLM):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    def step(ids, tgt):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(ids, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return step, opt


def mesh_stepper(model: DecoderLM):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    shape = f"batch:{BATCH},length:{LENGTH}"

    def step(ids, tgt):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(mt.from_global(ids, shape), mt.from_global(tgt, shape))
        loss.backward()
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        return loss.item()

    return step, opt


# ---------------------------------------------------------------- memory
class LiveStorage(TorchDispatchMode):
    """Peak bytes of live tensor storage: ``track`` the tensors alive at the start, then every
    storage an op creates while the mode is on, until it is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0
        self.ops = 0

    def track(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        s = t.untyped_storage()
        ref = StorageWeakRef(s)
        if ref.cdata not in self.live:
            self.live[ref.cdata] = (ref, s.nbytes())
            self.current += s.nbytes()

    def sweep(self) -> None:
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.sweep()
        for t in tree_flatten(out)[0]:
            self.track(t)
        self.peak = max(self.peak, self.current)
        return out


def peak_bytes(step, model: torch.nn.Module, opt: torch.optim.Optimizer, data) -> tuple[int, int, int]:
    """(peak bytes during one step, bytes alive at its start, ops seen)."""
    mode = LiveStorage()
    for p in model.parameters():
        mode.track(p)
        if p.grad is not None:
            mode.track(p.grad)
    for st in opt.state.values():
        for v in st.values():
            mode.track(v)
    start = mode.current
    mode.peak = start
    with mode:
        step(*data)
    return mode.peak, start, mode.ops


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each model")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noisy)")
    ap.add_argument("--out", default=str(RESULTS / "overhead"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    cfg = TransformerConfig(**CONFIG)
    ours = DecoderLM(cfg, seed=0)
    plain = PlainLM(ours)
    runs = {"plain": plain_stepper(plain), "meshtorch": mesh_stepper(ours)}
    for i in range(args.warmup):
        for step, _ in runs.values():
            step(*batch(i, cfg.vocab))
    times: dict[str, list[float]] = {"plain": [], "meshtorch": []}
    cpu: dict[str, list[float]] = {"plain": [], "meshtorch": []}
    for i in range(args.steps):
        order = ["plain", "meshtorch"] if i % 2 == 0 else ["meshtorch", "plain"]
        data = batch(args.warmup + i, cfg.vocab)
        for name in order:
            t, c = time.perf_counter(), time.thread_time()
            runs[name][0](*data)
            cpu[name].append(time.thread_time() - c)
            times[name].append(time.perf_counter() - t)
    ratio = statistics.median(m / p for m, p in zip(times["meshtorch"], times["plain"]))
    cpu_ratio = statistics.median(m / p for m, p in zip(cpu["meshtorch"], cpu["plain"]))

    # both copies take this counted step on the same batch, so they stay in step
    work = {name: count(lambda s=step: s(*batch(20_000, cfg.vocab)))[1] for name, (step, _) in runs.items()}
    memory = {}
    for name, (step, opt) in runs.items():
        model = plain if name == "plain" else ours
        peak, start, ops = peak_bytes(step, model, opt, batch(10_000, cfg.vocab))
        memory[name] = {"peak_bytes": peak, "start_bytes": start, "aten_ops": ops}
    # the two copies of the model trained on the same batches: they must still agree
    same = abs(runs["plain"][0](*batch(1, cfg.vocab)) - runs["meshtorch"][0](*batch(1, cfg.vocab)))

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    result = {
        "model": {**CONFIG, "batch": BATCH, "length": LENGTH, "parameters": ours.num_parameters()},
        "median_step_ms": {k: round(v, 3) for k, v in med.items()},
        "median_step_cpu_ms": {k: round(v, 3) for k, v in med_cpu.items()},
        "step_time_ratio": round(ratio, 4),
        "step_cpu_time_ratio": round(cpu_ratio, 4),
        "ratio_of_medians": round(med["meshtorch"] / med["plain"], 4),
        "target": TARGET,
        "peak_memory_bytes": {k: v["peak_bytes"] for k, v in memory.items()},
        "peak_memory_ratio": round(memory["meshtorch"]["peak_bytes"] / memory["plain"]["peak_bytes"], 4),
        "bytes_at_step_start": {k: v["start_bytes"] for k, v in memory.items()},
        "aten_ops_per_step": {k: v["aten_ops"] for k, v in memory.items()},
        "loss_difference_after_training": same,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figures = [figure(f"{k} step", med[k] / 1e3, work[k], processors=args.threads) for k in med]
    Path(args.out + ".json").write_text(json.dumps(attach(result, figures), indent=1) + "\n")
    mb = {k: v["peak_bytes"] / 2**20 for k, v in memory.items()}
    md = f"""# meshtorch overhead on one processor (CPU)

`python benchmarks/overhead.py --steps {args.steps} --threads {args.threads}`: a training step
(forward, cross-entropy, backward, clip, AdamW) of the `meshtorch train` default LM on the byte
tokenizer (`--tokenizer bytes`, vocabulary {cfg.vocab}: {ours.num_parameters():,} parameters, batch
{BATCH}x{LENGTH}; the default BPE tokenizer's 2048 ids make 664,832) vs the same LM in plain PyTorch.

| | median step (ms) | median step CPU time (ms) | peak live tensor memory (MiB) | ATen ops / step |
|---|---|---|---|---|
| plain PyTorch | {med['plain']:.2f} | {med_cpu['plain']:.2f} | {mb['plain']:.2f} | \
{memory['plain']['aten_ops']} |
| meshtorch | {med['meshtorch']:.2f} | {med_cpu['meshtorch']:.2f} | {mb['meshtorch']:.2f} | \
{memory['meshtorch']['aten_ops']} |

Step-time ratio meshtorch/plain (median of {args.steps} interleaved pairs; target <= {TARGET}):
**{ratio:.3f}** wall-clock, **{cpu_ratio:.3f}** in CPU time of the stepping thread (ratio of
medians {result['ratio_of_medians']:.3f}). Peak memory ratio: **{result['peak_memory_ratio']:.3f}**.
torch {torch.__version__}, {args.threads} intra-op thread(s), {os.cpu_count()} CPUs, 1-minute load
{load_before:.1f} before / {os.getloadavg()[0]:.1f} after. With one intra-op thread all of a step's
work runs on the stepping thread, so its CPU time leaves out the time the scheduler gave other
processes: on a loaded machine it is the steadier of the two figures. Loss difference of the two
copies after training: {same:.1e}.
""" + section(figures)
    Path(args.out + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
