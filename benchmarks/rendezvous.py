"""The rendezvous of a benchmark's spawned gloo workers, which no other run can join.

The parent starts the ``torch.distributed.TCPStore`` server on port 0 (the kernel picks a free port,
and the store keeps it bound for as long as the parent holds it) and hands its port to the workers,
which join as clients: torchrun's agent shares its own store with its workers the same way
(``TORCHELASTIC_USE_AGENT_STORE``). The benchmarks bound port 0, closed the socket and handed the
number on, for rank 0 to start the server on it later: a second run started in between (CI's quick
run beside a full one) could get the same number, and its workers then met the first run's (a run
hung once for 600 s).

Example:
    >>> from rendezvous import serve
    >>> store = serve()
    >>> store.port > 0
    True
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(minutes=10)  # a worker's import of torch on a loaded machine takes seconds


def serve(timeout: datetime.timedelta = TIMEOUT) -> dist.TCPStore:
    """The server of a run's store, on a free loopback port (``.port``): keep it until the workers end."""
    return dist.TCPStore(HOST, 0, None, True, timeout, wait_for_workers=False)


def join(port: int, rank: int, world: int, backend: str = "gloo") -> None:
    """Worker ``rank`` of ``world`` joins the default process group (its collectives' timeout torch's
    default) through the store :func:`serve` started on ``port``."""
    store = dist.TCPStore(HOST, port, None, False, TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
