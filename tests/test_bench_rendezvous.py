"""benchmarks/rendezvous.py: a benchmark's spawned workers meet through a store whose port their parent
holds, so two runs at once never share one (fsdp_vs_fsdp2, replicator_vs_ddp and dp_phases bound port 0,
closed it and handed the number on: a run started in between could take it, and its workers met the
first run's; a run hung 600 s beside CI's quick one)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import textwrap

import pytest

from bench_harness import BENCHMARKS, load_benchmark


def test_the_port_is_held_while_the_store_lives_so_no_other_run_can_take_it():
    rendezvous = load_benchmark("rendezvous")
    first, second = rendezvous.serve(), rendezvous.serve()
    assert first.port != second.port
    for port in (first.port, second.port):
        with socket.socket() as s, pytest.raises(OSError) as e:
            s.bind((rendezvous.HOST, port))  # what the old handover let the next run do
        assert e.value.errno == errno.EADDRINUSE


PROGRAM = """
import sys
sys.path.insert(0, {benchmarks!r})
import torch, torch.distributed as dist, torch.multiprocessing as mp
from rendezvous import join, serve


def worker(rank, port, run):
    join(port, rank, 2)
    total = torch.tensor([float(run)])
    dist.all_reduce(total)
    line = f"run {{run}} rank {{rank}}: {{dist.get_world_size()}} processes, sum {{total.item()}}\\n"
    sys.stdout.write(line)  # one write per line: two workers' lines do not interleave
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    # the benchmarks spawn their workers; forked here from one server that imported torch once (the
    # start method is not what is tested, and four spawned interpreters import torch four times)
    mp.set_forkserver_preload(["torch.distributed", "rendezvous"])
    stores = {{run: serve() for run in (1, 2)}}  # two runs at once, each holding its own port
    runs = [mp.start_processes(worker, args=(s.port, run), nprocs=2, join=False, start_method="forkserver")
            for run, s in stores.items()]
    for r in runs:
        while not r.join():
            pass
"""


def test_two_runs_at_once_each_meet_only_their_own_workers(tmp_path):
    script = tmp_path / "two_runs.py"
    script.write_text(textwrap.dedent(PROGRAM.format(benchmarks=str(BENCHMARKS))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # each run's sum is its own workers' (1 + 1, 2 + 2), never a mix
    assert sorted(out.stdout.splitlines()) == [f"run {run} rank {rank}: 2 processes, sum {2.0 * run}"
                                               for run in (1, 2) for rank in (0, 1)], out.stdout
