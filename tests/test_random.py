"""Random tensors are bitwise the same global tensor on any mesh and rules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt

MESHES = [("", ""), ("b:2", "a:b"), ("b:2,m:2", "a:b; c:m"), ("b:2,m:2,e:2", "b_:b; c:m; a:e"),
          ("m:4", "c:m"), ("x:8", "a:x"), ("x:2,y:4", "c:x; a:y")]


@pytest.mark.parametrize("kind", ["uniform", "normal", "bernoulli", "xavier_uniform", "kaiming_normal"])
def test_same_seed_bitwise_equal_on_1_2_4_8_processors(kind):
    def prog():
        fn = getattr(mt.random, kind)
        return fn("a:8,b_:4,c:16", seed=1234).to_global()

    ref = mt.launch(prog)[0]
    for mesh, rules in MESHES:
        for t in mt.launch(prog, mesh=mesh, rules=rules):
            assert torch.equal(t, ref), (kind, mesh, rules)


@given(seed=st.integers(0, 2**40), stream=st.one_of(st.integers(0, 99), st.text(max_size=5)))
@settings(max_examples=15, deadline=None)
def test_any_seed_and_stream_layout_invariant(seed, stream):
    def prog():
        return mt.random.normal("a:4,c:8", seed=seed, stream=stream, dtype=torch.float64).to_global()

    ref = mt.launch(prog)[0]
    for t in mt.launch(prog, mesh="x:2,y:2", rules="a:y; c:x"):
        assert torch.equal(t, ref)


def test_distribution_moments_and_independence():
    u = mt.random.uniform("a:200000", seed=7, dtype=torch.float64).to_global()
    n = mt.random.normal("a:200000", seed=7, dtype=torch.float64).to_global()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert abs(n.mean().item()) < 0.01 and abs(n.std().item() - 1) < 0.01
    # neighbours uncorrelated; other seeds and streams differ
    assert abs(torch.corrcoef(torch.stack([n[:-1], n[1:]]))[0, 1].item()) < 0.01
    assert not torch.equal(n, mt.random.normal("a:200000", seed=8, dtype=torch.float64).to_global())
    other = mt.random.normal("a:200000", seed=7, stream="x", dtype=torch.float64).to_global()
    assert abs(torch.corrcoef(torch.stack([n, other]))[0, 1].item()) < 0.01


def test_requires_grad_leaf():
    w = mt.random.normal("a:3", seed=0, requires_grad=True)
    assert w.requires_grad and w.local.is_leaf


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_bernoulli_rejects_probability_outside_unit_interval(p):
    with pytest.raises(mt.errors.ArgumentError, match=rf"bernoulli: p={p} is outside \[0, 1\]"):
        mt.random.bernoulli("a:4", p, seed=0)


@pytest.mark.parametrize("rate", [-0.5, 1.0])
def test_dropout_rejects_rate_outside_half_open_interval(rate):
    with pytest.raises(mt.errors.ArgumentError, match=rf"dropout: rate={rate} is outside \[0, 1\)"):
        mt.dropout(mt.ones("t:4"), rate, seed=0)


@given(seed=st.integers(0, 2**40), stream=st.one_of(st.integers(0, 99), st.text(max_size=5)))
@settings(max_examples=5, deadline=None)
def test_uniform_whole_is_the_laid_out_uniform_made_whole_without_communication(seed, stream):
    def prog():
        laid_out = mt.random.uniform("a:4,c:8", seed=seed, stream=stream, dtype=torch.float64).to_global()
        mt.reset_comm_stats()
        whole = mt.random.uniform_whole("a:4,c:8", seed=seed, stream=stream)
        return torch.equal(whole, laid_out), mt.comm_stats().bytes(), whole.device.type

    assert mt.launch(prog, mesh="x:2,y:2", rules="a:y; c:x") == [(True, 0, "cpu")] * 4
