"""Replicator training equals one process training on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mt
from mesh_harness import FailingBackward

STEPS, B = 10, 8


def make_net(bn: bool) -> torch.nn.Module:
    layers = [torch.nn.Conv2d(2, 4, 3)]
    if bn:
        layers.append(torch.nn.BatchNorm2d(4))
    layers += [torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3)]
    return torch.nn.Sequential(*layers).double()


def data(steps: int = STEPS, b: int = B):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, b, 2, 6, 6, generator=g, dtype=torch.float64) * 2 + 0.5
    y = torch.randint(0, 3, (steps, b), generator=g)
    return x, y


def reference(bn: bool) -> dict[str, torch.Tensor]:
    x, y = data()
    torch.manual_seed(0)
    model = make_net(bn)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for k in range(STEPS):
        loss = F.cross_entropy(model(x[k]), y[k])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def replica_program(bn: bool, bucket_mb: float, overlap: bool):
    x, y = data()
    repl = mt.Replicator(device="cpu")
    with repl.context():
        model = make_net(bn)
        if bn:
            model = repl.convert_sync_batchnorm(model)
        opt = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.02), bucket_mb=bucket_mb,
                                  overlap=overlap)
    b = B // repl.num_replicas
    step = iter(range(STEPS))

    def input_fn(ctx):
        k = next(step)
        sl = slice(ctx.replica_id * b, (ctx.replica_id + 1) * b)
        return x[k, sl], y[k, sl]

    def step_fn(batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    losses = [repl.reduce("mean", repl.run(step_fn, input_fn)) for _ in range(STEPS)]
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


@pytest.mark.parametrize("bn", [False, True], ids=["plain", "syncbn"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_threads_match_one_process_on_global_batch(n, bn):
    ref = reference(bn)
    # tiny buckets on some runs: many buckets must go out in the same order everywhere
    bucket_mb, overlap = {1: (25.0, True), 2: (0.0005, True), 4: (0.001, n % 2 == 0 and not bn)}[n]
    results = mt.replicator.launch_replicas(replica_program, bn, bucket_mb, overlap, num_replicas=n,
                                            timeout=60)
    for state, _ in results:
        assert state.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(state[k], ref[k], rtol=1e-9, atol=1e-9, msg=k)
    first_losses = results[0][1]
    for _, losses in results[1:]:
        assert [v.item() for v in losses] == [v.item() for v in first_losses]


def test_batchnorm_without_sync_differs():
    # guards the test above: per-replica BatchNorm statistics really give other weights
    ref = reference(True)

    def prog():
        x, y = data()
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = make_net(True)
            opt = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.02))
        r, b = repl.replica_id, B // 2
        for k in range(STEPS):
            loss = F.cross_entropy(model(x[k, r * b:(r + 1) * b]), y[k, r * b:(r + 1) * b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.state_dict()["0.weight"]

    w = mt.replicator.launch_replicas(prog, num_replicas=2)[0]
    assert not torch.allclose(w, ref["0.weight"], atol=1e-4)


def test_same_initial_weights_and_broadcast_from_replica_0():
    def prog():
        repl = mt.Replicator(device="cpu", seed=5)
        with repl.context():
            a = torch.nn.Linear(3, 2)
        # built outside the context with different seeds: wrap_optimizer broadcasts replica 0's
        torch.manual_seed(100 + repl.replica_id)
        b = torch.nn.Linear(3, 2)
        before = b.weight.detach().clone()
        repl.wrap_optimizer(torch.optim.SGD(b.parameters(), lr=0.1))
        return a.weight.detach(), before, b.weight.detach()

    out = mt.replicator.launch_replicas(prog, num_replicas=3)
    torch.manual_seed(5)
    expect = torch.nn.Linear(3, 2).weight.detach()
    for a, _, b in out:
        torch.testing.assert_close(a, expect, rtol=0, atol=0)
        torch.testing.assert_close(b, out[0][1], rtol=0, atol=0)
    assert not torch.equal(out[1][1], out[0][1])


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head0 = torch.nn.Linear(4, 1)
        self.head1 = torch.nn.Linear(4, 1)
        self.never = torch.nn.Linear(4, 1)

    def forward(self, x, which):
        return (self.head0 if which == 0 else self.head1)(torch.tanh(self.body(x))).sum()


def unused_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64)  # micro-batch, replica, example


def unused_reference() -> dict[str, torch.Tensor]:
    x = unused_data()
    torch.manual_seed(0)
    ref = TwoHeads().double()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for _ in range(2):
        ref_opt.zero_grad()
        for m in range(3):
            (sum(ref(x[m, r], r) for r in range(2)) / 2).backward()
        ref_opt.step()
    assert ref.never.weight.grad is None
    return ref.state_dict()


def unused_program():
    """Replica 0 uses head0, replica 1 head1, nobody uses `never`; two micro-batches
    accumulate under no_sync before the synchronised one."""
    x = unused_data()
    repl = mt.Replicator(device="cpu")
    with repl.context():
        model = TwoHeads().double()
        opt = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.05), bucket_mb=0.0001)
    r, comm = repl.replica_id, mt.current().comm
    calls = []
    for _ in range(2):
        opt.zero_grad()
        before = comm.stats.calls(kind="all_reduce")
        with repl.no_sync():
            for m in range(2):
                model(x[m, r], r).backward()
        calls.append(comm.stats.calls(kind="all_reduce") - before)
        model(x[2, r], r).backward()
        opt.step()
    return model.state_dict(), model.never.weight.grad, calls


def check_unused(results) -> None:
    ref = unused_reference()
    for state, never_grad, calls in results:
        assert never_grad is None
        assert calls == [0, 0]
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=k)


def test_unused_parameters_and_no_sync_accumulation():
    check_unused(mt.replicator.launch_replicas(unused_program, num_replicas=2))


def test_bucket_count_is_the_number_of_all_reduces():
    def prog(bucket_mb):
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
            opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=bucket_mb)
        comm = mt.current().comm
        before = comm.stats.calls(kind="all_reduce")
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        return comm.stats.calls(kind="all_reduce") - before

    # 2 weights of 16 KiB, 2 biases of 256 B: 1 bucket at 1 MiB, one per weight (+bias) at 17 KiB
    assert mt.replicator.launch_replicas(prog, 1.0, num_replicas=2) == [1, 1]
    assert mt.replicator.launch_replicas(prog, 17 / 1024, num_replicas=2) == [2, 2]
    assert mt.replicator.launch_replicas(prog, 1e-6, num_replicas=2) == [4, 4]


@pytest.mark.parametrize("overlap", [True, False])
def test_grads_live_in_the_buckets_and_accumulate_like_one_process(overlap):
    """zero_grad(set_to_none=False) and two backwards per step: autograd accumulates
    straight into the bucket buffers (no new gradient tensors after the first step),
    and the result is still one process's sum of the two global-batch gradients."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 2, 5, 4, generator=g, dtype=torch.float64)  # step, backward, replica, ex

    def loss(model, xb):
        return torch.tanh(model(xb)).pow(2).mean()

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        ref_opt.zero_grad(set_to_none=False)
        for k in range(2):
            (sum(loss(ref, x[s, k, r]) for r in range(2)) / 2).backward()
        ref_opt.step()

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
            opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      bucket_mb=1e-4, overlap=overlap)
        r, ptrs = repl.replica_id, []
        for s in range(3):
            opt.zero_grad(set_to_none=False)
            for k in range(2):
                loss(model, x[s, k, r]).backward()
            opt.step()
            ptrs.append([p.grad.data_ptr() for p in model.parameters()])
        return model.state_dict(), ptrs

    for state, ptrs in mt.replicator.launch_replicas(prog, num_replicas=2):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-12, atol=1e-12, msg=k)
        assert ptrs[0] == ptrs[1] == ptrs[2]      # the same bucket slots every step


def test_backward_that_raises_midway_leaves_the_next_step_correct():
    """The head's bucket goes out before the body's backward raises, and the
    end-of-backward callback never runs. The next backward must start a fresh round;
    training then matches one process that skipped the failed step."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 4, 3, generator=g, dtype=torch.float64)  # step, replica, example

    def make():
        return torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 1).double()

    def loss(body, head, xb, fail=False):
        return head(FailingBackward.apply(torch.tanh(body(xb)), fail)).pow(2).mean()

    torch.manual_seed(0)
    body, head = make()
    ref_opt = torch.optim.Adam([*body.parameters(), *head.parameters()], lr=0.05)
    for s in (1, 2):
        ref_opt.zero_grad()
        (sum(loss(body, head, x[s, r]) for r in range(2)) / 2).backward()
        ref_opt.step()
    ref = [p.detach() for p in (*body.parameters(), *head.parameters())]

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            body, head = make()
            params = [*body.parameters(), *head.parameters()]
            opt = repl.wrap_optimizer(torch.optim.Adam(params, lr=0.05), bucket_mb=1e-5)
        r, comm, calls = repl.replica_id, mt.current().comm, []
        for s in range(3):
            opt.zero_grad()
            before = comm.stats.calls(kind="all_reduce")
            try:
                loss(body, head, x[s, r], fail=s == 0).backward()
            except RuntimeError as e:
                assert "on purpose" in str(e) and s == 0
                repl.reduce("sum", 0.0)    # queued behind the head's buckets: they are done
                continue
            opt.step()
            calls.append(comm.stats.calls(kind="all_reduce") - before)
        return [p.detach() for p in params], calls

    for got, calls in mt.replicator.launch_replicas(prog, num_replicas=2):
        assert calls == [4, 4]    # one per parameter's bucket, none sent twice
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_refresh_after_add_param_group_then_remove():
    """refresh() re-buckets with the new group's parameters (each hooked once);
    remove() turns the optimizer back into a local one."""
    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            a = torch.nn.Parameter(torch.zeros(2))
            opt = repl.wrap_optimizer(torch.optim.SGD([a], lr=1.0))
        b = torch.nn.Parameter(torch.zeros(3))
        opt.add_param_group({"params": [b]})
        sync = repl._syncs[-1]
        sync.refresh()
        r = repl.replica_id
        ((a * 1.0).sum() + (b * (r + 1)).sum()).backward()   # mean grads: a 1, b 1.5
        opt.step()
        after_sync = (a.tolist(), b.tolist())
        sync.remove()
        opt.zero_grad()
        (b * (r + 1)).sum().backward()                       # local gradient only
        opt.step()
        return after_sync, b.tolist()

    out = mt.replicator.launch_replicas(prog, num_replicas=2)
    for r, (after_sync, b) in enumerate(out):
        assert after_sync == ([-1.0, -1.0], [-1.5, -1.5, -1.5])
        assert b == [-1.5 - (r + 1)] * 3


def test_the_old_launch_name_warns_and_does_the_same():
    # mt.replicator.launch read as a second mt.launch: deprecated for a release
    with pytest.warns(DeprecationWarning, match="launch_replicas"):
        got = mt.replicator.launch(lambda: mt.Replicator(device="cpu").replica_id, num_replicas=2)
    assert got == [0, 1]
