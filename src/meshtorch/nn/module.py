"""``mt.nn.Module``: a ``torch.nn.Module`` whose parameters are local slices (DESIGN §6).

Each parameter is a real ``nn.Parameter`` holding this processor's slice, and
remembers its named ``Shape`` and ``Layout``, so ``torch.optim`` works on
``model.parameters()`` unchanged while :meth:`Module.named_mesh_parameters`
gives every parameter back as a :class:`~meshtorch.tensor.MeshTensor` view.

A parameter's values are ``mt.random.<init>(shape, seed=seed, stream=<path>)``
where ``<path>`` is its name in the outermost module (``"mlp.0.kernel"``): the
same model on 1 processor and on 512, under any rules.

Example:
    >>> import meshtorch as mt
    >>> class Affine(mt.nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.scale = self.create_parameter("scale", [d], init="ones")
    ...     def forward(self, x):
    ...         return x * self.mesh_parameter("scale")
    >>> m = Affine(mt.Dim("d", 3))
    >>> m(mt.ones("d:3")).to_global().tolist(), m.num_parameters()
    ([1.0, 1.0, 1.0], 3)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from meshtorch import random as mtr
from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.layout import Layout
from meshtorch.shape import Dim, Shape, as_shape
from meshtorch.tensor import MeshTensor, full

InitFn = Callable[[Shape, int, str], MeshTensor]

_INITS: dict[str, Callable[..., InitFn]] = {
    "normal": lambda std=1.0, mean=0.0: lambda s, seed, st: mtr.normal(
        s, mean, std, seed=seed, stream=st),
    "uniform": lambda low=0.0, high=1.0: lambda s, seed, st: mtr.uniform(
        s, low, high, seed=seed, stream=st),
    "xavier_uniform": lambda **kw: lambda s, seed, st: mtr.xavier_uniform(
        s, seed=seed, stream=st, **kw),
    "kaiming_normal": lambda **kw: lambda s, seed, st: mtr.kaiming_normal(
        s, seed=seed, stream=st, **kw),
    "zeros": lambda: lambda s, seed, st: full(s, 0.0),
    "ones": lambda: lambda s, seed, st: full(s, 1.0),
    "constant": lambda value: lambda s, seed, st: full(s, value),
}


def _init_fn(init: str | InitFn, kwargs: dict) -> InitFn:
    if callable(init):
        return init
    if init not in _INITS:
        raise ShapeError(f"unknown initializer {init!r}; use one of {sorted(_INITS)} or a callable "
                         "(shape, seed, stream) -> MeshTensor")
    return _INITS[init](**kwargs)


def mesh_shape(p: torch.Tensor) -> Shape | None:
    """The named shape of a parameter made by :meth:`Module.create_parameter`, else ``None``."""
    return getattr(p, "_mt_shape", None)


def mesh_layout(p: torch.Tensor) -> Layout | None:
    """The layout of a parameter made by :meth:`Module.create_parameter`, else ``None``."""
    return getattr(p, "_mt_layout", None)


def as_mesh_view(p: torch.Tensor) -> MeshTensor | None:
    """``p`` (a slice parameter) as a MeshTensor sharing its storage and grad, else ``None``."""
    shape, layout = mesh_shape(p), mesh_layout(p)
    return None if shape is None else MeshTensor(p, shape, layout)


class Module(torch.nn.Module):
    """A ``torch.nn.Module`` over MeshTensors whose parameters are local slices.

    Subclasses create parameters with :meth:`create_parameter` and read them
    as MeshTensors with :meth:`mesh_parameter`; ``forward`` takes and returns
    MeshTensors. Build the model inside ``mt.launch`` (or at the prompt for
    one processor): layouts follow the mesh and rules current at creation.

    Example:
        >>> import meshtorch as mt
        >>> m = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
        >>> [(n, str(t.shape)) for n, t in m.named_mesh_parameters()]
        [('kernel', 'd:4,h:2'), ('bias', 'h:2')]
    """

    def __init__(self) -> None:
        super().__init__()
        self._mt_path = ""
        self._mt_seed = 0
        self._mt_inits: dict[str, tuple[Shape, InitFn]] = {}

    # ------------------------------------------------------------ parameters
    def create_parameter(self, name: str, shape: Shape | str | Iterable[Dim],
                         init: str | InitFn = "normal", **init_kwargs: Any) -> torch.nn.Parameter:
        """Create, register and return the parameter ``name`` (its local slice).

        ``init`` is one of ``normal, uniform, xavier_uniform, kaiming_normal,
        zeros, ones, constant`` (with its keyword arguments) or a function
        ``(shape, seed, stream) -> MeshTensor``; the stream is the parameter's path.
        """
        shape = as_shape(shape)
        fn = _init_fn(init, init_kwargs)
        self._mt_inits[name] = (shape, fn)
        value = self._materialize(name, shape, fn)
        p = torch.nn.Parameter(value.local.detach().clone())
        p._mt_shape, p._mt_layout = value.shape, value.layout
        self.register_parameter(name, p)
        return p

    def _materialize(self, name: str, shape: Shape, fn: InitFn) -> MeshTensor:
        path = f"{self._mt_path}.{name}" if self._mt_path else name
        value = fn(shape, self._mt_seed, path)
        if value.shape != shape:
            raise ShapeError(f"initializer of parameter {path!r} returned shape [{value.shape}], "
                             f"expected [{shape}]")
        return value

    def _reinit(self) -> None:
        with torch.no_grad():
            for name, (shape, fn) in self._mt_inits.items():
                p = self._parameters[name]
                p.copy_(self._materialize(name, shape, fn).local.to(p.dtype))

    def mesh_parameter(self, name: str) -> MeshTensor:
        """The parameter ``name`` of this module as a MeshTensor (gradients reach it)."""
        p = self._parameters.get(name)
        view = None if p is None else as_mesh_view(p)
        if view is None:
            raise ShapeError(f"{type(self).__name__} has no mesh parameter {name!r}; create it with "
                             f"self.create_parameter({name!r}, shape)")
        return view

    def named_mesh_parameters(self, prefix: str = "", recurse: bool = True
                              ) -> Iterator[tuple[str, MeshTensor]]:
        """``(name, MeshTensor)`` of every parameter, with its named shape and layout.

        Plain torch parameters (of ordinary ``torch.nn`` submodules) are given
        replicated, with dims named ``<param>_dim<i>``.
        """
        for name, p in self.named_parameters(prefix=prefix, recurse=recurse):
            view = as_mesh_view(p)
            if view is None:
                safe = name.replace(".", "_")
                shape = Shape([Dim(f"{safe}_dim{i}", s) for i, s in enumerate(p.shape)])
                view = MeshTensor(p, shape, Layout(shape, current().mesh, {}))
            yield name, view

    def mesh_parameters(self, recurse: bool = True) -> Iterator[MeshTensor]:
        """Every parameter as a MeshTensor view; see :meth:`named_mesh_parameters`."""
        for _, t in self.named_mesh_parameters(recurse=recurse):
            yield t

    def num_parameters(self) -> int:
        """Number of global parameters (each element counted once, whatever the layout)."""
        return sum(math.prod(t.shape.sizes) for t in self.mesh_parameters())

    def reset_parameters(self, seed: int = 0) -> Module:
        """Re-initialise every parameter of this tree from ``seed`` (and its path)."""
        for m in self.modules():
            if isinstance(m, Module):
                m._mt_seed = seed
                m._reinit()
        return self

    # ------------------------------------------------------------ paths
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if isinstance(value, torch.nn.Module) and "_mt_inits" in self.__dict__:
            self._adopt(name, value)

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        super().add_module(name, module)
        if module is not None and "_mt_inits" in self.__dict__:
            self._adopt(name, module)

    register_module = add_module

    def _adopt(self, name: str, child: torch.nn.Module) -> None:
        # A parameter's stream is its path from the outermost module, which is only
        # known once the child is attached: re-derive the subtree's values now.
        base = f"{self._mt_path}.{name}" if self._mt_path else name
        for sub, m in child.named_modules():
            if isinstance(m, Module):
                path = f"{base}.{sub}" if sub else base
                if m._mt_path != path or m._mt_seed != self._mt_seed:
                    m._mt_path, m._mt_seed = path, self._mt_seed
                    m._reinit()
