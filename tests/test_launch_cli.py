"""`meshtorch launch --backend torch` (spawned on one node), plain torchrun, and the CLI's checks.

Each subprocess runs in its own session and is killed as a group on timeout,
so a stuck worker can never outlive the test.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

from meshtorch.cli import main as cli_main

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_harness import run_in_session  # noqa: E402

pytestmark = pytest.mark.timeout(200)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import meshtorch as mt
    if {init}:
        mt.init_distributed("m:2", "d:m")
    out_dir = sys.argv[1]
    ctx = mt.current()
    x = mt.from_global(torch.arange(12.0).reshape(3, 4), "batch:3,d:4")
    total = mt.reduce_sum(x * x).item()
    if len(sys.argv) > 2 and sys.argv[2] == "fail" and ctx.rank == 1:
        raise ValueError("boom on purpose")
    rec = dict(rank=ctx.rank, coords=ctx.coords, backend=ctx.comm.backend, total=total,
               local=x.local.tolist(), world=dist.get_world_size() if dist.is_initialized() else None,
               argv=sys.argv[1:])
    with open(os.path.join(out_dir, f"r{{ctx.rank}}.json"), "w") as f:
        json.dump(rec, f)
""")


def _run(cmd, timeout=150):
    return run_in_session(cmd, timeout=timeout)


def _records(d):
    return [json.load(open(d / f"r{r}.json")) for r in range(2)]


def _check_records(recs, argv):
    full = torch.arange(12.0).reshape(3, 4)
    for r, rec in enumerate(recs):
        assert rec["rank"] == r and rec["coords"] == {"m": r}
        assert rec["backend"] == "torch" and rec["world"] == 2
        assert rec["total"] == float((full * full).sum())  # 506
        assert rec["local"] == full[:, 2 * r: 2 * r + 2].tolist()  # d split over m
        assert rec["argv"] == argv


def test_meshtorch_launch_runs_script_on_processes(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT.format(init=False))
    code, _, err = _run([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "-n", "2",
                         "--mesh", "m:2", "--rules", "d:m", "--check", str(script), str(tmp_path)])
    assert code == 0, err[-3000:]
    _check_records(_records(tmp_path), [str(tmp_path)])


def test_meshtorch_launch_reports_failing_processor(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT.format(init=False))
    code, _, err = _run([sys.executable, "-m", "meshtorch", "launch", "--backend", "torch", "--mesh", "m:2",
                         "--rules", "d:m", "--timeout", "20", str(script), str(tmp_path), "fail"])
    assert code != 0
    assert "processor 1 {'m': 1} raised ValueError: boom on purpose" in err


def test_plain_torchrun_with_init_distributed(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT.format(init=True))
    code, _, err = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                         "2", str(script), str(tmp_path)])
    assert code == 0, err[-3000:]
    _check_records(_records(tmp_path), [str(tmp_path)])


def test_launch_threads_backend_in_process(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT.format(init=False).replace("dist.get_world_size() if dist.is_initialized()",
                                                        "2 if True"))
    main, argv, path = sys.modules["__main__"], list(sys.argv), list(sys.path)
    assert cli_main(["launch", "--backend", "threads", "--mesh", "m:2", "--rules", "d:m", str(script),
                     str(tmp_path)]) == 0
    # this process is itself again: the processors' runpy swaps of __main__ overlap, and a script
    # module left as __main__ would run in every child a later spawn starts
    assert sys.modules["__main__"] is main and sys.argv == argv and sys.path == path
    recs = _records(tmp_path)
    for rec in recs:
        rec["backend"] = "torch"  # the same program, the threads communicator
    _check_records(recs, [str(tmp_path)])


def test_mesh_size_must_match_process_count(capsys):
    assert cli_main(["launch", "-n", "2", "--mesh", "b:2,m:2", "prog_that_never_runs.py"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["launch", "-n", "2", "--mesh", "b:2,m:2", __file__]) == 2
    assert "mesh 'b:2,m:2' has 4 processors but -n 2 x --nnodes 1 starts 2" in capsys.readouterr().err
