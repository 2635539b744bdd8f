"""Dense with expert dims: one kernel per expert, against a dense per-expert matmul in torch
(values and gradients of input, kernel and bias) on drawn meshes and rules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, meshes, multi_rules_for, rand


@given(data=st.data())
@settings(max_examples=10, deadline=None)
def test_expert_dense_is_a_matmul_per_expert(data):
    mesh = data.draw(meshes())
    e, b, d, h = 4, data.draw(SIZES), 4, data.draw(SIZES)
    rules = data.draw(multi_rules_for(mesh, ["experts", "batch", "d", "h"]))
    x, w = rand(e, b, d, seed=1), rand(e, d, h, seed=2)
    bias, probe = rand(e, h, seed=3), rand(e, b, h, seed=4)
    ref = [t.clone().requires_grad_(True) for t in (x, w, bias)]
    y_ref = torch.einsum("ebd,edh->ebh", ref[0], ref[1]) + ref[2][:, None, :]
    (y_ref * probe).sum().backward()

    def prog():
        layer = mt.nn.Dense(mt.Dim("d", d), mt.Dim("h", h), experts=mt.Dim("experts", e)).double()
        layer.kernel.data.copy_(mt.from_global(w, f"experts:{e},d:{d},h:{h}").local)
        layer.bias.data.copy_(mt.from_global(bias, f"experts:{e},h:{h}").local)
        t = mt.from_global(x, f"experts:{e},batch:{b},d:{d}", requires_grad=True)
        y = layer(t)
        mt.reduce_sum(y * mt.from_global(probe, y.shape)).backward()
        grads = [mt.MeshTensor(p.grad, p.mesh_shape, p.mesh_layout).to_global()
                 for p in (layer.kernel, layer.bias)]
        return (y.to_global(), t.grad.to_global(), *grads)

    for y, gx, gw, gb in mt.launch(prog, mesh=mesh, rules=rules):
        torch.testing.assert_close(y, y_ref.detach())
        for g, r in zip((gx, gw, gb), ref):
            torch.testing.assert_close(g, r.grad)


def test_split_experts_with_the_input_split_alike_communicate_nothing_forward():
    def prog():
        layer = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 6), experts=mt.Dim("experts", 4), bias=False)
        x = mt.from_global(rand(4, 8, 4).float(), "experts:4,batch:8,d:4")
        mt.reset_comm_stats()
        layer(x)
        return mt.comm_stats().calls()

    assert mt.launch(prog, mesh="x:4", rules="experts:x") == [0] * 4


def test_missing_expert_dim_is_named():
    layer = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2), experts=mt.Dim("experts", 3))
    with pytest.raises(mt.errors.ShapeError, match="expert dim experts"):
        layer(mt.ones("batch:2,d:4"))
