"""``MeshParameter``: a ``torch.nn.Parameter`` that is one processor's slice of a named tensor.

A MeshParameter carries its named ``Shape`` and ``Layout`` (``mesh_shape``,
``mesh_layout``) and reads back as a :class:`~meshtorch.tensor.MeshTensor`
with ``p.mesh_tensor`` (sharing storage and gradient). Its values are
``init(shape, seed, stream)``, where the stream is its path in the outermost
module (``"mlp.0.kernel"``): the same model on 1 processor and on 512, under
any rules. That path is only known once the model is assembled, so the values
are drawn lazily, once, the first time they are read: ``p.mesh_tensor``, the
parameter attribute of its module, ``model.parameters()``, ``state_dict``,
``model.to(...)``. The storage itself exists from the start (so optimizers,
hooks and memory accounting see the final tensor).

Example:
    >>> import meshtorch as mt
    >>> p = mt.nn.MeshParameter("d:3", init="constant", value=2.0)
    >>> p.mesh_shape, p.materialized
    (Shape('d:3'), False)
    >>> p.mesh_tensor.to_global().tolist(), p.materialized
    ([2.0, 2.0, 2.0], True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.overrides import TorchFunctionMode
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types
from torch.utils._pytree import tree_leaves

from meshtorch import random as mtr
from meshtorch.context import current, use
from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.layout import Layout
from meshtorch.lowering.redistribute import LastingMemo
from meshtorch.shape import Dim, Shape, as_shape
from meshtorch.tensor import MeshTensor, full, layout_for, local_shape

InitFn = Callable[[Shape, int, str], MeshTensor]

INITS: dict[str, Callable[..., InitFn]] = {
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


def _init_fn(init: str | InitFn, kwargs: dict[str, Any]) -> InitFn:
    """The initializer named ``init`` (with its keyword arguments), or ``init`` itself if callable."""
    if callable(init):
        return init
    given = sorted({"seed", "stream"} & set(kwargs))
    if given:
        # the seed is the model's and the stream the parameter's path: a per-layer seed would
        # make the same layer differ between models; Dense(d, h, seed=1) used to fail deep inside
        raise ArgumentError(
            f"initializer {init!r} got {', '.join(given)}=: a parameter's seed is its model's and its "
            "stream its path; draw a layer from seed s with layer.reset_parameters(seed=s)")
    if init not in INITS:
        raise ShapeError(f"unknown initializer {init!r}; use one of {sorted(INITS)} or a callable "
                         "(shape, seed, stream) -> MeshTensor")
    return INITS[init](**kwargs)


class MeshParameter(torch.nn.Parameter):
    """This processor's slice of a named, laid-out parameter, initialised once on first read.

    Args:
        shape: the global named shape.
        init: ``normal, uniform, xavier_uniform, kaiming_normal, zeros, ones,
            constant`` (configured by ``init_kwargs``) or a function
            ``(shape, seed, stream) -> MeshTensor``.
        requires_grad: as for ``torch.nn.Parameter``.

    The layout follows the mesh and rules current at creation; the storage is
    allocated then, with the default dtype on the processor's device
    (``mt.current().device``), and the values are cast to it. Assigned to an
    ``mt.nn.Module`` attribute, the parameter takes the attribute's path as its
    stream; attaching that module to a parent re-labels the path (the values are
    drawn for the final path, once).

    Example:
        >>> import meshtorch as mt
        >>> class Scale(mt.nn.Module):
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.scale = mt.nn.MeshParameter([d], init="ones")
        ...     def forward(self, x):
        ...         return x * self.scale.mesh_tensor
        >>> m = mt.nn.Sequential(Scale(mt.Dim("d", 3)))
        >>> m[0].scale.stream, m(mt.ones("d:3")).to_global().tolist()
        ('0.scale', [1.0, 1.0, 1.0])
    """

    mesh_shape: Shape
    mesh_layout: Layout
    seed: int
    stream: str
    materialized: bool

    def __new__(cls, shape: Shape | str | Iterable[Dim], init: str | InitFn = "normal", *,
                requires_grad: bool = True, **init_kwargs: Any) -> MeshParameter:
        shape = as_shape(shape)
        fn = _init_fn(init, init_kwargs)
        layout = layout_for(shape)
        # the storage is made where the processor computes; no device mode is needed for that
        storage = torch.empty(local_shape(layout), device=current().device)
        p = torch.Tensor._make_subclass(cls, storage, requires_grad)
        p._set_mesh(shape, layout, fn, current(), seed=0, stream="", materialized=False)
        return p

    def _set_mesh(self, shape: Shape, layout: Layout, fn: InitFn | None, ctx, *, seed: int, stream: str,
                  materialized: bool) -> None:
        self.mesh_shape, self.mesh_layout = shape, layout
        self._init, self._ctx = fn, ctx
        self._adapted = LastingMemo()
        self.seed, self.stream, self.materialized = seed, stream, materialized

    @property
    def mesh_tensor(self) -> MeshTensor:
        """This parameter as a MeshTensor sharing its storage (gradients reach the parameter)."""
        if not self.materialized:
            self.materialize()
        t = MeshTensor(self, self.mesh_shape, self.mesh_layout)
        # Every read shares the lowering's adapters (run_shared): uses of one parameter (a tied
        # embedding table: lookup and output layer) add their partial gradients locally and
        # reduce them once per axis group, as Mesh-TF does.
        t._adapted = self._adapted
        return t

    def relabel(self, stream: str, seed: int) -> None:
        """Give the parameter its path in the model (and the model's seed); its values are
        drawn again, on next read, if either changed."""
        if (stream, seed) != (self.stream, self.seed):
            self.stream, self.seed = stream, seed
            self.materialized = self._init is None  # values restored from a pickle stay

    def materialize(self) -> MeshParameter:
        """Draw the values now, ``init(mesh_shape, seed, stream)``, in place (the storage stays)."""
        if self._init is None:
            self.materialized = True
            return self
        # drawn on the processor that made the parameter, wherever it is read from; the
        # initialisers make their values on that processor's device (a parameter moved since,
        # by model.to(...), gets them copied over)
        ctx = self._ctx
        here = nullcontext() if ctx is None or current() is ctx else use(ctx)
        with torch.no_grad(), here:
            value = self._init(self.mesh_shape, self.seed, self.stream)
            if value.shape != self.mesh_shape:
                raise ShapeError(f"initializer of parameter {self.stream!r} returned shape [{value.shape}], "
                                 f"expected [{self.mesh_shape}]")
            if value.layout != self.mesh_layout:
                raise ShapeError(
                    f"parameter {self.stream!r} of shape [{self.mesh_shape}] was created with layout "
                    f"{self.mesh_layout} but is initialised under layout {value.layout}; create and use "
                    "a model under the same mesh and rules")
            self.copy_(value.local)
        self.materialized = True
        return self

    def __deepcopy__(self, memo: dict) -> MeshParameter:
        if id(self) in memo:
            return memo[id(self)]
        data = self.data.clone(memory_format=torch.preserve_format)
        p = torch.Tensor._make_subclass(MeshParameter, data, self.requires_grad)
        # a copy still unread draws the same values on first read: same init, seed and stream
        p._set_mesh(self.mesh_shape, self.mesh_layout, self._init, self._ctx, seed=self.seed,
                    stream=self.stream, materialized=self.materialized)
        memo[id(self)] = p
        return p

    def __reduce_ex__(self, proto: int):
        # initializers are closures and contexts hold communicators: pickle the values
        if not self.materialized:
            self.materialize()
        return (_rebuild, (self.data, self.requires_grad, self.mesh_shape, self.mesh_layout, self.seed,
                           self.stream))

    def __repr__(self) -> str:
        if not self.materialized:
            self.materialize()
        return (f"MeshParameter {self.stream!r} [{self.mesh_shape}] {self.mesh_layout} containing:\n"
                + torch.Tensor.__repr__(self))


class plain_parameters(TorchFunctionMode):
    """Within the block, torch sees each MeshParameter an op takes as a plain ``nn.Parameter``.

    For tracers that accept only exact ``Tensor``/``Parameter`` types, such as
    ``make_fx`` (the parameter is the same object, so the trace holds it as the
    model's constant); outside the block nothing changes.

    Example:
        >>> import torch, meshtorch as mt
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> dense = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 3), bias=False)
        >>> with mt.nn.parameter.plain_parameters():
        ...     gm = make_fx(lambda x: dense(mt.from_global(x, "d:2")).local)(torch.ones(2))
        >>> [type(p).__name__ for p in gm.parameters()]
        ['MeshParameter']
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        params = [a for a in tree_leaves((args, kwargs)) if type(a) is MeshParameter]
        for p in params:  # the same object, so autograd, storage and identity are untouched
            p.__class__ = torch.nn.Parameter
        try:
            return func(*args, **kwargs)
        finally:
            for p in params:
                p.__class__ = MeshParameter


# torch.optim and clip_grad_norm_ take their multi-tensor (foreach) kernels only for the tensor
# types listed here; a MeshParameter is an ordinary dense tensor to them (torch lists DTensor alike)
for _types in (_optim_foreach_types, _util_foreach_types):
    if MeshParameter not in _types:
        _types.append(MeshParameter)


def mesh_state(p: MeshParameter) -> dict[str, Any]:
    """What makes ``p`` a MeshParameter beyond its values (mesh shape, layout, initializer, seed,
    stream, materialized flag, and any attribute set on it), kept across a conversion that may
    leave a plain ``nn.Parameter`` in its place: :func:`as_mesh_parameter` puts it back."""
    return dict(p.__dict__)


def as_mesh_parameter(p: torch.Tensor | None, state: dict[str, Any]) -> None:
    """Make ``p`` a MeshParameter again, with ``state`` (:func:`mesh_state`), where torch made it a
    plain ``nn.Parameter``: ``torch.utils.swap_tensors`` (the swap flag of
    ``torch.__future__``: the same object, with a new Parameter's class and ``__dict__``), or a new
    Parameter in its place (the overwrite flag, a move to or from meta, ``load_state_dict(assign=
    True)``). The class is set on the object, as :class:`plain_parameters` does: its storage,
    ``requires_grad`` and gradient stay. Anything else (a MeshParameter, ``None``, a tensor
    subclass torch made, such as a DTensor) is left as it is.

    Example:
        >>> import torch, meshtorch as mt
        >>> p = mt.nn.MeshParameter("d:2", init="ones")
        >>> state = mt.nn.parameter.mesh_state(p.materialize())
        >>> q = torch.nn.Parameter(p.detach().double())
        >>> mt.nn.parameter.as_mesh_parameter(q, state)
        >>> type(q).__name__, q.mesh_shape, q.mesh_tensor.to_global().tolist()
        ('MeshParameter', Shape('d:2'), [1.0, 1.0])
    """
    if type(p) is not torch.nn.Parameter:
        return
    p.__class__ = MeshParameter
    p.__dict__.update(state)
    p._adapted = LastingMemo()  # the old values' adapters are not this tensor's


def _rebuild(data: torch.Tensor, requires_grad: bool, shape: Shape, layout: Layout, seed: int,
             stream: str) -> MeshParameter:
    p = torch.Tensor._make_subclass(MeshParameter, data, requires_grad)
    p._set_mesh(shape, layout, None, None, seed=seed, stream=stream, materialized=True)
    return p

