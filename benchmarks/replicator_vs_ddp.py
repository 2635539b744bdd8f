"""Step time of the Replicator vs torch DistributedDataParallel on 2 gloo processes.

Both run in the same two processes, on the same process group, model, batch
and bucket size, alternating blocks of steps so machine noise hits both
alike. Prints the ratio Replicator / DDP of the median step time (target
<= 1.05) and writes JSON and markdown into ``benchmarks/results/``.

Run:
    python benchmarks/replicator_vs_ddp.py [--steps 20] [--rounds 5] [--bucket-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import meshtorch as mt
from meshtorch.comm.torch import TorchCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.mesh import Mesh

RESULTS = Path(__file__).resolve().parent / "results"


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def _time_steps(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g)

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=args.bucket_mb)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)

    def ddp_step():
        loss = F.cross_entropy(ddp(x), y)
        ddp_opt.zero_grad()
        loss.backward()
        ddp_opt.step()

    comm = TorchCommunicator(Mesh(f"replica:{world}"))   # the Replicator on meshtorch's torch backend
    with use(ProcessorContext(comm)):
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = make_model()
            opt = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4), bucket_mb=args.bucket_mb,
                                      overlap=not args.no_overlap)

        def repl_step():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        times = {"ddp": [], "replicator": []}
        for _ in range(3):
            ddp_step(), repl_step()
        order = [("ddp", ddp_step), ("replicator", repl_step)]
        for r in range(args.rounds * args.steps):
            # alternate single steps (and who goes first) so load from elsewhere hits both alike
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name] += _time_steps(fn, 1)
        pairs = zip(ddp.module.parameters(), model.parameters())
        same = all(torch.allclose(a, b, atol=1e-4) for a, b in pairs)
    if rank == 0:
        queue.put({"times": times, "same_params": same, "communicator": type(comm).__name__})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=64, help="per process")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--no-overlap", action="store_true", help="Replicator averages at step() only")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, port, args, queue), nprocs=2, start_method="spawn")
    res = queue.get()
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    ratio = med["replicator"] / med["ddp"]
    # paired ratios: each Replicator step against the DDP step timed next to it
    paired = statistics.median(a / b for a, b in zip(res["times"]["replicator"], res["times"]["ddp"]))
    report = {
        "benchmark": "replicator_vs_ddp", "processes": 2, "backend": "gloo", "model": "MLP 784-1024x3-10",
        "params": sum(p.numel() for p in make_model().parameters()), "batch_per_process": args.batch,
        "bucket_mb": args.bucket_mb, "replicator_overlap": not args.no_overlap,
        "steps": args.steps * args.rounds, "median_step_s": med, "ratio_replicator_over_ddp": ratio,
        "median_paired_ratio": paired, "target": 1.05,
        "same_params_after_training": res["same_params"], "replicator_communicator": res["communicator"],
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replicator_vs_ddp.json").write_text(json.dumps(report, indent=2) + "\n")
    md = (f"# Replicator vs DDP (2 gloo processes, CPU)\n\n"
          f"| | median step (ms) |\n|---|---|\n| DDP | {1e3 * med['ddp']:.2f} |\n"
          f"| Replicator | {1e3 * med['replicator']:.2f} |\n\n"
          f"ratio Replicator/DDP: **{ratio:.3f}** (target <= 1.05; median of paired step ratios "
          f"{paired:.3f}); overlap {not args.no_overlap}; model {report['model']} "
          f"({report['params']:,} params), batch {args.batch}/process, buckets {args.bucket_mb} MiB, "
          f"{report['steps']} steps each, communicator {res['communicator']}, torch {torch.__version__}, "
          f"{report['cpus']} CPUs. Same parameters after training: {res['same_params']}.\n")
    (RESULTS / "replicator_vs_ddp.md").write_text(md)
    print(f"DDP {1e3 * med['ddp']:.2f} ms/step, Replicator {1e3 * med['replicator']:.2f} ms/step, "
          f"ratio {ratio:.3f} (paired {paired:.3f}; target <= 1.05); same params: {res['same_params']}")


if __name__ == "__main__":
    main()
