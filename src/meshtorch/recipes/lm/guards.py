"""What stops a training run before it goes wrong silently (and
:func:`meshtorch.recipes.lm.fit.check_memory`, before it runs out of memory).

- :class:`RunDirLock`: one writer per ``--out`` (an ``fcntl.flock`` on
  ``--out/.lock``, held for the run, naming the holder's pid), and no run
  silently replacing another: ``--out`` onto an earlier run needs ``--resume``
  (to continue it) or ``--overwrite`` (to replace it), which removes only the
  files meshtorch wrote there (the run's manifest, :data:`MANIFEST`), and only
  once the new run's inputs are checked (:func:`check_inputs`).
- :func:`check_loss` and :func:`check_weights`: a non-finite loss stops the run
  at the step it is seen, and a checkpoint is never written from non-finite
  weights.

Example:
    >>> import tempfile
    >>> from meshtorch.recipes.lm.config import TrainConfig
    >>> from meshtorch.recipes.lm.guards import RunDirLock
    >>> out = tempfile.mkdtemp()
    >>> with RunDirLock(TrainConfig(), out):
    ...     try:
    ...         RunDirLock(TrainConfig(), out).__enter__()
    ...     except Exception as e:
    ...         print(type(e).__name__, "in use" in str(e))
    TrainingError True
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from typing import Any

import torch

from meshtorch.errors import ArgumentError, TrainingError
from meshtorch.recipes.lm.config import TrainConfig

LOCK = ".lock"
# the files meshtorch train writes in --out (its other files are the user's and are left alone)
RUN_FILES = ("checkpoint", "metrics.jsonl", "summary.json", "loss.png", "tokenizer", "tensorboard")
# the manifest of a run directory: the files above that meshtorch wrote there, which --overwrite removes
MANIFEST = ".meshtorch-run.json"
# a run directory from before the manifest: what marks it as a run's
EARLIER = ("checkpoint", "metrics.jsonl")
FIX = "Lower --lr, keep --clip on (e.g. --clip 1), or use --precision fp32, then rerun or --resume"


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def _open_run_dir(out: str, lock: str) -> int:
    """Create ``out`` and open its lock file, or say why ``out`` cannot hold a run."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out {out!r} is a file, not a directory: pass a directory for the run "
                            "(one that does not exist yet is created)")
    try:
        os.makedirs(out, exist_ok=True)
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a file on the way (NotADirectoryError), read-only (EACCES, EROFS), full
        raise TrainingError(f"--out {out!r} cannot hold a run: {e.strerror or e} ({e.filename or out}); "
                            "pass a directory you can write to") from None


class RunDirLock:
    """Hold ``out`` for this run: create it, lock it against a second writer, and refuse to
    replace an earlier run there unless ``--resume`` continues it or ``--overwrite`` is given.

    The lock is ``fcntl.flock`` on ``out/.lock``: the kernel drops it when the holder exits,
    however it exits, so a killed run never leaves ``out`` locked.
    """

    def __init__(self, cfg: TrainConfig, out: str):
        self.cfg, self.out = cfg, out
        self.path = os.path.join(out, LOCK)
        self.fd: int | None = None
        self.listed: list[str] | None = None  # the manifest's files while the run holds ``out``

    def __enter__(self) -> RunDirLock:
        fd = _open_run_dir(self.out, self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise TrainingError(f"--out {self.out!r} is in use by another meshtorch train (pid {holder}, "
                                f"which holds {self.path}); wait for it to finish, stop it, or pass "
                                "another --out") from None
        self.fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            self._claim()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _ours(self) -> list[str]:
        """The files of an earlier run in ``out`` that meshtorch wrote (its manifest's; before
        manifests, the run files but ``tokenizer/`` unless the run recorded it as its own)."""
        manifest = os.path.join(self.out, MANIFEST)
        if os.path.exists(manifest):
            with open(manifest) as f:
                listed = json.load(f).get("files", [])
            return [f for f in listed if f in RUN_FILES and os.path.lexists(os.path.join(self.out, f))]
        if not any(os.path.exists(os.path.join(self.out, f)) for f in EARLIER):
            return []
        ours = [f for f in RUN_FILES if f != "tokenizer" and os.path.lexists(os.path.join(self.out, f))]
        try:
            theirs = (recorded(self.out).get("train_config") or {}).get("tokenizer") or ""
        except Exception:  # noqa: BLE001 - no readable checkpoint: the tokenizer is not known to be ours
            theirs = ""
        if theirs and _same_dir(theirs, os.path.join(self.out, "tokenizer")):
            ours.append("tokenizer")
        return ours

    def _claim(self) -> None:
        run = self.cfg.run
        ours = self._ours()
        if not _same_dir(run.resume, self.out):
            # a file of this run's names that meshtorch did not write: the run would write over it
            foreign = [f for f in RUN_FILES if f not in ours and os.path.lexists(os.path.join(self.out, f))]
            if foreign:
                raise TrainingError(f"--out {self.out!r} holds {', '.join(foreign)}, which meshtorch train "
                                    "did not write and would write over; move them or pass another --out")
            if ours and not run.overwrite:
                has_checkpoint = "checkpoint" in ours
                cont = (f"pass --resume {self.out} to continue it, another --out for a new run, or "
                        "--overwrite to replace it") if has_checkpoint else (
                        "it stopped before its first checkpoint: pass --overwrite to rerun it in place, "
                        "or another --out")
                raise TrainingError(f"--out {self.out!r} holds an earlier run ({', '.join(ours)}); {cont}")
            if ours:
                check_inputs(self.cfg, [os.path.join(self.out, f) for f in ours])
                for f in ours:  # only now, every input checked
                    path = os.path.join(self.out, f)
                    tree = os.path.isdir(path) and not os.path.islink(path)
                    shutil.rmtree(path) if tree else os.remove(path)
                ours = []
        # while it runs: the earlier run's files it continues and every name it may write (a run
        # stopped now is rerun in place with --overwrite); once it ends, only those it wrote
        self.listed = [f for f in RUN_FILES if f in ours or not os.path.lexists(os.path.join(self.out, f))]
        write_manifest(self.out, self.listed)

    def __exit__(self, *exc: Any) -> None:
        if self.listed is not None:
            # a name the run may have written but did not (tokenizer/ of a run on bytes, tensorboard/
            # without --tensorboard) is not the run's: a file of that name put there later is the user's
            wrote = [f for f in self.listed if os.path.lexists(os.path.join(self.out, f))]
            self.listed = None
            try:
                write_manifest(self.out, wrote)
            except OSError:  # --out went away or read-only under the run: its own error says so
                pass
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def lock_holder(out: str) -> str | None:
    """The pid that holds ``out`` (:class:`RunDirLock`: a run in progress there), or None.

    Example:
        >>> import tempfile
        >>> lock_holder(tempfile.mkdtemp()) is None
        True
    """
    try:
        fd = os.open(os.path.join(out, LOCK), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def recorded(resume: str) -> dict[str, Any]:
    """What the checkpoint of run directory ``resume`` records about its run (``extra``: the model kind
    ``model``, ``model_config``, ``train_config`` (every option by flag name), ``tokenizer``)."""
    return checkpoint_extra(os.path.join(resume, "checkpoint"))


def checkpoint_extra(path: str) -> dict[str, Any]:
    """What checkpoint ``path`` (a run's ``checkpoint`` directory, or one version of it) records
    about its run: :func:`recorded`'s fields, ``{}`` where it records none."""
    from meshtorch.checkpoint.index import read_index
    from meshtorch.checkpoint.state import from_json

    return from_json(read_index(path).get("extra")) or {}


def write_manifest(out: str, files: list[str]) -> None:
    """Record in ``out`` which of its files meshtorch train wrote (what ``--overwrite`` may remove)."""
    from meshtorch.files import write_atomic

    write_atomic(os.path.join(out, MANIFEST),
                 json.dumps({"written_by": "meshtorch train", "files": list(files)}, indent=1).encode())


def check_inputs(cfg: TrainConfig, removed: list[str]) -> None:
    """Raise :class:`ArgumentError` unless every input of the run (``--data``, ``--tokenizer``,
    ``--init-from``) exists and none lies in ``removed``, the earlier run's files that ``--overwrite``
    is about to delete."""
    run = cfg.run
    inputs = {"--data": run.data, "--init-from": run.init_from}
    if run.tokenizer != "auto" and run.tokenizer != "bytes" and not run.tokenizer.startswith("bpe:"):
        inputs["--tokenizer"] = run.tokenizer
    for flag, path in inputs.items():
        if not path:
            continue
        if not os.path.exists(path):
            raise ArgumentError(f"{flag} {path!r} does not exist; nothing in --out was removed")
        real = os.path.realpath(path)
        for gone in removed:
            g = os.path.realpath(gone)
            if real == g or real.startswith(g + os.sep):
                raise ArgumentError(f"{flag} {path!r} is in {gone}, a file of the earlier run that "
                                    "--overwrite would remove; copy it elsewhere and pass that, or pass "
                                    "another --out; nothing was removed")


def check_loss(loss: float, first: int, step: int, last_checkpoint: str) -> None:
    """Raise :class:`TrainingError` if ``loss`` (steps ``first + 1 .. step``' last) is not finite.

    Example:
        >>> check_loss(2.5, 0, 10, "no checkpoint was written")
        >>> try:
        ...     check_loss(float("nan"), 10, 11, "no checkpoint was written")
        ... except TrainingError as e:
        ...     print(str(e)[:40])
        the training loss is nan at step 11; sto
    """
    if math.isfinite(loss):
        return
    when = f"step {step}"
    if first + 1 < step:
        when += f" (it turned in steps {first + 1}..{step}: the loss is read once per --log-every window)"
    raise TrainingError(f"the training loss is {loss} at {when}; stopped without writing a checkpoint from "
                        f"it ({last_checkpoint}). {FIX}")


def check_weights(module: torch.nn.Module, step: int) -> None:
    """Raise :class:`TrainingError` (on every processor alike) if a parameter of ``module`` holds a
    NaN or infinity: a checkpoint is never written from them. One all_reduce of one number.

    Example:
        >>> import meshtorch as mt
        >>> mt.launch(lambda: check_weights(mt.nn.Dense(mt.Dim("a", 2), mt.Dim("b", 2)), step=1), mesh="m:2")
        [None, None]
    """
    from meshtorch.context import current

    params = list(module.named_parameters())
    if not params:
        return
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in params])
    comm = current().comm
    bad = comm.all_reduce((~finite).sum().reshape(1).to(torch.float64), comm.mesh.axis_names, "sum").item()
    if bad:
        names = [n for (n, _), ok in zip(params, finite.tolist()) if not ok]
        where = f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''} here)" if names else ""
        raise TrainingError(f"the weights are not finite at step {step}{where}; stopped without writing a "
                            f"checkpoint from them. {FIX}")
