"""Neural-network ops over named dims: softmax, cross_entropy, norms, dropout.

All are compositions of the lowered primitives, so they work with any dim
split (a split vocabulary or ``d_model`` costs a few small all_reduces).

Example:
    >>> import torch, meshtorch as mt
    >>> x = mt.from_global(torch.zeros(2, 4), "batch:2,vocab:4")
    >>> mt.softmax(x, "vocab").to_global()[0].tolist()
    [0.25, 0.25, 0.25, 0.25]
"""

from __future__ import annotations

import torch

from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.lowering.lower import align, lower
from meshtorch.ops.array import check_ids, ids_read_on_host, one_hot
from meshtorch.ops.cross_entropy_rows import cross_entropy_rows, takes_float32
from meshtorch.ops.elementwise import cast, exp, not_equal, rsqrt, square, where
from meshtorch.ops.reduce import reduce_logsumexp, reduce_mean, reduce_sum
from meshtorch.random import bernoulli
from meshtorch.shape import Dim, Shape, as_shape, dim_name
from meshtorch.tensor import MeshTensor, as_mesh_tensor

# Fast paths: when the dim an op normalises over is not split (always so on one processor),
# each slice holds whole rows, so one fused torch kernel (softmax, layer_norm, logsumexp)
# computes the op locally. That is the op a plain-PyTorch model calls: fewer kernels, less
# Python per op, fewer saved activations, and the same communication (none along that dim;
# the lowering still adapts the other dims). A split dim takes the composed path below.


def _word_bad_targets(targets: MeshTensor, v: Dim) -> None:
    """Raise :func:`check_ids`'s error for ``targets`` (after gather refused one), alone."""
    try:
        check_ids(targets, v, "cross_entropy", "targets")
    except ArgumentError as bad:
        raise bad from None


def _whole_in(x: MeshTensor, name: str) -> bool:
    return name not in x.layout.split  # (axes_of's answer, without its call)


def softmax(x: MeshTensor, dim: str | Dim, extra_logit: float | MeshTensor | None = None) -> MeshTensor:
    """``exp(x) / sum(exp(x))`` over ``dim``.

    ``extra_logit`` adds ``exp(extra_logit)`` to the denominator, as if ``dim`` had one more
    logit of that value (Mesh-TF's ``extra_logit``): the probabilities then sum to less than 1,
    which lets attention attend to nothing. A number, or a MeshTensor with some of the
    other dims of ``x``.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([0.0, 0.0]), "v:2")
        >>> mt.softmax(x, "v").to_global().tolist()
        [0.5, 0.5]
        >>> [round(p, 6) for p in mt.softmax(x, "v", extra_logit=0.0).to_global().tolist()]
        [0.333333, 0.333333]
    """
    x = as_mesh_tensor(x)
    n = dim_name(dim, x, "softmax")
    if _whole_in(x, n) and extra_logit is None:
        i = x.shape.index(n)
        return lower("softmax", [x], x.shape, lambda view, t: torch.softmax(t, i), whole=[n])
    return exp(log_softmax(x, dim, extra_logit=extra_logit))


def log_softmax(x: MeshTensor, dim: str | Dim, extra_logit: float | MeshTensor | None = None) -> MeshTensor:
    """``x - logsumexp(x)`` over ``dim``; ``extra_logit`` as in :func:`softmax`.

    Example:
        >>> import torch, math, meshtorch as mt
        >>> x = mt.from_global(torch.zeros(2), "v:2")
        >>> abs(mt.log_softmax(x, "v").to_global()[0].item() + math.log(2)) < 1e-6
        True
    """
    x = as_mesh_tensor(x)
    n = dim_name(dim, x, "log_softmax")
    if _whole_in(x, n) and extra_logit is None:
        i = x.shape.index(n)
        return lower("log_softmax", [x], x.shape, lambda view, t: torch.log_softmax(t, i), whole=[n])
    return x - reduce_logsumexp(x, n, extra_logit=extra_logit)


REDUCTIONS = ("none", "mean", "sum")
#: logits dtypes whose fused hard-target loss is :func:`~meshtorch.ops.cross_entropy_rows.cross_entropy_rows`
#: (float32 precision, no float32 [rows, vocab] tensor kept) on every device; float32 logits take it on
#: the devices of :data:`~meshtorch.ops.cross_entropy_rows.FLOAT32_DEVICES` (the CPU and CUDA: faster
#: there, and the rows' float32 log-probabilities not kept), others ``log_softmax`` and ``gather``.
ROWS_DTYPES = (torch.bfloat16, torch.float16)


def cross_entropy(logits: MeshTensor, targets: MeshTensor, dim: str | Dim = "vocab",
                  ignore_index: int | None = None, reduction: str = "none",
                  z_loss: float = 0.0) -> MeshTensor:
    """Per-example ``-log softmax(logits)[target]`` over ``dim`` (the class dim is
    reduced away; ``targets`` has the other dims). Works on a split vocabulary:
    no processor ever holds a whole row of logits.

    As ``torch.nn.functional.cross_entropy``: a target outside ``dim`` raises
    :class:`~meshtorch.errors.ArgumentError` (see :func:`~meshtorch.ops.array.check_ids`),
    except ``ignore_index``, whose positions take no part: their loss is 0, and
    ``reduction="mean"`` divides by the number of the other positions (``nan`` if there
    are none). ``reduction="sum"`` sums, ``"none"`` (the default) keeps every position.

    Soft targets: floating-point ``targets`` with the same dims as ``logits`` (each row a
    distribution over ``dim``) give ``-sum(targets * log_softmax(logits))`` over ``dim``.
    ``z_loss`` adds ``z_loss * logsumexp(logits)**2`` per example (Mesh-TF's z-loss, e.g.
    ``1e-4``), which keeps the logits from drifting.

    Example:
        >>> import torch, math, meshtorch as mt
        >>> logits = mt.from_global(torch.zeros(2, 4), "batch:2,vocab:4")
        >>> targets = mt.from_global(torch.tensor([1, 3]), "batch:2")
        >>> round(mt.reduce_mean(mt.cross_entropy(logits, targets)).item(), 5) == round(math.log(4), 5)
        True
        >>> targets = mt.from_global(torch.tensor([1, -100]), "batch:2")
        >>> [round(x, 5) for x in mt.cross_entropy(logits, targets, ignore_index=-100).to_global().tolist()]
        [1.38629, 0.0]
        >>> soft = mt.from_global(torch.full((2, 4), 0.25), "batch:2,vocab:4")
        >>> [round(x, 5) for x in mt.cross_entropy(logits, soft, z_loss=1.0).to_global().tolist()]
        [3.30811, 3.30811]
    """
    if reduction not in REDUCTIONS:
        raise ArgumentError(f"cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}")
    logits, targets = as_mesh_tensor(logits), as_mesh_tensor(targets)
    v = logits.shape[dim_name(dim, logits, "cross_entropy", "the logits")]
    out = logits.shape.without([v.name])
    soft = targets.dtype.is_floating_point
    if soft:
        if sorted(targets.names) != sorted(logits.names):
            raise ShapeError(f"cross_entropy: soft (floating-point) targets need the dims of the logits "
                             f"[{logits.shape}], got [{targets.shape}]; for hard targets pass integer "
                             f"class ids with dims [{out}]")
        if ignore_index is not None:
            raise ArgumentError("cross_entropy: ignore_index applies to integer class ids, not soft "
                                "targets; give a position all-zero soft targets to leave it out")
    fused = _whole_in(logits, v.name) and sorted(targets.names) == sorted(
        (logits.shape if soft else out).names)
    # Hard targets picked by gather on the host, none ignored: gather checks every id itself
    # (negative ones too) and raises at once, so check_ids runs only then, to word the error: two
    # ATen ops and their Python less per step (issue 27)
    by_gather = fused and not soft and ignore_index is None and ids_read_on_host(targets.local)
    if not soft and not by_gather:
        check_ids(targets, v, "cross_entropy", "targets", ignore_index)
    # bf16/fp16 logits give an fp32 loss, as F.cross_entropy under autocast: a bf16 loss near 10
    # nats moves in steps of 1/16 (the cast is fused into log_softmax's kernel)
    acc = torch.float32 if logits.dtype in (torch.bfloat16, torch.float16) else logits.dtype
    if fused:
        i = logits.shape.index(v.name)
        # hard targets of low-precision logits (and of float32 ones on FLOAT32_DEVICES): cross_entropy_rows
        # keeps float32 precision without the float32 [rows, vocab] log-probabilities (and their
        # gradient) autograd would keep
        rows = not soft and (logits.dtype in ROWS_DTYPES or logits.dtype == torch.float32
                             and takes_float32(logits.local.device.type))

        def local_fn(view, t, tt):
            if rows:
                ids = align(tt, targets.names, out.names)
                if not by_gather:
                    return cross_entropy_rows(t, ids, i, ignore_index, z_loss)
                try:
                    return cross_entropy_rows(t, ids, i, z_loss=z_loss)
                except RuntimeError as out_of_bounds:
                    _word_bad_targets(targets, v)
                    raise out_of_bounds
            if soft:
                picked = -(torch.log_softmax(t, i, dtype=acc) * align(tt, targets.names, logits.names)).sum(i)
            else:
                ids = align(tt, targets.names, out.names).unsqueeze(i)
                # the clamp only keeps gather in bounds: ids were checked above, and ignored ones
                # are zeroed below; without ignore_index every id is in bounds already
                safe = ids if ignore_index is None else ids.clamp(0, v.size - 1)
                # -log_softmax[target], as F.cross_entropy: log_softmax and its backward are one
                # vectorised kernel each, where logsumexp - t[target] costs an exp pass forward
                # and a sub, exp and mul backward over the whole logits
                logp = torch.log_softmax(t, i, dtype=acc)
                if by_gather:
                    try:
                        picked = logp.gather(i, safe)
                    except RuntimeError as out_of_bounds:
                        _word_bad_targets(targets, v)
                        raise out_of_bounds
                else:
                    picked = logp.gather(i, safe)
                picked = -picked.squeeze(i)
            if z_loss:
                picked = picked + z_loss * torch.logsumexp(t.to(acc), i).square()
            if ignore_index is None:
                return picked
            return picked.masked_fill(ids.squeeze(i) == ignore_index, 0.0)

        per = lower("cross_entropy", [logits, targets], out, local_fn, whole=[v.name])
    else:
        logits = logits if logits.dtype == acc else cast(logits, acc)
        lse = reduce_logsumexp(logits, v.name)
        if soft:
            per = reduce_sum((lse - logits) * targets, v.name)
        else:
            # an ignored id picks nothing in one_hot; its loss is masked out below
            per = lse - reduce_sum(logits * one_hot(targets, v, dtype=logits.dtype), v.name)
        if z_loss:
            per = per + z_loss * square(lse)
        if ignore_index is not None:
            per = where(not_equal(targets, ignore_index), per, 0.0)
    if reduction == "none":
        return per
    if reduction == "sum" or ignore_index is None:
        return reduce_sum(per) if reduction == "sum" else reduce_mean(per)
    return reduce_sum(per) / reduce_sum(cast(not_equal(targets, ignore_index), per.dtype))


def layer_norm(
    x: MeshTensor,
    dim: str | Dim,
    weight: MeshTensor | None = None,
    bias: MeshTensor | None = None,
    eps: float = 1e-5,
    *,
    compiled: bool | None = None,
) -> MeshTensor:
    """Normalise over ``dim`` to zero mean and unit variance, then scale and shift.

    ``compiled``: whether Dynamo traces the call, where the caller asked already (a layer's
    forward: :func:`~meshtorch.lowering.lower.lower`'s argument); ``None``: asked here.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([1.0, 3.0]), "d:2")
        >>> [round(v, 3) for v in mt.layer_norm(x, "d").to_global().tolist()]
        [-1.0, 1.0]
    """
    if not isinstance(x, MeshTensor):  # (the checks' calls made only where they fail: per layer)
        as_mesh_tensor(x)
    n = dim if isinstance(dim, str) else dim_name(dim, x, "layer_norm")
    params, only_dim = [], (n,)
    fused = n not in x.layout.split  # (_whole_in, and below a loop, without their calls)
    for p in (weight, bias):
        if p is not None:
            params.append(p)
            fused = fused and p.shape.names == only_dim
    if fused:
        names = x.shape.names
        i = names.index(n) if n in names else x.shape.index(n)  # (the latter raises, naming the dims)
        size = x.shape.sizes[i]

        def local_fn(view, t, *ps):
            w = ps[0] if weight is not None else None
            b = ps[-1] if bias is not None else None
            # torch.layer_norm: F.layer_norm's own call, without its two Python frames per layer
            # (its cudnn_enable argument is unused, deprecated: F's reads of the flag are a frame)
            if i == last:  # the usual case: no permute nodes for autograd to walk
                return torch.layer_norm(t, (size,), w, b, eps, True)
            return torch.layer_norm(t.movedim(i, -1), (size,), w, b, eps, True).movedim(-1, i)

        last = len(names) - 1  # (the slice's dims are the shape's)
        return lower("layer_norm", [x, *params], x.shape, local_fn, whole=[n], compiled=compiled)
    xc = x - reduce_mean(x, n)
    y = xc * rsqrt(reduce_mean(xc * xc, n) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm(x: MeshTensor, dim: str | Dim, weight: MeshTensor | None = None,
             eps: float = 1e-6) -> MeshTensor:
    """Scale to unit root-mean-square over ``dim`` (no centring), then by ``weight``.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.tensor([3.0, 4.0]), "d:2")
        >>> [round(v, 3) for v in mt.rms_norm(x, "d").to_global().tolist()]
        [0.849, 1.131]
    """
    x = as_mesh_tensor(x)
    y = x * rsqrt(reduce_mean(x * x, dim_name(dim, x, "rms_norm")) + eps)
    return y * weight if weight is not None else y


def dropout(x: MeshTensor, rate: float, *, seed: int | None = None, training: bool = True,
            stream: int | str | None = None, noise_shape=None) -> MeshTensor:
    """Zero each element with probability ``rate`` and scale the rest by
    ``1/(1-rate)``. The mask is a pure function of (seed, stream, element index),
    so it is the same on any mesh and layout. Without ``seed``, the next stream of
    the processor context is used (the same on every processor).

    ``noise_shape`` (a Shape, a shape string or a list of dim names, some of the dims of
    ``x``) draws the mask over those dims only and broadcasts it over the others, as
    Mesh-TF's ``noise_shape``: ``noise_shape=["batch", "d_model"]`` drops the same features
    at every position of a sequence.

    Example:
        >>> import torch, meshtorch as mt
        >>> y = mt.dropout(mt.ones("t:1000"), 0.5, seed=0)
        >>> set(y.to_global().unique().tolist()) == {0.0, 2.0}
        True
        >>> y = mt.dropout(mt.ones("t:3,d:1000"), 0.5, seed=0, noise_shape=["d"]).to_global()
        >>> bool((y == y[0]).all())
        True
    """
    x = as_mesh_tensor(x)
    if not 0.0 <= rate < 1.0:
        raise ArgumentError(f"dropout: rate={rate} is outside [0, 1); pass the probability of zeroing "
                            f"an element, e.g. rate=0.1")
    shape = x.shape if noise_shape is None else _noise_shape(x, noise_shape)
    if not training or rate == 0.0:
        return x
    keep = bernoulli(shape, 1.0 - rate, seed=seed, stream=stream, dtype=x.dtype)
    return x * keep / (1.0 - rate)


def _noise_shape(x: MeshTensor, noise_shape) -> Shape:
    if isinstance(noise_shape, str) and ":" not in noise_shape:
        noise_shape = [n.strip() for n in noise_shape.split(",") if n.strip()]
    given = list(as_shape(noise_shape)) if isinstance(noise_shape, (str, Shape)) else list(noise_shape)
    dims = []
    for d in given:
        n = dim_name(d, x, "dropout's noise_shape", "x")
        if n not in x.shape:
            raise ShapeError(f"dropout: noise_shape dim {d!s} is not a dim of x [{x.shape}]; "
                             f"noise_shape takes some of the dims of x")
        dims.append(x.shape[n])
    return Shape(dims)
