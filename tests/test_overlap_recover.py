"""``mt.overlap()`` after a backward that raised (caught: a loop that skips a batch on OOM or NaN):
the engine never runs the queued end of that backward, so its half-filled buckets must not carry
into the next step.

Reference: the same normal steps run without the failed one between them (bitwise: a fresh
step's gradients and loss), on threads and gloo, data parallel and FSDP rules.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import meshtorch as mt
from mesh_harness import FailingBackward

FSDP, DP = "batch:b; d_model:b", "batch:b"


class Net(mt.nn.Module):
    def __init__(self):
        super().__init__()
        d, f = mt.Dim("d_model", 8), mt.Dim("d_ff", 16)
        self.l1, self.l2, self.l3 = mt.nn.Dense(d, f), mt.nn.Dense(f, d), mt.nn.Dense(d, f)

    def forward(self, x, boom):
        y = self.l2(self.l1(x))
        y = mt.MeshTensor(FailingBackward.apply(y.local, boom), y.shape, y.layout)  # raises between l2 and l3
        return mt.reduce_mean(self.l3(y) ** 2)


def data(i: int) -> mt.MeshTensor:
    return mt.from_global(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), "batch:4,d_model:8")


def steps(fails: bool, outer: bool, bucket_mb: float) -> dict:
    """A normal step, (``fails``: a step whose backward raises, caught), a normal step; per normal
    step the loss and global gradients, and each parameter's gradient after the failed backward.
    ``outer``: one ``mt.overlap()`` block around every step (the failure is found at the next
    step's first read), else one per step (found at the block's exit)."""
    torch.manual_seed(0)
    net = Net()
    out: dict = {"losses": [], "grads": [], "after_failure": None}
    block = functools.partial(mt.overlap, bucket_mb=bucket_mb, gather_mb=bucket_mb)
    kinds = ("ok", "fail", "ok") if fails else ("ok", "ok")
    with block(enabled=outer):
        for i, kind in enumerate(kinds):
            for p in net.parameters():
                p.grad = None
            with contextlib.nullcontext() if outer else block():
                loss = net(data(i if fails else 2 * i), kind == "fail")
                try:
                    loss.backward()
                except RuntimeError as e:
                    assert str(e) == "backward failed on purpose"
            if kind == "fail":
                out["after_failure"] = after_failure(net)
                continue
            out["losses"].append(loss.item())
            out["grads"].append({n: p.grad.to_global() for n, p in net.named_mesh_parameters()})
    return out


@functools.cache
def run(rules: str, backend: str, fails: bool, outer: bool, bucket_mb: float) -> list[dict]:
    return mt.launch(steps, fails, outer, bucket_mb, mesh="b:2", rules=rules, backend=backend, timeout=60)


CASES = [(rules, "threads", outer, mb) for rules in (DP, FSDP) for outer in (False, True)
         for mb in (25.0, 1e-5)] + [(rules, "torch", outer, 1e-5) for rules in (DP, FSDP)
                                    for outer in (False, True)]


@pytest.mark.parametrize("rules,backend,outer,bucket_mb", CASES)
def test_a_step_after_a_failed_backward_is_a_fresh_step(rules, backend, outer, bucket_mb):
    failed = run(rules, backend, True, outer, bucket_mb)
    fresh = run(rules, backend, False, outer, bucket_mb)
    for a, b in zip(failed, fresh):
        assert a["losses"] == b["losses"]
        for ga, gb in zip(a["grads"], b["grads"]):
            assert ga.keys() == gb.keys()
            for n in ga:
                assert torch.equal(ga[n], gb[n]), n


def after_failure(net: Net) -> dict:
    """Each parameter's global gradient, or ``None``."""
    return {n: None if p.grad is None else p.grad.to_global() for n, p in net.named_mesh_parameters()}


def per_use_after_failure() -> dict:
    torch.manual_seed(0)
    net = Net()
    try:
        net(data(1), True).backward()
    except RuntimeError:
        pass
    return after_failure(net)


def test_data_parallel_adds_nothing_of_a_failed_backward_into_the_gradients():
    """Its buckets are added at the end of backward, which a failed one never reaches (the
    per-use path keeps what was reduced before the error: l3's gradients)."""
    for on in run(DP, "threads", True, False, 25.0):
        assert all(g is None for g in on["after_failure"].values())
    for off in mt.launch(per_use_after_failure, mesh="b:2", rules=DP):
        assert [n for n, g in off.items() if g is not None] == ["l3.kernel", "l3.bias"]


def test_fsdp_keeps_the_buckets_it_added_before_the_error_with_the_per_use_values():
    """One bucket per parameter: l3's first bucket is waited on (and added) when its second is
    launched, before the error; what was added is the per-use path's gradient."""
    off = mt.launch(per_use_after_failure, mesh="b:2", rules=FSDP)
    for on, ref in zip(run(FSDP, "threads", True, False, 1e-5), off):
        kept = {n: g for n, g in on["after_failure"].items() if g is not None}
        assert kept and set(kept) < {"l3.kernel", "l3.bias"}
        for n, g in kept.items():
            assert torch.equal(g, ref[n]), n


@pytest.mark.parametrize("rules", [DP, FSDP])
def test_without_torchs_graph_task_id_the_failure_is_found_at_the_blocks_exit(rules, monkeypatch):
    """``torch._C._current_graph_task_id`` is private: without it a read cannot tell a failed
    backward from a running one (a recomputed forward), and the block's exit finds it."""
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    failed = mt.launch(steps, True, False, 1e-5, mesh="b:2", rules=rules, timeout=60)
    for a, b in zip(failed, run(rules, "threads", False, False, 1e-5)):
        assert a["losses"] == b["losses"]
        for ga, gb in zip(a["grads"], b["grads"]):
            assert all(torch.equal(ga[n], gb[n]) for n in ga)
