"""Plain torch.nn code a user writes, under the Replicator, against one process.

Each model is tiny and float64; replica r takes the r-th block of every global
batch, and one process trains on the whole batch with the loss averaged over the
blocks (the same objective). Parameters and losses must match to 1e-9.
"""

from __future__ import annotations

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
        r = repl.replica_id
        for k in range(STEPS):
            opt.zero_grad()
            _plain_loss(model, x[k, r * B:(r + 1) * B], r).backward()
            opt.step()
        return model.state_dict()

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
        r = repl.replica_id
        for k in range(STEPS):
            if k:
                change(k, model, opt)
            opt.zero_grad()
            _plain_loss(model, x[k, r * B:(r + 1) * B], r).backward()
            opt.step()
        return model.state_dict()

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


def test_checkpoint_loaded_on_replica_0_inside_context_reaches_every_replica():
    """docs/replicator.md: the broadcast on leaving repl.context() makes the replicas
    equal "even when a checkpoint was loaded on replica 0 only". Only the
    optimizer's parameters were broadcast: BatchNorm's running statistics (and
    any buffer) kept each replica's own values, so eval outputs and saved
    state differed per replica. Buffers of modules built in the block now go too."""
    torch.manual_seed(7)
    saved = _bn_net()
    with torch.no_grad():
        saved[1].running_mean.uniform_(-1, 1)
        saved[1].running_var.uniform_(1, 2)
        saved[1].num_batches_tracked.fill_(12)
    checkpoint = {k: v.clone() for k, v in saved.state_dict().items()}
    x = _data(1)[0]

    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = _bn_net()
            model.register_buffer("flag", torch.tensor(repl.replica_id == 0))
            if repl.replica_id == 0:
                model.load_state_dict({**checkpoint, "flag": torch.tensor(True)})
            repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model.eval()
        return model.state_dict(), model(x).detach()

    saved.eval()
    for state, y in launch(prog):
        assert state.pop("flag").item() is True
        assert_states_equal(state, checkpoint, tol=0)
        torch.testing.assert_close(y, saved(x), rtol=0, atol=0)


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
