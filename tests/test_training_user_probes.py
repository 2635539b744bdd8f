"""The training loops users write from README and docs/training.md, held against the same loop in
dense single-process torch (same initial values, same data): torch.optim SGD (Nesterov momentum)
and AdamW (amsgrad, fused) with weight decay in param groups, LR schedulers, ``mt.optim.
clip_grad_norm_`` (2-, 1- and inf-norm), gradient accumulation with ``zero_grad(set_to_none=False)``,
frozen parameters unfrozen into a param group added mid-run, under FSDP, tensor-parallel, 2-D and
uneven layouts, with and without ``mt.overlap``, on threads and gloo; a run saved under one layout
and resumed under another (model, optimizer state and groups, scheduler) continues as the
uninterrupted run. Then the bugs these probes found, each with the user's code that met it.

Each loop is written once, against an ``env`` that is either the meshtorch model (inside
``mt.launch``) or the dense parameters, so the user code under test is the reference's too.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

import meshtorch as mt
from meshtorch.checkpoint import writer
from meshtorch.errors import ArgumentError, CheckpointError

B, DM, DF, CLS = 8, 8, 10, 4
LAYOUTS = {
    "fsdp": ("b:4", "batch:b; d_model:b"),
    "tp": ("b:2,m:2", "batch:b; d_ff:m; cls:m"),
    "fsdp_tp": ("b:2,m:2", "batch:b; d_model:b; d_ff:m"),
    "uneven": ("m:4", "d_ff:m; cls:m"),                    # d_ff 10 in pieces 3, 3, 3, 1
    "b3": ("b:3", "batch:b; d_model:b; d_ff:b"),           # batch 8 as 3, 3, 2; half-batches 2, 2, 0
}


def make_model() -> mt.nn.Module:
    dm, df, cls = mt.Dim("d_model", DM), mt.Dim("d_ff", DF), mt.Dim("cls", CLS)
    return mt.nn.Sequential(mt.nn.Dense(dm, df), mt.relu, mt.nn.Dense(df, dm), mt.nn.LayerNorm(dm),
                            mt.nn.Dense(dm, cls))


def batch(step: int, micro: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(B // parts, DM, generator=g)
    return x, torch.randint(0, CLS, (B // parts,), generator=g)


class MeshEnv:
    """The user's meshtorch side: the model, its loss, ``mt.optim.clip_grad_norm_``, ``mt.overlap``."""

    def __init__(self, overlap: str | None = None):
        self.model = make_model()
        self.params = dict(self.model.named_parameters())
        self.overlap = overlap

    def loss(self, step: int, micro: int = 0, parts: int = 1) -> mt.MeshTensor:
        x, y = batch(step, micro, parts)
        rows = x.shape[0]
        logits = self.model(mt.from_global(x, f"batch:{rows},d_model:{DM}"))
        return mt.reduce_mean(mt.cross_entropy(logits, mt.from_global(y, f"batch:{rows}"), "cls"))

    def block(self):
        if self.overlap is None:
            return contextlib.nullcontext()
        return mt.overlap(reshard_after_forward=self.overlap == "reshard")

    @staticmethod
    def clip(params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return mt.optim.clip_grad_norm_(params, max_norm, norm_type)


class DenseEnv:
    """The same model as plain torch tensors on one process (the reference)."""

    def __init__(self):
        start = mt.launch(lambda: {n: v.to_global() for n, v in make_model().named_mesh_parameters()})[0]
        self.params = {n: t.detach().clone().requires_grad_(True) for n, t in start.items()}

    def loss(self, step: int, micro: int = 0, parts: int = 1) -> torch.Tensor:
        x, y = batch(step, micro, parts)
        p = self.params
        h = torch.relu(x @ p["0.kernel"] + p["0.bias"])
        h = F.layer_norm(h @ p["2.kernel"] + p["2.bias"], (DM,), p["3.weight"], p["3.bias"], 1e-5)
        return F.cross_entropy(h @ p["4.kernel"] + p["4.bias"], y)

    @staticmethod
    def block():
        return contextlib.nullcontext()

    @staticmethod
    def clip(params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


def close(got: list[float], want: list[float], where: str, rel: float = 1e-5) -> None:
    assert len(got) == len(want), where
    for i, (a, b) in enumerate(zip(got, want)):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-6), f"{where}, value {i}: {a} vs dense {b}"


# ------------------------------------------------------------------ the loops (each logs floats)
def sgd_accumulating(env, steps: int = 6) -> list[float]:
    """SGD with Nesterov momentum, decay on kernels only, warmup then cosine, two half-batches per
    step with the gradients zeroed (not freed), clipped to global 2-norm 0.5."""
    p = env.params
    kernels = [v for n, v in p.items() if n.endswith("kernel")]
    vectors = [v for n, v in p.items() if not n.endswith("kernel")]
    opt = torch.optim.SGD([{"params": kernels, "weight_decay": 1e-2}, {"params": vectors, "lr": 0.05}],
                          lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)], milestones=[3])
    log = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        with env.block():
            for k in range(2):
                loss = env.loss(step, k, 2) / 2
                loss.backward()
                log.append(loss.item())
        log.append(float(env.clip(list(p.values()), 0.5)))
        opt.step()
        sched.step()
    return log


def adamw_unfreezing(env, steps: int = 6) -> list[float]:
    """The first layer frozen and left out of AdamW (amsgrad), then unfrozen at step 2 into a param
    group of its own; the gradients that exist clipped to inf-norm 0.3."""
    p = env.params
    first = [p["0.kernel"], p["0.bias"]]
    for t in first:
        t.requires_grad_(False)
    opt = torch.optim.AdamW([v for n, v in p.items() if not n.startswith("0.")], lr=1e-2,
                            weight_decay=0.1, amsgrad=True)
    log = []
    for step in range(steps):
        if step == 2:
            for t in first:
                t.requires_grad_(True)
            opt.add_param_group({"params": first, "lr": 3e-2, "weight_decay": 0.0})
        opt.zero_grad()
        with env.block():
            loss = env.loss(step)
            loss.backward()
        log.append(loss.item())
        log.append(float(env.clip([t for t in p.values() if t.grad is not None], 0.3, math.inf)))
        opt.step()
    return log


def fused_adamw_freezing(env, steps: int = 6) -> list[float]:
    """Fused AdamW; two parameters frozen at step 2 with their zeroed gradients kept (AdamW still
    decays them), one thawed again at step 4; the whole loop inside the overlap block, with
    clipping (1-norm) and the step in it; OneCycleLR."""
    p = env.params
    opt = torch.optim.AdamW(list(p.values()), lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-2, total_steps=steps)
    log = []
    with env.block():
        for step in range(steps):
            if step == 2:
                p["2.kernel"].requires_grad_(False)
                p["3.weight"].requires_grad_(False)
            if step == 4:
                p["2.kernel"].requires_grad_(True)
            opt.zero_grad(set_to_none=False)
            loss = env.loss(step)
            loss.backward()
            log.append(float(env.clip(list(p.values()), 0.2, 1.0)))
            opt.step()
            sched.step()
            log.append(loss.item())
    return log


LOOPS = {"sgd_accumulating": sgd_accumulating, "adamw_unfreezing": adamw_unfreezing,
         "fused_adamw_freezing": fused_adamw_freezing}
CASES = [("sgd_accumulating", "fsdp", "reshard"), ("sgd_accumulating", "tp", None),
         ("sgd_accumulating", "b3", "on"), ("adamw_unfreezing", "fsdp_tp", "on"),
         ("adamw_unfreezing", "uneven", None), ("adamw_unfreezing", "b3", "reshard"),
         ("fused_adamw_freezing", "fsdp", "on"), ("fused_adamw_freezing", "fsdp_tp", "reshard"),
         ("fused_adamw_freezing", "uneven", None)]
_DENSE: dict[str, list[float]] = {}


def dense(loop: str) -> list[float]:
    if loop not in _DENSE:
        _DENSE[loop] = LOOPS[loop](DenseEnv())
    return _DENSE[loop]


def run_loop(loop: str, overlap: str | None) -> list[float]:
    return LOOPS[loop](MeshEnv(overlap))


@pytest.mark.parametrize("loop,layout,overlap", CASES)
def test_a_users_loop_matches_dense_torch(loop, layout, overlap):
    mesh, rules = LAYOUTS[layout]
    logs = mt.launch(run_loop, loop, overlap, mesh=mesh, rules=rules)
    assert all(log == logs[0] for log in logs)  # losses and norms are replicated: bitwise everywhere
    close(logs[0], dense(loop), f"{loop} on {layout}, overlap {overlap}")


# ---------------------------------------------------------- save under one layout, resume under another
GROUP_STEP = 2  # where the runs without a scheduler add the thawed first layer as a param group


def build(env, kind: str):
    """Param groups by name (decay on kernels), the first layer frozen; a scheduler for AdamW
    (whose groups stay fixed: torch's schedulers do not follow groups added later)."""
    p = env.params
    first = [p["0.kernel"], p["0.bias"]]
    for t in first:
        t.requires_grad_(False)
    kernels = [v for n, v in p.items() if n.endswith("kernel") and not n.startswith("0.")]
    vectors = [v for n, v in p.items() if not n.endswith("kernel") and not n.startswith("0.")]
    groups = [{"params": kernels, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 5e-3}]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    elif kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, betas=(0.8, 0.95))
    else:
        opt = mt.optim.Adafactor(groups, lr=1e-2, beta1=0.9, min_dim_size_to_factor=4)
    if kind != "adamw":
        return opt, None, first
    thaw(opt, first)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 0.2, total_iters=3),
        torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)], milestones=[3])
    return opt, sched, first


def thaw(opt, first) -> None:
    for t in first:
        t.requires_grad_(True)
    opt.add_param_group({"params": first, "lr": 2e-2, "weight_decay": 0.0})


def resumable(env, kind: str, start: int, stop: int, path: str | None = None) -> list[float]:
    """Steps ``start`` to ``stop``: from the checkpoint at ``path`` when ``start`` > 0 (the groups
    the saved run had added are added again first), saving there after the last step otherwise."""
    opt, sched, first = build(env, kind)
    if start:
        if sched is None and start > GROUP_STEP:
            thaw(opt, first)
        assert mt.load(path, model=env.model, optimizer=opt, scheduler=sched)["step"] == start
    log = []
    for step in range(start, stop):
        if sched is None and step == GROUP_STEP:
            thaw(opt, first)
        opt.zero_grad()
        loss = env.loss(step)
        loss.backward()
        env.clip([t for t in env.params.values() if t.grad is not None], 0.5)
        opt.step()
        if sched is not None:
            sched.step()
        log.append(loss.item())
    if path is not None and not start:
        mt.save(path, model=env.model, optimizer=opt, scheduler=sched, step=stop)
    return log


def resumable_on_mesh(kind: str, start: int, stop: int, path: str | None = None) -> list[float]:
    return resumable(MeshEnv(), kind, start, stop, path)


@pytest.mark.parametrize("kind,first,then", [("sgd", "fsdp", "tp"), ("sgd", "b3", "uneven"),
                                             ("adamw", "tp", "fsdp"), ("adamw", "fsdp_tp", "b3"),
                                             ("adafactor", "fsdp_tp", "uneven"), ("adafactor", "uneven", "")])
def test_a_run_resumed_under_another_layout_continues_as_the_uninterrupted_run(tmp_path, kind, first, then):
    path = str(tmp_path / "ckpt")
    if kind == "adafactor":  # torch has none: the uninterrupted run on one processor
        want = mt.launch(resumable_on_mesh, kind, 0, 7)[0]
    else:
        want = resumable(DenseEnv(), kind, 0, 7)
    mesh, rules = LAYOUTS[first]
    got = mt.launch(resumable_on_mesh, kind, 0, 4, path, mesh=mesh, rules=rules)[0]
    mesh, rules = LAYOUTS.get(then, ("", ""))
    got += mt.launch(resumable_on_mesh, kind, 4, 7, path, mesh=mesh, rules=rules)[0]
    close(got, want, f"{kind}: {first} then {then or 'one processor'}")


def test_resuming_without_the_param_group_added_mid_run_is_refused_with_the_group_counts(tmp_path):
    path = str(tmp_path / "ckpt")
    mt.launch(resumable_on_mesh, "sgd", 0, 4, path, mesh="b:4", rules=LAYOUTS["fsdp"][1])

    def forgets():
        env = MeshEnv()
        opt, _, _ = build(env, "sgd")  # the thawed group is not added again
        mt.load(path, model=env.model, optimizer=opt)

    with pytest.raises(CheckpointError, match="3 optimizer groups, this optimizer 2"):
        mt.launch(forgets, mesh="b:2", rules="batch:b")


def gloo_program() -> list[list[float]]:
    return [run_loop("sgd_accumulating", "reshard"), run_loop("adamw_unfreezing", "on")]


def test_the_loops_on_three_gloo_processes_with_uneven_and_empty_pieces():
    """The torch backend pads uneven pieces for gloo (docs/layouts.md): batch 8 over 3 processes,
    half-batches of 2, 2 and 0 rows, d_model and d_ff split unevenly; one spawn for two loops."""
    logs = mt.launch(gloo_program, mesh="b:3", rules=LAYOUTS["b3"][1], backend="torch", nprocs=3)
    assert logs[0] == logs[1] == logs[2]
    close(logs[0][0], dense("sgd_accumulating"), "sgd_accumulating on gloo")
    close(logs[0][1], dense("adamw_unfreezing"), "adamw_unfreezing on gloo")


# ------------------------------------------------------------------ what these probes found
def adafactor_losses(how: str) -> list[float]:
    env = MeshEnv()
    params = {"module": env.model, "parameters": env.model.parameters(),
              "group": [{"params": env.model.parameters()}]}[how]
    opt = mt.optim.Adafactor(params, lr=1e-2, min_dim_size_to_factor=4)
    log = []
    for step in range(3):
        opt.zero_grad()
        loss = env.loss(step)
        loss.backward()
        opt.step()
        log.append(loss.item())
    return log


def test_adafactor_takes_the_generator_model_parameters_gives():
    """Seen: ``mt.optim.Adafactor(model.parameters())`` raised torch's "optimizer got an empty
    parameter list" (the generator was spent on Adafactor's named views before torch saw it),
    and ``[{"params": model.parameters()}]`` made an empty group that trained nothing, silently."""
    mesh, rules = LAYOUTS["tp"]
    want = mt.launch(adafactor_losses, "module", mesh=mesh, rules=rules)[0]
    assert want[0] != want[-1]
    for how in ("parameters", "group"):
        assert mt.launch(adafactor_losses, how, mesh=mesh, rules=rules)[0] == want, how


def scaled_then_clipped(env, unscale: str) -> list[float]:
    """SGD with momentum, fp32 compute scaled by powers of two (so unscaling is exact): torch's
    GradScaler recipe for clipping, ``unscale_`` before ``clip_grad_norm_``, then ``step``."""
    p = env.params
    opt = torch.optim.SGD(list(p.values()), lr=0.1, momentum=0.9)
    scaler = mt.amp.LossScaler(init_scale=2.0 ** 10, growth_interval=2) if unscale else None
    log = []
    for step in range(5):
        opt.zero_grad()
        loss = env.loss(step)
        if scaler is None:  # the dense reference: no scaling at all
            loss.backward()
            log.append(float(env.clip(list(p.values()), 0.5)))
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt if unscale == "optimizer" else list(p.values()))
            log.append(float(env.clip(list(p.values()), 0.5)))
            assert scaler.step(opt)
        log.append(loss.item())
    if scaler is not None:
        assert scaler.scale_value == 2.0 ** 12  # grew twice: no step was skipped
    return log


def scaled_on_mesh(unscale: str) -> list[float]:
    return scaled_then_clipped(MeshEnv("on"), unscale)


@pytest.mark.parametrize("unscale", ["optimizer", "parameters"])
def test_loss_scaler_unscale_then_clip_then_step_divides_the_gradients_once(unscale):
    """Seen: ``scaler.unscale_(params)``, clipping, then ``scaler.step(opt)`` divided the gradients by
    the scale a second time (updates 1024x too small, silently); ``scaler.unscale_(opt)``, torch's
    GradScaler spelling, raised "'SGD' object is not iterable"."""
    mesh, rules = LAYOUTS["fsdp_tp"]
    got = mt.launch(scaled_on_mesh, unscale, mesh=mesh, rules=rules)[0]
    close(got, scaled_then_clipped(DenseEnv(), ""), f"unscale_({unscale}) then clip")


def test_loss_scaler_unscale_twice_in_a_step_is_an_error_and_an_overflow_it_found_skips_the_step():
    def run():
        env = MeshEnv()
        opt = torch.optim.SGD(env.model.parameters(), lr=0.1)
        scaler = mt.amp.LossScaler(init_scale=4.0)
        scaler.scale(env.loss(0)).backward()
        scaler.unscale_(opt)
        with pytest.raises(ArgumentError, match="unscale_.* already .* since the last update"):
            scaler.unscale_(opt)
        before = [t.detach().clone() for t in env.model.parameters()]
        stepped = scaler.step(opt)
        moved = any(not torch.equal(a, b) for a, b in zip(before, env.model.parameters()))
        opt.zero_grad()
        scaler.scale(env.loss(1)).backward()
        if mt.current().rank == 1:  # an overflow one processor alone sees
            env.params["2.kernel"].grad.view(-1)[0] = math.inf
        found = scaler.unscale_(opt)
        before = [t.detach().clone() for t in env.model.parameters()]
        skipped = not scaler.step(opt)
        kept = all(torch.equal(a, b) for a, b in zip(before, env.model.parameters()))
        return stepped, moved, found, skipped, kept, scaler.scale_value

    for out in mt.launch(run, mesh="b:2,m:2", rules=LAYOUTS["tp"][1]):
        assert out == (True, True, True, True, True, 2.0)


def two_optimizers(env, recipe: str, overflow: bool) -> list[float]:
    """torch's GradScaler recipes with two optimizers (SGD with momentum on the kernels, Adam on the
    rest) or one, scales powers of two; ``overflow``: infs in a piece of a kernel's gradient at
    step 2 (on half the processors of the mesh). The dense side runs ``torch.amp.GradScaler``, the mesh side
    ``mt.amp.LossScaler``; ``no_update`` is meshtorch's loop that never calls ``update()``."""
    p = env.params
    kernels = [v for n, v in p.items() if n.endswith("kernel")]
    vectors = [v for n, v in p.items() if not n.endswith("kernel")]
    if recipe == "one":
        opts = [torch.optim.SGD([{"params": kernels}, {"params": vectors}], lr=0.1, momentum=0.9)]
    else:
        opts = [torch.optim.SGD(kernels, lr=0.1, momentum=0.9), torch.optim.Adam(vectors, lr=0.01)]
    kw = dict(init_scale=2.0 ** 10, growth_interval=2)
    dense = isinstance(env, DenseEnv)
    scaler = torch.amp.GradScaler("cpu", **kw) if dense else mt.amp.LossScaler(**kw)
    log = []
    for step in range(6):
        for opt in opts:
            opt.zero_grad()
        loss = env.loss(step)
        scaler.scale(loss).backward()
        if overflow and step == 2:  # the second half of d_ff: the processors at m=1 see it
            if dense:
                p["2.kernel"].grad[DF // 2:].fill_(math.inf)
            elif mt.current().coords["m"] == 1:
                p["2.kernel"].grad.fill_(math.inf)
        if recipe == "clip":
            for opt in opts:
                scaler.unscale_(opt)
            log.append(float(env.clip(list(p.values()), 0.5)))
        for opt in opts:
            scaler.step(opt)
        if recipe != "no_update":
            scaler.update()
        log += [loss.item(), scaler.get_scale() if dense else scaler.scale_value]
    return log


def two_optimizers_on_mesh(recipe: str, overflow: bool) -> list[float]:
    return two_optimizers(MeshEnv(), recipe, overflow)


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("recipe", ["steps", "clip", "no_update", "one"])
def test_loss_scaler_with_two_optimizers_matches_torchs_grad_scaler(recipe, overflow):
    """Seen: torch's recipe ``unscale_(oa); unscale_(ob); clip; step(oa); step(ob); update()`` divided
    ob's gradients twice (step(oa) updated the scale and forgot ob was unscaled), and the scale
    changed at each ``step`` and again at ``update()``: twice per iteration with two optimizers, and
    with one optimizer and ``update()`` too (growth twice as fast as torch's). An overflow in one
    optimizer's gradients skips that optimizer's step only, and halves the scale once, as torch's."""
    mesh, rules = LAYOUTS["tp"]
    want = two_optimizers(DenseEnv(), "steps" if recipe == "no_update" else recipe, overflow)
    for got in mt.launch(two_optimizers_on_mesh, recipe, overflow, mesh=mesh, rules=rules):
        close(got, want, f"{recipe}, overflow={overflow}")
    assert want[-1] == (2.0 ** 11 if overflow else 2.0 ** 13)  # (torch backed off once)


def two_losses(env, overflow: bool, update: bool = True) -> list[float]:
    """torch's recipe with two optimizers and two losses: per optimizer ``scale(loss)``,
    ``backward``, ``unscale_``, clip, ``step``; then one ``update()`` (or none, meshtorch's loop).
    The second loss is scaled after the first optimizer stepped. ``overflow``: infs in the first
    kernel's gradient at steps 0 and 3 (on the processors at m=1)."""
    p = env.params
    kernels = [v for n, v in p.items() if n.endswith("kernel")]
    vectors = [v for n, v in p.items() if not n.endswith("kernel")]
    opts = [(torch.optim.SGD(kernels, lr=0.1, momentum=0.9), kernels),
            (torch.optim.Adam(vectors, lr=0.01), vectors)]
    kw = dict(init_scale=2.0 ** 10, growth_interval=2)
    dense = isinstance(env, DenseEnv)
    scaler = torch.amp.GradScaler("cpu", **kw) if dense else mt.amp.LossScaler(**kw)
    log = []
    for step in range(6):
        for opt, _ in opts:
            opt.zero_grad()
        for micro, (opt, params) in enumerate(opts):
            loss = env.loss(step, micro, 2)
            scaler.scale(loss).backward()
            if overflow and micro == 0 and step in (0, 3):
                if dense:
                    p["0.kernel"].grad[:, DF // 2:].fill_(math.inf)
                elif mt.current().coords["m"] == 1:
                    p["0.kernel"].grad.fill_(math.inf)
            scaler.unscale_(opt)
            log.append(float(env.clip(params, 0.5)))
            scaler.step(opt)
            log.append(loss.item())
        if update:
            scaler.update()
        log.append(scaler.get_scale() if dense else scaler.scale_value)
    return log


def two_losses_on_mesh(overflow: bool, update: bool) -> list[float]:
    return two_losses(MeshEnv(), overflow, update)


@pytest.mark.parametrize("overflow, update", [(False, True), (True, True), (True, False)])
def test_loss_scaler_with_two_losses_scaled_between_steps_matches_torchs_grad_scaler(overflow, update):
    """Seen: the second optimizer's ``scaler.scale(loss)``, after the first optimizer's step and
    before the first ``update()``, updated the scale there (taken for a loop that calls no
    ``update()``): the first iteration's scale changed twice (growth twice as fast as torch's),
    and after an overflow the second loss was scaled by half the scale its optimizer's gradients
    (the first loss's too) were divided by. Without ``update()`` (meshtorch's loop) the numbers
    are torch's with it: the scale changes once per iteration, after both optimizers' steps."""
    mesh, rules = LAYOUTS["tp"]
    want = two_losses(DenseEnv(), overflow)
    for got in mt.launch(two_losses_on_mesh, overflow, update, mesh=mesh, rules=rules):
        close(got, want, f"overflow={overflow}, update={update}")


def test_loss_scaler_refuses_a_second_step_with_no_loss_scaled_between():
    def run():
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.25)
        scaler = mt.amp.LossScaler(init_scale=4.0)
        scaler.scale((w * w).sum()).backward()
        scaler.step(opt)
        with pytest.raises(ArgumentError, match="step.* already called .* no loss was scaled since"):
            scaler.step(opt)  # would divide the unscaled gradients by the scale again
        opt.zero_grad()
        scaler.scale((w * w).sum()).backward()  # a loop without update(): the next iteration
        return scaler.step(opt), w.tolist()

    assert mt.launch(run, mesh="b:1") == [(True, [0.25, 0.25])]


def test_loss_scaler_step_communicates_on_every_processor_whatever_unscale_was_given():
    """Each processor holds other parameters (as a pipeline's stages do) and unscales those it clips:
    processor 0 leaves one of its parameters to ``step``, processor 1 none. ``step`` decided whether
    to all-reduce the overflow flag on what was left locally, so processor 0 waited alone."""
    def run():
        rank = mt.current().rank
        w = torch.nn.Parameter(torch.full((2,), 1.0))
        params = [torch.nn.Parameter(torch.full((2,), 2.0)), w] if rank == 0 else [w]
        opt = torch.optim.SGD(params, lr=0.25)
        scaler = mt.amp.LossScaler(init_scale=2.0 ** 10)
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        scaler.unscale_([w])
        mt.optim.clip_grad_norm_([w], 100.0)
        return scaler.step(opt), [p.tolist() for p in params]

    out = mt.launch(run, mesh="b:2", timeout=20)
    assert out == [(True, [[1.0, 1.0], [0.5, 0.5]]), (True, [[0.5, 0.5]])]


def test_weight_decay_groups_of_parameters_instead_of_the_module_says_so():
    """Seen: an AttributeError ("'generator' object has no attribute 'named_parameters'")."""
    model = make_model()
    with pytest.raises(ArgumentError, match="weight_decay_groups.*module.*model.parameters"):
        mt.optim.weight_decay_groups(model.parameters(), 0.1)


def background_save(path: str) -> None:
    mt.save(path, model=make_model(), step=1, background=True)  # the program ends with it in flight


def test_a_background_save_a_program_ends_with_is_committed_before_the_launch_returns(tmp_path, monkeypatch):
    """Seen: ``mt.launch`` returned while a processor's background save was still being written, so
    the next launch's ``mt.load`` found no checkpoint (a notebook's train-then-resume cells), and a
    failed write was only a warning when Python exited."""
    path, real = str(tmp_path / "ckpt"), writer._write_slices

    def slow(tmp, rank, mine):
        import time

        time.sleep(0.3)
        return real(tmp, rank, mine)

    monkeypatch.setattr(writer, "_write_slices", slow)
    mt.launch(background_save, path, mesh="b:2", rules="batch:b; d_ff:b")
    assert mt.checkpoint.latest(path) == os.path.join(path, "step-000001")

    def failing(tmp, rank, mine):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(tmp, rank, mine)

    monkeypatch.setattr(writer, "_write_slices", failing)
    with pytest.raises(CheckpointError, match="background save .* No space left on device"):
        mt.launch(background_save, str(tmp_path / "full"), mesh="b:2", rules="batch:b; d_ff:b")


def background_save_then_raise(path: str) -> None:
    mt.save(path, model=make_model(), step=1, background=True)
    if mt.current().rank == 0:
        raise ValueError("a bug on processor 0")


def test_a_launch_that_fails_on_threads_returns_with_its_background_saves_ended(tmp_path, monkeypatch):
    """Seen: processor 0 raised with its background save in flight; the launch raised at once while
    its writer thread was still writing (no checkpoint yet), and the job stayed registered under the
    context's ``id()``, which a later processor context could be given."""
    from meshtorch.checkpoint import background

    path, real = str(tmp_path / "ckpt"), writer._write_slices

    def slow(tmp, rank, mine):
        import time

        time.sleep(0.3)
        return real(tmp, rank, mine)

    monkeypatch.setattr(writer, "_write_slices", slow)
    with pytest.raises(ValueError, match="a bug on processor 0"):
        mt.launch(background_save_then_raise, path, mesh="b:2", rules="batch:b; d_ff:b")
    assert mt.checkpoint.latest(path) == os.path.join(path, "step-000001")  # written and committed
    assert not background._jobs
    keys = mt.launch(lambda: mt.current().key, mesh="b:2")
    assert len(set(keys)) == 2 and keys != mt.launch(lambda: mt.current().key, mesh="b:2")


def test_loading_into_an_optimizer_of_another_model_says_so(tmp_path):
    """Seen: "optimizer group 0 holds parameters [None, None, ...] here but ['0.kernel', ...]" for
    a model built again whose old optimizer was passed to ``mt.load``."""
    path = str(tmp_path / "ckpt")

    def run():
        model = make_model()
        opt = torch.optim.AdamW(model.parameters())
        mt.save(path, model=model, optimizer=opt, step=1)
        mt.load(path, model=make_model(), optimizer=opt)

    with pytest.raises(CheckpointError, match="group 0 holds 8 parameter.*not in the model given; build"):
        mt.launch(run, mesh="b:2", rules=LAYOUTS["fsdp"][1])


def test_clip_grad_norm_takes_the_inf_spelled_as_torch_takes_it():
    """Seen: ``norm_type="inf"``, which ``torch.nn.utils.clip_grad_norm_`` takes, raised "must be real
    number, not str"."""
    def norms():
        env = MeshEnv()
        env.loss(0).backward()
        clipped = mt.optim.clip_grad_norm_(env.model, 1e3, "inf")
        return [float(clipped), float(mt.optim.global_grad_norm(env.model, "inf"))]

    dense_env = DenseEnv()
    dense_env.loss(0).backward()
    want = float(torch.nn.utils.clip_grad_norm_(list(dense_env.params.values()), 1e3, "inf"))
    mesh, rules = LAYOUTS["fsdp_tp"]
    for got in mt.launch(norms, mesh=mesh, rules=rules):
        close(got, [want, want], "inf-norm")


def clipped_with_an_empty_piece(norm_type) -> tuple[tuple[int, ...], float, list[float]]:
    w = mt.from_global(torch.tensor([3.0, -4.0]), "d:2", requires_grad=True)
    mt.reduce_sum(w * w).backward()   # grad = [6, -8], in pieces of 1, 1 and 0 over m:3
    norm = float(mt.optim.clip_grad_norm_([w], 2.0, norm_type))
    return tuple(w.local.shape), norm, w.grad.to_global().tolist()


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("norm_type", ["inf", 2.0])
def test_clip_grad_norm_with_an_empty_piece_on_a_processor(norm_type, backend):
    """Seen: ``norm_type="inf"`` raised "_foreach_norm cannot compute the infinity norm on an empty
    tensor" on the processor whose piece of an uneven layout was empty (d:2 over m:3)."""
    g = torch.tensor([6.0, -8.0], requires_grad=True)
    g.grad = g.detach().clone()
    want = float(torch.nn.utils.clip_grad_norm_([g], 2.0, norm_type))
    kw = dict(backend="torch", nprocs=3) if backend == "gloo" else {}
    out = mt.launch(clipped_with_an_empty_piece, norm_type, mesh="m:3", rules="d:m", timeout=60, **kw)
    assert [shape for shape, _, _ in out] == [(1,), (1,), (0,)]
    for _, norm, grad in out:
        close([norm] + grad, [want] + g.grad.tolist(), f"{norm_type}-norm on {backend}")


def test_loss_scaler_in_a_loop_with_update_refuses_a_second_step_naming_update():
    """A loop that calls update() and then steps an optimizer twice in an iteration (a loss scaled
    between the steps): refused as torch's GradScaler refuses it, the message saying this loop calls
    update(), not that no loss was scaled."""
    def run():
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.25)
        scaler = mt.amp.LossScaler(init_scale=4.0)
        for _ in range(2):
            scaler.scale((w * w).sum()).backward()
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
        scaler.scale((w * w).sum()).backward()
        scaler.step(opt)
        scaler.scale((w * w).sum()).backward()
        with pytest.raises(ArgumentError, match=r"step.* already called .*, and this loop calls update\(\)"):
            scaler.step(opt)
        return True

    assert mt.launch(run, mesh="b:1") == [True]
