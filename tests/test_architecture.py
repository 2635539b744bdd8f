"""The source tree's dependency rules, checked on the source text (nothing is imported).

Every import statement counts, including the deferred ones inside functions: a
function-level import hides a cycle from Python's import machinery but not from the
reader, who still has to understand both modules at once. Imports under
``if TYPE_CHECKING:`` never run and are left out. Importing ``meshtorch.a.b`` also
runs ``meshtorch/a/__init__.py``; that implicit edge is not counted, or every
submodule of a package whose ``__init__`` re-exports it would be in a cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "meshtorch"
# modules that talk to a terminal; everything else returns values or raises meshtorch errors
FRONT_ENDS = ("cli", "__main__")
FRONT_END_PACKAGES = ("meshtorch.recipes", "meshtorch.launcher")
BACKENDS = ("meshtorch.comm.threads", "meshtorch.comm.torch", "meshtorch.comm.meta")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


@functools.cache
def trees() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed on first use: not as each xdist worker collects this file
    (about a second of CPU at every worker's start, where one worker runs these tests)."""
    return {name: ast.parse(p.read_text(), str(p)) for name, p in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (they never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _existing(name: str) -> str | None:
    """The longest prefix of a dotted name that is a meshtorch module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str) -> list[tuple[str, int]]:
    """(imported meshtorch module, line) for every import statement in module ``name``."""
    tree = trees()[name]
    skip = _type_checking_nodes(tree)
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from meshtorch import x` imports the submodule meshtorch.x when there is one
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                       for a in node.names]
        else:
            continue
        for target in targets:
            resolved = _existing(target) if target.split(".")[0] == PACKAGE else None
            if resolved and resolved != name:
                found.append((resolved, node.lineno))
    return found


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for name in MODULES:
        for target, line in imports_of(name):
            graph.add_edge(name, target, line=line)
    return graph


def import_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module, each as a closed path."""
    cycles = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            edges = nx.find_cycle(graph.subgraph(component))
            cycles.append([u for u, _ in edges] + [edges[0][0]])
    return sorted(cycles)


def _where(graph: nx.DiGraph, path: list[str]) -> str:
    return " -> ".join(f"{u} (line {graph.edges[u, v]['line']})" for u, v in zip(path, path[1:])) + \
        f" -> {path[-1]}"


def test_import_graph_sees_deferred_relative_and_from_package_imports():
    # the checker itself, on modules whose imports are known
    lines = MODULES["meshtorch.random"].read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("from meshtorch.errors import"))
    assert ("meshtorch.errors", line) in imports_of("meshtorch.random")
    # `from meshtorch import x` is an edge to the submodule meshtorch.x
    assert {t for t, _ in imports_of("meshtorch")} >= {"meshtorch.errors", "meshtorch.random", "meshtorch.nn"}
    # a deferred import inside a function body counts (ops.nn.dropout imports meshtorch.random)
    assert "meshtorch.random" in {t for t, _ in imports_of("meshtorch.ops.nn")}
    cyclic = nx.DiGraph([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])
    assert import_cycles(cyclic) in ([["a", "b", "c", "a"]], [["b", "c", "a", "b"]], [["c", "a", "b", "c"]])


def test_no_import_cycles():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in src/meshtorch (move the shared code down a level):\n" \
        + "\n".join(_where(graph, c) for c in cycles)


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_library_never_imports_the_app():
    offenders = [f"{name} imports {target} (line {line})" for name in MODULES
                 if not _in(name, "meshtorch.recipes") and name != "meshtorch.cli"
                 for target, line in imports_of(name) if _in(target, "meshtorch.recipes")]
    assert not offenders, "the library must not depend on the LM recipe:\n" + "\n".join(offenders)


@pytest.mark.parametrize("package", ["meshtorch.ops", "meshtorch.models"])
def test_ops_and_models_never_import_a_concrete_backend(package):
    offenders = [f"{name} imports {target} (line {line})" for name in MODULES if _in(name, package)
                 for target, line in imports_of(name) if any(_in(target, b) for b in BACKENDS)]
    assert not offenders, f"{package} must reach processors only through the context's communicator:\n" + \
        "\n".join(offenders)


@pytest.mark.parametrize("package", ["meshtorch.ops", "meshtorch.models", "meshtorch.nn", "meshtorch.tensor"])
def test_only_the_lowering_decides_communication(package):
    # ops, layers and models describe what to compute; which collectives run is the lowering's choice
    offenders = [f"{name} imports {target} (line {line})" for name in MODULES if _in(name, package)
                 for target, line in imports_of(name) if target == "meshtorch.lowering.adapters"]
    assert not offenders, f"{package} must move data through the lowering (lower, redistribute, " \
        "shift_slice), not call its adapters:\n" + "\n".join(offenders)


def test_no_bare_assert_in_the_library():
    # asserts vanish under python -O; a check the user can trip raises a meshtorch error instead
    offenders = [f"{MODULES[name]}:{node.lineno}" for name, tree in trees().items()
                 for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not offenders, "bare assert in src/meshtorch (raise a meshtorch.errors class):\n" \
        + "\n".join(offenders)


def test_only_front_ends_print():
    def front_end(name: str) -> bool:
        return name.rpartition(".")[2] in FRONT_ENDS or any(_in(name, p) for p in FRONT_END_PACKAGES)

    offenders = [f"{MODULES[name]}:{node.lineno}" for name, tree in trees().items() if not front_end(name)
                 for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id == "print"]
    assert not offenders, "print( in a library module (return the text, or print it from a CLI module):\n" + \
        "\n".join(offenders)


# The core's levels, lowest first: a module may import its own level and the ones below, never
# one above. The communicators sit below the processor context (which holds one), and the
# lowering's engine below MeshTensor (whose operators lower through it; the lowering builds its
# results through the class the tensor module registers, meshtorch.lowering.output).
LEVELS = [
    # (meta_autocast: the planner's autocast of meta tensors, which imports only torch and errors;
    # the lowering asks it whether a meta step runs under autocast, as it asks torch for real ones)
    ("meshtorch.errors", "meshtorch.shape", "meshtorch.mesh", "meshtorch.caching", "meshtorch.meta_autocast",
     "meshtorch.streams"),
    ("meshtorch.layout",),
    ("meshtorch.comm",),
    ("meshtorch.context",),
    ("meshtorch.lowering",),
    ("meshtorch.tensor",),
]


def _level(name: str) -> int | None:
    for i, packages in enumerate(LEVELS):
        if any(_in(name, p) for p in packages):
            return i
    return None


def test_the_core_depends_only_downward():
    offenders = [f"{name} (level {_level(name)}) imports {target} (level {_level(target)}, line {line})"
                 for name in MODULES if _level(name) is not None
                 for target, line in imports_of(name)
                 if target != PACKAGE and (_level(target) is None or _level(target) > _level(name))]
    assert not offenders, "an arrow pointing up in the core (move the code down, or have the " \
        "lower level be handed what it needs):\n" + "\n".join(offenders)


def test_the_level_check_sees_an_upward_import():
    # the check itself: these would be arrows up
    assert _level("meshtorch.comm.threads") < _level("meshtorch.context")
    assert _level("meshtorch.lowering.redistribute") < _level("meshtorch.tensor")
    assert _level("meshtorch.ops.elementwise") is None  # not core: may import every level


def test_a_mesh_tensor_has_its_operators_whatever_was_imported_first():
    # a fresh interpreter: nothing but the tensor module imported, no meshtorch.ops
    import os
    import subprocess
    import sys

    program = (
        "import sys, torch\n"
        "from meshtorch.tensor import from_global\n"
        "x = from_global(torch.tensor([1.0, -2.0, 3.0]), 'a:3')\n"
        "y = (x * x + 1 - x / 2) ** 2 // 1 % 7\n"
        "print((y.local.tolist(), (-x).local.tolist(), abs(x).local.tolist(), (x < 0).local.tolist(),"
        " (2 - x).local.tolist(), 'meshtorch.ops' in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    t = [1.0, -2.0, 3.0]
    y = [((v * v + 1 - v / 2) ** 2 // 1) % 7 for v in t]
    assert out.stdout.strip() == str((y, [-v for v in t], [abs(v) for v in t], [v < 0 for v in t],
                                      [2 - v for v in t], False))
