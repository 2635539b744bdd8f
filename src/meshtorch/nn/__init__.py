"""``meshtorch.nn``: modules whose parameters are local slices of named, laid-out tensors.

Example:
    >>> import meshtorch as mt
    >>> d, h = mt.Dim("d", 4), mt.Dim("h", 8)
    >>> mlp = mt.nn.Sequential(mt.nn.Dense(d, h), mt.relu, mt.nn.Dense(h, d))
    >>> mlp.num_parameters()
    76
"""

from meshtorch.nn.layers import Dense, Dropout, Embedding, Fn, LayerNorm, RMSNorm, Sequential
from meshtorch.nn.module import Module, as_mesh_view, mesh_layout, mesh_shape
from meshtorch.nn.remat import checkpoint

__all__ = ["Module", "Dense", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "Sequential", "Fn",
           "checkpoint", "as_mesh_view", "mesh_shape", "mesh_layout"]
