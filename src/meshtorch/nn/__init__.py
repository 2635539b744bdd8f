"""``meshtorch.nn``: modules whose parameters are local slices of named, laid-out tensors.

Example:
    >>> import meshtorch as mt
    >>> d, h = mt.Dim("d", 4), mt.Dim("h", 8)
    >>> mlp = mt.nn.Sequential(mt.nn.Dense(d, h), mt.relu, mt.nn.Dense(h, d))
    >>> mlp.num_parameters()
    76
    >>> mlp[0].kernel.mesh_shape, mlp[0].kernel.stream
    (Shape('d:4,h:8'), '0.kernel')
"""

from meshtorch.nn.batchnorm import BatchNorm
from meshtorch.nn.layers import Dense, Dropout, Embedding, Fn, LayerNorm, RMSNorm, Sequential
from meshtorch.nn.module import Module
from meshtorch.nn.parameter import MeshParameter
from meshtorch.nn.remat import checkpoint

__all__ = ["Module", "MeshParameter", "Dense", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "Sequential",
           "Fn", "checkpoint", "BatchNorm"]
