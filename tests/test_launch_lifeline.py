"""Workers die with their launcher: kill -9, SIGTERM and SIGHUP of `mt.launch(backend="torch")`,
`meshtorch launch --backend torch` (spawned and through torchrun) and `meshtorch train --backend
torch` take every worker down within a bounded wait; `die_with_parent` alone, with and without
the Linux kernel's help.

Each launcher runs in its own session; whatever a test leaves running is killed as a group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from meshtorch.launcher.lifeline import EXIT_PARENT_DIED
from run_harness import tiny_train, write_corpus

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
# a worker that writes its pid, then works forever, as a training loop does
WORKER = textwrap.dedent("""
    import os, signal, sys, time
    import meshtorch as mt

    def work(d):
        with open(os.path.join(d, f"pid{mt.current().rank}"), "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.05)

    if __name__ == "__main__":
        if sys.argv[1] == "library":
            # as in a terminal: a shell may start this in the background with SIGINT ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
            mt.launch(work, sys.argv[2], mesh="m:2", backend="torch")
        else:  # run by `meshtorch launch` on every processor
            work(sys.argv[1])
""")
STARTUP_S = 90  # spawning processes that import torch on 2 shared cores
GONE_S = 10     # a dead launcher's workers must be gone well within this


def _alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet has stopped running, so counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return False


def _wait(cond, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _start(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)


def _worker_pids(d, n: int, launcher: subprocess.Popen) -> list[int]:
    paths = [d / f"pid{r}" for r in range(n)]
    if not _wait(lambda: all(p.exists() and p.read_text() for p in paths) or launcher.poll() is not None,
                 STARTUP_S):
        pytest.fail(f"workers did not start within {STARTUP_S} s")
    if launcher.poll() is not None:
        pytest.fail(f"launcher exited with {launcher.returncode}: {launcher.stderr.read().decode()[-3000:]}")
    return [int(p.read_text()) for p in paths]


def _kill_and_expect_workers_gone(launcher: subprocess.Popen, workers: list[int], sig: int) -> None:
    try:
        assert all(_alive(w) for w in workers)
        launcher.send_signal(sig)
        gone = _wait(lambda: not any(_alive(w) for w in workers), GONE_S)
        assert gone, f"workers {[w for w in workers if _alive(w)]} outlived their launcher ({sig!r})"
        assert launcher.wait(GONE_S) == -sig  # it died of the signal, as if it had not caught it
    finally:
        for w in workers:  # only if the assertion above failed: never leave them running
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        launcher.stderr.close()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_mt_launch_workers_die_with_the_launcher(script, tmp_path, sig):
    launcher = _start([sys.executable, str(script), "library", str(tmp_path)])
    _kill_and_expect_workers_gone(launcher, _worker_pids(tmp_path, 2, launcher), sig)


# SIGTERM and SIGINT take the same path as in mt.launch above
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_meshtorch_launch_workers_die_with_the_launcher(script, tmp_path, sig):
    launcher = _start([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--mesh", "m:2",
                       str(script), str(tmp_path)])
    _kill_and_expect_workers_gone(launcher, _worker_pids(tmp_path, 2, launcher), sig)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_meshtorch_launch_through_torchrun_workers_die_with_the_launcher(script, tmp_path, sig):
    # a rendezvous address sends the workers through torchrun, whose agent runs in the launcher
    launcher = _start([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--mesh", "m:2",
                       "--master-addr", "127.0.0.1", "--master-port", "0",
                       str(script), str(tmp_path)])
    _kill_and_expect_workers_gone(launcher, _worker_pids(tmp_path, 2, launcher), sig)


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, command line)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                with open(f"/proc/{entry}/cmdline") as f:
                    out[int(entry)] = ppid, f.read()
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
    return out


def _children(pid: int) -> list[int]:
    """Pids of the meshtorch workers that ``pid`` started: forked by its fork server (a child
    of ``pid`` itself), or spawned by ``pid`` (not multiprocessing's resource tracker)."""
    procs = _processes()
    servers = {p for p, (ppid, cmd) in procs.items() if ppid == pid and "forkserver" in cmd}
    return [p for p, (ppid, cmd) in procs.items() if ppid in servers or ppid == pid and "spawn_main" in cmd]


def test_meshtorch_train_workers_stop_writing_when_the_launcher_is_killed(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    write_corpus(data, 12)  # as in test_lm_train_cli: some files land in the held-out split
    out = tmp_path / "run"
    launcher = _start([sys.executable, "-m", "meshtorch", "train", "--backend", "torch",
                       *tiny_train(eval_batches=None, sample_tokens=None, mesh="b:2", rules="batch:b",
                                   steps=100000, log_every=1, lr_schedule="constant"),
                       "--data", str(data), "--out", str(out)])
    metrics = out / "metrics.jsonl"
    if not _wait(lambda: metrics.exists() and metrics.stat().st_size > 0 or launcher.poll() is not None,
                 STARTUP_S):
        pytest.fail("training did not start")
    workers = _children(launcher.pid)
    assert len(workers) == 2, workers
    _kill_and_expect_workers_gone(launcher, workers, signal.SIGKILL)
    size = metrics.stat().st_size
    time.sleep(1.0)  # a worker still training would log a step in this time
    assert metrics.stat().st_size == size


PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", '''
    import os, sys, time
    from meshtorch.launcher.lifeline import die_with_parent
    die_with_parent(int(sys.argv[1]), use_prctl=sys.argv[2] == "1", poll_s=float(sys.argv[3]))
    open(sys.argv[4], "w").write(str(os.getpid()))
    time.sleep(600)
    ''', str(os.getpid()), *sys.argv[1:]])
    time.sleep(600)
""")


@pytest.mark.parametrize("use_prctl, poll_s", [(True, 3600.0), (False, 0.05)],
                         ids=["kernel-signal-alone", "portable-watcher-alone"])
def test_die_with_parent_ends_the_worker_when_its_parent_is_killed(tmp_path, use_prctl, poll_s):
    parent = _start([sys.executable, "-c", PARENT, "1" if use_prctl else "0", str(poll_s),
                     str(tmp_path / "pid0")])
    _kill_and_expect_workers_gone(parent, _worker_pids(tmp_path, 1, parent), signal.SIGKILL)


def test_die_with_parent_ends_a_worker_whose_parent_died_before_it_started():
    # the launcher's pid as the launcher saw it is no longer this process's parent
    code = subprocess.run([sys.executable, "-c", "from meshtorch.launcher.lifeline import die_with_parent; "
                           "die_with_parent(1 if __import__('os').getppid() != 1 else 2); print('ran on')"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": SRC}).returncode
    assert code == EXIT_PARENT_DIED
