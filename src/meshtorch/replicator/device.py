"""Which device a replica computes on (``"auto"`` picks CUDA, then MPS, then CPU; the
choice is :func:`meshtorch.comm.device.resolve_device`'s, as for any processor),
moving its batches there, and drawing its initial weights from the CPU's generator
(:class:`host_random`), so that a model built for a GPU starts from the CPU's weights.

Example:
    >>> from meshtorch.replicator.device import resolve_device
    >>> from meshtorch.comm.base import LocalCommunicator
    >>> resolve_device("cpu", LocalCommunicator())
    device(type='cpu')
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# a replica is a processor of a ``replica`` mesh: it runs where any processor would
from meshtorch.comm.device import DEVICES, resolve_device

__all__ = ["DEVICES", "host_random", "resolve_device", "to_device"]

# what draws random numbers into a tensor in place (Tensor methods and torch.nn.init's functions,
# whose names these are) or makes a random tensor; a mode sees only the outermost call
_FILLS = frozenset({
    "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "sparse_"})
_MAKERS = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson"})


def _host(x: Any) -> Any:
    return x.cpu() if isinstance(x, torch.Tensor) else x


class host_random(TorchFunctionMode):
    """Within the block, random numbers for tensors on another device come from torch's CPU
    generator and are copied there: ``tensor.uniform_()``, ``torch.nn.init.kaiming_uniform_``,
    ``torch.randn(..., device=...)`` and their kin draw on the CPU, in the CPU's order. A
    model built on a GPU inside it therefore gets the weights the same seed gives on the CPU
    (CUDA's generator is another algorithm). Explicit ``generator=`` arguments are left alone.

    Example:
        >>> import torch
        >>> from meshtorch.replicator.device import host_random
        >>> _ = torch.manual_seed(0); cpu = torch.nn.Linear(3, 2); after_cpu = torch.get_rng_state()
        >>> _ = torch.manual_seed(0)
        >>> with torch.device("meta"), host_random():
        ...     meta = torch.nn.Linear(3, 2)
        >>> meta.weight.device.type, torch.equal(torch.get_rng_state(), after_cpu)
        ('meta', True)
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if kwargs.get("generator") is None and name in _FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.device.type != "cpu":
                host = torch.empty_like(target, device="cpu")  # every fill overwrites all of it
                if args:
                    func(host, *args[1:], **kwargs)
                else:
                    func(**{**kwargs, "tensor": host})
                with torch.no_grad():
                    target.copy_(host)
                return target
        elif kwargs.get("generator") is None and name in _MAKERS:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            device = kwargs.get("device")
            device = torch.device(device) if device is not None else (
                tensors[0].device if tensors else torch.get_default_device())
            if device.type != "cpu":
                host_kwargs = {k: _host(v) for k, v in kwargs.items()}
                if "device" in kwargs or not tensors:
                    host_kwargs["device"] = "cpu"
                return func(*map(_host, args), **host_kwargs).to(device)
        return func(*args, **kwargs)


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor inside (tuples, lists, dicts) moved to ``device``.

    Example:
        >>> import torch
        >>> from meshtorch.replicator.device import to_device
        >>> to_device({"x": (torch.ones(1), 2)}, torch.device("cpu"))
        {'x': (tensor([1.]), 2)}
    """
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x
