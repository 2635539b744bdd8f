"""Every placement the placer returns runs in the Pipeline and trains like the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import meshtorch as mt
from meshtorch.pipeline import Pipeline
from meshtorch.placement import OpGraph, Problem, evaluate, place
from meshtorch.placement.trace import DeviceSpec, split, trace

WIDTH = 6
# a fast link and slow compute, so that the placer splits even these tiny models
CHEAP_LINK = DeviceSpec(link_bandwidth=1e15, acc_flops=1e6, cpu_flops=1e5)


class Dag(nn.Module):
    """A DAG of ops over values of one shape: ``spec[i] = (kind, a, b)`` combines earlier values.

    Values ``0`` and ``1`` are the two inputs (``1`` is the second input, or the
    first one again: a shared input); value ``k + 2`` is the output of op ``k``.
    """

    def __init__(self, spec: list[tuple[str, int, int]], out: list[int]):
        super().__init__()
        self.spec, self.out = spec, out
        self.lin = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in spec)

    def forward(self, x, z):
        vals = [x, z]
        for k, (kind, a, b) in enumerate(self.spec):
            if kind == "linear":
                vals.append(self.lin[k](vals[a]))
            elif kind == "add":
                vals.append(vals[a] + self.lin[k](vals[b]))  # a residual over op b
            else:
                vals.append(torch.tanh(self.lin[k](vals[a])) * vals[b])  # a branch joined
        return sum(vals[i] for i in self.out)


@st.composite
def dags(draw):
    n = draw(st.integers(2, 7))
    spec = []
    for k in range(n):
        kind = draw(st.sampled_from(["linear", "add", "mul"]))
        # mostly recent values, sometimes far back: skips over several stages
        a = draw(st.integers(0, k + 1))
        b = draw(st.integers(0, k + 1))
        spec.append((kind, a, b))
    out = sorted(set(draw(st.lists(st.integers(2, n + 1), min_size=1, max_size=3))) | {n + 1})
    return spec, out


def _train_step(gm, placement, inputs, y, schedule, micro):
    def run():
        pipe = Pipeline(copy.deepcopy(gm), placement, microbatches=micro, schedule=schedule,
                        loss_fn=nn.functional.mse_loss)
        loss = pipe.forward_backward(inputs, y)
        return loss, {n: q.grad.clone() for n, q in pipe.module.named_parameters()
                      if q.grad is not None}

    return mt.launch(run, mesh=f"stage:{len(placement.stages)}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.integers(2, 4), st.booleans(), st.sampled_from(["gpipe", "1f1b"]))
def test_drawn_dags_place_split_and_train_like_unsplit(spec_out, devices, shared, schedule):
    spec, out = spec_out
    torch.manual_seed(0)
    model = Dag(spec, out)
    x = torch.randn(8, WIDTH)
    z = x if shared else torch.randn(8, WIDTH)
    y = torch.randn(8, WIDTH)
    gm = torch.fx.symbolic_trace(model)
    g = trace(gm, x[:4], z[:4], training=True, spec=CHEAP_LINK)
    p = place(g, Problem(devices=devices))
    assert p.problem.relay and p.is_contiguous()
    assert evaluate(g, p.problem, p.stages).max_load == pytest.approx(p.max_load)
    parts = split(gm, p)
    torch.testing.assert_close(parts(x, z), model(x, z))
    results = _train_step(gm, p, (x, z), y, schedule, micro=2)
    ref = copy.deepcopy(model)
    want = nn.functional.mse_loss(ref(x, z), y)
    want.backward()
    expected = {n: q.grad for n, q in ref.named_parameters() if q.grad is not None}
    got: dict[str, torch.Tensor] = {}
    for loss, grads in results:
        assert loss == pytest.approx(want.item(), rel=1e-5)
        assert not set(got) & set(grads)  # each parameter lives on one stage
        got.update(grads)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        a = self.l1(x)
        b = self.l2(a)
        return self.l3(b) + a


def test_residual_skipping_a_stage_runs_and_pays_the_relay():
    """The issue's case: stages {l1}, {l2}, {l3, add}; a = l1(x) passes through stage 1."""
    torch.manual_seed(0)
    model = Residual()
    gm = torch.fx.symbolic_trace(model)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    g = trace(gm, x[:4], spec=CHEAP_LINK)
    names = [n.name for n in g.nodes]
    where = {"x": 0, "l1": 0, "l2": 1, "l3": 2, "add": 2, "output": 2}
    stages = [("acc", [i for i, n in enumerate(names) if where[n] == s]) for s in range(3)]
    for nd in g.nodes:  # round numbers: transfers of 1 (l1's output) and 10 (l2's)
        nd.comm_time = {"l1": 1.0, "l2": 10.0}.get(nd.name, 0.0)
        nd.acc_time = 0.0
    relay = evaluate(g, Problem(devices=3), stages)
    paper = evaluate(g, Problem(devices=3, relay=False), stages)
    # stage 0 sends a; stage 1 receives a, sends a and b; stage 2 receives a and b
    assert [s.comm for s in relay.stages] == [1.0, 12.0, 11.0]
    # the paper's definition: stage 1 only receives a for l2 and sends b
    assert [s.comm for s in paper.stages] == [1.0, 11.0, 11.0]
    parts = split(gm, relay)
    assert len(parts.submod_1.graph.find_nodes(op="placeholder")) == 1  # a, relayed with b
    losses = _train_step(gm, relay, x, y, "1f1b", 4)
    want = nn.functional.mse_loss(model(x), y).item()
    assert [round(loss, 5) for loss, _ in losses] == [round(want, 5)] * 3


def test_relay_prices_what_split_sends():
    """The relay model's transfers are exactly the values ``split``'s stages pass on."""
    g = OpGraph()
    for n in "abcd":
        g.add_node(n, acc_time=1.0, comm_time=1.0)
    for u, v in ["ab", "bc", "cd", "ad"]:  # a skips b and c
        g.add_edge(u, v)
    p = evaluate(g, Problem(devices=4, relay=True), [("acc", [i]) for i in range(4)])
    # a crosses 3 borders, b and c one each: a sent, (a, b) in and out, (a, c) in and out
    assert [s.comm for s in p.stages] == [1.0, 3.0, 4.0, 2.0]


class _Saved:
    """A tensor autograd saved for the backward, counted while it lives (per thread: per stage)."""

    live = __import__("threading").local()

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.n = 0 if isinstance(t, nn.Parameter) else t.numel() * t.element_size()
        stats = _Saved.live.__dict__.setdefault("stats", [0, 0])
        stats[0] += self.n
        stats[1] = max(stats[1], stats[0])
        self.stats = stats

    def __del__(self):
        self.stats[0] -= self.n


@pytest.mark.parametrize("schedule,micro", [("gpipe", 4), ("1f1b", 4), ("1f1b", 2), ("2bw", 2)])
def test_memory_model_matches_the_pipelines_measured_peak(schedule, micro):
    """Per stage: peak saved activations = in-flight count x one forward's, and 2BW's versions."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh()) for _ in range(3)])
    gm = torch.fx.symbolic_trace(model)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    g = trace(gm, x[: 16 // micro], training=True, spec=CHEAP_LINK)
    names = [n.name for n in g.nodes]
    cut = {"input_1": 0, "_0_0": 0, "_0_1": 0, "_1_0": 1, "_1_1": 1, "_2_0": 2, "_2_1": 2,
           "output": 2}
    stages = [("acc", [i for i, n in enumerate(names) if cut[n.removesuffix(".grad")] == s])
              for s in range(3)]
    prob = Problem(devices=3, schedule=schedule, microbatches=micro)
    model_stages = evaluate(g, prob, stages).stages

    def run():
        pipe = Pipeline(copy.deepcopy(gm), evaluate(g, Problem(devices=3), stages),
                        microbatches=micro, schedule=schedule, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        forward, per = pipe.executor._forward, []

        def counted(*a):
            stats = _Saved.live.__dict__.setdefault("stats", [0, 0])
            before = stats[0]
            out = forward(*a)
            per.append(stats[0] - before)
            return out

        pipe.executor._forward = counted
        with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda s: s.t):
            pipe.train([(x, y)] * 3)
        versions = sum(sum(p.numel() * 4 for p in v) for v in pipe.weight_versions())
        return _Saved.live.stats[1], max(per), versions, sum(p.numel() * 4 for p in pipe.parameters())

    for st_model, (peak, one, versions, weights) in zip(model_stages, mt.launch(run, mesh="stage:3")):
        assert one > 0 and peak == st_model.in_flight * one
        assert versions == (2 if schedule == "2bw" else 1) * weights
        # resident: weights, grads, two Adam moments (4x), plus 2BW's second version
        assert st_model.memory - st_model.in_flight * sum(
            g.nodes[v].act_bytes for v in st_model.nodes) == 4 * weights + (versions - weights)
