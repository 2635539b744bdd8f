"""Weight-decay parameter groups chosen by dim name.

Example:
    >>> import meshtorch as mt
    >>> d, h = mt.Dim("d", 2), mt.Dim("h", 3)
    >>> model = mt.nn.Sequential(mt.nn.Dense(d, h), mt.nn.LayerNorm(h))
    >>> groups = mt.optim.weight_decay_groups(model, 0.1)
    >>> [(g["weight_decay"], len(g["params"])) for g in groups]
    [(0.1, 1), (0.0, 3)]
    >>> heads = mt.nn.Dense(d, [h, mt.Dim("d_kv", 4)])  # a [heads, d_kv] bias is still a bias
    >>> [len(g["params"]) for g in mt.optim.weight_decay_groups(heads, 0.1)]
    [1, 1]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshtorch.errors import ArgumentError
from meshtorch.optim.params import view_of
from meshtorch.shape import Dim, dim_name


def weight_decay_groups(model: torch.nn.Module, weight_decay: float, *,
                        no_decay_dims: Iterable[str | Dim] = (), decay_vectors: bool = False,
                        **group_options) -> list[dict]:
    """Two param groups for ``torch.optim``: with ``weight_decay``, and without.

    A parameter is not decayed if it is a bias (named ``bias``, whatever its
    dims: attention's ``[heads, d_kv]`` biases are one vector in Hugging Face's
    models) or has fewer than two dims (norm scales), unless ``decay_vectors``;
    nor if one of its dims is named in ``no_decay_dims`` (e.g. ``["vocab"]``
    to spare embeddings). Empty groups are left out. ``group_options``
    (``lr=...``) go into both groups.
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"weight_decay_groups takes the module (it reads the parameters' names: biases "
                            f"are not decayed), got {type(model).__name__}; pass model, not "
                            "model.parameters()")
    skip = {dim_name(d) for d in no_decay_dims}
    decay, keep = [], []
    for name, p in model.named_parameters():
        shape = view_of(p).shape
        vector = (shape.ndim < 2 or name.rsplit(".", 1)[-1] == "bias") and not decay_vectors
        (keep if vector or skip & set(shape.names) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, **group_options},
              {"params": keep, "weight_decay": 0.0, **group_options}]
    return [g for g in groups if g["params"]]
