"""reduce_mean's dtypes: a mean over no dims is a new floating tensor, fused (mt.Reductions) or not."""

import pytest
import torch

import meshtorch as mt

NAMES = ["p", "q", "r"]


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
