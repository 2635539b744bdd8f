"""``meshtorch launch``: run a script once per processor of a mesh.

With ``--backend threads`` (the default, as for ``meshtorch train`` and
``mt.launch``) the processors are threads of this process. With ``--backend
torch`` each is a process started through ``torch.distributed.run``
(torchrun's own machinery), so torchrun's multi-node options work unchanged.
Either way the script needs no setup code: ``mt.current()`` already has the
mesh, the rules and a communicator when it runs.

Example:
    $ meshtorch launch --mesh b:2,m:2 --rules "batch:b; d_ff:m" train.py --lr 1e-3
    $ meshtorch launch --backend torch -n 4 --mesh b:2,m:2 train.py
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from meshtorch.errors import MeshError, MeshTorchError
from meshtorch.launch.threads import run_threads
from meshtorch.launch.world import (
    DEFAULT_TIMEOUT,
    ENV_CHECK,
    ENV_MESH,
    ENV_RULES,
    ENV_TIMEOUT,
    init_distributed,
    shutdown,
)
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

_BOOTSTRAP = "from meshtorch.launch.cli import bootstrap; bootstrap()"
# torchrun options that only mean something when processes are started
_MULTI_NODE = ("node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "master_addr", "master_port")

BACKEND_HELP = (
    "threads (default, as for `meshtorch train` and mt.launch): every processor a thread of this "
    "process; nothing to set up and any script runs, hence the default for development, tests and "
    "one process driving several GPUs. "
    "torch: one process per processor over torch.distributed, started through torchrun's machinery "
    "(gloo on CPU, NCCL on GPU, multi-node): for real runs")


def _run_script(script: str) -> None:
    """One processor's run of ``script`` as ``__main__``; ``sys.exit(0)`` is a normal end."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


def bootstrap() -> None:
    """Entry of each worker process ``meshtorch launch --backend torch`` starts:
    join the world, then run the script as ``__main__``.

    Example (what torchrun runs in each worker):
        $ python -c "from meshtorch.launch.cli import bootstrap; bootstrap()" train.py --lr 1e-3
    """
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    ctx = init_distributed()
    try:
        _run_script(script)
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
        >>> from meshtorch.launch.cli import register
        >>> sub = argparse.ArgumentParser(prog="meshtorch").add_subparsers()
        >>> register(sub)
        >>> sub.choices["launch"].parse_args(["--mesh", "b:2", "run.py"]).backend
        'threads'
    """
    p = subparsers.add_parser(
        "launch", help="run a script on every processor of a mesh",
        description="Run SCRIPT once per processor of --mesh. The threads backend (default) runs the "
                    "processors as threads of this process; --backend torch starts one process each "
                    "through torch.distributed.run, so torchrun's multi-node options work unchanged.")
    p.add_argument("-n", "--nproc-per-node", type=int, default=None,
                   help="processors on this node (default: mesh size / nnodes)")
    p.add_argument("--mesh", required=True, help="mesh spec, e.g. b:2,m:2")
    p.add_argument("--rules", default="", help='layout rules, e.g. "batch:b; d_ff:m"')
    p.add_argument("--backend", choices=("threads", "torch"), default="threads", help=BACKEND_HELP)
    p.add_argument("--check", action="store_true", help="compare every collective across its group")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="collective timeout, seconds")
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


def _processes_per_node(a: argparse.Namespace, mesh: Mesh) -> int:
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
            f"{n * int(nnodes)} processors; make them equal")
    return n


def _torchrun_argv(a: argparse.Namespace, n: int) -> list[str]:
    nnodes = a.nnodes
    argv = ["--nnodes", nnodes, "--nproc-per-node", str(n), "--max-restarts", "0"]
    multi = a.rdzv_endpoint or a.master_addr or not nnodes.isdigit() or int(nnodes) > 1
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
    n = _processes_per_node(a, mesh)
    if a.backend == "threads":
        given = [f"--{f.replace('_', '-')}" for f in _MULTI_NODE if getattr(a, f) is not None]
        if given or a.nnodes != "1":
            raise MeshError(f"{', '.join(given) or '--nnodes'} starts processes on several nodes; "
                            "add --backend torch")
        sys.argv = [a.script, *a.script_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))  # as python script.py does
        run_threads(_run_script, (a.script,), {}, mesh, rules, a.timeout, a.check)
        return 0
    os.environ.update({ENV_MESH: str(mesh), ENV_RULES: str(rules), ENV_CHECK: "1" if a.check else "0",
                       ENV_TIMEOUT: str(a.timeout)})
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(_torchrun_argv(a, n))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0
