"""A scalar ``MeshTensor`` converts to a Python number as a one-element torch tensor does:
``float(loss)``, ``int(n)``, ``bool(x > 0)``, ``complex(z)``, ``operator.index(i)``; a tensor with
dims raises a ``ShapeError`` naming them.

References: the same conversions of the plain torch tensor (the dense computation), torch's own
errors (``float(torch.ones(2))`` is a ValueError; an index of a float tensor a TypeError), and a
collective faked with a handle that counts its waits.
"""

from __future__ import annotations

import operator
import types

import pytest
import torch

import meshtorch as mt
from meshtorch.comm.grouped import Handle
from meshtorch.errors import ShapeError
from meshtorch.layout import Layout
from meshtorch.lowering.adapters import all_reduce_sum_later
from meshtorch.tensor import MeshTensor

VALUES = {torch.float32: [0.5, -2.25, 3.0, 1.5], torch.int64: [3, -7, 0, 5],
          torch.bool: [False, True, False, False]}
CONVERSIONS = {"float": float, "int": int, "bool": bool, "complex": complex}


def conversions(dtype: torch.dtype) -> dict:
    """Each conversion of a sum over a split dim (an all_reduce's result) and of a scalar made from
    one number on every processor."""
    x = mt.from_global(torch.tensor(VALUES[dtype], dtype=dtype), "a:4")
    total = mt.reduce_any(x) if dtype == torch.bool else mt.reduce_sum(x)
    return {name: (f(total), total.item()) for name, f in CONVERSIONS.items()}


@pytest.mark.parametrize("dtype", list(VALUES))
def test_a_scalar_converts_as_the_dense_tensor_and_as_item(dtype):
    dense = torch.tensor(VALUES[dtype], dtype=dtype)
    dense = dense.any() if dtype == torch.bool else dense.sum()
    for got in mt.launch(conversions, dtype, mesh="b:2", rules="a:b"):
        for name, f in CONVERSIONS.items():
            value, item = got[name]
            assert value == f(dense) and type(value) is type(f(dense)), (name, value, f(dense))
            assert value == f(item)


def indices() -> tuple:
    i = mt.reduce_sum(mt.from_global(torch.tensor([1, 0, 1, 0]), "a:4"))  # 2, an int64 scalar
    f = mt.reduce_sum(mt.from_global(torch.tensor([1.0, 0.0, 1.0, 0.0]), "a:4"))
    with pytest.raises(TypeError) as float_error:
        operator.index(f)
    return operator.index(i), ["x", "y", "z"][i], list(range(5))[:i], str(float_error.value)


def test_an_integer_scalar_is_an_index_and_a_float_one_is_not_as_in_torch():
    with pytest.raises(TypeError) as torch_error:
        operator.index(torch.tensor(2.0))
    for got in mt.launch(indices, mesh="b:2", rules="a:b"):
        assert got == (2, "z", [0, 1], str(torch_error.value))


def not_scalars() -> dict:
    x = mt.from_global(torch.ones(4, 2), "rows:4,cols:2", name="weights")
    out = {}
    for name, f in {**CONVERSIONS, "index": operator.index, "item": lambda t: t.item()}.items():
        with pytest.raises(ShapeError) as e:
            f(x)
        out[name] = str(e.value)
    return out


def test_a_tensor_with_dims_refuses_every_conversion_naming_its_dims():
    for errors in mt.launch(not_scalars, mesh="b:2", rules="rows:b"):
        for name, message in errors.items():
            assert "needs a scalar MeshTensor" in message and "weights has dims [rows:4,cols:2]" in message
            assert ("mt.reduce_any(x)" if name == "bool" else "mt.reduce_sum(x)") in message, message
    with pytest.raises(ValueError):  # as torch's float(torch.ones(2)): ShapeError is a ValueError
        float(mt.launch(lambda: mt.ones("a:2"))[0])


def in_flight() -> list:
    """Each conversion of a sum read later (inside mt.overlap its all_reduce is not waited for
    in the forward), each on a sum fresh from the forward."""
    x = mt.from_global(torch.arange(4.0), "a:4")
    out = []
    for f in (float, int, bool, complex):
        with mt.overlap():
            total = mt.reduce_sum(x * x)
        out.append((total._later is not None, f(total), total._later is None))
    return out


def test_a_loss_in_flight_is_waited_for_by_every_conversion():
    for got in mt.launch(in_flight, mesh="b:2", rules="a:b", backend="threads"):
        assert got == [(True, 14.0, True), (True, 14, True), (True, True, True), (True, 14 + 0j, True)]


def test_float_of_a_loss_in_flight_waits_once_for_the_collective():
    waits: list = []

    def finish():
        waits.append(1)
        return [torch.tensor(9.5)]

    comm = types.SimpleNamespace(all_reduce_async=lambda t, axes: Handle(finish, done=lambda: False))
    later = all_reduce_sum_later(torch.tensor(2.0), comm, "b")
    loss = MeshTensor._read_later(later, mt.Shape(""), Layout(mt.Shape(""), mt.Mesh("b:2"), {}))
    assert waits == []
    assert float(loss) == 9.5 and int(loss) == 9 and bool(loss) and waits == [1]


def test_float_of_a_loss_that_requires_grad_warns_nothing():
    """``float(loss)`` reads the value as ``loss.item()`` does: torch's float(t) of a tensor that
    requires grad warns once ("Consider using tensor.detach()"), pointing into meshtorch."""
    import warnings

    w = torch.tensor(1.5, requires_grad=True)
    loss = mt.from_global(w * 2, "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(loss) == 3.0 and int(loss) == 3 and bool(loss) and complex(loss) == 3 + 0j
