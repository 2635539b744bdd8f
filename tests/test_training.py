"""Training a small MLP on several meshes equals dense single-process torch training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mt

B, D_IN, D_FF, CLS = 8, 8, 16, 4
STEPS = 20
MESHES = [("b:1", "batch:b"), ("b:2,m:2", "batch:b; d_ff:m"), ("b:2,m:2", "d_in:b; cls:m")]


def dims():
    return mt.Dim("batch", B), mt.Dim("d_in", D_IN), mt.Dim("d_ff", D_FF), mt.Dim("cls", CLS)


def make_model() -> mt.nn.Module:
    _, d_in, d_ff, cls = dims()
    return mt.nn.Sequential(mt.nn.Dense(d_in, d_ff), mt.relu, mt.nn.Dense(d_ff, cls))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, D_IN, generator=g)
    teacher = torch.randn(D_IN, CLS, generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(-1)


def mesh_loss(model, step: int) -> mt.MeshTensor:
    x, y = global_batch(step)
    xb = mt.from_global(x, "batch:8,d_in:8")
    yb = mt.from_global(y, "batch:8")
    return mt.reduce_mean(mt.cross_entropy(model(xb), yb, "cls"))


def initial_globals() -> dict[str, torch.Tensor]:
    return {n: t.to_global().detach().clone() for n, t in make_model().named_mesh_parameters()}


def dense_loss(params: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    x, y = global_batch(step)
    h = torch.relu(x @ params["0.kernel"] + params["0.bias"])
    return F.cross_entropy(h @ params["2.kernel"] + params["2.bias"], y)


def train_mesh(opt_name: str, clip: float | None = None) -> list[float]:
    model = make_model()
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    elif opt_name == "adafactor":
        opt = mt.optim.Adafactor(model, lr=1e-1, beta1=0.9, min_dim_size_to_factor=4,
                                 weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = mesh_loss(model, step)
        loss.backward()
        if clip is not None:
            mt.optim.clip_grad_norm_(model, clip)
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- references
def dense_adafactor_step(p, g, st, t, lr=1e-1, beta1=0.9, wd=0.1, min_factor=4):
    """The paper's algorithm on a plain tensor, factored over its two largest dims."""
    decay = 1.0 - t ** -0.8
    scale = lr * max(1e-3, p.pow(2).mean().sqrt().item())
    g2 = g * g + 1e-30
    order = sorted(range(g.dim()), key=lambda i: -g.shape[i])
    if g.dim() >= 2 and g.shape[order[1]] >= min_factor:
        d0, d1 = order[0], order[1]
        st["vr"] = decay * st.get("vr", torch.zeros_like(g2.mean(d0))) + (1 - decay) * g2.mean(d0)
        st["vc"] = decay * st.get("vc", torch.zeros_like(g2.mean(d1))) + (1 - decay) * g2.mean(d1)
        vr_d1 = d1 - (1 if d1 > d0 else 0)  # position of d1 once d0 is gone
        r = (st["vr"] / st["vr"].mean(vr_d1, keepdim=True)).rsqrt().unsqueeze(d0)
        c = st["vc"].rsqrt().unsqueeze(d1)
        x = g * r * c
    else:
        st["v"] = decay * st.get("v", torch.zeros_like(g2)) + (1 - decay) * g2
        x = g * st["v"].rsqrt()
    x = x / max(1.0, x.pow(2).mean().sqrt().item())
    x = x * scale
    st["m"] = beta1 * st.get("m", torch.zeros_like(x)) + (1 - beta1) * x
    p.mul_(1 - lr * wd)
    p.sub_(st["m"])


def train_dense(opt_name: str, clip: float | None = None) -> list[float]:
    params = {n: t.clone().requires_grad_(True) for n, t in initial_globals().items()}
    plist = list(params.values())
    opt = None
    if opt_name == "adamw":
        opt = torch.optim.AdamW(plist, lr=3e-2, weight_decay=0.1)
    elif opt_name == "sgd":
        opt = torch.optim.SGD(plist, lr=0.3)
    states = {n: {} for n in params}
    losses = []
    for step in range(STEPS):
        for p in plist:
            p.grad = None
        loss = dense_loss(params, step)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(plist, clip)
        if opt is not None:
            opt.step()
        else:
            with torch.no_grad():
                for n, p in params.items():
                    dense_adafactor_step(p, p.grad, states[n], step + 1)
        losses.append(loss.item())
    return losses


def assert_close_each_step(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-7), f"step {step}: {a} vs dense {b}"


@pytest.mark.parametrize("opt_name,clip", [("adamw", None), ("adafactor", None), ("sgd", 0.5)])
def test_mlp_training_matches_dense_on_every_mesh(opt_name, clip):
    want = train_dense(opt_name, clip)
    assert sum(want[-5:]) < 0.9 * sum(want[:5]), "the reference must actually learn"
    for mesh, rules in MESHES:
        per_proc = mt.launch(train_mesh, opt_name, clip, mesh=mesh, rules=rules)
        for losses in per_proc:
            assert losses == per_proc[0]  # SPMD: every processor sees the same replicated loss
        assert_close_each_step(per_proc[0], want)


def test_clip_actually_clips_and_norm_counts_each_element_once():
    def run():
        model = make_model()
        mesh_loss(model, 0).backward()
        norm = mt.optim.global_grad_norm(model)
        total = mt.optim.clip_grad_norm_(model, 0.01)
        after = mt.optim.global_grad_norm(model)
        return norm.item(), total.item(), after.item()

    params = {n: t.clone().requires_grad_(True) for n, t in initial_globals().items()}
    dense_loss(params, 0).backward()
    want = torch.sqrt(sum((p.grad ** 2).sum() for p in params.values())).item()
    for mesh, rules in MESHES + [("b:2,m:2", "batch:b; d_in:m; d_ff:b")]:
        for norm, total, after in mt.launch(run, mesh=mesh, rules=rules):
            assert math.isclose(norm, want, rel_tol=1e-5)
            assert total == norm
            assert math.isclose(after, 0.01, rel_tol=1e-4)
