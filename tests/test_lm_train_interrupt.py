"""Ctrl-C on ``meshtorch train --backend threads``: the process exits by its KeyboardInterrupt (never
an abort from its processor threads still inside torch), and leaves no temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_harness import tiny_train, write_corpus  # noqa: E402

pytestmark = pytest.mark.timeout(180)
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
# as in a terminal: a shell may start this in the background with SIGINT ignored
MAIN = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from meshtorch.cli import main; sys.exit(main(sys.argv[1:]))")
FLAGS = ["train", *tiny_train(layers=2, batch=8, eval_batches=None, sample_tokens=None, warmup=None,
                              tokenizer="bytes", mesh="b:2", rules="batch:b", steps=100000, log_every=1,
                              checkpoint_every=1)]


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_on_the_threads_backend_exits_cleanly_and_leaves_no_temporary_directory(tmp_path):
    (tmp_path / "data").mkdir()
    data, out, tmp = write_corpus(tmp_path / "data", 2), tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    p = subprocess.Popen([sys.executable, "-c", MAIN, *FLAGS, "--data", data, "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        # a checkpoint every step: the interrupt most likely lands in a save, the worst place for it
        deadline = time.monotonic() + 120
        while _lines(str(out / "metrics.jsonl")) < 3 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()[1][-3000:]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == -signal.SIGINT, err[-3000:]  # died of its KeyboardInterrupt, not SIGABRT
    assert "terminate called" not in err and "KeyboardInterrupt" in err
    left = [name for name in os.listdir(out / "checkpoint") if ".tmp-" in name or name.startswith(".")]
    assert left == [], left
    # nothing of the run's in the temporary directory (torch's compile cache is torch's, and meant to stay)
    assert [name for name in os.listdir(tmp) if not name.startswith("torchinductor_")] == []
    assert sorted(os.listdir(out / "checkpoint"))[-1].startswith("step-")  # it holds its checkpoints
