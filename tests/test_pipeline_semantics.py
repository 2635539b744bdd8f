"""PipeDream-2BW's update rule, data-parallel replicas of a pipeline, activation recomputation,
and a module cut by the placer: each against a single-process reference written here."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

import meshtorch as mt
from meshtorch.errors import ProcessorError
from meshtorch.pipeline import Pipeline

pytestmark = pytest.mark.timeout(120)

from test_pipeline import batches, make_stages, reference  # noqa: E402

LR = 0.05


def two_bw_reference(stages, data, lr=LR):
    """PipeDream-2BW written directly: W(t+1) = W(t) - lr * grad f(W(t-1)) on the whole batch,
    with W(-1) = W(0) (the first step uses W(0))."""
    model = torch.nn.Sequential(*copy.deepcopy(stages))
    names = [n for n, _ in model.named_parameters()]
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    w_prev = {n: v.clone() for n, v in w.items()}
    for x, y in data:
        at_prev = {n: v.clone().requires_grad_(True) for n, v in w_prev.items()}
        loss = torch.nn.functional.mse_loss(functional_call(model, at_prev, (x,)), y)
        grads = torch.autograd.grad(loss, [at_prev[n] for n in names])
        w_prev = {n: v.clone() for n, v in w.items()}
        w = {n: w[n] - lr * g for n, g in zip(names, grads)}
    return w


def _two_bw(stages, data, m, how="step"):
    pipe = Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=m, schedule="2bw",
                    loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    if how == "step":  # one flushed batch per call
        for x, y in data:
            pipe.step(x, y)
    elif how == "train":  # every batch in one table, no flush (the paper's steady state)
        pipe.train(data)
    else:  # two tables: the weight versions carry over between calls
        pipe.train(data[:2])
        pipe.train(data[2:])
    assert pipe.batches_trained == len(data)
    return pipe.module.state_dict()


@pytest.mark.parametrize("p,m,how", [(2, 4, "step"), (4, 4, "step"), (2, 4, "train"), (4, 4, "train"),
                                     (4, 3, "train"), (3, 4, "split")])
def test_2bw_follows_the_delayed_update_rule(p, m, how):
    stages, data = make_stages(p), batches(5, 12 if m == 3 else 8)
    want = two_bw_reference(stages, data)
    out = mt.launch(_two_bw, stages, data, m, how, mesh=f"stage:{p}")
    sync = torch.nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(sync.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(sync(x), y).backward()
        opt.step()
    for s, state in enumerate(out):
        for k, v in state.items():
            torch.testing.assert_close(v, want[f"{s}.{k}"], rtol=1e-10, atol=1e-12, msg=f"stage {s} {k}")
    # the delay matters: synchronous SGD ends elsewhere, so this test can tell 2BW from 1F1B
    assert not torch.allclose(out[0]["0.weight"], sync[0][0].weight, atol=1e-6)


def test_2bw_without_flush_needs_enough_microbatches():
    stages, data = make_stages(4), batches(3, 8)
    with pytest.raises(ProcessorError, match=r"before the update of batch 0.*microbatches >= stages - 1 = 3"):
        mt.launch(_two_bw, stages, data, 2, "train", mesh="stage:4")


def test_2bw_first_step_equals_synchronous_step():
    stages, data = make_stages(2), batches(1, 8)
    out = mt.launch(_two_bw, stages, data, 2, mesh="stage:2")
    sync = torch.nn.Sequential(*copy.deepcopy(stages))
    torch.nn.functional.mse_loss(sync(data[0][0]), data[0][1]).backward()
    for s, state in enumerate(out):
        for k, v in state.items():
            p = sync[s].get_parameter(k)
            torch.testing.assert_close(v, p.detach() - LR * p.grad, rtol=1e-12, atol=1e-14)


def _replicas(stages, data, m, schedule):
    ctx = mt.current()
    r, n = ctx.coords["dp"], ctx.mesh.axis_size("dp")
    pipe = Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=m, schedule=schedule,
                    loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    # each replica of the pipeline trains on its own rows of the batch
    losses = [pipe.step(x.chunk(n)[r], y.chunk(n)[r]) for x, y in data]
    return pipe.stage, pipe.module.state_dict(), losses


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_data_parallel_replicas_of_the_pipeline(schedule):
    stages, data = make_stages(2), batches(5, 16)
    want, want_losses = reference(stages, data)
    out = mt.launch(_replicas, stages, data, 4, schedule, mesh="dp:2,stage:2")
    assert [o[0] for o in out] == [0, 1, 0, 1]
    for stage, state, losses in out:
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for k, v in want[stage].items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-12, msg=f"stage {stage} {k}")


class Counting(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _recompute(stages, data, m, recompute):
    pipe = Pipeline(lambda i: Counting(copy.deepcopy(stages[i])), microbatches=m, schedule="1f1b",
                    recompute=recompute, loss_fn=torch.nn.functional.mse_loss,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    for x, y in data:
        pipe.step(x, y)
    return pipe.module.inner.state_dict(), pipe.module.calls


def test_recomputation_gives_the_same_training_and_reruns_forwards():
    stages, data = make_stages(3), batches(3, 12)
    want, _ = reference(stages, data)
    out = mt.launch(_recompute, stages, data, 4, True, mesh="stage:3")
    for s, (state, calls) in enumerate(out):
        assert calls == 3 * 4 * 2  # every forward ran again at its backward
        for k, v in want[s].items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-12)
    plain = mt.launch(_recompute, stages, data, 4, False, mesh="stage:3")
    assert [c for _, c in plain] == [3 * 4] * 3


def _placed(net, placement, data):
    pipe = Pipeline(net, placement, microbatches=2, schedule="1f1b", loss_fn=torch.nn.functional.mse_loss,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    for x, y in data:
        pipe.step(x, y)
    return pipe.module.state_dict()


def test_module_split_by_the_placer():
    from meshtorch.placement import Problem, place
    from meshtorch.placement.trace import DeviceSpec, trace

    stages, data = make_stages(4), batches(3, 8)
    net = torch.fx.symbolic_trace(torch.nn.Sequential(*copy.deepcopy(stages)))
    # fast links, so that the placer splits this tiny model at all
    placement = place(trace(net, data[0][0], spec=DeviceSpec(link_bandwidth=1e18)), Problem(devices=2))
    assert len(placement.stages) == 2
    want, _ = reference(stages, data)
    out = mt.launch(_placed, net, placement, data, mesh="stage:2")
    got = {k: v for state in out for k, v in state.items()}
    # each stage keeps the parameters' own paths in the traced model ("0.0.weight")
    flat = {f"{i}.{k}": v for i, sd in enumerate(want) for k, v in sd.items()}
    assert sorted(got) == sorted(flat)
    for k, v in flat.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12, msg=k)
