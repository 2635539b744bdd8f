"""The meta-kernel memo changes no trace: every field of a trace with it equals the trace without
it (the meta kernels run every time), for drawn models, optimizers, precisions, meshes and rules,
and for a pipeline's stage traces; and it leaves alone what it must not answer from memory."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh_harness import meshes, rules_for
from meshtorch.plan import shape_memo, trace
from meshtorch.plan.pipeline import stage_traces
from meshtorch.recipes.lm import TrainConfig, model_dims
from meshtorch.recipes.lm.steps import pipelined_training_step, training_step

VOCAB = 16
BASE = TrainConfig.of(batch=4, length=8, d_model=8, heads=4, d_kv=4, d_ff=16, layers=2, encoder_layers=1,
                      experts=4, top_k=2)


def fields(t) -> tuple:
    return (t.parameters, t.flops, t.flops_by_dtype, t.comm.as_dict(), t.peak_bytes, t.peak_by_kind,
            [str(op) for op in t.ops], t.flop_ops, t.param_shapes, t.start_by_kind, t.aten_ops)


@given(data=st.data(), model=st.sampled_from(["lm", "seq2seq", "moe"]),
       optimizer=st.sampled_from(["adamw", "adafactor"]), precision=st.sampled_from(["fp32", "bf16"]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_trace_with_the_memo_equals_one_without(data, model, optimizer, precision):
    cfg = BASE.replace(model=model, optimizer=optimizer, precision=precision)
    mesh = data.draw(meshes(max_procs=4))
    rules = data.draw(rules_for(mesh, sorted(set(model_dims(cfg, VOCAB)) - {"memory_length", "positions"})))
    step = training_step(cfg, VOCAB)
    with shape_memo.enabled(False):
        plain = trace(step, mesh=mesh, rules=rules)
    first = trace(step, mesh=mesh, rules=rules)   # fills the memo (if an earlier example did not)
    again = trace(step, mesh=mesh, rules=rules)   # answered from it
    assert fields(first) == fields(plain) == fields(again), (mesh, rules)
    assert plain.flops > 0


def test_pipeline_stage_traces_with_the_memo_equal_those_without():
    cfg = BASE.replace(layers=2, batch=8, microbatches=4, schedule="1f1b")
    step = pipelined_training_step(cfg, VOCAB)
    with shape_memo.enabled(False):
        plain = stage_traces(step, "stage:2,b:2", "batch:b")
    memo = stage_traces(step, "stage:2,b:2", "batch:b")
    assert [fields(t) for t in memo] == [fields(t) for t in plain]
    assert plain[0].comm.calls("stage", "send") > 0


def test_the_memo_runs_what_it_must_not_answer():
    x = torch.empty(3, 4, device="meta")
    aten = torch.ops.aten
    # a view shares its input's storage; an in-place op returns its input
    v = shape_memo.run(aten.view.default, (x, [4, 3]), {})
    assert shape_memo.run(aten.view.default, (x, [4, 3]), {}).untyped_storage() is x.untyped_storage()
    assert v.untyped_storage() is x.untyped_storage()
    y = shape_memo.run(aten.mul_.Tensor, (x, x), {})
    assert shape_memo.run(aten.mul_.Tensor, (x, x), {}) is x and y is x
    # values of host tensors matter: never answered from memory
    c = torch.tensor([2.0])
    assert shape_memo.run(aten.add.Tensor, (c, c), {}).item() == 4.0
    assert shape_memo.run(aten.add.Tensor, (c, torch.tensor([5.0])), {}).item() == 7.0
    # the same op on an int and a float scalar: different dtypes, different keys
    i = torch.empty(2, dtype=torch.int64, device="meta")
    assert shape_memo.run(aten.mul.Scalar, (i, 2.0), {}).dtype == torch.float32
    assert shape_memo.run(aten.mul.Scalar, (i, 2), {}).dtype == torch.int64
    # a non-contiguous input keeps its output strides (as the kernel gives them)
    t = x.t()
    for _ in range(2):
        assert shape_memo.run(aten.mul.Tensor, (t, 2.0), {}).stride() == (t * 2.0).stride() == (1, 4)
