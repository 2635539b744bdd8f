"""Chunks for interleaved 1F1B: the DP and the MILP against brute force, the step-time formula
against the simulator, and `meshtorch place --virtual-stages`."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtorch.cli import main
from meshtorch.errors import PlacementError
from meshtorch.pipeline import build_schedule, simulate
from meshtorch.placement import OpGraph, Problem, place
from meshtorch.placement.interleave import compare_virtual_stages, simulated_step_time, step_time
from meshtorch.placement.problem import chunk_in_flight

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _chain(times, comm=0.0) -> OpGraph:
    g = OpGraph()
    for i, t in enumerate(times):
        g.add_node(f"l{i}", acc_time=float(t), comm_time=comm)
    for i in range(len(times) - 1):
        g.add_edge(i, i + 1)
    return g


def peaks_from_table(p: int, v: int, m: int) -> list[int]:
    """Each model chunk's most stashed micro-batches, replayed from the executor's table."""
    table = build_schedule("interleaved", p, m, virtual_stages=v)
    peak = [0] * (p * v)
    for s in range(p):
        live: dict[int, int] = {}
        for a in sorted((a for a in table.actions if a.stage == s), key=lambda a: a.slot):
            c = table.model_chunk(a)
            live[c] = live.get(c, 0) + {"F": 1, "B": -1}.get(a.kind, 0)
            peak[c] = max(peak[c], live[c])
    return peak


def reference(graph: OpGraph, where: list[int], p: int, v: int, m: int, memory: float, relay: bool) -> float:
    """Max chunk load of the chunk assignment ``where`` (inf if infeasible), from the definitions:
    a chunk pays its nodes' times plus the transfers across its borders (relayed ones on every chunk
    they pass with ``relay``); device ``d`` holds chunks ``d, d + p, ...``, each with its weights and
    ``peak(c)`` micro-batches of activations."""
    S = p * v
    if sorted(set(where)) != list(range(S)) or any(where[a] > where[b] for a, b, _ in graph.edges):
        return math.inf
    peak = peaks_from_table(p, v, m)
    load = [0.0] * S
    mem = [0.0] * S
    for i, nd in enumerate(graph.nodes):
        load[where[i]] += nd.acc_time
        mem[where[i]] += nd.mem_bytes + peak[where[i]] * nd.act_bytes
    for u, nd in enumerate(graph.nodes):
        outs = [b for a, b, _ in graph.edges if a == u]
        if not outs:
            continue
        span = [where[u]] + [where[b] for b in outs]
        lo, hi = min(span), max(span)
        for s in range(S):
            if relay:
                load[s] += nd.comm_time * ((lo < s <= hi) + (lo <= s < hi))
            elif any((where[x] == s) != (where[u] == s) for x in outs):
                load[s] += nd.comm_time
    if any(sum(mem[d::p]) > memory * (1 + 1e-9) for d in range(p)):
        return math.inf
    return max(load)


@st.composite
def instances(draw):
    n = draw(st.integers(3, 6))
    g = OpGraph()
    for i in range(n):
        g.add_node(f"n{i}", acc_time=float(draw(st.integers(0, 6))), cpu_time=1.0,
                   comm_time=float(draw(st.integers(0, 2))), mem_bytes=float(draw(st.integers(0, 4))),
                   act_bytes=float(draw(st.integers(0, 2))))
    chain = draw(st.booleans())
    for j in range(1, n):
        preds = [j - 1] if chain else draw(st.sets(st.integers(0, j - 1), max_size=2))
        for i in sorted(preds):
            g.add_edge(i, j)
    p = draw(st.integers(1, 2))
    v = draw(st.integers(1, min(3, n // p)))
    m = p * draw(st.integers(1, 2))
    memory = draw(st.one_of(st.none(), st.integers(4, 30).map(float)))
    return g, p, v, m, memory, draw(st.booleans())


def brute_force(g: OpGraph, p: int, v: int, m: int, memory: float, relay: bool) -> float:
    return min(reference(g, list(w), p, v, m, memory, relay)
               for w in itertools.product(range(p * v), repeat=len(g.nodes)))


@SETTINGS
@given(instances())
def test_dp_and_milp_place_chunks_as_well_as_brute_force(case):
    g, p, v, m, memory, relay = case
    prob = Problem(devices=p, memory=memory, training=True, schedule="interleaved", virtual_stages=v,
                   microbatches=m, relay=relay)
    best = brute_force(g, p, v, m, math.inf if memory is None else memory, relay)
    for algorithm in ("dp", "ilp"):
        if math.isinf(best):
            with pytest.raises(PlacementError):
                place(g, prob, algorithm)
            continue
        got = place(g, prob, algorithm)
        where = got.device_of()
        assert len(got.stages) == p * v
        assert reference(g, where, p, v, m, math.inf if memory is None else memory, relay) == \
            pytest.approx(got.max_load)
        assert got.max_load == pytest.approx(best, abs=1e-6), algorithm
        assert got.info.get("exact", got.info.get("optimal")) is True


def _memory_bound_chain() -> OpGraph:
    g = _chain([2, 2, 2, 2, 1, 2])
    for nd, mem in zip(g.nodes, [4, 2, 4, 4, 0, 0]):
        nd.mem_bytes = float(mem)
    return g


def test_when_memory_binds_across_a_devices_chunks_the_milp_finishes_the_dps_work(monkeypatch):
    from meshtorch.placement import milp

    g = _memory_bound_chain()
    free = Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=2)
    assert place(g, free).algorithm == "dp"
    prob = Problem(devices=2, memory=8.0, schedule="interleaved", virtual_stages=2, microbatches=2)
    best = brute_force(g, 2, 2, 2, 8.0, False)
    got = place(g, prob)  # the DP's fastest chunks put 10 bytes on a device: the MILP takes over
    assert got.algorithm == "dp+ilp" and got.info["exact"] is True and got.max_load == best == 4.0
    assert max(got.info["device_memory"]) <= 8.0

    def no_milp(*a, **k):
        raise PlacementError("the MILP found no placement within 0 s")

    monkeypatch.setattr(milp, "solve_milp", no_milp)
    got = place(g, prob)  # the DP's restriction alone: each chunk within 4 bytes
    assert got.info["exact"] is False and got.info["lower_bound"] == best < got.max_load == 5.0
    assert max(got.info["device_memory"]) <= 8.0


def test_chunk_stashes_are_the_tables_and_never_undercount_a_device():
    for p, v, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 1, 4)]:
        peaks = list(chunk_in_flight(p, v, m))
        assert peaks == peaks_from_table(p, v, m)
        table = build_schedule("interleaved", p, m, virtual_stages=v)
        for s in range(p):  # with every chunk's stash 1 byte, the device peak is max_in_flight
            assert sum(peaks[s::p]) >= table.max_in_flight(s)
    assert chunk_in_flight(4, 1, 8) == (4, 3, 2, 1)  # 1F1B's p - s


@SETTINGS
@given(st.lists(st.integers(1, 9), min_size=4, max_size=9), st.integers(1, 2), st.integers(1, 3))
def test_the_step_time_bounds_the_replayed_table_and_is_it_for_equal_chunks(times, p, k):
    g, m = _chain(times), p * k
    for v in range(1, len(times) // p + 1):
        pl = place(g, Problem(devices=p, schedule="interleaved", virtual_stages=v, microbatches=m))
        assert simulated_step_time(pl) <= step_time(pl) + 1e-9
    even = place(_chain([2] * (4 * p)), Problem(devices=p, schedule="interleaved", virtual_stages=2,
                                                 microbatches=m))
    assert simulated_step_time(even) == pytest.approx(step_time(even)) == (2 * m + p - 1) * 4


def test_simulate_takes_a_cost_per_model_chunk():
    table = build_schedule("interleaved", 2, 2, virtual_stages=2)
    even = simulate(table, forward=[1, 1], backward=[2, 2])
    assert simulate(table, forward=[0.5] * 4, backward=[1.0] * 4).step_time == even.step_time
    slow = simulate(table, forward=[0.5, 0.5, 0.5, 2.0], backward=[1.0] * 4)
    assert slow.step_time > even.step_time and slow.busy == [6.0, 9.0]


def test_compare_says_when_interleaving_pays():
    # 8 unit layers, 2 devices, 2 micro-batches, step (2v + 1) x slowest chunk; a chunk pays c per border.
    # c = 0: v = 1: 3 x 4; v = 2: 5 x 2. c = 1/2: v = 1: 3 (4 + c); v = 2: ends of 2 (2 + c), inner of 2
    # (2 + 2c): 5 x 3; v = 3: ends of 2 (2.5), inner of 1 (2): 7 x 2.5; v = 4: 9 x (1 + 2c)
    fast = compare_virtual_stages(_chain([1] * 8), Problem(devices=2, microbatches=2), 2)
    assert [o.step_time for o in fast.options] == [12.0, 10.0] and fast.best == 2
    assert fast.speedup == pytest.approx(1.2)
    slow = compare_virtual_stages(_chain([1] * 8, comm=0.5), Problem(devices=2, microbatches=2), 4)
    assert [o.step_time for o in slow.options] == [13.5, 15.0, 17.5, 18.0] and slow.best == 1
    assert "v = 1 wins" in slow.summary()


@pytest.mark.parametrize("problem, match", [
    (Problem(devices=2, schedule="1f1b", virtual_stages=2, microbatches=2), "interleaved schedule"),
    (Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=3), "multiple of 2"),
    (Problem(devices=2, schedule="interleaved", virtual_stages=2), "multiple of 2"),
    (Problem(devices=2, schedule="interleaved", virtual_stages=5, microbatches=2), "10 chunks"),
    (Problem(devices=100, schedule="interleaved", virtual_stages=50, microbatches=100), "more than the 4096"),
    (Problem(devices=2, schedule="interleaved", virtual_stages=0, microbatches=2), ">= 1"),
    (Problem(devices=2, cpus=1, schedule="interleaved", virtual_stages=2, microbatches=2), "cpus"),
    (Problem(devices=2, max_replicas=2, training=True, schedule="interleaved", microbatches=2), "replicas"),
])
def test_bad_interleaved_problems_are_named(problem, match):
    with pytest.raises(PlacementError, match=match):
        place(_chain([1] * 8), problem)


def test_only_the_exact_algorithms_place_chunks():
    prob = Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=2)
    with pytest.raises(PlacementError, match="'dp'"):
        place(_chain([1] * 8), prob, "greedy")
    with pytest.raises(PlacementError, match="colocated"):  # 8 nodes, but one colour: 1 supernode
        g = _chain([1] * 8)
        for nd in g.nodes:
            nd.color = "x"
        place(g, prob)


def _cli(tmp_path, capsys, *flags) -> tuple[int, str, str]:
    path = tmp_path / "g.json"
    _chain([1] * 8).to_json(path)
    rc = main(["place", str(path), *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_places_chunks_and_picks_v(tmp_path, capsys):
    rc, out, _ = _cli(tmp_path, capsys, "--devices", "2", "--microbatches", "2", "--virtual-stages", "2")
    assert rc == 0 and "step time 10" in out and "acc1" in out
    rc, out, _ = _cli(tmp_path, capsys, "--devices", "2", "--microbatches", "2", "--virtual-stages", "2",
                      "--json")
    got = json.loads(out)
    assert (got["virtual_stages"], got["step_time"], got["max_load"], len(got["stages"])) == (2, 10.0, 2.0, 4)
    assert got["info"]["device_memory"] == [0.0, 0.0] and got["bubble"] == pytest.approx(0.2)
    rc, out, _ = _cli(tmp_path, capsys, "--devices", "2", "--microbatches", "2", "--virtual-stages", "auto",
                      "--max-virtual-stages", "5", "--json")
    got = json.loads(out)
    assert rc == 0 and got["best"] == 4 and got["speedup"] == pytest.approx(12 / 9)
    assert [o["step_time"] for o in got["options"]] == [12.0, 10.0, 14.0, 9.0, None]
    assert "10 chunks" in got["options"][4]["reason"]


@pytest.mark.parametrize("flags, match", [
    (["--virtual-stages", "0"], "chunk count >= 1"),
    (["--virtual-stages", "two"], "chunk count >= 1"),
    (["--virtual-stages", "2", "--schedule", "gpipe"], "drop --schedule gpipe"),
    (["--virtual-stages", "2"], "--microbatches"),
    (["--virtual-stages", "auto", "--microbatches", "2", "--max-virtual-stages", "0"], ">= 1"),
    (["--virtual-stages", "2", "--microbatches", "2", "--algorithm", "pipedream"], "'dp'"),
])
def test_cli_names_bad_virtual_stage_flags(tmp_path, capsys, flags, match):
    rc, _, err = _cli(tmp_path, capsys, "--devices", "2", *flags)
    assert rc != 0 and match in err


def test_placed_chunks_run_interleaved_and_train_like_the_unsplit_model():
    import copy

    import torch
    from torch import nn

    import meshtorch as mt
    from meshtorch.pipeline import Pipeline
    from meshtorch.placement.trace import DeviceSpec, trace

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(6, 6), nn.Tanh())])
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    gm = torch.fx.symbolic_trace(model)
    # a fast link and slow compute, so that the placer cuts even this tiny model
    g = trace(gm, x[:4], training=True, spec=DeviceSpec(link_bandwidth=1e15, acc_flops=1e6, cpu_flops=1e5))
    p = place(g, Problem(devices=2, schedule="interleaved", virtual_stages=2, microbatches=2))
    assert len(p.stages) == 4 and p.is_contiguous()

    def run():
        pipe = Pipeline(copy.deepcopy(gm), p, microbatches=2, schedule="interleaved", virtual_stages=2,
                        loss_fn=nn.functional.mse_loss)
        loss = pipe.forward_backward((x,), y)
        # a stage's parameters are "<its chunk>.<the model's name>"
        return loss, {n.split(".", 1)[1]: q.grad.clone() for n, q in pipe.module.named_parameters()}

    ref = copy.deepcopy(model)
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    got: dict[str, torch.Tensor] = {}
    for loss, grads in mt.launch(run, mesh="stage:2"):
        assert loss == pytest.approx(want.item(), rel=1e-5)
        assert not set(got) & set(grads)
        got.update(grads)
    assert set(got) == {n for n, _ in ref.named_parameters()}
    for name, q in ref.named_parameters():
        torch.testing.assert_close(got[name], q.grad, rtol=1e-5, atol=1e-6)
