"""The bounded memo the hot paths share (layouts, one-processor views, einsum and broadcast plans),
and the directory where meshtorch keeps what it measured or computed once per machine.

A model asks for the same few derived objects (a layout, an einsum plan) on every op of every
step; each is a pure function of its key, so it is computed once. The bound only guards against
a program that keeps making new shapes: when full, the memo starts over.

Example:
    >>> from meshtorch.caching import BoundedCache
    >>> cache = BoundedCache(limit=2)
    >>> cache.get("a") or cache.put("a", 1)
    1
    >>> cache.put("b", 2), cache.put("c", 3), sorted(cache)
    (2, 3, ['c'])
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

V = TypeVar("V")


class BoundedCache(dict):
    """A dict that empties itself instead of growing past ``limit`` entries.

    Look up with the plain ``dict.get`` (the hit path stays one C call) and store a miss with
    :meth:`put`, which returns the value.
    """

    __slots__ = ("limit",)

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def __reduce__(self) -> tuple:
        # a copy or pickle starts empty: what is kept (plans holding local functions, which do not
        # pickle) is made again on first use; torch.save(model) of a layer that has run failed
        return (type(self), (self.limit,))

    def put(self, key: Any, value: V) -> V:
        """Store ``value`` under ``key`` (clearing first when full) and return it.

        Under ``torch.compile`` nothing is stored: the traced program keeps what it computed as
        constants, and a store would be a side effect on a global dict that Dynamo replays
        after the graph (rebuilding the keys it made half-initialised)."""
        if compiling():
            return value
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


CONSTANT_RESULTS: list[Callable] = []  # what constant_result marked, for meshtorch.compiler


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing Dynamo (about a second of
    start-up in every fresh processor): the decorator only sets this mark, which Dynamo reads
    when it meets the call, so Dynamo calls ``fn`` at trace time and keeps its result as a
    constant. ``meshtorch.compiler`` applies torch's own decorator to every function marked here
    before it compiles, so a torch that marks differently still sees them
    (``tests/test_lazy_import.py`` checks that the two marks agree).

    Example:
        >>> from meshtorch.caching import constant_result
        >>> constant_result(lambda: 3)()
        3
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    CONSTANT_RESULTS.append(fn)
    return fn


def compiling() -> bool:
    """Whether ``torch.compile`` (Dynamo) is tracing this call; never imports torch.

    False in a function Dynamo calls rather than traces (the lowering's plans, resolved
    outside the trace by :func:`meshtorch.lowering.lower.plan_of`), so its memos work there.

    Once torch is imported, the first call puts torch's own test in this module's place of
    ``compiling``: callers that read it as ``caching.compiling()`` then make one Python call,
    not two (the memos of shapes and layouts ask on every op, paid cold between a model's large
    kernels, issue 27); a name imported earlier keeps this function, which asks the same test."""
    global _is_dynamo_compiling
    test = _is_dynamo_compiling
    if test is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        # is_dynamo_compiling: True only in traced code (torch >= 2.3); is_compiling is also True
        # in a function Dynamo calls at trace time on some versions (2.13) and not others (2.11).
        # Looked up once: the lowering asks on every op (each lookup two more calls, paid cold
        # between a model's large kernels, issue 27)
        test = _is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling",
                                              torch.compiler.is_compiling)
        globals()["compiling"] = test  # (this module's name for it from now on)
    return test()


_is_dynamo_compiling: Callable[[], bool] | None = None


# torch's private tests of a dispatch mode, looked up at the first call (this module never imports
# torch): this thread's mode stack's length; Dynamo's own test of it (torch >= 2.10: a non-infra
# mode that does not ignore compile internals); the process-wide flag older Dynamo reads. A test
# replaces them to stand for a torch without some of them.
_mode_tests: tuple[Callable[[], Any] | None, ...] | None = None


def _load_mode_tests() -> tuple:
    global _mode_tests
    if _mode_tests is None:
        import inspect

        import torch
        from torch.utils import _python_dispatch as pd

        flag = getattr(pd, "is_in_any_mode_without_ignore_compile_internals", None)
        if flag is None and callable(getattr(pd, "is_in_torch_dispatch_mode", None)):
            test = pd.is_in_torch_dispatch_mode
            infra = "include_infra_modes" in inspect.signature(test).parameters
            flag = (lambda: test(include_infra_modes=False)) if infra else test
        _mode_tests = (getattr(torch._C, "_len_torch_dispatch_stack", None),
                       getattr(pd, "any_torch_dispatch_mode_on_stack", None), flag)
    return _mode_tests


def _dynamo_reads_the_stack(on_stack: Callable[[], bool] | None) -> bool:
    """Whether Dynamo skips a frame for a mode on this thread's stack (torch >= 2.10, its config's
    ``inline_torch_dispatch_torch_compile``, on by default), not for the process-wide flag."""
    if on_stack is None:
        return False
    config = sys.modules.get("torch._dynamo.config")  # (not imported: nothing compiled yet, defaults)
    return bool(getattr(config, "inline_torch_dispatch_torch_compile", True))


def dispatch_mode_active(any_mode: bool = True) -> bool:
    """Whether ``torch.compile`` would refuse to compile here because of a ``TorchDispatchMode`` (a
    FLOP counter, a planner's tracer): Dynamo runs a frame uncompiled under one, and a function
    compiled with ``fullgraph=True`` called there is marked never to compile again in the process
    (torch 2.13: its later calls find "no compiled frames"), so callers run their code uncompiled
    instead. Dynamo's own test: on torch >= 2.10 a mode on this thread's stack (modes of torch's
    tracing infrastructure and those that ignore compile internals aside), before it one flag per
    process, which modes entered and left on several threads at once leave set.
    ``any_mode``: also True for any mode on this thread's stack, the infrastructure's too (code
    that must not call a compiled function inside a trace, e.g. AOTAutograd's of a backward).

    Example:
        >>> import torch
        >>> from torch.utils.flop_counter import FlopCounterMode
        >>> from meshtorch.caching import dispatch_mode_active
        >>> with FlopCounterMode(display=False):
        ...     inside = dispatch_mode_active()
        >>> inside, dispatch_mode_active()
        (True, False)
    """
    stack, on_stack, flag = _mode_tests or _load_mode_tests()
    depth = stack() if callable(stack) else None
    if any_mode and depth:
        return True
    if _dynamo_reads_the_stack(on_stack):
        return depth != 0 and on_stack()  # (an empty stack holds no mode: no walk, a call per step)
    return bool(flag()) if callable(flag) else False


def cache_root() -> Path:
    """Where meshtorch keeps per-machine results (the planner's calibration, encoded corpora):
    ``$MESHTORCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshtorch`` (``~/.cache/meshtorch``).

    Example:
        >>> from meshtorch.caching import cache_root
        >>> (cache_root() / "cpu.json").suffix
        '.json'
    """
    root = os.environ.get("MESHTORCH_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshtorch")
    return Path(root)
