"""``meshtorch.optim``: what optimisation needs beyond ``torch.optim`` on slices.

``torch.optim.SGD/Adam/AdamW`` and ``torch.optim.lr_scheduler`` work
unchanged on ``model.parameters()`` (elementwise updates of slices). Here are
the parts that need the whole tensor: the global gradient norm, Adafactor's
factored moments, and weight-decay groups by dim name.

Example:
    >>> import torch, meshtorch as mt
    >>> model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2))
    >>> opt = torch.optim.AdamW(mt.optim.weight_decay_groups(model, 0.01), lr=1e-3)
    >>> len(opt.param_groups)
    2
"""

from meshtorch.optim.adafactor import Adafactor
from meshtorch.optim.clip import clip_grad_norm_, global_grad_norm
from meshtorch.optim.groups import weight_decay_groups
from meshtorch.optim.params import mesh_views, view_of

__all__ = ["Adafactor", "clip_grad_norm_", "global_grad_norm", "weight_decay_groups", "mesh_views",
           "view_of"]
