"""Plain torch.nn code a user writes, under the Replicator, against one process.

Each model is tiny and float64; replica r takes the r-th block of every global
batch, and one process trains on the whole batch with the loss averaged over the
blocks (the same objective). Parameters and losses must match to 1e-9.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshtorch as mt

N, B, STEPS = 2, 4, 3   # replicas, examples per replica, steps


def launch(prog, n: int = N):
    return mt.replicator.launch_replicas(prog, num_replicas=n, timeout=60)


def assert_states_equal(got: dict, want: dict, tol: float = 1e-9) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=k)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.emb(x)).pow(2).mean()


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = kind(3, 4, batch_first=True)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1]).pow(2).mean()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return F.cross_entropy(self.out(torch.tanh(self.emb(x))).flatten(0, 1), x.flatten())


class FrozenBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 5).requires_grad_(False)
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x))).pow(2).mean()


class Scaled(nn.Module):
    """A custom module with a buffer drawn at construction (seeded: equal everywhere)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 1)
        self.register_buffer("scale", torch.randn(5))

    def forward(self, x):
        return self.lin(x * self.scale).pow(2).mean()


def _floats(g, shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _tokens(g, shape):
    return torch.randint(0, 7, (*shape, 3), generator=g)


MODELS = {
    "layernorm": (lambda: nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 1), nn.Flatten(0)),
                  lambda g, s: _floats(g, (*s, 5))),
    "embedding_padding_idx": (Embed, _tokens),
    "gru": (lambda: Recurrent(nn.GRU), lambda g, s: _floats(g, (*s, 5, 3))),
    "lstm": (lambda: Recurrent(nn.LSTM), lambda g, s: _floats(g, (*s, 5, 3))),
    "tied_weights": (Tied, _tokens),
    "frozen_submodule": (FrozenBody, lambda g, s: _floats(g, (*s, 5))),
    "custom_buffer": (Scaled, lambda g, s: _floats(g, (*s, 5))),
}


def _loss(model, x):
    y = model(x)
    return y if y.dim() == 0 else y.pow(2).mean()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_module_kinds_match_one_process(kind):
    make, inputs = MODELS[kind]
    x = inputs(torch.Generator().manual_seed(1), (STEPS, N * B))

    def build():
        return make().double()

    def opt_for(model):
        return torch.optim.AdamW(model.parameters(), lr=0.05)

    torch.manual_seed(0)
    ref = build()
    ref_opt = opt_for(ref)
    ref_losses = []
    for k in range(STEPS):
        ref_opt.zero_grad()
        loss = sum(_loss(ref, x[k, r * B:(r + 1) * B]) for r in range(N)) / N
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = build()
            opt = repl.wrap_optimizer(opt_for(model))
        r, losses = repl.replica_id, []
        for k in range(STEPS):
            opt.zero_grad()
            loss = _loss(model, x[k, r * B:(r + 1) * B])
            loss.backward()
            opt.step()
            losses.append(repl.reduce("mean", loss).item())
        return model.state_dict(), losses

    for state, losses in launch(prog):
        assert_states_equal(state, ref.state_dict())
        assert losses == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- shared helpers
def _data(steps: int = STEPS):
    return torch.randn(steps, N * B, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _mlp():
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _one_process(x, loss_fn, before_step=None, make=_mlp, change=None) -> dict:
    """One process on the global batch: the mean over the replica blocks of ``loss_fn``."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(x.shape[0]):
        if change is not None:
            change(k, model, opt)
        opt.zero_grad()
        (sum(loss_fn(model, x[k, r * B:(r + 1) * B], r) for r in range(N)) / N).backward()
        if before_step is not None:
            before_step(model)
        opt.step()
    return model.state_dict()


def _plain_loss(model, xb, r):
    return model(xb).pow(2).mean()


def _replica_steps(model, opt, x, r, loss_fn=_plain_loss, change=None) -> dict:
    """Replica ``r``'s side of :func:`_one_process`: each step on its block of the batch
    (``change`` from the second step on: the first is made before wrapping)."""
    for k in range(x.shape[0]):
        if change is not None and k:
            change(k, model, opt)
        opt.zero_grad()
        loss_fn(model, x[k, r * B:(r + 1) * B], r).backward()
        opt.step()
    return model.state_dict()


def test_wrapping_an_optimizer_twice_still_averages_once():
    """A second wrap_optimizer on the same optimizer (a helper that wraps, then the
    script wraps again; or a new bucket size) used to hook every parameter twice: the
    second hook divided the already divided gradient again, so steps were 1/N too
    small, silently. Now the second wrap replaces the first."""
    x = _data()
    ref = _one_process(x, _plain_loss)

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = _mlp()
            opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
            assert repl.wrap_optimizer(opt, bucket_mb=1e-4) is opt
        return _replica_steps(model, opt, x, repl.replica_id)

    for state in launch(prog):
        assert_states_equal(state, ref)


def _unfreeze_at_1(k, model, opt):
    if k == 0:
        model[0].requires_grad_(False)
    if k == 1:
        model[0].requires_grad_(True)


def _add_group_at_1(k, model, opt):
    if k == 0:
        opt.param_groups[0]["params"] = list(model[2].parameters())
        opt.state.clear()
    if k == 1:
        opt.add_param_group({"params": list(model[0].parameters())})


@pytest.mark.parametrize("change", [_unfreeze_at_1, _add_group_at_1], ids=["unfreeze", "add_param_group"])
@pytest.mark.parametrize("overlap", [True, False])
def test_parameters_that_become_trainable_after_wrapping_are_averaged(change, overlap):
    """Gradual unfreezing (requires_grad_(True) on a frozen body) and
    opt.add_param_group after wrap_optimizer: the buckets held only the parameters
    trainable at wrapping time, so the new ones stepped on their replica's own
    gradient and the replicas drifted apart, silently. The optimizer step now
    notices the changed set and re-buckets (and broadcasts the new parameters)."""
    x = _data()
    ref = _one_process(x, _plain_loss, change=change)

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = _mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            change(0, model, opt)
            repl.wrap_optimizer(opt, overlap=overlap)
        return _replica_steps(model, opt, x, repl.replica_id, change=change)

    for state in launch(prog):
        assert_states_equal(state, ref)


def _uneven_loss(model, xb, r):
    # replica-dependent scale: the local gradient norms differ from the global one
    return (model(xb) * (1 + 5 * r)).pow(2).mean()


def _clip(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


@pytest.mark.parametrize("accumulate", [False, True], ids=["one_backward", "no_sync_micro_batches"])
@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_clipping_between_backward_and_step_sees_the_average(overlap, accumulate):
    """clip_grad_norm_ between backward() and step() is what one process does to
    the global gradient. With overlap=False the gradients were averaged only at
    step(), so each replica clipped its own gradient and the average of the
    clipped gradients was applied, silently. Now every synchronised backward ends
    with averaged gradients, overlapped or not."""
    x = _data()
    ref = _one_process(x, _uneven_loss, before_step=_clip)

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = _mlp()
            opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      overlap=overlap)
        r = repl.replica_id
        for k in range(STEPS):
            opt.zero_grad()
            xb = x[k, r * B:(r + 1) * B]
            if accumulate:
                with repl.no_sync():
                    (_uneven_loss(model, xb[:B // 2], r) / 2).backward()
                (_uneven_loss(model, xb[B // 2:], r) / 2).backward()
            else:
                _uneven_loss(model, xb, r).backward()
            _clip(model)
            opt.step()
        return model.state_dict()

    for state in launch(prog):
        assert_states_equal(state, ref)


def _bn_net():
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()


def test_parameters_loaded_on_replica_0_reach_every_replica_beside_a_module_built_there_alone():
    """Leaving repl.context() broadcasts the wrapped optimizers' parameters from replica 0, so
    trainable weights loaded there alone reach every replica; buffers are not broadcast (docs:
    load a checkpoint on every replica). A module built on replica 0 only that wraps the model (an
    evaluation probe) must not change the collectives: broadcasting the buffers of "the model"
    counted it in there alone, a mismatched collective (review15b), a hang on gloo."""
    torch.manual_seed(7)
    saved = _bn_net()
    checkpoint = {k: v.clone() for k, v in saved.state_dict().items()}

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = _bn_net()
            if repl.replica_id == 0:
                model.load_state_dict(checkpoint)
                probe = nn.Sequential(model, nn.BatchNorm1d(1))  # replica 0 only
                assert probe[0] is model
            repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model.train()
        return {k: v for k, v in model.state_dict().items() if "running" not in k and "batches" not in k}

    want = {k: v for k, v in checkpoint.items() if "running" not in k and "batches" not in k}
    for state in launch(prog):
        assert_states_equal(state, want, tol=0)


def _dropout_masks():
    # module level: the gloo processes unpickle it
    repl = mt.Replicator(device="cpu", seed=3)
    with repl.context():
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    masks = [model[1](torch.ones(64)) for _ in range(2)]
    return repl.comm.backend, [m.tolist() for m in masks]


@pytest.mark.timeout(120)
def test_dropout_masks_are_independent_across_gloo_replicas():
    """One process on the global batch draws an independent dropout mask for every
    example. On the torch backend every replica was seeded alike and built the same
    model, so all drew the *same* masks: replica r's example i always dropped what
    replica 0's example i dropped. Replicas past 0 now continue on their own stream
    (replica 0 keeps the one-process stream, so one replica is one process)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = mt.replicator.launch_replicas(_dropout_masks, num_replicas=2, backend="torch", timeout=60)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    alone = [model[1](torch.ones(64)).tolist() for _ in range(2)]
    (backend0, masks0), (_, masks1) = out
    assert backend0 == "torch"
    assert masks0 == alone
    assert masks1[0] != masks0[0] and masks1[1] != masks0[1]


def test_step_with_a_closure_and_overlap_off_matches_one_process():
    """LBFGS calls its closure several times a step; with overlap=False that used to
    raise. Each closure's backward now ends averaged, overlapped or not."""
    x = _data(1)[0]

    def closure_for(model, opt, xs):
        def closure():
            opt.zero_grad()
            loss = sum(model(xb).pow(2).mean() for xb in xs) / len(xs)
            loss.backward()
            return loss
        return closure

    torch.manual_seed(0)
    ref = _mlp()
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=4)
    for _ in range(2):
        ref_opt.step(closure_for(ref, ref_opt, [x[r * B:(r + 1) * B] for r in range(N)]))

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = _mlp()
            opt = repl.wrap_optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4),
                                      overlap=False)
        r = repl.replica_id
        local = closure_for(model, opt, [x[r * B:(r + 1) * B]])
        for _ in range(2):
            opt.step(lambda: repl.reduce("mean", local()))
        return model.state_dict()

    for state in launch(prog):
        assert_states_equal(state, ref.state_dict())


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 1)

    def forward(self, x, scale=1.0):
        h = torch.tanh(self.a(x))
        return {"y": self.b(h) * scale, "h": h}


@pytest.mark.parametrize("amp", [False, True], ids=["float64", "autocast_bf16"])
def test_a_full_user_loop_matches_one_process(amp):
    """AdamW + StepLR + clip_grad_norm_, a dict batch with a non-tensor entry, dict
    outputs reduced with repl.reduce, eval between steps, a forward that raises
    (wrong shape) before a step, autocast(bf16) on the CPU, and the checkpoint
    loaded into a plain model: all as one process on the global batch."""
    dtype = torch.float32 if amp else torch.float64
    x = _data(4).to(dtype)
    tol = 2e-2 if amp else 1e-9     # bf16 matmuls over 4 or 8 rows round differently

    def build():
        torch.manual_seed(0)
        model = DictNet().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def train_step(model, opt, sched, batch):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(batch["x"], scale=batch["scale"])["y"].to(dtype).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return {"loss": loss.detach(), "examples": batch["x"].shape[0]}

    ref, ref_opt, ref_sched = build()
    ref_losses, ref_evals = [], []
    for k in range(4):
        ref_losses.append(train_step(ref, ref_opt, ref_sched, {"x": x[k], "scale": 2.0})["loss"].item())
        with torch.no_grad():
            ref_evals.append(ref.eval()(x[0])["y"].sum().item())
        ref.train()

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model, opt, sched = build()
            repl.wrap_optimizer(opt)
        r = repl.replica_id
        batches = iter([{"x": x[k, r * B:(r + 1) * B], "scale": 2.0} for k in range(4)])
        outs, evals = [], []
        for k in range(4):
            if k == 2:
                with pytest.raises(RuntimeError):
                    model(torch.zeros(3, 7, dtype=dtype))
            outs.append(repl.reduce("mean", repl.run(lambda b: train_step(model, opt, sched, b), batches)))
            with torch.no_grad():
                evals.append(model.eval()(x[0])["y"].sum().item())
            model.train()
        return model.state_dict(), outs, evals, opt.param_groups[0]["lr"]

    for state, outs, evals, lr in launch(prog):
        plain = DictNet().to(dtype)
        plain.load_state_dict(state)
        assert_states_equal(plain.state_dict(), ref.state_dict(), tol)
        assert [o["loss"].item() for o in outs] == pytest.approx(ref_losses, rel=tol, abs=tol)
        assert [o["examples"] for o in outs] == [float(B)] * 4
        assert evals == pytest.approx(ref_evals, rel=tol, abs=tol)
        assert lr == ref_opt.param_groups[0]["lr"]


def test_torch_syncbatchnorm_on_thread_replicas_raises_naming_the_fix():
    """torch.nn.SyncBatchNorm (DDP's recipe) needs torch.distributed's process group;
    thread-replicas have none, so it silently normalised with each replica's own
    batch. Built in repl.context() on thread-replicas, its training forward now
    raises, naming repl.convert_sync_batchnorm, which converts it and matches
    one process."""
    x = _data(1)[0]

    def make():
        return nn.Sequential(nn.Linear(5, 4), nn.SyncBatchNorm(4), nn.Linear(4, 1)).double()

    def prog(convert):
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = make()
            if convert:
                model = repl.convert_sync_batchnorm(model)
            opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        r = repl.replica_id
        model(x[r * B:(r + 1) * B]).pow(2).mean().backward()
        opt.step()
        return model.state_dict()

    with pytest.raises(mt.errors.ProcessorError, match="convert_sync_batchnorm"):
        mt.replicator.launch_replicas(prog, False, num_replicas=N, timeout=60)
    torch.manual_seed(0)
    ref = make()
    ref[1] = nn.BatchNorm1d(4).double()   # one process: plain BatchNorm (its init draws nothing)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    for state in mt.replicator.launch_replicas(prog, True, num_replicas=N, timeout=60):
        assert_states_equal(state, ref.state_dict())


@pytest.mark.parametrize("n, size, fits", [(4, 2, "4"), (3, 4, "3 or 6"), (4, 6, "4 or 8"), (2, 0, "2")])
def test_a_batch_the_replicas_do_not_divide_names_sizes_that_fit(n, size, fits):
    """A global batch smaller than the replica count, or not a multiple of it, is an
    error (every replica must get the same batch shape) that names sizes that work."""
    def prog():
        mt.Replicator(device="cpu").distribute(torch.zeros(10, 2), global_batch_size=size)

    with pytest.raises(mt.errors.ProcessorError, match=f"multiple of the {n} replicas.*use {fits}"):
        mt.replicator.launch_replicas(prog, num_replicas=n, timeout=60)


class MaxNormEmbed(nn.Module):
    def __init__(self, max_norm):
        super().__init__()
        self.emb = nn.Embedding(7, 4, max_norm=max_norm)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).pow(2).mean()


def test_embedding_max_norm_raises_naming_the_replicated_renorm():
    """nn.Embedding(max_norm=...) renormalises, in place in forward, the rows its
    input looks up: each replica renormalised only its own rows, so the replicas'
    weights drifted apart, silently. Built in repl.context() it now raises; the
    fix it names (renormalise the rows of every replica's ids, gathered, then
    look up with max_norm=None) matches one process on the global batch."""
    ids = torch.randint(0, 7, (STEPS, N * B, 3), generator=torch.Generator().manual_seed(5))

    def prog(fixed):
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = MaxNormEmbed(None if fixed else 0.5).double()
            opt = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        r = repl.replica_id
        for k in range(STEPS):
            mine = ids[k, r * B:(r + 1) * B]
            if fixed:
                with torch.no_grad():
                    torch.embedding_renorm_(model.emb.weight, repl.all_gather(mine).flatten(), 0.5, 2.0)
            opt.zero_grad()
            model(mine).backward()
            opt.step()
        return model.state_dict()

    with pytest.raises(mt.errors.ProcessorError, match="max_norm.*embedding_renorm_"):
        mt.replicator.launch_replicas(prog, False, num_replicas=N, timeout=60)
    torch.manual_seed(0)
    ref = MaxNormEmbed(0.5).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for k in range(STEPS):
        ref_opt.zero_grad()
        ref.emb(ids[k])    # one process renormalises every row of the global batch first
        (sum(ref(ids[k, r * B:(r + 1) * B]) for r in range(N)) / N).backward()
        ref_opt.step()
    for state in mt.replicator.launch_replicas(prog, True, num_replicas=N, timeout=60):
        assert_states_equal(state, ref.state_dict())


def _checkpointed_grads(reentrant: bool, overlap: bool, bucket_mb: float):
    from torch.utils.checkpoint import checkpoint

    repl = mt.Replicator(device="cpu")
    with repl.context():
        torch.manual_seed(1)
        m = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        repl.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), overlap=overlap, bucket_mb=bucket_mb)
    r = repl.replica_id
    x = _CKPT_X[r * 4:(r + 1) * 4].clone().requires_grad_(True)  # reentrant checkpointing needs it
    h = checkpoint(m[1], m[0](x), use_reentrant=reentrant)
    m[2](h).square().mean().backward()
    return [p.grad.clone() for p in m.parameters()]


_CKPT_X = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("overlap,bucket_mb", [(True, 25.0), (True, 1e-5), (False, 25.0)])
def test_activation_checkpointing_reentrant_or_not_gives_one_process_gradients(reentrant, overlap, bucket_mb):
    """Reentrant checkpointing (HF's gradient_checkpointing_enable default) runs the segment's
    backward as a nested backward with a graph task of its own: the hooks took it for a new round
    and put the parameters already in their slots again, halving the last layer's gradients on
    every replica alike (review15b). Nested backwards now join the round."""
    torch.manual_seed(1)
    ref = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    ref[2](ref[1](ref[0](_CKPT_X))).square().mean().backward()
    want = [p.grad for p in ref.parameters()]
    for got in launch(functools.partial(_checkpointed_grads, reentrant, overlap, bucket_mb)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
