"""Test harness for multi-node runs: two "hosts" on one machine, network namespaces joined by a veth pair
(needs root and iproute2's ``ip netns``; the test is skipped where the box allows neither), and
:func:`run_nodes`, which runs one command per node and, should a node hang, fails with every process's
stack."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

LINUX = sys.platform.startswith("linux")


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2 (each namespace's end of
    the pair is ``v<its name>``); skips the test where the box does not allow making them (not root, no
    ``ip``, no namespaces). ``ip netns exec NAME cmd`` runs ``cmd`` on that "host"."""
    if not LINUX or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) on Linux")
    a, b = f"mta{os.getpid()}", f"mtb{os.getpid()}"
    if _sh("ip", "netns", "add", a).returncode != 0:
        pytest.skip("this box does not allow network namespaces (ip netns add failed)")
    try:
        steps = [("ip", "netns", "add", b),
                 ("ip", "link", "add", f"v{a}", "type", "veth", "peer", "name", f"v{b}"),
                 ("ip", "link", "set", f"v{a}", "netns", a), ("ip", "link", "set", f"v{b}", "netns", b),
                 ("ip", "-n", a, "addr", "add", "10.77.0.1/24", "dev", f"v{a}"),
                 ("ip", "-n", b, "addr", "add", "10.77.0.2/24", "dev", f"v{b}")]
        steps += [("ip", "-n", ns, "link", "set", dev, "up") for ns in (a, b) for dev in ("lo", f"v{ns}")]
        for step in steps:
            done = _sh(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build the two hosts: {' '.join(step)}: {done.stderr.strip()}")
        yield a, b
    finally:
        for ns in (a, b):
            _sh("ip", "netns", "del", ns)  # takes its end of the veth pair with it


@dataclasses.dataclass
class Node:
    """What one node's command did: its exit code and what it printed."""

    code: int | None
    out: str
    err: str


def _children() -> dict[int, list[int]]:
    """Every live process's children, by parent pid (from ``/proc``)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return kids


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (torchrun's workers run in sessions of their own, so a
    process group does not hold them all)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _cpu(pid: int) -> str:
    """``pid``'s state and the CPU seconds it used: a process stuck waiting sleeps and gains none, a slow
    one (a loaded machine) runs and gains them."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    ticks = os.sysconf("SC_CLK_TCK")
    return f"state {fields[0]}, {(int(fields[11]) + int(fields[12])) / ticks:.1f} s CPU"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "(gone)"


def _no_core_dumps() -> None:
    # SIGABRT (below) ends each process with its Python stacks: never with a core file
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_nodes(cmds: list[list[str]], env: dict[str, str], timeout: float = 180,
              grace: float = 60) -> list[Node]:
    """Run ``cmds`` (one per node, e.g. ``ip netns exec NS ...``) at once, each in a session of its own,
    reading every one's stdout and stderr as it goes (a node blocked on a full pipe would stall the
    others in their collectives). A node not done within ``timeout`` s, or still running ``grace`` s
    after another node failed, fails the test with every node's process tree, each process's Python
    stack (``py-spy dump --native`` where py-spy is installed; and always faulthandler's, which
    ``PYTHONFAULTHANDLER`` makes each process print on the SIGABRT sent to every one of them) and what
    each node printed."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True, preexec_fn=_no_core_dumps) for cmd in cmds]
    told: list[tuple[str, str]] = [("", "")] * len(procs)

    def read(i: int) -> None:
        told[i] = procs[i].communicate()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    started = time.monotonic()
    deadline, failed = started + timeout, None
    why = f"a node did not finish in {timeout:g} s"
    try:
        while any(t.is_alive() for t in readers) and time.monotonic() < deadline:
            if failed is None:
                failed = next(((r, p.returncode, time.monotonic()) for r, p in enumerate(procs)
                               if p.poll() not in (None, 0)), None)
            elif time.monotonic() > failed[2] + grace:
                why = (f"node {failed[0]} exited with {failed[1]} and another node was still running "
                       f"{grace:g} s later")
                break
            time.sleep(0.2)
        if any(t.is_alive() for t in readers):
            report = _stacks(procs, started)
            for t in readers:
                t.join(15)
            pytest.fail(f"{why}:\n{report}\n" + "\n".join(
                f"--- node {r} (exit {p.returncode}) stdout:\n{o[-2000:]}\n--- stderr:\n{e[-12000:]}"
                for r, (p, (o, e)) in enumerate(zip(procs, told))))
    finally:
        for p in procs:
            if p.poll() is None:  # not reaped yet: its pid, and its descendants', are still this run's
                for pid in reversed(_tree(p.pid)):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                p.wait()
    return [Node(p.returncode, o, e) for p, (o, e) in zip(procs, told)]


def _stacks(procs: list[subprocess.Popen], started: float) -> str:
    """Every process of the nodes still alive: the tree, py-spy's dump of each (where installed), then
    SIGABRT to each, whose faulthandler prints its threads' Python stacks on the node's stderr."""
    lines = [f"=== this machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"]
    trees = [_tree(p.pid) if p.poll() is None else [] for p in procs]
    spy = shutil.which("py-spy")
    for r, tree in enumerate(trees):
        lines.append(f"=== node {r}: processes (after {time.monotonic() - started:.0f} s)")
        lines += [f"  {pid} ({_cpu(pid)}): {_cmdline(pid)}" for pid in tree]
    for r, tree in enumerate(trees):
        for pid in tree:
            if spy and "python" in _cmdline(pid):
                try:
                    dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                                          text=True, timeout=10)
                    lines.append(f"=== node {r}, py-spy dump of {pid}:\n{dump.stdout}{dump.stderr}")
                except subprocess.TimeoutExpired:
                    lines.append(f"=== node {r}, py-spy dump of {pid}: timed out")
    for tree in trees:
        for pid in reversed(tree):  # the workers first: their launcher would stop them otherwise
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGABRT)
    return "\n".join(lines)
