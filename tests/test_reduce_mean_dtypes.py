"""reduce_mean's dtypes: float16/bfloat16 accumulate in float32 as torch.mean does, on every
layout; a mean over no dims is a new floating tensor, fused (mt.Reductions) or not."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, meshes, rand, rules_for

NAMES = ["p", "q", "r"]


@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), fused=st.booleans())
@settings(max_examples=12, deadline=None)
def test_low_precision_mean_is_torch_mean_on_every_layout(data, dtype, fused):
    # elements of 5e3 to 5e4: torch sums float16 in float32 but returns the sum in float16, whose
    # largest value is 65504, so a partial sum of a few of them was inf before it was divided
    mesh = data.draw(meshes())
    sizes = [data.draw(SIZES) for _ in NAMES]
    rules = data.draw(rules_for(mesh, NAMES))
    which = sorted(data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=3, unique=True)))
    g = (rand(*sizes, seed=3, positive=True) * 1e4).to(dtype)
    kept = [s for i, s in enumerate(sizes) if i not in which]
    probe = torch.randn(kept, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref_x = g.clone().requires_grad_(True)
    ref = torch.mean(ref_x, which)
    (ref * probe).sum().backward()

    def prog():
        x = mt.from_global(g, ",".join(f"{n}:{s}" for n, s in zip(NAMES, sizes)), requires_grad=True)
        dims = [NAMES[i] for i in which]
        if fused:
            batch = mt.Reductions()
            h = batch.mean(x, dims)
            y = batch.run()[h]
        else:
            y = mt.reduce_mean(x, dims)
        mt.reduce_sum(y * mt.from_global(probe, y.shape)).backward()
        return y.to_global(), x.grad.to_global()

    # each processor rounds its partial mean to the low dtype and the all_reduce sums at most 8
    # of them in it: a few ulps of the largest element
    eps = torch.finfo(dtype).eps
    for y, grad in mt.launch(prog, mesh=mesh, rules=rules):
        assert y.dtype == dtype and grad.dtype == dtype
        torch.testing.assert_close(y.float(), ref.detach().float(), rtol=0,
                                   atol=8 * eps * g.float().abs().max().item())
        torch.testing.assert_close(grad, ref_x.grad, rtol=eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_count_low_precision_mean_does_not_overflow(dtype):
    # 131,072 twos summed in float16 are inf (its largest value is 65504); torch.mean gives 2
    g = torch.full((4096, 32), 2.0, dtype=dtype)

    def prog():
        x = mt.from_global(g, "batch:4096,d:32")
        batch = mt.Reductions()
        h = batch.mean(x)
        return mt.reduce_mean(x).to_global(), batch.run()[h].to_global()

    for one, fused in mt.launch(prog, mesh="b:2", rules="batch:b"):
        assert one.dtype == dtype and one.item() == torch.mean(g).item() == 2.0
        assert torch.equal(fused, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_mean_divide_the_sum_in_their_own_dtype(dtype):
    # unchanged by the low-precision path: bitwise the sum divided by the count, on one processor
    g = rand(12, 8, seed=7).to(dtype) * 1.1
    x = mt.from_global(g, "a:12,b:8")
    assert torch.equal(mt.reduce_mean(x, "a").to_global(), g.sum(0) / 12)
    assert torch.equal(mt.reduce_mean(x).to_global(), g.sum([0, 1]) / 96)


@pytest.mark.parametrize("source", [torch.arange(6).reshape(3, 2), torch.arange(6.0).reshape(3, 2) * 1.1,
                                    torch.tensor([[True, False], [True, True], [False, False]])])
def test_a_mean_over_no_dims_is_a_new_floating_tensor_fused_or_not(source):
    def prog():
        x = mt.from_global(source, "batch:3,d:2")
        batch = mt.Reductions()
        h, o = batch.mean(x, []), batch.mean(x, [], output_shape=["d", "batch"])
        out = batch.run()
        one = mt.reduce_mean(x, [])
        return [(r is x, r.dtype, r.to_global()) for r in (out[h], one)], out[o].to_global()

    want = source / 1
    for results, transposed in mt.launch(prog, mesh="b:2", rules="batch:b"):
        for same, dtype, value in results:
            assert not same and dtype == want.dtype
            assert torch.equal(value, want)
        assert torch.equal(transposed, want.T)
