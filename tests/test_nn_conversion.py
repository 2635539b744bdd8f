"""Module conversions (``.to()``, ``.double()``, ``to_empty``, ``load_state_dict``) keep each
MeshParameter a MeshParameter under every path torch's ``Module._apply`` takes: ``param.data =``
(by default), ``torch.utils.swap_tensors`` (``torch.__future__``'s swap flag) and a new Parameter
in its place (the overwrite flag; a move to or from meta). Each flag's results are checked
against the default path's."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import meshtorch as mt

D, H = mt.Dim("d", 4), mt.Dim("h", 6)
FLAGS = ("default", "swap", "overwrite")


@contextmanager
def conversion_flag(flag: str):
    """torch's module-conversion flags set for ``flag``, restored after."""
    fut = torch.__future__
    before = (fut.get_swap_module_params_on_conversion(), fut.get_overwrite_module_params_on_conversion())
    fut.set_swap_module_params_on_conversion(flag == "swap")
    fut.set_overwrite_module_params_on_conversion(flag == "overwrite")
    try:
        yield flag
    finally:
        fut.set_swap_module_params_on_conversion(before[0])
        fut.set_overwrite_module_params_on_conversion(before[1])


@pytest.fixture(params=FLAGS)
def flag(request):
    with conversion_flag(request.param) as f:
        yield f


class Net(mt.nn.Module):
    """A meshtorch layer, a frozen MeshParameter, a MeshParameter held by a plain torch.nn module
    (a ParameterList, which also ties the layer's kernel), a plain torch.nn.Linear and a buffer."""

    def __init__(self):
        super().__init__()
        self.dense = mt.nn.Dense(D, H)
        self.frozen = mt.nn.MeshParameter([H], init="constant", value=0.5, requires_grad=False)
        self.held = torch.nn.ParameterList([mt.nn.MeshParameter([H], init="normal")])
        self.plain = torch.nn.Linear(3, 2)
        with torch.no_grad():  # (not torch's global generator, which processor threads share)
            self.plain.weight.copy_(torch.linspace(-1.0, 1.0, 6).reshape(2, 3))
            self.plain.bias.fill_(0.25)
        self.register_buffer("offset", torch.arange(2.0))

    def forward(self, x: mt.MeshTensor) -> mt.MeshTensor:
        y = self.dense(x) * self.held[0].mesh_tensor + self.frozen.mesh_tensor
        z = self.plain(torch.ones(3, dtype=self.offset.dtype)) + self.offset
        return mt.reduce_sum(y * y) + (z * z).sum()


def mesh_meta(p) -> tuple:
    return (type(p).__name__, str(p.mesh_shape), str(p.mesh_layout), p.seed, p.stream, p.materialized,
            p.requires_grad)


def convert_and_train(flag: str) -> dict:
    """Under ``flag``: a Net with gradients, converted to float64; then a forward, a backward and a
    step; what the conversion kept, and the values."""
    with conversion_flag(flag):
        net = Net()
        x = mt.random.normal("batch:4,d:4", seed=1)
        net(x).backward()  # gradients to convert
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        before = dict(net.named_parameters())
        metas = {n: mesh_meta(p) for n, p in before.items() if isinstance(p, mt.nn.MeshParameter)}
        grads = {n: p.grad.clone() for n, p in before.items() if p.grad is not None}
        stale = net.dense.mesh_view("kernel")
        net.to(torch.float64)
        after = dict(net.named_parameters())
        out = {
            "types": {n: type(p).__name__ for n, p in after.items()},
            "metas_kept": {n: mesh_meta(after[n]) == m for n, m in metas.items()},
            "same_objects": {n: after[n] is p for n, p in before.items()},
            "dtypes": {n: (p.dtype, p.grad.dtype) for n, p in after.items() if p.grad is not None},
            "grads_converted": all(torch.equal(after[n].grad, g.double()) for n, g in grads.items()),
            "buffer": (type(net._buffers["offset"]).__name__, net.offset.dtype),
            # the layer's kept view (made before) is of the converted parameter
            "view_fresh": (stale.local.shape == net.dense.kernel.shape
                           and net.dense.mesh_view("kernel").local is net.dense.kernel
                           and net.dense.mesh_view("kernel").local.dtype == torch.float64),
        }
        opt.zero_grad()
        loss = net(mt.cast(x, torch.float64))
        loss.backward()
        opt.step()  # the optimizer holds the module's parameters (the same objects) in swap and default
        held = opt.param_groups[0]["params"]
        out["optimizer_reaches_module"] = [p is after[n] for n, p in zip(after, held)]
        out["loss"] = loss.to_global().detach()
        out["grads"] = {n: p.grad.clone() for n, p in after.items() if p.grad is not None}
        out["state"] = {k: v.clone() for k, v in net.state_dict().items()}
    return out


@pytest.mark.parametrize("mesh,rules", [("b:1", "batch:b"), ("b:2", "batch:b; h:b")])
def test_to_float64_keeps_mesh_parameters_under_each_conversion_flag(flag, mesh, rules):
    ref = mt.launch(lambda: convert_and_train("default"), mesh=mesh, rules=rules)
    got = mt.launch(lambda: convert_and_train(flag), mesh=mesh, rules=rules)
    for r, g in zip(ref, got):
        assert g["types"] == r["types"] == {
            "dense.kernel": "MeshParameter", "dense.bias": "MeshParameter", "frozen": "MeshParameter",
            "held.0": "MeshParameter", "plain.weight": "Parameter", "plain.bias": "Parameter"}
        assert all(g["metas_kept"].values()) and len(g["metas_kept"]) == 4
        # the swap path's point is the same objects (so optimizers keep them); overwrite makes new ones
        assert all(g["same_objects"].values()) == (flag != "overwrite")
        assert all(g["dtypes"][n] == (torch.float64, torch.float64) for n in g["dtypes"])
        assert set(g["dtypes"]) == {"dense.kernel", "dense.bias", "held.0", "plain.weight", "plain.bias"}
        assert g["grads_converted"] and g["buffer"] == ("Tensor", torch.float64)
        assert g["view_fresh"]
        assert all(g["optimizer_reaches_module"]) == (flag != "overwrite")
        torch.testing.assert_close(g["loss"], r["loss"], rtol=0, atol=0)
        # (overwrite: the optimizer zeroes and steps the old, replaced tensors, as for any torch module)
        for n, v in r["state"].items():
            assert g["state"][n].dtype == torch.float64
            if flag != "overwrite":
                torch.testing.assert_close(g["state"][n], v, rtol=0, atol=0)
        if flag != "overwrite":
            assert g["grads"].keys() == r["grads"].keys() and len(g["grads"]) == 5
            for n, v in r["grads"].items():
                torch.testing.assert_close(g["grads"][n], v, rtol=0, atol=0)


def test_to_float64_values_and_gradients_match_the_default_path_before_any_step(flag):
    def prog(f):
        with conversion_flag(f):
            net = Net()
            net.double()
            loss = net(mt.cast(mt.random.normal("batch:4,d:4", seed=1), torch.float64))
            loss.backward()
            return ({k: v.clone() for k, v in net.state_dict().items()},
                    {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})

    (ref_state, ref_grads), = mt.launch(lambda: prog("default"), mesh="b:1", rules="batch:b")
    (state, grads), = mt.launch(lambda: prog(flag), mesh="b:1", rules="batch:b")
    assert state.keys() == ref_state.keys() and grads.keys() == ref_grads.keys()
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=0, atol=0)
        assert state[k].dtype == torch.float64
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=0)


def test_no_op_conversion_keeps_the_same_parameters(flag):
    # .to() of the dtype and device it has hands back each MeshParameter itself, which torch's
    # swap and overwrite paths could not wrap in a new Parameter ("requires that detach() returns...")
    net = Net()
    kernel = net.dense.kernel
    values = kernel.detach().clone()
    net.to("cpu").float()
    assert type(net.dense.kernel) is mt.nn.MeshParameter
    assert (net.dense.kernel is kernel) == (flag != "overwrite")
    assert torch.equal(net.dense.kernel, values) and net.dense.kernel.stream == "dense.kernel"


def test_tied_parameter_stays_tied_and_a_mesh_parameter(flag):
    net = Net()
    net.held.append(net.dense.kernel)  # the same parameter in the layer and in a plain torch.nn module
    kernel = net.dense.kernel
    net.double()
    assert type(net.held[1]) is mt.nn.MeshParameter and type(net.dense.kernel) is mt.nn.MeshParameter
    assert net.dense.kernel.dtype == net.held[1].dtype == torch.float64
    if flag != "overwrite":  # (torch's overwrite path makes a new Parameter per holder, tied or not)
        assert net.held[1] is net.dense.kernel is kernel


def test_move_to_meta_and_back_redraws_the_same_values(flag):
    # a move to or from meta is torch's overwrite path under every flag (incompatible tensor types)
    dense = mt.nn.Dense(D, H)
    want = {n: p.detach().clone() for n, p in dense.named_parameters()}
    dense.to("meta")
    assert [(type(p).__name__, p.device.type, p.stream) for p in dense.parameters()] == [
        ("MeshParameter", "meta", "kernel"), ("MeshParameter", "meta", "bias")]
    assert dense.mesh_view("kernel").local.is_meta
    dense.to_empty(device="cpu").reset_parameters()
    for n, p in dense.named_parameters():
        assert type(p) is mt.nn.MeshParameter and torch.equal(p, want[n]), n
    assert dense(mt.ones("batch:2,d:4")).to_global().shape == (2, 6)


@pytest.mark.parametrize("assign", [False, True])
def test_state_dict_round_trip_after_conversion(flag, assign):
    def prog():
        with conversion_flag(flag):
            src = Net().double()
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(1.0)
            state = src.state_dict()
            dst = Net().double()
            before = dict(dst.named_parameters())
            stale = dst.dense.mesh_view("kernel")
            dst.load_state_dict(state, assign=assign)
            after = dict(dst.named_parameters())
            x = mt.cast(mt.random.normal("batch:4,d:4", seed=1), torch.float64)
            return (
                {n: type(p).__name__ for n, p in after.items()},
                {n: mesh_meta(p) == mesh_meta(before[n]) for n, p in after.items()
                 if isinstance(p, mt.nn.MeshParameter)},
                {n: after[n] is before[n] for n in after},
                all(torch.equal(dst.state_dict()[k], v) for k, v in state.items()),
                torch.equal(dst(x).to_global(), src(x).to_global()),
                dst.dense.mesh_view("kernel").local is dst.dense.kernel and stale is not None,
            )

    for types, metas, same, equal, forward_equal, view_fresh in mt.launch(prog, mesh="b:2",
                                                                         rules="batch:b; h:b"):
        assert {n: t for n, t in types.items() if not n.startswith("plain")} == {
            "dense.kernel": "MeshParameter", "dense.bias": "MeshParameter", "frozen": "MeshParameter",
            "held.0": "MeshParameter"}
        assert all(metas.values()) and len(metas) == 4
        # assign=True puts the state dict's tensors in place (the swap flag: swapped into the same
        # objects); without it they are copied into the same ones
        assert all(same.values()) == (not assign or flag == "swap")
        assert equal and forward_equal and view_fresh


def test_module_with_buffer_converts_under_each_flag(flag):
    class Scaled(mt.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = mt.nn.MeshParameter([D], init="ones")
            self.register_buffer("count", torch.tensor(3.0))

        def forward(self, x):
            return x * self.scale.mesh_tensor * self.count

    m = Scaled().double()
    assert type(m.scale) is mt.nn.MeshParameter and m.scale.dtype == m.count.dtype == torch.float64
    assert "count" in m._buffers and m.state_dict()["count"].dtype == torch.float64
    out = m(mt.cast(mt.ones("d:4"), torch.float64))
    assert out.to_global().tolist() == [3.0] * 4 and out.local.dtype == torch.float64


def overlap_steps_around_a_conversion(on: bool = True) -> list:
    """Two steps inside mt.overlap() (which holds the parameters weakly, its lasting entries and
    gather plans), ``.double()`` and a state-dict round trip under the conversion flag the launch
    runs under, then a step more: the gradients of each step after the first conversion, globally.
    (torch's flags are one per process: set around the launch, not by each thread-processor,
    whose enters and exits interleave and flipped the flag under another's conversion.)"""
    torch.manual_seed(0)
    net = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 6))
    x = mt.random.normal("batch:4,d:4", seed=1)
    grads = []
    for step in range(4):
        if step == 2:
            net.double()
            net.load_state_dict(net.state_dict())
            x = mt.cast(x, torch.float64)
        net.zero_grad()
        with mt.overlap(enabled=on):
            mt.reduce_sum(net(x) ** 2).backward()
        grads.append({n: p.grad.to_global() for n, p in net.named_mesh_parameters()})
    return [type(p).__name__ for p in net.parameters()], grads[2:]


@pytest.mark.parametrize("rules", ["batch:b", "batch:b; h:b"])
def test_a_model_trained_inside_overlap_converts_and_loads_under_each_flag(flag, rules):
    """torch.utils.swap_tensors (the swap flag) refuses a tensor with a weak reference, which
    mt.overlap()'s runtime keeps to each parameter it read: it lets go before a conversion or a
    load swaps them (review15: "Couldn't swap Dense.kernel"), and the steps after are those of
    the per-use path, which no runtime touches (bitwise: a parameter of one use), data parallel
    and FSDP."""
    with conversion_flag("default"):
        ref = mt.launch(overlap_steps_around_a_conversion, False, mesh="b:2", rules=rules)[0]
    with conversion_flag(flag):
        kinds, grads = mt.launch(overlap_steps_around_a_conversion, mesh="b:2", rules=rules)[0]
    assert kinds == ["MeshParameter", "MeshParameter"]
    for got, want in zip(grads, ref[1]):
        for k in want:
            assert got[k].dtype == torch.float64
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
