"""``mt.nn.Module``: a ``torch.nn.Module`` whose parameters are local slices.

Each parameter is a :class:`~meshtorch.nn.parameter.MeshParameter`: a real
``nn.Parameter`` holding this processor's slice that knows its named
``Shape`` and ``Layout``, so ``torch.optim`` works on ``model.parameters()``
unchanged while ``p.mesh_tensor`` (and :meth:`Module.named_mesh_parameters`)
gives it back as a :class:`~meshtorch.tensor.MeshTensor`.

A parameter's values are ``mt.random.<init>(shape, seed=seed, stream=<path>)``
where ``<path>`` is its name in the outermost module (``"mlp.0.kernel"``): the
same model on 1 processor and on 512, under any rules. Attaching a module to a
parent only re-labels the paths of its parameters; each is drawn once, when
first read.

Example:
    >>> import meshtorch as mt
    >>> class Affine(mt.nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.scale = mt.nn.MeshParameter([d], init="ones")
    ...     def forward(self, x):
    ...         return x * self.scale.mesh_tensor
    >>> m = Affine(mt.Dim("d", 3))
    >>> m(mt.ones("d:3")).to_global().tolist(), m.num_parameters()
    ([1.0, 1.0, 1.0], 3)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd import profiler as _autograd_profiler
from torch.nn.modules import module as _torch_module

from meshtorch.context import current, traced
from meshtorch.layout import Layout
from meshtorch.lowering.lower import is_dynamo_compiling
from meshtorch.lowering.overlap import release_parameters
from meshtorch.lowering.redistribute import LastingMemo
from meshtorch.nn.parameter import MeshParameter, as_mesh_parameter, mesh_state
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor


def _torch_call_is_known() -> Any:
    """torch's ``Module.__call__`` where it is the function whose no-hook path
    :meth:`Module.__call__` takes itself (``_wrapped_call_impl``, torch 2.2 on: the compiled call,
    then ``_call_impl``'s hook tables, every one of them present), else ``None``: every call then
    goes through torch's own (a torch that moved its hook tables or changed its call)."""
    call = getattr(torch.nn.Module, "_wrapped_call_impl", None)
    tables = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
              "_global_backward_hooks")
    known = (call is not None and torch.nn.Module.__call__ is call
             and all(isinstance(getattr(_torch_module, t, None), dict) for t in tables)
             and hasattr(torch._C, "_get_tracing_state")
             and isinstance(getattr(_autograd_profiler, "_is_profiler_enabled", None), bool))
    return call if known else None


_KNOWN_TORCH_CALL = _torch_call_is_known()



class Module(torch.nn.Module):
    """A ``torch.nn.Module`` over MeshTensors whose parameters are local slices.

    Subclasses assign :class:`~meshtorch.nn.parameter.MeshParameter` attributes
    and read them as MeshTensors with ``self.<name>.mesh_tensor``; ``forward``
    takes and returns MeshTensors. Build the model inside ``mt.launch`` (or at
    the prompt for one processor): layouts follow the mesh and rules current
    at creation.

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
        self._mt_views: dict[str, tuple[MeshTensor, torch.Size]] = {}  # for mesh_view

    # ------------------------------------------------------------ parameters
    def named_mesh_parameters(self, prefix: str = "", recurse: bool = True
                              ) -> Iterator[tuple[str, MeshTensor]]:
        """``(name, MeshTensor)`` of every parameter, with its named shape and layout.

        Plain torch parameters (of ordinary ``torch.nn`` submodules) are given
        replicated, with dims named ``<param>_dim<i>``.
        """
        for name, p in self.named_parameters(prefix=prefix, recurse=recurse):
            if isinstance(p, MeshParameter):
                yield name, p.mesh_tensor
            else:
                safe = name.replace(".", "_")
                shape = Shape([Dim(f"{safe}_dim{i}", s) for i, s in enumerate(p.shape)])
                yield name, MeshTensor(p, shape, Layout(shape, current().mesh, {}))

    def mesh_view(self, name: str, compiled: bool = False) -> MeshTensor | None:
        """``self.<name>.mesh_tensor``, or ``None`` where ``self.<name>`` is ``None`` (a layer
        without a bias), for a layer's forward: the MeshTensor of its own parameter ``name``,
        made once and kept on the module while the parameter is the same object, of the same
        local size, and drawn. A read is then one Python call, where the attribute, the
        property and MeshTensor's constructor are three, per weight of every layer, paid cold
        between a model's large kernels (issue 27). ``compiled``: Dynamo traces the call (as
        :func:`~meshtorch.lowering.adapters.is_dynamo_compiling` says): the attribute's path,
        nothing kept. Kept on the module, not the parameter, which the view holds: a parameter
        holding its view would be a reference cycle, keeping a dropped model's storage until the
        garbage collector runs; a copy or pickle of the module starts without them.

        Example:
            >>> import meshtorch as mt
            >>> dense = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2), bias=False)
            >>> w = dense.mesh_view("kernel")
            >>> w is dense.mesh_view("kernel"), w.local is dense.kernel, dense.mesh_view("bias")
            (True, True, None)
        """
        # (the tables subscripted, asked with `in`: no method call per read, paid cold, issue 27)
        params = self._parameters
        p = params[name] if name in params else None
        if p is None or compiled:
            value = getattr(self, name)  # (torch's path: its error for a missing name)
            return None if value is None else value.mesh_tensor
        views = self._mt_views
        if name in views:
            kept = views[name]
            view = kept[0]
            # the same parameter (not replaced: load_state_dict(assign=True), a new parameter),
            # its local size unchanged (`p.data = ...`: the constructor's check, below) and drawn
            # (relabel() asks for new values)
            if view.local is p and p.materialized and p.shape == kept[1]:
                if traced:  # a tracer sees each read, as it sees each MeshTensor made
                    tracer = current().tracer
                    if tracer is not None:
                        tracer.observe(view)
                return view
        view = p.mesh_tensor
        self._mt_views[name] = (view, p.shape)
        return view

    def mesh_parameters(self, recurse: bool = True) -> Iterator[MeshTensor]:
        """Every parameter as a MeshTensor view; see :meth:`named_mesh_parameters`."""
        for _, t in self.named_mesh_parameters(recurse=recurse):
            yield t

    def num_parameters(self) -> int:
        """Number of global parameters (each element counted once, whatever the layout)."""
        # counted from the shapes: no parameter needs its values for this
        return sum(math.prod(p.mesh_shape.sizes) if isinstance(p, MeshParameter) else p.numel()
                   for _, p in super().named_parameters())

    def reset_parameters(self, seed: int = 0) -> Module:
        """Draw every parameter of this tree again, now, from ``seed`` (and its path)."""
        for m in self.modules():
            if isinstance(m, Module):
                m._mt_seed = seed
                for p in m._own_mesh_parameters():
                    p.seed = seed
                    p.materialize()
        return self

    def _own_mesh_parameters(self) -> Iterator[MeshParameter]:
        return (p for p in self._parameters.values() if isinstance(p, MeshParameter))

    def _materialize_own(self) -> None:
        for p in self._parameters.values():
            if isinstance(p, MeshParameter) and not p.materialized:
                p.materialize()

    # ------------------------------------------------------------ calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # forward itself where torch's __call__ would only call it (no hooks of this module or
        # global ones, no compiled_call_impl, no TorchScript trace): one Python frame where
        # torch's is two (_wrapped_call_impl, _call_impl), per layer of every forward, paid
        # cold between large kernels (issue 27). Anything else takes torch's path as it is: a
        # profiler running in eager (it finds module calls by torch's frames), a torch whose
        # __call__ is not the one this shortcut mirrors (_torch_call_is_known), a patched
        # Module.__call__ (a wrapper). Under Dynamo the profiler's flag is not read: it is a
        # module global, which Dynamo would guard on, so a compiled step would compile again
        # when a profiler starts (and a compiled graph runs no module frames to find anyway);
        # Dynamo takes the same no-hook shortcut to forward itself. (The test comes before the
        # flag, as any read of the flag under Dynamo is guarded: one call more on the eager
        # shortcut, some 35 ns, against the ~200 ns of torch's frames it saves.)
        d = self.__dict__  # (compile() sets _compiled_call_impl there; asked with `in`: no call)
        if (torch.nn.Module.__call__ is _KNOWN_TORCH_CALL
                and ("_compiled_call_impl" not in d or d["_compiled_call_impl"] is None) and not (
                    self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks
                    or self._backward_hooks or _torch_module._global_forward_pre_hooks
                    or _torch_module._global_forward_hooks or _torch_module._global_backward_pre_hooks
                    or _torch_module._global_backward_hooks)
                and not torch._C._get_tracing_state()
                and (is_dynamo_compiling() or not _autograd_profiler._is_profiler_enabled)):
            return self.forward(*args, **kwargs)
        return torch.nn.Module.__call__(self, *args, **kwargs)  # (looked up now: a patched one too)

    # ------------------------------------------------------------ first reads draw the values
    def __getattr__(self, name: str) -> Any:
        # parameters and submodules (self.kernel, self.q: the reads of a forward) are found here,
        # without torch's __getattr__ frame (issue 27: each Python frame between large kernels
        # runs cold); torch keeps a name in one of its tables only, so the answer is the same.
        # Buffers, None entries and missing names take torch's path (its error message).
        # (submodules asked first: a forward reads them here, its weights through mesh_view)
        d = self.__dict__
        if "_modules" in d:  # (set up by torch's __init__, after _parameters)
            value = d["_modules"].get(name)
            if value is not None:
                return value
            value = d["_parameters"].get(name)
        else:
            value = None
        if value is None:
            value = super().__getattr__(name)
        if isinstance(value, MeshParameter) and not value.materialized:
            value.materialize()
        return value

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if isinstance(p, MeshParameter) and not p.materialized:
                p.materialize()
            yield name, p

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self._materialize_own()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # a parameter the state dict holds is overwritten, not drawn
        for name, p in self._parameters.items():
            if isinstance(p, MeshParameter) and prefix + name in state_dict:
                p.materialized = True
        self._materialize_own()
        # torch's swap flag swaps each parameter with a plain Parameter, and assign=True puts one
        # in its place: made MeshParameters again, as after a conversion (_apply)
        held = [(self, name, mesh_state(p)) for name, p in self._parameters.items()
                if isinstance(p, MeshParameter)]
        self._mt_views.clear()
        if torch.__future__.get_swap_module_params_on_conversion():
            release_parameters([p for p in self._parameters.values() if p is not None])
        super()._load_from_state_dict(state_dict, prefix, *args)
        _remade(held)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        # MeshParameters held by plain torch.nn modules below (a ParameterList), which torch loads
        # with its own _load_from_state_dict: those the state dict holds are loaded, not drawn
        # later, and stay MeshParameters (swap flag, assign=True), as this module's own do
        held = []
        for prefix, m in self.named_modules():
            if not isinstance(m, Module):
                for name, p in m._parameters.items():
                    if isinstance(p, MeshParameter):
                        p.materialized = p.materialized or _join(prefix, name) in state_dict
                        held.append((m, name, mesh_state(p)))
        out = super().load_state_dict(state_dict, *args, **kwargs)
        _remade(held)
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> Module:
        # torch converts a parameter one of three ways (Module._apply): `param.data = ...` (by
        # default), torch.utils.swap_tensors with a new plain Parameter (the swap flag of
        # torch.__future__: the same object, with a plain Parameter's class and __dict__), or a
        # new plain Parameter in its place (the overwrite flag, a move to or from meta). Each
        # MeshParameter of this module, and of the plain torch.nn modules below it (a
        # ParameterList), is made one again after the last two, with its metadata. (Nested
        # mt.nn.Modules do their own, called by torch's recursion.)
        held, params = [], []
        for m in _this_and_plain_below(self, recurse):
            for name, p in m._parameters.items():
                if p is not None:
                    params.append(p)
                if isinstance(p, MeshParameter):
                    if not p.materialized:  # drawn in the parameter's dtype and device, then converted
                        p.materialize()
                    p._adapted = LastingMemo()  # the adapters of the old values, not kept alive
                    held.append((m, name, mesh_state(p)))
        self._mt_views.clear()  # (views of the old parameters, or of the old values)
        release_parameters(params)  # (swapping refuses a parameter mt.overlap()'s runtime holds weakly)
        super()._apply(fn if getattr(fn, "_mt_detaches", False) else _detaching(fn), recurse)
        _remade(held)
        return self

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) makes its own views, of its own parameters and memos
        state = super().__getstate__()
        state["_mt_views"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_mt_views", {})  # (a module pickled before there were views)

    # ------------------------------------------------------------ paths
    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        if isinstance(param, MeshParameter) and "_mt_seed" in self.__dict__:
            param.relabel(_join(self._mt_path, name), self._mt_seed)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if isinstance(value, torch.nn.Module) and "_mt_seed" in self.__dict__:
            self._adopt(name, value)

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        super().add_module(name, module)
        if module is not None and "_mt_seed" in self.__dict__:
            self._adopt(name, module)

    register_module = add_module

    def _adopt(self, name: str, child: torch.nn.Module) -> None:
        # A parameter's stream is its path from the outermost module, only known once the
        # child is attached: re-label the subtree (values are drawn on first read).
        base = _join(self._mt_path, name)
        for sub, m in child.named_modules():
            if isinstance(m, Module):
                path = _join(base, sub)
                if m._mt_path != path or m._mt_seed != self._mt_seed:
                    m._mt_path, m._mt_seed = path, self._mt_seed
                    for pname, p in m._parameters.items():
                        if isinstance(p, MeshParameter):
                            p.relabel(_join(path, pname), self._mt_seed)


def _detaching(fn: Any) -> Any:
    """``fn`` for ``Module._apply``, giving back a MeshParameter it returns (a conversion that
    changes nothing: ``.to(its dtype)``, ``.cpu()`` on the CPU) detached: torch's swap and
    overwrite paths wrap the result in a new ``nn.Parameter``, which refuses a tensor subclass
    whose ``detach()`` is of another type (a MeshParameter's is a plain tensor). The same values,
    sharing the storage, as torch's default path's ``param.data = param``."""
    def applied(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out.detach() if isinstance(out, MeshParameter) else out
    applied._mt_detaches = True  # (torch's recursion hands it to the children: wrapped once)
    return applied


def _this_and_plain_below(module: Module, recurse: bool) -> list[torch.nn.Module]:
    """``module``, and with ``recurse`` the plain ``torch.nn`` modules below it reached without
    passing an ``mt.nn.Module`` (each of those converts its own)."""
    found, todo = [], [module]
    while todo:
        m = todo.pop()
        found.append(m)
        if recurse:
            todo.extend(c for c in m._modules.values() if c is not None and not isinstance(c, Module))
    return found


def _remade(held: list[tuple[torch.nn.Module, str, dict]]) -> None:
    for m, name, state in held:
        as_mesh_parameter(m._parameters.get(name), state)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name
