"""SyncBatchNorm against torch BatchNorm on the global batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.replicator import SyncBatchNorm, convert_sync_batchnorm


@settings(max_examples=6, deadline=None)
@given(n=st.sampled_from([1, 2, 4]), spatial=st.sampled_from([(), (3,), (2, 3)]), seed=st.integers(0, 99),
       momentum=st.sampled_from([0.1, None]))
def test_forward_backward_and_running_stats_match_global_batchnorm(n, spatial, seed, momentum):
    g = torch.Generator().manual_seed(seed)
    per, c = 3, 4
    x = torch.randn(n * per, c, *spatial, generator=g, dtype=torch.float64) * 3 + 5
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)       # upstream gradient
    bn_cls = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d}[len(spatial)]
    ref = bn_cls(c, momentum=momentum).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=g)
        ref.bias.uniform_(-1, 1, generator=g)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    xr = x.clone().requires_grad_(True)
    for _ in range(2):                                   # twice: running stats move, shift != 0
        (ref(xr) * w).sum().backward()
    ref.eval()
    ref_eval = ref(x)

    def prog():
        r = mt.current().rank
        bn = SyncBatchNorm(c, momentum=momentum).double()
        bn.load_state_dict(init)
        xl = x[r * per:(r + 1) * per].clone().requires_grad_(True)
        for _ in range(2):
            (bn(xl) * w[r * per:(r + 1) * per]).sum().backward()
        bn.eval()
        return xl.grad, bn.weight.grad, bn.bias.grad, bn.state_dict(), bn(xl.detach())

    out = mt.replicator.launch_replicas(prog, num_replicas=n)
    torch.testing.assert_close(torch.cat([o[0] for o in out]), xr.grad, rtol=1e-8, atol=1e-8)
    # each replica holds the gradient of its own share; averaging them x n gives the global one
    torch.testing.assert_close(sum(o[1] for o in out), ref.weight.grad, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(sum(o[2] for o in out), ref.bias.grad, rtol=1e-8, atol=1e-8)
    for o in out:
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(o[3][k], v, rtol=1e-10, atol=1e-10, msg=k)
    torch.testing.assert_close(torch.cat([o[4] for o in out]), ref_eval, rtol=1e-10, atol=1e-10)


def test_float32_large_mean_stays_accurate():
    # mean 1000, std 1: E[x^2]-E[x]^2 in float32 would lose the variance; shifting by the
    # running mean after the first step keeps it
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0)) + 1000
    ref = torch.nn.BatchNorm1d(2, momentum=None)
    sync = SyncBatchNorm(2, momentum=None)
    for _ in range(3):
        y_ref, y = ref(x), sync(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-3, atol=1e-3)


def test_convert_keeps_parameters_and_rejects_bad_input():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.Sequential(torch.nn.BatchNorm2d(2)))
    model[1][0].running_mean.fill_(3)
    w = model[1][0].weight
    conv = convert_sync_batchnorm(model)
    assert isinstance(conv[1][0], SyncBatchNorm) and conv[1][0].weight is w
    assert conv[1][0].running_mean.tolist() == [3.0, 3.0]
    assert set(conv.state_dict()) == set(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.Sequential(
        torch.nn.BatchNorm2d(2))).state_dict())
    with pytest.raises(mt.errors.ShapeError, match="channels"):
        SyncBatchNorm(3)(torch.ones(2, 4))
    with pytest.raises(mt.errors.ShapeError, match=r"\(N, C, ...\)"):
        SyncBatchNorm(3)(torch.ones(3))
