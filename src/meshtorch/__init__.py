"""meshtorch: named tensor dimensions split over any axis of a processor mesh.

Write the program once, from one processor's view; ``mt.launch`` runs it on
every processor of a mesh, and layout rules decide which dims are split over
which mesh axes.

Example:
    >>> import torch, meshtorch as mt
    >>> def step():
    ...     batch, d = mt.Dim("batch", 4), mt.Dim("d", 2)
    ...     x = mt.from_global(torch.ones(4, 2), [batch, d])
    ...     return mt.reduce_sum(x * 3).item()
    >>> mt.launch(step, mesh="b:2", rules="batch:b")
    [24.0, 24.0]
"""

from __future__ import annotations

import importlib
import importlib.util
import threading

__version__ = "0.1.0"


def _load() -> dict:
    """Import the public API; run on the first use of any ``meshtorch.X``.

    The package imports lazily so that torch-free sub-commands (``meshtorch place
    graph.json`` needs only numpy and scipy) start in a fraction of a second; the
    first attribute a program touches pays the full import once.
    """
    from meshtorch import amp, data, errors, models, nn, optim, pipeline, plan, random
    from meshtorch.amp import autocast
    from meshtorch.checkpoint import (
        export_consolidated,
        export_hf,
        import_consolidated,
        import_hf,
        load,
        save,
    )
    from meshtorch.comm import CommStats, Communicator
    from meshtorch.context import ProcessorContext, comm_stats, current, reset_comm_stats
    from meshtorch.dtensor import from_dtensor, to_dtensor
    from meshtorch.errors import MeshTorchError
    from meshtorch.launcher import init_distributed, launch
    from meshtorch.layout import Layout, LayoutRules
    from meshtorch.lowering.overlap import overlap
    from meshtorch.mesh import Mesh
    from meshtorch.ops.array import concat, cumsum, embedding, one_hot, pad, range, shift, slice
    from meshtorch.ops.attention import attention, local_attention, ring_attention
    from meshtorch.ops.conv import (
        conv1d,
        conv2d,
        conv3d,
        conv_transpose1d,
        conv_transpose2d,
        conv_transpose3d,
    )
    from meshtorch.ops.einsum import einsum, matmul
    from meshtorch.ops.elementwise import (
        abs,
        add,
        cast,
        clamp,
        cos,
        divide,
        elu,
        equal,
        exp,
        floordiv,
        gelu,
        gelu_tanh,
        greater,
        greater_equal,
        leaky_relu,
        less,
        less_equal,
        log,
        logical_and,
        logical_not,
        logical_or,
        maximum,
        minimum,
        mod,
        multiply,
        negative,
        not_equal,
        pow,
        reciprocal,
        relu,
        rsqrt,
        selu,
        sigmoid,
        sign,
        silu,
        sin,
        softplus,
        sqrt,
        square,
        subtract,
        tanh,
        where,
    )
    from meshtorch.ops.nn import cross_entropy, dropout, layer_norm, log_softmax, rms_norm, softmax
    from meshtorch.ops.pieces import split, stack, unstack
    from meshtorch.ops.pool import avg_pool, max_pool
    from meshtorch.ops.reduce import (
        Reductions,
        add_n,
        reduce_all,
        reduce_any,
        reduce_logsumexp,
        reduce_max,
        reduce_mean,
        reduce_min,
        reduce_sum,
    )
    from meshtorch.ops.reshape import broadcast, relayout, rename, replace_dims, reshape, transpose
    from meshtorch.ops.select import argmax, argmin, sample_with_temperature, top_k
    from meshtorch.ops.slicewise import slicewise
    from meshtorch.ops.spatial import halo_exchange
    from meshtorch.replicator import Replicator
    from meshtorch.shape import Dim, Shape
    from meshtorch.tensor import MeshTensor, from_global, full, ones, ones_like, zeros, zeros_like
    return {k: v for k, v in locals().items() if not k.startswith("_")}


_lock = threading.Lock()
_loader: list[int] = []  # the thread binding the API now, if any


def __getattr__(name: str):
    """The public API, bound on the first use of any of its names (PEP 562). Threads that touch
    it at once (thread-processors starting a script) wait for the one that binds it."""
    if name.startswith("__") and name != "__all__" or threading.get_ident() in _loader:
        # the binding thread's own imports (`from meshtorch import random`) fall back to the sub-module
        raise AttributeError(f"module 'meshtorch' has no attribute {name!r}")
    if "__all__" not in globals() and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # a sub-module (`from meshtorch import random` inside the package): import only it, so
        # that internal imports never pull in the whole API
        return importlib.import_module(f"{__name__}.{name}")
    with _lock:
        if "__all__" not in globals():
            _loader.append(threading.get_ident())
            try:
                api = _load()
            finally:
                _loader.clear()
            globals().update(api)
            globals()["__all__"] = sorted(api)
    if name not in globals():
        raise AttributeError(f"module 'meshtorch' has no attribute {name!r}")
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
