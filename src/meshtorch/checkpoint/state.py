"""What a checkpoint holds besides tensors: optimizer groups, RNG streams, JSON values.

Example:
    >>> from meshtorch.checkpoint.state import to_json
    >>> to_json({"betas": (0.9, 0.99), "lr": 1e-3}, "optimizer group")
    {'betas': [0.9, 0.99], 'lr': 0.001}
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import torch

from meshtorch.context import current
from meshtorch.errors import CheckpointError


def to_json(value: Any, what: str) -> Any:
    """``value`` as plain JSON (tuples → lists, 0-d tensors → numbers), or an error naming ``what``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_json(v, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, what) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} holds {type(value).__name__} {value!r}, which a checkpoint "
                              "index (JSON) cannot store; keep it out or convert it") from e
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def scalar_json(t: torch.Tensor) -> dict:
    """A 0-d state tensor (Adam's ``step``), exactly: the value and its dtype."""
    return {"value": t.item(), "dtype": str(t.dtype).removeprefix("torch.")}


def scalar_from_json(d: dict) -> torch.Tensor:
    return torch.tensor(d["value"], dtype=getattr(torch, d["dtype"]))


def rng_state(gather: bool = False) -> dict:
    """The random streams: meshtorch's stream counter (the same on every processor, SPMD)
    and torch's CPU generator of every processor (processes may seed theirs differently)."""
    comm = current().comm
    raw = torch.get_rng_state()
    if gather:  # every processor must call this (it is a collective)
        states = comm.all_gather(raw.reshape(1, -1), comm.mesh.axis_names, 0)
    else:
        states = raw.reshape(1, -1)
    return {"random_calls": current().random_calls,
            "torch_cpu": [base64.b64encode(r.numpy().tobytes()).decode() for r in states]}


def restore_rng(state: dict) -> None:
    """Restore :func:`rng_state`: this processor's own torch state when the mesh has as
    many processors as the one saved, else processor 0's."""
    ctx = current()
    ctx.random_calls = int(state["random_calls"])
    saved = state["torch_cpu"]
    raw = base64.b64decode(saved[ctx.rank] if len(saved) == ctx.mesh.size else saved[0])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
