"""Elementwise ops on drawn meshes and rules equal dense torch, values and grads."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, aten_ops, check_op, meshes, rand, rules_for

SET = settings(max_examples=8, deadline=None)

# (meshtorch op, torch reference, positive inputs only, input scale); the Mesh-TF activations
# take inputs scaled by 3 so that their negative branches and kinks are exercised
UNARY = [
    (mt.relu, torch.relu, False, 1),
    (mt.gelu, F.gelu, False, 1),
    (mt.silu, F.silu, False, 1),
    (mt.exp, torch.exp, False, 1),
    (mt.log, torch.log, True, 1),
    (mt.tanh, torch.tanh, False, 1),
    (mt.sigmoid, torch.sigmoid, False, 1),
    (mt.rsqrt, torch.rsqrt, True, 1),
    (mt.sqrt, torch.sqrt, True, 1),
    (mt.abs, torch.abs, False, 1),
    (mt.square, torch.square, False, 1),
    (lambda x: x ** 3, lambda x: x ** 3, False, 1),
    (lambda x: mt.pow(x, 0.5), lambda x: x ** 0.5, True, 1),
    (lambda x: -x, lambda x: -x, False, 1),
    (lambda x: mt.clamp(x, -0.5, 0.5), lambda x: x.clamp(-0.5, 0.5), False, 1),
    (mt.elu, F.elu, False, 3),
    (lambda x: mt.elu(x, alpha=0.5), lambda x: F.elu(x, 0.5), False, 3),
    (mt.selu, F.selu, False, 3),
    (mt.softplus, F.softplus, False, 3),
    (mt.leaky_relu, lambda x: F.leaky_relu(x, 0.2), False, 3),  # Mesh-TF's default slope
    (lambda x: mt.leaky_relu(x, alpha=0.01), F.leaky_relu, False, 3),
    (mt.sign, torch.sign, False, 3),
    (mt.reciprocal, lambda x: 1.0 / x, True, 3),
]


@pytest.mark.parametrize("i", range(len(UNARY)))
@given(data=st.data())
@SET
def test_unary(i, data):
    mt_fn, torch_fn, positive, scale = UNARY[i]
    mesh = data.draw(meshes())
    a, b = data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "q"]))
    check_op(mt_fn, torch_fn, [(scale * rand(a, b, positive=positive), f"p:{a},q:{b}")], mesh, rules)


def test_cast_keeps_gradient_in_original_dtype():
    def prog():
        x = mt.from_global(rand(4, 4), "p:4,q:4", requires_grad=True)
        y = mt.cast(x, torch.float32)
        mt.reduce_sum(y).backward()
        return y.dtype, x.grad.dtype, x.grad.to_global()

    for dtype, gdtype, g in mt.launch(prog, mesh="x:2,y:2", rules="p:x; q:y"):
        assert dtype == torch.float32 and gdtype == torch.float64
        assert torch.equal(g, torch.ones(4, 4, dtype=torch.float64))


BINARY = [
    (lambda x, y: x + y, torch.add, False),
    (lambda x, y: x - y, torch.sub, False),
    (lambda x, y: x * y, torch.mul, False),
    (lambda x, y: x / y, torch.div, True),
    (mt.minimum, torch.minimum, False),
    (mt.maximum, torch.maximum, False),
    (lambda x, y: mt.pow(x, y), torch.pow, True),
]


@pytest.mark.parametrize("i", range(len(BINARY)))
@given(data=st.data())
@SET
def test_binary_broadcast_by_name(i, data):
    """y has a subset of x's dims plus one of its own, in another order."""
    mt_fn, torch_fn, positive = BINARY[i]
    mesh = data.draw(meshes())
    a, b, c = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "q", "r"]))
    x = rand(a, b, seed=1, positive=positive)
    y = rand(c, a, seed=2, positive=True)
    # out dims: p, q (from x), then r (from y); y is [r, p]
    check_op(mt_fn, lambda x, y: torch_fn(x[:, :, None], y.T[:, None, :]),
             [(x, f"p:{a},q:{b}"), (y, f"r:{c},p:{a}")], mesh, rules)


@pytest.mark.parametrize("i", range(len(BINARY)))
@given(data=st.data())
@SET
def test_binary_trailing_dims(i, data):
    """y's dims are x's last ones in x's order (a bias, a per-feature scale): the local slices
    are broadcast by torch as they are, on every layout of either operand."""
    mt_fn, torch_fn, positive = BINARY[i]
    mesh = data.draw(meshes())
    a, b, c = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    rules = data.draw(rules_for(mesh, ["p", "q", "r"]))
    x = rand(a, b, c, seed=1, positive=positive)
    y = rand(b, c, seed=2, positive=True)
    check_op(mt_fn, torch_fn, [(x, f"p:{a},q:{b},r:{c}"), (y, f"q:{b},r:{c}")], mesh, rules)
    # y first: the output's dims are y's then p, so x's are not its last ones: aligned instead
    check_op(lambda x, y: mt_fn(y, x), lambda x, y: torch_fn(y, x).permute(1, 2, 0),
             [(x, f"p:{a},q:{b},r:{c}"), (y, f"q:{b},r:{c}")], mesh, rules)


def test_trailing_dims_run_the_op_alone_on_one_processor():
    """A bias add on one processor is one aten op, as ``x + b`` in torch: no permute, reshape or
    expand of the operands around it (each a Python call into torch, paid cold between the large
    kernels of a model's forward: issue 27)."""
    x = mt.from_global(rand(2, 3, 4), "p:2,q:3,r:4")
    bias = mt.from_global(rand(4, seed=2), "r:4")
    names, y = aten_ops(lambda: x + bias)
    assert names == ["add.Tensor"], names
    assert torch.equal(y.to_global(), x.to_global() + bias.to_global())
    # not trailing (r, q against p, q, r): aligned first
    names, _ = aten_ops(lambda: x * mt.from_global(rand(4, 3, seed=3), "r:4,q:3"))
    assert names != ["mul.Tensor"], names


@pytest.mark.parametrize("op, ref", [
    (lambda x, y: x < y, torch.lt), (lambda x, y: x >= y, torch.ge),
    (mt.equal, torch.eq), (mt.not_equal, torch.ne)])
@given(data=st.data())
@settings(max_examples=4, deadline=None)
def test_comparisons(op, ref, data):
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, ["p", "q"]))
    x = torch.tensor([[1.0, 2, 3, 4]] * 4)
    y = torch.tensor([2.0, 2, 2, 5])
    check_op(op, lambda x, y: ref(x, y[None, :]), [(x, "p:4,q:4"), (y, "q:4")], mesh, rules,
             grad=False)


@given(data=st.data())
@SET
def test_where_and_scalars(data):
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, ["p", "q"]))
    x, y = rand(4, 8, seed=3), rand(8, seed=4)
    check_op(lambda x, y: mt.where(x > 0, x * 2.0 + 1, 3.0 - y),
             lambda x, y: torch.where(x > 0, x * 2.0 + 1, 3.0 - y[None, :]),
             [(x, "p:4,q:8"), (y, "q:8")], mesh, rules)


def test_broadcast_size_mismatch_names_dim():
    with pytest.raises(mt.errors.ShapeError, match="cannot broadcast dim 'q': size 4 vs 8"):
        mt.ones("p:2,q:4") + mt.ones("q:8")


def test_operand_type_error_suggests_from_global():
    with pytest.raises(mt.errors.ShapeError, match="mt.from_global"):
        mt.ones("p:2") + torch.ones(2)
