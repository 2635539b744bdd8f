"""Test harness for multi-node runs: two "hosts" on one machine, network namespaces joined by a veth pair
(needs root and iproute2's ``ip netns``; the test is skipped where the box allows neither)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
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
