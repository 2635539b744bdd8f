"""Test harness: run an op on a drawn mesh and compare with dense torch.

``check_op`` runs ``mt_fn`` under ``mt.launch`` on the given mesh and rules,
backpropagates ``sum(y * probe)`` for a fixed random ``probe``, and compares the
gathered result and input gradients on *every* processor with the same
computation written in plain torch (float64) on one processor.
"""

from __future__ import annotations

import contextlib
import math

import torch
from hypothesis import strategies as st

import meshtorch as mt

AXES = ("x", "y", "z")


@st.composite
def meshes(draw, max_procs: int = 8, max_axes: int = 3) -> str:
    """A mesh spec with 1–3 axes of sizes 1, 2 or 4 and at most ``max_procs`` processors."""
    n_axes = draw(st.integers(1, max_axes))
    sizes = []
    for _ in range(n_axes):
        room = max_procs // math.prod(sizes) if sizes else max_procs
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 4) if s <= room])))
    return ",".join(f"{a}:{s}" for a, s in zip(AXES, sizes))


@st.composite
def rules_for(draw, mesh: str, dims: list[str]) -> str:
    """Rules mapping some of ``dims`` to axes of ``mesh`` (several dims may share an axis)."""
    axes = [p.split(":")[0] for p in mesh.split(",")]
    out = []
    for d in dims:
        axis = draw(st.sampled_from([None, *axes]))
        if axis is not None:
            out.append(f"{d}:{axis}")
    return "; ".join(out)


@st.composite
def multi_rules_for(draw, mesh: str, dims: list[str]) -> str:
    """Rules mapping some of ``dims`` to one axis or an ordered tuple of axes of ``mesh``, in any
    order (``"d:(y,x)"``); several dims may share axes."""
    axes = [p.split(":")[0] for p in mesh.split(",")]
    out = []
    for d in dims:
        k = draw(st.integers(0, len(axes)))
        if k:
            chosen = draw(st.permutations(axes))[:k]
            out.append(f"{d}:{chosen[0]}" if k == 1 else f"{d}:({','.join(chosen)})")
    return "; ".join(out)


SIZES = st.sampled_from([4, 8, 12])  # divisible by every axis size we draw


def _probe(shape: torch.Size, seed: int = 99) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def check_op(
    mt_fn,
    torch_fn,
    inputs: list[tuple[torch.Tensor, str]],
    mesh: str,
    rules: str,
    *,
    grad: bool = True,
    atol: float = 1e-9,
    rtol: float = 1e-7,
    expect_calls=None,
):
    """Compare ``mt_fn`` on the mesh with ``torch_fn`` densely, values and gradients."""
    ref_in = [t.clone().requires_grad_(grad and t.is_floating_point()) for t, _ in inputs]
    ref_out = torch_fn(*ref_in)
    probe = _probe(ref_out.shape) if ref_out.is_floating_point() else None
    if grad and probe is not None and ref_out.requires_grad:
        (ref_out * probe).sum().backward()
    # an input the output does not depend on has a zero gradient
    ref_grads = [
        (t.grad if t.grad is not None else torch.zeros_like(t)) if t.requires_grad else None
        for t in ref_in
    ]

    def program():
        xs = [
            mt.from_global(t, shape, requires_grad=grad and t.is_floating_point(), name=f"in{i}")
            for i, (t, shape) in enumerate(inputs)
        ]
        y = mt_fn(*xs)
        if grad and probe is not None:
            p = mt.from_global(probe.to(y.dtype), y.shape)
            mt.reduce_sum(y * p).backward()
        grads = [x.grad.to_global() if x.grad is not None else None for x in xs]
        return y.to_global().detach(), grads

    outs = mt.launch(program, mesh=mesh, rules=rules)
    for rank, (y, grads) in enumerate(outs):
        where = f"processor {rank} of mesh '{mesh}' rules '{rules}'"
        assert y.shape == ref_out.shape, where
        if y.is_floating_point():
            torch.testing.assert_close(y, ref_out.detach().to(y.dtype), atol=atol, rtol=rtol,
                                       msg=lambda m, where=where: f"value on {where}: {m}")
        else:
            assert torch.equal(y, ref_out), where
        for i, (g, rg) in enumerate(zip(grads, ref_grads)):
            if rg is None:
                continue
            assert g is not None, f"no gradient for input {i} on {where}"
            torch.testing.assert_close(g, rg, atol=atol, rtol=rtol,
                                       msg=lambda m, i=i, where=where: f"grad of input {i} on {where}: {m}")
    return outs


def rand(*sizes: int, seed: int = 0, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*sizes, generator=g, dtype=torch.float64)
    return t.abs() + 0.5 if positive else t


def fwd_bwd_counts(make_inputs, op):
    """A program returning the comm counters of ``op``'s forward and of its backward (from a
    gradient of ones), as two dicts."""
    def prog():
        xs = make_inputs()
        mt.reset_comm_stats()
        y = op(*xs)
        fwd = mt.comm_stats().as_dict()
        mt.reset_comm_stats()
        y.backward(mt.ones(y.shape))
        return fwd, mt.comm_stats().as_dict()
    return prog


def aten_ops(fn) -> tuple[list[str], object]:
    """The ATen ops ``fn()`` runs, by overload name (``"add.Tensor"``), in order, and its result:
    what a fast path is held to (each op is a Python call into torch, paid cold between a model's
    large kernels)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        out = fn()
    return ops.names, out


@contextlib.contextmanager
def torch_mode_flags_kept():
    """torch's process-wide "a dispatch mode is active" flags put back at the block's end as they
    were at its start: dispatch modes entered and left on several threads at once (a FLOP counter
    in each thread-processor's program) leave them set after all have exited, for every later
    test on the worker."""
    from torch.utils import _python_dispatch as pd

    names = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
             "_is_in_any_mode_without_ignore_compile_internals")
    before = {n: getattr(pd, n) for n in names if hasattr(pd, n)}
    try:
        yield
    finally:
        for n, v in before.items():
            setattr(pd, n, v)
        setter = getattr(pd, "set_is_in_mode_without_ignore_compile_internals", None)
        if setter is not None and names[2] in before:
            setter(before[names[2]])  # (its C++ twin, which Dynamo reads)


class FailingBackward(torch.autograd.Function):
    """The identity (a copy), whose backward raises ``RuntimeError("backward failed on purpose")``
    where ``fail`` (per call: e.g. every processor's own flag); for tests of a backward that
    raises midway and the step after it."""

    @staticmethod
    def forward(ctx, t, fail):
        ctx.fail = fail
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.fail:
            raise RuntimeError("backward failed on purpose")
        return g, None
