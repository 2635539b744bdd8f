"""Joining the ``torch.distributed`` world: one process per processor, mesh rank = world rank.

The environment says who is who when torchrun (or ``meshtorch launch
--backend torch``) started this process: torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, and meshtorch's ``MESHTORCH_MESH``,
``MESHTORCH_RULES``, ``MESHTORCH_CHECK``, ``MESHTORCH_TIMEOUT``, ``MESHTORCH_DEVICE``.

Example:
    >>> from meshtorch.launcher.world import in_torchrun
    >>> in_torchrun()
    False
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch

from meshtorch.comm.base import check_timeout
from meshtorch.comm.device import auto_device, parse_device
from meshtorch.context import ProcessorContext, set_process_context
from meshtorch.errors import ArgumentError, CommError, MeshError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

ENV_MESH, ENV_RULES, ENV_CHECK, ENV_TIMEOUT, ENV_DEVICE = (
    "MESHTORCH_MESH", "MESHTORCH_RULES", "MESHTORCH_CHECK", "MESHTORCH_TIMEOUT", "MESHTORCH_DEVICE")
DEFAULT_TIMEOUT = 300.0
# joining the world waits for the slowest process to start (importing torch on a busy
# machine takes seconds), so it never uses a collective timeout shorter than this
RENDEZVOUS_MIN_S = 120.0


def threads_per_processor(processors: int) -> int:
    """Each of ``processors`` processors' share of this machine's cores (at least one), so that they
    do not oversubscribe them: the intra-op threads it runs where the user chose none
    (:func:`threads_for`).

    Example:
        >>> threads_per_processor(1) == (os.cpu_count() or 1), threads_per_processor(10**6)
        (True, 1)
    """
    return max(1, (os.cpu_count() or 1) // processors)


def threads_for(processors: int) -> int:
    """The intra-op threads each of ``processors`` processors on this machine runs: the user's
    ``OMP_NUM_THREADS`` where it is a number of threads (:func:`threads_chosen`), else its share of
    the cores (:func:`threads_per_processor`): a process's threads, where each processor is a
    process. The processes launcher sets it, and torchrun's workers get it as ``OMP_NUM_THREADS``
    (:func:`meshtorch.launcher.elastic.thread_environment`); processors sharing one process (the
    threads backend) split it (:func:`threads_sharing_process`).

    Example:
        >>> import os
        >>> before = os.environ.pop("OMP_NUM_THREADS", None)
        >>> threads_for(2) == threads_per_processor(2)
        True
        >>> os.environ["OMP_NUM_THREADS"] = "3"
        >>> threads_for(2)
        3
        >>> os.environ["OMP_NUM_THREADS"] = "0"  # not a number of threads: the share
        >>> threads_for(2) == threads_per_processor(2)
        True
        >>> del os.environ["OMP_NUM_THREADS"]
        >>> os.environ.update({} if before is None else {"OMP_NUM_THREADS": before})
    """
    return threads_chosen() or threads_per_processor(processors)


def threads_sharing_process(processors: int) -> int:
    """The intra-op threads each of ``processors`` processors that share this process (the threads
    backend) runs: the process's threads, the user's ``OMP_NUM_THREADS`` (a process's threads, as
    OpenMP reads it) else all the cores, split among them, at least one each. A job scheduler that
    sets ``OMP_NUM_THREADS`` to the cores would otherwise get that many per processor.

    Example:
        >>> import os
        >>> before = os.environ.pop("OMP_NUM_THREADS", None)
        >>> threads_sharing_process(2) == threads_per_processor(2)
        True
        >>> os.environ["OMP_NUM_THREADS"] = "8"
        >>> threads_sharing_process(2), threads_sharing_process(16)
        (4, 1)
        >>> del os.environ["OMP_NUM_THREADS"]
        >>> os.environ.update({} if before is None else {"OMP_NUM_THREADS": before})
    """
    return max(1, threads_for(1) // processors)


def threads_chosen() -> int | None:
    """The intra-op threads the user chose for each process with ``OMP_NUM_THREADS`` (its first
    level, as OpenMP reads ``4,2``), or ``None`` where it is unset or not a positive whole number
    (``""``, ``"0"``, ``"abc"``, ``"\u00b2"``). A launcher gives its processes
    :func:`threads_per_processor` only where the user chose none (:func:`threads_for`).

    Example:
        >>> import os
        >>> before = os.environ.pop("OMP_NUM_THREADS", None)
        >>> os.environ["OMP_NUM_THREADS"] = "3"
        >>> threads_chosen()
        3
        >>> os.environ["OMP_NUM_THREADS"] = "many"
        >>> threads_chosen() is None
        True
        >>> os.environ["OMP_NUM_THREADS"] = "\u00b2"  # a superscript two: not a number of threads
        >>> threads_chosen() is None
        True
        >>> del os.environ["OMP_NUM_THREADS"]
        >>> os.environ.update({} if before is None else {"OMP_NUM_THREADS": before})
    """
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    # (isascii: str.isdigit also takes superscripts and other scripts' digits, which int() refuses)
    return int(value) if value.isascii() and value.isdigit() and int(value) > 0 else None


def in_torchrun() -> bool:
    """Whether this process was started by torchrun / ``torch.distributed.run``
    (or another launcher that sets ``RANK`` and ``WORLD_SIZE``).

    Example:
        >>> from meshtorch.launcher.world import in_torchrun
        >>> isinstance(in_torchrun(), bool)
        True
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_distributed(
    mesh: Mesh | str | dict | None = None,
    rules: LayoutRules | str | dict | None = None,
    *,
    check: bool | None = None,
    timeout: float | None = None,
    backend: str | None = None,
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    device: str | torch.device | None = None,
) -> ProcessorContext:
    """Join the ``torch.distributed`` world and make a ``torch`` communicator this
    process's default context. Arguments left ``None`` come from the environment
    (``MESHTORCH_MESH/RULES/CHECK/TIMEOUT``, and torchrun's ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    The mesh size is checked against the world size before any communication.
    ``device`` is where this process computes: ``"cuda"`` (NCCL, GPU ``LOCAL_RANK``),
    ``"cpu"`` (gloo) or ``"auto"`` (``MESHTORCH_DEVICE``, default ``"auto"``: CUDA when
    this machine has a GPU for each of its processes). meshtorch's factories put their
    tensors on ``ctx.device``; no device mode wraps the program (plain torch factories
    take ``device=mt.current().device``).

    Example (inside a script started by ``torchrun --nproc-per-node 2``):
        >>> import meshtorch as mt
        >>> ctx = mt.init_distributed("b:2", "batch:b")  # doctest: +SKIP
        >>> ctx.mesh.size  # doctest: +SKIP
        2
    """
    import torch.distributed as dist

    from meshtorch.comm.torch import TorchCommunicator, peer_left

    mesh = mesh if mesh is not None else os.environ.get(ENV_MESH)
    if mesh is None:
        raise MeshError(
            f"no mesh given: pass init_distributed(mesh='b:2,m:2') or set {ENV_MESH}, "
            "e.g. via `meshtorch launch --backend torch --mesh b:2,m:2`")
    mesh = Mesh(mesh)
    rules = LayoutRules(rules if rules is not None else os.environ.get(ENV_RULES, ""))
    rules.check(mesh)
    check = check if check is not None else os.environ.get(ENV_CHECK, "0") not in ("", "0", "false")
    if timeout is None:
        text = os.environ.get(ENV_TIMEOUT, str(DEFAULT_TIMEOUT))
        try:
            timeout = check_timeout(float(text), ENV_TIMEOUT)
        except ValueError as e:  # also ArgumentError: name the variable and its text
            raise ArgumentError(f"{ENV_TIMEOUT}={text!r} must be a positive, finite number of seconds, "
                                f"e.g. {ENV_TIMEOUT}=60") from e
    else:
        timeout = check_timeout(timeout)
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if mesh.size != world:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but {world} processes were started; "
            f"start {mesh.size} processes (e.g. `meshtorch launch --backend torch -n {mesh.size}`) "
            f"or use a mesh of {world} processors")
    spec = device if device is not None else os.environ.get(ENV_DEVICE, "auto")
    kind, index = parse_device(spec)
    if kind == "auto":
        # gloo asked for by name keeps the program on the CPU, as it always did
        kind = "cpu" if backend == "gloo" else auto_device(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if kind not in ("cpu", "cuda"):
        raise MeshError(f"device {spec!r}: the torch backend runs on 'cpu' (gloo) or 'cuda' (NCCL)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise MeshError(f"device {spec!r} asked for, but torch sees no CUDA GPU; use device='auto' or 'cpu'")
    local = int(os.environ.get("LOCAL_RANK", 0)) if index is None else index
    here = torch.device("cuda", local) if kind == "cuda" else torch.device("cpu")
    if not dist.is_initialized():
        backend = backend or ("nccl" if kind == "cuda" else "gloo")
        if kind == "cuda":
            torch.cuda.set_device(local)
        wait = datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S))
        kw: dict[str, Any] = {"timeout": wait}
        if store is None and rank is None:
            store, rank = _agent_store(wait)
        if store is not None:
            kw.update(store=store, rank=rank, world_size=world)
        try:
            dist.init_process_group(backend, **kw)
        except RuntimeError as e:  # gloo: "Connection closed by peer" when a peer left while connecting
            if peer_left(e):
                raise CommError(f"joining the world of {world} processes failed because a processor "
                                f"exited or crashed while it was connecting ({str(e).strip()})") from e
            raise
        # gloo aborts the interpreter ("terminate called without an active exception") if its
        # group is still alive at exit; whoever creates the group tears it down
        atexit.register(shutdown)
    elif device is None and ENV_DEVICE not in os.environ:
        here = None  # a world someone else made: the communicator follows its backend
    ctx = ProcessorContext(TorchCommunicator(mesh, check=check, timeout=timeout, device=here), rules)
    set_process_context(ctx)
    return ctx


def _agent_store(timeout: datetime.timedelta) -> tuple[Any, int | None]:
    """Under torchrun's agent, when its workers share the agent's store (``TORCHELASTIC_USE_AGENT_STORE``),
    a client of that store under a prefix of this start (``TORCHELASTIC_RESTART_COUNT``), and this
    process's rank; else ``(None, None)`` (``init_process_group`` reads the environment itself). A static
    rendezvous keeps one store for every restart of the workers: without the prefix the processes of a
    restart would read the keys of the start before (rank 0's address, now gone) and fail to connect."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None, None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/meshtorch/start_{start}", client), int(os.environ["RANK"])


def shutdown() -> None:
    """Leave the ``torch.distributed`` world (safe to call when not in one), once every
    point-to-point send of this process has been delivered: gloo aborts the interpreter
    ("terminate called without an active exception") when its process group is destroyed
    under a send still in flight. A send that fails now is its receiver's error to report.
    Every process group is destroyed here, its threads joined, none left to the interpreter's
    exit (:func:`~meshtorch.comm.torch.leave_groups`).

    Example:
        >>> from meshtorch.launcher.world import shutdown
        >>> shutdown()  # not in a world: nothing to leave
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from meshtorch.comm.torch import leave_groups, wait_all_sends

        try:
            wait_all_sends()
        except CommError:
            pass
        dist.destroy_process_group()
        # and the groups die now, not in the interpreter's exit, where a gloo worker thread that
        # frees a finished collective's tensors aborts the process (see leave_groups)
        leave_groups()
