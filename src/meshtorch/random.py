"""Layout-invariant randomness (see docs/design.md, Randomness).

Every random element is a pure function of ``(seed, stream, global element
index)``: a counter-based hash (Chris Wellons' ``triple32`` finaliser applied
to the index words and the key) computed only for the local slice. The same
seed therefore gives bitwise the same global tensor on 1 or 512 processors,
under any rules, and on any device: uniform draws are integer arithmetic and exact
float64 scaling, so a CUDA processor gets bitwise the CPU's numbers (normal ones
up to float64 rounding of ``log``/``cos``). Tensors are made on ``device=``,
by default the processor's (``mt.current().device``).

Example:
    >>> import meshtorch as mt
    >>> def f():
    ...     return mt.random.normal("a:4,b:2", seed=3).to_global()
    >>> one = mt.launch(f)[0]
    >>> four = mt.launch(f, mesh="x:2,y:2", rules="a:x; b:y")
    >>> all(bool((t == one).all()) for t in four)
    True
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch

from meshtorch.context import current, drawing
from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.layout import Layout
from meshtorch.shape import Dim, Shape, as_shape, dim_name
from meshtorch.tensor import MeshTensor, layout_for, local_shape

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 without int64 overflow: split c into 16-bit halves
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _triple32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


def _key(seed: int, stream: int | str, word: int) -> int:
    s = zlib.crc32(stream.encode()) if isinstance(stream, str) else int(stream)
    # keys are host integers, also while the meta backend makes meta the default device
    t = torch.tensor([(seed & _M32) ^ word * 0x9E3779B9 & _M32], dtype=torch.int64, device="cpu")
    t = _triple32(t ^ (s & _M32))
    t = _triple32(t ^ ((seed >> 32) & _M32) ^ ((s >> 32) & _M32))
    return int(t.item())


def _global_index(shape: Shape, slices, device) -> torch.Tensor:
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d, (start, size) in reversed(list(zip(shape, slices))):
        r = torch.arange(start, start + size, dtype=torch.int64, device=device) * stride
        idx = r.reshape((-1,) + (1,) * idx.dim()) + idx
        stride *= d.size
    return idx


def _words(shape: Shape, seed: int, stream, device, layout) -> tuple[torch.Tensor, torch.Tensor]:
    i = _global_index(shape, layout.slices(current().coords), device)
    lo, hi = i & _M32, i >> 32
    a = _triple32(_triple32(lo ^ _key(seed, stream, 1)) ^ hi ^ _key(seed, stream, 2))
    b = _triple32(a ^ _key(seed, stream, 3))
    return a, b


def _resolve(seed, stream) -> tuple[int, int | str]:
    if seed is None:
        return 0, ("auto", current().next_random_stream()).__repr__()
    if not isinstance(seed, int):
        raise ShapeError(f"seed must be an int, got {seed!r}")
    return seed, 0 if stream is None else stream


def _uniform53(shape, seed, stream, device, layout) -> torch.Tensor:
    # initialising is not the step's work: a tracer neither counts these ops nor holds their
    # temporaries as memory; a draw inside the measured step (dropout) holds real memory
    with drawing() as followed:
        dev = torch.device(device) if device is not None else torch.get_default_device()
        if dev.type == "meta" and not followed:
            # a meta tensor has no values; skip the ~100 integer ops per tensor, which are slow on
            # meta (initialising a 4.9B-parameter model took 38 s) and only produce this shape;
            # in a traced step they run, so that the plan holds their temporaries
            return torch.empty(local_shape(layout), dtype=torch.float64, device=dev)
        a, b = _words(shape, seed, stream, device, layout)
        # 53 random bits → a float64 in [0, 1), as MT19937's genrand_res53
        return ((a >> 5).double() * 67108864.0 + (b >> 6).double()) / 9007199254740992.0


def _make(shape, seed, stream, dtype, device, requires_grad, name, fn) -> MeshTensor:
    shape = as_shape(shape)
    seed, stream = _resolve(seed, stream)
    layout = layout_for(shape, name)
    dtype = dtype or torch.get_default_dtype()
    # the processor's device unless told: made there, never copied from the host
    device = device if device is not None else current().device
    local = fn(shape, seed, stream, device, layout).to(dtype)
    return MeshTensor(local.requires_grad_(requires_grad), shape, layout, name)


def uniform(shape, low: float = 0.0, high: float = 1.0, *, seed: int | None = None,
            stream: int | str | None = None, dtype: torch.dtype | None = None, device=None,
            requires_grad: bool = False, name: str | None = None) -> MeshTensor:
    """Uniform on ``[low, high)``; bitwise the same on any mesh and rules.

    Example:
        >>> import meshtorch as mt
        >>> u = mt.random.uniform("a:1000", seed=0).to_global()
        >>> bool((u >= 0).all() and (u < 1).all())
        True
    """
    return _make(shape, seed, stream, dtype, device, requires_grad, name,
                 lambda *a: low + (high - low) * _uniform53(*a))


def normal(shape, mean: float = 0.0, std: float = 1.0, *, seed: int | None = None,
           stream: int | str | None = None, dtype: torch.dtype | None = None, device=None,
           requires_grad: bool = False, name: str | None = None) -> MeshTensor:
    """Gaussian (Box–Muller); bitwise the same on any mesh and rules.

    Example:
        >>> import meshtorch as mt
        >>> abs(mt.random.normal("a:4000", seed=1).to_global().mean().item()) < 0.1
        True
    """
    def fn(shape, seed, stream, device, layout):
        u1 = _uniform53(shape, seed, (stream, "u1").__repr__(), device, layout)
        u2 = _uniform53(shape, seed, (stream, "u2").__repr__(), device, layout)
        z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)
        return mean + std * z

    return _make(shape, seed, stream, dtype, device, requires_grad, name, fn)


def uniform_whole(shape, low: float = 0.0, high: float = 1.0, *, seed: int, stream: int | str = 0,
                  dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The whole of ``uniform(shape, low, high, seed=seed, stream=stream).to_global()``, made on
    every processor without communication: for numbers every processor needs whole and the
    same, such as decoding's sampling noise. On ``device`` (default: the processor's); the
    same bits on the CPU and on a GPU.

    Example:
        >>> import meshtorch as mt
        >>> whole = mt.random.uniform_whole("batch:4", seed=5, stream="s")
        >>> def f():
        ...     laid_out = mt.random.uniform("batch:4", seed=5, stream="s", dtype=whole.dtype)
        ...     return bool((laid_out.to_global() == whole).all())
        >>> mt.launch(f, mesh="b:2", rules="batch:b")
        [True, True]
    """
    shape = as_shape(shape)
    if not isinstance(seed, int):
        raise ShapeError(f"seed must be an int, got {seed!r}")
    whole = Layout(shape, current().mesh, {})  # replicated: every processor draws all of it
    device = device if device is not None else current().device
    return (low + (high - low) * _uniform53(shape, seed, stream, device, whole)).to(dtype)


def bernoulli(shape, p: float = 0.5, *, seed: int | None = None, stream: int | str | None = None,
              dtype: torch.dtype | None = None, device=None, name: str | None = None) -> MeshTensor:
    """1 with probability ``p``, else 0; bitwise the same on any mesh and rules.

    Example:
        >>> import meshtorch as mt
        >>> mt.random.bernoulli("a:5", 1.0, seed=0).to_global().tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0]
    """
    if not 0.0 <= p <= 1.0:
        raise ArgumentError(f"bernoulli: p={p} is outside [0, 1]; pass the probability of a 1, e.g. p=0.9")
    return _make(shape, seed, stream, dtype, device, False, name,
                 lambda *a: (_uniform53(*a) < p).double())


def _fan(shape: Shape, dims: Iterable[str | Dim] | None, default: list[str], op: str) -> int:
    names = default if dims is None else [dim_name(d, shape, op, "the shape") for d in dims]
    return math.prod(shape[n].size for n in names) if names else 1


def xavier_uniform(shape, fan_in: Iterable[str | Dim] | None = None,
                   fan_out: Iterable[str | Dim] | None = None, gain: float = 1.0, **kw) -> MeshTensor:
    """Glorot uniform with fans given by dim names (default: all but the last dim
    are fan-in, the last is fan-out).

    Example:
        >>> import meshtorch as mt
        >>> w = mt.random.xavier_uniform("d_model:8,d_ff:8", seed=0)
        >>> bool(w.to_global().abs().max() <= (6 / 16) ** 0.5)
        True
    """
    shape = as_shape(shape)
    fi = _fan(shape, fan_in, list(shape.names[:-1]), "xavier_uniform")
    fo = _fan(shape, fan_out, list(shape.names[-1:]), "xavier_uniform")
    a = gain * math.sqrt(6.0 / (fi + fo))
    return uniform(shape, -a, a, **kw)


def kaiming_normal(shape, fan_in: Iterable[str | Dim] | None = None, gain: float = math.sqrt(2.0),
                   **kw) -> MeshTensor:
    """He normal: std ``gain / sqrt(fan_in)``, fan-in by dim names (default: all
    but the last dim).

    Example:
        >>> import meshtorch as mt
        >>> mt.random.kaiming_normal("d_in:16,d_out:4", seed=0).shape
        Shape('d_in:16,d_out:4')
    """
    shape = as_shape(shape)
    fi = _fan(shape, fan_in, list(shape.names[:-1]), "kaiming_normal")
    return normal(shape, 0.0, gain / math.sqrt(fi), **kw)
