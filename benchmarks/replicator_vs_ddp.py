"""Step time of the Replicator vs torch DistributedDataParallel on 2 gloo processes.

Both run in the same two processes, on the same process group, model, batch
and bucket size. Steps are interleaved one by one (DDP, Replicator,
Replicator, DDP, ...: who goes first alternates), each after a barrier so both
processes start it together, in several repeats after a warm-up. Machine
noise then hits both alike, and the figure to read is the **paired ratio**:
the median over steps of (Replicator step / the DDP step timed next to it).
The 1-minute load average before and after goes into the report, since on a
shared machine absolute times mean little.

Writes ``benchmarks/results/replicator_vs_ddp.{json,md}``; takes about a minute.

Run:
    python benchmarks/replicator_vs_ddp.py [--repeats 5] [--steps 40] [--bucket-mb 4] [--no-overlap]
        [--ddp-bucket-view] [--out DIR]
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
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from limits import Work, attach, count, figure, section
from rendezvous import join, serve

import meshtorch as mt
from meshtorch.comm.torch import TorchCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.mesh import Mesh

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 1.05


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def step_work(batch: int) -> Work:
    """The work of both processes' steps: each runs the model's step on its batch (communication aside)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # Adam's state exists from the first step on, as in the timed steps
    work = count(step)[1]
    return Work(2 * work.flops, 2 * work.bytes)


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    join(port, rank, world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g)

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=args.bucket_mb,
                                                    gradient_as_bucket_view=args.ddp_bucket_view)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)

    comm = TorchCommunicator(Mesh(f"replica:{world}"))   # the Replicator on meshtorch's torch backend
    with use(ProcessorContext(comm)):
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = make_model()
            opt = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4), bucket_mb=args.bucket_mb,
                                      overlap=not args.no_overlap)

        def step(net, optimizer):
            dist.barrier()          # both processes start the timed step together
            t0, c0 = time.perf_counter(), time.process_time()
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return time.perf_counter() - t0, time.process_time() - c0

        runs = {"ddp": (ddp, ddp_opt), "replicator": (model, opt)}
        for _ in range(args.warmup):
            for net, optimizer in runs.values():
                step(net, optimizer)
        times: dict[str, list[list[float]]] = {"ddp": [], "replicator": []}
        cpu: dict[str, list[list[float]]] = {"ddp": [], "replicator": []}
        for r in range(args.repeats):
            for name in times:
                times[name].append([])
                cpu[name].append([])
            for s in range(args.steps):
                order = list(runs) if (r + s) % 2 == 0 else list(runs)[::-1]
                for name in order:
                    wall, busy = step(*runs[name])
                    times[name][-1].append(wall)
                    cpu[name][-1].append(busy)
        pairs = zip(ddp.module.parameters(), model.parameters())
        same = all(torch.allclose(a, b, atol=1e-4) for a, b in pairs)
    if rank == 0:
        queue.put({"times": times, "cpu": cpu, "same_params": same, "communicator": type(comm).__name__})
    dist.barrier()
    dist.destroy_process_group()


def summarise(times: dict[str, list[list[float]]]) -> dict:
    """Medians and paired ratios, overall and per repeat."""
    flat = {k: [t for rep in v for t in rep] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in flat.items()}
    paired = [a / b for a, b in zip(flat["replicator"], flat["ddp"])]
    per_repeat = [statistics.median(a / b for a, b in zip(ra, rd))
                  for ra, rd in zip(times["replicator"], times["ddp"])]
    return {"median_step_s": med, "ratio_of_medians": med["replicator"] / med["ddp"],
            "paired_ratio": statistics.median(paired), "paired_ratio_per_repeat": per_repeat}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="interleaved step pairs per repeat")
    p.add_argument("--warmup", type=int, default=10, help="untimed step pairs first")
    p.add_argument("--batch", type=int, default=64, help="per process")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--no-overlap", action="store_true",
                   help="Replicator averages at the end of backward, not during it")
    p.add_argument("--ddp-bucket-view", action="store_true",
                   help="DDP with gradient_as_bucket_view=True (no copy-out, like the Replicator)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the json and md results")
    args = p.parse_args()
    store = serve()  # held until the workers end: no other run can take its port (rendezvous.py)
    port = store.port
    cpus = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    t0 = time.time()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, port, args, queue), nprocs=2, start_method="spawn")
    res = queue.get()
    load_after = os.getloadavg()[0]
    summ = summarise(res["times"])
    # CPU seconds of the process (all its threads, gloo's included) per step: the work each
    # does, which other load on the machine inflates far less than wall time
    cpu = summarise(res["cpu"])
    med, paired = summ["median_step_s"], summ["paired_ratio"]
    # the benchmark's 2 processes alone make a load of about 2 by the end; more than one
    # busy core's worth from others beforehand means the absolute times are shared-machine times
    busy = load_before > 1.0
    report = {
        "benchmark": "replicator_vs_ddp", "processes": 2, "backend": "gloo", "model": "MLP 784-1024x3-10",
        "params": sum(p.numel() for p in make_model().parameters()), "batch_per_process": args.batch,
        "bucket_mb": args.bucket_mb, "replicator_overlap": not args.no_overlap,
        "ddp_gradient_as_bucket_view": args.ddp_bucket_view,
        "repeats": args.repeats, "steps_per_repeat": args.steps, "warmup_steps": args.warmup,
        **summ, "target": TARGET, "meets_target": paired <= TARGET,
        "cpu_per_step": {"median_s": cpu["median_step_s"], "paired_ratio": cpu["paired_ratio"]},
        "load_average_1min": {"before": load_before, "after": load_after}, "machine_busy": busy,
        "wall_s": time.time() - t0, "same_params_after_training": res["same_params"],
        "replicator_communicator": res["communicator"], "torch": torch.__version__,
        "machine": platform.machine(), "cpus": cpus,
    }
    work = step_work(args.batch)
    figures = [figure(k, med[k], work, processors=2) for k in ("ddp", "replicator")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replicator_vs_ddp.json").write_text(json.dumps(attach(report, figures), indent=2) + "\n")
    reps = ", ".join(f"{r:.3f}" for r in summ["paired_ratio_per_repeat"])
    load = (f"1-min load average {load_before:.2f} before, {load_after:.2f} after, on {cpus} CPUs"
            + (" — **busy machine**: other work shared the cores, so absolute times are inflated and "
               "noisy; the paired ratio is the figure to read" if busy else ""))
    md = (f"# Replicator vs DDP (2 gloo processes, CPU)\n\n"
          f"| | median step (ms) |\n|---|---|\n| DDP | {1e3 * med['ddp']:.2f} |\n"
          f"| Replicator | {1e3 * med['replicator']:.2f} |\n\n"
          f"Paired ratio Replicator/DDP (median over steps of each Replicator step over the DDP step "
          f"next to it): **{paired:.3f}** (target <= {TARGET}; per repeat {reps}; ratio of medians "
          f"{summ['ratio_of_medians']:.3f}).\n\n"
          f"CPU time per step (the process's threads, gloo's included): DDP "
          f"{1e3 * cpu['median_step_s']['ddp']:.2f} ms, Replicator "
          f"{1e3 * cpu['median_step_s']['replicator']:.2f} ms, paired ratio {cpu['paired_ratio']:.3f}.\n\n"
          f"{load}. Overlap {not args.no_overlap}; model {report['model']} ({report['params']:,} params), "
          f"batch {args.batch}/process, buckets {args.bucket_mb} MiB, DDP gradient_as_bucket_view "
          f"{args.ddp_bucket_view}, {args.repeats} repeats x "
          f"{args.steps} interleaved steps each after {args.warmup} warm-up, communicator "
          f"{res['communicator']}, torch {torch.__version__}. Same parameters after training: "
          f"{res['same_params']}.\n\nReproduce: `python benchmarks/replicator_vs_ddp.py` "
          f"({report['wall_s']:.0f} s).\n" + section(figures))
    (args.out / "replicator_vs_ddp.md").write_text(md)
    print(f"DDP {1e3 * med['ddp']:.2f} ms/step, Replicator {1e3 * med['replicator']:.2f} ms/step, "
          f"paired ratio {paired:.3f} (per repeat {reps}; target <= {TARGET}); CPU time paired ratio "
          f"{cpu['paired_ratio']:.3f}; {load}; "
          f"same params: {res['same_params']}")


if __name__ == "__main__":
    main()
