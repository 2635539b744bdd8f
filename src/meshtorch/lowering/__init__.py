"""The lowering: the only place that decides communication.

- :mod:`meshtorch.lowering.adapters`: the differentiable collectives (``torch.autograd.Function``\\ s).
- :mod:`meshtorch.lowering.redistribute`: moves a local slice from one layout to another.
- :mod:`meshtorch.lowering.lower`: turns one op on MeshTensors into adapters and a local torch op,
  through a cached plan.
- :mod:`meshtorch.lowering.fused`: lowers several small reductions with one all_reduce per mesh axis.
- :mod:`meshtorch.lowering.shift`: shifts a slice along a dim, receiving the halo from neighbours.

The package imports none of its modules here, so the core (``meshtorch.tensor``) can use
:func:`~meshtorch.lowering.redistribute.redistribute` without importing the op machinery.
"""
