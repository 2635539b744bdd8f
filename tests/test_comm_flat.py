"""Prepared all_reduces (``Communicator.prepare_all_reduce``, ``all_reduce_async``): data
parallel's gradient buckets and a loss's scalar, started every step in a few Python calls, are
counted, described, checked and reported as ``all_reduce_grouped`` of the same buffer, on every
backend; on the torch backend the process group's own ``allreduce`` runs them, with
``dist.all_reduce`` where it is missing or takes other arguments.

Reference: each processor's buffer is written in closed form from its rank, so the sums are
written out by hand; the counters are those of ``all_reduce_grouped`` run on the same buffers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshtorch as mt
import meshtorch.comm.torch as ct
from meshtorch.comm.base import as_axes
from meshtorch.errors import CommError, ProcessorError

pytestmark = pytest.mark.timeout(120)


def mine(rank: int, n: int = 5) -> torch.Tensor:
    return torch.arange(float(n)) + 10.0 * rank


def summed(ranks, n: int = 5) -> torch.Tensor:
    return sum(mine(r, n) for r in ranks)


def prepared_and_grouped(axes) -> dict:
    """Two starts of one prepared all_reduce, one all_reduce_async of a scalar, then the same calls
    as all_reduce_grouped: the values, and what the counters and the planner's watchers saw."""
    comm = mt.current().comm
    seen, waited = [], []
    with comm.stats.watching(lambda *call: seen.append(call), waits=lambda: lambda: waited.append(1)):
        before = comm.stats.copy()
        bucket = comm.prepare_all_reduce(axes, 5, torch.float32)
        flats = [mine(comm.rank) for _ in range(2)]
        works = [bucket.start(f) for f in flats]
        loss = comm.all_reduce_async(torch.tensor(comm.rank + 1.0), axes)
        out = [w.wait()[0] for w in works] + [loss.wait()[0]]
        watched = (list(seen), len(waited))
        counted = (comm.stats - before).as_dict()
        before = comm.stats.copy()
        grouped = [comm.all_reduce_grouped([t], axes, async_op=True).wait()[0]
                   for t in (mine(comm.rank), mine(comm.rank), torch.tensor(comm.rank + 1.0))]
        return {"out": out, "grouped": grouped, "counted": counted, "grouped_counted":
                (comm.stats - before).as_dict(), "watched": watched, "in_place": out[0] is flats[0],
                "shapes": [tuple(t.shape) for t in out]}


@pytest.mark.parametrize("backend, mesh, axes, groups", [
    ("threads", "b:2,m:2", "b", [(0, 2), (1, 3)]),
    ("threads", "b:2,m:2", ("b", "m"), [(0, 1, 2, 3)]),
    ("torch", "b:2", ["b"], [(0, 1)]),
])
def test_a_prepared_all_reduce_gives_and_counts_what_the_grouped_call_does(backend, mesh, axes, groups):
    results = mt.launch(prepared_and_grouped, axes, mesh=mesh, backend=backend, timeout=60)
    for rank, got in enumerate(results):
        group = next(g for g in groups if rank in g)
        for t in got["out"][:2] + got["grouped"][:2]:
            assert torch.equal(t, summed(group))
        assert got["out"][2].item() == got["grouped"][2].item() == sum(r + 1.0 for r in group)
        assert got["shapes"] == [(5,), (5,), ()]
        assert got["counted"] == got["grouped_counted"] == {
            f"all_reduce@{','.join(as_axes(axes))}": {"calls": 3, "bytes": 2 * 20 + 4}}
        calls, waits = got["watched"]
        assert len(calls) == 3 and waits == 3  # every start told to the planner's watchers, and its wait
        assert got["in_place"] == (backend == "torch")  # the torch backend reduces the buffer itself


def alone_and_misused() -> tuple:
    comm = mt.current().comm
    flat = mine(comm.rank)
    alone = comm.prepare_all_reduce("m", 5, torch.float32).start(flat).wait()[0]
    bucket = comm.prepare_all_reduce("b", 5, torch.float32)
    errors = []
    for wrong in (torch.zeros(5, dtype=torch.float64), torch.zeros(4), torch.zeros(10)[::2]):
        with pytest.raises(CommError) as info:
            bucket.start(wrong)
        errors.append(str(info.value))
    return alone is flat, comm.stats.calls(), errors


def test_a_group_of_one_is_its_buffer_uncounted_and_a_wrong_buffer_is_refused():
    alone, calls, errors = mt.launch(alone_and_misused, mesh="b:2,m:1")[0]
    assert alone and calls == 0
    prepared = "all_reduce over ('b',) prepared for 5 contiguous elements of torch.float32, started with a"
    assert errors == [f"{prepared} contiguous torch.float64[5]", f"{prepared} contiguous torch.float32[4]",
                      f"{prepared} strided torch.float32[5]"]


def mismatched_sizes():
    comm = mt.current().comm
    n = 5 + comm.rank  # processor 1's bucket is longer
    return comm.prepare_all_reduce("b", n, torch.float32).start(mine(comm.rank, n)).wait()[0]


@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_under_check_a_prepared_all_reduce_that_differs_names_both_call_sites(backend):
    with pytest.raises(ProcessorError) as info:
        mt.launch(mismatched_sizes, mesh="b:2", check=True, backend=backend, timeout=60)
    msg = str(info.value)
    assert "collective mismatch: the shape differs ((5,) on processor 0, (6,) on processor 1)" in msg, msg
    assert msg.count("test_comm_flat.py") >= 2 and "in mismatched_sizes" in msg, msg


def one_never_joins():
    comm = mt.current().comm
    if comm.rank == 0:
        return None  # returns: processor 1 waits in the prepared all_reduce alone
    return comm.prepare_all_reduce("b", 5, torch.float32).start(mine(comm.rank)).wait()[0]


def test_a_prepared_all_reduce_nobody_joins_names_the_collective_and_its_call_site():
    with pytest.raises(ProcessorError) as info:
        mt.launch(one_never_joins, mesh="b:2")
    msg = str(info.value)
    assert "all_reduce over axes ('b',) called at" in msg and "test_comm_flat.py" in msg, msg
    assert "left (returned from the program) and never joined it" in msg, msg


class Reset:
    """A process group's ``allreduce`` whose transport says the peer went away (at the start, or
    at the wait of the work it gives)."""

    def __init__(self, at: str):
        self.at = at

    def __call__(self, pg, tensors, opts):
        if self.at == "start":
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:53478: Connection reset by peer")
        return self

    def wait(self):
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:53478: Connection reset by peer")


def the_process_groups_own_call_and_its_fallbacks() -> dict:
    """On each process: prepared all_reduces through ``ProcessGroup.allreduce`` (``dist.all_reduce``
    counted: not called), then with a method that takes other arguments (a TypeError: falls back,
    remembered), then with none at all; then failures of the transport, at the start and at the wait."""
    comm = mt.current().comm
    real_all_reduce, real_method = dist.all_reduce, ct.process_group_allreduce
    used = []

    def counted(*args, **kwargs):
        used.append(1)
        return real_all_reduce(*args, **kwargs)

    def values(fresh) -> list[torch.Tensor]:
        bucket = fresh.prepare_all_reduce("b", 5, torch.float32)
        return [bucket.start(mine(comm.rank)).wait()[0] for _ in range(2)]

    def other_signature(pg):
        def allreduce(pg, tensors, opts):
            raise TypeError("allreduce(): incompatible function arguments")
        return allreduce

    got: dict = {}
    dist.all_reduce = counted
    try:
        fresh = type(comm)(comm.mesh)
        got["direct"] = values(fresh), len(used), "ProcessGroup.allreduce" in fresh._missing
        used.clear()
        ct.process_group_allreduce = other_signature
        fresh = type(comm)(comm.mesh)
        got["other signature"] = values(fresh), len(used), "ProcessGroup.allreduce" in fresh._missing
        used.clear()
        ct.process_group_allreduce = lambda pg: None
        got["none"] = values(type(comm)(comm.mesh)), len(used), None
        for at in ("start", "wait"):
            ct.process_group_allreduce = lambda pg, at=at: Reset(at)
            try:
                values(type(comm)(comm.mesh))
                got[at] = None
            except CommError as e:
                got[at] = str(e)
    finally:
        dist.all_reduce, ct.process_group_allreduce = real_all_reduce, real_method
    comm.barrier()
    return got


def test_the_torch_backend_runs_the_process_groups_allreduce_and_falls_back_to_dist_all_reduce():
    for got in mt.launch(the_process_groups_own_call_and_its_fallbacks, mesh="b:2", backend="torch",
                         timeout=60):
        for how, dist_calls, remembered in (("direct", 0, False), ("other signature", 2, True),
                                            ("none", 2, None)):
            out, used, missing = got[how]
            assert all(torch.equal(t, summed((0, 1))) for t in out), how
            assert (used, missing) == (dist_calls, remembered), how
        for at in ("start", "wait"):
            msg = got[at]
            assert msg is not None and "all_reduce over axes ('b',) called at" in msg, msg
            assert "exited or crashed" in msg and "Connection reset by peer" in msg, msg


def a_prepared_all_reduce_after_leaving() -> tuple:
    """A prepared all_reduce holds no process group: once the world is left (leave_groups), the
    groups are gone (a gloo group living on into the interpreter's exit aborted the process), and
    a start raises CommError."""
    import gc
    import weakref

    from meshtorch.launcher.world import shutdown

    comm = mt.current().comm
    bucket = comm.prepare_all_reduce("b", 5, torch.float32)
    first = bucket.start(mine(comm.rank)).wait()[0]
    group = weakref.ref(comm._process_group("b"))
    shutdown()
    gc.collect()
    try:
        bucket.start(mine(comm.rank))
        after = None
    except CommError as e:
        after = str(e)
    return first, group() is None, after


def test_a_prepared_all_reduce_lets_its_group_die_with_the_world():
    for first, gone, after in mt.launch(a_prepared_all_reduce_after_leaving, mesh="b:2", backend="torch",
                                        timeout=60):
        assert torch.equal(first, summed((0, 1)))
        assert gone and after is not None and "after this process left" in after, after
