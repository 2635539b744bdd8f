"""The Replicator on the torch backend: 2 gloo processes match one process on the global batch."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import ProcessorError

# one xdist worker runs the whole module: its module fixture launches gloo processes once
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("test_replicator_gloo")]

try:
    from meshtorch.launcher import BACKENDS
except ImportError:  # pragma: no cover
    BACKENDS = ()
if "torch" not in BACKENDS or not torch.distributed.is_available():
    pytest.skip("meshtorch's torch backend is not available", allow_module_level=True)

from test_replicator import check_unused, reference, replica_program, unused_program  # noqa: E402


def _both(bucket_mb):
    # module level so the spawned processes can unpickle it; one spawn for all variants
    return [replica_program(bn, bucket_mb, True) for bn in (False, True)] + [unused_program()]


def _collectives():
    repl = mt.Replicator(device="cpu")
    x = torch.tensor([repl.replica_id + 1.0], requires_grad=True)
    y = repl.all_reduce(x, "max") + repl.broadcast(x, src=1) + repl.all_gather(x).sum()
    y.backward()
    return y.item(), x.grad.item(), repl.reduce("mean", repl.replica_id), repl.comm.backend


def _all(bucket_mb):
    # module level so the spawned processes can unpickle it; one world runs every program that
    # succeeds (a world starts two fresh interpreters)
    return {"replicas": _both(bucket_mb), "collectives": _collectives()}


@pytest.fixture(scope="module")
def gloo():
    """Each process's results of :func:`_all` on 2 gloo processes."""
    return mt.replicator.launch_replicas(_all, 0.001, num_replicas=2, backend="torch", timeout=120)


def _skip_a_collective():
    repl = mt.Replicator(device="cpu")
    if repl.replica_id == 0:
        repl.all_reduce(torch.ones(2))
    else:
        repl.broadcast(torch.ones(2))


def test_two_gloo_processes_match_one_process_on_global_batch(gloo):
    # buckets go out as asynchronous torch.distributed all_reduces here (no check)
    out = [per_process["replicas"] for per_process in gloo]
    check_unused([per_process[2] for per_process in out])
    for bn_index, bn in enumerate((False, True)):
        ref = reference(bn)
        for per_process in out:
            state, _ = per_process[bn_index]
            for k in ref:
                torch.testing.assert_close(state[k], ref[k], rtol=1e-9, atol=1e-9, msg=k)


def test_collectives_and_mismatch_on_gloo(gloo):
    out = [per_process["collectives"] for per_process in gloo]
    # y = max(1,2) + x_1 + (1 + 2) = 7; dy/dx summed over both replicas' y:
    # replica 0: max -> 0, broadcast -> 0, gather -> 2; replica 1: 2 + 2 + 2
    assert [o[:2] for o in out] == [(7.0, 2.0), (7.0, 6.0)]
    assert all(o[2] == 0.5 and o[3] == "torch" for o in out)
    with pytest.raises(ProcessorError, match="mismatch"):
        mt.replicator.launch_replicas(_skip_a_collective, num_replicas=2, backend="torch", timeout=60,
                                      check=True)
