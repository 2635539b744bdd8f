"""A collective's result that is read later: a tensor that waits for its call where it is read.

:func:`later` turns a :class:`~meshtorch.comm.grouped.Handle` of one tensor into a tensor of that
tensor's shape, dtype and device (a ``torch.Tensor`` subclass, :class:`Pending`) that the program
can hold, hand to autograd and compute with while the call runs. The first op that reads its
values waits for the call (``Handle.wait``) and runs on the result; from then on it is that
result. Ops that need only its metadata (``torch.ones_like``: what ``backward()`` seeds a scalar
with) and cheap ops of it alone (a view, a cast, arithmetic with numbers or with 0-d tensors,
which are copied when the op is taken; of a pending tensor of at most :data:`SMALL`
elements, up to :data:`MAX_DEPTH` in a row) are taken without waiting, and run on the result when
something reads it: a mean's division of an all-reduced sum, or the ``detach()`` of a logged
loss, leaves the call in flight until ``.item()``. (torch's functional collectives'
``AsyncCollectiveTensor`` is the same idea, a private API that waits at any op but a view.)

The values are those of the plain result: each op taken runs, on the same tensors, when the
value is read. The subclass stays beneath autograd (``__torch_dispatch__``): autograd records
the ops of a pending tensor as of any other.

It needs ``torch._C._disabled_torch_function_impl`` (how torch's own subclasses, ``DTensor``
and ``AsyncCollectiveTensor``, keep results of torch functions plain) and
``torch.Tensor._make_wrapper_subclass`` (how they are made), private names: where a torch lacks one,
:data:`AVAILABLE` is ``False`` and callers wait at once (the result is then a plain tensor).

Example:
    >>> import torch
    >>> from meshtorch.comm.grouped import Handle
    >>> from meshtorch.comm.pending import later
    >>> waited = []
    >>> call = Handle(lambda: waited.append(1) or [torch.tensor(6.0)], done=lambda: False)  # in flight
    >>> t = later(call, torch.empty(()))
    >>> half = t / 2  # taken: no wait yet
    >>> seed = torch.ones_like(half)  # metadata only: no wait
    >>> before = len(waited)
    >>> before, half.item(), len(waited)
    (0, 3.0, 1)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from meshtorch.comm.base import Communicator
from meshtorch.comm.grouped import Handle

_DISABLED = getattr(torch._C, "_disabled_torch_function_impl", None)
#: whether this torch can make pending tensors (see the module); otherwise :func:`later` waits
AVAILABLE = _DISABLED is not None and hasattr(torch.Tensor, "_make_wrapper_subclass")

_aten = torch.ops.aten
# ops that read no value of their pending input: run on a plain stand-in of its metadata
_METADATA = frozenset({_aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default,
                       _aten.full_like.default})
# cheap ops taken without waiting when every other tensor operand is 0-d (copied when taken)
_TAKEN = frozenset({
    _aten.div.Tensor, _aten.div.Scalar, _aten.mul.Tensor, _aten.mul.Scalar, _aten.add.Tensor,
    _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.neg.default, _aten.detach.default,
    _aten.alias.default, _aten.view.default, _aten.clone.default,
})


_on = threading.local()  # whether this thread's scalar all_reduces are read later (reading_later)


@contextmanager
def reading_later(enabled: bool = True) -> Iterator[None]:
    """Inside, :func:`all_reduce_later` runs (``mt.overlap()`` enters it for the lowering's
    scalar all_reduces: a loss's, a metric's); ``enabled=False``: not, also inside another.

    Example:
        >>> from meshtorch.comm import pending
        >>> with pending.reading_later():
        ...     pending.reads_later()
        True
    """
    prev = getattr(_on, "later", False)
    _on.later = bool(enabled)
    try:
        yield
    finally:
        _on.later = prev


def reads_later() -> bool:
    """Whether this thread is inside :func:`reading_later` (enabled)."""
    return getattr(_on, "later", False)


def all_reduce_later(t: torch.Tensor, comm, axes) -> torch.Tensor | None:
    """The sum of ``t`` over ``axes`` as an asynchronous all_reduce whose value is read later
    (:func:`later`), or ``None`` (the caller runs the blocking call): inside
    :func:`reading_later` only, eager, on a :class:`~meshtorch.comm.base.Communicator`.

    The lowering asks it for the all_reduce of a 0-d partial sum, a loss's or a metric's: a
    blocking one would be a second point per step where each processor waits for the others
    (DDP's loss is each process's own), in the middle of the step. Read later, the processors
    meet at the end of backward, and the scalar's call has long completed when the step reads
    it. Its value is the blocking call's (one element, reduced alike); the caller's backward
    (the identity, for a sum) is unchanged."""
    # (is_compiling first: a traced step reads no thread-local state of this module)
    if (torch.compiler.is_compiling() or not getattr(_on, "later", False) or not AVAILABLE
            or not isinstance(comm, Communicator) or len(comm.group(axes)) == 1):
        return None
    # (a copy: the call reduces its buffer in place, and a view's base would be taken as that buffer)
    work = comm.all_reduce_grouped([t.detach().clone()], axes, async_op=True)
    if work.is_completed():
        # unpacked out of a tracer's sight (views of the result: no bytes, no time), as where it
        # is read later, inside the op that reads it: a planner's trace on an eager backend sees
        # the ops a traced run on an asynchronous one does, in the same order
        with comm.unseen():
            return work.wait()[0]
    return later(work, t)


def later(work: Handle, like: torch.Tensor) -> torch.Tensor:
    """The one tensor ``work`` gives, as a tensor to read later (a :class:`Pending` of ``like``'s
    shape, dtype and device), or at once where the call has completed (an eager backend) or this
    torch cannot make one (:data:`AVAILABLE`)."""
    if work.is_completed() or not AVAILABLE:
        return work.wait()[0]
    return Pending(like, lambda: work.wait()[0])


class Pending(torch.Tensor):
    """A tensor whose values come from ``source()`` (a collective's wait, or an op taken on other
    pending tensors), called once, at the first op that reads them (see the module)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, source, device: torch.device | None = None, depth: int = 0
                ) -> Pending:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(),
                                                storage_offset=like.storage_offset(), dtype=like.dtype,
                                                device=device or like.device, requires_grad=False)
        t._source, t._value = source, None
        t._depth = depth  # ops taken since the call (a chain read back recursively)
        return t

    def value(self) -> torch.Tensor:
        """The plain result (waits for the call the first time)."""
        if self._value is None:
            self._value = self._source()
            self._source = None  # (kept until it succeeds: a failed wait raises again when read again)
        return self._value

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105 (printing reads the values)
        return f"Pending({self.value()!r})"

    if _DISABLED is not None:
        __torch_function__ = _DISABLED

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*_each(args, _stand_in), **_each(kwargs, _stand_in))
        if func in _TAKEN and _small(args, kwargs):
            args, kwargs = _each(args, _frozen), _each(kwargs, _frozen)
            # the result's metadata, from the op on small CPU stand-ins (the meta device's
            # elementwise rules run torch's Python references: ten times slower); its device, the
            # pending input's
            shaped = func(*_each(args, _on_cpu), **_each(kwargs, _on_cpu))
            pend = [t for t in _tensors(args) if isinstance(t, Pending)]
            if isinstance(shaped, torch.Tensor):
                return Pending(shaped, lambda: func(*_each(args, _read), **_each(kwargs, _read)),
                               pend[0].device, 1 + max(t._depth for t in pend))
        return func(*_each(args, _read), **_each(kwargs, _read))


def _each(tree, fn):
    """``fn`` applied to the tensors of ``args`` or ``kwargs`` (lists and tuples looked into)."""
    if isinstance(tree, dict):
        return {k: _each(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_each(v, fn) for v in tree)
    return fn(tree) if isinstance(tree, torch.Tensor) else tree


def _read(t: torch.Tensor) -> torch.Tensor:
    return t.value() if isinstance(t, Pending) else t


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a pending one's metadata (values unset)."""
    if not isinstance(t, Pending):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU stand-in of ``t``'s metadata (values unset), for the metadata of an op's result."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)


def _frozen(t: torch.Tensor) -> torch.Tensor:
    """A 0-d operand of a taken op as it is now (the op runs later, after in-place changes)."""
    return t if isinstance(t, Pending) else t.clone()


def _tensors(tree) -> list[torch.Tensor]:
    found: list = []
    _each(tree, found.append)
    return found


SMALL = 64  # elements of a pending tensor whose ops are taken (a loss, a few metrics)
# ops taken in a row on a pending value before the next one waits: a running sum of losses over
# many steps, never read, would otherwise hold every step's call and recurse as deep when read
MAX_DEPTH = 8


def _small(args, kwargs) -> bool:
    """Whether an op can wait: its pending operands are small (:data:`SMALL`: an op taken runs
    on stand-ins of them for its metadata) and on one device, and its plain tensor operands
    0-d (copied when it is taken), there or on the CPU."""
    found = _tensors((args, kwargs))
    pend = [t for t in found if isinstance(t, Pending)]
    devices = {t.device for t in pend}
    return (len(devices) == 1 and all(t.numel() <= SMALL and t._depth < MAX_DEPTH for t in pend)
            and all(t.dim() == 0 and (t.device in devices or t.device.type == "cpu")
                    for t in found if not isinstance(t, Pending)))
