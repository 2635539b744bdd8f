"""Which device a replica computes on (``"auto"`` picks CUDA, then MPS, then CPU), and
moving its batches there.

On CUDA each replica gets one GPU, its *local* index: its rank on the threads
backend (one process drives every GPU, one thread each) and ``LOCAL_RANK``
on the torch backend (one process per GPU, as torchrun numbers them).

Example:
    >>> from meshtorch.replicator.device import resolve_device
    >>> from meshtorch.comm.base import LocalCommunicator
    >>> resolve_device("cpu", LocalCommunicator())
    device(type='cpu')
"""

from __future__ import annotations

import os
from typing import Any

import torch

from meshtorch.comm.base import Communicator
from meshtorch.errors import MeshError

DEVICES = ("auto", "cpu", "cuda", "mps")


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _local_index(comm: Communicator) -> int:
    if comm.backend == "threads" or comm.mesh.size == 1:
        return comm.rank
    return int(os.environ.get("LOCAL_RANK", comm.rank))


def resolve_device(spec: str | torch.device, comm: Communicator) -> torch.device:
    """The ``torch.device`` this processor's replica runs on.

    ``"cuda"`` gives the replica the GPU of its local index and makes it the
    calling thread's current CUDA device (NCCL and the CUDA caching allocator
    use it); an explicit ``"cuda:1"`` pins every replica of this process there.

    Raises:
        MeshError: the device kind is unknown or unavailable, or the threads
            backend would put two replicas on one accelerator (their blocking
            collectives inside backward would deadlock on its autograd thread).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.replicator.device import resolve_device
        >>> mt.launch(lambda: str(resolve_device("cpu", mt.current().comm)), mesh="replica:2")
        ['cpu', 'cpu']
    """
    if isinstance(spec, torch.device):
        kind, index = spec.type, spec.index
    elif isinstance(spec, str):
        kind, _, idx = spec.partition(":")
        if kind not in DEVICES or (idx and not idx.isdigit()) or (idx and kind == "auto"):
            raise MeshError(f"device {spec!r} is not one of {DEVICES} (or e.g. 'cuda:1')")
        index = int(idx) if idx else None
    else:
        raise MeshError(f"device {spec!r} is not one of {DEVICES} or a torch.device")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    threads = comm.backend == "threads"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise MeshError(f"device {spec!r} asked for, but torch sees no CUDA GPU; use device='auto'")
        count = torch.cuda.device_count()
        if index is None:
            if threads and comm.mesh.size > count:
                raise MeshError(
                    f"{comm.mesh.size} thread replicas but {count} CUDA GPUs: the threads backend puts "
                    f"one replica on each GPU; launch at most {count} replicas, or use the torch backend"
                )
            index = _local_index(comm) % count
        elif index >= count:
            raise MeshError(f"device {spec!r}: torch sees {count} CUDA GPUs (cuda:0..cuda:{count - 1})")
        elif threads and comm.mesh.size > 1:
            raise MeshError(
                f"device {spec!r} would put all {comm.mesh.size} thread replicas on one GPU; use "
                "device='cuda' (one GPU per replica) or launch 1 replica"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if kind != "mps":
        raise MeshError(f"device {spec!r} is not one of {DEVICES} or a torch.device")
    if not _mps_available():
        raise MeshError("device 'mps' asked for, but torch.backends.mps is not available")
    if threads and comm.mesh.size > 1:
        raise MeshError(
            f"{comm.mesh.size} thread replicas cannot share the one MPS device; launch 1 replica"
        )
    return torch.device("mps")


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor inside (tuples, lists, dicts) moved to ``device``.

    Example:
        >>> import torch
        >>> from meshtorch.replicator.device import to_device
        >>> to_device({"x": (torch.ones(1), 2)}, torch.device("cpu"))
        {'x': (tensor([1.]), 2)}
    """
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x
