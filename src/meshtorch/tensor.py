"""``MeshTensor``: a named global shape, its layout, and this processor's slice.

Example:
    >>> import torch, meshtorch as mt
    >>> def f():
    ...     x = mt.from_global(torch.arange(8.0).reshape(4, 2), "batch:4,d:2")
    ...     return x.local.tolist(), (x * 2).to_global().sum().item()
    >>> mt.launch(f, mesh="b:2", rules="batch:b")
    [([[0.0, 1.0], [2.0, 3.0]], 56.0), ([[4.0, 5.0], [6.0, 7.0]], 56.0)]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshtorch.context import current, here, traced
from meshtorch.errors import ShapeError
from meshtorch.layout import Layout
from meshtorch.lowering import elementwise as ew
from meshtorch.lowering.output import register
from meshtorch.lowering.redistribute import redistribute
from meshtorch.shape import Dim, Shape, as_shape


@register  # the class the lowering builds its results as (meshtorch.lowering.output)
class MeshTensor:
    """A distributed tensor with named dims.

    Its Python operators (``+ - * / // % **``, unary ``-``, ``abs()``, ``< <= > >=``) are the
    elementwise ops of :mod:`meshtorch.lowering.elementwise`, broadcasting by dim name; a Python
    number or a 0-d torch tensor on either side acts as a scalar.

    Attributes:
        shape: the global named ``Shape``.
        layout: which dim holds which mesh axis (derived from the rules).
        local: this processor's slice, a plain ``torch.Tensor`` whose dims are
            in ``shape`` order and whose sizes are :func:`local_shape` of the layout.
    """

    # ``_adapted``: the lowering's per-tensor state (:meth:`adapter_memo`); ``_later``: the
    # all_reduce in flight of a scalar whose ``local`` is not set yet (:meth:`_read_later`)
    __slots__ = ("shape", "layout", "local", "name", "_adapted", "_later")
    __array_priority__ = 1000  # so numpy scalars defer to our operators

    def __init__(self, local: torch.Tensor, shape: Shape, layout: Layout, name: str | None = None):
        want = layout.even_sizes or local_shape(layout)
        if tuple(local.shape) != want:
            raise ShapeError(
                f"tensor{_called(name)} of shape [{shape}] with layout {layout} needs a local slice "
                f"of size {list(want)}, got {list(local.shape)}"
            )
        self.shape = shape
        self.layout = layout
        self.local = local
        self.name = name
        self._adapted = self._later = None
        if traced:
            tracer = current().tracer
            if tracer is not None:
                tracer.observe(self)

    @classmethod
    def _checked_elsewhere(cls, local: torch.Tensor, shape: Shape, layout: Layout,
                           name: str | None = None) -> MeshTensor:
        """Construct without re-checking ``local``'s size: for hot paths (the one-processor
        lowering) that have just checked it against the shape."""
        t = object.__new__(cls)
        t.shape, t.layout, t.local, t.name, t._adapted, t._later = shape, layout, local, name, None, None
        if traced:
            tracer = current().tracer
            if tracer is not None:
                tracer.observe(t)
        return t

    @classmethod
    def _read_later(cls, later, shape: Shape, layout: Layout, name: str | None = None) -> MeshTensor:
        """A scalar whose all_reduce is in flight (``later``: :class:`meshtorch.lowering.adapters.Later`,
        made by :func:`meshtorch.lowering.overlap.read_later`): every read of its ``local`` waits
        for the value first (:meth:`__getattr__`), but for :meth:`backward`, which needs none."""
        t = cls._checked_elsewhere(later.tensor, shape, layout, name)  # a tracer sees the result
        del t.local
        t._later = later
        return t

    def __getattr__(self, name: str):
        # reached only where an attribute is missing: ``local`` of a scalar whose all_reduce is in
        # flight is filled now (a copy or pickle reads it this way too)
        if name == "local":
            later = self._later
            if later is None:  # another thread filled it since this one looked
                return object.__getattribute__(self, "local")
            local = later.wait()
            self.local, self._later = local, None
            return local
        raise AttributeError(f"'MeshTensor' object has no attribute {name!r}")

    # ------------------------------------------------------------ properties
    @property
    def names(self) -> tuple[str, ...]:
        return self.shape.names

    @property
    def dims(self) -> tuple[Dim, ...]:
        return self.shape.dims

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def requires_grad(self) -> bool:
        return self.local.requires_grad

    def requires_grad_(self, flag: bool = True) -> MeshTensor:
        """Make this tensor a leaf that accumulates ``.grad`` (in place)."""
        self.local.requires_grad_(flag)
        return self

    @property
    def grad(self) -> MeshTensor | None:
        """The gradient, with this tensor's shape and layout."""
        g = self.local.grad
        return None if g is None else MeshTensor(g, self.shape, self.layout)

    def zero_grad_(self) -> None:
        self.local.grad = None

    def backward(self, gradient: MeshTensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False) -> None:
        """Backpropagate from this tensor; a scalar needs no ``gradient``. ``retain_graph`` and
        ``create_graph`` as :meth:`torch.Tensor.backward`'s: ``create_graph=True`` builds the
        gradients' own graph (a gradient penalty; higher-order gradients go through every layout,
        outside :func:`mt.overlap <meshtorch.overlap>`).

        Every processor calls it (SPMD), as it calls every other op.

        With ``create_graph=True`` a leaf's ``.grad`` holds a graph that refers to the leaf: a
        reference cycle, of which torch warns on the first such call of a process. Take the
        gradient out and set ``.grad`` to ``None`` after use, as torch recommends, which breaks
        it (or take the gradient with ``torch.autograd.grad(loss.local, leaves, create_graph=True)``,
        which makes no ``.grad``).

        Example (a gradient penalty: the gradient of ``sum(x**3)`` is ``3x**2``, its square's sum's
        gradient ``36x**3``):
            >>> import torch, warnings, meshtorch as mt
            >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
            >>> x = mt.from_global(w, "d:2")
            >>> with warnings.catch_warnings():  # the cycle is broken below: no warning of it
            ...     warnings.filterwarnings("ignore", "Using backward.*create_graph=True")
            ...     mt.reduce_sum(x ** 3).backward(create_graph=True)
            >>> g, w.grad = w.grad, None  # the gradient out of .grad: no cycle left
            >>> (g ** 2).sum().backward()
            >>> w.grad.tolist()
            [36.0, 288.0]
        """
        if gradient is None:
            if self.shape.ndim:
                raise ShapeError(
                    f"backward() without a gradient needs a scalar; this tensor has shape "
                    f"[{self.shape}] — reduce it first, e.g. mt.reduce_sum(x)"
                )
            later = self._later  # a loss whose all_reduce is in flight: its gradient is 1 all the same
            (self.local if later is None else later.tensor).backward(
                retain_graph=retain_graph, create_graph=create_graph)
        else:
            if gradient.shape != self.shape:
                raise ShapeError(
                    f"backward: the gradient has shape [{gradient.shape}] but the tensor has "
                    f"[{self.shape}]; pass a gradient of the tensor's shape"
                )
            self.local.backward(redistribute(gradient.local, gradient.layout, self.layout),
                                retain_graph=retain_graph, create_graph=create_graph)

    def detach(self) -> MeshTensor:
        return MeshTensor(self.local.detach(), self.shape, self.layout, self.name)

    def to_global(self) -> torch.Tensor:
        """The whole tensor as a plain ``torch.Tensor``, on every processor."""
        return redistribute(self.local, self.layout, Layout(self.shape, self.layout.mesh, {}))

    def item(self) -> float | int | bool:
        return self._scalar("item()").item()

    # Python's number conversions, as torch.Tensor's: ``float(loss)`` is ``loss.item()`` (a loss
    # whose all_reduce is in flight waits for it: ``local`` is read). Only a scalar converts; it is
    # the same number on every processor, so every processor takes the same branch of an ``if``.
    def __float__(self) -> float:
        return float(self._scalar("float()").item())

    def __int__(self) -> int:
        return int(self._scalar("int()").item())

    def __index__(self) -> int:  # an integer dtype only, as torch's (a float raises TypeError)
        return self._scalar("operator.index()").__index__()

    def __complex__(self) -> complex:
        return complex(self._scalar("complex()").item())

    def __bool__(self) -> bool:
        return bool(self._scalar("bool()").item())

    def _scalar(self, what: str) -> torch.Tensor:
        """The local value of this scalar for ``what`` (a conversion to a Python number)."""
        if self.shape.ndim:
            fix = "mt.reduce_any(x) or mt.reduce_all(x)" if what == "bool()" else "mt.reduce_sum(x)"
            raise ShapeError(
                f"{what} needs a scalar MeshTensor (no dims); {self.name or 'this tensor'} has dims "
                f"[{self.shape}] — reduce them first, e.g. {fix}")
        return self.local

    def __repr__(self) -> str:
        nm = f" {self.name!r}" if self.name else ""
        return f"MeshTensor{nm}([{self.shape}], layout={self.layout}, dtype={self.dtype})"

    def adapter_memo(self) -> dict:
        """The store in which the uses of this tensor share their adapters' outputs
        (:func:`~meshtorch.lowering.redistribute.run_shared`); made on first use."""
        memo = self._adapted
        if memo is None:
            memo = self._adapted = {}
        return memo

    # ------------------------------------------------------------ operators
    # ``x + y`` is ``add(x, y)``: each method calls the op's nary() itself, no frame of its own
    # per operator (issue 27: a model's residual adds and scalings run cold between large
    # kernels); the reflected ones swap their operands. An operand of a foreign type with the
    # matching method (``__radd__`` for ``__add__``) has it run, meshtorch's error where it declines
    # (lowering.elementwise.operator; a reflected method never gives way: Python calls it after the
    # other's own method declined); ``==`` is identity (``mt.equal`` compares values)
    __add__ = ew.operator(ew.add, "__radd__")
    __radd__ = ew.operator(ew.add, None, swap=True)
    __sub__ = ew.operator(ew.subtract, "__rsub__")
    __rsub__ = ew.operator(ew.subtract, None, swap=True)
    __mul__ = ew.operator(ew.multiply, "__rmul__")
    __rmul__ = ew.operator(ew.multiply, None, swap=True)
    __truediv__ = ew.operator(ew.divide, "__rtruediv__")
    __rtruediv__ = ew.operator(ew.divide, None, swap=True)
    __pow__ = ew.operator(ew.pow, "__rpow__")
    __rpow__ = ew.operator(ew.pow, None, swap=True)
    __floordiv__ = ew.operator(ew.floordiv, "__rfloordiv__")
    __rfloordiv__ = ew.operator(ew.floordiv, None, swap=True)
    __mod__ = ew.operator(ew.mod, "__rmod__")
    __rmod__ = ew.operator(ew.mod, None, swap=True)
    # (a comparison's reflection is the mirrored comparison: ``x < y`` is ``y > x``)
    __lt__ = ew.operator(ew.less, "__gt__")
    __le__ = ew.operator(ew.less_equal, "__ge__")
    __gt__ = ew.operator(ew.greater, "__lt__")
    __ge__ = ew.operator(ew.greater_equal, "__le__")
    __neg__ = ew.negative
    __abs__ = ew.abs

    __hash__ = object.__hash__


def layout_for(shape: Shape, name: str | None = None) -> Layout:
    """The layout of ``shape`` under the current processor's mesh and rules."""
    ctx = here.ctx or current()  # (current() and ctx.mesh without their frames: per op's output)
    return ctx.rules.layout(shape, ctx.comm.mesh, name)


def local_shape(layout: Layout) -> tuple[int, ...]:
    """Sizes of this processor's slice of a tensor in ``layout`` (they differ between processors
    where a dim is split unevenly).

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.tensor import layout_for, local_shape
        >>> mt.launch(lambda: local_shape(layout_for(mt.Shape("batch:5"))), mesh="b:2", rules="batch:b")
        [(3,), (2,)]
    """
    sizes = layout.even_sizes
    return sizes if sizes is not None else layout.local_sizes_at(current().coords)


def local_slices(layout: Layout) -> tuple[slice, ...]:
    """Index of this processor's slice within the global tensor."""
    # (a list made in one frame, not a generator resumed per dim; the context without current()'s)
    return tuple([slice(s, s + n) for s, n in layout.slices((here.ctx or current()).comm.coords)])


def from_global(
    t: torch.Tensor,
    shape: Shape | str | Iterable[Dim],
    requires_grad: bool = False,
    name: str | None = None,
) -> MeshTensor:
    """Lay out a whole tensor (the same on every processor) by the current rules.

    Each processor keeps only its slice; no communication happens. ``t`` must
    be the same on every processor (seed any torch RNG you use; under
    ``mt.launch(..., check=True)`` this is verified). If ``t`` requires grad,
    gradients flow back into it. The slice is put on the processor's device
    (``mt.launch(..., device="cuda")``), so ``t`` may be a host tensor.

    Example:
        >>> import torch, meshtorch as mt
        >>> x = mt.from_global(torch.zeros(2, 3), "a:2,b:3")
        >>> x.shape, x.local.shape
        (Shape('a:2,b:3'), torch.Size([2, 3]))
    """
    if not isinstance(shape, Shape):
        shape = as_shape(shape)
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if tuple(t.shape) != shape.sizes:
        hint = ("name one dim per torch dim" if t.dim() != len(shape.sizes) else
                "name the dims in the tensor's order, or permute it" if sorted(t.shape) == sorted(shape.sizes)
                else "give the named dims the tensor's sizes")
        raise ShapeError(
            f"from_global: tensor{_called(name)} has torch shape {list(t.shape)} but the named "
            f"shape [{shape}] needs {list(shape.sizes)}; {hint}"
        )
    layout = layout_for(shape, name)
    comm = (here.ctx or current()).comm
    if comm.check:
        _check_same_everywhere(t, shape, name)
    # the slice goes where the processor computes (a GPU's processor reads host data)
    dev = comm.device
    moved = dev is not None and t.device != dev
    if t.requires_grad:
        local = t[local_slices(layout)]  # a view: gradients flow back into t
        if moved:
            local = local.to(dev)
    else:
        # a copy of the slice; an unsplit tensor is its own slice, so no indexing op (and no
        # detach: t has no autograd history), one aten op for an input on one processor
        local = t[local_slices(layout)] if layout.split else t
        local = local.to(dev) if moved else local.clone()
        if requires_grad:
            local.requires_grad_(True)
    return MeshTensor(local, shape, layout, name)


def _called(name: str | None) -> str:
    """`` 'name'`` for a message about a tensor, or nothing where it has no name."""
    return f" {name!r}" if name else ""


def on_processor(t: torch.Tensor) -> torch.Tensor:
    """``t`` on this processor's device (``mt.launch(..., device=)``); unchanged where it is
    already there or the processor has none of its own (torch's default device then).

    Example:
        >>> import torch
        >>> from meshtorch.tensor import on_processor
        >>> on_processor(torch.ones(2)).device.type
        'cpu'
    """
    dev = current().device
    return t if dev is None or t.device == dev else t.to(dev)


def _check_same_everywhere(t: torch.Tensor, shape: Shape, name: str | None) -> None:
    # two position-weighted sums catch any difference short of a deliberate collision
    flat = t.detach().reshape(-1).to(torch.float64)
    w = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    sig = torch.stack([flat.sum(), (flat * w).sum()]).nan_to_num(0.0)
    comm = current().comm
    axes = comm.mesh.axis_names
    if not torch.equal(comm.all_reduce(sig, axes, "max"), comm.all_reduce(sig, axes, "min")):
        raise ShapeError(
            f"from_global: tensor{_called(name)} of shape [{shape}] differs between processors; "
            "from_global needs the same whole tensor on every processor — seed it (e.g. "
            "torch.Generator().manual_seed(0)) or use mt.random"
        )


def full(
    shape: Shape | str | Iterable[Dim],
    value: float,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    device: torch.device | str | None = None,
    name: str | None = None,
) -> MeshTensor:
    """A tensor filled with ``value``, allocated slice by slice on ``device`` (by default
    the processor's, ``mt.current().device``).

    Example:
        >>> import meshtorch as mt
        >>> mt.full("a:2", 3.0).to_global().tolist()
        [3.0, 3.0]
    """
    shape = as_shape(shape)
    layout = layout_for(shape, name)
    device = device if device is not None else current().device
    local = torch.full(local_shape(layout), value, dtype=dtype, device=device)
    return MeshTensor(local.requires_grad_(requires_grad), shape, layout, name)


def zeros(shape, dtype=None, requires_grad=False, device=None, name=None) -> MeshTensor:
    """A tensor of zeros; see :func:`full`.

    Example:
        >>> import meshtorch as mt
        >>> mt.zeros("a:2").to_global().tolist()
        [0.0, 0.0]
    """
    return full(shape, 0.0, dtype, requires_grad, device, name)


def ones(shape, dtype=None, requires_grad=False, device=None, name=None) -> MeshTensor:
    """A tensor of ones; see :func:`full`.

    Example:
        >>> import meshtorch as mt
        >>> mt.ones("a:2").to_global().tolist()
        [1.0, 1.0]
    """
    return full(shape, 1.0, dtype, requires_grad, device, name)


def zeros_like(x: MeshTensor, dtype: torch.dtype | None = None, name: str | None = None) -> MeshTensor:
    """Zeros of ``x``'s shape and layout (and dtype, unless given); not tied to ``x``'s graph.

    Example:
        >>> import meshtorch as mt
        >>> mt.zeros_like(mt.ones("a:2")).to_global().tolist()
        [0.0, 0.0]
    """
    x = as_mesh_tensor(x)
    return MeshTensor(torch.zeros_like(x.local, dtype=dtype), x.shape, x.layout, name)


def ones_like(x: MeshTensor, dtype: torch.dtype | None = None, name: str | None = None) -> MeshTensor:
    """Ones of ``x``'s shape and layout (and dtype, unless given); not tied to ``x``'s graph.

    Example:
        >>> import meshtorch as mt
        >>> mt.ones_like(mt.zeros("a:2")).to_global().tolist()
        [1.0, 1.0]
    """
    x = as_mesh_tensor(x)
    return MeshTensor(torch.ones_like(x.local, dtype=dtype), x.shape, x.layout, name)


def share_adapted(src: MeshTensor, dst: MeshTensor) -> None:
    """``dst`` wraps the very slice of ``src`` under other dim names (a relayout that moved
    nothing, such as attention's keys read from its queries' input under ``memory_length``): let
    their uses share adapters (:func:`~meshtorch.lowering.redistribute.run_shared`), as uses of
    one tensor do. The adapters act on tensor dims by position, never by name, so the same steps
    give the same result for both."""
    if dst.local is src.local:
        dst._adapted = src.adapter_memo()


def as_mesh_tensor(x) -> MeshTensor:
    """Check that ``x`` is a ``MeshTensor`` with a useful error otherwise."""
    if not isinstance(x, MeshTensor):
        raise ShapeError(
            f"expected a MeshTensor, got {type(x).__name__}; wrap torch tensors with "
            "mt.from_global(t, shape)"
        )
    return x
