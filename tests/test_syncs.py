"""No host syncs in a training step: between two log windows meshtorch reads no more values back
than plain PyTorch's same step does.

On the CPU a sync shows as a value read into Python: ``aten::_local_scalar_dense`` (``.item()``,
``float()``, ``bool()``, ``int()`` of a tensor), counted with a ``TorchDispatchMode``. On a GPU each
such read waits for the device; ``torch.cuda.set_sync_debug_mode("warn")`` counts them (and every
other synchronising call) there. The step is ``meshtorch train``'s own
(:class:`~meshtorch.recipes.lm.strategies.PlainStep` on a window of batches: it reads the window's
last loss once, for the log), held against the plain-PyTorch twin of the LM
(``benchmarks/overhead.py``'s ``PlainLM``: the same weights and the same loss, which the test also
checks) with torch's AdamW and ``torch.nn.utils.clip_grad_norm_``.

Reads per window, hand-derived: the loss, once; plus, with torch's for-each AdamW (what the host
gets, on both sides), one ``.item()`` of each parameter's step counter per step (on the host a
read of a host tensor, no sync; on a GPU the trainer uses fused AdamW, which reads none).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import meshtorch as mt
from bench_harness import load_benchmark
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.optimizer import lr_at, make_optimizer
from meshtorch.recipes.lm.steps import build_model
from meshtorch.recipes.lm.strategies import PlainStep

overhead = load_benchmark("overhead")

VOCAB, BATCH, LENGTH, STEPS = 24, 4, 8, 3
CFG = TrainConfig.of(d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, batch=BATCH, length=LENGTH,
                     clip=1.0, weight_decay=0.0, warmup=2, steps=10)
SHAPE = f"batch:{BATCH},length:{LENGTH}"
SPLIT = "batch:b; heads:m; d_ff:m; vocab:m"  # data and model split: collectives in every part


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


_counters: dict[int, list[int]] = {}  # thread -> its ScalarReads' count of tolist()/numpy() reads


@pytest.fixture(autouse=True)
def count_list_reads(monkeypatch):
    """``tolist()``/``numpy()`` read a host tensor's memory without an ATen op (and a torch-function
    mode is not on in autograd's callbacks, where the Replicator waits): count them at the method."""
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _counted(getattr(torch.Tensor, name)))


def _counted(original):
    def read(self, *args, **kwargs):
        counter = _counters.get(threading.get_ident())
        if counter is not None:
            counter[0] += 1
        return original(self, *args, **kwargs)

    return read


class ScalarReads:
    """Counts the values this thread reads back into Python while it is on:
    ``aten::_local_scalar_dense`` (``.item()``, ``float()``, ``bool()``, ``int()``), ``.tolist()``
    and ``.numpy()``."""

    def __enter__(self) -> ScalarReads:
        self._mode, self._lists = _Reads(), [0]
        _counters[threading.get_ident()] = self._lists
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        del _counters[threading.get_ident()]

    @property
    def count(self) -> int:
        return self._mode.count + self._lists[0]


@contextlib.contextmanager
def counting_syncs(device: str):
    """Yield a list that holds, on exit, the number of host syncs inside the block: values read
    into Python on the CPU, synchronising CUDA calls on a GPU."""
    out: list[int] = []
    if device == "cpu":
        with ScalarReads() as reads:
            yield out
        out.append(reads.count)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield out
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (torch's first switch to the debug mode also warns that the mode "does not yet detect all
    # synchronizing operations": that notice is not a sync)
    out.append(sum("called a synchronizing" in str(w.message) for w in caught))


def batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A warm-up batch and a window of ``STEPS`` batches (ids, next ids), global tensors."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS + 1):
        data = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
        out.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return out


def fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """make_optimizer's AdamW as it is on a GPU (fused), here on the host."""
    groups = mt.optim.weight_decay_groups(model, CFG.optimizer.weight_decay)
    return torch.optim.AdamW(groups, lr=CFG.optimizer.lr, betas=(0.9, 0.99), fused=True)


def meshtorch_window(cfg: TrainConfig, optimizer, mesh: str, rules: str, device: str = "cpu"):
    """The syncs of ``meshtorch train``'s step over one window (after a warm-up window) on every
    processor, and the window's loss."""
    data = batches(device)

    def prog():
        model = build_model(cfg, VOCAB)
        step = PlainStep(cfg, model, optimizer(model))
        window = [(mt.from_global(a, SHAPE), mt.from_global(b, SHAPE)) for a, b in data]
        step.run(window[:1], 0)  # the optimizer's state exists from here on, as in every later window
        with counting_syncs(device) as syncs:
            loss = step.run(window[1:], 1)
        return syncs[0], loss, model

    kwargs = {"device": device} if device != "cpu" else {}
    out = mt.launch(prog, mesh=mesh, rules=rules, **kwargs)
    return [s for s, _, _ in out], out[0][1], out[0][2]


def plain_window(model: torch.nn.Module, fused: bool, device: str = "cpu") -> tuple[int, float]:
    """The same window in plain PyTorch: PlainLM with ``model``'s initial weights."""
    plain = overhead.PlainLM(model).to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=CFG.optimizer.lr, betas=(0.9, 0.99), weight_decay=0.0,
                            fused=fused or None)

    def run(window, first):
        for i, (ids, tgt) in enumerate(window):
            for g in opt.param_groups:
                g["lr"] = lr_at(CFG, first + i)
            loss = plain.loss(ids, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), CFG.optimizer.clip)
            opt.step()
        return loss.item()

    data = batches(device)
    run(data[:1], 0)
    with counting_syncs(device) as syncs:
        loss = run(data[1:], 1)
    return syncs[0], loss


def fresh_model() -> torch.nn.Module:
    return build_model(CFG, VOCAB)  # the same seed as every processor's: the same initial weights


@pytest.mark.parametrize("mesh,rules", [("m:1", ""), ("b:2", "batch:b")])
def test_trainer_window_reads_the_loss_and_adamw_counters_like_plain_pytorch(mesh, rules):
    # the host's AdamW (for-each, as make_optimizer gives it off the GPU) on both sides
    ours, loss, _ = meshtorch_window(CFG, lambda m: make_optimizer(CFG, m), mesh, rules)
    theirs, plain_loss = plain_window(fresh_model(), fused=False)
    params = len(list(fresh_model().parameters()))
    assert params == len(list(overhead.PlainLM(fresh_model()).parameters()))
    assert loss == pytest.approx(plain_loss, rel=1e-5)  # the twin takes the same step
    assert theirs == 1 + STEPS * params
    assert ours == [theirs] * len(ours)


@pytest.mark.parametrize("mesh,rules", [("m:1", ""), ("b:2,m:2", SPLIT)])
def test_trainer_window_with_fused_adamw_reads_only_the_loss(mesh, rules):
    # AdamW as the trainer builds it on a GPU: then the window reads the loss and nothing else
    ours, loss, _ = meshtorch_window(CFG, fused_adamw, mesh, rules)
    theirs, plain_loss = plain_window(fresh_model(), fused=True)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert theirs == 1
    assert ours == [1] * len(ours)


def test_trainer_window_with_adafactor_reads_only_the_loss():
    cfg = CFG.replace(optimizer="adafactor")
    ours, _, _ = meshtorch_window(cfg, lambda m: make_optimizer(cfg, m), "b:2,m:2", SPLIT)
    assert ours == [1, 1, 1, 1]


def test_adafactor_reads_a_loaded_step_counter_once_and_continues_it():
    # the host copy of the counter is the counter's value: a relative step (lr=None) after
    # load_state_dict equals the uninterrupted run's 4th, and only that first step reads
    def prog():
        d, h = mt.Dim("d", 4), mt.Dim("h", 4)
        x = mt.from_global(torch.linspace(-1, 1, 8).reshape(2, 4), "batch:2,d:4")

        def run(model, opt, n):
            reads = []
            for _ in range(n):
                opt.zero_grad()
                mt.reduce_sum(model(x) ** 2).backward()
                with ScalarReads() as r:
                    opt.step()
                reads.append(r.count)
            return reads

        a = mt.nn.Dense(d, h)
        opt_a = mt.optim.Adafactor(a, min_dim_size_to_factor=2)
        run(a, opt_a, 3)
        b = mt.nn.Dense(d, h)
        b.load_state_dict(a.state_dict())
        opt_b = mt.optim.Adafactor(b, min_dim_size_to_factor=2)
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # (torch loads tensors uncopied)
        reads = run(b, opt_b, 2)
        run(a, opt_a, 2)
        weights = [(p.to_global(), q.to_global()) for p, q in zip(a.mesh_parameters(), b.mesh_parameters())]
        return reads, [float(opt_b.state[p]["step"]) for p in b.parameters()], weights

    reads, steps, weights = mt.launch(prog, mesh="m:2", rules="h:m")[0]
    assert reads == [2, 0]  # kernel and bias: each counter read once, after loading
    assert steps == [5.0, 5.0]
    for uninterrupted, resumed in weights:
        torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=0)


def test_clip_reads_nothing_unless_asked_to_raise_on_a_nonfinite_norm():
    def prog():
        w = mt.from_global(torch.tensor([3.0, 4.0]), "d:2", requires_grad=True)
        mt.reduce_sum(w * w).backward()  # grad [6, 8]: norm 10
        with ScalarReads() as quiet:
            norm = mt.optim.clip_grad_norm_([w], 5.0)
        with ScalarReads() as checked:
            mt.optim.clip_grad_norm_([w], 5.0, error_if_nonfinite=True)  # as torch's: one read
        w.grad.local.fill_(float("inf"))
        with pytest.raises(mt.MeshTorchError, match="norm is inf"):
            mt.optim.clip_grad_norm_([w], 5.0, error_if_nonfinite=True)
        return quiet.count, checked.count, norm.item()

    assert mt.launch(prog, mesh="m:2", rules="d:m") == [(0, 1, 10.0)] * 2


def test_replicator_step_reads_nothing_when_every_parameter_has_a_gradient():
    def prog():
        repl = mt.Replicator(device="cpu")
        with repl.context():
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
            opt = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
        x = torch.linspace(-1, 1, 6).reshape(2, 3) * (repl.replica_id + 1)
        counts = []
        for _ in range(3):
            with ScalarReads() as r:
                opt.zero_grad()
                model(x).square().sum().backward()
                opt.step()
            counts.append(r.count)
        return counts

    assert mt.replicator.launch_replicas(prog, num_replicas=2) == [[0, 0, 0]] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trainer_window_syncs_no_more_than_plain_pytorch():
    # on the GPU make_optimizer gives fused AdamW; the sync debug mode counts every synchronising
    # call (reads, and copies that wait), against plain PyTorch's fused step on the same GPU
    ours, loss, model = meshtorch_window(CFG, lambda m: make_optimizer(CFG, m), "m:1", "", device="cuda")
    theirs, plain_loss = plain_window(fresh_model(), fused=True, device="cuda")
    assert loss == pytest.approx(plain_loss, rel=1e-4)
    assert ours[0] <= theirs
    assert ours == [1]
