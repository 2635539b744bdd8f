"""The op a compiled graph runs for each collective: ``meshtorch::collective``.

Under ``torch.compile`` the collective methods (marked with
:func:`meshtorch.comm.base.collective`) of a backend that Dynamo cannot trace (the
``threads`` backend's rendezvous; the ``torch`` backend is traced, as functional
collectives) emit this one custom op, whose argument names the call (mesh, rank,
method, arguments). When the graph runs, the op calls the method of the live
communicator of that mesh and rank, which checks and counts the call as in eager
mode; while the graph is traced, the ``meta`` backend gives the result's shape.
The graph holds it as one node, so a collective is no graph break, in the
forward or in the backward.

Example:
    >>> import torch, meshtorch as mt
    >>> import meshtorch.comm.compiled
    >>> def f():
    ...     comm = mt.current().comm
    ...     return torch.compile(comm.all_reduce, backend="eager")(torch.ones(1), "b").item()
    >>> mt.launch(f, mesh="b:2")
    [2.0, 2.0]
"""

from __future__ import annotations

import ast
import functools

import torch

from meshtorch.comm.base import LIVE
from meshtorch.comm.meta import MetaCommunicator
from meshtorch.errors import CommError
from meshtorch.mesh import Mesh


@functools.lru_cache(maxsize=4096)
def _decode(call: str) -> tuple:
    return ast.literal_eval(call)


@torch.library.custom_op("meshtorch::collective", mutates_args=())
def _collective_op(t: torch.Tensor, call: str) -> torch.Tensor:
    mesh, rank, name, args, kwargs = _decode(call)
    comm = LIVE.get((mesh, rank))
    if comm is None:
        raise CommError(f"a compiled graph runs {name} on processor {rank} of mesh '{mesh}', which has "
                        "no live communicator; run the compiled function inside the launch it was "
                        "compiled in")
    # the method itself, not the compile-time wrapper: this runs the collective
    out = getattr(type(comm), name).__wrapped__(comm, t, *args, **kwargs)
    return _result(out, t)


def _result(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The op's result, contiguous, for the real op and the fake alike: inductor asserts the
    fake's strides on the real result, and the backends lay out a result differently (the meta
    backend's all_gather along dim 1 is a transposed view, the threads backend's a ``torch.cat``).
    A custom op's result never aliases its input."""
    return out.clone(memory_format=torch.contiguous_format) if out is t else out.contiguous()


@_collective_op.register_fake
def _(t: torch.Tensor, call: str) -> torch.Tensor:
    # the meta backend shapes every collective
    mesh, rank, name, args, kwargs = _decode(call)
    out = getattr(MetaCommunicator, name).__wrapped__(MetaCommunicator(Mesh(mesh), rank), t, *args, **kwargs)
    return _result(out, t)
