"""Adafactor (Shazeer & Stern, 2018) over named dims, as in Mesh TensorFlow.

For a parameter with at least two dims of size ``>= min_dim_size_to_factor``
the second moment is factored over its two largest dims ``d0, d1``: a row
statistic (mean of ``g²`` over ``d0``) and a column statistic (mean over
``d1``), each a tensor with its own named shape and layout. Every mean is a
lowered reduction, so the result is the dense algorithm's on any layout; the
means of all parameters are reduced together (``mt.Reductions``), two rounds of
at most one all_reduce per mesh axis a step, not several per parameter.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     model = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 4), bias=False)
    ...     opt = mt.optim.Adafactor(model, lr=0.1, min_dim_size_to_factor=2)
    ...     mt.reduce_sum(model(mt.ones("batch:2,d:4"))).backward()
    ...     opt.step()
    ...     return sorted(opt.state[model.kernel])
    >>> mt.launch(f, mesh="m:2", rules="h:m")[0]
    ['step', 'vc', 'vr']
"""

from __future__ import annotations

import math

import torch

from meshtorch.ops.elementwise import maximum, rsqrt, sqrt
from meshtorch.ops.reduce import Reductions
from meshtorch.ops.reshape import relayout_like
from meshtorch.optim.params import Params, listed, mesh_views, torch_params, view_of
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor, layout_for, local_shape


class Adafactor(torch.optim.Optimizer):
    """Adafactor with factored second moments over named dims.

    Args:
        params: an ``mt.nn.Module``, its parameters, or param groups.
        lr: a fixed learning rate, or ``None`` for the paper's relative step
            ``min(1e-2, 1/sqrt(step))``.
        beta1: first-moment decay (0 keeps no first moment, as in the paper).
        decay_rate: the second-moment decay is ``1 - step**-decay_rate``.
        clipping_threshold: update clipping ``d`` (RMS of the update ≤ d).
        multiply_by_parameter_scale: scale the step by ``max(eps2, RMS(param))``.
        eps1, eps2: the paper's ε₁ (added to g²) and ε₂.
        min_dim_size_to_factor: factor only when the two largest dims are this big.
        weight_decay: decoupled decay, ``param -= lr * weight_decay * param``.
    """

    def __init__(self, params: Params, lr: float | None = None, *, beta1: float = 0.0,
                 decay_rate: float = 0.8, clipping_threshold: float | None = 1.0,
                 multiply_by_parameter_scale: bool = True, eps1: float = 1e-30, eps2: float = 1e-3,
                 min_dim_size_to_factor: int = 128, weight_decay: float = 0.0):
        params = listed(params)  # model.parameters() is read twice: for the views, then by torch
        self._views = {id(p): v for p, v in mesh_views(params)}
        defaults = dict(lr=lr, beta1=beta1, decay_rate=decay_rate,
                        clipping_threshold=clipping_threshold,
                        multiply_by_parameter_scale=multiply_by_parameter_scale, eps1=eps1, eps2=eps2,
                        min_dim_size_to_factor=min_dim_size_to_factor, weight_decay=weight_decay)
        super().__init__(torch_params(params), defaults)
        self._counts: dict[int, tuple[torch.Tensor, float]] = {}  # id(p) -> (its counter, its value)

    # ------------------------------------------------------------ shapes
    def _view(self, p: torch.Tensor) -> MeshTensor:
        view = self._views.get(id(p))
        return view if view is not None else view_of(p)

    def factored_dims(self, shape: Shape, group: dict) -> tuple[Dim, Dim] | None:
        """The two dims a moment of ``shape`` is factored over (largest first), or ``None``."""
        dims = sorted(shape.dims, key=lambda d: -d.size)
        if len(dims) < 2 or dims[1].size < group["min_dim_size_to_factor"]:
            return None
        return dims[0], dims[1]

    def state_shape(self, p: torch.Tensor, key: str) -> Shape | None:
        """The named shape of ``self.state[p][key]`` (for checkpoints); ``None`` for scalars."""
        shape = self._view(p).shape
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        f = self.factored_dims(shape, group)
        if key == "vr" and f:
            return shape.without([f[0]])
        if key == "vc" and f:
            return shape.without([f[1]])
        if key in ("v", "m"):
            return shape
        return None

    def _state(self, p: torch.Tensor, key: str) -> MeshTensor:
        shape = self.state_shape(p, key)
        layout = layout_for(shape)
        st = self.state[p]
        if key not in st:
            st[key] = torch.zeros(local_shape(layout), dtype=torch.float32, device=p.device)
        return MeshTensor(st[key], shape, layout)

    def _next_step(self, p: torch.Tensor) -> float:
        """Count a step of ``p``: its counter ``state[p]["step"]`` (a host tensor, as checkpoints
        hold it) becomes a new tensor one higher; the number, for the step's learning rate and
        decay, comes from the host copy kept beside it, so a step reads no tensor (no
        ``.item()``): the counter is read only when it is not the one this optimizer made (a
        first step, or one loaded by ``load_state_dict``)."""
        st = self.state[p]
        counter = st.get("step")
        made = self._counts.get(id(p))
        if made is not None and made[0] is counter:
            t = made[1] + 1
        else:
            t = (float(counter) if counter is not None else 0.0) + 1
        st["step"] = torch.tensor(t, dtype=torch.float32, device="cpu")
        self._counts[id(p)] = (st["step"], t)
        return t

    # ------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (all processors call it).

        The statistics of all parameters are reduced together (:class:`meshtorch.Reductions`):
        one round for the parameter scales and the second-moment factors, one for the
        update clipping, so a step costs at most two all_reduces per mesh axis however
        many parameters there are.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [_Todo(p, group) for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        stats = Reductions()
        for u in todo:
            self._statistics(u, stats)
        out = stats.run()
        clip = Reductions()
        for u in todo:
            self._moments(u, out)
            if u.group["clipping_threshold"]:
                x = self._direction(u)
                u.clip = clip.mean(x * x)
        out = clip.run()
        for u in todo:
            self._apply(u, out)
        return loss

    def _statistics(self, u: _Todo, stats: Reductions) -> None:
        """The local parts of the reductions one parameter's update needs before clipping."""
        p, group = u.p, u.group
        u.view = view = self._view(p)
        t = self._next_step(p)
        u.lr = group["lr"] if group["lr"] is not None else min(1e-2, 1.0 / math.sqrt(t))
        u.decay = 1.0 - t ** (-group["decay_rate"])
        u.g = g = MeshTensor(p.grad.detach().float(), view.shape, view.layout)
        if group["multiply_by_parameter_scale"]:
            w = MeshTensor(p.detach().float(), view.shape, view.layout)
            u.rms = stats.mean(w * w)
        g2 = g * g + group["eps1"]
        u.factored = f = self.factored_dims(view.shape, group)
        if f:
            d0, d1 = f
            u.vr, u.vc = self._state(p, "vr"), self._state(p, "vc")
            u.r, u.c = stats.mean(g2, d0.name), stats.mean(g2, d1.name)
            # mean_d1(new_vr) = decay·mean_d1(vr) + (1 - decay)·mean_{d0,d1}(g²): reduced in this
            # round rather than after new_vr is known, which would cost a round of its own
            u.vr_mean, u.g2_mean = stats.mean(u.vr, d1.name), stats.mean(g2, [d0.name, d1.name])
        else:
            v = self._state(p, "v")
            v.local.copy_((v * u.decay + g2 * (1.0 - u.decay)).local)
            u.v = v

    def _moments(self, u: _Todo, out: list[MeshTensor]) -> None:
        """The new second-moment factors and the step's scale, from the reduced statistics."""
        decay = u.decay
        u.scale = u.lr
        if u.group["multiply_by_parameter_scale"]:
            u.scale = u.lr * torch.clamp(sqrt(out[u.rms]).local, min=u.group["eps2"])
        if u.factored:
            u.vr.local.copy_((u.vr * decay + out[u.r] * (1.0 - decay)).local)
            u.vc.local.copy_((u.vc * decay + out[u.c] * (1.0 - decay)).local)
            u.row_mean = out[u.vr_mean] * decay + out[u.g2_mean] * (1.0 - decay)

    @staticmethod
    def _direction(u: _Todo) -> MeshTensor:
        """The unclipped update: the gradient over the root of the second moment. Computed
        again in :meth:`_apply` rather than kept, so no parameter-sized tensor outlives its
        parameter's turn."""
        if u.factored:
            return u.g * rsqrt(u.vr / u.row_mean) * rsqrt(u.vc)
        return u.g * rsqrt(u.v)

    def _apply(self, u: _Todo, out: list[MeshTensor]) -> None:
        p, group = u.p, u.group
        x = self._direction(u)
        if group["clipping_threshold"]:
            x = x / maximum(sqrt(out[u.clip]) / group["clipping_threshold"], 1.0)
        x = x * u.scale
        if group["beta1"]:
            m = self._state(p, "m")
            new_m = m * group["beta1"] + x * (1.0 - group["beta1"])
            m.local.copy_(new_m.local)
            x = new_m
        upd = relayout_like(x, u.view).local
        if group["weight_decay"]:
            p.mul_(1.0 - u.lr * group["weight_decay"])
        p.sub_(upd.to(p.dtype))


class _Todo:
    """One parameter's update in flight through :meth:`Adafactor.step`'s rounds: its tensors
    and the handles of its reductions."""

    def __init__(self, p: torch.Tensor, group: dict) -> None:
        self.p, self.group = p, group
