"""Worker processes that die with their launcher.

A worker started by ``mt.launch(backend="torch")``, ``meshtorch train --backend
torch`` or ``meshtorch launch --backend torch`` must not go on training (and
writing into the run directory) after its launcher is gone, however the
launcher died: ``kill -9`` runs none of its clean-up. Each worker therefore
calls :func:`die_with_parent` as it starts. On Linux the kernel kills the
worker when its parent exits (``PR_SET_PDEATHSIG``); everywhere, a daemon
thread watches the parent's pid and ends the worker when it changes (the
orphan is re-parented), which also covers systems without ``prctl``.

Example:
    >>> import os
    >>> from meshtorch.launcher.lifeline import die_with_parent
    >>> die_with_parent(os.getppid(), use_prctl=False)  # the parent is alive: returns
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

# the environment variable through which `meshtorch launch` tells torchrun's workers who launched them
ENV_LAUNCHER_PID = "MESHTORCH_LAUNCHER_PID"
# exit status of a worker whose launcher died (128 + SIGKILL, as if the kernel had killed it)
EXIT_PARENT_DIED = 137
# how often the portable watcher looks at the parent's pid, seconds
POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> bool:
    """Ask the Linux kernel to SIGKILL this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc or no prctl: the watcher thread still runs
        return False


def _orphaned() -> None:
    os._exit(EXIT_PARENT_DIED)  # from any thread, at once: nothing of the run is worth finishing


def _watch(parent_pid: int, poll_s: float) -> None:
    event = threading.Event()
    while not event.wait(poll_s):
        if os.getppid() != parent_pid:
            _orphaned()


def die_with_parent(parent_pid: int, *, use_prctl: bool = True, poll_s: float = POLL_S) -> None:
    """End this process as soon as process ``parent_pid`` (its launcher) is gone.

    ``parent_pid`` is the launcher's pid as the launcher saw it; if the
    launcher already died before this call (the worker was slow to start),
    the process ends here. ``use_prctl=False`` leaves out the Linux-only
    kernel signal and relies on the portable watcher alone.

    Example:
        >>> import os
        >>> from meshtorch.launcher.lifeline import die_with_parent
        >>> die_with_parent(os.getppid(), use_prctl=False)
    """
    if use_prctl:
        _set_pdeathsig()
    # the parent may have died before prctl took effect; after it, a death cannot go unnoticed
    if os.getppid() != parent_pid:
        _orphaned()
    threading.Thread(target=_watch, args=(parent_pid, poll_s), name="meshtorch-lifeline",
                     daemon=True).start()


def die_with_launcher() -> None:
    """:func:`die_with_parent` for a worker that torchrun started for ``meshtorch launch``,
    which names itself in ``MESHTORCH_LAUNCHER_PID``; nothing to do without it.

    Example:
        >>> from meshtorch.launcher.lifeline import die_with_launcher
        >>> die_with_launcher()  # not started by `meshtorch launch`: nothing to watch
    """
    pid = os.environ.get(ENV_LAUNCHER_PID, "")
    if pid.isdigit() and int(pid) != os.getpid():  # never the launcher itself
        die_with_parent(int(pid))
