"""What one replica builds inside ``repl.context()``: the modules, how they nest, and which
module owns which parameter, seen through torch's global module and parameter registration
hooks.

The Replicator is never handed the model, only optimizers. On leaving the block it puts its
guards (``torch.nn.SyncBatchNorm`` on thread-replicas, ``Embedding(max_norm=...)``) on the
models an optimizer wrapped there trains: the modules connected, by nesting, to a module
that owns one of its parameters. (Their buffers are not broadcast: a module built on one
replica only that wraps or ties the model would be counted there alone.)

Example:
    >>> import torch
    >>> from meshtorch.replicator.building import BuiltModules
    >>> with BuiltModules() as built:
    ...     model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ...     other = torch.nn.BatchNorm1d(3)
    >>> [type(m).__name__ for m in built.trained([model[0].weight])]
    ['Linear', 'BatchNorm1d', 'Sequential']
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class BuiltModules:
    """Records the modules this thread builds while the ``with`` block runs.

    The hooks are process-wide (thread-replicas share them), so only calls made on the
    thread that entered the block count. Modules are held until the object is dropped,
    so their ids stay unique.
    """

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._modules: dict[int, torch.nn.Module] = {}
        self._parent: dict[int, int] = {}          # union-find over module ids: nesting
        self._owner: dict[int, int] = {}           # id(parameter) -> id(module)
        self._hooks: list = []

    def __enter__(self) -> BuiltModules:
        self._hooks = [register_module_buffer_registration_hook(self._on_buffer),
                       register_module_parameter_registration_hook(self._on_parameter),
                       register_module_module_registration_hook(self._on_child)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ hooks
    def _mine(self, module: torch.nn.Module) -> bool:
        if threading.get_ident() != self._thread:
            return False
        self._modules.setdefault(id(module), module)
        return True

    def _on_buffer(self, module: torch.nn.Module, _name: str, _buffer) -> None:
        self._mine(module)  # (a module with buffers only, a BatchNorm without affine: it nests too)

    def _on_parameter(self, module: torch.nn.Module, _name: str, param) -> None:
        if self._mine(module) and param is not None:
            self._owner[id(param)] = id(module)

    def _on_child(self, module: torch.nn.Module, _name: str, child) -> None:
        if child is not None and self._mine(module) and self._mine(child):
            self._parent[self._root(id(child))] = self._root(id(module))

    def _root(self, i: int) -> int:
        while self._parent.get(i, i) != i:
            i = self._parent[i]
        return i

    # ---------------------------------------------------------------- queries
    def trained(self, params: Iterable[torch.Tensor]) -> list[torch.nn.Module]:
        """The modules built here that are nested together with an owner of ``params``."""
        roots = {self._root(self._owner[id(p)]) for p in params if id(p) in self._owner}
        return [m for i, m in self._modules.items() if self._root(i) in roots]
