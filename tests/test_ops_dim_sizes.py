"""A dim argument given as a ``Dim`` is that dim, size and all: ops refuse one whose size differs
from the tensor's (they matched it by name and ignored its size), and take one of the right size
as they take its name. Dims an op makes (a new size) are not checked against the operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import rand
from meshtorch.errors import ShapeError
from meshtorch.shape import Dim, Shape

# op -> (the call with the dim argument ``d`` of x [batch, d], the dense reference over t)
_OPS = {
    "reduce_sum": (lambda x, d: mt.reduce_sum(x, d), lambda t: t.sum(1)),
    "reduce_max": (lambda x, d: mt.reduce_max(x, output_shape=[d]), lambda t: t.amax(0)),
    "softmax": (lambda x, d: mt.softmax(x, d), lambda t: torch.softmax(t, 1)),
    "log_softmax": (lambda x, d: mt.log_softmax(x, d), lambda t: torch.log_softmax(t, 1)),
    "layer_norm": (lambda x, d: mt.layer_norm(x, d), lambda t: F.layer_norm(t, t.shape[1:])),
    "cumsum": (lambda x, d: mt.cumsum(x, d), lambda t: t.cumsum(1)),
    "argmax": (lambda x, d: mt.argmax(x, d), lambda t: t.argmax(1)),
    "slice": (lambda x, d: mt.slice(x, d, 1, 1), lambda t: t[:, 1:2]),
    "split": (lambda x, d: mt.split(x, d, 1)[0], lambda t: t),
    "transpose": (lambda x, d: mt.transpose(x, [d, "batch"]), lambda t: t.T),
    "einsum": (lambda x, d: mt.einsum(x, output_shape=[d]), lambda t: t.sum(0)),
    "cross_entropy": (lambda x, d: mt.cross_entropy(x, mt.zeros("batch:3", dtype=torch.long), d),
                      lambda t: -torch.log_softmax(t, 1)[:, 0]),
}


@settings(max_examples=15, deadline=None)
@given(op=st.sampled_from(sorted(_OPS)), n=st.integers(2, 6), wrong=st.integers(0, 9), seed=st.integers(0, 9))
def test_a_dim_of_another_size_raises_naming_the_op_dim_sizes_and_tensor(op, n, wrong, seed):
    wrong += wrong >= n  # any size but n
    call, ref = _OPS[op]
    t = rand(3, n, seed=seed)
    x = mt.from_global(t, f"batch:3,d:{n}")
    right = call(x, Dim("d", n))  # first: a plan made for it (einsum's, cached) must not pass the wrong one
    if ref is not None:
        torch.testing.assert_close(right.to_global(), ref(t))
    torch.testing.assert_close(right.to_global(), call(x, "d").to_global())  # a Dim is its name
    with pytest.raises(ShapeError) as e:
        call(x, Dim("d", wrong))
    msg = str(e.value)
    assert msg.startswith(f"{op}: dim d:{wrong} has size {wrong}, but 'd' is {n} in ")
    assert f"[batch:3,d:{n}]" in msg and f"Dim('d', {n})" in msg
    x.name = "h"  # a tensor with a name of its own is named by it
    with pytest.raises(ShapeError, match=f"'d' is {n} in tensor 'h' "):
        call(x, Dim("d", wrong))


@settings(max_examples=10, deadline=None)
@given(which=st.sampled_from(["dim", "memory", "features", "heads", "kv_heads"]), wrong=st.integers(1, 9))
def test_attention_refuses_a_dim_of_another_size_after_its_plan_is_kept(which, wrong):
    sizes = {"dim": ("length", 4), "memory": ("memory_length", 5), "features": ("d_kv", 8),
             "heads": ("heads", 2), "kv_heads": ("heads", 2)}
    name, size = sizes[which]
    wrong += wrong >= size
    q = mt.random.normal("batch:1,length:4,heads:2,d_kv:8", seed=0)
    k, v = (mt.random.normal("batch:1,memory_length:5,heads:2,d_kv:8", seed=s) for s in (1, 2))
    ref = mt.attention(q, k, v).to_global()
    # the plan kept for the names is not the one a Dim of the right size makes, nor a wrong one
    torch.testing.assert_close(mt.attention(q, k, v, **{which: Dim(name, size)}).to_global(), ref)
    with pytest.raises(ShapeError, match=rf"^attention: dim {name}:{wrong} has size {wrong}, but "
                                         rf"'{name}' is {size} in the (queries|keys) \["):
        mt.attention(q, k, v, **{which: Dim(name, wrong)})


@pytest.mark.parametrize("op", ["ring_attention", "local_attention"])
def test_sequence_attentions_refuse_a_dim_of_another_size(op):
    q, k, v = (mt.random.normal("batch:1,length:4,d_kv:8", seed=s) for s in range(3))
    fn = (lambda **kw: mt.ring_attention(q, k, v, **kw)) if op == "ring_attention" else (
        lambda **kw: mt.local_attention(q, k, v, 2, **kw))
    torch.testing.assert_close(fn(dim=Dim("length", 4), features=Dim("d_kv", 8)).to_global(),
                               fn().to_global())
    with pytest.raises(
            ShapeError, match=rf"^{op}: dim length:6 has size 6, but 'length' is 4 in the queries \["):
        fn(dim=Dim("length", 6))
    with pytest.raises(ShapeError, match=rf"^{op}: dim d_kv:4 has size 4"):
        fn(features=Dim("d_kv", 4))


def test_concat_takes_the_inputs_dim_or_the_results():
    a, b = mt.from_global(torch.arange(2.0), "t:2"), mt.from_global(torch.arange(3.0), "t:3")
    assert mt.concat([a, b], Dim("t", 5)).to_global().tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert mt.concat([a, a], Dim("t", 2)).shape == Shape("t:4")  # every input's dim
    with pytest.raises(ShapeError, match=r"^concat: dim t:2 has size 2, but 't' is 5 in the result \[t:5\]"):
        mt.concat([a, b], Dim("t", 2))  # one input's size, not the other's


def test_other_dim_arguments_of_an_op_are_checked_where_the_tensor_has_them():
    x = mt.from_global(rand(2, 3, 4), "b:2,h:3,w:4")
    k = mt.from_global(rand(2, 2, 5), "kh:2,b:2,c:5")
    with pytest.raises(ShapeError, match=r"^conv1d: dim kh:3 has size 3, but 'kh' is 2 in the kernel"):
        mt.conv1d(x, k, dims="h", kernel_dims=Dim("kh", 3))
    with pytest.raises(ShapeError, match=r"^max_pool: dim w:5 has size 5, but 'w' is 4 in the input"):
        mt.max_pool(x, Dim("w", 5), 2)
    with pytest.raises(ShapeError, match=r"^rename: dim h:4"):
        mt.rename(x, Dim("h", 4), "g")
    with pytest.raises(ShapeError, match=r"^slicewise: whole dim w:3 has size 3, but 'w' is 4 in the"):
        mt.slicewise(lambda t: t, x, whole=[Dim("w", 3)])
    # a function may resize a dim it takes whole (an FFT): a Dim of the operands' or the output's size
    for w in (Dim("w", 4), Dim("w", 3), "w"):
        y = mt.slicewise(lambda t: torch.fft.rfft(t, dim=2).real, x, output_shape="b:2,h:3,w:3", whole=[w])
        torch.testing.assert_close(y.to_global(), torch.fft.rfft(x.to_global(), dim=2).real)
    with pytest.raises(ShapeError, match=r"^embedding: dim h:2 has size 2, but 'h' is 3 in the table"):
        mt.embedding(x, mt.from_global(torch.tensor([0, 1]), "i:2"), Dim("h", 2))
    with pytest.raises(ShapeError, match=r"^dropout's noise_shape: dim w:5"):
        mt.dropout(x, 0.5, seed=0, noise_shape=[Dim("w", 5)])
    with pytest.raises(ShapeError, match=r"^xavier_uniform: dim h:9"):
        mt.random.xavier_uniform("h:3,w:4", fan_in=[Dim("h", 9)])


def test_a_shape_looks_up_a_dim_by_name_and_size():
    s = Shape("a:2,b:3")
    assert s.index(Dim("b", 3)) == 1 and s[Dim("b", 3)] == Dim("b", 3) and Dim("b", 4) not in s
    with pytest.raises(ShapeError, match=r"^dim b:4 has size 4, but 'b' is 3 in the shape \[a:2,b:3\]"):
        s.index(Dim("b", 4))
    with pytest.raises(ShapeError, match="dim b:4"):
        s.without([Dim("b", 4)])


def test_dims_an_op_makes_take_their_new_size():
    ids = mt.from_global(torch.tensor([1, 0]), "b:2")
    assert mt.one_hot(ids, Dim("v", 3)).shape == Shape("b:2,v:3")
    assert mt.range(Dim("t", 4)).to_global().tolist() == [0, 1, 2, 3]
    assert mt.stack([ids, ids], Dim("s", 2)).shape == Shape("s:2,b:2")
    assert mt.einsum(mt.ones("b:2"), output_shape=["b", Dim("c", 5)]).shape == Shape("b:2,c:5")
    x = mt.ones("b:2,h:2,d:3")
    assert mt.replace_dims(x, [Dim("h", 2), "d"], [Dim("hd", 6)]).shape == Shape("b:2,hd:6")
    assert mt.rename(x, Dim("d", 3), Dim("e", 3)).shape == Shape("b:2,h:2,e:3")
    assert mt.top_k(mt.ones("v:4"), Dim("v", 4), Dim("k", 2))[0].shape == Shape("k:2")
