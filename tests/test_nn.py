"""mt.nn: layout-invariant parameters, layers against dense torch, module bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt

V, D, H, B = mt.Dim("vocab", 8), mt.Dim("d", 4), mt.Dim("h", 8), mt.Dim("batch", 4)


def build():
    return mt.nn.Sequential(mt.nn.Embedding(V, D), mt.nn.LayerNorm(D), mt.nn.Dense(D, H), mt.gelu,
                            mt.nn.RMSNorm(H), mt.nn.Dense(H, V))


def globals_of(model):
    return {n: v.to_global().detach().clone() for n, v in model.named_mesh_parameters()}


ONE = globals_of(build())

MESH_RULES = st.sampled_from([
    ("b:2,m:2", "batch:b; vocab:m; h:m"),
    ("b:2,m:2", "d:b; h:m"),
    ("m:4", "vocab:m; h:m"),
    ("x:2,y:2", "h:x; vocab:y; d:x"),
    ("b:4", "batch:b; h:b"),
])


@settings(max_examples=5, deadline=None)
@given(MESH_RULES)
def test_model_is_the_same_on_any_mesh_and_forward_matches_dense(mesh_rules):
    mesh, rules = mesh_rules
    ids = torch.tensor([3, 0, 7, 3])

    def run():
        model = build()
        out = model(mt.from_global(ids, [B]))
        return globals_of(model), out.to_global(), model.num_parameters()

    # dense torch on the same global parameters
    p = ONE
    x = p["0.table"][ids]
    x = F.layer_norm(x, (4,), p["1.weight"], p["1.bias"], 1e-5)
    x = F.gelu(x @ p["2.kernel"] + p["2.bias"])
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * p["4.weight"]
    want = x @ p["5.kernel"] + p["5.bias"]
    for params, out, n in mt.launch(run, mesh=mesh, rules=rules):
        for k in ONE:
            assert torch.equal(params[k], ONE[k]), k  # bitwise the same model
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert n == 8 * 4 + 4 + 4 + 4 * 8 + 8 + 8 + 8 * 8 + 8


def test_parameter_streams_are_paths_and_init_statistics():
    # different paths → different values; the value is a pure function of (seed, path)
    a = mt.nn.Dense(D, H)
    wrapped = mt.nn.Sequential(mt.nn.Dense(D, H))
    assert not torch.equal(a.kernel, wrapped[0].kernel)  # stream "kernel" vs "0.kernel"
    assert torch.equal(wrapped[0].kernel, mt.random.kaiming_normal(
        "d:4,h:8", fan_in=["d"], gain=1.0, seed=0, stream="0.kernel").local)
    # a deeper tree re-derives its streams when attached
    outer = mt.nn.Sequential(mt.nn.LayerNorm(D), wrapped)
    assert torch.equal(outer[1][0].kernel, mt.random.kaiming_normal(
        "d:4,h:8", fan_in=["d"], gain=1.0, seed=0, stream="1.0.kernel").local)
    assert [n for n, _ in outer.named_parameters()] == ["0.weight", "0.bias", "1.0.kernel", "1.0.bias"]
    # reset_parameters(seed) changes the values; LeCun normal has std 1/sqrt(fan_in)
    big = mt.nn.Dense(mt.Dim("i", 256), mt.Dim("o", 256), bias=False)
    k0 = big.kernel.detach().clone()
    big.reset_parameters(seed=1)
    assert not torch.equal(k0, big.kernel)
    assert math.isclose(big.kernel.std().item(), 1 / 16, rel_tol=0.02)


def test_layers_reject_bad_inputs_with_clear_errors():
    with pytest.raises(mt.errors.ShapeError, match="Dense expects dim d:4"):
        mt.nn.Dense(D, H)(mt.ones("batch:2,e:4"))
    with pytest.raises(mt.errors.ShapeError, match="in_dims must be a Dim"):
        mt.nn.Dense("d", H)
    with pytest.raises(mt.errors.ShapeError, match="unknown initializer 'nope'"):
        mt.nn.Dense(D, H, init="nope")
    with pytest.raises(mt.errors.ArgumentError, match="Dropout rate"):
        mt.nn.Dropout(1.0)
    with pytest.raises(mt.errors.ShapeError, match="initializer of parameter 'kernel' returned shape"):
        mt.nn.Dense(D, H, init=lambda s, seed, st: mt.zeros("d:4")).kernel.materialize()


def test_embedding_with_split_vocab_trains_like_torch_embedding():
    ids = torch.tensor([1, 5, 5, 7])

    def run():
        emb = mt.nn.Embedding(V, D)
        out = emb(mt.from_global(ids, [B]))
        logits = emb.attend(out)
        mt.reduce_sum(logits * logits).backward()
        return out.to_global(), emb.table.mesh_tensor.grad.to_global()

    table = mt.nn.Embedding(V, D).table.detach().clone().requires_grad_(True)
    out = table[ids]
    (out @ table.T).pow(2).sum().backward()
    for got, grad in mt.launch(run, mesh="m:4", rules="vocab:m"):
        torch.testing.assert_close(got, out.detach())
        torch.testing.assert_close(grad, table.grad, rtol=1e-5, atol=1e-5)


def test_dropout_module_is_layout_invariant_and_differs_per_call():
    def run():
        drop = mt.nn.Dropout(0.5)
        x = mt.ones("batch:4,h:8")
        a, b = drop(x).to_global(), drop(x).to_global()
        return a, b, drop.eval()(x).to_global()

    ref = mt.launch(run)[0]
    assert not torch.equal(ref[0], ref[1])
    assert set(ref[0].unique().tolist()) == {0.0, 2.0}
    assert torch.equal(ref[2], torch.ones(4, 8))
    for got in mt.launch(run, mesh="b:2,m:2", rules="batch:b; h:m"):
        assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_plain_torch_submodules_are_counted_as_replicated():
    class Mixed(mt.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = mt.nn.Dense(D, H)
            self.extra = torch.nn.Linear(3, 2)

    m = Mixed()
    views = dict(m.named_mesh_parameters())
    assert str(views["extra.weight"].shape) == "extra_weight_dim0:2,extra_weight_dim1:3"
    assert m.num_parameters() == 4 * 8 + 8 + 3 * 2 + 2


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_dropout_layer_rejects_rate_outside_half_open_interval(rate):
    with pytest.raises(mt.errors.ArgumentError, match=rf"Dropout rate={rate} is outside \[0, 1\)"):
        mt.nn.Dropout(rate)
