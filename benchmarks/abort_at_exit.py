"""How often a process ends in "terminate called without an active exception" (SIGABRT) instead of
exiting: a loop over fresh processes, each ending one way a real run ends. Not timed; not in run_all.

    python benchmarks/abort_at_exit.py [--runs 20] [--only failed-launch ctrl-c torchrun-pipeline]

Ways to end (each run a new process, one intra-op thread):

- ``failed-launch``: ``mt.launch`` on the threads backend, processor 0 raises while processor 1 waits
  in a collective inside ``backward()``; the program exits right after the launch raised.
- ``ctrl-c``: SIGINT while two thread-processors loop forward and backward with a collective in it.
- ``torchrun-pipeline``: ``torchrun --nproc-per-node 2 -m meshtorch train --pipeline-stages 2`` on
  gloo, 2 steps (about 15 s a run on 2 cores; the abort was about 1 run in 15).

The cause, as gdb shows it on the core (``ulimit -c unlimited`` in the shell that runs this; the
core lands in the run's working directory): a thread that is not the interpreter's main thread
frees a tensor whose Python object C++ owns, takes the GIL for it (``decref_pyobject`` ->
``gil_scoped_acquire``) after the interpreter began to exit; Python ends the thread with
``pthread_exit``, whose unwinding meets a ``noexcept`` destructor, and libstdc++ calls
``std::terminate``. On the threads backend that thread was a processor whose aborted backward left
work in torch's thread-local autograd queue (freed when the system thread ends, after
``Thread.join``); on gloo, a process group's worker thread (``ProcessGroupGloo::runLoop``) finishing
an ``AsyncAllgatherWork`` of a group that lived on into the exit. Before the fixes (``launcher/threads``
waits for its threads' system threads; ``launcher/world.shutdown`` destroys every group): 13 of 26,
14 of 15 and 2 of 30 runs aborted; after: 0 of 32, 0 of 15 and 0 of 55.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

# the ways a threads launch ends are tests/test_threads_exit.py's own processor functions (one copy of
# the backward that waits in a collective when a processor fails or Ctrl-C comes)
TESTS = os.path.join(os.path.dirname(SRC), "tests")
PROGRAM = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import meshtorch as mt
    from test_threads_exit import _fails_in_backward, _loops_forward_and_backward

    try:
        if sys.argv[1] == "failed-launch":
            mt.launch(_fails_in_backward, [], mesh="m:2")
        else:
            mt.launch(_loops_forward_and_backward, sys.argv[2], mesh="m:2")
    except mt.errors.ProcessorError:
        sys.exit(3)
""")

TRAIN = ["--d-model", "16", "--heads", "2", "--d-kv", "8", "--d-ff", "32", "--layers", "2", "--batch", "8",
         "--length", "16", "--eval-batches", "1", "--sample-tokens", "0", "--warmup", "2", "--no-progress",
         "--lr", "0.01", "--mesh", "b:1", "--rules", "batch:b", "--tokenizer", "bytes", "--steps", "2",
         "--log-every", "1", "--pipeline-stages", "2", "--schedule", "gpipe", "--microbatches", "2"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS]), "OMP_NUM_THREADS": "1"}


def _threads(way: str, d: str) -> tuple[int, str]:
    started = os.path.join(d, "started")
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, way, started], cwd=d, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if way == "ctrl-c":
        deadline = time.monotonic() + 60
        while not os.path.exists(started) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
    return p.returncode, err


def _torchrun(d: str) -> tuple[int, str]:
    data = os.path.join(d, "data")
    os.makedirs(data)
    for i in range(6):
        with open(os.path.join(data, f"m{i}.py"), "w") as f:
            f.write("".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "meshtorch", "train", "--backend", "torch", "--device", "cpu", "--out", os.path.join(d, "out"),
           "--data", data, *TRAIN]
    p = subprocess.run(cmd, cwd=d, env=_env(), capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--only", nargs="+", default=["failed-launch", "ctrl-c", "torchrun-pipeline"],
                    choices=["failed-launch", "ctrl-c", "torchrun-pipeline"])
    a = ap.parse_args(argv)
    expected = {"failed-launch": 3, "ctrl-c": -signal.SIGINT, "torchrun-pipeline": 0}
    for way in a.only:
        aborts = others = 0
        for _ in range(a.runs):
            with tempfile.TemporaryDirectory() as d:
                code, err = _torchrun(d) if way == "torchrun-pipeline" else _threads(way, d)
            if "terminate called" in err or code == -signal.SIGABRT:
                aborts += 1
            elif code != expected[way]:
                others += 1
                print(f"{way}: exit {code}: {err[-500:]}", flush=True)
        print(f"{way}: {aborts} of {a.runs} runs aborted ({others} failed otherwise)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
