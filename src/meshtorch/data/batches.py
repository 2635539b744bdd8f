"""Language-model batches: deterministic, resumable, each processor reads its own part.

The split is cut into non-overlapping windows of ``length + 1`` tokens; each
epoch visits them in a permutation drawn from ``seed`` and the epoch number.
Row ``r`` of step ``s`` is window ``s * batch + r`` of that sequence, so the
batch at any step is a pure function of ``(seed, step)``: resuming needs only
the step (``state_dict``). A processor builds only its slice of the
``[batch, length]`` ids and targets, as the layout rules place them.

Example:
    >>> import numpy as np, meshtorch as mt
    >>> from meshtorch.data import LMBatches
    >>> tokens = np.arange(100, dtype=np.uint16)
    >>> def f():
    ...     ids, tgt = LMBatches(tokens, batch=4, length=3, seed=0).next()
    ...     return ids.local.shape, bool((tgt.to_global() == ids.to_global() + 1).all())
    >>> mt.launch(f, mesh="b:2", rules="batch:b")
    [(torch.Size([2, 3]), True), (torch.Size([2, 3]), True)]
"""

from __future__ import annotations

import numpy as np
import torch

from meshtorch.data.corpus import DataError
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor, layout_for, local_slices, on_processor


class LMBatches:
    """Next-token batches ``(ids, targets)``, both ``[batch, length]`` int64 MeshTensors.

    Args:
        tokens: the token stream (a corpus split).
        batch, length: the global batch shape.
        seed: the order of windows.
        step: the first step (e.g. from a checkpoint).
        shuffle: visit windows in a seeded permutation (else in order; evaluation).
    """

    def __init__(self, tokens: np.ndarray, batch: int, length: int, seed: int = 0, step: int = 0,
                 shuffle: bool = True):
        self.tokens = tokens
        self.batch, self.length, self.seed, self.step, self.shuffle = batch, length, seed, step, shuffle
        self.windows = (len(tokens) - 1) // length
        if self.windows < 1:
            raise DataError(f"the split has {len(tokens)} tokens, fewer than one window of length+1="
                            f"{length + 1}; lower --length or give more text")
        self._perm: tuple[int, np.ndarray] | None = None
        self.shape = Shape([Dim("batch", batch), Dim("length", length)])

    def _window(self, k: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return k % self.windows
        epoch, i = np.divmod(k, self.windows)
        out = np.empty_like(k)
        for e in np.unique(epoch):
            if self._perm is None or self._perm[0] != e:
                rng = np.random.default_rng([self.seed, int(e)])
                self._perm = (int(e), rng.permutation(self.windows))
            out[epoch == e] = self._perm[1][i[epoch == e]]
        return out

    def _block(self, step: int, rows: slice, cols: slice) -> np.ndarray:
        k = np.arange(rows.start, rows.stop, dtype=np.int64) + step * self.batch
        starts = self._window(k) * self.length
        offs = np.arange(cols.start, cols.stop + 1)
        return self.tokens[starts[:, None] + offs[None, :]]

    def windows_at(self, step: int) -> np.ndarray:
        """The whole batch of ``step`` as ``[batch, length + 1]`` token ids (inputs are ``[:, :-1]``,
        targets ``[:, 1:]``), on the host: e.g. to count the bytes its targets stand for."""
        return self._block(step, slice(0, self.batch), slice(0, self.length))

    def at(self, step: int) -> tuple[MeshTensor, MeshTensor]:
        """The batch of ``step``, read only for this processor's slice."""
        layout = layout_for(self.shape)
        rows, cols = local_slices(layout)
        block = on_processor(torch.from_numpy(self._block(step, rows, cols).astype(np.int64)))
        return (MeshTensor(block[:, :-1].contiguous(), self.shape, layout),
                MeshTensor(block[:, 1:].contiguous(), self.shape, layout))

    def next(self) -> tuple[MeshTensor, MeshTensor]:
        """The batch of the current step; then advance."""
        out = self.at(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "batch": self.batch, "length": self.length}

    def load_state_dict(self, state: dict) -> None:
        if state is None:
            return
        self.step = int(state["step"])
        self.seed = int(state.get("seed", self.seed))
