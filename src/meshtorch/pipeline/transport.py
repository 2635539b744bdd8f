"""Stage-to-stage transport: activations and gradients over ``comm.send``/``recv``.

A *value* is what a stage returns and the next one takes: a ``torch.Tensor``,
a :class:`~meshtorch.tensor.MeshTensor`, ``None``, or a tuple of these. It
travels as a small header (a ``uint8`` tensor holding the structure as JSON:
which leaves are MeshTensors and their global named shapes) followed by one
plain tensor per leaf. A MeshTensor travels as its local slice and is
re-wrapped on the receiver with the same named shape and the layout the
(global) rules give it; since the rules never mention the pipeline axis, the
receiver's slice has the sender's slice shape.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.pipeline.transport import recv_value, send_value
    >>> def f():
    ...     comm = mt.current().comm
    ...     if comm.coords["stage"] == 0:
    ...         send_value(comm, (mt.ones("batch:4,d:2"), torch.arange(3)), "stage", 1, tag=0)
    ...         return None
    ...     x, y = recv_value(comm, "stage", 0, tag=0)
    ...     return str(x.shape), str(x.layout), y.tolist()
    >>> mt.launch(f, mesh="stage:2,b:2", rules="batch:b")[3]
    ('batch:4,d:2', 'batch:b', [0, 1, 2])
"""

from __future__ import annotations

import json
from typing import Any

import torch

from meshtorch.comm.base import Communicator
from meshtorch.errors import PipelineError
from meshtorch.shape import Shape
from meshtorch.tensor import MeshTensor, layout_for


def leaves(value: Any) -> list:
    """The leaves of a value, in order (a non-tuple is one leaf)."""
    return list(value) if isinstance(value, tuple) else [value]


def local(x: Any) -> torch.Tensor | None:
    """The plain tensor of a leaf (a MeshTensor's slice)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, MeshTensor):
        return x.local
    raise PipelineError(f"pipeline stages pass tensors, MeshTensors, None or tuples of these between "
                        f"each other, got {type(x).__name__}")


def _header(spec: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)


def read_header(header: torch.Tensor) -> dict[str, Any]:
    """A value's structure from its header: ``{"tuple": bool, "leaves": [None | "" | named shape]}``
    (one plain tensor follows the header for each leaf that is not ``None``)."""
    return json.loads(bytes(header.tolist()).decode())


def gradient_message(header: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a backward sends back for a value that arrived as ``header`` and ``parts``
    (its leaves' tensors): a header, then an empty tensor of each floating leaf's shape and dtype,
    on its device (the other leaves get no gradient). What a planner answers a stage's recv of
    gradients with, on the meta backend, where the next stage does not run."""
    spec, it, grads = read_header(header), iter(parts), []
    kinds: list[str | None] = []
    for kind in spec["leaves"]:
        t = None if kind is None else next(it)
        if t is not None and t.is_floating_point():
            kinds.append("")
            grads.append(torch.empty(t.shape, dtype=t.dtype, device=t.device))
        else:
            kinds.append(None)
    return [_header({"tuple": spec["tuple"], "leaves": kinds}), *grads]


def send_value(comm: Communicator, value: Any, axis: str, dst: int, tag: int) -> None:
    """Send ``value`` (detached) to member ``dst`` along ``axis``."""
    parts = leaves(value)
    spec = {"tuple": isinstance(value, tuple),
            "leaves": [None if x is None else str(x.shape) if isinstance(x, MeshTensor) else ""
                       for x in parts]}
    comm.send(_header(spec), axis, dst, tag)
    for x in parts:
        if x is not None:
            comm.send(local(x).detach(), axis, dst, tag)


def recv_value(comm: Communicator, axis: str, src: int, tag: int) -> Any:
    """Receive a value sent with :func:`send_value` from member ``src`` along ``axis``."""
    spec = read_header(comm.recv(axis, src, tag))
    out = []
    for kind in spec["leaves"]:
        if kind is None:
            out.append(None)
            continue
        t = comm.recv(axis, src, tag)
        if kind:
            shape = Shape(kind)
            t = MeshTensor(t, shape, layout_for(shape))
        out.append(t)
    return tuple(out) if spec["tuple"] else out[0]
