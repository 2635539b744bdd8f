"""The exact placement algorithms against each other and against brute force."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtorch.errors import PlacementError
from meshtorch.placement import OpGraph, Problem, evaluate, order_constraints, place
from meshtorch.placement import dp as dp_module
from meshtorch.placement.milp import solve_milp

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def reference_load(graph: OpGraph, prob: Problem, stages: list) -> float:
    """Max load of ``stages`` (``(kind, nodes, replicas)`` in pipeline order), ``inf`` if infeasible.

    Written from the definitions in docs/placement.md, independently of ``evaluate``.
    """
    where: dict[int, int] = {}
    for s, (_, nodes, _) in enumerate(stages):
        for v in nodes:
            if v in where:
                return math.inf
            where[v] = s
    if len(where) != len(graph.nodes):
        return math.inf
    home: dict[str, int] = {}
    for v, nd in enumerate(graph.nodes):
        if nd.color is not None and home.setdefault(nd.color, where[v]) != where[v]:
            return math.inf
    if sum(r for k, _, r in stages if k == "acc") > prob.devices:
        return math.inf
    if sum(1 for k, _, _ in stages if k == "cpu") > prob.cpus:
        return math.inf
    consumers: dict[int, set[int]] = {}
    for u, v, _ in graph.edges:
        consumers.setdefault(u, set()).add(v)
    worst = 0.0
    for s, (kind, nodes, r) in enumerate(stages):
        nds = [graph.nodes[v] for v in nodes]
        if kind == "cpu":
            if r != 1 or any(x.cpu_time is None for x in nds):
                return math.inf
            worst = max(worst, sum(x.cpu_time for x in nds))
            continue
        if any(x.acc_time is None for x in nds):
            return math.inf
        comm = 0.0
        for u, outs in consumers.items():
            c = graph.nodes[u].comm_time
            if prob.relay:
                lo = min(where[w] for w in outs | {u})
                hi = max(where[w] for w in outs | {u})
                comm += c * ((lo < s <= hi) + (lo <= s < hi))
            elif any((where[w] == s) != (where[u] == s) for w in outs):
                comm += c
        devices_after = sum(r2 if k2 == "acc" else 1 for k2, _, r2 in stages[s:])
        memory = sum(x.mem_bytes for x in nds)
        if prob.schedule == "2bw":  # the second weight version
            memory += sum(x.weight_bytes for x in nds)
        if prob.training and prob.stash:
            m = prob.microbatches or math.inf
            held = {"gpipe": m, "1f1b": min(devices_after, m), "2bw": devices_after}[prob.schedule]
            held = math.ceil(held / r)
            act = sum(x.act_bytes for x in nds if not x.backward)
            if prob.recompute:  # stage inputs per micro-batch, one micro-batch recomputed
                fwd = [(u, w) for u, w, _ in graph.edges
                       if not graph.nodes[u].backward and not graph.nodes[w].backward]
                crossing = sum(graph.nodes[u].act_bytes for u in {u for u, _ in fwd}
                               if where[u] < s <= max(where[w] for u2, w in fwd if u2 == u))
                sources = sum(graph.nodes[v].act_bytes for v in nodes if not graph.nodes[v].backward
                              and all(w != v for _, w in fwd))
                memory += held * (crossing + sources) + act
            else:
                memory += held * act
        if memory > prob.memory * (1 + 1e-9):
            return math.inf
        sync = 2 * (r - 1) / r * sum(x.sync_time for x in nds)
        worst = max(worst, (sum(x.acc_time for x in nds) + comm) / r + sync)
    return worst


def brute_force(graph: OpGraph, prob: Problem, contiguous: bool) -> float:
    """Min max-load over every assignment of colour groups to ordered stages."""
    prob = prob.resolve(graph)
    groups: dict[str, list[int]] = {}
    for i, nd in enumerate(graph.nodes):
        groups.setdefault(nd.color if nd.color is not None else f"#{i}", []).append(i)
    members = list(groups.values())
    S = prob.devices + prob.cpus
    best = math.inf
    kinds_options = set(itertools.permutations(["acc"] * prob.devices + ["cpu"] * prob.cpus))
    order = order_constraints(graph)
    for assign in itertools.product(range(S), repeat=len(members)):
        stage_of = {i: s for g, s in zip(members, assign) for i in g}
        if contiguous and any(stage_of[u] > stage_of[v] for u, v in order):
            continue
        for kinds in kinds_options:
            stages = [(kinds[s], [i for g, s2 in zip(members, assign) if s2 == s for i in g])
                      for s in range(S)]
            stages = [s for s in stages if s[1]]
            n_acc = sum(k == "acc" for k, _ in stages)
            for reps in itertools.product(range(1, prob.max_replicas + 1), repeat=n_acc):
                it = iter(reps)
                best = min(best, reference_load(
                    graph, prob, [(k, nodes, next(it) if k == "acc" else 1) for k, nodes in stages]))
    return best


@st.composite
def dags(draw, max_nodes: int = 6, training: bool | None = None, chain: bool = False):
    n = draw(st.integers(2, max_nodes))
    train = draw(st.booleans()) if training is None else training
    if train:
        n = min(n, 4)
    g = OpGraph()
    times = st.integers(0, 9).map(float)
    for i in range(n):
        acc = draw(times)
        g.add_node(
            f"f{i}",
            acc_time=None if draw(st.integers(0, 9)) == 0 else acc,
            cpu_time=float(draw(st.integers(0, 40))),
            mem_bytes=float(draw(st.integers(0, 5))),
            act_bytes=float(draw(st.integers(0, 2))),
            weight_bytes=float(draw(st.integers(0, 2))),
            comm_time=float(draw(st.integers(0, 3))),
            color=f"c{i}" if train else None,
        )
    edges = []
    for j in range(1, n):
        if chain:
            edges.append((j - 1, j))
            continue
        for i in range(j):
            if draw(st.integers(0, 2)) == 0:
                edges.append((i, j))
    for i, j in edges:
        g.add_edge(i, j)
    if train:
        for i in range(n):
            g.add_node(f"b{i}", acc_time=float(draw(st.integers(0, 9))),
                       cpu_time=float(draw(st.integers(0, 40))), mem_bytes=0.0,
                       comm_time=float(draw(st.integers(0, 3))), backward=True, color=f"c{i}")
        for i, j in edges:
            g.add_edge(f"b{j}", f"b{i}")
        for i in range(n):  # the stashed activation feeds the node's backward
            g.add_edge(f"f{i}", f"b{i}")
    return g


@st.composite
def problems(draw, graph: OpGraph):
    devices = draw(st.integers(1, 3))
    cpus = draw(st.integers(0, 1)) if devices < 3 else 0
    total = graph.total("mem_bytes") + 3 * graph.total("act_bytes")
    memory = float(draw(st.integers(3, int(total) + 4)))
    return Problem(devices=devices, cpus=cpus, memory=memory,
                   stash=draw(st.booleans()), relay=draw(st.booleans()))


def check_placement(p, graph):
    """Reported loads match an independent recomputation; constraints hold."""
    again = evaluate(graph, p.problem, p.stages, strict=True)
    assert again.max_load == pytest.approx(p.max_load, abs=1e-9)
    for s, t in zip(p.stages, again.stages):
        assert s.load == pytest.approx(t.load, abs=1e-9)
        if s.kind == "acc":
            assert s.memory <= p.problem.memory + 1e-9


def placed_as_brute_force(graph: OpGraph, prob: Problem, method: str = "dp"):
    """``place(graph, prob, method)``, checked and as good as the brute-force contiguous
    optimum; ``None`` (having checked that it raises ``PlacementError``) when nothing fits."""
    brute_c = brute_force(graph, prob, contiguous=True)
    if math.isinf(brute_c):
        with pytest.raises(PlacementError):
            place(graph, prob, method)
        return None
    p = place(graph, prob, method)
    check_placement(p, graph)
    assert p.max_load == pytest.approx(brute_c, abs=1e-9)
    return p


@SETTINGS
@given(st.data())
def test_dp_matches_brute_force_and_milp(data):
    graph = data.draw(dags())
    prob = data.draw(problems(graph))
    brute_any = brute_force(graph, prob, contiguous=False)
    # small graphs take the all-pairs path; the Pareto frontiers of big ones must agree
    through_frontiers = data.draw(st.booleans(), label="through_frontiers")
    with mock.patch.object(dp_module, "FRONTIER_MIN_IDEALS", 0 if through_frontiers else 10**9):
        dp = placed_as_brute_force(graph, prob)
    if dp is not None and not any(n.acc_time is None for n in graph.nodes):
        assert dp.info["frontier"] == through_frontiers
    if dp is None:
        return
    assert dp.is_contiguous()
    ilp_c = solve_milp(graph, prob, contiguous=True, time_limit=None)
    assert ilp_c.max_load == pytest.approx(dp.max_load, abs=1e-6)
    ilp = solve_milp(graph, prob, contiguous=False, time_limit=None)
    check_placement(ilp, graph)
    assert ilp.max_load == pytest.approx(brute_any, abs=1e-6)
    assert ilp.max_load <= dp.max_load + 1e-6


@SETTINGS
@given(st.data())
def test_chain_solver_is_exact_on_chains(data):
    graph = data.draw(dags(max_nodes=7, training=False, chain=True))
    prob = data.draw(problems(graph))
    ch = placed_as_brute_force(graph, prob, "chain")
    if ch is None:
        return
    assert ch.info["exact"]
    assert place(graph, prob, "dp").max_load == pytest.approx(ch.max_load, abs=1e-9)


def test_milp_relays_through_a_cpu_in_the_middle():
    """Relayed transfers make the slot order matter: the MILP may not fix the CPUs first.

    p (comm 1) feeds q and the CPU-only h. With relaying, [p | h | q] costs 1 + 1 on each
    accelerator (each pays one border) and nothing on the CPU, whose load is its CPU time;
    with the CPU first, p and q share a stage (3) or one sits between h and the other and
    pays the border twice (3). Cold start: the contiguous DP would find [p | h | q] itself.
    """
    g = OpGraph()
    g.add_node("p", acc_time=1.0, cpu_time=None, comm_time=1.0)
    g.add_node("q", acc_time=1.0, cpu_time=None)
    g.add_node("h", acc_time=None, cpu_time=0.0)
    g.add_edge("p", "q")
    g.add_edge("p", "h")
    prob = Problem(devices=2, cpus=1, relay=True)
    p = solve_milp(g, prob, time_limit=None, warm_start=False)
    check_placement(p, g)
    assert p.max_load == 2.0 == brute_force(g, prob, contiguous=False)
    assert [s.kind for s in p.stages] == ["acc", "cpu", "acc"]
    assert evaluate(g, prob, [("cpu", [2]), ("acc", [0]), ("acc", [1])]).max_load == 3.0


def test_milp_relay_cpu_in_the_middle_found_by_hypothesis():
    """The example hypothesis found for test_dp_matches_brute_force_and_milp (MILP 3.0,
    brute force 2.0): colours tie f2 <-> f3 both ways, so the DP's contiguous start is no help."""
    g = OpGraph()
    for i, (acc, cpu) in enumerate([(None, 0.0), (None, 0.0), (1.0, 3.0), (1.0, 3.0)]):
        g.add_node(f"f{i}", acc_time=acc, cpu_time=cpu, color=f"c{i}")
    for i in range(4):
        g.add_node(f"b{i}", acc_time=0.0, cpu_time=0.0, comm_time=float(i == 3), backward=True,
                   color=f"c{i}")
    for u, v in [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3), (5, 4), (6, 4), (6, 5),
                 (7, 4), (7, 5), (7, 6), (0, 4), (1, 5), (2, 6), (3, 7)]:
        g.add_edge(u, v)
    prob = Problem(devices=2, cpus=1, memory=3.0, stash=False, relay=True)
    p = solve_milp(g, prob, time_limit=None)
    check_placement(p, g)
    assert p.max_load == pytest.approx(brute_force(g, prob, contiguous=False), abs=1e-6)
    assert p.max_load == pytest.approx(2.0, abs=1e-6)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_replicated_stages_beat_or_match_plain(data):
    graph = data.draw(dags(max_nodes=4, training=True))
    for nd in graph.nodes:
        nd.sync_time = 0.5
        nd.acc_time = 1.0 if nd.acc_time is None else nd.acc_time
    plain = Problem(devices=3, memory=1e9, stash=False)
    rep = Problem(devices=3, memory=1e9, stash=False, max_replicas=3)
    a, b = place(graph, plain, "dp"), place(graph, rep, "dp")
    check_placement(b, graph)
    assert b.max_load <= a.max_load + 1e-9


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_replication_dp_milp_and_brute_force_agree(data):
    """Data-parallel stages: DP = contiguous MILP = brute force; MILP = brute force overall."""
    graph = data.draw(dags(max_nodes=3, training=True))
    for nd in graph.nodes:
        nd.sync_time = float(data.draw(st.integers(0, 3)))
    base = data.draw(problems(graph))
    prob = Problem(devices=data.draw(st.integers(2, 3)), cpus=base.cpus if base.devices < 3
                   else 0, memory=base.memory, stash=base.stash,
                   max_replicas=data.draw(st.integers(2, 3)))
    brute_any = brute_force(graph, prob, contiguous=False)
    if math.isinf(brute_any):
        with pytest.raises(PlacementError):
            solve_milp(graph, prob, time_limit=None)
        return
    ilp = solve_milp(graph, prob, contiguous=False, time_limit=None)
    check_placement(ilp, graph)
    assert ilp.max_load == pytest.approx(brute_any, abs=1e-6)
    dp = placed_as_brute_force(graph, prob)
    if dp is None:
        return
    ilp_c = solve_milp(graph, prob, contiguous=True, time_limit=None)
    check_placement(ilp_c, graph)
    assert ilp_c.is_contiguous()
    assert ilp_c.max_load == pytest.approx(dp.max_load, abs=1e-6)


def test_milp_replicates_a_stage_by_hand():
    # one heavy node with little to synchronise: best is one stage on both accelerators
    g = OpGraph()
    g.add_node("f", acc_time=8.0, cpu_time=None, sync_time=1.0, color="x")
    g.add_node("b", acc_time=8.0, cpu_time=None, backward=True, color="x")
    g.add_edge("f", "b")
    prob = Problem(devices=2, max_replicas=2)
    for p in (solve_milp(g, prob), place(g, prob, "dp")):
        assert [(s.kind, s.replicas) for s in p.stages] == [("acc", 2)]
        assert p.max_load == pytest.approx(16.0 / 2 + 2 * 1 / 2 * 1.0)  # 9.0
    assert solve_milp(g, Problem(devices=2)).max_load == 16.0


def test_milp_survives_highs_presolve_solve_error():
    """Found by test_replication_dp_milp_and_brute_force_agree: HiGHS's presolve ends in
    "Solve error" (status 4) on this feasible contiguous model; the MILP retries without it."""
    g = OpGraph()
    g.add_node("f0", acc_time=1.0, cpu_time=2.0, mem_bytes=1.0, act_bytes=1.0, color="c0")
    g.add_node("f1", acc_time=1.0, cpu_time=1.0, mem_bytes=3.0, sync_time=3.0, color="c1")
    g.add_node("b0", acc_time=0.0, cpu_time=0.0, sync_time=3.0, backward=True, color="c0")
    g.add_node("b1", acc_time=1.0, cpu_time=2.0, sync_time=3.0, backward=True, color="c1")
    g.add_edge("f0", "b0")
    g.add_edge("f1", "b1")
    prob = Problem(devices=2, cpus=1, memory=3.0, stash=True, max_replicas=2)
    p = solve_milp(g, prob, contiguous=True, time_limit=None)
    check_placement(p, g)
    assert p.max_load == pytest.approx(brute_force(g, prob, contiguous=True), abs=1e-6)
    assert p.max_load == pytest.approx(place(g, prob, "dp").max_load, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_memory_frontier_matches_brute_force(data):
    """The DP's memory-aware frontier: min over inserted I with mu(I) <= mu(J) + budget."""
    import numpy as np

    from meshtorch.placement.frontier import MemoryFrontier

    n = data.draw(st.integers(1, 40))
    seg = np.sort(np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))))
    ints = st.lists(st.integers(0, 30), min_size=n, max_size=n)
    mu = seg * 100.0 + np.array(data.draw(ints))  # segments are ordered in memory
    alpha = np.array(data.draw(ints), dtype=float)
    g = np.array(data.draw(st.lists(st.sampled_from([*range(20), math.inf]), min_size=n,
                                    max_size=n)), dtype=float)
    fr = MemoryFrontier(mu, seg)
    inserted = np.zeros(n, dtype=bool)
    for t in sorted(set(seg.tolist()), reverse=True):
        js = np.flatnonzero(seg == t)
        beta = np.array(data.draw(st.lists(st.integers(-10, 10), min_size=n, max_size=n)),
                        dtype=float)
        budget = float(data.draw(st.integers(0, 250)))
        val, idx = fr.query(beta, js, budget)
        for q, j in enumerate(js.tolist()):
            ok = [i for i in np.flatnonzero(inserted) if mu[i] <= mu[j] + budget]
            want = min((max(g[i], alpha[i] + beta[j]) for i in ok), default=math.inf)
            assert val[q] == want
            if math.isfinite(want):
                i = idx[q]
                assert i in ok and max(g[i], alpha[i] + beta[j]) == want
        fr.insert(js.size, alpha, g)
        inserted[js] = True


@SETTINGS
@given(st.data())
def test_weights_merged_only_when_certified(data):
    """Zero-time nodes holding memory (weights) next to one op: the DP tries them merged
    into that op and must fall back to the full problem when memory makes that wrong."""
    graph = data.draw(dags(max_nodes=4, training=False))
    ops = len(graph)
    for k in range(data.draw(st.integers(1, 2))):
        w = graph.add_node(f"w{k}", acc_time=0.0, cpu_time=0.0,
                           mem_bytes=float(data.draw(st.integers(1, 6))),
                           comm_time=float(data.draw(st.integers(0, 2))))
        graph.add_edge(w, data.draw(st.integers(0, ops - 1)))
    prob = data.draw(problems(graph))
    placed_as_brute_force(graph, prob)


def test_weight_that_does_not_fit_with_its_consumer():
    # w (6 bytes) feeds c (5 bytes); 10 bytes per device: w must sit apart from c
    g = OpGraph()
    for name, t, m in [("a", 1.0, 3.0), ("b", 1.0, 0.0), ("c", 1.0, 5.0)]:
        g.add_node(name, acc_time=t, cpu_time=None, mem_bytes=m, comm_time=0.5)
    g.add_node("w", acc_time=0.0, cpu_time=0.0, mem_bytes=6.0, comm_time=0.25)
    for u, v in ["ab", "bc", "wc"]:
        g.add_edge(u, v)
    p = place(g, Problem(devices=2, memory=10))
    assert "certificate" not in p.info
    assert p.max_load == pytest.approx(brute_force(g, Problem(devices=2, memory=10), True))
    where = p.device_of()
    assert where[3] != where[2]
    # with room for both (memory still binds: 14 bytes in all), the merged solution
    # is certified by the relaxation
    q = place(g, Problem(devices=2, memory=11))
    assert q.info["certificate"]["pendant_nodes"] == 1
    assert q.max_load == pytest.approx(brute_force(g, Problem(devices=2, memory=11), True))


def test_hand_derived_loads():
    # a -> b -> c with comm 0.5 on each producer: {a,b} | {c}
    g = OpGraph()
    for name, t in [("a", 2.0), ("b", 3.0), ("c", 1.0)]:
        g.add_node(name, acc_time=t, cpu_time=10 * t, comm_time=0.5)
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    p = place(g, Problem(devices=2))
    # best split: {a} | {b, c}: loads 2 + 0.5 and 4 + 0.5
    assert [sorted(s.nodes) for s in p.stages] == [[0], [1, 2]]
    assert p.max_load == 4.5
    # diamond where the fork's output goes to both branches: paid once per device
    d = OpGraph()
    for name in "abcd":
        d.add_node(name, acc_time=1.0, cpu_time=1.0, comm_time=1.0)
    for u, v in ["ab", "ac", "bd", "cd"]:
        d.add_edge(u, v)
    q = evaluate(d, Problem(devices=2), [("acc", [0]), ("acc", [1, 2, 3])])
    assert [s.load for s in q.stages] == [2.0, 4.0]


def test_training_stash_counts_in_flight_micro_batches():
    g = OpGraph()
    for i in range(3):
        g.add_node(f"f{i}", acc_time=1.0, cpu_time=1.0, act_bytes=10.0, color=str(i))
        g.add_node(f"b{i}", acc_time=2.0, cpu_time=2.0, backward=True, color=str(i))
    for i in range(2):
        g.add_edge(f"f{i}", f"f{i + 1}")
        g.add_edge(f"b{i + 1}", f"b{i}")
    p = evaluate(g, Problem(devices=3, memory=100), [("acc", [0, 1]), ("acc", [2, 3]),
                                                     ("acc", [4, 5])])
    assert [s.in_flight for s in p.stages] == [3, 2, 1]
    assert [s.memory for s in p.stages] == [30.0, 20.0, 10.0]
    # with 25 bytes the first stage cannot hold 3 in-flight activations of 10 bytes
    with pytest.raises(PlacementError, match="bytes"):
        evaluate(g, Problem(devices=3, memory=25), p.stages)
    best = place(g, Problem(devices=3, memory=25))
    assert best.max_load == pytest.approx(
        brute_force(g, Problem(devices=3, memory=25), contiguous=True)
    )


def test_errors_name_the_culprit():
    g = OpGraph()
    g.add_node("a", acc_time=1.0, cpu_time=1.0)
    g.add_node("b", acc_time=1.0, cpu_time=1.0)
    g.add_edge("a", "b")
    g.add_edge("b", "a")
    with pytest.raises(PlacementError, match="cycle: .*a.*b"):
        place(g, Problem(devices=2))
    h = OpGraph()
    h.add_node("big", acc_time=1.0, cpu_time=None, mem_bytes=100.0)
    with pytest.raises(PlacementError, match="big"):
        place(h, Problem(devices=2, memory=10))
    u = OpGraph()
    u.add_node("gpu_only", acc_time=None, cpu_time=1.0)
    with pytest.raises(PlacementError, match="gpu_only"):
        place(u, Problem(devices=2, cpus=0))
    w = OpGraph()
    for i in range(3):
        w.add_node(f"n{i}", acc_time=1.0, cpu_time=None, mem_bytes=6.0)
    w.add_edge("n0", "n1")
    w.add_edge("n1", "n2")
    with pytest.raises(PlacementError, match="memory bound|bytes"):
        place(w, Problem(devices=2, memory=10))
    with pytest.raises(PlacementError, match="infeasible"):
        solve_milp(w, Problem(devices=2, memory=10))


@SETTINGS
@given(st.data())
def test_schedule_aware_memory_dp_matches_brute_force(data):
    """GPipe/1F1B/2BW, micro-batch counts and recompute in the memory bound: DP = brute force
    (and the MILP where it models the schedule)."""
    graph = data.draw(dags(training=True))
    base = data.draw(problems(graph))
    schedule = data.draw(st.sampled_from(["gpipe", "1f1b", "2bw"]))
    micro = data.draw(st.integers(1, 4)) if schedule == "gpipe" else data.draw(
        st.one_of(st.none(), st.integers(1, 4)))
    prob = Problem(devices=base.devices, cpus=base.cpus, memory=base.memory, relay=base.relay,
                   stash=True, schedule=schedule, microbatches=micro,
                   recompute=data.draw(st.booleans()),
                   max_replicas=data.draw(st.integers(1, 2)))
    dp = placed_as_brute_force(graph, prob)
    if dp is None or prob.recompute or prob.max_replicas > 1:
        return
    ilp_c = solve_milp(graph, prob, contiguous=True, time_limit=None)
    assert ilp_c.max_load == pytest.approx(dp.max_load, abs=1e-6)


def test_schedule_memory_by_hand():
    """One stage of three on a chain a -> b -> c, act 1 each, weights 2 (mem 8 = 4 x weights)."""
    g = OpGraph()
    for n in "abc":
        g.add_node(n, acc_time=1.0, mem_bytes=8.0, weight_bytes=2.0, act_bytes=1.0, color=n)
        g.add_node(f"{n}'", acc_time=1.0, backward=True, color=n)
    g.add_edge("a", "b"), g.add_edge("b", "c"), g.add_edge("c'", "b'"), g.add_edge("b'", "a'")
    stages = [("acc", [0, 1]), ("acc", [2, 3]), ("acc", [4, 5])]

    def memory(**kw):
        return [s.memory for s in evaluate(g, Problem(devices=3, **kw), stages).stages]

    assert memory() == [8 + 3, 8 + 2, 8 + 1]  # 1F1B: 3, 2, 1 micro-batches in flight
    assert memory(schedule="1f1b", microbatches=2) == [8 + 2, 8 + 2, 8 + 1]
    assert memory(schedule="gpipe", microbatches=4) == [12, 12, 12]
    assert memory(schedule="2bw", microbatches=1) == [8 + 2 + 3, 8 + 2 + 2, 8 + 2 + 1]
    # recompute: stage 0 stashes the graph input a (1 per micro-batch), the others the
    # value crossing in (1 per micro-batch); plus one micro-batch recomputed (1)
    assert memory(recompute=True) == [8 + 3 + 1, 8 + 2 + 1, 8 + 1 + 1]
