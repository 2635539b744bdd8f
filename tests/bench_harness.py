"""Tests import benchmark scripts (``benchmarks/<name>.py``) as modules with :func:`load_benchmark`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``bench_<name>``, imported once per session.

    It is registered in ``sys.modules`` (dataclasses look their module up there), and
    ``benchmarks/`` is on ``sys.path`` while it runs, as when the script runs from there
    (scripts import their neighbours, such as ``limits.py``)."""
    key = f"bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    path = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    finally:
        sys.path[:] = path
    return module
