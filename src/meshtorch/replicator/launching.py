"""Start a Replicator program: one replica per processor of a ``replica`` mesh.

Example:
    >>> import meshtorch as mt
    >>> mt.replicator.launch_replicas(lambda: mt.current().coords, num_replicas=2)
    [{'replica': 0}, {'replica': 1}]
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.errors import MeshError
from meshtorch.launcher import gather_results
from meshtorch.launcher import launch as mesh_launch
from meshtorch.launcher.world import in_torchrun


def default_num_replicas() -> int:
    """One replica per CUDA GPU when there are any, else one.

    Example:
        >>> from meshtorch.replicator.launching import default_num_replicas
        >>> default_num_replicas() >= 1
        True
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch_replicas(fn: Callable[..., Any], *args: Any, num_replicas: int | None = None,
                    backend: str = "threads", timeout: float = 300.0, check: bool = False,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as ``num_replicas`` replicas; results in replica order.

    The same script works under every launcher. Called where no program is
    running yet, it starts the replicas on ``backend``. Called inside a
    running program (a script started by ``meshtorch launch``, or inside
    ``mt.launch``), every processor is already one replica: ``fn`` runs once
    on each, as that replica, and each gets the results of all of them, in
    replica order, as from a fresh launch. Under plain torchrun the
    processes join as ``WORLD_SIZE`` replicas on the torch backend.

    Args:
        num_replicas: default one per CUDA GPU, else 1; inside a running
            program, the processors running (a different number is an error).
        backend: ``"threads"`` (one thread per replica) or ``"torch"``, for
            starting the replicas; a running program keeps its own.
        timeout: seconds a collective may wait before it raises.
        check: record collective call sites, so a replica that skips a
            collective is named with both call sites.

    Raises:
        MeshError: ``num_replicas`` differs from the processors already running.

    Example:
        >>> import meshtorch as mt
        >>> mt.replicator.launch_replicas(lambda: mt.Replicator(device="cpu").replica_id, num_replicas=3)
        [0, 1, 2]
        >>> def outer():  # already running on 2 processors: each is one replica
        ...     return mt.replicator.launch_replicas(lambda: mt.Replicator(device="cpu").replica_id)
        >>> mt.launch(outer, mesh="replica:2")
        [[0, 1], [0, 1]]
    """
    ctx = current()
    running = ctx.mesh.size > 1 or ctx.comm.backend != "local"
    if running or in_torchrun():
        n = ctx.mesh.size if running else int(os.environ["WORLD_SIZE"])
        if num_replicas not in (None, n):
            where = f"mesh '{ctx.mesh}'" if running else "torchrun's world"
            raise MeshError(
                f"mt.replicator.launch_replicas(num_replicas={num_replicas}) was called where {n} processors "
                f"({where}) already run the program, each as one replica; leave num_replicas out, "
                f"or start {num_replicas} processors")
        if running:
            return gather_results(fn(*args, **kwargs))
        # torchrun started the processes: join them as one replica each
        return mesh_launch(fn, *args, mesh=f"replica:{n}", backend="torch", timeout=timeout, check=check,
                           **kwargs)
    n = default_num_replicas() if num_replicas is None else num_replicas
    extra = {} if backend == "threads" else {"nprocs": n}
    return mesh_launch(fn, *args, mesh=f"replica:{n}", backend=backend, timeout=timeout, check=check,
                       **extra, **kwargs)


def launch(*args: Any, **kwargs: Any) -> list[Any]:
    """Deprecated name of :func:`launch_replicas` (``mt.launch`` runs a program on a mesh; this
    starts replicas)."""
    warnings.warn("mt.replicator.launch is deprecated and will be removed in the next release: call "
                  "mt.replicator.launch_replicas", DeprecationWarning, stacklevel=2)
    return launch_replicas(*args, **kwargs)
