"""Automatic restarts (``--max-restarts``, torchrun's elastic agent): a worker killed with SIGKILL mid-run
ends, after the restart, in the run an uninterrupted one gives, bitwise."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

from meshtorch.checkpoint import latest
from meshtorch.cli import main as cli_main
from meshtorch.launcher.elastic import failure_text, restart_count
from meshtorch.recipes.lm.config import TrainConfig
from meshtorch.recipes.lm.guards import RunDirLock
from meshtorch.recipes.lm.restarts import ENV_TEST_KILL, continued, launcher_holds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_harness import assert_same_bits, checkpoint_tensors, run_in_session, tiny_train, write_corpus  # noqa: E402

pytestmark = pytest.mark.timeout(240)
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
TINY = tiny_train(batch=8, sample_tokens=0, warmup=2, mesh="b:2", rules="batch:b", lr=0.01, tokenizer="bytes",
                  steps=6, log_every=1, checkpoint_every=2, no_memory_check=True)


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
RESTARTS = "the run restarts from its checkpoint of step 2 (restart 1 of --max-restarts 1)"
# what processor 0 says where it saw processor 1 leave, in a run whose newest checkpoint is of step 2
SURVIVOR = f"meshtorch train: processor 0 stopped: processor 1 exited or crashed; {RESTARTS}"


def _run(cmd, env=None, timeout=150):
    """Run ``cmd`` on this checkout's package, in its own session; (exit status, stdout, stderr)."""
    return run_in_session(cmd, {"PYTHONPATH": SRC, **(env or {})}, timeout)


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_worker_killed_mid_run_is_restarted_and_the_run_ends_bitwise_as_an_uninterrupted_one(tmp_path):
    (tmp_path / "data").mkdir()
    data = write_corpus(tmp_path / "data", 3)
    out = str(tmp_path / "restarted")
    # processor 1 kills itself with SIGKILL after step 3 of its first start: the checkpoint of step 2 is
    # the newest, so the restart trains step 3 again (the data position and the random streams resume)
    code, _, err = _run([sys.executable, "-m", "meshtorch", "train", *TINY, "--data", data, "--out", out,
                         "--backend", "torch", "--device", "cpu", "--max-restarts", "1"],
                        env={ENV_TEST_KILL: "1:3"}, timeout=220)
    assert code == 0, err[-4000:]
    # the kill happened: seen by torchrun's agent, or (under load the agent may report processor 0's
    # SIGTERM from its own teardown first) by processor 0, which names processor 1
    assert ("failed (exitcode: -9) local_rank: 1" in err
            or "processor 0 stopped: processor 1 exited or crashed" in err), err[-4000:]
    # processor 0, where it saw processor 1 leave, says so in one line, not ~80 of `[rank0]:` traceback
    assert "Traceback" not in err and "[rank0]" not in err, err[-4000:]
    said = [line for line in err.splitlines() if line.startswith("meshtorch train: processor 0")]
    assert said in ([], [SURVIVOR]), err[-4000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["steps"], summary["restarts"], summary["restarted_at_steps"]) == (6, 1, [2])
    records = _metrics(out)
    assert {"step": 2, "event": "restart", "restart": 1} in records
    # the reference: the same run, uninterrupted (threads: on this 2-processor mesh the only cross-processor
    # arithmetic is sums of two addends, which are exact in either order, so the backends agree bitwise)
    ref = str(tmp_path / "uninterrupted")
    assert cli_main(["train", *TINY, "--data", data, "--out", ref]) == 0
    assert [r["loss"] for r in records if "loss" in r] == [r["loss"] for r in _metrics(ref)]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert_same_bits(checkpoint_tensors(out), checkpoint_tensors(ref))


def test_meshtorch_launch_restarts_every_worker_over_the_loopback(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys
        import torch
        import meshtorch as mt
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_launch_processes import listening_addresses
        from meshtorch.launcher.elastic import restart_count
        ctx = mt.current()
        total = ctx.comm.all_reduce(torch.ones(1), ("m",), "sum").item()
        if restart_count() == 0 and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(sys.argv[1], f"r{{ctx.rank}}.json"), "w") as f:
            json.dump({{"restart": restart_count(), "total": total, "listening": listening_addresses()}}, f)
    """))
    code, _, err = _run([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--mesh", "m:2",
                         "--max-restarts", "1", str(script), str(tmp_path)], timeout=150)
    assert code == 0, err[-3000:]
    for r in range(2):
        rec = json.loads((tmp_path / f"r{r}.json").read_text())
        assert (rec["restart"], rec["total"]) == (1, 2.0)  # both were started again, and met again
        assert rec["listening"] and all(a in LOOPBACK for a in rec["listening"]), rec["listening"]


def test_the_threads_backend_refuses_max_restarts(tmp_path, capsys):
    assert cli_main(["train", "--max-restarts", "2", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "--max-restarts 2 restarts the worker processes" in err and "add --backend torch" in err
    assert not os.path.exists(tmp_path / "t")  # refused before anything ran
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert cli_main(["launch", "--mesh", "m:2", "--max-restarts", "1", str(script)]) == 2
    assert "threads of this one process: add --backend torch" in capsys.readouterr().err
    assert cli_main(["launch", "--backend", "torch", "--mesh", "m:2", "--max-restarts=-1", str(script)]) == 2
    assert "--max-restarts -1 must be a whole number >= 0" in capsys.readouterr().err
    assert cli_main(["train", "--backend", "torch", "--max-restarts", "-1"]) == 2
    assert "--max-restarts -1 is out of range" in capsys.readouterr().err


def test_a_restart_continues_from_the_checkpoint_in_out_only_where_there_is_one(tmp_path):
    (tmp_path / "data").mkdir()
    data = write_corpus(tmp_path / "data", 2)
    out = str(tmp_path / "run")
    cfg = TrainConfig.of(out=out, data=data, overwrite=True)
    assert continued(cfg, out) is cfg  # nothing written yet: a restart starts as the first start did
    assert cli_main(["train", *TINY, "--data", data, "--out", out, "--steps", "2"]) == 0
    again = continued(cfg, out)
    assert again.options() == {**cfg.options(), "resume": out, "overwrite": False}


def test_only_the_launcher_that_holds_out_lets_its_workers_skip_the_lock(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    cfg = TrainConfig.of(out=out)
    monkeypatch.setenv("MESHTORCH_LAUNCHER_PID", str(os.getppid()))
    os.makedirs(out)
    # the variable names our parent, but nobody holds the lock (and the lock file names nobody)
    assert not launcher_holds(out)
    with RunDirLock(cfg, out):  # held by this process, which is not our parent
        assert not launcher_holds(out)
        monkeypatch.setenv("MESHTORCH_LAUNCHER_PID", str(os.getpid()))
        assert not launcher_holds(out)  # names the holder, but the holder is not this process's parent
    monkeypatch.delenv("MESHTORCH_LAUNCHER_PID")
    assert not launcher_holds(out)


def test_a_worker_whose_launcher_holds_out_skips_the_lock(tmp_path):
    # the worker: a child of this process, which holds the lock and is named by the variable and the file
    out = str(tmp_path / "run")
    ask = [sys.executable, "-c",
           f"from meshtorch.recipes.lm.restarts import launcher_holds as h; print(h({out!r}))"]
    with RunDirLock(TrainConfig.of(out=out), out):
        assert _run(ask, env={"MESHTORCH_LAUNCHER_PID": str(os.getpid())})[1].split() == ["True"]
        assert _run(ask, env={"MESHTORCH_LAUNCHER_PID": "1"})[1].split() == ["False"]  # not its parent
    assert _run(ask, env={"MESHTORCH_LAUNCHER_PID": str(os.getpid())})[1].split() == ["False"]  # released


def test_restart_count_is_torchruns_and_only_under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert restart_count() == 0  # a stray variable outside torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert restart_count() == 2


@pytest.mark.parametrize("chosen", [None, "3", "abc"])
def test_torchruns_workers_get_their_share_of_the_cores_and_no_warning_about_it(chosen, monkeypatch):
    """torchrun set OMP_NUM_THREADS=1 where it was unset and printed six lines of warning about it, at
    every meshtorch train/launch --max-restarts: the launcher now gives the workers their share of the
    cores (as the processes launcher does) itself; a value the user chose is theirs, one that is no
    number of threads ("abc", which torchrun passed on) is replaced by the share, as the others do."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # each worker's line is one write(2), atomic on a pipe: print's separate writes of the two workers
    # interleaved under load ("threads 1threads", " 1")
    program = textwrap.dedent("""
        import os, sys
        from meshtorch.launcher.elastic import run_elastic
        worker = "import os; os.write(1, ('threads %s\\\\n' % os.environ['OMP_NUM_THREADS']).encode())"
        run_elastic([sys.executable, "-c", worker], 2, {}, max_restarts=1)
        print("left", os.environ.get("OMP_NUM_THREADS"))  # this process's own is as it was
    """)
    code, out, err = _run([sys.executable, "-c", program], env={"OMP_NUM_THREADS": chosen} if chosen else {},
                          timeout=120)
    assert code == 0, err[-3000:]
    share = "3" if chosen == "3" else str(max(1, (os.cpu_count() or 1) // 2))
    assert sorted(out.splitlines()) == [f"left {chosen}", f"threads {share}", f"threads {share}"], out
    # torchrun's warning is gone; "abc" gets this launcher's own OpenMP's one line (as any program would)
    assert not [line for line in err.splitlines() if "OMP_NUM_THREADS" in line and
                not line.startswith("libgomp: Invalid value")], err[-3000:]


def test_a_failure_is_told_by_the_exception_a_worker_recorded_else_by_its_exit(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "TrainingError: the loss is nan", "extraInfo": {
        "py_callstack": "...", "timestamp": "1"}}}))
    recorded = ProcessFailure(local_rank=1, pid=10, exitcode=1, error_file=str(error_file))
    killed = ProcessFailure(local_rank=0, pid=11, exitcode=-9, error_file="<N/A>")
    want = "processor 1 raised TrainingError: the loss is nan"
    assert failure_text(ChildFailedError("w", {1: recorded})) == want
    assert failure_text(ChildFailedError("w", {0: killed})) == "processor 0 was killed by SIGKILL"
    assert torch.distributed.is_available()


def test_a_run_that_failed_for_good_says_how_to_go_on_in_its_out(tmp_path):
    """Seen: '... exited with code 1. no checkpoint was written: fix the cause and rerun', where the
    rerun in place was then refused for the metrics.jsonl the run had left, until --overwrite."""
    from meshtorch.recipes.lm.restarts import what_next

    out = tmp_path / "run"
    out.mkdir()
    assert what_next(str(out)) == "No checkpoint was written: fix the cause and rerun"
    (out / "metrics.jsonl").write_text("{}\n")
    assert what_next(str(out)).endswith(f"rerun it in place with --out {out} --overwrite")
    (out / "checkpoint").mkdir()
    assert what_next(str(out)).endswith(f"continue with --resume {out}")


def _failing_worker(tmp_path, monkeypatch, error, restart):
    """Run a worker of `meshtorch train --max-restarts 1` in this process, its start number ``restart``,
    its training raising ``error`` in a run whose newest checkpoint is of step 2; (exit status, stderr,
    the message torchrun's error file got)."""
    import meshtorch as mt
    from meshtorch.recipes.lm import trainer

    out = tmp_path / "run"
    mt.save(str(out / "checkpoint"), model=mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2)), step=2)
    options = TrainConfig.of(out=str(out), backend="torch", max_restarts=1).options()
    for k, v in {"TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": str(restart), "RANK": "0",
                 "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["-c", json.dumps(options)])
    monkeypatch.setattr(trainer, "train", lambda cfg: (_ for _ in ()).throw(error))
    err = tmp_path / "stderr"
    with open(err, "w") as f, pytest.raises(SystemExit) as ended:
        monkeypatch.setattr(sys, "stderr", f)
        trainer.restarting_worker()
    monkeypatch.undo()
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    return ended.value.code, err.read_text(), recorded


def _peer_left_error(call: str, group: list[int]):
    """The CommError a torch communicator raises where gloo found the connection to a peer closed."""
    from meshtorch.errors import CommError

    e = CommError(f"{call} failed because a processor of the group {group} exited or crashed")
    e.__cause__ = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    return e


def test_a_worker_that_saw_another_leave_says_so_in_one_line_and_where_it_restarts(tmp_path, monkeypatch):
    """Seen: on every restart the survivor of a killed processor printed ~80 lines of `[rank0]:`
    traceback (its CommError's chain), none of them saying what happened or what comes next."""
    from meshtorch.launcher.failures import processor_error

    seen = _peer_left_error("all_reduce over axes ('b',)", [0, 1])
    survivor = processor_error(seen, 0, {"b": 0})
    survivor.__cause__ = seen
    code, err, recorded = _failing_worker(tmp_path, monkeypatch, survivor, restart=0)
    assert code == 1
    assert err == SURVIVOR + "\n"
    # the launcher still learns the whole error (failure_text reads it when the run fails for good)
    assert recorded.startswith("ProcessorCommError: processor 0 {'b': 0} raised CommError: all_reduce")
    # in a larger group it cannot tell which of the others left
    from meshtorch.recipes.lm.restarts import worker_failed

    wide = _peer_left_error("all_gather", [0, 2, 4, 6])
    monkeypatch.setenv("RANK", "2")
    assert worker_failed(wide, TrainConfig.of(out=str(tmp_path / "none"))) == \
        "meshtorch train: processor 2 stopped: one of processors [0, 4, 6] exited or crashed"


def test_a_worker_that_failed_on_its_own_says_why_and_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    from meshtorch.errors import TrainingError
    from meshtorch.launcher.failures import processor_error

    nan = processor_error(TrainingError("the loss is nan at step 3"), 0, {"b": 0})
    code, err, _ = _failing_worker(tmp_path, monkeypatch, nan, restart=0)
    said = "meshtorch train: processor 0 {'b': 0} raised TrainingError: the loss is nan at step 3"
    assert (code, err) == (1, f"{said}; {RESTARTS}\n")
    # no restart left: the launcher's error says the run failed; an error that is no meshtorch error (a bug)
    # keeps its traceback, there being no log file to keep it in
    try:
        {}["vocab"]
    except KeyError as e:
        bug = processor_error(e, 0, {"b": 0})
        bug.__cause__ = e
    code, err, _ = _failing_worker(tmp_path, monkeypatch, bug, restart=1)
    assert code == 1 and err.startswith("Traceback (most recent call last):") and 'line' in err, err
    assert err.endswith("\nmeshtorch train: processor 0 {'b': 0} raised KeyError: 'vocab'\n"), err



def test_meshtorch_launch_with_restarts_waits_for_the_scripts_background_save(tmp_path):
    """Seen: under torchrun (``--max-restarts``, ``--nnodes``) the workers did not wait for their
    background save at the script's end: a failed write was only a warning at exit (exit status 0),
    where ``meshtorch launch`` without them waits for it and raises."""
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import meshtorch as mt
        from meshtorch.checkpoint import writer
        real = writer._write_slices
        def slow(tmp, rank, mine):
            time.sleep(0.5)
            if sys.argv[2] == "fail" and rank == 1:
                raise OSError(28, "No space left on device")
            return real(tmp, rank, mine)
        writer._write_slices = slow
        mt.save(sys.argv[1], model=mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 4)), step=1, background=True)
    """))
    base = [sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--device", "cpu",
            "--mesh", "b:2", "--rules", "d:b", "--max-restarts", "1", str(script)]
    code, _, err = _run(base + [str(tmp_path / "ok"), "ok"])
    assert code == 0, err[-3000:]
    assert latest(str(tmp_path / "ok")) == str(tmp_path / "ok" / "step-000001")
    code, _, err = _run(base + [str(tmp_path / "full"), "fail"])
    assert code == 1, err[-3000:]
    assert "raised CheckpointError: the background save of checkpoint" in err, err[-3000:]
    assert "No space left on device" in err and not (tmp_path / "full" / "step-000001").exists()
