"""The threads communicator: collective values against hand-derived results,
counters, failure propagation without hangs, and mismatch detection."""

import threading
import time

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import ProcessorError


def _comm():
    return mt.current().comm


def test_collective_values_on_2d_mesh():
    def prog():
        c = _comm()
        r = float(c.rank)
        t = torch.tensor([r, 10 * r])
        return {
            "sum_m": c.all_reduce(t, "m").tolist(),
            "max_b": c.all_reduce(t, "b", "max").tolist(),
            "min_all": c.all_reduce(t, ("b", "m"), "min").tolist(),
            "gather_m": c.all_gather(t.view(1, 2), "m", 0).tolist(),
            "rs_b": c.reduce_scatter(torch.arange(4.0) + r, "b", 0).tolist(),
            "a2a_m": c.all_to_all(torch.tensor([[r, r + 0.5]]), "m", 1, 0).tolist(),
            "bcast_m": c.broadcast(t, "m", src=1).tolist(),
            "shift_m": c.shift(t, "m", 1).tolist(),
            "wrap_m": c.shift(t, "m", 1, wrap=True).tolist(),
        }

    outs = mt.launch(prog, mesh="b:2,m:2")
    # ranks: (b,m) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1)
    assert [o["sum_m"] for o in outs] == [[1, 10], [1, 10], [5, 50], [5, 50]]
    assert [o["max_b"] for o in outs] == [[2, 20], [3, 30], [2, 20], [3, 30]]
    assert all(o["min_all"] == [0, 0] for o in outs)
    assert outs[2]["gather_m"] == [[2, 20], [3, 30]]
    # reduce_scatter over b of arange(4)+r: ranks 0 and 2 sum to [2,4,6,8]; member 0 keeps [2,4]
    assert outs[0]["rs_b"] == [2, 4] and outs[2]["rs_b"] == [6, 8]
    assert outs[1]["rs_b"] == [4, 6] and outs[3]["rs_b"] == [8, 10]
    # all_to_all along m: member j receives chunk j of every member, stacked in member order
    assert outs[0]["a2a_m"] == [[0.0], [1.0]] and outs[1]["a2a_m"] == [[0.5], [1.5]]
    assert outs[0]["bcast_m"] == [1, 10] and outs[2]["bcast_m"] == [3, 30]
    assert outs[0]["shift_m"] == [0, 0] and outs[1]["shift_m"] == [0, 0]
    assert outs[3]["shift_m"] == [2, 20] and outs[2]["wrap_m"] == [3, 30]


def test_counters_count_payload_per_axis_and_kind():
    def prog():
        c = _comm()
        c.all_reduce(torch.ones(8), "b")
        c.all_gather(torch.ones(2, 3), "m", 0)
        c.all_gather(torch.ones(2, 3), "m", 0)
        c.all_reduce(torch.ones(1), ("b", "m"))
        c.all_reduce(torch.ones(5), "one")  # a group of one: no traffic, not counted
        return c.stats.as_dict()

    stats = mt.launch(prog, mesh="b:2,m:2,one:1")[0]
    assert stats == {
        "all_gather@m": {"calls": 2, "bytes": 48},
        "all_reduce@b": {"calls": 1, "bytes": 32},
        "all_reduce@b,m": {"calls": 1, "bytes": 4},
    }


def test_exception_names_processor_and_does_not_hang():
    def prog():
        c = _comm()
        if c.coords == {"b": 1, "m": 0}:
            raise ValueError("boom on purpose")
        c.all_reduce(torch.ones(1), ("b", "m"))  # the others wait here for the dead one

    t0 = time.monotonic()
    with pytest.raises(ProcessorError, match=r"processor 2 \{'b': 1, 'm': 0\} raised ValueError"):
        mt.launch(prog, mesh="b:2,m:2", timeout=60)
    assert time.monotonic() - t0 < 30
    try:
        mt.launch(prog, mesh="b:2,m:2")
    except ProcessorError as e:
        assert e.rank == 2 and e.coords == {"b": 1, "m": 0}
        assert isinstance(e.__cause__, ValueError)


def test_mismatched_collectives_raise_with_call_sites():
    def prog():
        c = _comm()
        if c.rank == 0:
            c.all_gather(torch.ones(2), "b", 0)
        else:
            c.all_reduce(torch.ones(2), "b")

    with pytest.raises(ProcessorError) as info:
        mt.launch(prog, mesh="b:2", check=True)
    msg = str(info.value)
    assert "collective mismatch" in msg and "all_gather" in msg and "all_reduce" in msg
    assert msg.count("test_comm_threads.py:") == 2


def test_skipped_collective_times_out_naming_it():
    release = threading.Event()

    def prog():
        c = _comm()
        if c.rank == 0:
            c.all_reduce(torch.ones(2), "b")
        else:
            # busy elsewhere until the test lets it go (a 1.5 s sleep left 0.5 s of margin: with processor 0
            # late to its all_reduce on a loaded machine, 1 could return first and be named as having left)
            release.wait()

    try:
        with pytest.raises(ProcessorError, match=r"all_reduce over axes \('b',\) called at .*test_comm_"
                           r"threads.* did not complete within 1 s: processors \[1\] never joined it "
                           r"\(processor 1 is running outside any collective\)"):
            mt.launch(prog, mesh="b:2", timeout=1, check=True)
    finally:
        release.set()


def test_results_in_processor_order_with_args():
    assert mt.launch(lambda a, k=0: (mt.current().rank, a, k), 5, k=7, mesh="m:3") == [
        (0, 5, 7), (1, 5, 7), (2, 5, 7)]


def test_launch_restores_intra_op_threads():
    before = torch.get_num_threads()
    mt.launch(lambda: None, mesh="b:2")
    assert torch.get_num_threads() == before


def test_check_mode_catches_from_global_of_different_tensors():
    def prog():
        return mt.from_global(torch.randn(4, 4), "a:4,b:4", name="x").to_global()  # unseeded: differs

    with pytest.raises(ProcessorError, match="tensor 'x' of shape \\[a:4,b:4\\] differs between processors"):
        mt.launch(prog, mesh="b:2", check=True)

    def seeded():
        g = torch.Generator().manual_seed(0)
        return mt.from_global(torch.randn(4, 4, generator=g), "a:4,b:4").to_global()

    a, b = mt.launch(seeded, mesh="b:2", check=True)
    assert torch.equal(a, b)
