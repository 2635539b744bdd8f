"""``meshtorch launch``: run a script once per processor of a mesh.

With ``--backend threads`` (the default, as for ``meshtorch train`` and
``mt.launch``) the processors are threads of this process. With ``--backend
torch`` each is a process: on one node they are spawned as by
``mt.launch(backend="torch")`` (rendezvous through a private file, no open
port; the first failure stops the others at once); across nodes they are
started through ``torch.distributed.run`` (torchrun's own machinery), so
torchrun's multi-node options work unchanged; so are they with ``--max-restarts N``
(torchrun's elastic agent starts every worker again when one fails,
:mod:`meshtorch.launcher.elastic`). Either way the script needs no
setup code: ``mt.current()`` already has the mesh, the rules and a
communicator when it runs, and the workers die with this launcher.

Example:
    $ meshtorch launch --mesh b:2,m:2 --rules "batch:b; d_ff:m" train.py --lr 1e-3
    $ meshtorch launch --backend torch -n 4 --mesh b:2,m:2 train.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import runpy
import sys
import traceback
from collections.abc import Iterator

from meshtorch.comm.base import check_timeout
from meshtorch.comm.device import threads_device
from meshtorch.errors import ArgumentError, MeshError, MeshTorchError, ProcessorError
from meshtorch.launcher.elastic import Nodes, check_max_restarts, run_elastic
from meshtorch.launcher.failures import RemoteTraceback
from meshtorch.launcher.lifeline import ENV_LAUNCHER_PID, die_with_launcher
from meshtorch.launcher.processes import launch_processes
from meshtorch.launcher.program import run_program
from meshtorch.launcher.threads import run_threads
from meshtorch.launcher.world import (
    DEFAULT_TIMEOUT,
    ENV_CHECK,
    ENV_DEVICE,
    ENV_MESH,
    ENV_RULES,
    ENV_TIMEOUT,
    init_distributed,
    shutdown,
)
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

_BOOTSTRAP = "from meshtorch.launcher.cli import bootstrap; bootstrap()"

BACKEND_HELP = (
    "threads (default, as for `meshtorch train` and mt.launch): every processor a thread of this "
    "process; nothing to set up and any script runs, hence the default for development, tests and "
    "one process driving several GPUs. "
    "torch: one process per processor over torch.distributed (gloo on CPU, NCCL on GPU), spawned on "
    "this node, or across nodes through torchrun's machinery; the processes die with this launcher: "
    "for real runs")


def _run_script(script: str, argv: list[str] | None = None) -> None:
    """One processor's run of ``script`` as ``__main__``; ``sys.exit(0)`` is a normal end.
    ``argv`` (the script's arguments) is set up first where this process has not done it."""
    if argv is not None:
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python script.py does
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


@contextlib.contextmanager
def _as_main_script(script: str, argv: list[str]) -> Iterator[None]:
    """This process set up as ``python script argv...`` for the block (the threads backend's
    processors all run ``script`` here), and restored after: ``sys.argv``, ``sys.path`` and
    ``sys.modules["__main__"]``. Each thread's ``runpy.run_path(run_name="__main__")`` swaps the
    ``__main__`` module and puts back what it found, so processors that overlap can leave a
    script's module as ``__main__``, and a later spawn would run the script in every child."""
    saved = sys.argv, list(sys.path), sys.modules.get("__main__")
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python script.py does
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        if saved[2] is not None:
            sys.modules["__main__"] = saved[2]


def bootstrap() -> None:
    """Entry of each worker process ``meshtorch launch --backend torch`` starts through torchrun
    (``--nnodes``, ``--max-restarts``): join the world, then run the script as ``__main__``, and
    wait for its background checkpoint save as :func:`mt.launch <meshtorch.launch>` does.

    Example (what torchrun runs in each worker):
        $ python -c "from meshtorch.launcher.cli import bootstrap; bootstrap()" train.py --lr 1e-3
    """
    die_with_launcher()
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    ctx = init_distributed()
    try:
        # as every launch runs a program: its background save committed (or its failure raised)
        # before the worker ends
        run_program(_run_script, (script,), {})
    except BaseException as e:
        print(f"meshtorch: processor {ctx.rank} {ctx.coords} raised {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        raise
    finally:
        shutdown()


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``launch`` sub-command.

    Example:
        >>> import argparse
        >>> from meshtorch.launcher.cli import register
        >>> sub = argparse.ArgumentParser(prog="meshtorch").add_subparsers()
        >>> register(sub)
        >>> sub.choices["launch"].parse_args(["--mesh", "b:2", "run.py"]).backend
        'threads'
    """
    p = subparsers.add_parser(
        "launch", help="run a script on every processor of a mesh",
        description="Run SCRIPT once per processor of --mesh. The threads backend (default) runs the "
                    "processors as threads of this process; --backend torch starts one process each, "
                    "across nodes through torch.distributed.run, so torchrun's multi-node options work "
                    "unchanged.")
    p.add_argument("-n", "--nproc-per-node", type=int, default=None,
                   help="processors on this node (default: mesh size / nnodes)")
    p.add_argument("--mesh", required=True, help="mesh spec, e.g. b:2,m:2")
    p.add_argument("--rules", default="", help='layout rules, e.g. "batch:b; d_ff:m"')
    p.add_argument("--backend", choices=("threads", "torch"), default="threads", help=BACKEND_HELP)
    p.add_argument("--device", default=None,
                   help="where each processor computes: cpu, cuda (one GPU per processor: processor i "
                        "on cuda:i of its node), auto (CUDA when there is a GPU for every processor "
                        "on the node, else CPU). Default: cpu with --backend threads, auto with torch")
    p.add_argument("--check", action="store_true", help="compare every collective across its group")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="collective timeout, seconds (> 0)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a worker fails, stop the others and start them all again, up to this many "
                        "times (torchrun's elastic agent; --backend torch); the script continues from its "
                        "own checkpoint, and TORCHELASTIC_RESTART_COUNT says which start it is (default: 0)")
    p.add_argument("--nnodes", default="1", help="as torchrun: N or MIN:MAX (--backend torch)")
    p.add_argument("--node-rank", type=int, default=None, help="as torchrun (--backend torch)")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="host:port of the rendezvous, multi-node (--backend torch)")
    p.add_argument("--rdzv-backend", default=None, help="as torchrun (--backend torch)")
    p.add_argument("--rdzv-id", default=None, help="as torchrun (--backend torch)")
    p.add_argument("--master-addr", default=None, help="as torchrun (--backend torch)")
    p.add_argument("--master-port", default=None, help="as torchrun (--backend torch)")
    p.add_argument("script", help="the Python script every processor runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to SCRIPT")
    p.set_defaults(func=_cli_launch)


def _nodes(a: argparse.Namespace) -> Nodes:
    """torchrun's node options as given to ``meshtorch launch``."""
    return Nodes(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Nodes)})


def _processes_per_node(a: argparse.Namespace, mesh: Mesh) -> int:
    lo, hi = _nodes(a).counts
    fixed = lo == hi
    n = a.nproc_per_node
    if n is not None and n < 1:
        raise ArgumentError(f"-n/--nproc-per-node {n}: a node runs at least 1 processor; pass e.g. -n 2")
    if n is None:
        if not fixed or mesh.size % lo:
            raise MeshError(f"cannot infer -n from mesh '{mesh}' and --nnodes {a.nnodes}; pass -n")
        n = mesh.size // lo
    if fixed and n * lo != mesh.size:
        raise MeshError(
            f"mesh '{mesh}' has {mesh.size} processors but -n {n} x --nnodes {a.nnodes} starts "
            f"{n * lo} processors; make them equal")
    return n


def _print_processor_traceback(e: ProcessorError) -> None:
    """The failing processor's traceback, before ``main`` prints the one-line error."""
    cause = e.__cause__
    remote = getattr(cause, "__cause__", None)
    if isinstance(remote, RemoteTraceback):
        print(str(remote).strip(), file=sys.stderr)
    elif cause is not None and cause.__traceback__ is not None:
        print("".join(traceback.format_exception(cause)).rstrip(), file=sys.stderr)


def _cli_launch(a: argparse.Namespace) -> int:
    mesh = Mesh(a.mesh)
    rules = LayoutRules(a.rules)
    rules.check(mesh)
    check_timeout(a.timeout, "--timeout")
    if not os.path.exists(a.script):
        raise MeshTorchError(f"script {a.script!r} does not exist")
    n = _processes_per_node(a, mesh)
    nodes = _nodes(a)
    restarts = check_max_restarts(a.max_restarts)
    if a.backend == "threads" and (nodes.multi_node or restarts):
        if restarts:
            raise ArgumentError(f"--max-restarts {restarts} restarts the worker processes when one fails; "
                                "the threads backend's processors are threads of this one process: add "
                                "--backend torch")
        raise MeshError(f"{', '.join(nodes.given) or '--nnodes'} starts processes on several nodes; "
                        "add --backend torch")
    if not nodes.multi_node and not restarts:
        try:
            if a.backend == "threads":
                device = threads_device(a.device, mesh.size)
                with _as_main_script(a.script, a.script_args):
                    run_threads(_run_script, (a.script,), {}, mesh, rules, a.timeout, a.check, device)
            else:
                launch_processes(_run_script, (a.script, list(a.script_args)), {}, mesh, rules,
                                 a.timeout, a.check, nprocs=n, device=a.device)
        except ProcessorError as e:
            _print_processor_traceback(e)
            raise
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    env = {ENV_MESH: str(mesh), ENV_RULES: str(rules), ENV_CHECK: "1" if a.check else "0",
           ENV_TIMEOUT: str(a.timeout), ENV_LAUNCHER_PID: str(os.getpid()),
           ENV_DEVICE: a.device or "auto"}
    try:
        run_elastic([sys.executable, "-c", _BOOTSTRAP, a.script, *a.script_args], n, env, nodes, restarts)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0
