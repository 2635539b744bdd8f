"""A threads launch returns (or raises) only after its processors' system threads have ended.

After a processor fails, the others' collectives inside ``backward()`` are abandoned and torch's
autograd engine keeps the rest of each backward in its thread-local queue; that queue is freed when
the system thread ends, after ``Thread.join`` has returned, and freeing it takes the GIL. A program
that exited at once after the launch raised aborted in about half the runs ("terminate called without
an active exception"): Python ended the thread with ``pthread_exit`` inside that C++ destructor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import ProcessorError

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux lists threads in /proc")]

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


class _Reduce(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``m`` (a collective inside backward)."""

    @staticmethod
    def forward(ctx, t):
        return t

    @staticmethod
    def backward(ctx, g):
        return mt.current().comm.all_reduce(g, "m")


class _Grad(torch.autograd.Function):
    """Identity whose backward makes its gradient in Python; made after the _Reduce, so its backward
    runs first, and the node it feeds is queued behind the collective with that gradient."""

    made: list = []  # weak references to each gradient it made

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        out = g * 1
        _Grad.made.append(weakref.ref(out))
        return out


def _loss(x: torch.Tensor, branches: int = 16) -> torch.Tensor:
    # each a's backward waits in the queue, holding a gradient _Grad made, when the collective is abandoned
    a = [x * 3 for _ in range(branches)]
    r = _Reduce.apply(x * 2)
    return sum(_Grad.apply(t).sum() for t in a) + r.sum()


def _fails_in_backward(tids: list[int]) -> None:
    """Processor 0 raises; the others wait in a collective of their backward until that wakes them."""
    tids.append(threading.get_native_id())
    x = torch.randn(4, 16, requires_grad=True)
    if mt.current().rank == 0:
        raise ValueError("processor 0 fails")
    _loss(x).backward()


def _alive(tids: list[int]) -> list[int]:
    return [t for t in tids if os.path.exists(f"/proc/self/task/{t}")]


@pytest.fixture
def gil_held():
    """The launching thread keeps the GIL until it blocks (no switch every 5 ms), as a main thread
    that goes straight on to exit would: what a processor thread still needs the GIL for waits."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_a_failed_launch_raises_after_its_processors_let_go_of_their_abandoned_backward(gil_held):
    tids: list[int] = []
    _Grad.made.clear()
    with pytest.raises(ProcessorError, match="processor 0 fails"):
        mt.launch(_fails_in_backward, tids, mesh="m:2")
    alive = [r for r in _Grad.made if r() is not None]  # looked at before anything lets go of the GIL
    assert len(tids) == 2 and len(_Grad.made) == 16
    assert alive == []
    assert _alive(tids) == []


def test_a_launch_returns_after_its_processor_threads_have_ended(gil_held):
    tids: list[int] = []
    ranks = mt.launch(lambda: tids.append(threading.get_native_id()) or mt.current().rank, mesh="m:3")
    assert ranks == [0, 1, 2]
    assert len(tids) == 3
    assert _alive(tids) == []


def _env() -> dict[str, str]:
    """This checkout's package, and this file importable (its processor functions)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.path.dirname(os.path.abspath(__file__))]),
            "OMP_NUM_THREADS": "1"}


def test_a_program_that_exits_right_after_a_failed_launch_exits_instead_of_aborting():
    script = textwrap.dedent("""
        import sys
        import meshtorch as mt
        from test_threads_exit import _fails_in_backward
        try:
            mt.launch(_fails_in_backward, [], mesh="m:2")
        except mt.errors.ProcessorError:
            sys.exit(3)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(),
                       timeout=100)
    assert p.returncode == 3, p.stderr[-3000:]  # not -6 (SIGABRT)
    assert "terminate called" not in p.stderr


def _loops_forward_and_backward(started: str) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    if mt.current().rank == 0:
        open(started, "w").close()
    while True:  # until Ctrl-C abandons the collective of a backward
        _loss(x).backward()


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="POSIX signals")
def test_ctrl_c_in_the_middle_of_backward_exits_by_its_keyboard_interrupt_instead_of_aborting(tmp_path):
    started = tmp_path / "started"
    # as in a terminal: a shell may start this in the background with SIGINT ignored
    script = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import meshtorch as mt
        from test_threads_exit import _loops_forward_and_backward
        mt.launch(_loops_forward_and_backward, {str(started)!r}, mesh="m:2")
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)  # a few steps in
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == -signal.SIGINT, err[-3000:]  # not -6 (SIGABRT)
    assert "terminate called" not in err and "KeyboardInterrupt" in err
