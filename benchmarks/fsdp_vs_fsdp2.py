"""meshtorch FSDP by rules and data parallel vs PyTorch FSDP2 and DDP: an LM step on 2 gloo processes.

Issue 27's table, measured as a user comparing peers would. Five variants of one
training step (forward, mean cross-entropy, backward, ``torch.optim.AdamW``) of
the same LM (``DecoderLM``: vocab 2048, d_model 256, 4 heads of 64, d_ff 1024, 4
layers, tied embeddings, 3.7M parameters; a global batch of 16 x 128 tokens,
fp32), all in the same two processes, each with one intra-op thread:

- ``meshtorch_fsdp``: meshtorch under ``batch:b; d_model:b`` (FSDP by rules);
- ``fsdp2``: PyTorch FSDP2, ``fully_shard`` on each block, then on the root;
- ``fsdp2_keep``: the same with ``reshard_after_forward=False``;
- ``meshtorch_dp``: meshtorch under ``batch:b`` (data parallel);
- ``ddp``: ``DistributedDataParallel``.

The torch variants run :class:`BlockLM`, a plain ``torch.nn`` twin of the
``DecoderLM`` made from its weights (through ``overhead.PlainLM``, whose
equality with ``DecoderLM`` the tests check) with one submodule per block, so
that FSDP2 can shard block by block. Every variant starts from the same weights
and takes its k-th step on the same rows (step k's global batch; each process
takes its half of the rows, as ``batch:b`` gives a processor), so all variants
compute the same losses step after step: the report gives the largest
difference from meshtorch FSDP's losses.

How it measures:

- **Time.** After ``--warmup`` steps each, rounds of ``--steps`` steps per
  variant run in a balanced order (ABCDE, EDCBA, ABCDE, ...), every step after a
  barrier so both processes start it together; a step's time is the larger of
  the two processes' wall times. A round's *paired ratio* is the median of one
  variant's steps over the median of its peer's in that round (meshtorch FSDP /
  FSDP2, meshtorch DP / DDP): machine noise hits both alike. The stepping
  thread's CPU time (``time.thread_time``) and its paired ratios are reported
  too: on a shared machine it leaves out the time other processes held the core
  (and the time a process waits for the other inside a collective).
- **Collectives.** One extra step of each variant runs under a
  ``TorchDispatchMode`` that counts every ``c10d`` / functional-collective op
  the dispatcher runs on the stepping thread (FSDP2's ``all_gather_single`` and
  ``reduce_scatter_single``, DDP's C++ reducer's bucket all-reduces, meshtorch's
  communicator alike) and its payload: the bytes of the tensors this process
  hands in (an all-gather's input, a reduce-scatter's whole input), the
  definition of ``mt.comm_stats()``, whose own count for the meshtorch variants
  is reported next to it.
- **Peak memory.** The CPU allocator's peak during a steady-state step, from
  ``torch.profiler``'s memory events (``allocator_peak.step_peaks``): each
  variant is built afresh inside the profile (so its parameters, gradients and
  optimizer state are counted), takes one step, and the least peak of the next
  ``--memory-steps`` steps is its figure, gloo's buffers included.
- **The baseline is believable.** The FLOPs of the step
  (``torch.utils.flop_counter``, both processes' halves) over this machine's
  measured fp32 matmul rate per core (``limits.py``) times 2 cores, as a
  percentage of each variant's median step time.

The machine is shared: the 1-minute load average before and after goes into the
report. Writes ``benchmarks/results/fsdp_vs_fsdp2.{json,md}``.

Run:
    python benchmarks/fsdp_vs_fsdp2.py [--rounds 8] [--steps 3] [--warmup 2] [--quick] [--out DIR]
        [--pairs meshtorch_dp/ddp]    # one comparison's variants (a quick look, ~40 s; printed only)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from allocator_peak import step_peaks
from limits import RESULTS, Work, attach, count, figure, limits, section
from overhead import PlainLM
from rendezvous import join, serve
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import meshtorch as mt
from meshtorch.comm.torch import TorchCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.layout import LayoutRules
from meshtorch.models import DecoderLM, TransformerConfig

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # older torch: FSDP2 lived here
    from torch.distributed._composable.fsdp import fully_shard

CONFIG = dict(vocab=2048, d_model=256, heads=4, d_kv=64, d_ff=1024, layers=4, max_length=128)
BATCH, LENGTH = 16, 128
# --quick: a small LM and few steps, to check the benchmark end to end in well under a minute
QUICK_CONFIG = dict(vocab=256, d_model=64, heads=2, d_kv=32, d_ff=128, layers=2, max_length=32)
QUICK_BATCH, QUICK_LENGTH = 4, 32
WORLD = 2

VARIANTS = ("meshtorch_fsdp", "fsdp2", "meshtorch_fsdp_keep", "fsdp2_keep", "meshtorch_dp", "ddp",
            "meshtorch_fsdp_per_use")
LABELS = {"meshtorch_fsdp": "meshtorch `batch:b; d_model:b` (FSDP by rules), "
                            "`mt.overlap(reshard_after_forward=True)`",
          "fsdp2": "PyTorch FSDP2 (`fully_shard` per block + root)",
          "meshtorch_fsdp_keep": "meshtorch FSDP by rules, `mt.overlap()` (gathered parameters kept)",
          "fsdp2_keep": "FSDP2, `reshard_after_forward=False`",
          "meshtorch_dp": "meshtorch `batch:b` (data parallel), `mt.overlap()`",
          "ddp": "DDP",
          "meshtorch_fsdp_per_use": "meshtorch FSDP by rules, per-use collectives "
                                    "(`mt.overlap(enabled=False)`)"}
RULES = {"meshtorch_fsdp": "batch:b; d_model:b", "meshtorch_fsdp_keep": "batch:b; d_model:b",
         "meshtorch_dp": "batch:b", "meshtorch_fsdp_per_use": "batch:b; d_model:b"}
# how each meshtorch variant runs its parameters' collectives (lowering/overlap.py); None: per use
OVERLAP = {"meshtorch_fsdp": {"reshard_after_forward": True}, "meshtorch_fsdp_keep": {},
           "meshtorch_dp": {}, "meshtorch_fsdp_per_use": None}
PAIRS = {"meshtorch_fsdp/fsdp2": ("meshtorch_fsdp", "fsdp2"),
         "meshtorch_fsdp_keep/fsdp2_keep": ("meshtorch_fsdp_keep", "fsdp2_keep"),
         "meshtorch_dp/ddp": ("meshtorch_dp", "ddp"),
         "meshtorch_fsdp/meshtorch_fsdp_per_use": ("meshtorch_fsdp", "meshtorch_fsdp_per_use")}
LR = 1e-3


def reference(variants: Sequence[str]) -> str:
    """The variant whose losses the others' are compared with, and whose model the plain twin
    copies: the first meshtorch one run (every pair has one)."""
    return next(n for n in variants if n in RULES)


# ---------------------------------------------------------------- the plain twin
def _copy(plain: PlainLM, name: str) -> torch.nn.Parameter:
    """A contiguous copy of ``plain``'s parameter ``name`` (FSDP2 shards contiguous parameters only)."""
    return torch.nn.Parameter(plain._parameters[name].detach().clone(memory_format=torch.contiguous_format))


class Block(torch.nn.Module):
    """One pre-LayerNorm decoder block of :class:`BlockLM`: its parameters live here, so that
    ``fully_shard(block)`` makes it one FSDP2 unit."""

    def __init__(self, plain: PlainLM, names: dict[str, str | None]):
        super().__init__()
        self.cfg = plain.cfg
        self.act = plain.act
        for ours, theirs in names.items():
            value = None if theirs is None else _copy(plain, theirs)
            self.register_parameter(ours, value)

    def _linear(self, x: torch.Tensor, w: str) -> torch.Tensor:
        b = getattr(self, w + "_b")
        y = x @ getattr(self, w)
        return y if b is None else y + b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, t, _ = x.shape
        y = F.layer_norm(x, (cfg.d_model,), self.ln1_w, self.ln1_b, cfg.eps)
        q, k, v = (self._linear(y, w).view(bsz, t, cfg.heads, cfg.d_kv).transpose(1, 2) for w in "qkv")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self._linear(o.transpose(1, 2).reshape(bsz, t, cfg.heads * cfg.d_kv), "o")
        y = F.layer_norm(x, (cfg.d_model,), self.ln2_w, self.ln2_b, cfg.eps)
        return x + self._linear(self.act(self._linear(y, "wi")), "wo")


class BlockLM(torch.nn.Module):
    """A :class:`~meshtorch.models.DecoderLM` (learned positions, LayerNorm, dense feed-forward,
    tied or untied head) as a plain ``torch.nn`` model with ``model``'s weights and one
    :class:`Block` submodule per decoder block, the structure FSDP2 shards by.

    It is :class:`overhead.PlainLM`'s model (same weights, same math, attention by
    ``F.scaled_dot_product_attention``) regrouped into blocks.

    Example:
        >>> import torch
        >>> import meshtorch as mt
        >>> from meshtorch.models import DecoderLM, TransformerConfig
        >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=4)
        >>> ours = DecoderLM(cfg, seed=0)
        >>> twin = BlockLM(ours)
        >>> ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
        >>> a = twin.loss(ids[:, :-1], ids[:, 1:]).item()
        >>> b = ours.loss(mt.from_global(ids[:, :-1], "batch:2,length:4"),
        ...               mt.from_global(ids[:, 1:], "batch:2,length:4")).item()
        >>> len(twin.blocks), abs(a - b) < 1e-6
        (2, True)
    """

    def __init__(self, model: DecoderLM):
        super().__init__()
        plain = PlainLM(model, sdpa=True)
        self.cfg = plain.cfg
        self.wte = _copy(plain, plain.wte_name)
        self.wpe = _copy(plain, plain.wpe_name)
        keys = ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "q", "k", "v", "o", "wi", "wo")
        self.blocks = torch.nn.ModuleList()
        for i in range(self.cfg.layers):
            names = {key: f"h{i}_{key}" for key in keys}
            for w in ("q", "k", "v", "o", "wi", "wo"):
                names[w + "_b"] = f"h{i}_{w}_b" if self.cfg.bias else None
            self.blocks.append(Block(plain, names))
        self.ln_f_w = _copy(plain, plain.ln_f[0])
        self.ln_f_b = _copy(plain, plain.ln_f[1])
        self.head = None if plain.head_name is None else _copy(plain, plain.head_name)
        # our parameter name -> DecoderLM's, to compare gradients
        ours = {"wte": plain.wte_name, "wpe": plain.wpe_name, "ln_f_w": plain.ln_f[0],
                "ln_f_b": plain.ln_f[1], "head": plain.head_name}
        for i, block in enumerate(self.blocks):
            ours |= {f"blocks.{i}.{key}": f"h{i}_{key}" for key, _ in block.named_parameters()}
        self.names = {k: plain.names[v] for k, v in ours.items() if v is not None}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte[ids] + self.wpe[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, (self.cfg.d_model,), self.ln_f_w, self.ln_f_b, self.cfg.eps)
        return x @ (self.wte.T if self.head is None else self.head)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- counting collectives
# dispatcher collectives -> the kind names of mt.comm_stats()
KINDS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
         "all_reduce_coalesced": "all_reduce",
         "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
         "all_gather_into_tensor_coalesced": "all_gather",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "reduce_scatter_tensor_coalesced": "reduce_scatter",
         "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
         "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv",
         "recv_any_source_": "recv"}
# the argument holding what this process hands in, by schema name
INPUTS = ("input_tensor", "input", "input_tensors", "inputs", "input_list", "tensors")


class Collectives(TorchDispatchMode):
    """Counts the collectives the dispatcher runs on this thread while it is on: calls and
    payload bytes (the tensors this process hands in; nothing for a receive) per kind.

    It sees what runs, whoever issues it: ``torch.distributed``'s Python functions, FSDP2,
    DDP's C++ reducer and functional collectives all reach the ``c10d`` /
    ``_c10d_functional`` ops. Barriers are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and name in KINDS:
            kind = KINDS[name]
            self.calls[kind] += 1
            if kind != "recv":
                names = [a.name for a in func._schema.arguments]
                given = dict(zip(names, args)) | kwargs
                arg = next(n for n in INPUTS if n in given)
                self.bytes[kind] += sum(t.numel() * t.element_size() for t in tree_leaves(given[arg])
                                        if isinstance(t, torch.Tensor))
        return func(*args, **kwargs)


# ---------------------------------------------------------------- the variants
def batch(step: int, vocab: int, rows: int, length: int) -> torch.Tensor:
    """Step ``step``'s global batch of token ids, ``[rows, length + 1]`` (inputs and targets)."""
    return torch.randint(0, vocab, (rows, length + 1), generator=torch.Generator().manual_seed(step))


def mesh_variant(cfg: TransformerConfig, ctx: ProcessorContext, shape: str, how: dict | None = None):
    """A meshtorch DecoderLM under ``ctx``'s rules and its step, its parameters' collectives run
    by ``mt.overlap(**how)`` (``None``: per use); returns (step, model)."""
    with use(ctx):
        model = DecoderLM(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(data: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)  # before the forward, as the trainer (PlainStep.run) does
        with use(ctx), mt.overlap(enabled=how is not None, **(how or {})):
            loss = model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))
            loss.backward()
            opt.step()
            return loss.item()  # the global mean: the same on both processes

    return step, model


def torch_variant(name: str, twin: BlockLM):
    """FSDP2 (``fsdp2``, ``fsdp2_keep``) or DDP of a copy of ``twin``, and its step."""
    model = copy.deepcopy(twin)
    if name == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        # fsdp2: FSDP2's defaults, as a user calls it (blocks reshard after forward, the root, whose
        # parameters backward needs at once, keeps them); fsdp2_keep: no module reshards
        kw = {"reshard_after_forward": False} if name == "fsdp2_keep" else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        net = fully_shard(model, **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    rank = dist.get_rank()

    def step(data: torch.Tensor) -> float:
        rows = data.shape[0] // WORLD
        local = data[rank * rows:(rank + 1) * rows]  # the rows meshtorch's batch:b gives this processor
        opt.zero_grad(set_to_none=True)
        logits = net(local[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.item()  # this process's mean: averaged over processes for the comparison

    return step, net


def matmul_rate_cpu_time(n: int = 512, repeats: int = 5) -> float:
    """fp32 matmul FLOPs per second of this thread's CPU time (``time.thread_time``), the best of
    ``repeats``: the FLOP rate of a core while this thread holds it, which other jobs on a shared
    machine do not lower the way they lower a wall-clock rate."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(repeats):
        c = time.thread_time()
        for _ in range(8):
            a @ b
        best = max(best, 8 * 2 * n ** 3 / max(time.thread_time() - c, 1e-9))
    return best


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    join(port, rank, WORLD)
    cfg = TransformerConfig(**args.config)
    rows, length = args.batch, args.length
    shape = f"batch:{rows},length:{length}"
    comm = TorchCommunicator(f"b:{WORLD}")
    variants = args.variants
    contexts = {name: ProcessorContext(comm, LayoutRules(RULES[name])) for name in variants if name in RULES}

    steps, models = {}, {}
    for name in variants:
        if name in RULES:
            steps[name], models[name] = mesh_variant(cfg, contexts[name], shape, OVERLAP[name])
    first = reference(variants)  # every meshtorch variant starts from the same weights (seed 0)
    with use(contexts[first]):
        twin = BlockLM(models[first])  # gathers the whole weights on each process
    for name in variants:
        if name not in RULES:
            steps[name], models[name] = torch_variant(name, twin)

    losses: dict[str, list[float]] = {n: [] for n in variants}
    done = dict.fromkeys(variants, 0)

    def take(name: str) -> tuple[float, float]:
        data = batch(done[name], cfg.vocab, rows, length)  # every variant's k-th step: the same rows
        dist.barrier()  # both processes start the step together
        t, c = time.perf_counter(), time.thread_time()
        losses[name].append(steps[name](data))
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        done[name] += 1
        return wall, cpu

    for name in variants:
        for _ in range(args.warmup):
            take(name)

    # one counted step each: what the dispatcher runs, and meshtorch's own counters
    counted: dict[str, dict] = {}
    for name in variants:
        comm.stats.reset()
        with Collectives() as seen:
            take(name)
        counted[name] = {"calls": dict(seen.calls), "bytes": dict(seen.bytes)}
        if name in RULES:
            counted[name]["comm_stats"] = comm.stats.as_dict()

    wall: dict[str, list[list[float]]] = {n: [] for n in variants}
    cpu: dict[str, list[list[float]]] = {n: [] for n in variants}
    for r in range(args.rounds):
        for name in variants if r % 2 == 0 else variants[::-1]:
            wall[name].append([])
            cpu[name].append([])
            for _ in range(args.steps):
                w, c = take(name)
                wall[name][-1].append(w)
                cpu[name][-1].append(c)

    # peak memory: each variant built afresh inside the allocator's profile (so its parameters,
    # gradients and optimizer state are seen made), two steps, then the measured ones
    peaks: dict[str, int] = {}
    data = batch(10_000, cfg.vocab, rows, length)
    for name in variants:
        def setup(name=name):
            if name in RULES:
                step, _ = mesh_variant(cfg, contexts[name], shape, OVERLAP[name])
            else:
                step, _ = torch_variant(name, twin)
            for _ in range(2):  # the optimizer's state exists, DDP has rebuilt its buckets
                step(data)
            return step
        peaks[name] = min(step_peaks(setup, lambda step: step(data), args.memory_steps))

    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"wall": wall, "cpu": cpu, "losses": losses, "counted": counted,
                                      "peaks": peaks, "matmul_rate_cpu_time": matmul_rate_cpu_time()})
    if rank == 0:
        queue.put({"per_process": gathered, "parameters": models[first].num_parameters()})
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- summary
def summarise(per_process: list[dict], pairs: Sequence[str] = tuple(PAIRS)) -> dict:
    """Per variant: step times (the larger of the processes' for each step), per-round medians,
    CPU times, collectives, peak memory; the paired ratios per round (of ``pairs``); the loss
    differences."""
    first = per_process[0]
    variants = list(first["wall"])  # the variants run, in their order
    out: dict = {"variants": {}}
    for name in variants:
        rounds = [[max(ts) for ts in zip(*(p["wall"][name][r] for p in per_process))]
                  for r in range(len(first["wall"][name]))]
        cpu_rounds = [[max(ts) for ts in zip(*(p["cpu"][name][r] for p in per_process))]
                      for r in range(len(first["cpu"][name]))]
        flat = [t for rr in rounds for t in rr]
        round_medians = [statistics.median(rr) for rr in rounds]
        counted = first["counted"][name]
        out["variants"][name] = {
            "label": LABELS[name], "rules": RULES.get(name),
            "median_step_ms": 1e3 * statistics.median(flat),
            "round_median_ms": [1e3 * m for m in round_medians],
            "median_step_cpu_ms": 1e3 * statistics.median(t for rr in cpu_rounds for t in rr),
            "collective_calls": sum(counted["calls"].values()),
            "collective_calls_by_kind": counted["calls"],
            "payload_bytes": sum(counted["bytes"].values()),
            "payload_bytes_by_kind": counted["bytes"],
            "payload_bytes_per_process": [sum(p["counted"][name]["bytes"].values()) for p in per_process],
            "comm_stats": counted.get("comm_stats"),
            "peak_bytes_per_process": [p["peaks"][name] for p in per_process],
            "peak_bytes": max(p["peaks"][name] for p in per_process),
        }
        out["variants"][name]["_rounds"] = {"wall": rounds, "cpu": cpu_rounds}
    for clock, table in (("wall", "ratios"), ("cpu", "cpu_ratios")):
        out[table] = {}
        for key in pairs:
            a, b = PAIRS[key]
            ra, rb = out["variants"][a]["_rounds"][clock], out["variants"][b]["_rounds"][clock]
            per_round = [statistics.median(x) / statistics.median(y) for x, y in zip(ra, rb)]
            out[table][key] = {"median": statistics.median(per_round), "per_round": per_round,
                               "min": min(per_round), "max": max(per_round)}
    for v in out["variants"].values():
        del v["_rounds"]
    # losses: meshtorch's are global means; the torch variants' are each process's, averaged
    losses = {n: ([sum(p["losses"][n][i] for p in per_process) / len(per_process)
                   for i in range(len(first["losses"][n]))] if n not in RULES else first["losses"][n])
              for n in variants}
    ref = losses[reference(variants)]
    out["losses"] = losses
    out["loss_max_difference"] = {n: max(abs(a - b) for a, b in zip(losses[n], ref)) for n in variants}
    out["matmul_flops_per_cpu_s"] = max(p["matmul_rate_cpu_time"] for p in per_process)
    out["loss_max_relative_difference"] = {n: max(abs(a - b) / abs(b) for a, b in zip(losses[n], ref))
                                           for n in variants}
    out["loss_first_step_difference"] = {n: abs(losses[n][0] - ref[0]) for n in variants}
    return out


def step_work(cfg: TransformerConfig, rows: int, length: int) -> Work:
    """Both processes' FLOPs and bytes of one step of the plain twin on its half of the rows."""
    twin = BlockLM(DecoderLM(cfg, seed=0))
    opt = torch.optim.AdamW(twin.parameters(), lr=LR)
    data = batch(0, cfg.vocab, rows // WORLD, length)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = twin.loss(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()

    step()  # AdamW's state exists from the first step on, as in the timed steps
    work = count(step)[1]
    return Work(WORLD * work.flops, WORLD * work.bytes)


def markdown(report: dict, figures: list[dict]) -> str:
    v, r = report["variants"], report["ratios"]
    mib, mb = 2 ** 20, 1e6
    cfg = ", ".join(f"{k} {x}" for k, x in report["config"].items())
    lines = [f"# meshtorch FSDP / data parallel vs PyTorch FSDP2 / DDP ({WORLD} gloo processes, CPU)", "",
             f"One training step of a DecoderLM ({report['parameters']:,} parameters: {cfg}; batch "
             f"{report['batch']} x {report['length']}, fp32, AdamW) in the same {WORLD} processes, one "
             f"intra-op thread each, same initial weights and rows. {report['rounds']} rounds of "
             f"{report['steps']} steps per variant in a balanced order (ABCDE, EDCBA, ...) after "
             f"{report['warmup']} warm-up steps each.", "",
             "| variant | median step ms (round medians) | CPU ms | collective calls / step "
             "| payload MB / step / process | peak MiB / process | % of FLOP limit | in CPU time |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for f, x in zip(figures, v.values()):
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(x["collective_calls_by_kind"].items()))
        lo, hi = min(x["round_median_ms"]), max(x["round_median_ms"])
        lines.append(f"| {x['label']} | {x['median_step_ms']:.1f} ({lo:.0f}-{hi:.0f}) | "
                     f"{x['median_step_cpu_ms']:.1f} | {x['collective_calls']} ({kinds}) | "
                     f"{x['payload_bytes'] / mb:.1f} | {x['peak_bytes'] / mib:.1f} | "
                     f"{100 * f['flop_fraction']:.1f} | "
                     f"{100 * report['flop_limit_fraction_cpu_time'][f['figure']]:.1f} |")
    lines += ["", "Paired ratios (per round: the median of one variant's steps over its peer's "
              "in that round; their median, range and values):", ""]
    for key, x in r.items():
        per = ", ".join(f"{q:.2f}" for q in x["per_round"])
        c = report["cpu_ratios"][key]
        lines.append(f"- **{key} = {x['median']:.3f}** (rounds {x['min']:.2f}-{x['max']:.2f}: {per}); "
                     f"in the stepping thread's CPU time {c['median']:.3f} ({c['min']:.2f}-{c['max']:.2f})")

    ref = reference(list(v))

    def others(diffs: dict) -> str:
        return ", ".join(f"{n} {d:.1e}" for n, d in diffs.items() if n != ref)

    lines += ["", f"Losses: every variant's k-th step against {ref}'s, over "
              f"{report['losses_compared']} steps: largest difference "
              f"{others(report['loss_max_difference'])} (relative: "
              f"{others(report['loss_max_relative_difference'])}; first step: "
              f"{others(report['loss_first_step_difference'])}).", ""]
    for name in (n for n in v if n in RULES):
        s = v[name]["comm_stats"] or {}
        lines.append(f"- `mt.comm_stats()` of {name}: {sum(e['calls'] for e in s.values())} calls, "
                     f"{sum(e['bytes'] for e in s.values()) / mb:.2f} MB (the dispatcher counted "
                     f"{v[name]['collective_calls']} calls, {v[name]['payload_bytes'] / mb:.2f} MB).")
    load = report["load_average_1min"]
    lines += ["", "How: step time is the larger of the two processes' wall times of a step that starts "
              "after a barrier; CPU ms is the stepping thread's CPU time (`time.thread_time`), which "
              "leaves out time other processes held the core. Collective calls and payload (bytes this "
              "process hands in: an all-gather's input, a reduce-scatter's whole input, an all-reduce's "
              "tensor) are counted on one step by a `TorchDispatchMode` over the `c10d` ops, which sees "
              "FSDP2's and DDP's internal collectives as well as meshtorch's. Peak memory is the CPU "
              "allocator's peak during a steady-state step from `torch.profiler`'s memory events "
              "(`benchmarks/allocator_peak.py`), the variant built inside the profile; the larger of the "
              "two processes. % of FLOP limit: the step's FLOPs (`torch.utils.flop_counter`, both "
              "processes) over 2 cores' measured fp32 matmul rate, as a share of the median step time; "
              "*in CPU time*: each process's half of the FLOPs over its stepping thread's median CPU time "
              "at the matmul rate measured in CPU time "
              f"({report['matmul_flops_per_cpu_s'] / 1e9:.1f} GFLOP/s per core), the figure a loaded "
              "machine distorts least (it leaves out gloo's threads).", "",
              f"Machine: {report['cpus']} CPUs, **shared with other jobs**: 1-minute load average "
              f"{load['before']:.2f} before, {load['after']:.2f} after; absolute times are inflated and "
              "noisy where the load exceeds the benchmark's own 2, and the paired ratios are the figures "
              f"to read. torch {report['torch']}.", "",
              f"Reproduce: `{report['command']}` ({report['wall_s']:.0f} s)."]
    return "\n".join(lines) + "\n" + section(figures)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds, in a balanced order (ABCDE, EDCBA, ...)")
    p.add_argument("--steps", type=int, default=3, help="steps of each variant per round")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps of each variant first; at least 2, so that the counted step is a "
                        "steady one (DDP rebuilds its buckets in its second step, broadcasting their order)")
    p.add_argument("--memory-steps", type=int, default=3, help="profiled steps of each variant (least peak)")
    p.add_argument("--quick", action="store_true",
                   help=f"a small LM ({QUICK_CONFIG}), batch {QUICK_BATCH} x {QUICK_LENGTH}, 2 rounds of "
                        "2 steps: checks the benchmark in well under a minute")
    p.add_argument("--pairs", default=",".join(PAIRS),
                   help="the paired comparisons to run, comma-separated (their variants only), e.g. "
                        "--pairs meshtorch_dp/ddp for a quick look at one; default: all of "
                        + ", ".join(PAIRS))
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for the json and md results (default {RESULTS}; a run of some of the "
                        "--pairs writes none unless given one: it does not replace the whole run's)")
    a = p.parse_args(argv)
    a.pairs = [k.strip() for k in a.pairs.split(",") if k.strip()]
    unknown = [k for k in a.pairs if k not in PAIRS]
    if unknown or not a.pairs:
        p.error(f"--pairs: {', '.join(unknown) or 'none given'}; choose from {', '.join(PAIRS)}")
    chosen = {n for k in a.pairs for n in PAIRS[k]}
    a.variants = [n for n in VARIANTS if n in chosen]
    if a.quick:
        a.rounds, a.steps, a.memory_steps = min(a.rounds, 2), min(a.steps, 2), min(a.memory_steps, 2)
    a.warmup = max(a.warmup, 2)
    a.config = QUICK_CONFIG if a.quick else CONFIG
    a.batch, a.length = (QUICK_BATCH, QUICK_LENGTH) if a.quick else (BATCH, LENGTH)
    a.command = "python benchmarks/fsdp_vs_fsdp2.py" + (" " + " ".join(argv) if argv else "")
    return a


def results_folder(args: argparse.Namespace) -> Path | None:
    """Where a run writes its json and md: ``--out``, else ``benchmarks/results`` for a run of every
    pair; ``None`` (printed only) for a run of some of them, which must not replace the whole run's."""
    if args.out is not None or set(args.pairs) != set(PAIRS):
        return args.out
    return RESULTS


def main(argv: list[str] | None = None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    store = serve()  # held until the workers end: no other run can take its port (rendezvous.py)
    port = store.port
    load_before = os.getloadavg()[0]
    t0 = time.time()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(port, args, queue), nprocs=WORLD, start_method="spawn")
    res = queue.get()
    wall_s = time.time() - t0
    load_after = os.getloadavg()[0]
    summary = summarise(res["per_process"], args.pairs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = step_work(TransformerConfig(**args.config), args.batch, args.length)
    finally:
        torch.set_num_threads(threads)
    figures = [figure(name, x["median_step_ms"] / 1e3, work, processors=WORLD)
               for name, x in summary["variants"].items()]
    rate = summary["matmul_flops_per_cpu_s"]
    report = {"benchmark": "fsdp_vs_fsdp2", "processes": WORLD, "backend": "gloo", "config": args.config,
              "parameters": res["parameters"], "batch": args.batch, "length": args.length,
              "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
              "memory_steps": args.memory_steps, "quick": args.quick, **summary,
              "losses_compared": len(summary["losses"][reference(args.variants)]),
              "flop_limit_fraction": {f["figure"]: f["flop_fraction"] for f in figures},
              # each process's half of the FLOPs over its stepping thread's CPU time at the CPU-time rate
              "flop_limit_fraction_cpu_time": {
                  name: work.flops / WORLD / (x["median_step_cpu_ms"] / 1e3 * rate)
                  for name, x in summary["variants"].items()},
              "load_average_1min": {"before": load_before, "after": load_after},
              "wall_s": wall_s, "command": args.command, "torch": torch.__version__,
              "machine": platform.machine(), "cpus": os.cpu_count()}
    note = ("The work of both processes' halves of the step (the plain twin's; meshtorch's math is the "
            f"same), on {WORLD} cores.")
    md = markdown(report, figures)
    out = results_folder(args)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "fsdp_vs_fsdp2.json").write_text(json.dumps(attach(report, figures, note), indent=1) + "\n")
        (out / "fsdp_vs_fsdp2.md").write_text(md)
    print(md)
    if out is None:
        print(f"(--pairs {','.join(args.pairs)}: results printed only; {RESULTS} keeps the whole run's, "
              "--out DIR writes these)")
    for f in figures:
        print(f"{f['figure']}: {100 * f['flop_fraction']:.1f}% of the FLOP limit ({f['flops'] / 1e9:.3f} "
              f"GFLOP at {limits().flops_per_core / 1e9:.1f} GFLOP/s x {WORLD} cores); in CPU time "
              f"{100 * report['flop_limit_fraction_cpu_time'][f['figure']]:.1f}% (at "
              f"{report['matmul_flops_per_cpu_s'] / 1e9:.1f} GFLOP/s per CPU second)")
    return report


if __name__ == "__main__":
    main()
