"""``meshtorch train --backend torch --max-restarts N``: a run that survives a failed worker.

The command's process holds ``--out`` (its lock and the earlier-run check, once for every start)
and runs torchrun's elastic agent (:func:`meshtorch.launcher.elastic.run_elastic`), which starts
one worker process per processor, each running
:func:`meshtorch.recipes.lm.trainer.restarting_worker`. When a worker fails (an exception,
an exit, ``kill -9``), the agent stops the others and starts them all again, up to N times; a
restarted worker continues the run from the newest checkpoint in ``--out`` (:func:`continued`), so
the run ends at ``--steps`` with the weights an uninterrupted run would have (the resume is
bitwise). Each restart is a ``metrics.jsonl`` record (``{"step": S, "event": "restart",
"restart": K}``: start K continued from the checkpoint of step S) and ``summary.json`` holds
``restarts`` and ``restarted_at_steps``.

Example:
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.restarts import continued
    >>> import tempfile
    >>> continued(TrainConfig.of(out="x"), tempfile.mkdtemp()).run.resume is None  # no checkpoint yet
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from typing import Any

from meshtorch.errors import TrainingError
from meshtorch.launcher.elastic import restart_count
from meshtorch.launcher.lifeline import ENV_LAUNCHER_PID
from meshtorch.recipes.lm.config import TrainConfig
from meshtorch.recipes.lm.guards import LOCK, RunDirLock

# each worker process runs meshtorch.recipes.lm.trainer.restarting_worker (named, not imported: the
# trainer imports this module)
_WORKER = "from meshtorch.recipes.lm.trainer import restarting_worker; restarting_worker()"
# a test's fault: "RANK:STEP" kills processor RANK with SIGKILL once it has trained to STEP, in the first
# start only (what a crash of one worker mid-run looks like to the others and to the agent)
ENV_TEST_KILL = "MESHTORCH_TEST_KILL_AT"


def train_restarting(cfg: TrainConfig, out: str, processors: int) -> dict[str, Any]:
    """Run ``cfg`` (its ``--out`` is ``out``) on ``processors`` worker processes on this node through
    torchrun's elastic agent, restarting them up to ``--max-restarts`` times; with ``--nnodes N`` they
    are this node's part of the mesh (:mod:`meshtorch.recipes.lm.nodes`). Return processor 0's summary
    (on a node other than node 0: ``out``, ``node_rank`` and ``wall_s``; node 0 writes the run's files)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from meshtorch.launcher.elastic import Nodes, failure_text, run_elastic

    par = cfg.parallelism
    n = par.max_restarts
    nodes = Nodes() if par.nnodes == 1 else Nodes(
        nnodes=str(par.nnodes), node_rank=par.node_rank, master_addr=par.master_addr,
        master_port=str(par.master_port))
    t0 = time.time()
    # held here for every start by node 0 (processor 0's): a start's processor 0 finds it held by its
    # launcher and goes on; the options travel as an argument (no file to leave behind when a signal ends
    # this process)
    with RunDirLock(cfg, out) if par.node_rank == 0 else contextlib.nullcontext():
        try:
            options = json.dumps(cfg.replace(out=out).options())
            run_elastic([sys.executable, "-c", _WORKER, options], processors,
                        {ENV_LAUNCHER_PID: str(os.getpid())}, nodes, max_restarts=n, say="meshtorch train")
        except ChildFailedError as e:
            times = f"failed {n + 1} times (--max-restarts {n}); the last time" if n else "failed:"
            raise TrainingError(f"the run {times} {failure_text(e)}. {what_next(out)}") from None
    if par.node_rank:
        return {"out": out, "node_rank": par.node_rank, "wall_s": round(time.time() - t0, 1)}
    with open(os.path.join(out, "summary.json")) as f:
        result = json.load(f)
    result["wall_s"] = round(time.time() - t0, 1)
    return result


def what_next(out: str) -> str:
    """What to do with ``out`` after a run in it failed for good: continue from its newest checkpoint,
    or, with none, rerun in place, which needs ``--overwrite`` where the run left files of its own.

    Example:
        >>> import tempfile
        >>> what_next(tempfile.mkdtemp())
        'No checkpoint was written: fix the cause and rerun'
    """
    from meshtorch.recipes.lm.guards import RUN_FILES

    if os.path.isdir(os.path.join(out, "checkpoint")):
        return f"{out} holds the newest checkpoint: fix the cause and continue with --resume {out}"
    if any(os.path.lexists(os.path.join(out, f)) for f in RUN_FILES):
        return f"No checkpoint was written: fix the cause and rerun it in place with --out {out} --overwrite"
    return "No checkpoint was written: fix the cause and rerun"


def continued(cfg: TrainConfig, out: str) -> TrainConfig:
    """``cfg`` for a restarted start of its run in ``out``: continue from ``out``'s newest checkpoint
    where there is one (the launcher claimed ``out`` for this run before the first start, so any
    checkpoint there is this run's, or the one it resumed in place), else start as the first start did."""
    from meshtorch.checkpoint.index import read_index

    try:
        read_index(os.path.join(out, "checkpoint"))
    except Exception:  # noqa: BLE001 - no (readable) checkpoint yet: the first start's options
        return cfg
    return cfg.replace(resume=out, out=out, overwrite=False)


def launcher_holds(out: str) -> bool:
    """Whether ``out`` is held (:class:`RunDirLock`) by the ``meshtorch train`` process that started this
    worker: this process's parent, named in ``MESHTORCH_LAUNCHER_PID`` and in the lock file, and the lock
    taken. An environment variable alone never skips the lock."""
    pid = os.environ.get(ENV_LAUNCHER_PID, "")
    if not pid.isdigit() or int(pid) != os.getppid():
        return False
    try:
        fd = os.open(os.path.join(out, LOCK), os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.read(fd, 64).decode(errors="replace").strip() != pid:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True  # held, by the parent the file names
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def maybe_crash(step: int, rank: int) -> None:
    """Kill this process with SIGKILL if the test fault :data:`ENV_TEST_KILL` names this processor and a
    step it has reached, in the first start only."""
    spec = os.environ.get(ENV_TEST_KILL)
    if not spec or restart_count():
        return
    who, _, when = spec.partition(":")
    if who.isdigit() and when.isdigit() and int(who) == rank and step >= int(when):
        os.kill(os.getpid(), signal.SIGKILL)


def restart_record(start: int) -> dict[str, Any] | None:
    """The ``metrics.jsonl`` record of this start if it is a restart (it continues from step ``start``)."""
    k = restart_count()
    return {"step": start, "event": "restart", "restart": k} if k else None

