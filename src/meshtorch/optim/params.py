"""Parameters as the optimizers in :mod:`meshtorch.optim` see them: local slice + named view.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.optim.params import mesh_views
    >>> dense = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 3))
    >>> [str(v.shape) for _, v in mesh_views(dense)]
    ['d:2,h:3', 'h:3']
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshtorch.context import current
from meshtorch.layout import Layout
from meshtorch.nn.parameter import MeshParameter
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor

Params = torch.nn.Module | Iterable[torch.Tensor] | Iterable[MeshTensor] | Iterable[dict]


def view_of(p: torch.Tensor) -> MeshTensor:
    """``p`` as a MeshTensor: its own named shape and layout if it has them, else
    replicated on every axis with dims named ``dim0, dim1, ...``."""
    if isinstance(p, MeshTensor):
        return p
    if isinstance(p, MeshParameter):
        return p.mesh_tensor
    shape = Shape([Dim(f"dim{i}", s) for i, s in enumerate(p.shape)])
    return MeshTensor(p, shape, Layout(shape, current().mesh, {}))


def mesh_views(params: Params) -> list[tuple[torch.Tensor, MeshTensor]]:
    """``(local parameter, MeshTensor view)`` for a module, parameters or MeshTensors."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    out = []
    for p in params:
        if isinstance(p, dict):
            out.extend(mesh_views(p["params"]))
        elif isinstance(p, MeshTensor):
            out.append((p.local, p))
        else:
            out.append((p, view_of(p)))
    return out


def layouts_of(params: Params) -> list[tuple[torch.Tensor, Layout]]:
    """``(local parameter, layout)``, as :func:`mesh_views` gives them but without building a
    MeshTensor per parameter: for what runs every step (gradient clipping) and needs only the
    layouts."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    params = list(params)
    if all([type(p) is MeshParameter for p in params]):  # (no call per parameter: the usual case)
        return [(p, p.mesh_layout) for p in params]
    out = []
    for p in params:
        if isinstance(p, MeshParameter):
            out.append((p, p.mesh_layout))
        else:
            out.extend((q, v.layout) for q, v in mesh_views([p]))
    return out


def listed(params: Params) -> Params:
    """``params`` with every iterator made a list (a group's too), so that it can be read twice: an
    optimizer reads its parameters' named views, then hands them to ``torch.optim``, and
    ``model.parameters()`` is a generator that the first reading would spend."""
    if isinstance(params, (torch.nn.Module, torch.Tensor, MeshTensor)):
        return params  # (a lone tensor: torch.optim says what it takes)
    return [{**p, "params": [p["params"]] if isinstance(p["params"], (torch.Tensor, MeshTensor))
             else list(p["params"])} if isinstance(p, dict) else p for p in params]


def torch_params(params: Params) -> list | list[dict]:
    """What ``torch.optim.Optimizer`` takes: local tensors, or groups of them."""
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    out = []
    for p in params:
        if isinstance(p, dict):
            out.append({**p, "params": [q.local if isinstance(q, MeshTensor) else q
                                        for q in p["params"]]})
        else:
            out.append(p.local if isinstance(p, MeshTensor) else p)
    return out
