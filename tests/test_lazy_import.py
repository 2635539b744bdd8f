"""`import meshtorch` is lazy: torch-free commands stay torch-free, the API behaves as if eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    if out.returncode:
        raise AssertionError(out.stderr)
    return out.stdout.strip()


def test_place_on_a_json_graph_never_imports_torch(tmp_path):
    from meshtorch.placement import OpGraph

    graph = OpGraph()
    for i, t in enumerate([1.0, 2.0, 3.0, 2.0]):
        graph.add_node(f"l{i}", acc_time=t, cpu_time=10 * t)
    for i in range(3):
        graph.add_edge(f"l{i}", f"l{i + 1}")
    path = tmp_path / "chain.json"
    graph.to_json(path)
    code = ("import sys\nfrom meshtorch.cli import main\n"
            f"rc = main(['place', {str(path)!r}, '--devices', '2', '--json'])\n"
            "print('torch-imported' if 'torch' in sys.modules else 'torch-free', rc)")
    out = _python(code).splitlines()
    assert out[-1] == "torch-free 0"
    # a 1-2-3-2 chain on two devices: the best contiguous cut is {1,2} | {3,2} -> max load 5
    assert json.loads("\n".join(out[:-1]))["max_load"] == pytest.approx(5.0)


def test_import_meshtorch_is_cheap_and_the_api_appears_on_first_use():
    out = _python("import sys, meshtorch as mt\nprint('torch' in sys.modules)\n"
                  "print(mt.Dim('batch', 4).size, 'torch' in sys.modules)")
    assert out.splitlines() == ["False", "4 True"]


def test_launch_is_the_function_even_after_the_launcher_is_imported_first():
    # `mt.launch` is the function; its package is `meshtorch.launcher`, so importing that first
    # leaves `mt.launch` alone
    code = ("import meshtorch.launcher.cli, meshtorch as mt, torch\n"
            "def step():\n"
            "    x = mt.from_global(torch.ones(4), [mt.Dim('batch', 4)])\n"
            "    return mt.reduce_sum(x * 3).item()\n"
            "print(callable(mt.launch), mt.launch(step, mesh='b:2', rules='batch:b'))")
    assert _python(code) == "True [12.0, 12.0]"


def test_star_import_dir_and_unknown_names():
    import meshtorch as mt

    namespace: dict = {}
    exec("from meshtorch import *", namespace)
    for name in ("launch", "Dim", "einsum", "reduce_sum", "Mesh", "nn", "optim"):
        assert namespace[name] is getattr(mt, name)
    assert {"launch", "einsum", "Replicator"} <= set(dir(mt))
    assert callable(mt.launch) and mt.random.__name__ == "meshtorch.random"
    with pytest.raises(AttributeError, match="no attribute 'no_such_op'"):
        mt.no_such_op  # noqa: B018


def test_a_graph_file_missing_a_field_names_it(tmp_path):
    from meshtorch.errors import PlacementError
    from meshtorch.placement import OpGraph

    path = tmp_path / "paper.json"
    path.write_text(json.dumps({"nodes": [{"id": 0, "cpuLatency": 1.0}], "edges": []}))
    missing = r"paper.json: cannot read the graph \(node \"id\" 0 has no \"fpgaLatency\"\); expected the"
    with pytest.raises(PlacementError, match=missing):
        OpGraph.from_json(path)


def test_the_package_is_a_plain_module():
    # no module-class trick: the lazy API is PEP 562's module __getattr__, and no name is both a
    # sub-package and a public function (the launchers live in meshtorch.launcher)
    import pkgutil
    import types

    import meshtorch as mt

    assert type(mt) is types.ModuleType
    submodules = {m.name for m in pkgutil.iter_modules(mt.__path__)}
    shadowed = {n for n in submodules if callable(getattr(mt, n, None))}
    assert not shadowed, f"sub-modules whose name is also a public function: {shadowed}"
    assert "launcher" in submodules and callable(mt.launch)


def test_threads_touching_the_api_while_it_is_bound_all_get_it():
    # thread-processors starting a script (`meshtorch launch --backend threads`) reach the lazy
    # API together: one that comes while another binds it waits for it. An import hook holds the
    # first thread inside the binding while the others ask.
    code = ("import sys, threading, time, meshtorch as mt\n"
            "binding = threading.Event()\n"
            "class Hold:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'meshtorch.ops.einsum' and not binding.is_set():\n"
            "            binding.set(); time.sleep(0.5)\n"
            "sys.meta_path.insert(0, Hold())\n"
            "got = []\n"
            "def first(): got.append(mt.current().mesh.size)\n"
            "def later(): binding.wait(); got.append(mt.current().mesh.size)\n"
            "ts = [threading.Thread(target=f) for f in (first, later, later, later)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "print(got)")
    assert _python(code) == "[1, 1, 1, 1]"


def test_a_spawned_processor_starts_without_dynamo():
    # every mt.launch(backend="torch") processor and CLI run imports these; Dynamo (about a
    # second of start-up each) is imported only when something compiles
    code = ("import sys, meshtorch as mt, meshtorch.launcher.processes, meshtorch.comm.torch, "
            "meshtorch.recipes.lm\nmt.Mesh('b:2')\nprint('torch._dynamo' in sys.modules)")
    assert _python(code) == "False"


def test_the_constant_mark_without_dynamo_is_the_one_torch_sets():
    import torch

    from meshtorch.caching import constant_result

    def ours():
        return 0

    def torchs():
        return 0

    constant_result(ours)
    before = set(vars(torchs))
    torch.compiler.assume_constant_result(torchs)
    assert {k: v for k, v in vars(torchs).items() if k not in before} == vars(ours)

