"""``mt.launch(fn, backend="meta")``: processor 0 alone, on ``meta`` tensors, for planning.

Collectives are only counted, so one representative processor stands for
the whole mesh; the launch returns its result alone.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.launcher.meta import run_meta
    >>> run_meta(lambda: mt.current().mesh.size, (), {}, mt.Mesh("b:64"), mt.LayoutRules(""))
    64
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from meshtorch.comm.meta import MetaCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.launcher.failures import processor_error
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh

try:  # what ``with torch.device(...)`` pushes, and the factories it gives a device (private)
    from torch.utils._device import DeviceContext, _device_constructors
except ImportError:  # (a torch without them: a plain mode and this list, see _meta_default_class)
    DeviceContext = _device_constructors = None

# the factories a default device applies to, where torch's own list (_device_constructors) is missing
_FACTORIES = ("empty", "empty_strided", "ones", "zeros", "full", "arange", "linspace", "logspace", "eye",
              "rand", "randn", "randint", "randperm", "tensor", "as_tensor", "asarray", "scalar_tensor",
              "tril_indices", "triu_indices")


_FALLBACK_FACTORIES = frozenset(getattr(torch, name) for name in _FACTORIES if hasattr(torch, name))


def _factories() -> Any:
    """torch's set of the factories a default device applies to, else :data:`_FACTORIES`'."""
    # (torch's own set object: Dynamo, tracing a compiled step on meta, reads it as it reads
    # DeviceContext's; a set made here of builtins it cannot hash)
    return _device_constructors() if _device_constructors is not None else _FALLBACK_FACTORIES


def run_meta(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
             rank: int = 0) -> Any:
    """``fn(*args, **kwargs)`` as processor ``rank`` (default 0) of ``mesh`` with ``meta`` as the
    default device, except for the tensors ``torch.optim`` makes without a device: the step
    counters its optimizers make with ``torch.tensor(0.0)`` (and read with ``.item()``) are host
    scalars, as in a real run, not meta ones.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launcher.meta import run_meta
        >>> run_meta(lambda: torch.ones(2).device.type, (), {}, mt.Mesh("m:4"), mt.LayoutRules(""))
        'meta'
    """
    comm = MetaCommunicator(mesh, rank)
    ctx = ProcessorContext(comm, rules)
    try:
        with use(ctx), _MetaDefault():
            return fn(*args, **kwargs)
    except Exception as e:
        raise processor_error(e, rank, mesh.coords(rank), where="(meta backend)") from e


def _meta_default_class(base: type) -> type:
    """``torch.device("meta")`` as a context, but not for the factories ``torch.optim`` calls:
    built on torch's own device mode (``DeviceContext``: kept at the bottom of the mode stack,
    ``torch.get_default_device()`` says meta), or on a plain ``TorchFunctionMode`` where this
    torch has none."""

    class _MetaDefault(base):
        def __init__(self) -> None:
            if base is TorchFunctionMode:
                super().__init__()
            else:
                super().__init__("meta")
            self.device = torch.device("meta")

        def __torch_function__(self, func, types, args=(), kwargs=None):
            # (a factory naming its device needs no walk; a traced one none either: Dynamo refuses
            # sys._getframe, and a compiled step on meta makes tensors as it says)
            if (func in _factories() and (kwargs is None or kwargs.get("device") is None)
                    and not torch.compiler.is_compiling() and _called_by_torch_optim()):
                # as in a run, which has no default device: a number's tensor on the host, a
                # tensor's where it is
                return func(*args, **(kwargs or {}))
            if base is not TorchFunctionMode:  # torch's device mode, as `with torch.device` runs it
                return super().__torch_function__(func, types, args, kwargs)
            kwargs = kwargs or {}
            if func in _factories() and kwargs.get("device") is None:
                kwargs["device"] = self.device
            return func(*args, **kwargs)

    return _MetaDefault


_MetaDefault = _meta_default_class(DeviceContext if DeviceContext is not None else TorchFunctionMode)


def _called_by_torch_optim() -> bool:
    """Whether the factory being dispatched was called from a ``torch.optim`` module (past the
    ``__torch_function__`` of modes stacked above this one, such as meshtorch's meta autocast)."""
    frame = sys._getframe(2)  # (1: _MetaDefault.__torch_function__)
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("torch.optim.")
