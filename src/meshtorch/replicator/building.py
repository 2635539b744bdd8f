"""What one replica builds inside ``repl.context()``: the modules, how they nest, and which
module owns which parameter, seen through torch's global module/parameter/buffer
registration hooks.

The Replicator is never handed the model, only optimizers. On leaving the block it
broadcasts the buffers (BatchNorm's running statistics) of the models an optimizer
wrapped there trains: the modules connected, by nesting, to a module that owns one of
its parameters. A module built on one replica only (an evaluation copy on replica 0)
is left alone, so the replicas still make the same collective calls.

Example:
    >>> import torch
    >>> from meshtorch.replicator.building import BuiltModules
    >>> with BuiltModules() as built:
    ...     model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ...     other = torch.nn.BatchNorm1d(3)
    >>> [tuple(b.shape) for b in built.buffers(built.trained([model[0].weight]))]
    [(2,), (2,), ()]
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
        self._buffers: dict[tuple[int, str], None] = {}
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

    def _on_buffer(self, module: torch.nn.Module, name: str, _buffer) -> None:
        if self._mine(module):
            self._buffers[(id(module), name)] = None

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

    def buffers(self, modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
        """The buffers of ``modules`` registered here, as they are now (``.double()``,
        ``.to()`` and ``load_state_dict`` replace or fill them), each tensor once."""
        ids = {id(m) for m in modules}
        seen: set[int] = set()
        out = []
        for (i, name) in self._buffers:
            b = self._modules[i]._buffers.get(name) if i in ids else None
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
        return out
