"""The one engine that moves data between layouts.

:func:`redistribute` takes a local slice laid out one way and returns this processor's slice of
the same values laid out another way (same sizes, dims possibly renamed), with the fewest bytes.
A dim split over axes ``(a1, ..., ak)`` is cut over ``a1`` first (see :mod:`meshtorch.layout`),
so a dim can only lose its minor axes and gain axes after the ones it keeps. Per tensor dim,
the axes after the common prefix of the two layouts move: one ``all_to_all`` over the group of
axes that leave one dim for the next free place of another, one ``all_gather`` over the group of
those that become replicated (``(b,m)`` to ``b``: an all_gather over ``m`` only), a local slice
(no communication) for those that become split. Axes given in mesh order travel as one grouped
collective. Each step is an adapter of :mod:`meshtorch.lowering.adapters`, so the result is
differentiable. ``relayout``, ``to_global``, ``MeshTensor.backward(gradient)`` and the lowering of
every op move data through it.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.layout import LayoutRules
    >>> from meshtorch.lowering.redistribute import redistribute
    >>> def f():
    ...     x = mt.from_global(torch.arange(4.0), "batch:4")
    ...     whole = LayoutRules("").layout(x.shape, mt.current().mesh)
    ...     return redistribute(x.local, x.layout, whole).tolist(), mt.comm_stats().calls()
    >>> mt.launch(f, mesh="b:2", rules="batch:b")
    [([0.0, 1.0, 2.0, 3.0], 1), ([0.0, 1.0, 2.0, 3.0], 1)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from meshtorch.caching import BoundedCache
from meshtorch.context import current
from meshtorch.errors import ShapeError
from meshtorch.layout import Axes, Layout
from meshtorch.lowering import adapters as ca
from meshtorch.lowering.adapters import is_dynamo_compiling
from meshtorch.mesh import Mesh

# One step of a move: an adapter, the axis (or group of axes, in mesh order) it runs over, and
# its arguments after (tensor, comm, axes).
Step = tuple[Callable[..., torch.Tensor], "str | Axes", tuple]


def group(axes: Axes) -> str | Axes:
    """How a step names its axes: one axis by name (as the communicator counts it), several as
    a tuple."""
    return axes[0] if len(axes) == 1 else axes


def ordered_runs(mesh: Mesh, axes: Axes) -> list[Axes]:
    """``axes`` cut into runs that each come in mesh order (each run is one grouped collective)."""
    runs: list[Axes] = []
    for a in axes:
        if runs and mesh.in_order(runs[-1][-1:] + (a,)):
            runs[-1] += (a,)
        else:
            runs.append((a,))
    return runs


def _common(a: Axes, b: Axes) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def moves(mesh: Mesh, sizes: Sequence[int], src: Sequence[Axes], dst: Sequence[Axes],
          summed: frozenset[str] = frozenset()) -> tuple[Step, ...]:
    """The adapters that take a slice whose tensor dim ``i`` (of global size ``sizes[i]``) is split
    over ``src[i]`` to one split over ``dst[i]``, in the order to run them.

    Axes first leave their dims (minor first): by ``all_to_all`` when another dim takes them next,
    else by ``all_gather``; then the axes a dim gains are sliced. ``summed`` names the axes whose
    gather feeds an op that varies along them (its backward is a ``reduce_scatter``, not a slice).
    """
    cur = [tuple(a) for a in src]
    k = len(cur)
    steps: list[Step] = []

    def whole(i: int, keep: int) -> tuple:
        """What a gather of dim ``i`` down to its first ``keep`` axes needs to know of uneven
        pieces: its global size and those axes (nothing when every piece is equal)."""
        if sizes[i] % math.prod([mesh.axis_size(a) for a in cur[i]]) == 0:
            return ()
        return (sizes[i], cur[i][:keep])

    def keep(i: int) -> int:
        return _common(cur[i], dst[i])

    def ready(j: int) -> bool:
        return len(cur[j]) < len(dst[j]) and cur[j] == dst[j][: len(cur[j])]

    while True:
        leaving = [i for i in range(k) if len(cur[i]) > keep(i)]
        if not leaving:
            break
        move = None
        for i in leaving:
            free = len(cur[i]) - keep(i)
            for j in range(k):
                if j == i or not ready(j):
                    continue
                nxt = dst[j][len(cur[j]):]
                for g in range(min(free, len(nxt)), 0, -1):
                    axes = cur[i][len(cur[i]) - g:]
                    if axes == nxt[:g] and mesh.in_order(axes):
                        move = (i, j, axes)
                        break
                if move:
                    break
            if move:
                break
        if move is not None:
            i, j, axes = move
            steps.append((ca.all_to_all, group(axes), (j, i) + whole(i, len(cur[i]) - len(axes))))
            cur[i], cur[j] = cur[i][: len(cur[i]) - len(axes)], cur[j] + axes
            continue
        i = leaving[0]
        wanted = {dst[j][len(cur[j])] for j in range(k) if j != i and ready(j)}
        run = cur[i][-1:]
        # gather as one group the longest tail in mesh order, of one kind, that stops before
        # an axis another dim could take next by all_to_all
        for a in reversed(cur[i][keep(i):-1]):
            if a in wanted or (a in summed) != (run[0] in summed) or not mesh.in_order((a,) + run):
                break
            run = (a,) + run
        fn = ca.all_gather if run[0] in summed else ca.all_gather_sliced
        steps.append((fn, group(run), (i,) + whole(i, len(cur[i]) - len(run))))
        cur[i] = cur[i][: len(cur[i]) - len(run)]
    for i in range(k):
        for run in ordered_runs(mesh, dst[i][len(cur[i]):]):
            steps.append((ca.local_slice, group(run), (i,)))
    return tuple(steps)


def steps_between(src: Layout, dst: Layout) -> tuple[Step, ...]:
    """The adapters that take a slice in layout ``src`` to layout ``dst``, in the order to run them
    (see :func:`moves`)."""
    if src.shape.sizes != dst.shape.sizes:
        raise ShapeError(
            f"redistribute keeps sizes: [{src.shape}] has sizes {list(src.shape.sizes)}, but "
            f"[{dst.shape}] has {list(dst.shape.sizes)}; use mt.reshape to change sizes"
        )
    return moves(src.mesh, src.shape.sizes, [src.axes_of(d.name) for d in src.shape],
                 [dst.axes_of(d.name) for d in dst.shape])


def run_steps(t: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    """Apply ``steps`` (adapters and their arguments) to the local tensor ``t`` on this processor."""
    if steps:
        comm = current().comm
        for fn, axis, args in steps:
            t = fn(t, comm, axis, *args)
    return t


def sums_gradient(steps: Sequence[Step]) -> bool:
    """Whether ``steps`` hold an adapter whose backward sums gradients over an axis (an input
    used whole by an op that varies along the axis: ``identity_grad_sum``, or ``all_gather``
    with its ``reduce_scatter`` backward)."""
    return any(fn is ca.identity_grad_sum or fn is ca.all_gather for fn, _, _ in steps)


def run_shared(t: torch.Tensor, memo: dict, steps: tuple[Step, ...]) -> torch.Tensor:
    """:func:`run_steps` on a tensor ``x``'s slice ``t``, shared through ``memo`` (``x``'s store,
    :meth:`~meshtorch.tensor.MeshTensor.adapter_memo`) by every use of ``x`` that runs the same
    ``steps``: Mesh-TensorFlow's lazy all-reduce.

    Each op that varies along an axis ``x`` is replicated on (or whole along) sends back a partial
    sum of ``x``'s gradient. Run per use, every use reduces its own part; here the first use runs
    the adapters and later ones take their output, so autograd adds the parts locally and the
    reduction runs once per tensor and axis group (three projections of one input: one
    ``all_reduce``, not three). The adapters are linear and save no tensors, so a shared output
    is exact, also when a later use comes after a backward or in a recomputation.

    The output lives on ``x`` (so it dies with ``x`` and is never seen by another tensor), is
    kept per communicator (one processor never takes another's), and is used only while ``x``'s
    slice is the same tensor at the same version (an in-place update, such as an optimizer step
    on a parameter, makes the next use adapt afresh). Callers share only in grad mode, for
    ``x`` requiring grad and steps that :func:`sums_gradient`; otherwise nothing is summed and
    :func:`run_steps` is used. A parameter gives every MeshTensor read from it one
    :class:`LastingMemo`: its uses share too (a tied embedding table's lookup and output layer
    reduce its gradient once), but only adapters whose output is a view of the slice, and not
    inside a ``torch.compile``d step (there each use of a parameter reduces its own part).

    Example (two uses of ``x``, replicated on ``m``, by ops that split ``h`` over ``m``):
        >>> import torch, meshtorch as mt
        >>> def f():
        ...     x = mt.from_global(torch.ones(2, 3), "batch:2,d:3", requires_grad=True)
        ...     w = mt.from_global(torch.ones(3, 4), "d:3,h:4")
        ...     y = mt.einsum("batch d, d h -> batch h", x, w)
        ...     z = mt.einsum("batch d, d h -> batch h", x, w * 2)
        ...     mt.reduce_sum(y + z).backward()
        ...     return mt.comm_stats().calls("m", "all_reduce"), x.grad.to_global()[0].tolist()
        >>> mt.launch(f, mesh="m:2", rules="h:m")[0]
        (2, [12.0, 12.0, 12.0])
    """
    comm = current().comm
    lasting = type(memo) is LastingMemo
    # under torch.compile a store that outlives the call would be a side effect Dynamo replays and
    # guards on (a recompile per step): a compiled step reduces a parameter once per use
    if lasting and (torch.compiler.is_compiling()
                    or not all(fn is ca.identity_grad_sum for fn, _, _ in steps)):
        return run_steps(t, steps)
    key = (steps, id(comm))
    hit = memo.get(key)
    if (hit is not None and hit[0] is comm and hit[1] is t and hit[2] == t._version
            # a lasting view must still alias the slice: `p.data = ...` (module.to(dtype),
            # .double()) swaps the storage without a version bump
            and (not lasting or torch._C._is_alias_of(hit[3], t))):
        return hit[3]
    out = run_steps(t, steps)
    memo[key] = (comm, t, t._version, out)
    return out


class LastingMemo(dict):
    """The shared adapters of a tensor that outlives a step (a parameter, whose MeshTensors are
    read afresh for each use): :func:`run_shared` keeps in it only outputs that are views of the
    slice (the identity of a replicated input, whose backward sums the gradient), so sharing
    holds no memory. A parameter gathered whole (FSDP-style rules) is gathered per use, so a
    ZeRO-style layout or a recomputed block does not keep a whole copy alive through the step.

    Example (two uses of a parameter replicated on ``b`` by ops split on ``b``: its gradient is
    all-reduced once, and is the sum of both uses' over the whole batch):
        >>> import torch, meshtorch as mt
        >>> def f():
        ...     p = mt.nn.MeshParameter("d:3", init="ones")
        ...     x = mt.from_global(torch.ones(2, 3), "batch:2,d:3")
        ...     y = mt.einsum("batch d, d -> batch", x, p.mesh_tensor)      # a read per use
        ...     z = mt.einsum("batch d, d -> batch", x * 2, p.mesh_tensor)
        ...     loss = mt.reduce_sum(y + z)
        ...     before = mt.comm_stats().calls("b", "all_reduce")
        ...     loss.backward()
        ...     return mt.comm_stats().calls("b", "all_reduce") - before, p.grad.tolist()
        >>> mt.launch(f, mesh="b:2", rules="batch:b")
        [(1, [6.0, 6.0, 6.0]), (1, [6.0, 6.0, 6.0])]
    """


def redistribute(t: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This processor's slice in layout ``dst`` of the tensor whose slice in layout ``src`` is ``t``.

    ``src`` and ``dst`` have the same sizes (their dim names may differ); the moves are cached per
    pair of layouts. Every processor must call it (SPMD): it runs collectives.

    Example:
        >>> import torch, meshtorch as mt
        >>> from meshtorch.lowering.redistribute import redistribute
        >>> x = mt.ones("a:2")
        >>> redistribute(x.local, x.layout, x.layout).tolist()
        [1.0, 1.0]
    """
    if src is dst:
        return t
    # the layouts by their constants (equal exactly when they are), hashed in C: a Layout's own
    # __hash__ is a Python call (a rename runs this every step, cold between large kernels)
    key = (src.key, dst.key)
    compiled = is_dynamo_compiling()
    steps = None if compiled else _STEPS.get(key)
    if steps is None:
        steps = steps_between(src, dst) if compiled else _STEPS.put(key, steps_between(src, dst))
    return run_steps(t, steps) if steps else t


_STEPS = BoundedCache(4096)
