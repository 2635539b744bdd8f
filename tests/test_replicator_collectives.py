"""Replicator collectives: values, gradients, and failures that raise instead of hanging."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.errors import CommError, ProcessorError


def test_all_reduce_broadcast_all_gather_values():
    def prog():
        repl = mt.Replicator(device="cpu")
        r = repl.replica_id
        x = torch.tensor([r + 1.0, -r])
        return (repl.all_reduce(x, "sum").tolist(), repl.all_reduce(x, "mean").tolist(),
                repl.all_reduce(x, "max").tolist(), repl.all_reduce(x, "min").tolist(),
                repl.broadcast(x, src=2).tolist(), repl.all_gather(x).tolist(),
                repl.all_gather(x.reshape(2, 1), dim=1).tolist(), repl.reduce("sum", {"a": r, "b": [x]}))

    out = mt.replicator.launch_replicas(prog, num_replicas=3)
    for s, mean, mx, mn, bc, ag, ag1, red in out:
        assert s == [6.0, -3.0]
        assert mean == pytest.approx([2.0, -1.0])
        assert mx == [3.0, 0.0] and mn == [1.0, -2.0]
        assert bc == [3.0, -2.0]
        assert ag == [1.0, 0.0, 2.0, -1.0, 3.0, -2.0]
        assert ag1 == [[1.0, 2.0, 3.0], [0.0, -1.0, -2.0]]
        assert red["a"] == 3.0 and red["b"][0].tolist() == [6.0, -3.0]


@settings(max_examples=5, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 1000))
def test_gradients_are_those_of_the_summed_replica_losses(n, seed):
    """Replica r's loss is sum(c_r * f(x)) for its own c_r; autograd through the
    collectives must give d(sum_r loss_r)/dx_r, computed here by hand."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, 3, generator=g, dtype=torch.float64)
    cs = torch.randn(n, 3, generator=g, dtype=torch.float64)

    def prog():
        repl = mt.Replicator(device="cpu")
        r = repl.replica_id
        out = {}
        fns = {"sum": lambda x: repl.all_reduce(x, "sum"), "mean": lambda x: repl.all_reduce(x, "mean"),
               "max": lambda x: repl.all_reduce(x, "max"), "bcast": lambda x: repl.broadcast(x, src=n - 1),
               "gather": lambda x: repl.all_gather(x)}
        for name, f in fns.items():
            x = xs[r].clone().requires_grad_(True)
            y = f(x)
            c = cs[r] if name != "gather" else cs.reshape(-1)[: y.numel()] * (r + 1)
            (c * y).sum().backward()
            out[name] = x.grad
        return out

    res = mt.replicator.launch_replicas(prog, num_replicas=n)
    csum = cs.sum(0)
    arg = xs.argmax(0)
    for r in range(n):
        torch.testing.assert_close(res[r]["sum"], csum)
        torch.testing.assert_close(res[r]["mean"], csum / n)
        torch.testing.assert_close(res[r]["max"], torch.where(arg == r, csum, torch.zeros(3, dtype=xs.dtype)))
        torch.testing.assert_close(res[r]["bcast"], csum if r == n - 1 else torch.zeros(3, dtype=xs.dtype))
        # y = cat(x_0..x_{n-1}); replica q weighs it with (q+1) * c_flat; my slice is r
        weight = sum(q + 1 for q in range(n)) * cs.reshape(-1)[: 3 * n][3 * r: 3 * r + 3]
        torch.testing.assert_close(res[r]["gather"], weight)


def test_replica_skipping_a_collective_raises_not_hangs():
    def prog():
        repl = mt.Replicator(device="cpu")
        if repl.replica_id == 0:
            repl.all_reduce(torch.ones(2))
        return True

    with pytest.raises(ProcessorError) as info:
        mt.replicator.launch_replicas(prog, num_replicas=2, timeout=3, check=True)
    assert isinstance(info.value.__cause__, CommError)
    assert "never joined" in str(info.value) and "test_replicator_collectives.py" in str(info.value)


def test_replicas_calling_different_collectives_name_both_sites():
    def prog():
        repl = mt.Replicator(device="cpu")
        if repl.replica_id == 0:
            repl.all_reduce(torch.ones(2))
        else:
            repl.broadcast(torch.ones(2))
        return True

    with pytest.raises(ProcessorError, match="collective mismatch") as info:
        mt.replicator.launch_replicas(prog, num_replicas=2, timeout=20, check=True)
    assert str(info.value).count("test_replicator_collectives.py") >= 2


def test_gradient_sync_skipped_by_one_replica_raises():
    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            w = torch.nn.Parameter(torch.ones(3))
            opt = repl.wrap_optimizer(torch.optim.SGD([w], lr=0.1))
        if repl.replica_id == 1:
            return "skipped"        # replica 0's background bucket all_reduce waits in vain
        (w * 2).sum().backward()
        opt.step()
        return "stepped"

    with pytest.raises(ProcessorError, match="all_reduce"):
        mt.replicator.launch_replicas(prog, num_replicas=2, timeout=3, check=True)


def test_collective_inside_context_raises():
    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            repl.all_reduce(torch.ones(1))

    with pytest.raises(ProcessorError, match="inside repl.context"):
        mt.replicator.launch_replicas(prog, num_replicas=2, timeout=10)


def test_bad_arguments_name_the_fix():
    repl = mt.Replicator(device="cpu")
    with pytest.raises(CommError, match="not one of"):
        repl.all_reduce(torch.ones(1), "avg")
    with pytest.raises(CommError, match="src=3"):
        repl.broadcast(torch.ones(1), src=3)
    with pytest.raises(mt.errors.MeshError, match="device"):
        mt.Replicator(device="tpu")
    with pytest.raises(CommError, match="torch.optim.Optimizer"):
        repl.wrap_optimizer(object())
    assert repl.reduce("max", 3) == 3.0 and repl.num_replicas == 1
