"""Where meshtorch data parallel's step spends its CPU time next to DDP's, phase by phase.

A diagnosis of ``fsdp_vs_fsdp2.py``'s ``meshtorch_dp/ddp`` ratio (issue 27): the same LM,
weights, rows and ``torch.optim.AdamW`` as there, on 2 gloo processes with one intra-op
thread each. Steps of meshtorch ``batch:b`` under ``mt.overlap()``, of the same without
overlap (per-use collectives) and of DDP are interleaved (the order reverses every round,
each step after a barrier); each phase's CPU time on the stepping thread
(``time.thread_time``: it leaves out waits in collectives and time other processes held the
core) is reported as the median over steps of rank 0: forward and loss, ``zero_grad``,
backward (gradient reductions included), ``opt.step``. Then the same split on one processor,
without any collective: meshtorch's ``DecoderLM`` vs its plain ``torch.nn`` twin
(``fsdp_vs_fsdp2.BlockLM``) on one process's rows, which is what is left of the gap when no
data-parallel machinery runs.

Run:
    python benchmarks/dp_phases.py [--rounds 16] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import fsdp_vs_fsdp2 as bench
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rendezvous import join, serve

import meshtorch as mt
from meshtorch.comm.torch import TorchCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.layout import LayoutRules
from meshtorch.models import DecoderLM, TransformerConfig

PHASES = ("forward+loss", "zero_grad", "backward", "opt.step")


def timed(loss_fn, opt) -> list[float]:
    """One step: each phase's CPU time on this thread, seconds."""
    t = [time.thread_time()]
    loss = loss_fn()
    t.append(time.thread_time())
    opt.zero_grad(set_to_none=True)
    t.append(time.thread_time())
    loss.backward()
    t.append(time.thread_time())
    opt.step()
    t.append(time.thread_time())
    loss.item()
    return [b - a for a, b in zip(t, t[1:])]


def table(res: dict[str, list[list[float]]], title: str) -> str:
    lines = [title, "", "| variant | " + " | ".join(PHASES) + " | step |", "|---" * (len(PHASES) + 2) + "|"]
    for name, steps in res.items():
        med = [1e3 * statistics.median(s[i] for s in steps) for i in range(len(PHASES))]
        total = 1e3 * statistics.median(sum(s) for s in steps)
        lines.append(f"| {name} | " + " | ".join(f"{m:.2f}" for m in med) + f" | {total:.1f} |")
    return "\n".join(lines)


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    join(port, rank, 2)
    cfg = TransformerConfig(**args.config)
    shape = f"batch:{args.batch},length:{args.length}"
    ctx = ProcessorContext(TorchCommunicator("b:2"), LayoutRules("batch:b"))
    with use(ctx):
        model = DecoderLM(cfg, seed=0)
        twin = bench.BlockLM(model)
    mopt = torch.optim.AdamW(model.parameters(), lr=bench.LR)
    net = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(twin))
    dopt = torch.optim.AdamW(net.parameters(), lr=bench.LR)
    data = bench.batch(0, cfg.vocab, args.batch, args.length)
    rows = args.batch // 2
    local = data[rank * rows:(rank + 1) * rows]

    def mesh(overlap: bool):
        def loss():
            with use(ctx), mt.overlap(enabled=overlap):
                return model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))

        def step():
            with use(ctx), mt.overlap(enabled=overlap):  # backward's reductions run in it too
                return timed(loss, mopt)
        return step

    steps = {"meshtorch batch:b, mt.overlap()": mesh(True),
             "meshtorch batch:b, per use": mesh(False),
             "DDP": lambda: timed(lambda: F.cross_entropy(net(local[:, :-1]).flatten(0, 1),
                                                          local[:, 1:].flatten()), dopt)}
    res = interleaved(steps, args.rounds, before=dist.barrier)
    if rank == 0:
        queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def interleaved(steps: dict, rounds: int, before=lambda: None) -> dict[str, list[list[float]]]:
    """Each step's phase times over ``rounds`` rounds in a balanced order (AB, BA, ...), after 3
    warm-up steps each; ``before`` runs before every measured step (a barrier across processes)."""
    for step in steps.values():
        for _ in range(3):
            step()
    res: dict[str, list[list[float]]] = {n: [] for n in steps}
    order = list(steps)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            before()
            res[name].append(steps[name]())
    return res


def one_processor(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """meshtorch's DecoderLM vs its plain twin on one process's rows, no collectives."""
    torch.set_num_threads(1)
    cfg = TransformerConfig(**args.config)
    rows = args.batch // 2
    model = DecoderLM(cfg, seed=0)
    twin = bench.BlockLM(model)
    mopt = torch.optim.AdamW(model.parameters(), lr=bench.LR)
    topt = torch.optim.AdamW(twin.parameters(), lr=bench.LR)
    data = bench.batch(0, cfg.vocab, rows, args.length)
    shape = f"batch:{rows},length:{args.length}"
    steps = {"meshtorch, one processor": lambda: timed(lambda: model.loss(
                 mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape)), mopt),
             "plain torch twin": lambda: timed(lambda: twin.loss(data[:, :-1], data[:, 1:]), topt)}
    return interleaved(steps, args.rounds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16, help="interleaved steps of each variant")
    p.add_argument("--quick", action="store_true", help="fsdp_vs_fsdp2's small LM, 4 rounds")
    args = p.parse_args(argv)
    args.config = bench.QUICK_CONFIG if args.quick else bench.CONFIG
    args.batch, args.length = ((bench.QUICK_BATCH, bench.QUICK_LENGTH) if args.quick
                               else (bench.BATCH, bench.LENGTH))
    if args.quick:
        args.rounds = min(args.rounds, 4)
    store = serve()  # held until the workers end: no other run can take its port (rendezvous.py)
    port = store.port
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(port, args, queue), nprocs=2, start_method="spawn")
    print(table(queue.get(), "Data parallel on 2 gloo processes: median CPU ms of rank 0's stepping thread"))
    print()
    print(table(one_processor(args), "One processor, no collectives: median CPU ms"))
    print(f"\nload average (1 min) {os.getloadavg()[0]:.2f}; torch {torch.__version__}; "
          f"`python benchmarks/dp_phases.py {' '.join(sys.argv[1:] if argv is None else argv)}`")


if __name__ == "__main__":
    main()
