"""Mixed precision: bf16/fp16 compute with fp32 master parameters, and loss scaling.

Parameters stay fp32 (they are the master copy the optimizer updates);
``mt.autocast`` runs the matmul-heavy local ops (einsum, matmul) in bf16 or
fp16 through ``torch.autocast``, and collectives carry whatever dtype the
local op produced. On the ``meta`` backend, which torch's autocast ignores,
it applies the same casts (:class:`meshtorch.meta_autocast.MetaAutocast`), so
a planned bf16 step has the FLOPs, bytes and memory of a real one.

For fp16, :class:`LossScaler` scales the loss and skips the step when any
processor saw an overflow — the decision is all-reduced, so every processor
skips together and replicated parameters stay identical.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.ones("batch:2,d:4")
    >>> dense = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
    >>> with mt.autocast(torch.bfloat16):
    ...     y = dense(x)
    >>> y.dtype, dense.kernel.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import contextlib

import torch

from meshtorch.context import current, processor_device
from meshtorch.errors import ArgumentError, MeshTorchError
from meshtorch.meta_autocast import MetaAutocast
from meshtorch.optim.params import Params, layouts_of
from meshtorch.tensor import MeshTensor


def _device_type() -> str:
    """The kind of device this processor's tensors are on: its communicator's, or where
    torch's factories put tensors (one processor outside a launch, the meta backend)."""
    ctx = current()
    if ctx.comm.backend == "meta":
        return "meta"
    return processor_device().type


def autocast(dtype: torch.dtype = torch.bfloat16, enabled: bool = True,
             device_type: str | None = None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for this processor's device (CPU or CUDA: the device of the
    tensors it makes, ``mt.launch(..., device=)``) with ``dtype``; on the ``meta``
    backend (planning), :class:`~meshtorch.meta_autocast.MetaAutocast`. Pass
    ``device_type`` to override.

    Example:
        >>> import torch, meshtorch as mt
        >>> with mt.autocast(torch.float16):
        ...     y = mt.einsum("a b, b c -> a c", mt.ones("a:2,b:2"), mt.ones("b:2,c:2"))
        >>> y.dtype
        torch.float16
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise MeshTorchError(f"autocast dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    device_type = device_type or _device_type()
    if device_type == "meta":
        return MetaAutocast(dtype) if enabled else contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


class LossScaler:
    """Dynamic loss scaling for fp16, agreed across the mesh.

    ``scale(loss)`` multiplies the loss; ``step(optimizer)`` unscales the
    gradients, all-reduces whether any is inf/NaN, and steps only if none is;
    ``update()`` halves the scale after an overflow and doubles it after
    ``growth_interval`` clean steps. ``state_dict()`` is JSON-able, for ``mt.save(extra=)``.
    To clip, unscale first, as with torch's ``GradScaler``: ``scaler.unscale_(optimizer)``,
    ``mt.optim.clip_grad_norm_(...)``, then ``scaler.step(optimizer)``, which does not divide
    those gradients again.

    Example:
        >>> import torch, meshtorch as mt
        >>> w = mt.from_global(torch.ones(2), "d:2", requires_grad=True)
        >>> opt = torch.optim.SGD([w.local], lr=0.5)
        >>> scaler = mt.amp.LossScaler(init_scale=1024.0)
        >>> scaler.scale(mt.reduce_sum(w * w)).backward()
        >>> scaler.step(opt, [w.local]), w.to_global().tolist()
        (True, [0.0, 0.0])
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.enabled = growth_interval, enabled
        self.good_steps = 0
        self.found_inf = False
        self._unscaled: set[int] = set()  # ids of the parameters unscale_ divided since update()

    def scale(self, loss: MeshTensor | torch.Tensor) -> MeshTensor | torch.Tensor:
        """``loss * scale`` (unchanged when disabled)."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, params: Params | torch.optim.Optimizer) -> bool:
        """Divide the gradients of ``params`` (or of an optimizer's parameters) by the scale, once
        per step: before clipping, so that :meth:`step` then leaves them as they are. Returns
        whether any processor found inf/NaN in them (or in those unscaled before in this step)."""
        if not self.enabled:
            return False
        if isinstance(params, torch.optim.Optimizer):
            params = [p for g in params.param_groups for p in g["params"]]
        views = layouts_of(params)
        again = [p for p, _ in views if id(p) in self._unscaled]
        if again:
            raise ArgumentError(f"LossScaler.unscale_() was already called on {len(again)} of these "
                                "parameters since the last update(): their gradients would be divided by "
                                "the scale twice; call it once per step, before clipping (step() unscales "
                                "the others)")
        # the flags stay on the grads' device: one host sync (the .item() below), not one per grad
        bad = torch.zeros(1, device=current().device)
        for p, _ in views:
            self._unscaled.add(id(p))
            if p.grad is not None:
                p.grad.detach().div_(self.scale_value)
                bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().to(bad.device, bad.dtype))
        comm = current().comm
        found = bool(comm.all_reduce(bad, comm.mesh.axis_names, "max").item())
        self.found_inf = self.found_inf or found
        return self.found_inf

    def step(self, optimizer: torch.optim.Optimizer, params: Params | None = None) -> bool:
        """Unscale the gradients of ``params`` (default: the optimizer's) that :meth:`unscale_`
        has not, step unless there was an overflow anywhere, then :meth:`update`. Returns
        whether it stepped."""
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
        todo = [p for p, _ in layouts_of(params) if id(p) not in self._unscaled]
        # (the same on every processor: unscale_ was called alike everywhere, as every collective is)
        if self.enabled and (todo or not self._unscaled):
            self.unscale_(todo)
        if self.found_inf:
            self.update()
            return False
        optimizer.step()
        self.update()
        return True

    def update(self) -> None:
        """Adjust the scale after a step (called by :meth:`step`)."""
        if not self.enabled:
            return
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0
        self.found_inf = False
        self._unscaled.clear()

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.good_steps = float(state["scale"]), int(state["good_steps"])
