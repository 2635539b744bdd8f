"""Elementwise ops on drawn meshes and rules equal dense torch, values and grads."""

import decimal

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


class Recorder:
    """A foreign operand that defines every reflected arithmetic method and the comparisons,
    recording which ran (and with which operand)."""

    def __init__(self):
        self.calls = []

    def _record(name):
        def method(self, other):
            self.calls.append((name, other))
            return name

        return method

    for _name in ("radd", "rsub", "rmul", "rtruediv", "rpow", "rfloordiv", "rmod", "rmatmul",
                  "add", "sub", "mul", "truediv", "pow", "floordiv", "mod", "lt", "le", "gt", "ge"):
        locals()[f"__{_name}__"] = _record(f"__{_name}__")
    del _name, _record


OPERATORS = [  # (expression, the foreign operand's method Python runs)
    (lambda x, f: x + f, "__radd__"), (lambda x, f: x - f, "__rsub__"), (lambda x, f: x * f, "__rmul__"),
    (lambda x, f: x / f, "__rtruediv__"), (lambda x, f: x ** f, "__rpow__"),
    (lambda x, f: x // f, "__rfloordiv__"), (lambda x, f: x % f, "__rmod__"),
    (lambda x, f: x @ f, "__rmatmul__"),  # (MeshTensor has no @: Python goes to the other's)
    (lambda x, f: x < f, "__gt__"), (lambda x, f: x <= f, "__ge__"), (lambda x, f: x > f, "__lt__"),
    (lambda x, f: x >= f, "__le__"),
]


@pytest.mark.parametrize("expr,method", OPERATORS)
def test_operators_defer_to_a_foreign_operands_reflected_method(expr, method):
    x, foreign = mt.ones("p:2"), Recorder()
    assert expr(x, foreign) == method
    assert len(foreign.calls) == 1 and foreign.calls[0][0] == method and foreign.calls[0][1] is x


@pytest.mark.parametrize("expr,method", [
    (lambda f, x: f + x, "__add__"), (lambda f, x: f - x, "__sub__"), (lambda f, x: f * x, "__mul__"),
    (lambda f, x: f / x, "__truediv__"), (lambda f, x: f ** x, "__pow__"),
    (lambda f, x: f // x, "__floordiv__"), (lambda f, x: f % x, "__mod__"), (lambda f, x: f < x, "__lt__")])
def test_foreign_left_operand_runs_its_own_method(expr, method):
    x, foreign = mt.ones("p:2"), Recorder()
    assert expr(foreign, x) == method and [c[0] for c in foreign.calls] == [method]


class Declines:
    """Defines the arithmetic methods and comparisons but returns NotImplemented from each."""

    def __add__(self, other):
        return NotImplemented

    def __radd__(self, other):
        return NotImplemented

    def __lt__(self, other):
        return NotImplemented

    def __gt__(self, other):
        return NotImplemented


class Plain:
    """No arithmetic methods at all."""


def test_operand_errors_for_types_without_the_reflected_method_are_meshtorchs():
    x = mt.ones("p:2")
    wrap = "neither a MeshTensor nor a scalar; wrap torch tensors with mt.from_global"
    # a torch tensor, a list, a str (each has reflected methods: their errors would mislead)
    for bad, name in [(torch.ones(2), "Tensor"), ([1.0, 2.0], "list"), ("ab", "str"), (Plain(), "Plain")]:
        for expr, op in [(lambda a, b: a + b, "add"), (lambda a, b: a * b, "multiply"),
                         (lambda a, b: b * a, "multiply"), (lambda a, b: a < b, "less"),
                         (lambda a, b: b - a, "subtract")]:
            with pytest.raises(mt.errors.ShapeError, match=f"{op}: operand of type {name} is {wrap}"):
                expr(x, bad)
    # a type that declines both ways: meshtorch's error either way (Python's would be a bare
    # TypeError), comparisons too (review15b: Num() < x)
    for expr, op in [(lambda a, b: a + b, "add"), (lambda a, b: b + a, "add"),
                     (lambda a, b: a < b, "less"), (lambda a, b: b < a, "greater")]:
        with pytest.raises(mt.errors.ShapeError, match=f"{op}: operand of type Declines is {wrap}"):
            expr(x, Declines())
    # numbers of other kinds know only numbers: meshtorch's error both ways
    for number in (decimal.Decimal(1),):
        for expr in (lambda a, b: a + b, lambda a, b: b + a):
            with pytest.raises(mt.errors.ShapeError, match=f"add: operand of type {type(number).__name__}"):
                expr(x, number)


def test_operators_cost_no_frame_beyond_the_ops_own_function():
    """``x + y`` and ``2 * x`` run as many Python frames as ``mt.add(x, y)`` and
    ``mt.multiply(2, x)`` (issue 27: operators run per op of every forward), and never
    the foreign-type check."""
    import sys

    x, y = mt.ones("p:2,q:3"), mt.ones("p:2,q:3")

    def frames(fn):
        fn()  # (plans the op)
        called: list[str] = []

        def profile(frame, event, arg):
            if event == "call":
                called.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return called

    for op, via_operator in [(lambda: mt.add(x, y), lambda: x + y),
                             (lambda: mt.multiply(2, x), lambda: 2 * x),
                             (lambda: mt.subtract(2.5, x), lambda: 2.5 - x),
                             (lambda: mt.less(x, y), lambda: x < y)]:
        theirs, ours = frames(op), frames(via_operator)
        assert len(ours) == len(theirs) and "defers_to" not in ours, (ours, theirs)
    assert (2 - x).to_global().tolist() == [[1.0] * 3] * 2 and (x ** 3 // 2 % 2).to_global().sum() == 0
