"""Fused optimizer collectives: the values of reducing one by one, one all_reduce per axis a round.

Adafactor's statistics and the global gradient norm are many small reductions; reduced
together (``mt.Reductions``, ``lowering.fused``) they cost one collective per mesh axis,
reduce op and round. Checked against dense torch, against the same reductions run one by
one, against hand-derived counts, on threads and on gloo, and the planner's (meta
backend's) counts against a real step's communicator.
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, meshes, rules_for
from test_optim_training import dense_adafactor_step, dense_loss, initial_globals, make_model, mesh_loss

DIMS = ("p", "q", "r")
TORCH_REDUCE = {"sum": torch.sum, "mean": torch.mean,
                "max": lambda t, i: torch.amax(t, i), "min": lambda t, i: torch.amin(t, i)}
OP_OF = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


@st.composite
def reduction_batches(draw):
    mesh = draw(meshes(max_procs=4))
    rules = draw(rules_for(mesh, list(DIMS)))
    sizes = {d: draw(SIZES) for d in DIMS}
    items = []
    for _ in range(draw(st.integers(1, 5))):
        dims = draw(st.lists(st.sampled_from(DIMS), min_size=1, max_size=3, unique=True))
        kept = [d for d in DIMS if d in dims or draw(st.booleans())]  # the tensor's dims
        reduced = [d for d in kept if d in dims] or kept[:1]
        items.append((",".join(f"{d}:{sizes[d]}" for d in kept), reduced,
                      draw(st.sampled_from(sorted(TORCH_REDUCE))), draw(st.integers(0, 99))))
    return mesh, rules, items


def _global(shape: str, seed: int) -> torch.Tensor:
    sizes = [int(p.split(":")[1]) for p in shape.split(",")]
    return torch.randn(sizes, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _one_by_one_and_fused(items):
    xs = [mt.from_global(_global(shape, seed), shape) for shape, _, _, seed in items]
    single, alone = [], []
    for x, (_, dims, how, _) in zip(xs, items):
        mt.reset_comm_stats()
        y = getattr(mt, f"reduce_{how}")(x, dims)
        alone.append(mt.comm_stats().copy())
        single.append(y.to_global())
    mt.reset_comm_stats()
    batch = mt.Reductions()
    handles = [getattr(batch, how)(x, dims) for x, (_, dims, how, _) in zip(xs, items)]
    out = batch.run()
    fused_stats = mt.comm_stats().copy()
    return [out[h].to_global() for h in handles], single, alone, fused_stats


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reduction_batches())
def test_reductions_equal_dense_with_one_all_reduce_per_axis_and_op(case):
    mesh, rules, items = case
    for fused, single, alone, stats in mt.launch(_one_by_one_and_fused, items, mesh=mesh, rules=rules):
        for (shape, dims, how, seed), got, one in zip(items, fused, single):
            names = [p.split(":")[0] for p in shape.split(",")]
            want = TORCH_REDUCE[how](_global(shape, seed), [names.index(d) for d in dims])
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert torch.equal(got, one)  # the same reduction order as one by one
        # the analytic count: one all_reduce per (axis, reduce op) that any reduction needs
        needed = {(axes, OP_OF[how]) for s, (_, _, how, _) in zip(alone, items)
                  for axes in [tuple(k.split("@")[1].split(",")) for k in s.as_dict()
                               if k.startswith("all_reduce@")]}
        # (a dim split over several axes is reduced over their group in one call, counted there)
        groups = {axes for axes, _ in needed} | {(a,) for a in mt.Mesh(mesh).axis_names}
        for axes in groups:
            assert stats.calls(axes, "all_reduce") == len({op for g, op in needed if g == axes})
            # the same payload, in fewer calls; what is not an all_reduce is not fused
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                assert stats.bytes(axes, kind) == sum(s.bytes(axes, kind) for s in alone)
            assert stats.calls(axes, "reduce_scatter") == sum(s.calls(axes, "reduce_scatter") for s in alone)


# -------------------------------------------------------------- Adafactor and clipping
STEPS, CLIP = 3, 0.5
# (mesh, rules, all_reduces per step on b, on m): hand-derived below
CASES = [
    # d_ff on m: every statistic of 0.kernel, 0.bias and 2.kernel is reduced over m, nothing over b.
    # One call for the gradient norm, one for the scales and moment factors, one for update clipping.
    ("b:2,m:2", "batch:b; d_ff:m", 0, 3),
    # 0.kernel's d_in on b, 2.kernel's and 2.bias's cls on m: each axis has a share of every round.
    ("b:2,m:2", "d_in:b; cls:m", 3, 3),
    # both kernels split on b (on different dims): their statistics share each round's call
    ("b:2", "d_in:b; cls:b", 3, 0),
]


def adafactor_program():
    """3 clipped Adafactor steps; the parameters and the optimizer part's collectives per step."""
    model = make_model()
    opt = mt.optim.Adafactor(model, lr=1e-1, beta1=0.9, min_dim_size_to_factor=4, weight_decay=0.1)
    per_step = []
    for step in range(STEPS):
        opt.zero_grad()
        mesh_loss(model, step).backward()
        mt.reset_comm_stats()
        mt.optim.clip_grad_norm_(model, CLIP)
        opt.step()
        per_step.append(mt.comm_stats().as_dict())
    return {n: p.to_global().detach() for n, p in model.named_mesh_parameters()}, per_step


def dense_adafactor() -> dict[str, torch.Tensor]:
    params = {n: t.clone().requires_grad_(True) for n, t in initial_globals().items()}
    states = {n: {} for n in params}
    for step in range(STEPS):
        for p in params.values():
            p.grad = None
        dense_loss(params, step).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        with torch.no_grad():
            for n, p in params.items():
                dense_adafactor_step(p, p.grad, states[n], step + 1)
    return {n: p.detach() for n, p in params.items()}


def check_adafactor_runs(per_proc, calls_b: int, calls_m: int) -> None:
    want = dense_adafactor()
    for params, per_step in per_proc:
        for n, p in want.items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=n)
        for counts in per_step:
            assert {k: v["calls"] for k, v in counts.items()} == {
                k: c for k, c in {"all_reduce@b": calls_b, "all_reduce@m": calls_m}.items() if c}


def test_adafactor_and_clipping_equal_dense_with_the_analytic_calls_per_step():
    for mesh, rules, calls_b, calls_m in CASES:
        check_adafactor_runs(mt.launch(adafactor_program, mesh=mesh, rules=rules), calls_b, calls_m)


def test_adafactor_calls_do_not_grow_with_the_number_of_parameters():
    """12 layers' worth of parameters split over m: still 3 all_reduces a step (was 1 + 5 per
    parameter split on m, one by one)."""
    def run():
        d, h = mt.Dim("d", 8), mt.Dim("h", 16)
        model = mt.nn.Sequential(*[mt.nn.Dense(d, h) if i % 2 == 0 else mt.nn.Dense(h, d)
                                   for i in range(12)])
        opt = mt.optim.Adafactor(model, lr=1e-2, min_dim_size_to_factor=4)
        mt.reduce_sum(model(mt.ones("batch:2,d:8"))).backward()
        mt.reset_comm_stats()
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        return mt.comm_stats().calls(), mt.comm_stats().calls("m", "all_reduce")

    for total, on_m in mt.launch(run, mesh="m:2", rules="h:m"):
        assert (total, on_m) == (3, 3)


def _torch_backend_available() -> bool:
    import importlib

    return "torch" in getattr(importlib.import_module("meshtorch.launcher"), "BACKENDS", ())


def test_adafactor_fused_on_two_gloo_processes():
    """One spawn of 2 gloo processes: the same values and calls per step as the threads backend."""
    if not _torch_backend_available():
        import pytest

        pytest.skip("the torch.distributed (gloo) backend of mt.launch is not available")
    mesh, rules, calls_b, calls_m = CASES[2]
    per_proc = mt.launch(adafactor_program, mesh=mesh, rules=rules, backend="torch", nprocs=2)
    assert len(per_proc) == 2
    check_adafactor_runs(per_proc, calls_b, calls_m)


# -------------------------------------------------------------- the planner sees the fused calls
def planned_step():
    """A warm-up step, then one measured clipped Adafactor step; the step's own counts."""
    model = make_model()
    opt = mt.optim.Adafactor(model, lr=1e-1, beta1=0.9, min_dim_size_to_factor=4)
    for step in range(2):
        opt.zero_grad()
        mesh_loss(model, step).backward()
        mt.reset_comm_stats()
        with mt.plan.measure() if step else contextlib.nullcontext():
            mt.optim.clip_grad_norm_(model, CLIP)
            opt.step()
    return mt.comm_stats().as_dict()


def test_planned_optimizer_calls_and_bytes_equal_a_real_step():
    for mesh, rules, calls_b, calls_m in CASES:
        real = mt.launch(planned_step, mesh=mesh, rules=rules)[0]  # the communicator alone, no tracer
        est = mt.plan.estimate(planned_step, mesh, rules, device="a100")
        planned = {f"{kind}@{axes}": {"calls": est.calls_per_axis[axes][kind], "bytes": b}
                   for axes, kinds in est.bytes_per_axis.items() for kind, b in kinds.items()}
        assert planned == real
        assert {k: v["calls"] for k, v in real.items()} == {
            k: c for k, c in {"all_reduce@b": calls_b, "all_reduce@m": calls_m}.items() if c}
