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

    ``scale(loss)`` multiplies the loss; ``step(optimizer)`` unscales the optimizer's
    gradients, all-reduces whether any is inf/NaN, and steps only if none is; the scale is
    then halved after an overflow, doubled after ``growth_interval`` clean iterations.
    ``state_dict()`` is JSON-able, for ``mt.save(extra=)``.

    As with torch's ``GradScaler``, the overflow check is per optimizer (an optimizer whose
    gradients overflowed skips its step; the others step) and the scale changes once per
    iteration, after the last ``step``: at :meth:`update`, which torch's recipe calls at the end of
    every iteration. Until then every :meth:`scale` multiplies by the same scale, also one called
    after an optimizer stepped (a second optimizer's loss). A loop that never calls :meth:`update`
    shows it when an optimizer steps (or is unscaled) a second time: that iteration still runs at
    the first one's scale, and from then on the scale is updated at the :meth:`scale` that follows
    the steps of every optimizer the previous iteration stepped. To clip,
    unscale first: ``scaler.unscale_(optimizer)``, ``mt.optim.clip_grad_norm_(...)``, then
    ``scaler.step(optimizer)``, which does not divide those gradients again.

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
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.enabled = growth_interval, enabled
        self.good_steps = 0
        self._explicit_update = False  # the caller calls update() (torch's recipe): never implied
        # in a loop known to call no update(): the optimizers its last iteration stepped (an
        # iteration ends once they all stepped again), and the update the iteration that showed
        # it owes (applied with that iteration's own, as its losses were scaled before it)
        self._last: frozenset[int] | None = None
        self._owed: tuple[float, int] | None = None
        self._scaled_after_step = False  # scale() called since the last step(): a new iteration may begin
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        # what happened since the last update(), as torch's GradScaler._per_optimizer_states: the
        # stage of each optimizer, by id() ("unscaled" / "stepped"; alike on every processor, as
        # the calls are) with the agreed overflow flag it found, and of each parameter unscale_
        # divided (it also takes parameters, which torch's does not)
        self._stage: dict[int, str] = {}
        self._opt_found: dict[int, bool] = {}
        self._param_found: dict[int, bool] = {}
        self._found_any = False

    @property
    def scale_value(self) -> float:
        """The scale as torch's ``GradScaler.get_scale()`` gives it after ``update()``: in a loop
        that calls no :meth:`update`, with the update of the iteration whose steps ran."""
        return self._shown()[0]

    @scale_value.setter
    def scale_value(self, value: float) -> None:
        self._scale = float(value)

    @property
    def found_inf(self) -> bool:
        """Whether a processor found inf/NaN in the gradients unscaled since the last update."""
        return self._found_any

    def scale(self, loss: MeshTensor | torch.Tensor) -> MeshTensor | torch.Tensor:
        """``loss * scale`` (unchanged when disabled). Starts the next iteration: a loop that
        does not call :meth:`update` has the scale updated here, after its last ``step``."""
        if not self.enabled:
            return loss
        if self._update_due():
            self._last = self._stepped()
            self._apply_update()
        self._scaled_after_step = True
        return loss * self._scale

    def unscale_(self, params: Params | torch.optim.Optimizer) -> bool:
        """Divide the gradients of an optimizer's parameters (or of ``params``) by the scale, once
        per iteration: before clipping, so that :meth:`step` then leaves them as they are. Returns
        whether any processor found inf/NaN in them (or in those unscaled before in this iteration)."""
        if not self.enabled:
            return False
        if isinstance(params, torch.optim.Optimizer):
            key = id(params)
            stage = self._stage.get(key)
            if stage == "stepped" and self._next_iteration():
                self._owe_update()
            elif stage is not None:
                raise ArgumentError(
                    "LossScaler.unscale_() was already called on this optimizer since the last "
                    "update(): its gradients would be divided by the scale twice; call it once per "
                    "iteration, before clipping" if stage == "unscaled" else
                    "LossScaler.unscale_() after step() on this optimizer since the last update(): "
                    "unscale_ before step, and call scaler.update() at the end of each iteration")
            self._opt_found[key] = self._unscale(_local_params(params), False)
            self._stage[key] = "unscaled"
            return self._found_any
        tensors = [p for p, _ in layouts_of(params)]
        again = [p for p in tensors if id(p) in self._param_found]
        if again and "stepped" in self._stage.values() and self._next_iteration():
            self._owe_update()
        elif again:
            raise ArgumentError(f"LossScaler.unscale_() was already called on {len(again)} of these "
                                "parameters since the last update(): their gradients would be divided by "
                                "the scale twice; call it once per iteration, before clipping (step() "
                                "unscales the others)")
        self._unscale(tensors, False)
        return self._found_any

    def _unscale(self, tensors: list[torch.Tensor], seen_before: bool) -> bool:
        """Divide the gradients of these local tensors by the scale and agree over the mesh whether
        any (or ``seen_before``, this processor's earlier finding) is inf/NaN. Every processor calls
        it alike, whatever its tensors (it communicates)."""
        # the flags stay on the grads' device: one host sync (the .item() below), not one per grad
        bad = torch.full((1,), float(seen_before), device=current().device)
        for p in tensors:
            if p.grad is not None:
                p.grad.detach().div_(self._scale)
                bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().to(bad.device, bad.dtype))
        comm = current().comm
        found = bool(comm.all_reduce(bad, comm.mesh.axis_names, "max").item())
        for p in tensors:
            self._param_found[id(p)] = found
        self._found_any = self._found_any or found
        return found

    def step(self, optimizer: torch.optim.Optimizer, params: Params | None = None) -> bool:
        """Unscale the gradients of ``params`` (default: the optimizer's) that :meth:`unscale_`
        has not, and step unless a processor found inf/NaN in them. Returns whether it stepped.
        The scale is updated once all optimizers have stepped (see the class)."""
        if not self.enabled:
            optimizer.step()
            return True
        key = id(optimizer)
        stage = self._stage.get(key)
        if stage == "stepped" and self._next_iteration():
            self._owe_update()
            stage = None
        if stage == "stepped":
            since = ("and no loss was scaled since" if not self._scaled_after_step
                     else "and this loop calls update()")
            raise ArgumentError(f"LossScaler.step() was already called on this optimizer since the last "
                                f"update(), {since}: call scaler.update() at the end of each iteration, "
                                f"after every optimizer's step (torch's GradScaler recipe), and "
                                f"scaler.scale(loss) before the next step")
        if stage == "unscaled":  # unscale_(optimizer) agreed on its overflow: nothing to communicate
            found = self._opt_found[key]
        else:
            # (decided on the optimizer's stage, alike everywhere: every processor reaches the
            # all-reduce even where none of its own gradients is left to divide)
            tensors = _local_params(optimizer) if params is None else [p for p, _ in layouts_of(params)]
            found_before = self._param_found
            todo = [p for p in tensors if id(p) not in found_before]
            seen = any([found_before[id(p)] for p in tensors if id(p) in found_before])
            found = self._unscale(todo, seen)
        self._stage[key] = "stepped"
        self._scaled_after_step = False
        if found:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale from what this iteration's :meth:`unscale_` and :meth:`step` calls
        found: once, after every optimizer's step, as torch's ``GradScaler.update``. A loop that
        never calls it has the scale updated at the next :meth:`scale`."""
        if not self.enabled:
            return
        self._explicit_update = True
        if self._stage or self._param_found or self._owed:
            self._apply_update()

    def _stepped(self) -> frozenset[int]:
        return frozenset(k for k, stage in self._stage.items() if stage == "stepped")

    def _update_due(self) -> bool:
        """Whether the next :meth:`scale` begins an iteration of a loop that calls no update()
        (before one is seen to, a scale() after a step is a further loss of the same iteration,
        as with torch's GradScaler)."""
        if self._explicit_update or self._last is None:
            return False
        stepped = self._stepped()
        return bool(stepped) and stepped >= self._last

    def _next_iteration(self) -> bool:
        """Whether a step (or unscale_) of an optimizer that stepped since the last update begins
        the next iteration of a loop that calls no update(): a loss was scaled since (a second step
        with none between is the caller's mistake, refused as torch's GradScaler refuses it)."""
        return not self._explicit_update and self._scaled_after_step

    def _owe_update(self) -> None:
        """An optimizer steps (or is unscaled) a second time with no update() between: the loop
        calls none, and this is the next iteration, whose losses were scaled before the update."""
        self._owed = self._next()
        self._last = self._stepped()
        self._reset_iteration()

    def _next(self) -> tuple[float, int]:
        """The scale and clean-iteration count after this iteration's update."""
        scale, good = self._owed or (self._scale, self.good_steps)
        if self._found_any:
            return scale * self.backoff_factor, 0
        if good + 1 >= self.growth_interval:
            return scale * self.growth_factor, 0
        return scale, good + 1

    def _apply_update(self) -> None:
        self._scale, self.good_steps = self._next()
        self._owed = None
        self._reset_iteration()

    def _shown(self) -> tuple[float, int]:
        """The scale and clean-iteration count a checkpoint holds: in a loop that calls no
        update(), after the update of the iteration whose steps ran."""
        if not self._explicit_update and "stepped" in self._stage.values():
            return self._next()
        return self._owed or (self._scale, self.good_steps)

    def state_dict(self) -> dict:
        scale, good = self._shown()
        return {"scale": scale, "good_steps": good}

    def load_state_dict(self, state: dict) -> None:
        self._scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self._owed = None
        self._reset_iteration()


def _local_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's local tensors (what it steps), listed without their layouts."""
    return [p for g in optimizer.param_groups for p in g["params"]]
