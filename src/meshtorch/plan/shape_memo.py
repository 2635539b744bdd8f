"""Meta kernels answered from memory: an op on ``meta`` tensors, once seen, is not run again.

On ``meta`` tensors an aten op computes nothing but its outputs' metadata,
and torch computes it in Python for most pointwise and reduction ops
(``torch._refs``/``torch._prims`` meta functions: about 0.2 ms an op, most of a
meta trace's time). That metadata is a pure function of the inputs'
metadata (shape, strides, storage offset, dtype) and the op's other
arguments, so :func:`run` remembers it per key and answers a repeat with
fresh ``empty_strided`` tensors: the same shapes, strides, dtypes and
storage sizes the kernel would make. A planner traces the same blocks
under many layouts, so most ops repeat.

Only what provably has no other effect is remembered: ``aten`` ops whose
schema neither mutates nor aliases, all of whose tensors are ``meta``
tensors, whose outputs are one tensor or a tuple of tensors, each a fresh
storage exactly as large as ``empty_strided`` makes it (checked on the op's
first run). Everything else runs as before. ``enabled(False)`` turns the
memo off (for comparing traces).

Example:
    >>> import torch
    >>> from meshtorch.plan import shape_memo
    >>> x = torch.empty(4, 8, device="meta")
    >>> a = shape_memo.run(torch.ops.aten.mul.Tensor, (x, x), {})
    >>> b = shape_memo.run(torch.ops.aten.mul.Tensor, (x, x), {})   # from memory
    >>> b.shape, b.stride(), b.dtype, b.device.type, b.untyped_storage() is not a.untyped_storage()
    (torch.Size([4, 8]), (8, 1), torch.float32, 'meta', True)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from meshtorch.caching import BoundedCache

_empty_strided = torch.ops.aten.empty_strided.default
_META = torch.device("meta")
# argument values that are their own key (with their type: 1, 1.0 and True hash alike but
# promote differently)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)

_MEMO = BoundedCache(1 << 16)  # (op, argument keys) -> output metadata
_PURE: dict[Any, bool] = {}   # op -> whether its schema lets it be remembered
_state = threading.local()


class _Uncacheable(Exception):
    pass


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.device != _META:
            raise _Uncacheable
        return (x.shape, x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x), *(_key(v) for v in x))
    if isinstance(x, _PLAIN):
        return (type(x), x)
    raise _Uncacheable


def _pure(func: Any) -> bool:
    ok = _PURE.get(func)
    if ok is None:
        schema = func._schema
        ok = _PURE[func] = (func.namespace == "aten" and not schema.is_mutable
                            and all(r.alias_info is None for r in schema.returns)
                            and all(a.alias_info is None for a in schema.arguments))
    return ok


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors of an aten op's arguments or outputs (nested lists, tuples, dicts), in order:
    a few times faster than ``torch.utils._pytree.tree_leaves`` on the tracer's every op (a list
    filled in place, not nested generators: half the time again, and the tracer calls it several
    times an op)."""
    if isinstance(x, torch.Tensor):
        return [x]
    out: list[torch.Tensor] = []
    if isinstance(x, (list, tuple, dict)):
        _collect(x, out)
    return out


def _collect(x: list | tuple | dict, out: list[torch.Tensor]) -> None:
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple, dict)):
            _collect(v, out)


def _fresh(meta: tuple) -> torch.Tensor:
    shape, stride, dtype = meta
    return _empty_strided(shape, stride, dtype=dtype, device=_META)


def _metadata(out: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What to remember of ``out``, or None when an empty_strided copy would differ from it."""
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or not all(isinstance(t, torch.Tensor) and t.device == _META for t in outs):
        return None
    taken = {id(t.untyped_storage()) for t in tensors_in((args, kwargs))}
    metas = []
    for t in outs:
        meta = (t.shape, t.stride(), t.dtype)
        st = id(t.untyped_storage())
        if (st in taken or t.storage_offset() != 0
                or _fresh(meta).untyped_storage().nbytes() != t.untyped_storage().nbytes()):
            return None
        taken.add(st)
        metas.append(meta)
    return (isinstance(out, tuple), tuple(metas))


def run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, answered from memory when it is a pure op on meta tensors
    seen before with inputs of the same metadata."""
    if not _pure(func) or not getattr(_state, "on", True):
        return func(*args, **kwargs)
    try:
        key = (func, _key(args), _key(tuple(kwargs.items())) if kwargs else None,
               torch.get_default_dtype())  # a factory without a dtype makes the default one
    except _Uncacheable:
        return func(*args, **kwargs)
    hit = _MEMO.get(key)
    if hit is None:
        out = func(*args, **kwargs)
        _MEMO.put(key, _metadata(out, args, kwargs) or False)
        return out
    if hit is False:
        return func(*args, **kwargs)
    many, metas = hit
    outs = tuple(_fresh(m) for m in metas)
    return outs if many else outs[0]


@contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Turn the memo on or off for this thread's block."""
    before = getattr(_state, "on", True)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


__all__ = ["enabled", "run", "tensors_in"]
