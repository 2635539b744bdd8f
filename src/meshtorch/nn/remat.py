"""Activation recomputation that works through collectives and layout-invariant dropout.

``mt.nn.checkpoint(fn, *args)`` is ``torch.utils.checkpoint`` (non-reentrant)
for functions of MeshTensors: the recomputation during backward re-issues the
same collectives on every processor (backward runs the same graph everywhere),
and the random-stream counter is rewound so dropout draws the same mask again.

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.ones(3), "d:3", requires_grad=True)
    >>> y = mt.nn.checkpoint(lambda t: mt.reduce_sum(t * t), x)
    >>> y.backward(); x.grad.to_global().tolist()
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as tuc

from meshtorch.context import current
from meshtorch.lowering.overlap import unsaved
from meshtorch.meta_autocast import MetaAutocast, active_dtype


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward."""
    ctx = current()
    start = ctx.random_calls
    # checkpoint restores torch.autocast's state for the recomputation, but the meta backend's autocast
    # (a planned bf16 step) is a TorchFunctionMode it does not know: re-enter it, so that the recomputed
    # tensors have the dtypes of the first forward's
    meta_dtype = active_dtype()

    @contextlib.contextmanager
    def rewind() -> Iterator[None]:
        # the recomputation must draw the same random streams as the first forward
        saved = ctx.random_calls
        ctx.random_calls = start
        try:
            with MetaAutocast(meta_dtype) if meta_dtype is not None else contextlib.nullcontext():
                yield
        finally:
            ctx.random_calls = saved

    def contexts():
        # the first run saves nothing for backward: mt.overlap frees its gathered values after use
        return unsaved(), rewind()

    return tuc.checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)
