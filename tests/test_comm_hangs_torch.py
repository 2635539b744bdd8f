"""Hangs on the torch backend: a collective's timeout names the processors that never joined it (a
worker stuck in a computation or stopped), not only the one that raised, and calls it no mismatch."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import meshtorch as mt
from meshtorch.comm import absent
from meshtorch.errors import CommError, ProcessorError
from meshtorch.mesh import Mesh

pytestmark = pytest.mark.timeout(120)


def absent_from_the_all_reduce(stuck: int, how: str):
    """Every processor but ``stuck`` all-reduces over m; ``stuck`` sleeps or stops itself."""
    comm = mt.current().comm
    # all in step first: the others then enter the second all_reduce within far less than the timeout of
    # each other (else one late on a loaded machine is rightly named as not having joined yet)
    comm.all_reduce(torch.ones(1), "m")
    if comm.rank == stuck:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # as `kill -STOP`; the launcher's SIGKILL ends it
        time.sleep(100)
    return comm.all_reduce(torch.ones(1), "m").item()


def test_a_timeout_names_the_processor_that_never_joined_and_no_mismatch():
    # stopped (as by `kill -STOP`): a stuck computation looks the same to the others (no report, no exit)
    with pytest.raises(ProcessorError) as info:
        mt.launch(absent_from_the_all_reduce, 2, "stop", mesh="m:3", backend="torch", timeout=3)
    err, msg = info.value, str(info.value)
    assert isinstance(err, CommError) and err.rank in (0, 1)  # one of those that waited
    assert "all_reduce over axes ('m',) called at" in msg and "test_comm_hangs_torch.py" in msg
    assert "did not complete within the 3 s timeout: processor 2 {'m': 2} never joined it: it is waiting " \
           "in no collective (stopped, stuck in a computation, or gone)" in msg
    assert "processor 0 {'m': 0} never" not in msg and "processor 1 {'m': 1} never" not in msg
    assert "same collective calls" not in msg and "check=True" not in msg  # nothing was mismatched
    assert "pass a larger timeout" in msg


def test_members_in_another_collective_are_named_with_their_call_site_as_a_mismatch():
    mine = {"kind": "all_reduce", "axes": ["m"], "group": [0, 1, 2, 3], "site": "a.py:1 in f"}
    other = {"kind": "all_gather", "axes": ["m"], "group": [0, 1, 2, 3], "site": "a.py:9 in g"}
    text, mismatch = absent.describe(mine, {1: mine, 3: other}, [0, 1, 2, 3], 0, Mesh("m:4"))
    assert mismatch
    assert text == ("processor 2 {'m': 2} never joined it: it is waiting in no collective (stopped, stuck in "
                    "a computation, or gone); processor 3 {'m': 3} is waiting in all_gather over axes ('m',) "
                    "called at a.py:9 in g")
    text, mismatch = absent.describe(mine, {}, [0, 1, 2], 1, Mesh("m:3"))
    assert (text, mismatch) == ("processors 0 {'m': 0}, 2 {'m': 2} never joined it: they are waiting in no "
                                "collective (stopped, stuck in a computation, or gone)", False)


def test_without_torchs_default_store_the_timeout_keeps_its_plain_message(monkeypatch):
    monkeypatch.setattr(absent, "default_store", lambda: None)
    assert absent.diagnose("all_reduce", ("m",), "a.py:1 in f", [0, 1], 0, Mesh("m:2")) is None
    # the private function it relies on is where this torch keeps it (outside a world: no store)
    from torch.distributed import distributed_c10d

    assert callable(getattr(distributed_c10d, "_get_default_store", None))


def test_a_peer_that_crashed_is_no_mismatch():
    """Seen after `kill -9` of a worker: the survivor's error said "failed because a processor of the
    group [0, 1] exited or crashed ... Every processor of a group must make the same collective calls
    in the same order; run with check=True", advice for a mismatch that was not there."""
    from types import SimpleNamespace

    from meshtorch.comm.torch import TorchCommunicator

    def reset():
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:53478: Connection reset by peer")

    comm = SimpleNamespace(timeout=300.0, rank=0, mesh=Mesh("b:2"))
    comm._failed = lambda *args: TorchCommunicator._failed(comm, *args)
    with pytest.raises(CommError) as info:
        TorchCommunicator._run(comm, "all_reduce", ("b",), [0, 1], reset)
    msg = str(info.value)
    assert "exited or crashed" in msg and "Connection reset by peer" in msg, msg
    assert "same collective calls" not in msg and "check=True" not in msg, msg


def test_a_call_site_is_a_file_not_python_minus_c():
    """`meshtorch train --max-restarts`'s workers run `python -c`: their errors named the call site
    '<string>:1 in <module>'. A frame without a file is passed over for one with a file."""
    from meshtorch.comm.base import user_call_site

    scope: dict = {"user_call_site": user_call_site}
    exec(compile("site = user_call_site()", "<string>", "exec"), scope)
    assert "test_comm_hangs_torch.py" in scope["site"] and "in test_a_call_site_is_a_file" in scope["site"]
