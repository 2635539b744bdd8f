"""Which device a processor computes on, and running its program there.

``"auto"`` picks CUDA, then MPS, then the CPU. On CUDA each processor gets one
GPU, its *local* index: its rank on the threads backend (one process drives
every GPU, one thread each) and ``LOCAL_RANK`` on the torch backend (one
process per GPU, as torchrun numbers them). The threads backend never puts
two processors on one GPU: CUDA runs backward on one autograd thread per
device, so two processors' blocking collectives inside backward would wait
for each other on that thread for ever.

Example:
    >>> from meshtorch.comm.device import resolve_device
    >>> from meshtorch.comm.base import LocalCommunicator
    >>> resolve_device("cpu", LocalCommunicator())
    device(type='cpu')
"""

from __future__ import annotations

import os

import torch

from meshtorch.comm.base import Communicator
from meshtorch.errors import MeshError

DEVICES = ("auto", "cpu", "cuda", "mps")


def mps_available() -> bool:
    """Whether torch can use Apple's MPS device here."""
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _local_index(comm: Communicator) -> int:
    if comm.backend == "threads" or comm.mesh.size == 1:
        return comm.rank
    return int(os.environ.get("LOCAL_RANK", comm.rank))


def parse_device(spec: str | torch.device) -> tuple[str, int | None]:
    """``(kind, index)`` of a device spec (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``,
    ``"mps"`` or a ``torch.device``), or :class:`~meshtorch.errors.MeshError` naming the choices.

    Example:
        >>> from meshtorch.comm.device import parse_device
        >>> parse_device("cuda:1"), parse_device("auto")
        (('cuda', 1), ('auto', None))
    """
    if isinstance(spec, torch.device):
        if spec.type not in DEVICES:
            raise MeshError(f"device {spec!r} is not one of {DEVICES} or a torch.device of those kinds")
        return spec.type, spec.index
    if not isinstance(spec, str):
        raise MeshError(f"device {spec!r} is not one of {DEVICES} or a torch.device")
    kind, _, idx = spec.partition(":")
    if kind not in DEVICES or (idx and not idx.isdigit()) or (idx and kind == "auto"):
        raise MeshError(f"device {spec!r} is not one of {DEVICES} (or e.g. 'cuda:1')")
    return kind, int(idx) if idx else None


def auto_device(processors_here: int) -> str:
    """What ``"auto"`` means for a program of ``processors_here`` processors on this
    machine: ``"cuda"`` when there is a CUDA GPU for each of them, otherwise ``"cpu"``.

    Example:
        >>> from meshtorch.comm.device import auto_device
        >>> auto_device(1) in ("cpu", "cuda")
        True
    """
    ok = torch.cuda.is_available() and torch.cuda.device_count() >= processors_here
    return "cuda" if ok else "cpu"


def threads_device(spec: str | torch.device | None, processors: int) -> str | torch.device:
    """The device spec the threads backend gives its ``processors`` thread-processors:
    ``None`` is the CPU (a launch never moves to a GPU unasked), ``"auto"`` is
    :func:`auto_device`'s choice; the spec is checked here, before any thread starts.

    Example:
        >>> from meshtorch.comm.device import threads_device
        >>> threads_device(None, 4), threads_device("cpu", 4)
        ('cpu', 'cpu')
    """
    if spec is None:
        return "cpu"
    kind, _ = parse_device(spec)
    return auto_device(processors) if kind == "auto" else spec


def resolve_device(spec: str | torch.device, comm: Communicator) -> torch.device:
    """The ``torch.device`` the processor of ``comm`` computes on.

    ``"cuda"`` gives the processor the GPU of its local index and makes it the
    calling thread's current CUDA device (NCCL and the CUDA caching allocator
    use it); an explicit ``"cuda:1"`` pins every processor of this process there.

    Raises:
        MeshError: the device kind is unknown or unavailable, or the threads
            backend would put two processors on one accelerator.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.comm.device import resolve_device
        >>> mt.launch(lambda: str(resolve_device("cpu", mt.current().comm)), mesh="b:2")
        ['cpu', 'cpu']
    """
    kind, index = parse_device(spec)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    threads = comm.backend == "threads"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise MeshError(f"device {spec!r} asked for, but torch sees no CUDA GPU; use device='auto' "
                            "or 'cpu'")
        count = torch.cuda.device_count()
        if index is None:
            if threads and comm.mesh.size > count:
                raise MeshError(
                    f"{comm.mesh.size} thread processors but {count} CUDA GPUs: the threads backend "
                    f"puts one processor on each GPU; use a mesh of at most {count} processors, "
                    "device='cpu', or the torch backend")
            index = _local_index(comm) % count
        elif index >= count:
            raise MeshError(f"device {spec!r}: torch sees {count} CUDA GPUs (cuda:0..cuda:{count - 1})")
        elif threads and comm.mesh.size > 1:
            raise MeshError(
                f"device {spec!r} would put all {comm.mesh.size} thread processors on one GPU; use "
                "device='cuda' (one GPU per processor) or a mesh of 1 processor")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if not mps_available():
        raise MeshError("device 'mps' asked for, but torch.backends.mps is not available")
    if threads and comm.mesh.size > 1:
        raise MeshError(f"{comm.mesh.size} thread processors cannot share the one MPS device; "
                        "use a mesh of 1 processor")
    return torch.device("mps")

