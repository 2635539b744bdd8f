"""Mesh-TensorFlow's lazy all-reduce for parameters: a parameter used by several ops (a tied
embedding table: the lookup and the output layer) has its gradient summed locally and reduced
once per axis group, not once per use.

Hand derivation (data parallelism, ``batch:b``, every parameter replicated on ``b``): every op of
the LM varies along ``b`` (its activations split ``batch``), so every parameter's gradient is a
partial sum over ``b``, all-reduced once; the only other all_reduce over ``b`` is the loss's mean
over ``batch`` (one float32 scalar). A step therefore does ``P + 1`` all_reduces over ``b``
moving ``sum(parameter slice bytes) + 4`` bytes, where ``P`` counts distinct parameters: the tied
table once (Mesh-TF sums its two LazyAllreduceSum gradients before realising them). Rotary
positions keep a position table (whose gradient is reduced as the activation it adds, not as a
parameter) out of the count. Other axes (``m``) hold the heads, d_ff or vocab splits; they
never add a ``b`` reduction.

Counts are a real threads or gloo step's, taken by the communicator alone; gradients are
compared with the same model run on one processor, where every op is the dense torch op.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.plan import measure

BATCH, LENGTH = 4, 6


def config(tie: bool) -> TransformerConfig:
    return TransformerConfig(vocab=32, d_model=8, heads=4, d_kv=2, d_ff=16, layers=1, max_length=LENGTH,
                             tie_embeddings=tie, positions="rotary")


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 32, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def step(model: DecoderLM, seed: int) -> None:
    ids, targets = batch(seed)
    shape = f"batch:{BATCH},length:{LENGTH}"
    model.loss(mt.from_global(ids, shape), mt.from_global(targets, shape)).backward()


def grads(model: DecoderLM) -> dict[str, torch.Tensor]:
    return {n: t.grad.to_global() for n, t in model.named_mesh_parameters()}


def counted(tie: bool):
    """An SPMD program (bind ``tie`` with :func:`counted_step`): one forward and backward of the
    LM; per processor the ``b`` all_reduces (calls, bytes), those over groups holding ``b`` with
    another axis, the hand-derived ``(P + 1, parameter bytes + 4)``, the global gradients, and
    per adapter output the parameters keep, whether it is a view of the parameter."""
    model = DecoderLM(config(tie), seed=0)
    params = list(model.parameters())  # distinct: a tied table once
    before = mt.comm_stats().copy()
    with measure():
        step(model, seed=1)
    diff = mt.comm_stats() - before
    grouped = sum(v["calls"] for k, v in diff.as_dict().items()
                  if k.startswith("all_reduce@b,") or (k.startswith("all_reduce@") and ",b" in k))
    want = (len(params) + 1, sum(p.numel() * p.element_size() for p in params) + 4)
    kept = [e[3]._base is p for p in params for e in p._adapted.values()]  # (shared outputs)
    return (diff.calls("b", "all_reduce"), diff.bytes("b", "all_reduce")), grouped, want, grads(model), kept


def counted_step(tie: bool):
    """:func:`counted` for ``tie``, picklable (the torch backend starts fresh processes)."""
    return functools.partial(counted, tie)


@functools.cache
def reference(tie: bool) -> dict[str, torch.Tensor]:
    """The gradients on one processor (every op the dense torch op)."""
    ((_, _, _, g, _),) = mt.launch(counted_step(tie))
    return g


@st.composite
def data_parallel(draw) -> tuple[str, str]:
    """A mesh with a data axis ``b`` (2 or 4) and maybe a model axis ``m`` (2), and rules that
    split ``batch`` on ``b`` and any of heads, d_ff, vocab on ``m``."""
    b = draw(st.sampled_from([2, 4]))
    m = draw(st.sampled_from([1, 2]))
    rules = ["batch:b"]
    if m > 1:
        rules += [r for r in ("heads:m", "d_ff:m", "vocab:m") if draw(st.booleans())]
    return (f"b:{b},m:{m}" if m > 1 else f"b:{b}"), "; ".join(rules)


@given(layout=data_parallel(), tie=st.booleans())
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_each_parameter_gradient_is_reduced_once(layout, tie):
    mesh, rules = layout
    ref = reference(tie)
    for (got, grouped, want, g, kept) in mt.launch(counted_step(tie), mesh=mesh, rules=rules):
        assert got == want, (mesh, rules, tie)
        assert grouped == 0
        assert kept == [True] * len(g)  # one shared identity per parameter: a view, never a copy
        assert g.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(g[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_tied_table_is_one_reduction_where_untied_is_two():
    """The tied table's two uses cost one all_reduce of the vocab×d_model gradient; untying adds
    the output layer's kernel (same size) as a parameter of its own, reduced once too."""
    mesh, rules = "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"
    (tied, _, _, _, _), *_ = mt.launch(counted_step(True), mesh=mesh, rules=rules)
    (untied, _, _, _, _), *_ = mt.launch(counted_step(False), mesh=mesh, rules=rules)
    table = 32 // 2 * 8 * 4  # vocab split on m, d_model whole, float32
    assert (untied[0] - tied[0], untied[1] - tied[1]) == (1, table)
    # 13 parameters: table, 2 norms x (scale, bias) in the block, q, k, v, o, wi, wo, the final
    # norm's scale and bias; plus the loss
    assert tied[0] == 13 + 1


def test_the_planner_counts_one_reduction_per_parameter():
    """The meta backend runs the same lowering, so the plan predicts the single reduction."""
    mesh, rules = "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"
    (real, _, _, _, _), *_ = mt.launch(counted_step(True), mesh=mesh, rules=rules)
    est = mt.plan.estimate(counted_step(True), mesh, rules, device="a100")
    assert (est.calls_per_axis["b"]["all_reduce"], est.bytes_per_axis["b"]["all_reduce"]) == real


@pytest.mark.timeout(180)
def test_gloo_processes_reduce_the_tied_table_once():
    out = mt.launch(counted_step(True), mesh="b:2", rules="batch:b", backend="torch", nprocs=2)
    ref = reference(True)
    for got, grouped, want, g, kept in out:
        assert (got, grouped, all(kept)) == (want, 0, True)
        for name in ref:
            torch.testing.assert_close(g[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def accumulated_training(microbatches: int = 2, steps: int = 2):
    """An SPMD program: ``steps`` SGD steps, each accumulating ``microbatches`` backwards, with
    an evaluation under ``no_grad`` between micro-batches; the ``b`` all_reduce calls of each
    backward and the final global parameters."""

    def program():
        model = DecoderLM(config(True), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        calls = []
        ids, _ = batch(9)
        for s in range(steps):
            opt.zero_grad()
            for k in range(microbatches):
                before = mt.comm_stats().calls("b", "all_reduce")
                step(model, seed=10 * s + k)
                calls.append(mt.comm_stats().calls("b", "all_reduce") - before)
                with torch.no_grad():  # shares nothing, disturbs nothing
                    model(mt.from_global(ids, f"batch:{BATCH},length:{LENGTH}"))
            opt.step()
        return calls, {n: t.to_global() for n, t in model.named_mesh_parameters()}

    return program


def test_micro_batches_and_steps_accumulate_exact_gradients():
    """Each backward reduces each parameter once (P + 1 = 14 calls); the accumulated gradients
    and two SGD steps give the one-processor parameters."""
    ((_, ref),) = mt.launch(accumulated_training())
    for calls, params in mt.launch(accumulated_training(), mesh="b:2,m:2", rules="batch:b; vocab:m; heads:m"):
        assert calls == [14] * 4
        for name in ref:  # (float32 sums in another order, amplified by the steps)
            torch.testing.assert_close(params[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp_rules_keep_no_gathered_copy():
    """Under ``batch:b; d_model:b`` every parameter is split on b: gathered forward,
    reduce_scattered backward. The tied table's lookup runs on its own d_model slice (no
    collective on the table), its output layer gathers it: one reduce_scatter per parameter.
    No parameter keeps a gathered copy (which would stay alive through the step, and through
    a recomputed block's forward)."""
    ref = reference(True)

    def program():
        out = counted(True)
        return out[3], out[4], mt.comm_stats().calls("b", "reduce_scatter")

    for g, kept, scatters in mt.launch(program, mesh="b:2", rules="batch:b; d_model:b"):
        assert (scatters, kept) == (13, [])
        for name in ref:
            torch.testing.assert_close(g[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def converted(dtype: torch.dtype):
    """An SPMD program: a step, the model converted to ``dtype`` (``module.to`` swaps each
    parameter's storage without an in-place update), another step; its gradients."""
    model = DecoderLM(config(True), seed=0)
    step(model, seed=1)
    model.to(dtype)
    model.zero_grad()
    step(model, seed=2)
    return {n: t.grad.to_global() for n, t in model.named_mesh_parameters()}


def test_a_converted_model_adapts_its_new_storage():
    ((ref),) = mt.launch(functools.partial(converted, torch.float64))
    for g in mt.launch(functools.partial(converted, torch.float64), mesh="b:2", rules="batch:b"):
        for name in ref:
            assert g[name].dtype == torch.float64
            torch.testing.assert_close(g[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
