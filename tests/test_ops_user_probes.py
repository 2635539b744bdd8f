"""Models users write from the docs (README's language part, docs/layouts.md, docs/ops.md,
docs/models.md), run under drawn layouts against dense single-processor torch: each test here
failed before its fix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import check_op, rand
from meshtorch.errors import LayoutError
from meshtorch.models import DecoderLM, TransformerConfig


def dense_attention(q, k, v, causal):
    """[batch, length, heads, d_kv] softmax attention on one processor."""
    t = [x.transpose(1, 2) for x in (q, k, v)]
    return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=causal).transpose(1, 2)


# ring attention over a length the axis does not divide: torch.chunk pieces, the last ones
# shorter or empty (5 over 4: 2, 2, 1, 0), as docs/layouts.md promises for every op
@settings(max_examples=12, deadline=None)
@given(m=st.sampled_from([3, 4]), length=st.integers(1, 11), causal=st.booleans(), balance=st.booleans(),
       seed=st.integers(0, 99))
def test_ring_attention_over_uneven_pieces_equals_dense_attention(m, length, causal, balance, seed):
    shape = f"batch:2,length:{length},heads:2,d_kv:4"
    inputs = [(rand(2, length, 2, 4, seed=seed + i), shape) for i in range(3)]
    check_op(lambda q, k, v: mt.ring_attention(q, k, v, causal=causal, balance=balance),
             lambda q, k, v: dense_attention(q, k, v, causal), inputs, f"m:{m}", "length:m")


def test_lm_with_a_length_the_axis_does_not_divide_equals_one_processor():
    cfg = TransformerConfig(vocab=64, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=16)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))

    def loss():
        x = mt.from_global(ids, "batch:2,length:10")
        return DecoderLM(cfg, seed=0).loss(x, x).item()

    one = mt.launch(loss)[0]
    for mesh in ("m:3", "m:4"):  # pieces 4, 4, 2 and 3, 3, 3, 1: ring attention (auto)
        assert mt.launch(loss, mesh=mesh, rules="length:m") == pytest.approx([one] * int(mesh[-1]), rel=1e-5)


def test_ring_attention_over_two_axes_names_them_and_the_fix():
    def prog():
        q = mt.random.normal("batch:1,length:8,heads:1,d_kv:2", seed=0)
        return mt.ring_attention(q, q, q, causal=True)

    with pytest.raises(LayoutError, match=r"split over axes \(a,c\).*'length:a'.*mt\.attention"):
        mt.launch(prog, mesh="a:2,c:2", rules="length:(a,c)")


def test_einsum_with_an_equation_and_output_shape_takes_the_sizes_or_names_the_disagreement():
    # the unknown-dim error says to give the size in output_shape=; a user who kept the equation
    # had output_shape= ignored: the same error again, or, where the equation was complete, the
    # equation's result whatever output_shape= said
    x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,b:3")
    out = mt.einsum("a b -> a c", x, output_shape=["a", mt.Dim("c", 2)])
    assert out.shape == mt.Shape("a:2,c:2") and out.to_global().tolist() == [[3.0, 3.0], [12.0, 12.0]]
    assert mt.einsum("a b -> b", x, output_shape="b:3").to_global().tolist() == [3.0, 5.0, 7.0]
    with pytest.raises(mt.errors.ArgumentError, match=r"names the output dims \['a'\], but output_shape= "
                                                       r"names \['b'\]"):
        mt.einsum("a b -> a", x, output_shape="b:3")


@pytest.mark.parametrize("reduce", [mt.reduce_sum, mt.reduce_mean, mt.reduce_max, mt.reduce_any,
                                    mt.reduce_logsumexp])
def test_a_reduction_given_dims_and_output_shape_that_disagree_names_both(reduce):
    # output_shape= won silently: reduce_sum(x, "a", output_shape="a:2") summed over b
    x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,b:3")
    with pytest.raises(mt.errors.ArgumentError,
                       match=rf"{reduce.__name__} of \[a:2,b:3\].*dims='a'.*keeps \['a'\]"):
        reduce(x, "a", output_shape="a:2")
    assert reduce(x, "a", output_shape="b:3").shape == mt.Shape("b:3")  # the same dims both ways


# a contraction whose contracted dim leaves some processor an empty piece (4 over 3: 2, 2, 0):
# the local matmul reshaped with -1 beside a 0 and raised on that processor
DOTS = [("a, a ->", "a:{a}", "a:{a}", "i,i->"), ("b a, a -> b", "b:3,a:{a}", "a:{a}", "ba,a->b"),
        ("a, a c d -> c d", "a:{a}", "a:{a},c:2,d:2", "a,acd->cd"),
        ("b a, c d a -> b c d", "b:2,a:{a}", "c:2,d:2,a:{a}", "ba,cda->bcd"),
        ("b a e, a e c -> b c", "b:2,a:{a},e:3", "a:{a},e:3,c:2", "bae,aec->bc")]


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(DOTS), a=st.sampled_from([1, 2, 4, 5]), layout=st.sampled_from(
       [("p:3", "a:p"), ("p:8", "a:p"), ("p:2,q:3", "a:(p,q); c:q"), ("p:4", "a:p; b:p")]))
def test_a_contraction_over_empty_pieces_equals_dense(case, a, layout):
    eq, sa, sb, torch_eq = case
    sa, sb = sa.format(a=a), sb.format(a=a)
    inputs = [(rand(*mt.Shape(s).sizes, seed=i), s) for i, s in enumerate((sa, sb))]
    check_op(lambda x, y: mt.einsum(eq, x, y), lambda x, y: torch.einsum(torch_eq, x, y), inputs, *layout)


# a boolean padding mask handed to mt.attention as its bias (the docs: the bias is SDPA's
# attn_mask) was added to the scores as 1.0 and 0.0: nothing was masked
@settings(max_examples=10, deadline=None)
@given(causal=st.booleans(), layout=st.sampled_from(
       [("a:1", ""), ("a:2", "batch:a"), ("a:3", "memory_length:a"), ("a:2,c:2", "length:(a,c); heads:c"),
        ("a:2,c:2", "heads:a; memory_length:c")]), seed=st.integers(0, 99))
def test_a_boolean_bias_masks_keys_as_sdpas_attn_mask(causal, layout, seed):
    b, n, h, d = 2, 5, 2, 4
    keep = torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[:, 0] = True  # every query keeps a key (the first), also under the causal mask
    inputs = [(rand(b, n, h, d, seed=seed), f"batch:{b},length:{n},heads:{h},d_kv:{d}"),
              *[(rand(b, n, h, d, seed=seed + i), f"batch:{b},memory_length:{n},heads:{h},d_kv:{d}")
                for i in (1, 2)], (keep, f"batch:{b},memory_length:{n}")]

    def dense(q, k, v, m):
        t = [x.transpose(1, 2) for x in (q, k, v)]
        mask = m[:, None, None, :] & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)
        return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask).transpose(1, 2)

    check_op(lambda q, k, v, m: mt.attention(q, k, v, bias=m, causal=causal), dense, inputs, *layout)


@pytest.mark.parametrize("t, shape, hint", [
    (torch.zeros(3, 4), "batch:4,d:3", "name the dims in the tensor's order, or permute it"),
    (torch.zeros(3, 4), "batch:3", "name one dim per torch dim"),
    (torch.zeros(3, 4), "batch:3,d:5", "give the named dims the tensor's sizes")])
def test_from_global_of_the_wrong_size_names_the_tensor_and_the_fix(t, shape, hint):
    # it read "tensor  has torch shape" (no name, two spaces) and said nothing of the fix
    with pytest.raises(mt.errors.ShapeError,
                       match=rf"^from_global: tensor 'x' has torch shape \[3, 4\].*; {hint}$"):
        mt.from_global(t, shape, name="x")
    with pytest.raises(mt.errors.ShapeError, match=r"^from_global: tensor has torch shape"):
        mt.from_global(t, shape)


# einsum (and Dense) promote mixed dtypes; a convolution of a bf16 image with a float32 kernel
# raised torch's "Input type ... and weight type ... should be the same" instead
@pytest.mark.parametrize("conv, dtype", [(mt.conv2d, torch.bfloat16), (mt.conv_transpose2d, torch.float64)])
def test_a_convolution_promotes_mixed_dtypes_as_einsum_does(conv, dtype):
    x, k = rand(2, 5, 4, 3, seed=1).to(dtype), rand(3, 3, 3, 2, seed=2).float()
    want = torch.promote_types(dtype, torch.float32)

    def prog():
        xm = mt.from_global(x, "b:2,h:5,w:4,c:3")
        km = mt.from_global(k, "kh:3,kw:3,c:3,o:2", requires_grad=True)
        y = conv(xm, km)
        mt.reduce_sum(y).backward()
        return y.to_global(), km.grad.dtype

    def dense():
        return mt.launch(lambda: conv(mt.from_global(x.to(want), "b:2,h:5,w:4,c:3"),
                                      mt.from_global(k.to(want), "kh:3,kw:3,c:3,o:2")).to_global())[0]

    ref = dense()
    for y, grad_dtype in mt.launch(prog, mesh="a:2,c:2", rules="h:a; o:c"):
        assert y.dtype == want and grad_dtype == torch.float32  # each gradient keeps its input's dtype
        torch.testing.assert_close(y, ref)


# ops.md maps mtf.gather(table, ids, dim) to mt.embedding; Mesh-TF's gather matches the dims ids
# and table share (a batched gather: ids [batch, k] into [batch, length, d]), mt.embedding raised
# "share dims {'batch'}" with no way out
@pytest.mark.parametrize("mesh, rules", [("a:1", ""), ("a:2", "batch:a"), ("a:3", "length:a"),
                                         ("a:2,c:2", "batch:a; length:c; k:a")])
def test_embedding_with_dims_the_ids_share_is_a_batched_gather(mesh, rules):
    x = rand(3, 7, 2, seed=1)
    ids = torch.randint(0, 7, (3, 4), generator=torch.Generator().manual_seed(0))
    check_op(lambda x, i: mt.embedding(x, i, "length"), lambda x, i: x[torch.arange(3)[:, None], i],
             [(x, "batch:3,length:7,d:2"), (ids, "batch:3,k:4")], mesh, rules)


def test_embedding_ids_out_of_range_or_on_the_indexed_dim_raise_naming_it():
    table = mt.from_global(rand(3, 7, seed=1), "batch:3,length:7")
    with pytest.raises(mt.errors.ArgumentError, match="ids hold 7, outside dim 'length'"):
        mt.embedding(table, mt.from_global(torch.full((3, 2), 7), "batch:3,k:2"), "length")
    with pytest.raises(mt.errors.ShapeError, match="have the dim 'length' they index"):
        mt.embedding(table, mt.from_global(torch.zeros(7, dtype=torch.long), "length:7"), "length")


def _gloo_probes() -> list[torch.Tensor]:
    """The probes above on one mesh of processes, each output and input gradient made whole."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (mt.from_global(torch.randn(2, 10, 2, 4, generator=g), "batch:2,length:10,heads:2,d_kv:4",
                              requires_grad=True) for _ in range(3))
    ring = mt.ring_attention(q, k, v, causal=True)                      # length 10 over m:3: 4, 4, 2
    x = mt.from_global(torch.randn(4, 3, generator=g), "length:4,d:3", requires_grad=True)
    dot = mt.einsum("length d, length -> d", x, mt.ones("length:4"))   # 4 over m:3: 2, 2, 0
    keep = mt.from_global(torch.tensor([[True] * 7 + [False] * 3] * 2), "batch:2,memory_length:10")
    kk, vv = (mt.rename(t, "length", "memory_length") for t in (k, v))
    masked = mt.attention(q, kk, vv, bias=keep)
    ids = mt.from_global(torch.randint(0, 10, (2, 3), generator=g), "batch:2,j:3")
    rows = mt.embedding(mt.reduce_sum(q, "d_kv"), ids, "length")        # a batched gather
    loss = sum(mt.reduce_sum(t * t) for t in (ring, dot, masked, rows))
    loss.backward()
    outs = [t.to_global().detach() for t in (ring, dot, masked, rows)]
    return outs + [t.grad.to_global() for t in (q, k, v, x)]


@pytest.mark.timeout(120)
def test_the_probes_on_gloo_processes_equal_one_processor():
    one = mt.launch(_gloo_probes)[0]
    for got in mt.launch(_gloo_probes, mesh="m:3", rules="length:m", backend="torch", timeout=90):
        for a, b in zip(got, one):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# docs: "block must divide each processor's piece"; uneven pieces it divides (10 over 3: 4, 4, 2
# with block 2) were refused all the same, with advice to take a block dividing 3
@pytest.mark.parametrize("length, block, mesh, rules", [
    (10, 2, "a:3", "length:a"), (12, 3, "a:5", "length:a"), (5, 1, "a:4", "length:a"),
    (20, 2, "a:2,c:3", "length:(a,c)")])  # 10, 10: 4, 4, 2 each
def test_local_attention_over_uneven_pieces_the_block_divides_equals_dense(length, block, mesh, rules):
    i = torch.arange(length)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - block)

    def dense(q, k, v):
        t = [x.transpose(1, 2) for x in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask).transpose(1, 2)

    shape = f"batch:2,length:{length},heads:2,d_kv:4"
    check_op(lambda q, k, v: mt.local_attention(q, k, v, block), dense,
             [(rand(2, length, 2, 4, seed=s), shape) for s in range(3)], mesh, rules)


def test_local_attention_names_the_pieces_a_block_does_not_divide_and_a_length_that_works():
    def prog():
        q = mt.zeros("batch:1,length:7,d_kv:2")
        return mt.local_attention(q, q, q, 3)

    with pytest.raises(mt.errors.ShapeError, match=r"pieces of \[3, 4\].*make 'length' a multiple of 6"):
        mt.launch(prog, mesh="a:2", rules="length:a")


# the same mask through a model's Attention in training with dropout: its path forms the scores
# itself (layout-invariant dropout masks), and added a boolean bias as 1.0 / 0.0, masking nothing
@pytest.mark.parametrize("mesh, rules", [("", ""), ("a:2", "batch:a; memory_length:a")])
def test_a_boolean_bias_masks_keys_in_attention_with_dropout_too(mesh, rules):
    from meshtorch.models import TransformerConfig
    from meshtorch.models.layers import Attention

    cfg = TransformerConfig(vocab=64, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=16)
    keep = torch.tensor([[True] * 3 + [False] * 2, [True] * 4 + [False]])

    def prog():
        attn = Attention(cfg)
        x = mt.random.normal("batch:2,length:5,d_model:16", seed=0)
        mask = mt.from_global(keep, "batch:2,memory_length:5")
        fused = attn.eval()(x, bias=mask).to_global()
        attn.train()
        attn.rate = 1e-12  # the dropout path, which then drops nothing (its scale 1 / (1 - 1e-12) is 1.0)
        dropped = attn(x, bias=mask).to_global()
        return (fused - dropped).abs().max().item()

    assert max(mt.launch(prog, mesh=mesh, rules=rules)) < 1e-5
