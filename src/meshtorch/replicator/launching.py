"""Start a Replicator program: one replica per processor of a ``replica`` mesh.

Example:
    >>> import meshtorch as mt
    >>> mt.replicator.launch(lambda: mt.current().coords, num_replicas=2)
    [{'replica': 0}, {'replica': 1}]
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.launch import launch as mesh_launch
from meshtorch.launcher import in_torchrun


def default_num_replicas() -> int:
    """One replica per CUDA GPU when there are any, else one."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch(fn: Callable[..., Any], *args: Any, num_replicas: int | None = None, backend: str = "threads",
           timeout: float = 300.0, check: bool = False, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as ``num_replicas`` replicas; results in replica order.

    Inside a program that is already running on several processors (a script
    started by ``meshtorch launch``, or a nested ``mt.launch``) ``fn`` runs
    once, here, and the list holds this replica's result only; under plain
    torchrun the processes join as ``WORLD_SIZE`` replicas on the torch
    backend. So the same script works under every launcher.

    Args:
        num_replicas: default one per CUDA GPU, else 1.
        backend: ``"threads"`` (one thread per replica) or ``"torch"``.
        timeout: seconds a collective may wait before it raises.
        check: record collective call sites, so a replica that skips a
            collective is named with both call sites.

    Example:
        >>> import meshtorch as mt
        >>> mt.replicator.launch(lambda: mt.Replicator(device="cpu").replica_id, num_replicas=3)
        [0, 1, 2]
    """
    if current().mesh.size > 1 or current().comm.backend != "local":
        return [fn(*args, **kwargs)]
    if in_torchrun():
        # torchrun already started the processes: join them as one replica each
        n, backend, extra = int(os.environ["WORLD_SIZE"]), "torch", {}
    else:
        n = default_num_replicas() if num_replicas is None else num_replicas
        extra = {} if backend == "threads" else {"nprocs": n}
    return mesh_launch(fn, *args, mesh=f"replica:{n}", backend=backend, timeout=timeout, check=check,
                       **extra, **kwargs)
