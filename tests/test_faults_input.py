"""Bad input gets a clear meshtorch error, never a traceback, and no size runs away.

Each case feeds one malformed input the way a user would (a file in ``tmp_path``, a flag to the
``meshtorch`` CLI, called in-process) and checks the error names the input and the fix, or that a
huge size answers as the graph's or model's real size does.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given as draw
from hypothesis import settings
from hypothesis import strategies as st

from meshtorch import cli
from meshtorch.errors import PlacementError
from meshtorch.placement import OpGraph, Problem, place
from meshtorch.placement.cli import parse_bytes as cli_parse_bytes
from run_harness import tiny_train, write_corpus

pytestmark = pytest.mark.timeout(120)


# -- meshtorch place --------------------------------------------------------------------------------

def _graph(edges, **costs_of_b) -> dict:
    nodes = [{"name": n, "acc_time": 1.0, "cpu_time": 2.0, "mem_bytes": 1.0} for n in "abc"]
    nodes[1].update(costs_of_b)
    return {"format": "meshtorch.opgraph/1", "meta": {"devices": 2}, "nodes": nodes, "edges": edges}


def _place(tmp_path, capsys, graph, *flags) -> tuple[int, str, str]:
    path = tmp_path / "g.json"
    path.write_text(graph if isinstance(graph, str) else json.dumps(graph))
    rc = cli.main(["place", str(path), *flags])
    out, err = capsys.readouterr()
    return rc, out, err


CHAIN = [["a", "b", 1], ["b", "c", 1]]


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "3"])
def test_place_refuses_a_json_file_that_is_not_an_object(text, tmp_path, capsys):
    rc, _, err = _place(tmp_path, capsys, text)
    assert rc == 2
    assert "g.json holds a JSON" in err and "not an object" in err and '"nodes"' in err
    assert "Traceback" not in err


@pytest.mark.parametrize("edges, cycle", [
    ([["a", "b", 1], ["b", "c", 1], ["c", "a", 1]], "a -> b -> c -> a"),
    # a node downstream of the cycle with the lowest index: the forward walk used to run out of
    # successors there and raise StopIteration
    ([["b", "c", 1], ["c", "b", 1], ["c", "a", 1]], "c -> b -> c"),
])
@pytest.mark.parametrize("algorithm, objective", [("dp", "throughput"), ("greedy", "throughput"),
                                                  ("greedy", "latency"), ("pipedream", "throughput")])
def test_place_names_the_cycle_of_a_cyclic_graph(edges, cycle, algorithm, objective, tmp_path, capsys):
    rc, _, err = _place(tmp_path, capsys, _graph(edges), "--algorithm", algorithm, "--objective", objective)
    assert rc == 2
    assert f"the operator graph has a cycle: {cycle}" in err, err


@pytest.mark.parametrize("objective", ["throughput", "latency"])
@pytest.mark.parametrize("field, value", [("acc_time", float("nan")), ("acc_time", float("inf")),
                                          ("acc_time", -1.0), ("cpu_time", float("nan")),
                                          ("comm_time", -0.5), ("acc_time", "1.0")])
def test_greedy_refuses_nan_inf_negative_and_non_numeric_costs(field, value, objective, tmp_path, capsys):
    rc, out, err = _place(tmp_path, capsys, _graph(CHAIN, **{field: value}), "--algorithm", "greedy",
                          "--objective", objective)
    assert rc == 2 and out == ""
    assert f"node 'b': {field}={value!r} must be a finite number >= 0" in err, err


def _paper_graph(**changes) -> dict:
    """A graph in the paper's format (msr-fiddle/dnn-partitioning): ids 1 -> 2 -> 3; ``changes`` maps
    "node 2"/"edge 1"/"meta" to the fields to set there."""
    nodes = [{"id": i, "name": f"op{i}", "supportedOnFpga": 1, "fpgaLatency": 1.0, "cpuLatency": 2.0,
              "size": 1.0} for i in (1, 2, 3)]
    edges = [{"sourceId": i, "destId": i + 1, "cost": 0.5, "size": 4.0} for i in (1, 2)]
    nodes[1].update(changes.get("node 2", {}))
    edges[0].update(changes.get("edge 1", {}))
    return {"maxFPGAs": 2, "maxCPUs": 1, "maxSizePerFPGA": 100.0, **changes.get("meta", {}),
            "nodes": nodes, "edges": edges}


@pytest.mark.parametrize("changes, needle", [
    ({"node 2": {"fpgaLatency": -1.0}}, "node '2': \"fpgaLatency\"=-1.0 must be a finite number >= 0, "
                                        "or \"supportedOnFpga\": 0 where the op cannot run"),
    ({"node 2": {"cpuLatency": float("nan")}}, "node '2': \"cpuLatency\"=nan must be a finite number >= 0\n"),
    ({"node 2": {"size": -3}}, "node '2': \"size\"=-3.0 must be a finite number >= 0"),
    ({"edge 1": {"cost": -0.5}}, "node '1': outgoing \"cost\"=-0.5 must be a finite number >= 0"),
    ({"edge 1": {"size": float("inf")}}, "edge '1' -> '2': \"size\"=inf must be finite and >= 0"),
    ({"meta": {"maxFPGAs": -2}}, "the graph's \"maxFPGAs\"=-2 must be a number >= 0"),
])
def test_a_paper_format_graph_is_refused_in_its_own_field_names(changes, needle, tmp_path, capsys):
    """Seen: a paper-format file with a negative fpgaLatency was refused as 'acc_time=-1.0', a name the
    user's file never uses."""
    rc, out, err = _place(tmp_path, capsys, _paper_graph(**changes))
    assert rc == 2 and out == "" and needle in err, err
    for ours in ("acc_time", "cpu_time", "mem_bytes", "comm_time", "bytes=", "meta ", "None (null"):
        assert ours not in err, err
    assert _place(tmp_path, capsys, _paper_graph())[0] == 0  # the same graph unchanged is placed


@pytest.mark.parametrize("graph, needle", [
    ({**_paper_graph(), "edges": [{"sourceId": 1, "destId": 9, "cost": 0.5}]},
     'the edge "sourceId" 1 -> "destId" 9: no node has "id" 9'),
    ({**_paper_graph(), "nodes": [{"id": 1, "fpgaLatency": 1.0, "cpuLatency": 2.0}] * 2, "edges": []},
     'two nodes have "id" 1'),
    ({**_paper_graph(), "nodes": ["op1", "op2"]}, "cannot read the graph (AttributeError"),
    # a missing field names the entry, not the field alone (KeyError: 'fpgaLatency')
    ({**_paper_graph(), "nodes": [{"id": 2, "cpuLatency": 2.0}]}, 'node "id" 2 has no "fpgaLatency"'),
    ({**_paper_graph(), "nodes": [{"fpgaLatency": 1.0, "cpuLatency": 2.0}]}, 'node 1 of "nodes" has no "id"'),
    ({**_paper_graph(), "edges": [{"sourceId": 1, "destId": 2}]}, 'edge 1 of "edges" has no "cost"'),
    ({"format": "meshtorch.opgraph/1", "nodes": ["a"], "edges": []}, "cannot read the graph (AttributeError"),
])
def test_a_malformed_paper_format_graph_is_refused_in_its_own_words(graph, needle, tmp_path, capsys):
    """Seen: an edge to an id no node has was 'no node named ...', two nodes of one id 'duplicate node
    name', our words for what the file calls "id"; a node that is no JSON object was a traceback."""
    rc, out, err = _place(tmp_path, capsys, graph)
    assert rc == 2 and out == "" and needle in err, err
    assert "node named" not in err and "node name " not in err and "Traceback" not in err, err


@pytest.mark.parametrize("flags, needle", [
    (["--cpus", "-1"], "cpus=-1 (--cpus) must be >= 0"),
    (["--devices", "-2"], "devices=-2 (--devices) must be >= 0"),
    (["--devices", "0", "--cpus", "0"], "need at least one device (devices=0, cpus=0)"),
])
def test_a_negative_device_count_is_named_alone(flags, needle, tmp_path, capsys):
    """Seen: `--cpus -1` with 2 accelerators said 'need at least one device (devices=2, cpus=-1)'."""
    rc, out, err = _place(tmp_path, capsys, _paper_graph(), *flags)
    assert rc == 2 and out == "" and needle in err, err


def test_greedy_refuses_nan_or_negative_edge_bytes(tmp_path, capsys):
    for b in (float("nan"), -1.0):
        rc, _, err = _place(tmp_path, capsys, _graph([["a", "b", b], ["b", "c", 1]]), "--algorithm", "greedy")
        assert rc == 2
        assert f"edge 'a' -> 'b': bytes={b} must be finite and >= 0" in err


@pytest.mark.parametrize("graph, needle", [
    ({"format": "meshtorch.opgraph/1", "nodes": [], "edges": []}, "the operator graph has no nodes"),
    ({"maxFPGAs": 2, "nodes": [], "edges": []}, "the operator graph has no nodes"),
    ({**_graph(CHAIN), "meta": {"devices": "x"}}, "the graph's meta devices='x' must be a number >= 0"),
    ({**_graph(CHAIN), "meta": {"memory": "big"}}, "the graph's meta memory='big' must be a number >= 0"),
    (_graph(CHAIN, backward="no"), "node 'b': name must be a string, backward true or false"),
    (_graph(CHAIN, color=[1]), "color a string or null; got name='b', backward=False, color=[1]"),
    ({**_graph(CHAIN), "nodes": 5}, "cannot read the graph (TypeError"),
    ({**_graph(CHAIN), "edges": [["a"]]}, "cannot read the graph (ValueError"),
])
@pytest.mark.parametrize("flags", [["--algorithm", "dp"], ["--algorithm", "greedy"],
                                   ["--plan-2bw", "--batch", "4"]])
def test_place_names_malformed_fields(graph, needle, flags, tmp_path, capsys):
    rc, _, err = _place(tmp_path, capsys, graph, *flags)
    assert rc == 2 and needle in err, err


@pytest.mark.parametrize("algorithm", ["dp", "chain", "greedy", "pipedream"])
def test_place_with_a_billion_devices_answers_as_with_one_per_node(algorithm, tmp_path, capsys):
    # three nodes can use at most three devices: a billion must give the same placement, not a
    # MemoryError from tables sized by the request
    _, want, _ = _place(tmp_path, capsys, _graph(CHAIN), "--algorithm", algorithm, "--devices", "3",
                        "--json")
    rc, got, err = _place(tmp_path, capsys, _graph(CHAIN), "--algorithm", algorithm, "--devices",
                          "1000000000", "--cpus", "1000000000", "--json")
    assert rc == 0, err
    strip = ("solve_seconds", "info")
    assert ({k: v for k, v in json.loads(got).items() if k not in strip}
            == {k: v for k, v in json.loads(want).items() if k not in strip})
    assert Problem(devices=10**9, cpus=10**9).resolve(OpGraph.from_dict(_graph(CHAIN))).devices == 3


def _sized_graph(gib_of_b: float) -> dict:
    g = _graph(CHAIN, mem_bytes=gib_of_b * 2**30)
    for n in g["nodes"]:
        n["mem_bytes"] = max(n["mem_bytes"], 2**20)  # 1 MiB each, b larger
    g["meta"]["cpus"] = 1
    return g


@pytest.mark.parametrize("flag, want", [("16GiB", 16 * 2**30), ("16GB", 16e9), ("16384MiB", 16 * 2**30),
                                        ("512MB", 512e6), ("17179869184", 16 * 2**30)])
def test_place_memory_takes_units_and_plain_bytes(flag, want, tmp_path, capsys):
    rc, out, err = _place(tmp_path, capsys, _sized_graph(0.25), "--memory", flag, "--json")
    assert rc == 0, err
    stages = json.loads(out)["stages"]
    assert {s["device"] for s in stages} == {"acc"}  # b fits: nothing needs the CPU
    assert cli_parse_bytes(flag) == want


def test_place_memory_as_a_plain_number_too_small_for_a_node_names_the_node_and_the_unit(tmp_path, capsys):
    # `--memory 16` meant 16 GiB, read as 16 bytes: every node went to the CPU without a word
    rc, out, err = _place(tmp_path, capsys, _sized_graph(2.0), "--memory", "16")
    assert rc == 2 and not out
    assert ("--memory 16 is 16 bytes (a plain number counts bytes), less than node 'b' alone needs "
            "(2.00GiB): write the unit, e.g. --memory 16GiB") in err, err
    # a bound with a unit that holds no node at all leaves the accelerators idle: also refused
    rc, _, err = _place(tmp_path, capsys, _sized_graph(2.0), "--memory", "512KiB")
    assert rc == 2 and "holds no node on an accelerator: the smallest, 'a', needs 1.00MiB" in err, err
    # one that holds the small nodes but not b is a real bound: b goes to the CPU
    # one that holds the small nodes but not b is a real bound, with a unit or as plain bytes of a
    # MiB or more: b goes to the CPU
    for bound in ("1GiB", str(2**30)):
        rc, out, err = _place(tmp_path, capsys, _sized_graph(2.0), "--memory", bound, "--json")
        assert rc == 0, err
        assert {n: s["device"] for s in json.loads(out)["stages"] for n in s["nodes"]} == {
            "a": "acc", "b": "cpu", "c": "acc"}


def test_replicas_are_bounded_and_more_than_127_are_recorded():
    g = OpGraph()
    g.add_node("f", acc_time=1.0, cpu_time=1.0, mem_bytes=1.0, color="x", sync_time=0.001)
    g.add_node("b", acc_time=2.0, cpu_time=2.0, mem_bytes=1.0, backward=True, color="x")
    g.add_edge("f", "b", 1.0)
    # one stage replicated 200 times: the DP's replica table was int8 and overflowed past 127
    dp = place(g, Problem(devices=200, max_replicas=200, training=True), "dp")
    reference = place(g, Problem(devices=200, max_replicas=200, training=True), "pipedream")
    assert [s.replicas for s in dp.stages] == [200] and dp.max_load == pytest.approx(reference.max_load)
    with pytest.raises(PlacementError, match=r"1000000000 usable devices \(2 nodes x up to 1000000000 "
                                             r"replicas each\) is more than the 4096"):
        place(g, Problem(devices=10**9, max_replicas=10**9, training=True), "dp")


def test_plan_2bw_with_a_billion_devices_is_bounded_by_the_graph_and_the_batch():
    from meshtorch.placement.plan2bw import plan_2bw

    g = OpGraph()
    for name, bwd in (("f", False), ("b", True)):
        g.add_node(name, acc_time=1.0, cpu_time=1.0, mem_bytes=1.0, backward=bwd, color="x")
    g.add_edge("f", "b", 1.0)
    small = plan_2bw(g, devices=4, memory=100.0, batch=4)
    huge = plan_2bw(g, devices=10**9, memory=100.0, batch=4)
    assert (huge.depth, huge.width, huge.throughput) == (small.depth, small.width, small.throughput)


def test_the_library_raises_placement_errors_too(tmp_path):
    with pytest.raises(PlacementError, match="cycle"):
        place(OpGraph.from_dict(_graph([["a", "b", 1], ["b", "a", 1]])), Problem(objective="latency"),
              "greedy")
    (tmp_path / "l.json").write_text("[]")
    with pytest.raises(PlacementError, match="l.json holds a JSON list, not an object"):
        OpGraph.from_json(tmp_path / "l.json")


# -- meshtorch plan ---------------------------------------------------------------------------------

PLAN = ["plan", "--d-model", "8", "--heads", "2", "--d-kv", "4", "--d-ff", "16", "--batch", "4",
        "--length", "8", "--vocab", "16", "--json"]


def _plan(capsys, *flags) -> tuple[int, dict | None, str]:
    rc = cli.main([*PLAN, *flags])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else None, err


def test_plan_of_a_billion_layers_is_extrapolated_from_two_shallow_traces(capsys):
    # parameters and FLOPs grow exactly linearly with depth: the billion-layer estimate is the
    # one-layer estimate plus (1e9 - 1) times the step from one layer to two
    flags = ["--mesh", "b:2", "--rules", "batch:b"]
    one, two = (_plan(capsys, "--layers", str(n), *flags)[1] for n in (1, 2))
    rc, deep, err = _plan(capsys, "--layers", "1000000000", *flags)
    assert rc == 0, err
    for key in ("parameters", "flops"):
        assert deep[key] == pytest.approx(one[key] + (10**9 - 1) * (two[key] - one[key]), rel=1e-9), key
    assert not deep["fits"]


def test_plan_search_of_a_billion_layers_answers_and_pipelines_are_refused_by_name(capsys):
    rc, res, err = _plan(capsys, "--layers", "1000000000", "--search", "--processors", "2", "--no-pipeline",
                         "--top", "1")
    assert rc == 0, err
    assert res["parameters"] > 10**9
    for flags in (["--search", "--processors", "2"], ["--pipeline-stages", "2", "--mesh", "stage:2,b:1"]):
        rc, _, err = _plan(capsys, "--layers", "1000000000", *flags)
        assert rc == 2
        assert "a pipelined step of 1000000000 layers" in err and "--no-pipeline" in err, err


# -- meshtorch train --out --------------------------------------------------------------------------

TINY = tiny_train(log_every=2, steps=2)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), 6)


def _train(capsys, *flags) -> tuple[int, str]:
    rc = cli.main(["train", *flags])
    return rc, capsys.readouterr().err


def test_train_refuses_an_out_that_is_a_file_or_under_one(text, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    rc, err = _train(capsys, "--data", text, *TINY, "--out", str(f))
    assert rc == 2 and f"--out {str(f)!r} is a file, not a directory" in err, err
    rc, err = _train(capsys, "--data", text, *TINY, "--out", str(f / "run"))
    assert rc == 2 and "cannot hold a run: Not a directory" in err and "a directory you can write to" in err
    assert f.read_text() == "mine"


def test_train_refuses_a_read_only_out(text, tmp_path, capsys, monkeypatch):
    import errno
    import os

    from meshtorch.recipes.lm import guards

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root writes anywhere: make the file system say what a read-only one does
        def read_only(path, *a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

        monkeypatch.setattr(guards.os, "makedirs", read_only)
    rc, err = _train(capsys, "--data", text, *TINY, "--out", str(ro / "run"))
    assert rc == 2 and f"--out {str(ro / 'run')!r} cannot hold a run" in err, err
    assert "a directory you can write to" in err and "Traceback" not in err


# -- --init-from and --tokenizer: a Hugging Face model directory ----------------------------------

HF_RUN = ["--batch", "4", "--length", "16", "--eval-batches", "1", "--sample-tokens", "4", "--log-every", "2",
          "--warmup", "0", "--no-progress", "--steps", "2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A tiny GPT-2 written as save_pretrained would (config.json + model.safetensors)."""
    import meshtorch as mt
    from meshtorch.models import DecoderLM, TransformerConfig, export_hf

    path = str(tmp_path_factory.mktemp("hf") / "gpt2")
    cfg = TransformerConfig(vocab=264, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=32,
                            bias=True)
    mt.launch(lambda: export_hf(path, DecoderLM(cfg)))
    return path


def _copy(hf_dir: str, tmp_path) -> str:
    import shutil

    return shutil.copytree(hf_dir, str(tmp_path / "model"))


def test_a_good_model_directory_trains(hf_dir, text, tmp_path, capsys):
    # the reference for every case below: the same flags and files, undamaged, run
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", hf_dir, "--out", str(tmp_path / "r"))
    assert rc == 0, err


@pytest.mark.parametrize("keep", [40, 0.5])
def test_a_truncated_safetensors_file_is_named(keep, hf_dir, text, tmp_path, capsys):
    model = _copy(hf_dir, tmp_path)
    f = tmp_path / "model" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", model, "--out", str(tmp_path / "r"))
    assert rc == 2
    assert f"{f} is not a complete safetensors file" in err and "fetch or export it again" in err, err
    assert "Traceback" not in err and "SafetensorError" not in err


@pytest.mark.parametrize("field, value, want", [
    ("n_embd", "16", "a whole number > 0"), ("n_layer", 1.0, "a whole number > 0"),
    ("n_head", True, "a whole number > 0"), ("n_inner", -32, "a whole number > 0 or null"),
    ("layer_norm_epsilon", "1e-5", "a finite number > 0"), ("tie_word_embeddings", "yes", "true or false"),
    ("activation_function", 3, "a string"), ("model_type", ["gpt2"], "a string"),
])
def test_wrong_types_in_config_json_are_named(field, value, want, hf_dir, text, tmp_path, capsys):
    model = _copy(hf_dir, tmp_path)
    cfile = tmp_path / "model" / "config.json"
    config = json.loads(cfile.read_text())
    config[field] = value
    cfile.write_text(json.dumps(config))
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", model, "--out", str(tmp_path / "r"))
    assert rc == 2
    assert f"config.json: {field} is {value!r} ({type(value).__name__}), it must be {want}" in err, err


@pytest.mark.parametrize("content, needle", [("{not json", "is not valid JSON"),
                                             ("[1, 2]", "holds a JSON list, not an object")])
def test_a_config_json_that_is_not_an_object_is_named(content, needle, hf_dir, text, tmp_path, capsys):
    model = _copy(hf_dir, tmp_path)
    (tmp_path / "model" / "config.json").write_text(content)
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", model, "--out", str(tmp_path / "r"))
    assert rc == 2 and f"config.json {needle}" in err, err


def test_the_llama_config_is_type_checked_too():
    from meshtorch.errors import CheckpointError
    from meshtorch.models.hf import _check_types

    good = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": None,
            "rope_theta": 10000.0, "attention_bias": False}
    _check_types(good, "config.json")
    for field, value in (("hidden_size", "4096"), ("rope_theta", float("nan")), ("attention_bias", 0),
                         ("rope_scaling", "linear")):
        with pytest.raises(CheckpointError, match=f"config.json: {field} is"):
            _check_types({**good, field: value}, "config.json")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors",
                                   "a/../../x.safetensors", "link.safetensors", 7])
def test_shard_index_paths_stay_inside_the_model_directory(shard, hf_dir, text, tmp_path, capsys):
    import os

    model = _copy(hf_dir, tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "model" / "model.safetensors").read_bytes())
    os.symlink(tmp_path / "outside.safetensors", tmp_path / "model" / "link.safetensors")
    os.remove(tmp_path / "model" / "model.safetensors")
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": shard}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", model, "--out", str(tmp_path / "r"))
    assert rc == 2
    needle = f"weight_map puts 'transformer.wte.weight' in {shard!r}, which is not a file name inside"
    assert needle in err, err


def test_a_shard_index_that_is_not_an_index_is_named(hf_dir, tmp_path):
    from meshtorch.checkpoint.consolidated import weight_map
    from meshtorch.errors import CheckpointError

    model = _copy(hf_dir, tmp_path)
    index = tmp_path / "model" / "model.safetensors.index.json"
    for text, needle in (("{", "is not a safetensors index"),
                         ('{"weight_map": [1]}', '"weight_map" is a list')):
        index.write_text(text)
        with pytest.raises(CheckpointError, match=needle):
            weight_map(model)
    # a good index of files inside the directory still loads
    index.write_text(json.dumps({"weight_map": {"transformer.wte.weight": "model.safetensors"}}))
    assert weight_map(model) == {"transformer.wte.weight": f"{model}/model.safetensors"}


def test_nan_weights_are_refused_at_load_by_name(hf_dir, text, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model = _copy(hf_dir, tmp_path)
    f = str(tmp_path / "model" / "model.safetensors")
    tensors = load_file(f)
    tensors["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    # d_ff split over two processors: only processor 0 holds the NaN, both must stop alike
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", model, "--mesh", "b:2",
                     "--rules", "batch:b; d_ff:b", "--out", str(tmp_path / "r"))
    assert rc == 2
    assert "hold NaN or infinity (transformer.h.0.mlp.c_fc.weight)" in err, err
    assert "learning rate" not in err and "loss is nan" not in err


@pytest.mark.parametrize("content", [b"garbage{", b"[1, 2]", b'{"model": {"type": "BPE", "vocab": "x"}}',
                                     bytes(range(256))])
def test_a_garbage_tokenizer_json_is_named(content, text, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(content)
    for given in (tok, tok / "tokenizer.json"):
        rc, err = _train(capsys, "--data", text, *TINY, "--tokenizer", str(given),
                         "--out", str(tmp_path / "r"))
        assert rc == 2
        assert f"--tokenizer {str(given)!r}: {tok / 'tokenizer.json'} is not a tokenizers file" in err, err
        assert "Traceback" not in err


def test_a_garbage_tokenizer_json_in_an_init_from_directory_is_named(hf_dir, text, tmp_path, capsys):
    # --tokenizer auto takes the model directory's own tokenizer.json: the file is named, not a traceback
    pytest.importorskip("tokenizers")
    model = _copy(hf_dir, tmp_path)
    (tmp_path / "model" / "tokenizer.json").write_bytes(b"garbage{")
    rc, err = _train(capsys, "--data", text, *HF_RUN, "--init-from", model, "--out", str(tmp_path / "r"))
    assert rc == 2
    assert f"{tmp_path / 'model' / 'tokenizer.json'} is not a tokenizers file" in err, err
    assert f"--init-from {model!r}: its tokenizer.json cannot be read" in err, err  # the flag given
    assert "Traceback" not in err and not (tmp_path / "r" / "tokenizer").exists()


def test_a_garbage_tokenizer_config_is_named(tmp_path):
    from meshtorch.data.corpus import DataError
    from meshtorch.data.hf_tokenizer import _eos_token

    (tmp_path / "tokenizer_config.json").write_text("[")
    with pytest.raises(DataError, match="tokenizer_config.json is not a tokenizer config"):
        _eos_token(str(tmp_path))


# -- meshtorch train: model sizes -------------------------------------------------------------------

@pytest.mark.parametrize("flags, lower", [
    (["--model", "seq2seq", "--encoder-layers", "1000000000"], "--encoder-layers"),
    (["--model", "seq2seq", "--encoder-layers", "1000000"], "--encoder-layers"),
    (["--layers", "1000000000", "--no-memory-check"], "--layers"),  # a certainty, not the planner's guess
    (["--layers", "1000000000", "--rules", "auto", "--mesh", "auto:2"], "--layers"),  # before the search
    (["--d-ff", "1000000000"], "--d-ff"),
    (["--model", "moe", "--experts", "1000000000"], "--experts"),
])
def test_a_model_too_large_for_memory_fails_at_once_naming_the_size(flags, lower, tmp_path, capsys,
                                                                     monkeypatch):
    from meshtorch.plan import devices

    monkeypatch.setattr(devices, "available_memory", lambda: (64 << 30, "a 64 GiB test machine"))
    rc, err = _train(capsys, *flags, "--out", str(tmp_path / "run"), "--tokenizer", "bytes")
    assert rc == 2, err
    assert "the model has at least" in err and "fp32 weights alone need" in err, err
    assert "only 64.00 GiB is available (a 64 GiB test machine)" in err
    assert err.rstrip().endswith(f"lower {lower}"), err
    assert not (tmp_path / "run").exists()  # nothing was started


@settings(max_examples=8, deadline=None)
@draw(model=st.sampled_from(["lm", "moe", "seq2seq"]), d_model=st.sampled_from([4, 8]),
       heads=st.integers(1, 2), d_ff=st.sampled_from([4, 16]), layers=st.integers(1, 3),
       experts=st.integers(1, 3), kv=st.booleans())
def test_the_size_bound_never_exceeds_the_models_real_parameter_count(model, d_model, heads, d_ff, layers,
                                                                      experts, kv):
    from meshtorch.recipes.lm.config import TrainConfig
    from meshtorch.recipes.lm.fit import parameters_at_least
    from meshtorch.recipes.lm.steps import build_model

    cfg = TrainConfig.of(model=model, d_model=d_model, heads=heads, d_kv=4, d_ff=d_ff, layers=layers,
                         encoder_layers=layers, experts=experts, top_k=1, kv_heads=1 if kv else 0,
                         batch=2, length=8)
    bound = sum(parameters_at_least(cfg, vocab=16).values())
    assert 0 < bound <= build_model(cfg, vocab=16).num_parameters()
