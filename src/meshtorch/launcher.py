"""Start meshtorch programs as one process per processor over ``torch.distributed``.

Three ways in, one process model (mesh rank = ``torch.distributed`` rank):

- ``meshtorch launch -n 4 --mesh b:2,m:2 --rules "batch:b; d_ff:m" train.py [args]``
  runs ``train.py`` on 4 local processes through ``torch.distributed.run``
  (torchrun's own machinery), so ``--nnodes/--node-rank/--rdzv-endpoint``
  work as with torchrun. The script needs no setup: ``mt.current()`` already
  has the mesh, rules and a ``torch`` communicator.
- ``torchrun --nproc-per-node 4 train.py`` where ``train.py`` calls
  :func:`init_distributed` (mesh from its argument or ``MESHTORCH_MESH``).
- ``mt.launch(fn, mesh=..., backend="torch")`` from Python: spawns the
  processes, returns ``fn``'s results in rank order, and re-raises the first
  failure as a ``ProcessorError`` naming the rank and coordinates, after
  terminating the other processes.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.launcher import in_torchrun
    >>> in_torchrun()
    False
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import pickle
import queue as queue_mod
import runpy
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from meshtorch.context import ProcessorContext, current, set_process_context
from meshtorch.errors import CommError, MeshError, MeshTorchError, ProcessorError
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

ENV_MESH, ENV_RULES, ENV_CHECK, ENV_TIMEOUT = (
    "MESHTORCH_MESH", "MESHTORCH_RULES", "MESHTORCH_CHECK", "MESHTORCH_TIMEOUT")
DEFAULT_TIMEOUT = 300.0
# after the first failure, how long to wait for the other processes' reports
# (to tell a root cause from the CommErrors it provokes) before terminating them
FAILURE_GRACE_S = 2.0
# joining the world waits for the slowest process to start (importing torch on a busy
# machine takes seconds), so it never uses a collective timeout shorter than this
RENDEZVOUS_MIN_S = 120.0


def in_torchrun() -> bool:
    """Whether this process was started by torchrun / ``torch.distributed.run``
    (or another launcher that sets ``RANK`` and ``WORLD_SIZE``)."""
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
) -> ProcessorContext:
    """Join the ``torch.distributed`` world and make a ``torch`` communicator this
    process's default context. Arguments left ``None`` come from the environment
    (``MESHTORCH_MESH/RULES/CHECK/TIMEOUT``, and torchrun's ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    The mesh size is checked against the world size before any communication.

    Example (inside a script started by ``torchrun --nproc-per-node 2``):
        >>> from meshtorch.launcher import init_distributed
        >>> ctx = init_distributed("b:2", "batch:b")  # doctest: +SKIP
        >>> ctx.mesh.size  # doctest: +SKIP
        2
    """
    import torch.distributed as dist

    from meshtorch.comm.torch import TorchCommunicator

    mesh = mesh if mesh is not None else os.environ.get(ENV_MESH)
    if mesh is None:
        raise MeshError(
            f"no mesh given: pass init_distributed(mesh='b:2,m:2') or set {ENV_MESH}, "
            "e.g. via `meshtorch launch --mesh b:2,m:2`")
    mesh = Mesh(mesh)
    rules = LayoutRules(rules if rules is not None else os.environ.get(ENV_RULES, ""))
    rules.check(mesh)
    check = check if check is not None else os.environ.get(ENV_CHECK, "0") not in ("", "0", "false")
    timeout = float(timeout if timeout is not None else os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT))
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if mesh.size != world:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but {world} processes were started; "
            f"start {mesh.size} processes (e.g. `meshtorch launch -n {mesh.size}`) or use a mesh of "
            f"{world} processors")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S))}
        if store is not None:
            kw.update(store=store, rank=rank, world_size=world)
        dist.init_process_group(backend, **kw)
        # gloo aborts the interpreter ("terminate called without an active exception") if its
        # group is still alive at exit; whoever creates the group tears it down
        atexit.register(shutdown)
    ctx = ProcessorContext(TorchCommunicator(mesh, check=check, timeout=timeout), rules)
    set_process_context(ctx)
    return ctx


def shutdown() -> None:
    """Leave the ``torch.distributed`` world (safe to call when not in one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------ mt.launch(backend="torch")
class RemoteTraceback(MeshTorchError):
    """The formatted traceback of an exception raised in another process."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def launch_processes(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
                     timeout: float, check: bool, nprocs: int | None = None) -> list[Any]:
    """``mt.launch`` for ``backend="torch"``; see :func:`meshtorch.launch`.

    Under torchrun (``nprocs`` not given) ``fn`` runs in this process as its
    rank and the results of all ranks are gathered; otherwise ``nprocs``
    (default: the mesh size) fresh processes are spawned.
    """
    if nprocs is None and in_torchrun():
        return _run_in_world(fn, args, kwargs, mesh, rules, timeout, check)
    nprocs = mesh.size if nprocs is None else nprocs
    if nprocs != mesh.size:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but nprocs={nprocs}; pass nprocs={mesh.size} "
            f"or a mesh of {nprocs} processors")
    try:
        payload = pickle.dumps((fn, args, kwargs, str(mesh), str(rules), timeout, check))
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing
        raise ProcessorError(
            f"mt.launch(backend='torch') runs {getattr(fn, '__qualname__', fn)!r} in fresh processes, "
            f"so it and its arguments must be picklable: define the function at module level "
            f"({type(e).__name__}: {e})") from e
    return _spawn(payload, mesh, nprocs, timeout)


def _run_in_world(fn, args, kwargs, mesh, rules, timeout, check) -> list[Any]:
    import torch.distributed as dist

    ctx = current()
    if ctx.comm.backend != "torch" or ctx.mesh != mesh:
        ctx = init_distributed(mesh, rules, check=check, timeout=timeout)
    else:
        ctx.rules = rules
    try:
        out = fn(*args, **kwargs)
    except BaseException as e:
        coords = mesh.coords(ctx.rank)
        raise ProcessorError(f"processor {ctx.rank} {coords} raised {type(e).__name__}: {e}",
                             ctx.rank, coords) from e
    results: list[Any] = [None] * mesh.size
    dist.all_gather_object(results, out)
    return results


def _child(rank: int, world: int, host: str, port: int, payload: bytes, q) -> None:
    """Body of one spawned processor: join the world, run, report to the parent."""
    try:
        import torch.distributed as dist

        fn, args, kwargs, mesh, rules, timeout, check = pickle.loads(payload)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world))
        store = dist.TCPStore(host, port, None, False,
                              timeout=datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S)))
        init_distributed(mesh, rules, check=check, timeout=timeout, store=store, rank=rank,
                         world_size=world)
        out = fn(*args, **kwargs)
        q.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(e)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
            blob = None
        q.put((rank, "err", (blob, type(e).__name__, str(e), tb)))
    finally:
        shutdown()


def _spawn(payload: bytes, mesh: Mesh, nprocs: int, timeout: float) -> list[Any]:
    import multiprocessing as mp

    import torch.distributed as dist

    # the parent holds the rendezvous store: port 0 lets the OS pick a free port, no races
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S)))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, nprocs, "127.0.0.1", store.port, payload, q),
                         name=f"meshtorch-{r}", daemon=True) for r in range(nprocs)]
    results: dict[int, Any] = {}
    errors: dict[int, tuple] = {}
    order: list[int] = []
    first_error_at: float | None = None
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < nprocs:
            if first_error_at is not None and time.monotonic() - first_error_at > FAILURE_GRACE_S:
                break
            try:
                rank, status, body = q.get(timeout=0.1)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results and r not in errors]
                if dead:
                    try:  # a report may still be in the pipe
                        rank, status, body = q.get(timeout=1.0)
                    except queue_mod.Empty:
                        for r in dead:
                            errors[r] = (None, "ProcessExit", f"exited with code {procs[r].exitcode} "
                                         "without reporting a result", "")
                            order.append(r)
                        first_error_at = first_error_at or time.monotonic()
                        continue
                else:
                    continue
            if status == "ok":
                results[rank] = body
            else:
                errors[rank] = body
                order.append(rank)
                first_error_at = first_error_at or time.monotonic()
    finally:
        _terminate(procs)
        q.close()
    if errors:
        _raise_root(errors, order, mesh)
    return [pickle.loads(results[r]) for r in range(nprocs)]


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _raise_root(errors: dict, order: list[int], mesh: Mesh) -> None:
    def is_comm(r):
        return errors[r][1] == "CommError"

    # the root cause is the first failure that is not another processor's abandonment
    rank = ([r for r in order if not is_comm(r)] or order)[0]
    blob, tname, msg, tb = errors[rank]
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        exc = CommError(msg) if tname == "CommError" else MeshTorchError(f"{tname}: {msg}")
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    coords = mesh.coords(rank)
    raise ProcessorError(f"processor {rank} {coords} raised {tname}: {msg}", rank, coords) from exc


# ------------------------------------------------------------ `meshtorch launch`
_BOOTSTRAP = "from meshtorch.launcher import _bootstrap; _bootstrap()"


def _bootstrap() -> None:
    """Entry of each worker started by ``meshtorch launch``: init, then run the script."""
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    ctx = init_distributed()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    except BaseException as e:
        print(f"meshtorch: processor {ctx.rank} {ctx.coords} raised {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        raise
    finally:
        shutdown()


def _run_script_threads(script: str) -> None:
    runpy.run_path(script, run_name="__main__")


def register(subparsers) -> None:
    """Add the ``launch`` sub-command."""
    p = subparsers.add_parser(
        "launch", help="run a script on every processor of a mesh",
        description="Run SCRIPT once per processor. With --backend torch (default) this goes through "
                    "torch.distributed.run, so torchrun's multi-node options work unchanged.")
    p.add_argument("-n", "--nproc-per-node", type=int, default=None,
                   help="processes on this node (default: mesh size / nnodes)")
    p.add_argument("--mesh", required=True, help="mesh spec, e.g. b:2,m:2")
    p.add_argument("--rules", default="", help='layout rules, e.g. "batch:b; d_ff:m"')
    p.add_argument("--backend", choices=("torch", "threads"), default="torch")
    p.add_argument("--check", action="store_true", help="compare every collective across its group")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="collective timeout, seconds")
    p.add_argument("--nnodes", default="1", help="as torchrun: N or MIN:MAX")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    p.add_argument("--rdzv-backend", default=None)
    p.add_argument("--rdzv-id", default=None)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", default=None)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cli_launch)


def _torchrun_argv(a: argparse.Namespace, mesh: Mesh) -> list[str]:
    nnodes = a.nnodes
    fixed = nnodes.isdigit()
    n = a.nproc_per_node
    if n is None:
        if not fixed or mesh.size % int(nnodes):
            raise MeshError(f"cannot infer -n from mesh '{mesh}' and --nnodes {nnodes}; pass -n")
        n = mesh.size // int(nnodes)
    if fixed and n * int(nnodes) != mesh.size:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but -n {n} x --nnodes {nnodes} starts "
            f"{n * int(nnodes)} processes; make them equal")
    argv = ["--nnodes", nnodes, "--nproc-per-node", str(n), "--max-restarts", "0"]
    multi = a.rdzv_endpoint or a.master_addr or not fixed or int(nnodes) > 1
    if not multi:
        argv.append("--standalone")
    for flag, value in (("--node-rank", a.node_rank), ("--rdzv-endpoint", a.rdzv_endpoint),
                        ("--rdzv-backend", a.rdzv_backend), ("--rdzv-id", a.rdzv_id),
                        ("--master-addr", a.master_addr), ("--master-port", a.master_port)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + ["--no-python", sys.executable, "-c", _BOOTSTRAP, a.script, *a.script_args]


def _cli_launch(a: argparse.Namespace) -> int:
    mesh = Mesh(a.mesh)
    rules = LayoutRules(a.rules)
    rules.check(mesh)
    if not os.path.exists(a.script):
        raise MeshTorchError(f"script {a.script!r} does not exist")
    if a.backend == "threads":
        from meshtorch.launch import launch

        sys.argv = [a.script, *a.script_args]
        launch(_run_script_threads, a.script, mesh=mesh, rules=rules, timeout=a.timeout, check=a.check)
        return 0
    argv = _torchrun_argv(a, mesh)
    os.environ.update({ENV_MESH: str(mesh), ENV_RULES: str(rules), ENV_CHECK: "1" if a.check else "0",
                       ENV_TIMEOUT: str(a.timeout)})
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0
