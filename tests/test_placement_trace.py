"""Graphs traced from real modules give placements that run; JSON and CLI round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from meshtorch.cli import main
from meshtorch.errors import PlacementError
from meshtorch.placement import OpGraph, Problem, evaluate, load_split, place
from meshtorch.placement.trace import DeviceSpec, split, trace

# tiny models: a fast link, so that splitting them pays off
FAST = DeviceSpec(link_bandwidth=1e15)
DATA = Path(__file__).parents[1] / ".." / "shared" / "data" / "dnn-partitioning"


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)

    def example_inputs(self):
        return (torch.randn(8, 32),)


class Block(nn.Module):
    def __init__(self, c: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c if stride == 1 else c // 2, c, 3, stride, 1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = nn.Conv2d(c // 2, c, 1, stride) if stride != 1 else nn.Identity()

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class ResNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 1, 1)
        self.blocks = nn.Sequential(Block(8, 1), Block(16, 2), Block(16, 1), Block(32, 2))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.blocks(torch.relu(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


class Tied(nn.Module):
    """Shared parameters: the embedding matrix is reused by the output projection."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, idx):
        h = torch.tanh(self.mid(self.emb(idx)))
        return h @ self.emb.weight.t()


@pytest.mark.parametrize("model,inp", [(MLP(), torch.randn(8, 32)),
                                        (ResNetLike(), torch.randn(2, 3, 16, 16))])
@pytest.mark.parametrize("algorithm", ["dp", "greedy", "pipedream", "ilp"])
def test_traced_placements_run(model, inp, algorithm):
    model.eval()
    gm = torch.fx.symbolic_trace(model)
    g = trace(gm, inp, spec=FAST)
    assert g.total("flops") > 0
    p = place(g, Problem(devices=3), algorithm, **({"contiguous": True, "time_limit": 30}
                                                   if algorithm == "ilp" else {}))
    assert len(p.stages) >= 2
    parts = split(gm, p)
    torch.testing.assert_close(parts(inp), model(inp))
    again = evaluate(g, p.problem, p.stages)
    assert again.max_load == pytest.approx(p.max_load)


def test_dp_beats_baselines_on_traced_resnet():
    g = trace(ResNetLike().eval(), torch.randn(2, 3, 16, 16), spec=FAST)
    dp = place(g, Problem(devices=3))
    for name in ("greedy", "pipedream"):
        assert dp.max_load <= place(g, Problem(devices=3), name).max_load + 1e-12


def test_training_trace_colocates_and_places():
    model = MLP(depth=3)
    g = trace(model, torch.randn(8, 32), training=True, spec=FAST)
    assert g.is_training and sum(n.backward for n in g.nodes) == len(g) // 2
    p = place(g, Problem(devices=2, max_replicas=2))
    where = p.device_of()
    for i, nd in enumerate(g.nodes):
        if nd.backward:
            assert where[i] == where[g.index(nd.name[: -len(".grad")])]
    assert all(s.memory > 0 for s in p.stages)


def test_shared_parameters_share_a_device():
    g = trace(Tied(), torch.randint(0, 50, (4, 7)), spec=FAST)
    p = place(g, Problem(devices=3))
    where = p.device_of()
    users = [i for i, n in enumerate(g.nodes) if n.color is not None]
    assert len(users) >= 2 and len({where[i] for i in users if g.nodes[i].color ==
                                    g.nodes[users[0]].color}) == 1


def test_the_default_accelerator_is_the_planners_a100():
    """Priced as the planner prices its A100 (meshtorch.plan.devices): bf16 at half the data sheet's
    312 TFLOP/s, its 2,039 GB/s; a matmul big enough to be bound by its FLOPs takes them at that rate."""
    spec = DeviceSpec()
    assert (spec.acc_flops, spec.acc_bandwidth) == (312e12 / 2, 2039e9)
    g = trace(nn.Sequential(nn.Linear(1024, 1024, bias=False)), torch.randn(4096, 1024))
    (mm,) = [n for n in g.nodes if n.flops]
    assert mm.acc_time == pytest.approx(2 * 4096 * 1024 * 1024 / (312e12 / 2))
    assert mm.cpu_time == pytest.approx(2 * 4096 * 1024 * 1024 / 1e12)


def test_json_round_trip_and_paper_format(tmp_path):
    g = trace(MLP(), torch.randn(8, 32))
    g.meta.update(devices=2, memory=1e9)
    path = tmp_path / "g.json"
    g.to_json(path)
    h = OpGraph.from_json(path)
    assert place(h, Problem()).max_load == pytest.approx(place(g, Problem()).max_load)
    paper = tmp_path / "paper.json"
    paper.write_text(json.dumps(g.to_dnn_partitioning_dict()))
    q = OpGraph.from_dnn_partitioning(paper)
    assert place(q, Problem()).max_load == pytest.approx(place(g, Problem()).max_load)


def test_to_json_writes_the_whole_file_or_leaves_the_old_one(tmp_path, monkeypatch):
    """The graph file is written through a temporary one that replaces it (meshtorch.files): a write
    that fails leaves the file before it whole, and no temporary file behind."""
    import os

    import meshtorch.files

    path = tmp_path / "g.json"
    small, big = trace(MLP(), torch.randn(8, 32)), trace(MLP(), torch.randn(64, 32))
    text = small.to_json(path)
    assert path.read_text() == text and os.stat(path).st_mode & 0o777 == meshtorch.files.usual_mode()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(meshtorch.files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        big.to_json(path)
    assert path.read_text() == text and os.listdir(tmp_path) == ["g.json"]
    monkeypatch.undo()
    assert OpGraph.from_json(big.to_json(path)).to_json() == path.read_text() != text


def test_cli_json_and_table(tmp_path, capsys):
    g = trace(MLP(), torch.randn(8, 32))
    path = tmp_path / "mlp.json"
    g.to_json(path)
    assert main(["place", str(path), "--devices", "3", "--memory", "1GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"max_load", "solve_seconds", "algorithm", "stages"} <= set(out)
    assert max(s["load"] for s in out["stages"]) == pytest.approx(out["max_load"])
    assert main(["place", str(path), "--devices", "2", "--algorithm", "pipedream"]) == 0
    assert "bottleneck" in capsys.readouterr().out
    assert main(["place", str(path), "--devices", "2", "--memory", "1KiB"]) == 2
    assert "memory" in capsys.readouterr().err
    assert main(["place", "tests.test_placement_trace:MLP", "--devices", "2"]) == 0


@pytest.mark.skipif(not DATA.exists(), reason="shared dnn-partitioning data not present")
def test_paper_graphs_small_ones_exact_against_milp():
    g = OpGraph.from_dnn_partitioning(DATA / "throughput-inputs/LayerGraphs/bert24_inference.json")
    dp = place(g, Problem())
    ilp = place(g, Problem(), "ilp", contiguous=True, time_limit=60)
    assert ilp.info["optimal"]
    assert dp.max_load == pytest.approx(ilp.max_load, rel=1e-6)
    expert = evaluate(g, Problem(), load_split(DATA / "human-experts/bert24_inference_expert.json",
                                               g), strict=False)
    assert dp.max_load <= expert.max_load


class Conv(nn.Module):
    """A net with no example_inputs(): the CLI traces it on --input-shape."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_cli_names_an_input_shape_the_model_cannot_take(capsys):
    """A wrong rank (8,3,32 for a Conv2d: read as one unbatched 8-channel image) and a size that is
    no integer are the CLI's one-line error naming --input-shape, the layer's wanted input and the
    fix, not torch.fx's ShapeProp traceback or a bare ValueError; the right shape places."""
    spec = "tests.test_placement_trace:Conv"
    assert main(["place", spec, "--input-shape", "8,3,32", "--devices", "2", "--memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshtorch place: error: {spec} cannot run on --input-shape 8,3,32: its layer "
                          "'body.0' (Conv2d) takes (batch, 3, H, W); torch says: ")
    assert "3 channels, but got 8" in err and "Give --input-shape the sizes" in err
    assert "ShapeProp" not in err and "Traceback" not in err
    for bad in ("8,3,x2", "8,0,32,32", ""):
        assert main(["place", spec, "--input-shape", bad, "--devices", "2"]) == 2
        assert capsys.readouterr().err == (
            f"meshtorch place: error: --input-shape {bad!r} is not a list of positive integers: give the "
            "input's sizes, batch first, separated by commas, e.g. --input-shape 8,3,32,32\n")
    assert main(["place", spec, "--input-shape", "2,3,8,8", "--devices", "2", "--memory", "1GiB"]) == 0
    assert "max load" in capsys.readouterr().out


def test_bad_inputs():
    with pytest.raises(PlacementError, match="no such graph file"):
        OpGraph.from_json("/nonexistent/graph.json")
    with pytest.raises(PlacementError, match="unknown algorithm"):
        place(OpGraph(), Problem(devices=1), "magic")


def test_cli_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    g = trace(MLP(), torch.randn(8, 32), spec=FAST)
    path = tmp_path / "mlp.json"
    g.to_json(path)
    png = tmp_path / "stages.png"
    assert main(["place", str(path), "--devices", "3", "--png", str(png)]) == 0
    assert "bottleneck" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000  # a rendered chart, not an empty canvas
    # the IHDR chunk: width and height of the figure (at least 4 x 3.5 in at 120 dpi)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 480 and height >= 420


def test_our_transformer_lm_traced_at_aten_level_places_and_runs():
    """meshtorch's own DecoderLM (MeshTensor ops, opaque to symbolic_trace) via make_fx."""
    import meshtorch as mt
    from meshtorch.models import DecoderLM, TransformerConfig
    from meshtorch.placement.trace import trace_function

    cfg = TransformerConfig(vocab=32, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1,
                            max_length=8, tie_embeddings=False)
    model = DecoderLM(cfg, seed=0)

    def logits(ids):
        return model(mt.from_global(ids, "batch:2,length:6")).local

    ids = torch.arange(12).reshape(2, 6) * 5 % 32
    gm, g = trace_function(logits, ids, spec=FAST)
    assert sum(n.mem_bytes for n in g.nodes) == sum(p.numel() * 4 for p in model.parameters())
    p = place(g, Problem(devices=3))
    assert len(p.stages) == 3 and p.is_contiguous()
    for name in ("greedy", "pipedream"):
        assert p.max_load <= place(g, Problem(devices=3), name).max_load + 1e-15
    parts = split(gm, p)
    # each stage owns the weights it uses, and the placement's memory counts exactly them
    for s, stage in enumerate(p.stages):
        sub = getattr(parts, f"submod_{s}")
        assert stage.memory == 4 * sum(q.numel() for q in sub.parameters()) > 0
    want = logits(ids)
    got = parts(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the stages run backward too: the same gradients as the unsplit model
    want.square().sum().backward()
    expected = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    got.square().sum().backward()
    for q, e in zip(model.parameters(), expected):
        torch.testing.assert_close(q.grad, e)


def test_milp_agrees_with_dp_on_traced_times_in_nanoseconds():
    """Traced loads are ~1e-9 s; the MILP must not read them as solver noise."""
    g = trace(MLP(depth=3), torch.randn(8, 32), training=True, spec=FAST)
    for nd in g.nodes:
        nd.sync_time *= 0.01  # cheap all-reduce: replicating the whole model pays
    for prob in (Problem(devices=3), Problem(devices=3, max_replicas=3)):
        dp = place(g, prob, "dp")
        ilp = place(g, prob, "ilp", contiguous=True, time_limit=60)
        assert dp.max_load < 1e-7 and ilp.info["optimal"]
        assert ilp.max_load == pytest.approx(dp.max_load, rel=1e-6)
        assert ilp.info["objective"] == pytest.approx(dp.max_load, rel=1e-6)
    assert [(s.kind, s.replicas) for s in ilp.stages] == [("acc", 3)]


def test_the_input_check_changes_no_statistics_nor_the_random_stream():
    """``meshtorch place``'s run of the model before tracing (cli.check_forward) leaves a
    BatchNorm's running statistics, the global random stream (dropout) and the training mode as
    they were: the trace that follows sees the model the user gave."""
    from meshtorch.placement.cli import check_forward

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    net.train()
    stats = net[1].running_mean.clone(), net[1].num_batches_tracked.clone()
    x = torch.randn(8, 4) + 3
    rng = torch.get_rng_state()
    check_forward(net, (x,), "m:Net", "--input-shape 8,4")
    assert net.training and net[1].training
    assert torch.equal(net[1].running_mean, stats[0]) and torch.equal(net[1].num_batches_tracked, stats[1])
    assert torch.equal(torch.get_rng_state(), rng)
