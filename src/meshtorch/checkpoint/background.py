"""Background saves (``mt.save(..., background=True)``): a thread writes the files while training goes on.

Everything collective stays on each processor's own thread, in step order:
the temporary directory's name, the RNG streams, agreeing that the directory
exists, and the copy of the processor's slices into host memory (the
snapshot: what is written is the state at the save call, whatever the step
loop changes afterwards). Then one thread per processor writes its slice
file exactly as a synchronous save does, fsyncs it, and leaves a marker
``.done-<rank>`` with the file's sha256 (or its error) in the temporary
directory. Processor 0's thread waits for every processor's marker, removes
them, and writes the index and commits as a synchronous save does: the same
files, bytes, checksums, atomic pointer and ``keep``. No collective runs off
the processor's thread, so nothing races the step loop's collectives.

At most one save per processor is in flight: the next save (or
:func:`~meshtorch.checkpoint.wait`) joins it first, and all processors agree
on its outcome there, so a failure raises on every processor at that call.
The threads are not daemons: the process ends only after its last save is
written, and an error nobody collected is reported as a warning at exit.

Example:
    >>> import tempfile, os, meshtorch as mt
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2))
    >>> mt.save(path, model=model, step=1, background=True)  # returns at once
    >>> os.path.basename(mt.checkpoint.wait())
    'step-000001'
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from meshtorch.files import write_atomic

# how long processor 0's writer waits for another processor's slice file before the save fails
MARKER_TIMEOUT_S = 1800.0
_MARKER = ".done-{:05d}"

_jobs: dict[int, Job] = {}  # processor context's key -> its save in flight (or finished, not yet collected)
_jobs_lock = threading.Lock()


class Job:
    """One processor's background save: ``work()`` runs on a thread; its result or error is kept."""

    def __init__(self, owner: int, work: Callable[[], Any]):
        self.owner, self.work = owner, work
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"meshtorch-save-{owner}", daemon=False)

    def _run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as e:  # noqa: BLE001 - kept for the next save, which raises it
            self.error = e


def start_background(owner: int, work: Callable[[], Any]) -> None:
    """Run ``work`` on a background thread as processor ``owner``'s save in flight."""
    job = Job(owner, work)
    with _jobs_lock:
        if owner in _jobs:  # the caller collects the previous one first
            raise RuntimeError("a background save is already in flight for this processor")
        _jobs[owner] = job
    job.thread.start()


def collect(owner: int) -> Job | None:
    """Processor ``owner``'s last background save, after it finished (``None`` if there is none)."""
    with _jobs_lock:
        job = _jobs.get(owner)
    if job is None:
        return None
    job.thread.join()
    with _jobs_lock:
        _jobs.pop(owner, None)
    return job


def drop(owner: int) -> None:
    """Wait for processor ``owner``'s save in flight to end, and forget it, without the agreement
    on its outcome :func:`~meshtorch.checkpoint.wait` makes: for a processor whose program raised,
    so that its launch returns with nothing left writing. A failure of the save is warned about,
    as one that nothing collected is at exit."""
    job = collect(owner)
    if job is not None and job.error is not None:
        _warn_uncollected(job)


def in_flight(owner: int) -> bool:
    with _jobs_lock:
        return owner in _jobs


def write_marker(tmp: str, rank: int, sha256: str | None, error: BaseException | None) -> None:
    """Tell processor 0 that ``rank``'s slice file is written (its sha256) or failed (the error)."""
    body = {"sha256": sha256} if error is None else {"error": f"{type(error).__name__}: {error}"}
    write_atomic(os.path.join(tmp, _MARKER.format(rank)), json.dumps(body).encode())  # never half a marker


def wait_markers(tmp: str, ranks: range, timeout: float = MARKER_TIMEOUT_S) -> dict[int, dict]:
    """Every processor's marker in ``tmp`` (processor 0's writer waits for them), then removed."""
    deadline, pause = time.monotonic() + timeout, 0.002
    found: dict[int, dict] = {}
    while True:
        for rank in ranks:
            if rank not in found:
                fpath = os.path.join(tmp, _MARKER.format(rank))
                if os.path.exists(fpath):
                    with open(fpath) as f:
                        found[rank] = json.loads(f.read())
        if len(found) == len(ranks):
            break
        if time.monotonic() > deadline:
            missing = [r for r in ranks if r not in found]
            raise TimeoutError(f"processor(s) {missing} did not finish writing their slices into {tmp} "
                               f"within {timeout:.0f} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    for rank in ranks:
        os.remove(os.path.join(tmp, _MARKER.format(rank)))
    return found


@atexit.register
def _report_uncollected() -> None:
    # non-daemon threads are joined before atexit runs: every job has finished by now
    with _jobs_lock:
        failed = [job for job in _jobs.values() if job.error is not None]
    for job in failed:
        _warn_uncollected(job)


def _warn_uncollected(job: Job) -> None:
    warnings.warn(f"a background checkpoint save failed and no later save or mt.checkpoint.wait() "
                  f"reported it: {type(job.error).__name__}: {job.error}", RuntimeWarning, stacklevel=1)
