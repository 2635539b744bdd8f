"""The latency objective: MILP and greedy against brute force with an evaluator written here."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtorch.errors import PlacementError
from meshtorch.placement import OpGraph, Problem, evaluate, place
from meshtorch.placement.latency import evaluate_latency

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_latency(graph: OpGraph, k: int, q: int, memory: float, cpus: int,
                      where: list[tuple[int, int] | None]) -> float:
    """Latency of ``where[v]`` = ``(accelerator, slot)`` or ``None`` (host), from the paper's
    definition, by fixed-point iteration over node finishing times; ``inf`` if infeasible."""
    n = len(graph)
    nodes = graph.nodes
    succ = {u: set() for u in range(n)}
    pred = {v: set() for v in range(n)}
    for u, v, _ in graph.edges:
        succ[u].add(v)
        pred[v].add(u)
    groups: dict[tuple[int, int], set[int]] = {}
    for v, w in enumerate(where):
        if w is None:
            if cpus == 0 or nodes[v].cpu_time is None:
                return math.inf
        else:
            if nodes[v].acc_time is None or not (0 <= w[0] < k and 0 <= w[1] < q):
                return math.inf
            groups.setdefault(w, set()).add(v)
    for d in range(k):
        if sum(nodes[v].mem_bytes for (e, _), s in groups.items() if e == d for v in s) > memory:
            return math.inf
    colour_dev: dict[str, object] = {}
    for v, nd in enumerate(nodes):
        dev = None if where[v] is None else where[v][0]
        if nd.color is not None and colour_dev.setdefault(nd.color, dev) != dev:
            return math.inf
    # convex: no node outside S is both reachable from S and reaching S
    def reach(start, nbrs):
        seen, todo = set(), list(start)
        while todo:
            x = todo.pop()
            for y in nbrs[x]:
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return seen
    for s in groups.values():
        if (reach(s, succ) & reach(s, pred)) - s:
            return math.inf
    dur = {}
    for key, s in groups.items():
        t = sum(nodes[v].acc_time for v in s)
        for u in range(n):
            if succ[u] and any((v in s) != (u in s) for v in succ[u]):
                t += nodes[u].comm_time
        dur[key] = t
    finish = [0.0] * n
    gstart = {key: 0.0 for key in groups}
    for _ in range(3 * n + 3):
        old = (list(finish), dict(gstart))
        for key, s in groups.items():
            ready = max([finish[u] for v in s for u in pred[v] if u not in s], default=0.0)
            d, slot = key
            before = [gstart[(d, j)] + dur[(d, j)] for j in range(slot) if (d, j) in groups]
            gstart[key] = max([ready] + before)
            for v in s:
                finish[v] = gstart[key] + dur[key]
        for v in range(n):
            if where[v] is None:
                finish[v] = max([finish[u] for u in pred[v]], default=0.0) + nodes[v].cpu_time
        if (finish, gstart) == old:
            return max(finish, default=0.0)
    return math.inf  # waits in a cycle


def brute_force(graph: OpGraph, k: int, q: int, memory: float, cpus: int) -> float:
    options = [None] + [(d, j) for d in range(k) for j in range(q)]
    return min(reference_latency(graph, k, q, memory, cpus, list(w))
               for w in itertools.product(options, repeat=len(graph)))


def as_assignment(p, q: int) -> list[tuple[int, int] | None]:
    """Our placement as ``where``: slots of an accelerator numbered in run order."""
    where: list[tuple[int, int] | None] = [None] * len(p.graph)
    seen: dict[int, int] = {}
    for sg in sorted(p.stages, key=lambda s: s.start):
        if sg.kind == "acc":
            slot = seen.setdefault(sg.device, 0)
            seen[sg.device] += 1
            for v in sg.nodes:
                where[v] = (sg.device, slot)
    return where


@st.composite
def instances(draw):
    n = draw(st.integers(2, 5))
    g = OpGraph()
    for i in range(n):
        g.add_node(
            f"n{i}",
            acc_time=None if draw(st.integers(0, 7)) == 0 else float(draw(st.integers(0, 6))),
            cpu_time=float(draw(st.integers(0, 20))),
            mem_bytes=float(draw(st.integers(0, 4))),
            comm_time=float(draw(st.integers(0, 3))),
            color=draw(st.sampled_from([None, None, "c"])),
        )
    for j in range(1, n):
        for i in range(j):
            if draw(st.integers(0, 2)) == 0:
                g.add_edge(i, j)
    k = draw(st.integers(1, 2))
    q = draw(st.integers(1, 2)) if n <= 4 or k == 1 else 1
    memory = float(draw(st.sampled_from([3, 6, 100])))
    cpus = draw(st.sampled_from([0, 1, 1]))
    return g, k, q, memory, cpus


@SETTINGS
@given(instances())
def test_milp_matches_brute_force_and_greedy_is_feasible(inst):
    g, k, q, memory, cpus = inst
    best = brute_force(g, k, q, memory, cpus)
    prob = Problem(devices=k, cpus=cpus, memory=memory, objective="latency", subgraphs=q)
    if best == math.inf:
        with pytest.raises(PlacementError):
            place(g, prob, "ilp", time_limit=None)
        return
    p = place(g, prob, "ilp", time_limit=None)
    assert p.info["optimal"]
    assert p.latency == pytest.approx(best, abs=1e-6)
    assert reference_latency(g, k, q, memory, cpus, as_assignment(p, q)) == \
        pytest.approx(p.latency, abs=1e-6)
    try:
        gr = place(g, prob, "greedy")
    except PlacementError:
        return  # the greedy needs the host for what fits no accelerator
    assert gr.latency >= best - 1e-9
    assert reference_latency(g, k, q, memory, cpus, as_assignment(gr, q)) == \
        pytest.approx(gr.latency, abs=1e-9)


@SETTINGS
@given(instances(), st.data())
def test_evaluate_latency_matches_the_reference(inst, data):
    g, k, q, memory, cpus = inst
    options = [None] + [(d, j) for d in range(k) for j in range(q)]
    where = [data.draw(st.sampled_from(options)) for _ in range(len(g))]
    ref = reference_latency(g, k, q, memory, cpus, where)
    subgraphs = [("acc", [v for v in range(len(g)) if where[v] == (d, j)], d)
                 for d in range(k) for j in range(q)]
    subgraphs.append(("cpu", [v for v in range(len(g)) if where[v] is None]))
    prob = Problem(devices=k, cpus=cpus, memory=memory, objective="latency", subgraphs=q)
    p = evaluate_latency(g, prob, subgraphs, strict=False)
    if ref == math.inf:
        assert p.violations
    else:
        assert not p.violations
        assert p.latency == pytest.approx(ref, abs=1e-9)


def test_hand_derived_latency():
    # a -> b -> c, b only fast on the host: a and c share one accelerator in two subgraphs
    g = OpGraph()
    for name, acc, cpu in [("a", 1.0, 10.0), ("b", 9.0, 2.0), ("c", 1.0, 10.0)]:
        g.add_node(name, acc_time=acc, cpu_time=cpu, comm_time=0.5)
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    one = Problem(devices=1, cpus=1, objective="latency", subgraphs=1)
    two = Problem(devices=1, cpus=1, objective="latency", subgraphs=2)
    # q=1: everything on the accelerator (11) beats {a} + host (1.5 + 2 + 10 = 13.5)
    assert place(g, one, "ilp").latency == pytest.approx(11.0)
    # q=2: a (1 + 0.5 out), b on the host (2), c (0.5 in + 1): 5
    p = place(g, two, "ilp")
    assert p.latency == pytest.approx(5.0)
    assert [st.kind for st in p.stages] == ["acc", "cpu", "acc"]
    assert p.to_dict()["objective"] == "latency" and p.to_dict()["value"] == pytest.approx(5.0)


def test_the_latency_milp_survives_highs_presolve_solve_error(monkeypatch):
    """Both placement MILPs solve through milp.solve_model: where HiGHS's presolve ends in "Solve
    error" (status 4, seen on a feasible max-load model), the latency model is solved again without
    it too (it had its own copy of the solver call, without the retry, and failed)."""
    from types import SimpleNamespace

    import meshtorch.placement.milp as milp_module
    from meshtorch.placement.latency_milp import solve_latency_milp

    real, presolve = milp_module.run_highs, []

    def presolve_fails(cost, constraints, integrality, bounds, options):
        presolve.append(options.get("presolve", True))
        if options.get("presolve", True):
            return SimpleNamespace(status=4, x=None, message="Solve error", mip_dual_bound=None), ""
        return real(cost, constraints, integrality, bounds, options)

    monkeypatch.setattr(milp_module, "run_highs", presolve_fails)
    g = OpGraph()
    for name, acc, cpu in [("a", 1.0, 10.0), ("b", 9.0, 2.0), ("c", 1.0, 10.0)]:
        g.add_node(name, acc_time=acc, cpu_time=cpu, comm_time=0.5)
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    p = solve_latency_milp(g, Problem(devices=1, cpus=1, objective="latency", subgraphs=2), warm_start=False)
    assert p.latency == pytest.approx(5.0) and presolve == [True, False]


def test_latency_errors_name_the_fix():
    g = OpGraph()
    g.add_node("f", acc_time=1.0, cpu_time=1.0)
    g.add_node("g", acc_time=1.0, cpu_time=1.0, backward=True, color="x")
    with pytest.raises(PlacementError, match="--training"):
        place(g, Problem(objective="latency"), "ilp")
    with pytest.raises(PlacementError, match="use 'ilp'"):
        place(OpGraph(g.nodes[:1]), Problem(objective="latency"), "dp")
    with pytest.raises(PlacementError, match="unknown objective"):
        place(g, Problem(objective="speed"))


@SETTINGS
@given(instances(), st.data())
def test_evaluate_max_load_matches_an_independent_formula(inst, data):
    # the throughput model, recomputed here from its definition (no replicas, inference)
    g, k, _, memory, cpus = inst
    slots = k + cpus
    where = [data.draw(st.integers(0, slots - 1)) for _ in range(len(g))]
    kinds = ["acc"] * k + ["cpu"] * cpus
    stages = [(kinds[s], [v for v in range(len(g)) if where[v] == s]) for s in range(slots)]
    p = evaluate(g, Problem(devices=k, cpus=cpus, memory=memory), stages, strict=False)
    loads = []
    for s, (kind, members) in enumerate(stages):
        if not members:
            continue
        if kind == "cpu":
            loads.append(sum(g.nodes[v].cpu_time for v in members))
            continue
        cross = {u for u, v, _ in g.edges if (where[u] == s) != (where[v] == s)}
        loads.append(sum(g.nodes[v].acc_time or 0.0 for v in members)
                     + sum(g.nodes[u].comm_time for u in cross))
    assert p.max_load == pytest.approx(max(loads))


def _small_graph(tmp_path: Path) -> Path:
    g = OpGraph(meta={"devices": 2, "cpus": 1})
    for i, t in enumerate([3.0, 1.0, 4.0, 1.0, 5.0]):
        g.add_node(f"l{i}", acc_time=t, cpu_time=5 * t, comm_time=0.5)
    for i in range(4):
        g.add_edge(f"l{i}", f"l{i + 1}")
    path = tmp_path / "g.json"
    g.to_json(path)
    return path


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_cli_json_is_clean(tmp_path, objective):
    # a subprocess, so that HiGHS's own writes to fd 1 would land in the output we parse
    path = _small_graph(tmp_path)
    code = (
        "import sys; from meshtorch.cli import main; "
        f"rc = main(['place', {str(path)!r}, '--algorithm', 'ilp', '--json', "
        f"'--objective', {objective!r}, '--time-limit', '20']); "
        "sys.exit(rc)"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)  # the whole of stdout is one JSON object
    assert d["objective"] == objective
    assert d["value"] == pytest.approx(d["max_load"] if objective == "throughput" else 14.0)
