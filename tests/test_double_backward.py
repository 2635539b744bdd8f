"""Second-order gradients through the lowering's collectives: a gradient penalty
(``torch.autograd.grad(loss, params or input, create_graph=True)``, then ``backward()`` of the
loss plus the gradients' squares) under drawn rules, even and uneven pieces, one and two mesh
axes, against the one-processor run (to float rounding).

A collective's backward runs in grad mode there and must be differentiable itself
(:mod:`meshtorch.lowering.adapters`): before it was, some layouts raised torch's "does not require
grad" and others (``d_model:b``) gave silently wrong gradients. Where meshtorch cannot
differentiate twice it raises: a ``backward(create_graph=True)`` whose parameter gradients reach
``mt.overlap()``'s buckets, and ring attention.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import meshtorch as mt
from meshtorch.errors import MeshTorchError
from meshtorch.lowering import adapters as ca

B, L, D, F, H, K = 6, 4, 6, 10, 2, 3  # 6 and 10 over 4 processors: uneven pieces


class Mlp(mt.nn.Module):
    """Layer norm, two dense layers and a nonlinearity: partial sums, gathers, replicated weights."""

    def __init__(self):
        super().__init__()
        d, f = mt.Dim("d_model", D), mt.Dim("d_ff", F)
        self.norm, self.wi, self.wo = mt.nn.LayerNorm(d), mt.nn.Dense(d, f), mt.nn.Dense(f, d)

    def forward(self, x):
        return self.wo(mt.tanh(self.wi(self.norm(x))))


class Attention(mt.nn.Module):
    """Causal self-attention (torch's math kernel: the fused ones have no double backward)."""

    def __init__(self):
        super().__init__()
        d, h, k = mt.Dim("d_model", D), mt.Dim("heads", H), mt.Dim("d_kv", K)
        self.q, self.k, self.v = (mt.nn.Dense(d, [h, k]) for _ in range(3))
        self.o = mt.nn.Dense([h, k], d)

    def forward(self, x):
        k, v = (mt.rename(f(x), "length", "memory_length") for f in (self.k, self.v))
        return self.o(mt.attention(self.q(x), k, v, causal=True))


class Moves(mt.nn.Module):
    """A dense layer, shifts along ``length`` (halo permutes where it is split) and a relayout
    (``batch`` renamed: an all_to_all where the new name's rule takes another axis)."""

    def __init__(self):
        super().__init__()
        self.w = mt.nn.Dense(mt.Dim("d_model", D), mt.Dim("d_ff", F))

    def forward(self, x):
        y = mt.tanh(self.w(x))
        y = mt.shift(y, "length", 1) * mt.shift(y, "length", -1, wrap=True)
        return mt.rename(y, "batch", "rows") ** 2


MODELS = {"mlp": Mlp, "attention": Attention, "moves": Moves}


def data(model: str) -> mt.MeshTensor:
    if model == "mlp":
        return mt.from_global(torch.linspace(-2, 2, B * D).reshape(B, D), f"batch:{B},d_model:{D}")
    x = torch.linspace(-2, 2, B * L * D).reshape(B, L, D)
    return mt.from_global(x, f"batch:{B},length:{L},d_model:{D}")


def penalized(model: str, wrt: str, own_kernel: bool = False) -> dict:
    """Every parameter's global gradient of ``loss + ½ Σ g²`` (``g``: the loss's gradient with
    respect to the parameters, or ``(g - 0.1)²`` with respect to the input), and ``g`` itself.
    Attention takes torch's math kernel (the fused ones have no double backward): the caller sets
    it around a launch of thread-processors, ``own_kernel`` a process of its own. sdpa_kernel sets
    process-wide flags, so thread-processors entering and leaving it each left MATH set after the
    launch, for every later test of the worker (fused attention gone, calibrations changed)."""
    torch.manual_seed(0)
    net = MODELS[model]()
    x = data(model)
    with sdpa_kernel(SDPBackend.MATH) if own_kernel else contextlib.nullcontext():
        if wrt == "input":
            x.requires_grad_(True)
        loss = mt.reduce_mean(net(x) ** 2)
        if wrt == "params":
            ps = list(net.parameters())
            gs = torch.autograd.grad(loss.local, ps, create_graph=True)
            grads = [mt.MeshTensor(g, p.mesh_shape, p.mesh_layout) for g, p in zip(gs, ps)]
            penalty = mt.add_n([mt.reduce_sum(g ** 2) for g in grads])
        else:
            (g,) = torch.autograd.grad(loss.local, x.local, create_graph=True)
            grads = [mt.MeshTensor(g, x.shape, x.layout)]
            penalty = mt.reduce_sum((grads[0] - 0.1) ** 2)
        (loss + 0.5 * penalty).backward()
    out = {n: p.grad.to_global() for n, p in net.named_mesh_parameters()}
    out["first order"] = [g.detach().to_global() for g in grads]
    return out


@functools.cache
def dense(model: str, wrt: str) -> dict:
    with sdpa_kernel(SDPBackend.MATH):
        return mt.launch(penalized, model, wrt)[0]


def check(model: str, wrt: str, mesh: str, rules: str, backend: str = "threads") -> None:
    with sdpa_kernel(SDPBackend.MATH):
        got = mt.launch(penalized, model, wrt, backend == "torch", mesh=mesh, rules=rules, backend=backend,
                        timeout=60)
    ref = dense(model, wrt)
    for out in got:  # every processor's global values
        assert out.keys() == ref.keys()
        for k in ref:
            where = f"{mesh} {rules} {k}: "
            torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-5, msg=lambda m, w=where: w + m)


AXES = {"b:2": [None, "b"], "b:2,m:2": [None, "b", "m", "(b,m)", "(m,b)"]}


@st.composite
def meshes_and_rules(draw, dims: tuple[str, ...]):
    mesh = draw(st.sampled_from(sorted(AXES)))
    axes = [draw(st.sampled_from(AXES[mesh])) for _ in dims]
    return mesh, "; ".join(f"{d}:{a}" for d, a in zip(dims, axes) if a is not None)


@settings(max_examples=12, deadline=None)
@given(case=meshes_and_rules(("batch", "d_model", "d_ff")), wrt=st.sampled_from(["params", "input"]))
def test_a_dense_models_penalty_has_the_one_processor_gradients(case, wrt):
    check("mlp", wrt, *case)


@settings(max_examples=6, deadline=None)
@given(case=meshes_and_rules(("batch", "length", "heads", "d_model", "memory_length")),
       wrt=st.sampled_from(["params", "input"]))
def test_an_attentions_penalty_has_the_one_processor_gradients(case, wrt):
    check("attention", wrt, *case)


@pytest.mark.parametrize("wrt", ["params", "input"])
@pytest.mark.parametrize("rules", ["batch:b; length:m; rows:m", "length:(b,m); d_ff:b; rows:b"])
def test_shifts_and_relayouts_penalty_has_the_one_processor_gradients(rules, wrt):
    def calls():
        stats = mt.comm_stats()
        return {k: stats.calls(kind=k) for k in ("permute", "all_to_all")}

    def counted():
        before = calls()
        penalized("moves", wrt)
        return {k: v - before[k] for k, v in calls().items()}

    with sdpa_kernel(SDPBackend.MATH):
        made = mt.launch(counted, mesh="b:2,m:2", rules=rules)[0]
    assert made["permute"] and made["all_to_all"]  # (the collectives this test is for)
    check("moves", wrt, "b:2,m:2", rules)


def test_a_penalty_on_gloo_processes():
    check("mlp", "params", "b:2", "batch:b; d_model:b", backend="torch")


def hessian_vector(on: bool) -> dict:
    torch.manual_seed(0)
    net = Mlp()
    with mt.overlap(enabled=on):
        loss = mt.reduce_mean(net(data("mlp")) ** 2)
        loss.backward(create_graph=True)  # (MeshTensor.backward passes it on, as torch's)
        norm = mt.add_n([mt.reduce_sum(p.grad ** 2) for p in net.mesh_parameters()])
        net.zero_grad()
        norm.backward()
    return {n: p.grad.to_global() for n, p in net.named_mesh_parameters()}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("rules", ["batch:b", "batch:b; d_model:b"])
def test_backward_with_create_graph_inside_overlap_raises_and_outside_is_right(rules):
    """The buckets' collectives are not differentiable: meshtorch's error naming the fix, never
    a gradient without its second order (the per-use path outside is differentiable)."""
    ref = mt.launch(hessian_vector, False)[0]
    for out in mt.launch(hessian_vector, False, mesh="b:2", rules=rules):
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-5)
    with pytest.raises(MeshTorchError, match=r"create_graph=True.*outside mt.overlap\(\)"):
        mt.launch(hessian_vector, True, mesh="b:2", rules=rules)


def input_penalty_in_overlap(reshard: bool) -> dict:
    torch.manual_seed(0)
    net = Mlp()
    with mt.overlap(reshard_after_forward=reshard, bucket_mb=1e-5, gather_mb=1e-5):
        for _ in range(2):  # (the second step: the overlap's planned buckets and prefetch)
            net.zero_grad()
            x = data("mlp").requires_grad_(True)
            (g,) = torch.autograd.grad(mt.reduce_sum(net(x) ** 2).local, x.local, create_graph=True)
            (mt.reduce_mean(net(x) ** 2) + mt.reduce_sum(mt.MeshTensor(g, x.shape, x.layout) ** 2)).backward()
    return {n: p.grad.to_global() for n, p in net.named_mesh_parameters()}


@pytest.mark.parametrize("reshard", [False, True])
def test_an_input_penalty_inside_overlap_under_fsdp_rules(reshard):
    ref = mt.launch(input_penalty_in_overlap, reshard)[0]
    for out in mt.launch(input_penalty_in_overlap, reshard, mesh="b:2", rules="batch:b; d_model:b"):
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-5)


def ring_penalty() -> None:
    q = mt.random.normal(f"batch:2,length:{L},d_kv:{K}", seed=0).requires_grad_(True)
    out = mt.reduce_sum(mt.ring_attention(q, q, q, causal=True) ** 2)
    (g,) = torch.autograd.grad(out.local, q.local, create_graph=True)


@pytest.mark.parametrize("mesh,rules", [("", ""), ("b:2", "length:b")])
def test_ring_attention_raises_for_a_second_order_gradient(mesh, rules):
    with pytest.raises(MeshTorchError, match="ring_attention has no second-order gradient"):
        mt.launch(ring_penalty, mesh=mesh, rules=rules)


def cubed(kind: str) -> list:
    """Each processor's own loss ``c·Σy³`` (``c`` = rank + 1, the Replicator's convention: the losses
    add up) of a broadcast from member 1 or a max over the axis (``grad_sum``), its input's gradient
    squared added, differentiated twice."""
    comm = mt.current().comm
    x = torch.tensor([1.0 + comm.rank, 2.0 - comm.rank], requires_grad=True)
    if kind == "broadcast":
        y = ca.broadcast(x, comm, "b", 1, grad_sum=True)
    else:
        y = ca.all_reduce_extreme(x, comm, "b", "max", grad_sum=True)
    loss = ((1.0 + comm.rank) * y ** 3).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + (g ** 2).sum()).backward()
    return x.grad.tolist()


@pytest.mark.parametrize("kind", ["broadcast", "max"])
def test_the_replicators_broadcast_and_max_differentiate_twice(kind):
    # the losses add to 3·Σy³, whose gradient 9y² goes to y's source alone; with its square 81y⁴
    # there: d/dy = 9y² + 324y³ (broadcast: y = member 1's [2, 1]; max: [2, 2], from 1 then 0)
    def d(y):
        return 9 * y ** 2 + 324 * y ** 3

    want = [[0.0, 0.0], [d(2.0), d(1.0)]] if kind == "broadcast" else [[0.0, d(2.0)], [d(2.0), 0.0]]
    assert mt.launch(cubed, kind, mesh="b:2") == want
