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


def _torch_backend_available() -> bool:
    import importlib

    return "torch" in getattr(importlib.import_module("meshtorch.launcher"), "BACKENDS", ())


GLOO_RUNS = [("adamw", None), ("adafactor", None), ("sgd", 0.5)]


def gloo_program(path: str):
    """Runs in each of 2 gloo processes: train with every optimizer, then save a checkpoint."""
    out = [train_mesh(opt_name, clip) for opt_name, clip in GLOO_RUNS]
    model = make_model().reset_parameters(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh_loss(model, 0).backward()
    opt.step()
    mt.save(path, model=model, optimizer=opt, step=1)
    return out, {n: v.to_global().detach() for n, v in model.named_mesh_parameters()}


@pytest.mark.skipif(not _torch_backend_available(),
                    reason="the torch.distributed (gloo) backend of mt.launch is not available")
def test_mlp_training_matches_dense_on_two_gloo_processes(tmp_path):
    """One spawn of 2 gloo processes (spawning dominates the cost): AdamW, Adafactor and
    clipped SGD each match dense torch step by step; a checkpoint the two processes
    wrote loads on one processor."""
    path = str(tmp_path / "ckpt")
    per_proc = mt.launch(gloo_program, path, mesh="b:2", rules="batch:b; d_ff:b",
                         backend="torch", nprocs=2)
    assert len(per_proc) == 2 and per_proc[0][0] == per_proc[1][0]
    for (opt_name, clip), losses in zip(GLOO_RUNS, per_proc[0][0]):
        assert_close_each_step(losses, train_dense(opt_name, clip))
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert mt.load(path, model=model, optimizer=opt)["step"] == 1
    for n, v in model.named_mesh_parameters():
        assert torch.equal(v.to_global(), per_proc[0][1][n]), n
    assert all(len(st) == 3 for st in opt.state.values())


def test_gradient_accumulation_equals_the_full_batch():
    """Two micro-batches of 4 with the loss halved give the gradient of the batch of 8."""
    def grads(micro: bool):
        model = make_model()
        x, y = global_batch(0)
        if micro:
            for half in (slice(0, 4), slice(4, 8)):
                xb = mt.from_global(x[half], "batch:4,d_in:8")
                yb = mt.from_global(y[half], "batch:4")
                (mt.reduce_mean(mt.cross_entropy(model(xb), yb, "cls")) * 0.5).backward()
        else:
            mesh_loss(model, 0).backward()
        return {n: v.grad.to_global() for n, v in model.named_mesh_parameters()}

    params = {n: t.clone().requires_grad_(True) for n, t in initial_globals().items()}
    dense_loss(params, 0).backward()
    for micro in (False, True):
        for got in mt.launch(grads, micro, mesh="b:2,m:2", rules="batch:b; d_ff:m"):
            for n, p in params.items():
                torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)


def test_activation_recomputation_through_collectives_and_dropout():
    """mt.nn.checkpoint recomputes a block with collectives and dropout in backward:
    the same loss and gradients as without recomputation, on a split mesh."""
    def run(remat: bool):
        _, d_in, d_ff, cls = dims()
        l1, l2 = mt.nn.Dense(d_in, d_ff), mt.nn.Dense(d_ff, cls)
        drop = mt.nn.Dropout(0.3)
        x, y = global_batch(0)
        xb, yb = mt.from_global(x, "batch:8,d_in:8"), mt.from_global(y, "batch:8")

        def block(t):
            return l2(drop(mt.relu(l1(t))))

        logits = mt.nn.checkpoint(block, xb) if remat else block(xb)
        loss = mt.reduce_mean(mt.cross_entropy(logits, yb, "cls"))
        loss.backward()
        return loss.item(), l1.kernel.mesh_tensor.grad.to_global()

    for mesh, rules in [("b:2,m:2", "batch:b; d_ff:m"), ("m:4", "d_ff:m")]:
        plain = mt.launch(run, False, mesh=mesh, rules=rules)
        remat = mt.launch(run, True, mesh=mesh, rules=rules)
        for (l0, g0), (l1_, g1) in zip(plain, remat):
            assert l0 == l1_
            torch.testing.assert_close(g1, g0, rtol=0, atol=0)
        assert (plain[0][1] != 0).any()


def test_bf16_autocast_trains_close_to_fp32_dense_with_fp32_master_params():
    def run():
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            with mt.autocast(torch.bfloat16):
                loss = mesh_loss(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert all(p.dtype == torch.float32 for p in model.parameters())
        return losses

    want = train_dense("adamw")
    for losses in mt.launch(run, mesh="b:2,m:2", rules="batch:b; d_ff:m")[:1]:
        assert all(math.isclose(a, b, rel_tol=5e-2) for a, b in zip(losses, want))
        assert losses != want  # the compute really was bf16


def test_fp16_loss_scaler_skips_overflowing_steps_on_every_processor():
    def run():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        scaler = mt.amp.LossScaler(init_scale=2.0 ** 22, growth_interval=3)
        before = [p.detach().clone() for p in model.parameters()]
        stepped, scales, losses = [], [], []
        for step in range(12):
            opt.zero_grad()
            with mt.autocast(torch.float16):
                loss = mesh_loss(model, step)
            scaler.scale(loss).backward()
            stepped.append(scaler.step(opt))
            scales.append(scaler.scale_value)
            losses.append(loss.item())
            if step == 0:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        return stepped, scales, losses, moved and finite

    results = mt.launch(run, mesh="b:2,m:2", rules="batch:b; d_ff:m")
    stepped, scales, losses, moved_and_finite = results[0]
    assert all(r[0] == stepped and r[1] == scales for r in results)  # agreed across the mesh
    assert stepped[0] is False and scales[0] == 2.0 ** 21  # fp16 overflow: skipped, backed off
    assert any(stepped)
    first = stepped.index(True)
    assert all(stepped[first:first + 3]) and scales[first + 2] == 2 * scales[first + 1]  # growth
    assert moved_and_finite and all(math.isfinite(v) for v in losses)


def test_lr_schedule_and_weight_decay_groups_match_dense():
    def run():
        model = make_model()
        groups = mt.optim.weight_decay_groups(model, 0.5)
        opt = torch.optim.AdamW(groups, lr=3e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        losses = []
        for step in range(8):
            opt.zero_grad()
            loss = mesh_loss(model, step)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        return losses, [len(g["params"]) for g in groups]

    params = {n: t.clone().requires_grad_(True) for n, t in initial_globals().items()}
    opt = torch.optim.AdamW([{"params": [params["0.kernel"], params["2.kernel"]], "weight_decay": 0.5},
                             {"params": [params["0.bias"], params["2.bias"]], "weight_decay": 0.0}],
                            lr=3e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    want = []
    for step in range(8):
        opt.zero_grad()
        loss = dense_loss(params, step)
        loss.backward()
        opt.step()
        sched.step()
        want.append(loss.item())
    losses, sizes = mt.launch(run, mesh="b:2,m:2", rules="batch:b; d_ff:m")[0]
    assert sizes == [2, 2]
    assert_close_each_step(losses, want)
