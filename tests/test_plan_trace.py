"""The planner's trace on meta tensors equals a real threads-backend step.

Collective calls and bytes per axis and kind must *equal* those of a real
step counted by the communicator alone (``mt.comm_stats()`` around the step,
no tracer); FLOPs equal the real step's (``torch.utils.flop_counter``); the
memory peak within 10% of the tracer's on real tensors; parameter, gradient
and optimizer bytes equal to what the model's slices hold.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import meshes, rules_for
from meshtorch.plan import trace
from meshtorch.recipes.lm import TrainConfig, model_dims
from meshtorch.recipes.lm.steps import prepare, training_step

VOCAB = 16
BASE = TrainConfig.of(batch=4, length=8, d_model=8, heads=4, d_kv=4, d_ff=16, layers=2, encoder_layers=1,
                   experts=4, top_k=2)


def config(model: str, optimizer: str = "adamw") -> TrainConfig:
    return BASE.replace(model=model, optimizer=optimizer)


def communicator_counts(cfg: TrainConfig, mesh: str, rules: str) -> dict:
    """Collectives of one real steady-state step on the threads backend, as the communicator
    counts them: no tracer, no measure() block; the warm-up before it is not part of it."""

    def program() -> dict:
        step, batch = prepare(cfg, VOCAB)
        before = mt.comm_stats().copy()
        step.run([batch], 1)
        return (mt.comm_stats() - before).as_dict()

    return mt.launch(program, mesh=mesh, rules=rules, backend="threads")[0]


def both(cfg: TrainConfig, mesh: str, rules: str):
    real = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, backend="threads")
    meta = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules, backend="meta")
    return real, meta


@given(data=st.data(), model=st.sampled_from(["lm", "seq2seq", "moe"]),
       optimizer=st.sampled_from(["adamw", "adafactor"]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_meta_trace_bytes_and_flops_equal_a_real_step(data, model, optimizer):
    cfg = config(model, optimizer)
    mesh = data.draw(meshes(max_procs=4))
    # the dims the layout rules of this test split (not the attention keys or position table)
    rules = data.draw(rules_for(mesh, sorted(set(model_dims(cfg, VOCAB)) - {"memory_length", "positions"})))
    real, meta = both(cfg, mesh, rules)
    assert meta.comm.as_dict() == communicator_counts(cfg, mesh, rules), (mesh, rules)
    assert meta.flops == real.flops > 0
    assert meta.result["parameters"] == real.result["parameters"]
    assert meta.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10), (mesh, rules)


@pytest.mark.parametrize("model, mesh, rules, overlap", [
    ("lm", "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m", True),
    ("moe", "b:2,m:2", "batch:b; experts:b; d_ff:m", True),
    # under mt.overlap too: a reduce_scatter bucket's gradients are views of its flat result,
    # which is exactly their bytes
    ("seq2seq", "b:4", "batch:b; d_model:b", True),
])
def test_memory_by_kind_matches_the_slices(model, mesh, rules, overlap):
    cfg = config(model).replace(overlap=overlap)

    def slice_bytes():
        from meshtorch.recipes.lm.steps import build_model
        m = build_model(cfg, VOCAB)
        return sum(p.numel() * p.element_size() for p in m.parameters())

    local, = mt.launch(slice_bytes, mesh=mesh, rules=rules, backend="meta")
    real, meta = both(cfg, mesh, rules)
    for t in (real, meta):
        assert t.peak_by_kind["parameters"] == local
        # the step before's, alive as the step begins, freed by zero_grad before the forward: the
        # peak (the forward's values as backward starts) comes before backward makes the first one
        assert t.start_by_kind["gradients"] == local
        assert t.peak_by_kind["gradients"] == 0
        assert t.peak_by_kind["optimizer"] >= 2 * local  # AdamW's two moments (+ step counters)
        assert t.peak_by_kind["activations"] > 0
        assert sum(t.peak_by_kind.values()) == t.peak_bytes
    assert meta.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10)


@pytest.mark.parametrize("model, mesh, rules", [
    ("lm", "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"),
    ("moe", "b:2,m:2", "batch:b; experts:b; d_ff:m"),
])
def test_the_warm_up_is_not_counted(model, mesh, rules):
    # Adafactor's warm-up step all-reduces its factored moments over m: a trace that counted it
    # would report more model-axis calls than the step makes
    cfg = config(model, "adafactor")
    want = communicator_counts(cfg, mesh, rules)
    assert any(key.endswith("@m") for key in want)
    got = trace(training_step(cfg, VOCAB), mesh=mesh, rules=rules)
    assert got.comm.as_dict() == want


def test_trace_names_the_dims_of_every_mesh_tensor():
    cfg = config("lm")
    t = trace(training_step(cfg, VOCAB), mesh="b:2,m:2", rules="batch:b; d_ff:m")
    ffn = [op for op in t.ops if "d_ff:16" in op.shape and "batch:4" in op.shape]
    assert ffn and all("d_ff:m" in op.layout and "batch:b" in op.layout for op in ffn)
    assert any(op.flops == 2 * 2 * 8 * 8 * 8 for op in ffn)  # [batch/2, length] x d_model x d_ff/2


def _phased_step():
    import torch

    from meshtorch.context import phase

    a, b = torch.ones(4, 8), torch.ones(8, 16)
    x = mt.random.normal("batch:8,d:4", seed=0)
    with mt.plan.measure():
        torch.mm(a, b)
        with phase("update"):
            torch.mm(b.T, a.T)
            mt.reduce_sum(x, output_shape=[])  # a sum over the split batch: one all_reduce over b
        with phase("update"):
            torch.add(a, 1)


def test_a_phase_counts_its_blocks_work_apart_and_in_the_totals():
    t = trace(_phased_step, mesh="b:2", rules="batch:b")
    up = t.phases["update"]
    assert up.flops_by_dtype == {"float32": 2 * 16 * 8 * 4}  # the second mm, hand-counted
    assert t.flops_by_dtype == {"float32": 2 * 2 * 16 * 8 * 4}
    assert up.comm.as_dict() == t.comm.as_dict() == {"all_reduce@b": {"calls": 1, "bytes": 4}}
    assert 3 <= up.aten_ops < t.aten_ops  # the mm, the sum's ops, the add; not the first mm
