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
import json
import os
import re
import signal
import sys
import time
import traceback
from typing import Any

from meshtorch.errors import CommError, MeshTorchError, ProcessorError, TrainingError
from meshtorch.launcher.elastic import restart_count
from meshtorch.launcher.lifeline import ENV_LAUNCHER_PID
from meshtorch.recipes.lm.config import TrainConfig
from meshtorch.recipes.lm.guards import RunDirLock, lock_holder

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


def _newest_checkpoint(out: str) -> dict[str, Any] | None:
    """The index of the newest checkpoint in ``out`` that a restart continues from; ``None`` while
    there is no (readable) one: a restart then starts as the first start did."""
    from meshtorch.checkpoint.index import read_index

    try:
        return read_index(os.path.join(out, "checkpoint"))
    except Exception:  # noqa: BLE001 - none yet, or half-written: the first start's options
        return None


def continued(cfg: TrainConfig, out: str) -> TrainConfig:
    """``cfg`` for a restarted start of its run in ``out``: continue from ``out``'s newest checkpoint
    where there is one (the launcher claimed ``out`` for this run before the first start, so any
    checkpoint there is this run's, or the one it resumed in place), else start as the first start did."""
    if _newest_checkpoint(out) is None:
        return cfg
    return cfg.replace(resume=out, out=out, overwrite=False)


def restarts_from(cfg: TrainConfig) -> str:
    """Where a restart of ``cfg``'s run continues (as :func:`continued` decides): the newest
    checkpoint in its ``--out``, named by its step; else where the first start began (the
    checkpoint named by its ``--resume``, or the start).

    Example:
        >>> import tempfile
        >>> from meshtorch.recipes.lm.config import TrainConfig
        >>> cfg = TrainConfig.of(out=tempfile.mkdtemp(), resume="runs/earlier")
        >>> restarts_from(cfg)
        'the checkpoint it resumed (--resume runs/earlier; none of its own yet)'
    """
    index = _newest_checkpoint(cfg.run.out)
    if index is None:
        if cfg.run.resume:
            return f"the checkpoint it resumed (--resume {cfg.run.resume}; none of its own yet)"
        return "the start (no checkpoint yet)"
    step = index.get("step")
    return "its newest checkpoint" if step is None else f"its checkpoint of step {step}"


def _peer_left(e: BaseException, rank: int) -> str | None:
    """Who left, where ``e`` only tells that another processor went away in a collective (it exited
    or crashed: its own error, or the agent's report of its exit, says why; this one adds nothing);
    else ``None``."""
    from meshtorch.comm.torch import peer_left

    while e is not None:
        cause = e.__cause__
        if isinstance(e, CommError) and cause is not None and not isinstance(cause, MeshTorchError) \
                and peer_left(cause):
            # the communicator names the group ("a processor of the group [0, 1] exited or crashed")
            group = re.search(r"group \[([\d, ]*)\] exited", str(e))
            others = [r for r in map(int, group.group(1).split(",")) if r != rank] if group else []
            if len(others) == 1:
                return f"processor {others[0]}"
            return f"one of processors {others}" if others else "a processor it was exchanging data with"
        e = cause
    return None


def worker_failed(e: Exception, cfg: TrainConfig) -> str:
    """What a worker of ``meshtorch train --max-restarts`` says on stderr when it failed with ``e``, in
    place of the traceback of every exception in the chain (seen: ~80 lines prefixed ``[rank0]:`` from
    the survivor of a killed processor, on every restart): one line saying which processor, why, and
    from which step the run restarts. A processor that stopped because another left says only that;
    an exception that is no meshtorch error (a bug, whose message alone may not tell where) is
    preceded by its traceback, there being no log file of the run to keep it in.

    Example:
        >>> from meshtorch.errors import TrainingError
        >>> print(worker_failed(TrainingError("the loss is nan at step 3"), TrainConfig.of(out="x")))
        meshtorch train: processor 0 failed: TrainingError: the loss is nan at step 3
    """
    rank = int(os.environ.get("RANK", "0"))
    left = _peer_left(e, rank)
    if left is not None:
        what = f"processor {rank} stopped: {left} exited or crashed"
    elif isinstance(e, ProcessorError):  # "processor R {coords} raised Type: message"
        what = str(e)
    else:
        what = f"processor {rank} failed: {type(e).__name__}: {e}"
    original = getattr(e, "_original", type(e))  # a ProcessorError's is the class the processor raised
    shown = "" if issubclass(original, MeshTorchError) else "".join(traceback.format_exception(e))
    n, k = cfg.parallelism.max_restarts, restart_count()
    if k < n:
        what += (f"; the run restarts from {restarts_from(cfg)} "
                 f"(restart {k + 1} of --max-restarts {n})")
    return f"{shown}meshtorch train: {what}"


def launcher_holds(out: str) -> bool:
    """Whether ``out`` is held (:class:`RunDirLock`) by the ``meshtorch train`` process that started this
    worker: this process's parent, named in ``MESHTORCH_LAUNCHER_PID`` and in the lock file, and the lock
    taken (:func:`~meshtorch.recipes.lm.guards.lock_holder`). An environment variable alone never skips
    the lock."""
    pid = os.environ.get(ENV_LAUNCHER_PID, "")
    return pid.isdigit() and int(pid) == os.getppid() and lock_holder(out) == pid


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

