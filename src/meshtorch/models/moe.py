"""Mixture-of-Experts feed-forward layer (top-1 / top-2 gating, capacity, load balancing).

Each ``batch`` row is a group of ``length`` tokens. A gate picks each token's
expert(s); a token takes slot ``p`` of its expert if fewer than ``capacity``
tokens of its group came first (else it is dropped and passes only through
the residual). Dispatch is an einsum into ``[experts, batch, expert_capacity,
d_model]``: with rules ``experts:b; batch:b`` the tokens arrive split by
``batch`` and leave split by ``experts``, which the lowering turns into one
``all_to_all`` along ``b`` (and one back in the combine).

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.models import TransformerConfig
    >>> from meshtorch.models.moe import MoE
    >>> cfg = TransformerConfig(d_model=8, heads=2, d_kv=4, d_ff=16, vocab=32, experts=4, top_k=2)
    >>> y, aux = MoE(cfg)(mt.random.normal("batch:2,length:6,d_model:8", seed=0))
    >>> y.shape, aux.shape.ndim
    (Shape('batch:2,length:6,d_model:8'), 0)
"""

from __future__ import annotations

import math

import torch

from meshtorch import nn
from meshtorch.models.config import TransformerConfig
from meshtorch.models.layers import ACTIVATIONS
from meshtorch.ops.array import one_hot
from meshtorch.ops.einsum import einsum
from meshtorch.ops.nn import softmax
from meshtorch.ops.reduce import reduce_mean, reduce_sum
from meshtorch.ops.slicewise import slicewise
from meshtorch.shape import Dim
from meshtorch.tensor import MeshTensor

EXPERTS, CAPACITY = "experts", "expert_capacity"


def _top1_mask(probs: MeshTensor) -> MeshTensor:
    i = probs.shape.index(EXPERTS)

    def fn(t: torch.Tensor) -> torch.Tensor:
        # not F.one_hot: it checks the ids' range on real tensors only (other ops, other
        # buffers than on meta), so the planner's meta trace would not match a real step
        along_i = [-1 if d == i else 1 for d in range(t.dim())]
        experts = torch.arange(t.shape[i], device=t.device).view(along_i)
        return (t.argmax(i, keepdim=True) == experts).to(t.dtype)

    return slicewise(fn, probs.detach(), whole=[EXPERTS])


def _positions(mask: MeshTensor) -> MeshTensor:
    """Slot of each routed token within its expert: earlier tokens of the group first."""
    i = mask.shape.index("length")
    return slicewise(lambda t: torch.cumsum(t, i) - 1.0, mask, whole=["length"])


class MoE(nn.Module):
    """Experts' feed-forward layers; ``forward(x)`` returns ``(y, load_balancing_loss)``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        experts, d_model, d_ff = cfg.dim("experts"), cfg.dim("d_model"), cfg.dim("d_ff")
        self.gate = nn.Dense(d_model, experts, bias=False, init="normal", std=cfg.d_model ** -0.5)
        self.wi = nn.MeshParameter([experts, d_model, d_ff], "normal", std=cfg.d_model ** -0.5)
        self.wo = nn.MeshParameter([experts, d_ff, d_model], "normal",
                                   std=cfg.d_ff ** -0.5 / math.sqrt(2 * max(cfg.layers, 1)))
        self.act = ACTIVATIONS[cfg.activation]

    def capacity(self, length: int) -> int:
        cfg = self.cfg
        return max(1, math.ceil(cfg.capacity_factor * length * cfg.top_k / cfg.experts))

    def forward(self, x: MeshTensor) -> tuple[MeshTensor, MeshTensor]:
        cfg = self.cfg
        cap = Dim(CAPACITY, self.capacity(x.shape["length"].size))
        probs = softmax(self.gate(x), EXPERTS)                       # [batch, length, experts]
        mask1 = _top1_mask(probs)
        pos1 = _positions(mask1) * mask1
        gate1 = reduce_sum(probs * mask1, EXPERTS)
        dispatch1 = one_hot(pos1, cap, dtype=x.dtype) * mask1        # out-of-capacity slots are all zero
        # load balancing (Switch/GShard): fraction routed × mean gate probability, per expert
        aux = reduce_mean(reduce_mean(mask1, "length") * reduce_mean(probs, "length")) * (cfg.experts ** 2)
        if cfg.top_k == 2:
            rest = probs * (1.0 - mask1)
            mask2 = _top1_mask(rest)
            used = reduce_sum(mask1, "length")                       # slots top-1 took, per group and expert
            pos2 = (_positions(mask2) + used) * mask2
            gate2 = reduce_sum(probs * mask2, EXPERTS)
            norm = gate1 + gate2 + 1e-9
            gate1, gate2 = gate1 / norm, gate2 / norm
            dispatch2 = one_hot(pos2, cap, dtype=x.dtype) * mask2
            dispatch = dispatch1 + dispatch2
            combine = dispatch1 * gate1 + dispatch2 * gate2
        else:
            dispatch, combine = dispatch1, dispatch1 * gate1
        inputs = einsum(dispatch, x, output_shape=[EXPERTS, "batch", CAPACITY, "d_model"])
        h = self.act(einsum(inputs, self.wi.mesh_tensor,
                            output_shape=[EXPERTS, "batch", CAPACITY, "d_ff"]))
        outputs = einsum(h, self.wo.mesh_tensor, output_shape=[EXPERTS, "batch", CAPACITY, "d_model"])
        others = [n for n in x.names if n != "d_model"]
        y = einsum(combine, outputs, output_shape=others + ["d_model"])
        return y, aux
