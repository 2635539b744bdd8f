"""Pipeline runtime on the threads backend: GPipe/1F1B equal unsplit training, the executed
order equals the table, failures name the stage; point-to-point send/recv underneath."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import CommError, PipelineError, ProcessorError
from meshtorch.pipeline import Pipeline, build_schedule

pytestmark = pytest.mark.timeout(120)

WIDTHS = [5, 7, 6, 4, 3]  # stage boundaries of different widths: activations of different shapes


def make_stages(p: int, seed: int = 0) -> list[torch.nn.Module]:
    """``p`` float64 MLP stages; stage ``i`` maps WIDTHS[i] -> WIDTHS[i + 1] (tanh between)."""
    g = torch.Generator().manual_seed(seed)
    widths = WIDTHS[:p] + [2]
    stages = []
    for i in range(p):
        lin = torch.nn.Linear(widths[i], widths[i + 1]).double()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=torch.float64) * 0.5)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g, dtype=torch.float64) * 0.1)
        stages.append(torch.nn.Sequential(lin, torch.nn.Tanh()) if i < p - 1 else lin)
    return stages


def batches(steps: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, WIDTHS[0], generator=g, dtype=torch.float64),
             torch.randn(n, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def reference(stages, data, lr=0.01):
    """The unsplit model trained on whole batches with Adam: the ground truth."""
    model = torch.nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [m.state_dict() for m in model], losses


def run_pipeline(stages, data, schedule, m, lr=0.01, recompute=False):
    pipe = Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=m, schedule=schedule,
                    loss_fn=torch.nn.functional.mse_loss, recompute=recompute,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=lr))
    losses = [pipe.step(x, y) for x, y in data]
    return pipe.module.state_dict(), losses, pipe.trace, pipe.stage


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 6)])
def test_pipeline_equals_unsplit_training(schedule, p, m):
    stages, data = make_stages(p), batches(5, 12)
    want, want_losses = reference(stages, data)
    out = mt.launch(run_pipeline, stages, data, schedule, m, mesh=f"stage:{p}")
    for s, (state, losses, _, stage) in enumerate(out):
        assert stage == s
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for k, v in want[s].items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-12, msg=f"stage {s} {k}")
    # the test can fail: Adam moved the parameters away from their initial values
    assert not torch.allclose(out[0][0]["0.weight"], stages[0][0].weight)


def _train_batches(stages, data, schedule, m):
    pipe = Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=m, schedule=schedule,
                    loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    pipe.train(data)
    return pipe.trace


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
def test_executed_order_equals_table_and_dependencies_hold(schedule):
    # two batches in one table: flushed for GPipe/1F1B, overlapping for 2BW
    p, m = 3, 5
    stages, data = make_stages(p), batches(2, 10)
    out = mt.launch(_train_batches, stages, data, schedule, m, mesh=f"stage:{p}")
    table = build_schedule(schedule, p, m, batches=2)
    ends = {}
    for s, trace in enumerate(out):
        assert [(k, i) for k, i, *_ in trace] == table.order(s)
        assert [v for *_, v in trace] == [a.version for a in table.for_stage(s)]
        for k, i, t0, t1, _ in trace:
            ends[(s, k, i)] = (t0, t1)
    # a stage starts an action only after the actions it depends on ended on the other stages
    for (s, k, i), (t0, _) in ends.items():
        if k == "F" and s > 0:
            assert t0 >= ends[(s - 1, "F", i)][1]
        if k == "B" and s < p - 1:
            assert t0 >= ends[(s + 1, "B", i)][1]
    # 2BW: batch 1 entered stage 0 before batch 0 drained there (no flush); the others flush
    first_f1 = ends[(0, "F", m)][0]
    last_b0 = ends[(0, "B", m - 1)][1]
    assert (first_f1 < last_b0) == (schedule == "2bw")


class Boom(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("bad activation")
        return self.inner(x)


def _failing(stages):
    pipe = Pipeline(lambda i: Boom(stages[i]) if i == 1 else copy.deepcopy(stages[i]), microbatches=4,
                    loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x, y = batches(1, 8)[0]
    return pipe.step(x, y)


def test_stage_exception_fails_pipeline_naming_stage():
    t = time.monotonic()
    with pytest.raises(ProcessorError, match=r"stage 1 of axis 'stage' raised ValueError in the forward of "
                                             r"micro-batch 2: bad activation") as err:
        mt.launch(_failing, make_stages(3), mesh="stage:3", timeout=60)
    assert err.value.coords == {"stage": 1}
    assert time.monotonic() - t < 30  # the other stages were woken, not left to time out


def test_configuration_errors():
    stages = make_stages(2)
    with pytest.raises(ProcessorError, match="3 stages but axis 'stage' has 2"):
        mt.launch(lambda: Pipeline(make_stages(3), microbatches=2), mesh="stage:2")
    with pytest.raises(ProcessorError, match="axis 'pp' is not an axis of the mesh"):
        mt.launch(lambda: Pipeline(stages, axis="pp"), mesh="stage:2")
    with pytest.raises(ProcessorError, match="not divisible into 4|cannot be cut into 4"):
        mt.launch(lambda: Pipeline(lambda i: copy.deepcopy(stages[i]), microbatches=4,
                                   loss_fn=torch.nn.functional.mse_loss,
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)).step(
            torch.zeros(6, 5, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.float64)), mesh="stage:2")
    with pytest.raises(PipelineError, match="not one of"):
        Pipeline(stages, schedule="zigzag")


# ------------------------------------------------------------------ point-to-point transport
def _p2p():
    comm = mt.current().comm
    s = comm.coords["s"]
    if s == 0:
        comm.send(torch.arange(6.0).reshape(2, 3), "s", dst=1, tag=7)
        comm.send(torch.tensor([True, False]), "s", dst=1, tag=7)
        comm.send(torch.tensor([comm.coords["b"]]), "s", dst=1, tag=8)
        back = comm.recv("s", src=1)
        comm.wait_sends()
        return back.tolist()
    late = comm.recv("s", src=0, tag=8)  # tags are separate mailboxes; order holds within one
    a, b = comm.recv("s", src=0, tag=7), comm.recv("s", src=0, tag=7)
    comm.send(a.sum().reshape(1) + 100 * late, "s", dst=0)
    comm.wait_sends()
    return a.tolist(), b.tolist(), comm.stats.calls("s", "recv")


def test_send_recv_threads():
    out = mt.launch(_p2p, mesh="s:2,b:2")
    # ranks: (s0,b0), (s0,b1), (s1,b0), (s1,b1); each b has its own pair along s
    assert out[0] == [15.0] and out[1] == [115.0]
    assert out[2] == out[3] == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [True, False], 3)


def _recv_from_failed():
    comm = mt.current().comm
    if comm.coords["s"] == 0:
        raise RuntimeError("sender died")
    return comm.recv("s", src=0)


def test_recv_wakes_when_sender_fails_and_peer_errors():
    with pytest.raises(ProcessorError, match="sender died"):
        mt.launch(_recv_from_failed, mesh="s:2", timeout=60)
    with pytest.raises(ProcessorError, match="not another member"):
        mt.launch(lambda: mt.current().comm.send(torch.ones(1), "s", dst=0), mesh="s:2")
    with pytest.raises(ProcessorError, match="meta backend"):
        mt.launch(lambda: mt.current().comm.recv("s", src=1), mesh="s:2", backend="meta")
    with pytest.raises(ProcessorError, match="within 1 s"):
        mt.launch(lambda: mt.current().comm.recv("s", src=1 - mt.current().coords["s"]), mesh="s:2",
                  timeout=1)
    with pytest.raises(CommError, match="one axis"):
        mt.current().comm.send(torch.ones(1), ("a", "b"), dst=0)
