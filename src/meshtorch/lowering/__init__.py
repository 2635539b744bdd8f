"""The lowering: the only place that decides communication.

- :mod:`meshtorch.lowering.adapters`: the differentiable collectives (``torch.autograd.Function``\\ s).
- :mod:`meshtorch.lowering.redistribute`: moves a local slice from one layout to another.
- :mod:`meshtorch.lowering.overlap`: parameters' gradient-summing collectives grouped in buckets
  and overlapped with compute (``mt.overlap()``).
  :mod:`~meshtorch.lowering.overlap_runtime` runs them (grouped gathers, prefetch, reshard),
  :mod:`~meshtorch.lowering.overlap_buckets` reduces the gradients in buckets,
  :mod:`~meshtorch.lowering.overlap_reads` finds the inputs an op's backward never reads.
- :mod:`meshtorch.lowering.lower`: turns one op on MeshTensors into adapters and a local torch op,
  through a cached plan.
- :mod:`meshtorch.lowering.fused`: lowers several small reductions with one all_reduce per mesh axis.
- :mod:`meshtorch.lowering.elementwise`: elementwise ops broadcast by dim name, among them
  ``MeshTensor``'s Python operators.
- :mod:`meshtorch.lowering.halo`: a split dim's edges received from the neighbouring processors.
- :mod:`meshtorch.lowering.shift`: shifts a slice along a dim, receiving the halo from neighbours.
- :mod:`meshtorch.lowering.ring`: ring attention's loop of key and value shifts.
- :mod:`meshtorch.lowering.scan`: prefix sums (``cumsum``) along a split dim.
- :mod:`meshtorch.lowering.output`: the class the lowering builds its results as (``MeshTensor``,
  registered by :mod:`meshtorch.tensor`, which sits above the lowering).

The package imports none of its modules here, so importing one module of the lowering does not
import the others.
"""
