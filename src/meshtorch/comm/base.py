"""The ``Communicator`` interface: the only place processors talk (see docs/design.md, backends).

A communicator gives one processor its coordinates on the mesh and grouped
collectives over a set of axes. A collective over axes ``A`` runs among the
processors that share this processor's coordinates on every other axis,
ordered row-major over ``A``. Every call is counted in :attr:`stats`.
Groups of one processor return their input without communicating or counting.

Backends implement the underscored methods; the public methods validate,
count and short-circuit, so every backend behaves the same.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     comm = mt.current().comm
    ...     return comm.all_reduce(torch.tensor([1.0 + comm.rank]), "b")
    >>> [t.item() for t in mt.launch(f, mesh="b:2")]
    [3.0, 3.0]
"""

from __future__ import annotations

import functools
import math
import numbers
import traceback
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, TypeVar

import torch

from meshtorch.comm import grouped as gp
from meshtorch.comm.grouped import Handle
from meshtorch.comm.stats import CommStats, note_traced
from meshtorch.errors import ArgumentError, CommError
from meshtorch.mesh import Mesh

REDUCE_OPS = ("sum", "max", "min")

# What every member of a group must pass alike, in the order a mismatch names it (the kind
# and axes first: a different collective altogether), with the words the message uses.
CALL_FIELDS = {
    "kind": "collective", "axes": "axes", "op": "reduce op", "dim": "tensor dim",
    "split_dim": "split dim", "concat_dim": "concat dim", "src": "broadcast source",
    "sources": "permute sources", "dtype": "dtype", "shape": "shape",
}
# the call's own arguments, shown in its description as `name=value`
_ARGS = ("op", "dim", "split_dim", "concat_dim", "src", "sources")


def check_timeout(value: float | None, name: str = "timeout", allow_none: bool = False) -> float | None:
    """``value`` as seconds, or :class:`~meshtorch.errors.ArgumentError` naming ``name``
    unless it is a positive, finite number (or ``None`` where ``allow_none``).

    Example:
        >>> from meshtorch.comm.base import check_timeout
        >>> check_timeout(2)
        2.0
        >>> check_timeout(-1, "wait_s")
        Traceback (most recent call last):
        ...
        meshtorch.errors.ArgumentError: wait_s=-1 must be a positive, finite number of seconds, e.g. wait_s=60
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ArgumentError(f"{name}={value!r} must be a positive, finite number of seconds, e.g. {name}=60")
    return float(value)


def user_call_site() -> str:
    """``file:line in function`` of the innermost frame outside meshtorch and torch that has a file;
    where the program has none (``python -c``, as ``meshtorch train``'s worker processes run), the
    innermost frame of the meshtorch recipe that runs it (the training loop), not ``<string>:1``."""
    recipe = unnamed = None
    for frame in reversed(traceback.extract_stack()[:-1]):
        f = frame.filename.replace("\\", "/")
        if "/meshtorch/" in f and "/tests/" not in f and "/examples/" not in f:
            if recipe is None and "/meshtorch/recipes/" in f:
                recipe = frame
            continue
        if "/torch/" in f or "/threading.py" in f:
            continue
        if f.startswith("<"):  # <string>, <stdin>, <frozen runpy>: no file to look at
            unnamed = unnamed or frame
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    frame = recipe or unnamed
    return f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else "<unknown>"


F = TypeVar("F", bound=Callable)

# the prepared all_reduces a communicator keeps for all_reduce_async (a loss's, a few metrics')
MAX_FLAT_ALL_REDUCES = 64

# the live communicator of each (mesh, rank), for collectives that a compiled graph runs
LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def collective(method: F) -> F:
    """Mark a communicator method that talks to other processors. Under ``torch.compile``, a
    backend whose collectives are traceable (:attr:`Communicator.traceable`: the ``torch``
    backend, whose methods then call ``torch.distributed``'s functional collectives) is traced
    as it is. Any other backend's call becomes one opaque op of the graph
    (``meshtorch::collective``): Dynamo does not trace the backend's rendezvous (threads), nor
    breaks the graph there; when the compiled graph runs, the op calls this processor's
    communicator, which counts the call as in eager mode. On a one-processor mesh every group
    is this processor alone, and the method is traced as it is.

    Example:
        >>> import torch
        >>> from meshtorch.comm.base import LocalCommunicator
        >>> torch.compile(LocalCommunicator().all_reduce, backend="eager")(torch.ones(2), ()).tolist()
        [1.0, 1.0]

    (The examples compile library functions, not lambdas of their own: Dynamo stores helper
    globals in the compiled function's module, and a doctest's namespace is cleared before
    Dynamo drops them, which printed a ``KeyError: '__builtins_dict___N'`` at exit.)
    """
    name = method.__name__

    @functools.wraps(method)
    def call(self, t, *args, **kwargs):
        if torch.compiler.is_compiling() and self.mesh.size > 1 and not self.traceable:
            return torch.ops.meshtorch.collective(t, repr((str(self.mesh), self.rank, name, args, kwargs)))
        return method(self, t, *args, **kwargs)

    return call  # type: ignore[return-value]


def as_axes(axes: str | Iterable[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def all_texts(comm: Communicator, text: str) -> list[str]:
    """Every processor's ``text``, in rank order, on every processor (every processor calls it).

    Example:
        >>> import meshtorch as mt
        >>> mt.launch(lambda: all_texts(mt.current().comm, "p" * mt.current().rank), mesh="b:3")[0]
        ['', 'p', 'pp']
    """
    everyone = comm.mesh.axis_names
    data = bytearray(text.encode())
    raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    sizes = [int(n) for n in comm.all_gather(torch.tensor([raw.numel()]), everyone, 0).tolist()]
    joined = comm.all_gather(raw, everyone, 0, sizes=sizes).numpy().tobytes()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [joined[s:s + n].decode() for s, n in zip(starts, sizes)]


class Communicator(ABC):
    """One processor's view of the mesh and its collectives.

    Args:
        mesh: the processor mesh.
        rank: this processor's row-major number.
        check: record each collective's call site so that mismatches between
            processors can name both sides.
    """

    backend: str = "abstract"
    #: whether ``_all_gather`` concatenates tensors of different lengths itself (no padding)
    gathers_uneven: bool = False
    # where this processor computes (its tensors, its collectives' buffers); None: wherever
    # torch's default device is (one processor outside any launch, the meta backend)
    device: torch.device | None = None
    #: whether the backend methods can be traced by ``torch.compile`` (see :func:`collective`)
    traceable: bool = False
    #: a block a tracer of this processor does not see (a backend's private copies): the
    #: processor context's ``untraced``, set by the context that takes this communicator (the
    #: communicators sit below the context and never import it)
    unseen: Callable[[], AbstractContextManager[Any]] = nullcontext
    #: non-empty while some processor of this process has a tracer (the context's ``traced``, set
    #: with ``unseen``): a hot path enters ``unseen()`` only then (its ``nullcontext`` is three
    #: Python calls, run between backward's kernels, where Python runs cold)
    tracing: Any = ()

    def __init__(self, mesh: Mesh, rank: int, check: bool = False):
        self.mesh = mesh
        self.rank = rank
        self.coords = mesh.coords(rank)
        self.check = check
        self.stats = CommStats()
        # axes as a grouped call was given them -> (axes, group): looked up once per axes, as
        # data parallel's gradient buckets make the same calls every step
        self._grouped_axes: dict = {}
        # (axes, op, dtype, shape, device) -> the FlatAllReduce of all_reduce_async's calls
        self._flat_all_reduces: dict = {}
        if self.backend != "meta":  # the meta backend only shapes what compiled graphs run
            LIVE[(str(mesh), rank)] = self

    # ----------------------------------------------------------------- helpers
    def group(self, axes: str | Iterable[str]) -> tuple[int, ...]:
        """Ranks of this processor's group over ``axes``, in group order."""
        return self.mesh.group(self.rank, as_axes(axes))

    def position(self, axes: str | Iterable[str]) -> int:
        """This processor's index within its group over ``axes``."""
        return self.group(axes).index(self.rank)

    def _record(self, kind: str, axes: tuple[str, ...], nbytes: int) -> None:
        # a traced collective runs each time its graph does, not each time it is traced: the
        # trace notes it, and the compiled step (meshtorch.compiler) counts it per run (an
        # opaque collective counts itself when it runs)
        if self.traceable and torch.compiler.is_compiling():
            note_traced(kind, axes, nbytes)
        else:
            self.stats.record(kind, axes, nbytes)

    def _describe(self, kind: str, axes: tuple[str, ...], t: torch.Tensor, **args) -> dict:
        """The call as the group compares it (see :func:`compare_calls`): the kind, axes,
        arguments, dtype and shape, and with ``check`` the user's call site."""
        call = {"kind": kind, "axes": axes, **args, "dtype": str(t.dtype), "shape": tuple(t.shape)}
        if self.check:
            call["site"] = user_call_site()
        return call

    def _prepare(self, kind: str, axes, t: torch.Tensor) -> tuple[tuple[str, ...], tuple[int, ...]]:
        axes = as_axes(axes)
        for a in axes:
            self.mesh.axis_size(a)
        if not isinstance(t, torch.Tensor):
            raise CommError(f"{kind} needs a torch.Tensor, got {type(t).__name__}")
        return axes, self.group(axes)

    # ------------------------------------------------------------ collectives
    @collective
    def all_reduce(self, t: torch.Tensor, axes, op: str = "sum") -> torch.Tensor:
        """Elementwise ``sum``/``max``/``min`` of ``t`` over the group; same on all."""
        if op not in REDUCE_OPS:
            raise CommError(f"all_reduce op {op!r} is not one of {REDUCE_OPS}")
        axes, group = self._prepare("all_reduce", axes, t)
        if len(group) == 1:
            return t
        self._record("all_reduce", axes, t.numel() * t.element_size())
        return self._all_reduce(t, axes, group, op, self._describe("all_reduce", axes, t, op=op))

    @collective
    def all_gather(self, t: torch.Tensor, axes, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate the group's tensors along tensor dim ``dim``, in group order.

        ``sizes`` gives each member's length along ``dim`` when they differ (uneven pieces);
        a backend that needs equal sizes gets them padded, but only the real bytes are counted.
        """
        axes, group = self._prepare("all_gather", axes, t)
        if len(group) == 1:
            return t
        dim = dim % max(t.dim(), 1)
        self._record("all_gather", axes, t.numel() * t.element_size())
        uneven = sizes is not None and len(set(sizes)) > 1
        if uneven and self.gathers_uneven:
            # the group compares the call as if padded: every member's shape must agree but dim's
            call = self._describe("all_gather", axes, t, dim=dim)
            call["shape"] = tuple(max(sizes) if i == dim else n for i, n in enumerate(t.shape))
            return self._all_gather(t, axes, group, dim, call)
        if not uneven:
            return self._all_gather(t, axes, group, dim, self._describe("all_gather", axes, t, dim=dim))
        m = max(sizes)
        padded = _pad(t, dim, m)
        out = self._all_gather(padded, axes, group, dim, self._describe("all_gather", axes, padded, dim=dim))
        return torch.cat([out.narrow(dim, i * m, n) for i, n in enumerate(sizes)], dim)

    @collective
    def reduce_scatter(self, t: torch.Tensor, axes, dim: int, op: str = "sum",
                       sizes: list[int] | None = None) -> torch.Tensor:
        """Reduce over the group, then keep this processor's chunk of tensor dim ``dim``
        (``sizes``: each member's chunk length, when they differ; padded where the backend
        needs equal chunks, the real bytes counted)."""
        if op not in REDUCE_OPS:
            raise CommError(f"reduce_scatter op {op!r} is not one of {REDUCE_OPS}")
        axes, group = self._prepare("reduce_scatter", axes, t)
        if len(group) == 1:
            return t
        dim = dim % t.dim()
        if sizes is None and t.shape[dim] % len(group):
            raise CommError(
                f"reduce_scatter over {axes}: tensor dim {dim} of size {t.shape[dim]} is not "
                f"divisible by the group size {len(group)}; pass sizes= for uneven chunks"
            )
        self._record("reduce_scatter", axes, t.numel() * t.element_size())
        if sizes is None or len(set(sizes)) == 1:
            return self._reduce_scatter(t, axes, group, dim, op,
                                        self._describe("reduce_scatter", axes, t, op=op, dim=dim))
        m = max(sizes)
        padded = torch.cat([_pad(c, dim, m) for c in t.split(sizes, dim)], dim)
        me = group.index(self.rank)
        call = self._describe("reduce_scatter", axes, padded, op=op, dim=dim)
        return self._reduce_scatter(padded, axes, group, dim, op, call).narrow(dim, 0, sizes[me]).contiguous()

    @collective
    def all_to_all(self, t: torch.Tensor, axes, split_dim: int, concat_dim: int,
                   split_sizes: list[int] | None = None, concat_sizes: list[int] | None = None
                   ) -> torch.Tensor:
        """Split ``split_dim`` into group-size chunks, send chunk i to member i, and
        concatenate what arrives along ``concat_dim`` in group order.

        For uneven pieces, ``split_sizes`` are the chunk lengths along ``split_dim`` (member i
        gets chunk i) and ``concat_sizes`` each member's length along ``concat_dim``; a backend
        that needs equal blocks gets them padded, the real bytes counted.
        """
        axes, group = self._prepare("all_to_all", axes, t)
        if len(group) == 1:
            return t
        split_dim, concat_dim = split_dim % t.dim(), concat_dim % t.dim()
        uneven = any(s is not None and len(set(s)) > 1 for s in (split_sizes, concat_sizes))
        if not uneven and t.shape[split_dim] % len(group):
            raise CommError(
                f"all_to_all over {axes}: tensor dim {split_dim} of size {t.shape[split_dim]} "
                f"is not divisible by the group size {len(group)}; pass split_sizes= for uneven chunks"
            )
        self._record("all_to_all", axes, t.numel() * t.element_size())
        if not uneven:
            call = self._describe("all_to_all", axes, t, split_dim=split_dim, concat_dim=concat_dim)
            return self._all_to_all(t, axes, group, split_dim, concat_dim, call)
        n = len(group)
        splits = split_sizes or [t.shape[split_dim] // n] * n
        concats = concat_sizes or [t.shape[concat_dim]] * n
        ms, mc = max(splits), max(concats)
        padded = torch.cat([_pad(c, split_dim, ms) for c in t.split(splits, split_dim)], split_dim)
        padded = _pad(padded, concat_dim, mc)
        call = self._describe("all_to_all", axes, padded, split_dim=split_dim, concat_dim=concat_dim)
        out = self._all_to_all(padded, axes, group, split_dim, concat_dim, call)
        mine = splits[group.index(self.rank)]
        blocks = [out.narrow(concat_dim, i * mc, c) for i, c in enumerate(concats)]
        return torch.cat(blocks, concat_dim).narrow(split_dim, 0, mine).contiguous()

    @collective
    def permute(self, t: torch.Tensor, axis, sources: list[int | None]) -> torch.Tensor:
        """Point-to-point along one axis, or a group of axes (members numbered row-major in
        mesh order, as :meth:`group`): member ``i`` receives the tensor of member
        ``sources[i]`` (zeros where ``sources[i]`` is ``None``). Every member must
        pass the same ``sources``; each member sends to all who name it."""
        axes, group = self._prepare("permute", axis, t)
        if len(sources) != len(group):
            raise CommError(f"permute along {axis!r}: {len(sources)} sources for {len(group)}")
        me = group.index(self.rank)
        if all(s == i for i, s in enumerate(sources)):
            return t
        sends = sum(1 for i, s in enumerate(sources) if s == me and i != me)
        self._record("permute", axes, sends * t.numel() * t.element_size())
        call = self._describe("permute", axes, t, sources=tuple(sources))
        return self._permute(t, axes, group, list(sources), call)

    def shift(self, t: torch.Tensor, axis: str, offset: int, wrap: bool = False) -> torch.Tensor:
        """Receive the tensor of the member ``offset`` places before this one along
        ``axis`` (with ``wrap``, cyclically; otherwise zeros at the edge)."""
        n = self.mesh.axis_size(axis)
        sources = []
        for i in range(n):
            j = i - offset
            sources.append(j % n if wrap else (j if 0 <= j < n else None))
        return self.permute(t, axis, sources)

    # --------------------------------------------------- grouped collectives
    def _grouped(self, kind: str, tensors, axes, release: bool = False
                 ) -> tuple[tuple[str, ...], tuple[int, ...]]:
        if release and not isinstance(tensors, list):
            raise CommError(f"grouped {kind} with release=True empties the list of tensors once packed: "
                            f"pass a list, not a {type(tensors).__name__}")
        if torch.compiler.is_compiling():
            raise CommError(f"grouped {kind} is an eager call: a compiled step runs one collective per "
                            "tensor (torch.compile schedules and overlaps those itself)")
        try:
            return self._grouped_axes[axes]
        except (KeyError, TypeError):  # (TypeError: axes given as a list)
            pass
        given, axes = axes, as_axes(axes)
        for a in axes:
            self.mesh.axis_size(a)
        got = self._grouped_axes[given if isinstance(given, (str, tuple)) else axes] = axes, self.group(axes)
        return got

    def all_gather_grouped(self, tensors: list[torch.Tensor], axes, dims: list[int],
                           async_op: bool = False, lazy: bool = False) -> list[torch.Tensor] | Handle:
        """Each tensor gathered along its dim of ``dims`` over the group, as *one* flat
        all_gather (see :mod:`meshtorch.comm.grouped`); with ``async_op``, a :class:`Handle`.
        With ``lazy``, the result is a :class:`~meshtorch.comm.grouped.Gathered` (its tensors
        copied out one at a time, into storages of the caller's) instead of a list (a group of
        one gives the list either way).

        Example:
            >>> import torch, meshtorch as mt
            >>> def f():
            ...     comm = mt.current().comm
            ...     a, b = torch.full((1, 2), float(comm.rank)), torch.full((2, 1), float(comm.rank))
            ...     out = comm.all_gather_grouped([a, b], "b", dims=[0, 1])
            ...     return [t.tolist() for t in out], comm.stats.calls()
            >>> mt.launch(f, mesh="b:2")[1]
            ([[[0.0, 0.0], [1.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]], 1)
        """
        axes, group = self._grouped("all_gather", tensors, axes)
        if len(group) == 1:
            return _alone(tensors, async_op)
        flat, layout = gp.pack_gather(tensors, dims, axes)
        self._record("all_gather", axes, flat.numel() * flat.element_size())
        n = len(group)
        work = self._start_all_gather(flat, axes, group, self._describe("all_gather", axes, flat, dim=0),
                                      (lambda out: gp.Gathered(out, n, layout)) if lazy
                                      else lambda out: gp.unpack_gather(out, n, layout))
        del flat  # the call holds it until done; unpacking, only the result and its copies are alive
        return self._issued(work) if async_op else work.wait()

    def reduce_scatter_grouped(self, tensors: list[torch.Tensor], axes, dims: list[int], op: str = "sum",
                               async_op: bool = False, release: bool = False) -> list[torch.Tensor] | Handle:
        """Each tensor reduced over the group and cut along its dim of ``dims``, this
        processor keeping its chunk, as *one* flat reduce_scatter; with ``async_op``, a
        :class:`Handle`. Every dim must divide by the group size. The chunks are views of the
        call's one flat result (see :mod:`meshtorch.comm.grouped`). With ``release``, the list
        ``tensors`` is emptied once packed, before the call runs: tensors held nowhere else
        (a bucket of gradients) are freed rather than kept beside their packed copy."""
        if op not in REDUCE_OPS:
            raise CommError(f"reduce_scatter op {op!r} is not one of {REDUCE_OPS}")
        axes, group = self._grouped("reduce_scatter", tensors, axes, release)
        if len(group) == 1:
            return _alone(tensors, async_op, release)
        buf, layout = gp.pack_scatter(tensors, dims, axes, len(group), release)
        _release(tensors, release)
        self._record("reduce_scatter", axes, buf.numel() * buf.element_size())
        call = self._describe("reduce_scatter", axes, buf, op=op, dim=0)
        work = self._start_reduce_scatter(buf, axes, group, op, call,
                                          lambda row: gp.unpack_scatter(row, layout))
        return self._issued(work) if async_op else work.wait()

    def all_reduce_grouped(self, tensors: list[torch.Tensor], axes, op: str = "sum",
                           async_op: bool = False, release: bool = False) -> list[torch.Tensor] | Handle:
        """Each tensor reduced elementwise over the group, as *one* flat all_reduce; with
        ``async_op``, a :class:`Handle` (see :mod:`meshtorch.comm.grouped`: the results are views
        of one flat buffer). ``release``: as :meth:`reduce_scatter_grouped`'s."""
        if op not in REDUCE_OPS:
            raise CommError(f"all_reduce op {op!r} is not one of {REDUCE_OPS}")
        axes, group = self._grouped("all_reduce", tensors, axes, release)
        if len(group) == 1:
            return _alone(tensors, async_op, release)
        flat, shapes = gp.pack_reduce(tensors, axes, release)
        _release(tensors, release)
        self._record("all_reduce", axes, flat.numel() * flat.element_size())
        call = self._describe("all_reduce", axes, flat, op=op)
        work = self._start_all_reduce(flat, axes, group, op, call, lambda out: gp.unpack_reduce(out, shapes))
        return self._issued(work) if async_op else work.wait()

    def prepare_all_reduce(self, axes, numel: int, dtype: torch.dtype, op: str = "sum") -> FlatAllReduce:
        """A grouped all_reduce of one flat buffer of ``numel`` elements of ``dtype``, prepared once
        and started as often as needed (:meth:`FlatAllReduce.start`): data parallel's gradient
        buckets, which the same backward launches at every step, a loss's scalar. It is counted,
        described and run as ``all_reduce_grouped([flat], axes, op, async_op=True)``, with the
        group, the description and the backend's launch worked out here, once.

        Example:
            >>> import torch, meshtorch as mt
            >>> def f():
            ...     comm = mt.current().comm
            ...     bucket = comm.prepare_all_reduce("b", 3, torch.float32)
            ...     out = [bucket.start(torch.full((3,), comm.rank + 1.0)).wait()[0] for _ in range(2)]
            ...     return [t.tolist() for t in out], comm.stats.calls(), comm.stats.bytes()
            >>> mt.launch(f, mesh="b:2")[0]
            ([[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]], 2, 24)
        """
        if op not in REDUCE_OPS:
            raise CommError(f"all_reduce op {op!r} is not one of {REDUCE_OPS}")
        axes, group = self._grouped("all_reduce", [], axes)
        return FlatAllReduce(self, axes, group, op, numel, dtype)

    def all_reduce_async(self, t: torch.Tensor, axes, op: str = "sum") -> Handle:
        """``t`` reduced elementwise over the group, issued asynchronously: a :class:`Handle`
        whose ``wait()`` gives ``[result]``, of ``t``'s shape. Counted and run as
        ``all_reduce_grouped([t], axes, op, async_op=True)``, through a :class:`FlatAllReduce`
        kept per axes, op, dtype, shape and device (a loss's scalar, every step). The backend
        may reduce ``t`` in place (the ``torch`` backend does): pass a tensor of your own.

        Example:
            >>> import torch, meshtorch as mt
            >>> def f():
            ...     comm = mt.current().comm
            ...     return comm.all_reduce_async(torch.tensor(comm.rank + 1.0), "b").wait()[0].item()
            >>> mt.launch(f, mesh="b:2")
            [3.0, 3.0]
        """
        key = (axes, op, t.dtype, t.shape, t.device)
        try:
            flat = self._flat_all_reduces.get(key)
        except TypeError:  # axes given as a list
            key = (as_axes(axes), *key[1:])
            flat = self._flat_all_reduces.get(key)
        if flat is None:
            if len(self._flat_all_reduces) >= MAX_FLAT_ALL_REDUCES:  # shapes that vary: not kept on
                self._flat_all_reduces.clear()
            flat = self._flat_all_reduces[key] = self.prepare_all_reduce(axes, t.numel(), t.dtype, op)
        return flat.start(t)

    def _prepare_all_reduce(self, axes: tuple[str, ...], group: tuple[int, ...], op: str) -> Any:
        """What a backend works out once for a :class:`FlatAllReduce` and hands each of its starts
        (:meth:`_start_flat_all_reduce`): nothing here."""
        return None

    def _start_flat_all_reduce(self, flat: torch.Tensor, axes, group, op, call, prepared) -> Handle:
        """A :class:`FlatAllReduce`'s call started on ``flat``: its handle's wait gives ``[result]``
        (``flat`` itself where reduced in place). This one runs the backend's
        ``_start_all_reduce``, as :meth:`all_reduce_grouped` does; a backend overrides it (and
        :meth:`_prepare_all_reduce`) to do less per call."""
        return self._start_all_reduce(flat, axes, group, op, call, _as_list)

    def _issued(self, work: Handle) -> Handle:
        """An asynchronous call's handle, whose wait the stats' watchers are told of (the
        planner prices the compute run until then as overlapping the call)."""
        waited = self.stats.started()
        if waited is None:
            return work

        def finish() -> list[torch.Tensor]:
            out = work.wait()
            waited()
            return out

        return Handle(finish, work.is_completed)

    # A backend that runs calls asynchronously overrides these; the others run them now. Either
    # way the result is unpacked when waited on, so every backend runs the same ops in one order.
    def _start_all_gather(self, flat, axes, group, call, unpack) -> Handle:
        out = self._all_gather(flat, axes, group, 0, call)
        return Handle(lambda: unpack(out))

    def _start_reduce_scatter(self, buf, axes, group, op, call, unpack) -> Handle:
        out = self._reduce_scatter(buf, axes, group, 0, op, call)
        return Handle(lambda: unpack(out))

    def _start_all_reduce(self, flat, axes, group, op, call, unpack) -> Handle:
        out = self._all_reduce(flat, axes, group, op, call)
        return Handle(lambda: unpack(out))

    # ------------------------------------------------------ point-to-point
    def _peer(self, kind: str, axis: str, peer: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
        axes = as_axes(axis)
        if len(axes) != 1:
            raise CommError(f"{kind} runs along one axis, got {axes}")
        group = self.group(axes)
        me = group.index(self.rank)
        if not 0 <= peer < len(group) or peer == me:
            raise CommError(f"{kind} along {axis!r}: peer {peer} is not another member of this "
                            f"processor's group of {len(group)} (it is member {me})")
        return axes, group

    def send(self, t: torch.Tensor, axis: str, dst: int, tag: int = 0) -> None:
        """Send ``t`` to member ``dst`` of this processor's group along ``axis``.

        Unlike the collectives, only the two ends take part: the matching
        :meth:`recv` on ``dst`` gets ``t`` (any shape and dtype). ``send`` does not
        wait for the receiver; tensors between one pair with one ``tag`` arrive in
        the order sent. :meth:`wait_sends` waits until all sends have been delivered.

        Example:
            >>> import torch, meshtorch as mt
            >>> def f():
            ...     comm = mt.current().comm
            ...     if comm.coords["s"] == 0:
            ...         comm.send(torch.arange(3.0), "s", dst=1)
            ...         return None
            ...     return comm.recv("s", src=0).tolist()
            >>> mt.launch(f, mesh="s:2")
            [None, [0.0, 1.0, 2.0]]
        """
        axes, group = self._peer("send", axis, dst)
        if not isinstance(t, torch.Tensor):
            raise CommError(f"send needs a torch.Tensor, got {type(t).__name__}")
        self._record("send", axes, t.numel() * t.element_size())
        self._send(t, axes, group, dst, tag)

    def recv(self, axis: str, src: int, tag: int = 0) -> torch.Tensor:
        """The next tensor member ``src`` of this processor's group along ``axis``
        sent here with ``tag`` (waits for it; see :meth:`send`)."""
        axes, group = self._peer("recv", axis, src)
        self._record("recv", axes, 0)
        return self._recv(axes, group, src, tag)

    def wait_sends(self) -> None:
        """Wait until every tensor this processor sent has been delivered."""
        return None

    def _send(self, t, axes, group, dst, tag):
        raise CommError(f"the {self.backend} backend has no point-to-point send/recv")

    def _recv(self, axes, group, src, tag):
        raise CommError(f"the {self.backend} backend has no point-to-point send/recv")

    @collective
    def broadcast(self, t: torch.Tensor, axes, src: int = 0) -> torch.Tensor:
        """The tensor of group member ``src`` (an index into the group), on all members."""
        axes, group = self._prepare("broadcast", axes, t)
        if len(group) == 1:
            return t
        if not 0 <= src < len(group):
            raise CommError(f"broadcast over {axes}: src {src} is not in a group of {len(group)}")
        self._record("broadcast", axes, t.numel() * t.element_size())
        return self._broadcast(t, axes, group, src, self._describe("broadcast", axes, t, src=src))

    def barrier(self) -> None:
        """Wait until every processor of the mesh gets here."""
        if self.mesh.size > 1:
            self._barrier(self._describe("barrier", tuple(self.mesh.axis_names), torch.empty(0)))

    # -------------------------------------------------------- backend methods
    # ``call`` is the call's description (:meth:`_describe`): a backend whose members can
    # disagree hands the group's descriptions to :func:`compare_calls` before using any data.
    @abstractmethod
    def _all_reduce(self, t, axes, group, op, call): ...

    @abstractmethod
    def _all_gather(self, t, axes, group, dim, call): ...

    @abstractmethod
    def _reduce_scatter(self, t, axes, group, dim, op, call): ...

    @abstractmethod
    def _all_to_all(self, t, axes, group, split_dim, concat_dim, call): ...

    @abstractmethod
    def _permute(self, t, axes, group, sources, call): ...

    @abstractmethod
    def _broadcast(self, t, axes, group, src, call): ...

    @abstractmethod
    def _barrier(self, call): ...


class FlatAllReduce:
    """A grouped all_reduce of one flat buffer, prepared once by
    :meth:`Communicator.prepare_all_reduce` and started at every step: a start is counted
    (stats, the planner's watchers) and described as ``all_reduce_grouped([flat])``, in a few
    Python calls instead of some sixty (data parallel's backward launches several, each between
    two large kernels, where Python runs several times slower than warm). Eager only (a compiled
    step runs its own collectives). Under ``check`` each start takes ``all_reduce_grouped``, which
    records its call site."""

    __slots__ = ("comm", "axes", "group", "op", "numel", "dtype", "nbytes", "call", "prepared")

    def __init__(self, comm: Communicator, axes: tuple[str, ...], group: tuple[int, ...], op: str,
                 numel: int, dtype: torch.dtype):
        self.comm, self.axes, self.group, self.op = comm, axes, group, op
        self.numel, self.dtype = numel, dtype
        self.nbytes = numel * dtype.itemsize
        self.call = comm._describe("all_reduce", axes, _Like(dtype, (numel,)), op=op)
        self.prepared = None if len(group) == 1 else comm._prepare_all_reduce(axes, group, op)

    def start(self, flat: torch.Tensor) -> Handle:
        """Issue the all_reduce of ``flat`` (contiguous, ``numel`` elements of ``dtype``; the
        backend may reduce it in place): a :class:`Handle` whose ``wait()`` gives ``[result]``,
        of ``flat``'s shape (``flat`` itself where reduced in place)."""
        if flat.dtype != self.dtype or flat.numel() != self.numel or not flat.is_contiguous():
            how = "contiguous" if flat.is_contiguous() else "strided"
            raise CommError(f"all_reduce over {self.axes} prepared for {self.numel} contiguous elements of "
                            f"{self.dtype}, started with a {how} {flat.dtype}{list(flat.shape)}")
        comm = self.comm
        if len(self.group) == 1:
            return gp.done([flat])
        if comm.check:  # its call site recorded per call (a 1-d buffer whole: reduced as it is, no copy)
            return comm.all_reduce_grouped([flat.view(-1) if flat.dim() == 1 else flat], self.axes, self.op,
                                           async_op=True)
        stats = comm.stats
        stats.record("all_reduce", self.axes, self.nbytes)
        work = comm._start_flat_all_reduce(flat, self.axes, self.group, self.op, self.call, self.prepared)
        # (the watchers' list read here: _issued and CommStats.started are two calls more per start)
        return comm._issued(work) if stats._async_watchers else work


class LocalCommunicator(Communicator):
    """The communicator of a one-processor mesh: every group is this processor."""

    backend = "local"

    def __init__(self, mesh: Mesh | None = None):
        mesh = mesh or Mesh("")
        if mesh.size != 1:
            raise CommError(f"LocalCommunicator serves one processor, mesh '{mesh}' has {mesh.size}")
        super().__init__(mesh, 0)

    def _unreachable(self, *args):  # pragma: no cover - groups of one short-circuit
        raise CommError("a one-processor mesh has nobody to talk to")

    _all_reduce = _all_gather = _reduce_scatter = _all_to_all = _unreachable
    _permute = _broadcast = _unreachable

    def _barrier(self, call):
        return None


def _pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``length`` (itself when already that long)."""
    short = length - t.shape[dim]
    if not short:
        return t
    size = list(t.shape)
    size[dim] = short
    return torch.cat([t, t.new_zeros(size)], dim)


class _Like(NamedTuple):
    """What :meth:`Communicator._describe` reads of a tensor, for a call prepared before it has one."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def _as_list(out: torch.Tensor) -> list[torch.Tensor]:
    return [out]


def _alone(tensors: list[torch.Tensor], async_op: bool, release: bool = False) -> list[torch.Tensor] | Handle:
    """A grouped collective over a group of one: the tensors are their own result (``release``
    empties the caller's list, as the call would once packed)."""
    out = list(tensors)
    _release(tensors, release)
    return gp.done(out) if async_op else out


def _release(tensors: list[torch.Tensor], release: bool) -> None:
    """Empty the caller's list of a grouped call's inputs, once packed (``release=True``)."""
    if release:
        tensors.clear()


def reduce_stack(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce tensors in the given (group) order, so every member gets the same bits."""
    out = parts[0].clone()
    for p in parts[1:]:
        if op == "sum":
            out.add_(p)
        elif op == "max":
            torch.maximum(out, p, out=out)
        else:
            torch.minimum(out, p, out=out)
    return out


def _side(rank: int, call: dict, mesh: Mesh) -> str:
    args = "".join(f", {k}={call[k]!r}" for k in _ARGS if k in call)
    where = f" at {call['site']}" if call.get("site") else ""
    return (f"processor {rank} {mesh.coords(rank)} called {call['kind']}({call['dtype']}"
            f"{list(call['shape'])}{args}) over {call['axes']}{where}")


def compare_calls(calls: dict[int, dict], group: tuple[int, ...], mesh: Mesh) -> None:
    """Raise ``CommError`` if the members of ``group`` described different calls.

    ``calls`` maps each member's rank to its call description (``Communicator._describe``).
    The first field of :data:`CALL_FIELDS` that differs from the first member's is named,
    with both calls and (under ``check``) both call sites. Every backend and every member
    reports a mismatch with the same words.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.comm.base import compare_calls
        >>> a = {"kind": "all_reduce", "axes": ("b",), "op": "sum", "dtype": "torch.float32",
        ...      "shape": (2,), "site": "train.py:7 in step"}
        >>> try:
        ...     compare_calls({0: a, 1: {**a, "op": "max"}}, (0, 1), mt.Mesh("b:2"))
        ... except mt.errors.CommError as e:
        ...     print(str(e)[:68])
        collective mismatch: the reduce op differs ('sum' on processor 0, 'm
    """
    ref_rank = group[0]
    ref = calls[ref_rank]
    for rank in group[1:]:
        call = calls[rank]
        field = next((f for f in CALL_FIELDS if call.get(f) != ref.get(f)), None)
        if field is None:
            continue
        hint = "" if ref.get("site") and call.get("site") else "; run with check=True to name the call sites"
        raise CommError(
            f"collective mismatch: the {CALL_FIELDS[field]} differs ({ref.get(field)!r} on processor "
            f"{ref_rank}, {call.get(field)!r} on processor {rank}): {_side(ref_rank, ref, mesh)}; but "
            f"{_side(rank, call, mesh)}. Every processor of a group must make the same collective "
            f"calls in the same order with the same arguments{hint}"
        )
