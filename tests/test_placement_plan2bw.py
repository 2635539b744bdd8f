"""The PipeDream-2BW planner against brute force over depth x width x micro-batch size."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtorch.cli import main
from meshtorch.errors import PlacementError
from meshtorch.placement import OpGraph
from meshtorch.placement.plan2bw import plan_2bw

LAYER = st.fixed_dictionaries({
    "fwd": st.integers(1, 6), "bwd": st.integers(0, 9), "comm": st.integers(0, 3),
    "mem": st.integers(0, 6), "weights": st.integers(0, 3), "act": st.integers(0, 3),
    "sync": st.integers(0, 4),
})


def chain(layers: list[dict]) -> OpGraph:
    g = OpGraph()
    for i, lay in enumerate(layers):
        g.add_node(f"f{i}", acc_time=float(lay["fwd"]), comm_time=float(lay["comm"]),
                   mem_bytes=float(lay["mem"]), weight_bytes=float(lay["weights"]),
                   act_bytes=float(lay["act"]), sync_time=float(lay["sync"]), color=f"c{i}")
        g.add_node(f"b{i}", acc_time=float(lay["bwd"]), backward=True, color=f"c{i}")
        g.add_edge(f"f{i}", f"b{i}")
    for i in range(len(layers) - 1):
        g.add_edge(f"f{i}", f"f{i + 1}")
        g.add_edge(f"b{i + 1}", f"b{i}")
    return g


def brute_force(layers, devices, memory, batch, sizes, recompute) -> float:
    """Best throughput over every (d, w, b) and every split of the chain into <= d stages,
    from the 2BW model's definitions (written here, not taken from the library)."""
    n = len(layers)
    best = 0.0
    for d, w, b in itertools.product(range(1, devices + 1), range(1, devices + 1), sizes):
        if d * w > devices or batch % (w * b):
            continue
        m = batch // (w * b)
        if m < d - 1:
            continue
        for k in range(1, min(d, n) + 1):
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                worst = 0.0
                for s in range(k):
                    lo, hi = bounds[s], bounds[s + 1]
                    mine = layers[lo:hi]
                    load = sum(b * (x["fwd"] + x["bwd"]) + 2 * (w - 1) / w / m * x["sync"]
                               for x in mine)
                    load += b * ((layers[lo - 1]["comm"] if lo > 0 else 0)
                                 + (layers[hi - 1]["comm"] if hi < n else 0))
                    held = k - s  # 2BW: stage s of k holds k - s micro-batches
                    act = b * sum(x["act"] for x in mine)
                    received = b * layers[lo - 1]["act"] if lo > 0 else b * layers[0]["act"]
                    mem = sum(x["mem"] + x["weights"] for x in mine)
                    mem += held * received + act if recompute else held * act
                    if mem > memory:
                        worst = math.inf
                        break
                    worst = max(worst, load)
                if math.isfinite(worst):
                    best = max(best, w * b / worst)
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=4), st.integers(1, 4), st.integers(4, 40),
       st.sampled_from([4, 6, 8]), st.booleans())
def test_planner_matches_brute_force(layers, devices, memory, batch, recompute):
    sizes = (1, 2)
    want = brute_force(layers, devices, memory, batch, sizes, recompute)
    g = chain(layers)
    if want == 0.0:
        with pytest.raises(PlacementError, match="fits"):
            plan_2bw(g, devices=devices, memory=memory, batch=batch, microbatch_sizes=sizes,
                     recompute=recompute, relay=False)
        return
    plan = plan_2bw(g, devices=devices, memory=memory, batch=batch, microbatch_sizes=sizes,
                    recompute=recompute, relay=False)
    assert plan.throughput == pytest.approx(want, rel=1e-9)
    assert plan.depth * plan.width <= devices and plan.microbatches >= plan.depth - 1
    assert plan.microbatches * plan.width * plan.microbatch_size == batch
    assert all(s.memory <= memory for s in plan.placement.stages)


def test_cli_plan_2bw_json(tmp_path, capsys):
    g = chain([{"fwd": 1, "bwd": 2, "comm": 1, "mem": 4, "weights": 1, "act": 1, "sync": 0}] * 4)
    path = tmp_path / "g.json"
    g.to_json(path)
    assert main(["place", str(path), "--plan-2bw", "--devices", "4", "--memory", "16",
                 "--batch", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["plan"], out["depth"] * out["width"] <= 4) == ("2bw", True)
    assert out["throughput"] == pytest.approx(max(c["throughput"] for c in out["candidates"]
                                                  if c["fits"]))
    assert main(["place", str(path), "--plan-2bw", "--devices", "4"]) == 2  # no --batch
