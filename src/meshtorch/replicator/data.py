"""Each replica's disjoint share of a dataset, padded so an epoch counts every example once.

Global step ``k`` covers positions ``k*G .. k*G+G-1`` of the (optionally
shuffled) example order, ``G`` the global batch size; replica ``r`` takes
the ``r``-th contiguous block of ``G/N`` of them. Every replica does the
same number of steps with the same batch shape (collectives stay in
lockstep, SyncBatchNorm sees equal shapes); positions past the end of the
dataset are filled with real examples but carry weight 0 in the mask that
comes with every batch. Sum ``mask * metric`` and ``mask`` over the replicas
and the epoch, and every example counts exactly once.

Example:
    >>> import torch
    >>> from meshtorch.replicator.data import ReplicaLoader
    >>> x = torch.arange(5.0)
    >>> [(b.tolist(), m.tolist()) for b, m in ReplicaLoader(x, 4, replica_id=1, num_replicas=2)]
    [([2.0, 3.0], [1.0, 1.0]), ([1.0, 2.0], [0.0, 0.0])]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from meshtorch.errors import MeshError
from meshtorch.replicator.device import to_device


def _tensor_tuple(d: Any) -> bool:
    return isinstance(d, (tuple, list)) and bool(d) and all(isinstance(t, torch.Tensor) for t in d)


class ReplicaLoader:
    """Iterates ``(batch, mask)`` pairs: this replica's examples of each global step.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``), a tensor, or a tuple
            of tensors with the same first size (indexed in one go, fast).
        global_batch_size: examples per step over all replicas; a multiple of
            ``num_replicas``.
        replica_id, num_replicas: which share.
        shuffle: a new permutation each epoch, the same on every replica
            (from ``seed`` and the epoch number).
        device: where batches and masks are put.

    ``mask`` is a float tensor of shape ``(G/N,)``: 1 for a real example, 0 for padding.
    """

    def __init__(self, dataset: Any, global_batch_size: int, replica_id: int = 0, num_replicas: int = 1,
                 shuffle: bool = False, seed: int = 0, device: torch.device | str = "cpu"):
        if global_batch_size < 1 or global_batch_size % num_replicas:
            below = global_batch_size // num_replicas * num_replicas
            fits = " or ".join(str(v) for v in (below, below + num_replicas) if v > 0)
            raise MeshError(
                f"global_batch_size={global_batch_size} must be a positive multiple of the "
                f"{num_replicas} replicas, so every replica gets the same batch shape: use {fits}"
            )
        self.dataset = dataset
        self.num_examples = self._length(dataset)
        if self.num_examples == 0:
            raise MeshError("distribute got an empty dataset; there is nothing to iterate")
        self.global_batch_size = global_batch_size
        self.batch_size = global_batch_size // num_replicas
        self.replica_id, self.num_replicas = replica_id, num_replicas
        self.shuffle, self.seed = shuffle, seed
        self.device = torch.device(device)
        self.epoch = 0

    @staticmethod
    def _length(dataset: Any) -> int:
        if isinstance(dataset, torch.Tensor):
            return dataset.shape[0]
        if _tensor_tuple(dataset):
            sizes = {t.shape[0] for t in dataset}
            if len(sizes) != 1:
                raise MeshError(f"distribute got tensors of different first sizes {sorted(sizes)}")
            return sizes.pop()
        try:
            return len(dataset)
        except TypeError:
            raise MeshError(
                f"distribute needs a sized dataset (len and [i]), a tensor or a tuple of tensors; "
                f"got {type(dataset).__name__}"
            ) from None

    def __len__(self) -> int:
        """Steps per epoch: ``ceil(len(dataset) / global_batch_size)``."""
        return math.ceil(self.num_examples / self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (and so the permutation) the next iteration uses."""
        self.epoch = epoch

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_examples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_examples, generator=g)

    def _fetch(self, idx: torch.Tensor) -> Any:
        d = self.dataset
        if isinstance(d, torch.Tensor):
            return d[idx]
        if _tensor_tuple(d):
            return type(d)(t[idx] for t in d)
        return default_collate([d[i] for i in idx.tolist()])

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        order = self._order()
        self.epoch += 1
        n, b = self.num_examples, self.batch_size
        for step in range(len(self)):
            pos = step * self.global_batch_size + self.replica_id * b + torch.arange(b)
            real = pos < n
            idx = order[pos % n]
            mask = real.to(torch.float32)
            yield to_device(self._fetch(idx), self.device), mask.to(self.device)
