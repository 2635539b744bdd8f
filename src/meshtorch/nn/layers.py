"""Layers over named dims: Dense, Embedding, LayerNorm, RMSNorm, Dropout, Sequential.

Layers take dims positionally: ``Dense(d_model, d_ff)`` maps ``d_model`` to
``d_ff`` and keeps every other dim of its input (batch, length, ...). Which
dims are split is decided by the layout rules, not by the layer.

Example:
    >>> import torch, meshtorch as mt
    >>> d, h, v = mt.Dim("d", 4), mt.Dim("h", 3), mt.Dim("vocab", 10)
    >>> model = mt.nn.Sequential(mt.nn.Embedding(v, d), mt.nn.Dense(d, h), mt.relu)
    >>> ids = mt.from_global(torch.tensor([1, 7]), "batch:2")
    >>> model(ids).shape, model.num_parameters()
    (Shape('batch:2,h:3'), 55)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshtorch.caching import BoundedCache
from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.lower import is_dynamo_compiling, lower
from meshtorch.nn.module import Module
from meshtorch.nn.parameter import InitFn, MeshParameter
from meshtorch.ops.array import add_rows, embedding, embedding_range
from meshtorch.ops.einsum import _einsum_plan, _promoted, einsum
from meshtorch.ops.elementwise import cast
from meshtorch.ops.nn import dropout, layer_norm, rms_norm
from meshtorch.shape import Dim
from meshtorch.tensor import MeshTensor, as_mesh_tensor


def _dims(x: Dim | Sequence[Dim], what: str) -> list[Dim]:
    dims = [x] if isinstance(x, Dim) else list(x)
    if not dims or not all(isinstance(d, Dim) for d in dims):
        raise ShapeError(f"{what} must be a Dim or a non-empty sequence of Dims, got {x!r}")
    return dims


class Dense(Module):
    """``y = x · kernel + bias``, contracting ``in_dims`` into ``out_dims``.

    The kernel has shape ``experts + in_dims + out_dims`` and is initialised with std
    ``1/sqrt(fan_in)`` (LeCun normal, fan-in over ``in_dims``) unless ``init`` says otherwise.

    ``experts`` (Mesh-TF's expert dims): dims the input carries too, over which the layer has one
    kernel (and bias) each; ``x[..., e, ...]`` is multiplied by kernel ``e`` (one batched matmul,
    as :class:`~meshtorch.models.moe.MoE`'s experts). A split expert dim needs no communication
    where the input is split on it as well.

    Example:
        >>> import meshtorch as mt
        >>> d, h, e = mt.Dim("d", 4), mt.Dim("h", 2), mt.Dim("experts", 3)
        >>> mt.nn.Dense(d, h)(mt.ones("batch:3,d:4")).shape
        Shape('batch:3,h:2')
        >>> layer = mt.nn.Dense(d, h, experts=e)
        >>> layer.kernel.mesh_shape, layer(mt.ones("experts:3,batch:5,d:4")).shape
        (Shape('experts:3,d:4,h:2'), Shape('experts:3,batch:5,h:2'))
    """

    def __init__(self, in_dims: Dim | Sequence[Dim], out_dims: Dim | Sequence[Dim], *,
                 bias: bool = True, init: str | InitFn = "kaiming_normal",
                 experts: Dim | Sequence[Dim] = (), **init_kwargs: Any):
        super().__init__()
        self.in_dims, self.out_dims = _dims(in_dims, "in_dims"), _dims(out_dims, "out_dims")
        self.expert_dims = _dims(experts, "experts") if experts else []
        if init == "kaiming_normal":
            init_kwargs = {"gain": 1.0, "fan_in": [d.name for d in self.in_dims], **init_kwargs}
        self.kernel = MeshParameter(self.expert_dims + self.in_dims + self.out_dims, init, **init_kwargs)
        self.bias = MeshParameter(self.expert_dims + self.out_dims, "zeros") if bias else None
        # input shape -> (kernel shape, output dim names, einsum's plan)
        self._out_names = BoundedCache(64)

    def forward(self, x: MeshTensor) -> MeshTensor:
        if not isinstance(x, MeshTensor):  # (the check's call made only where it fails: per layer)
            as_mesh_tensor(x)
        shape = x.shape
        compiled = is_dynamo_compiling()
        kernel = self.mesh_view("kernel", compiled)
        key = (shape.names, shape.sizes)  # (the shape's own hash is a Python call; these hash in C)
        plan = None if compiled else self._out_names.get(key)
        if plan is None or plan[0] is not kernel.shape:
            # checked once per input shape: a model feeds the same few every step
            ins = {d.name for d in self.in_dims}
            for d in self.in_dims + self.expert_dims:
                if d not in x.shape:
                    what = "expert dim" if d in self.expert_dims else "dim"
                    raise ShapeError(f"Dense expects {what} {d} in its input, got [{x.shape}]")
            out = tuple([n for n in x.names if n not in ins] + [d.name for d in self.out_dims])
            if compiled:
                plan = (kernel.shape, out, None)
            else:
                # with einsum's own plan for these operands: each step then lowers the matmul
                # directly, einsum's call and lookup saved (issue 27: per layer, cold)
                plan = self._out_names.put(key, (kernel.shape, out, _einsum_plan((x, kernel), out, False)))
        if plan[2] is None:  # traced: einsum plans outside the trace
            y = einsum(x, kernel, output_shape=plan[1])
        else:
            out_shape, local_fn, reduced = plan[2]
            # (operands of one dtype, the usual case, or of two under torch's autocast, which
            # casts them itself (bf16 activations into a float32 kernel): without _promoted's
            # and autocast_enabled's calls, two Python frames per layer, paid cold, issue 25)
            xl = x.local
            if xl.dtype == kernel.local.dtype:
                xs = (x, kernel)
            else:
                kind = xl.device.type
                amp = kind != "meta" and torch.is_autocast_enabled(kind)  # (meta: MetaAutocast's)
                xs = (x, kernel) if amp else _promoted((x, kernel))
            y = lower("einsum", xs, out_shape, local_fn, reduced=reduced, compiled=False)
        if self._parameters.get("bias") is None:  # no bias (torch keeps a None one in __dict__)
            return y
        b = self.mesh_view("bias", compiled)
        # under autocast the einsum runs in low precision; keep the bias add there too
        return y + (cast(b, y.dtype) if b.dtype != y.dtype else b)


class Embedding(Module):
    """Lookup of ``d_model`` vectors by id along ``vocab`` (which may be split).

    ``attend(x)`` computes logits against the same table (tied output layer).

    Example:
        >>> import torch, meshtorch as mt
        >>> emb = mt.nn.Embedding(mt.Dim("vocab", 5), mt.Dim("d", 2))
        >>> emb(mt.from_global(torch.tensor([0, 4]), "batch:2")).shape
        Shape('batch:2,d:2')
    """

    def __init__(self, vocab: Dim, d_model: Dim | Sequence[Dim], *, init: str | InitFn = "normal",
                 **init_kwargs: Any):
        super().__init__()
        self.vocab = _dims(vocab, "vocab")[0]
        self.d_model = _dims(d_model, "d_model")
        self.table = MeshParameter([self.vocab] + self.d_model, init, **init_kwargs)

    def forward(self, ids: MeshTensor) -> MeshTensor:
        return embedding(self.mesh_view("table", is_dynamo_compiling()), as_mesh_tensor(ids), self.vocab.name)

    def rows(self, out: Dim, offset: int = 0) -> MeshTensor:
        """The vectors of ids ``offset .. offset + out.size - 1`` over the new dim ``out`` (learned
        positions): ``self(ids)`` for those ids, without making them (see
        :func:`~meshtorch.ops.array.embedding_range`).

        Example:
            >>> import meshtorch as mt
            >>> emb = mt.nn.Embedding(mt.Dim("positions", 8), mt.Dim("d", 2))
            >>> emb.rows(mt.Dim("length", 3), offset=2).shape
            Shape('length:3,d:2')
        """
        return embedding_range(self.mesh_view("table", is_dynamo_compiling()), self.vocab.name, out, offset)

    def add_rows(self, x: MeshTensor, out: Dim, offset: int = 0) -> MeshTensor:
        """``x + self.rows(out, offset)`` as one op (see :func:`~meshtorch.ops.array.add_rows`:
        the table's gradient then goes with the other parameters' under ``mt.overlap()``).

        Example:
            >>> import meshtorch as mt
            >>> emb = mt.nn.Embedding(mt.Dim("positions", 8), mt.Dim("d", 2))
            >>> x = mt.ones("batch:2,length:3,d:2")
            >>> y = emb.add_rows(x, mt.Dim("length", 3), offset=2)
            >>> bool(mt.reduce_all(mt.equal(y, x + emb.rows(mt.Dim("length", 3), offset=2))).item())
            True
        """
        return add_rows(x, self.mesh_view("table", is_dynamo_compiling()), self.vocab.name, out, offset)

    def attend(self, x: MeshTensor) -> MeshTensor:
        """Logits ``x · tableᵀ`` over ``vocab`` (``d_model`` contracted)."""
        model = {d.name for d in self.d_model}  # (made once, not per name)
        keep = [n for n in x.names if n not in model]
        table = self.mesh_view("table", is_dynamo_compiling())
        return einsum(x, table, output_shape=keep + [self.vocab.name])


class LayerNorm(Module):
    """Layer normalisation over ``dim`` with a learned scale (and bias).

    Example:
        >>> import torch, meshtorch as mt
        >>> ln = mt.nn.LayerNorm(mt.Dim("d", 2))
        >>> [round(v, 3) for v in ln(mt.from_global(torch.tensor([1.0, 3.0]), "d:2")).to_global().tolist()]
        [-1.0, 1.0]
    """

    def __init__(self, dim: Dim, *, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.dim, self.eps = _dims(dim, "dim")[0], eps
        self.weight = MeshParameter([self.dim], "ones")
        self.bias = MeshParameter([self.dim], "zeros") if bias else None

    def forward(self, x: MeshTensor) -> MeshTensor:
        compiled = is_dynamo_compiling()
        return layer_norm(x, self.dim.name, self.mesh_view("weight", compiled),
                          self.mesh_view("bias", compiled), self.eps, compiled=compiled)


class RMSNorm(Module):
    """Root-mean-square normalisation over ``dim`` with a learned scale.

    Example:
        >>> import torch, meshtorch as mt
        >>> rn = mt.nn.RMSNorm(mt.Dim("d", 2))
        >>> [round(v, 3) for v in rn(mt.from_global(torch.tensor([3.0, 4.0]), "d:2")).to_global().tolist()]
        [0.849, 1.131]
    """

    def __init__(self, dim: Dim, *, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = _dims(dim, "dim")[0], eps
        self.weight = MeshParameter([self.dim], "ones")

    def forward(self, x: MeshTensor) -> MeshTensor:
        return rms_norm(x, self.dim.name, self.mesh_view("weight", is_dynamo_compiling()), self.eps)


class Dropout(Module):
    """Dropout whose mask is layout-invariant (see docs/design.md, Randomness).

    Each call draws the next random stream of the processor context, so masks
    differ between steps, agree across processors, and are restored with a
    checkpoint (``mt.load`` restores the stream counter).

    Example:
        >>> import meshtorch as mt
        >>> drop = mt.nn.Dropout(0.5).eval()
        >>> drop(mt.ones("t:4")).to_global().tolist()
        [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(self, rate: float):
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise ArgumentError(f"Dropout rate={rate} is outside [0, 1); pass e.g. Dropout(0.1)")
        self.rate = rate

    def forward(self, x: MeshTensor) -> MeshTensor:
        return dropout(x, self.rate, training=self.training)


class Fn(Module):
    """Wrap a function of MeshTensors (``mt.relu``) as a module with no parameters."""

    def __init__(self, fn: Callable[..., MeshTensor]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> MeshTensor:
        return self.fn(*args)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


class Sequential(Module):
    """Apply layers in order; plain functions such as ``mt.relu`` are allowed.

    Parameters are named by position: ``"0.kernel"``, ``"2.bias"``.

    Example:
        >>> import meshtorch as mt
        >>> d, h = mt.Dim("d", 2), mt.Dim("h", 3)
        >>> seq = mt.nn.Sequential(mt.nn.Dense(d, h), mt.relu, mt.nn.Dense(h, d))
        >>> [n for n, _ in seq.named_parameters()]
        ['0.kernel', '0.bias', '2.kernel', '2.bias']
    """

    def __init__(self, *layers: torch.nn.Module | Callable[..., MeshTensor]):
        super().__init__()
        for i, layer in enumerate(layers):
            if not isinstance(layer, torch.nn.Module):
                if not callable(layer):
                    raise ShapeError(f"Sequential layer {i} is neither a module nor callable: {layer!r}")
                layer = Fn(layer)
            self.add_module(str(i), layer)

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> torch.nn.Module:
        return list(self._modules.values())[i]

    def forward(self, x: Any) -> Any:
        for layer in self._modules.values():
            x = layer(x)
        return x
