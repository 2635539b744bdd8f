"""mt.nn.BatchNorm against torch.nn.BatchNorm1d/2d: values, gradients and running statistics on
drawn meshes and rules, and the one all_reduce of the statistics."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import SIZES, meshes, multi_rules_for, rand

SET = settings(max_examples=8, deadline=None)


def _reference(x, torch_bn, probe, steps):
    outs = []
    for _ in range(steps):
        xi = x.clone().requires_grad_(True)
        y = torch_bn(xi)
        (y * probe).sum().backward()
        outs.append((y.detach(), xi.grad))
    return outs


@given(data=st.data(), image=st.booleans())
@SET
def test_batchnorm_matches_torch_on_every_mesh(data, image):
    mesh = data.draw(meshes())
    n, c = data.draw(SIZES), 4
    h = data.draw(SIZES) if image else None
    rules = data.draw(multi_rules_for(mesh, ["batch", "c", "h"]))
    # torch's layout: [N, C] or [N, C, H, W]; ours names the dims, C last
    x = 2 + 3 * rand(n, c, h, 2, seed=1) if image else 2 + 3 * rand(n, c, seed=1)
    shape = f"batch:{n},h:{h},w:2,c:{c}" if image else f"batch:{n},c:{c}"
    ours = x.permute(0, 2, 3, 1).contiguous() if image else x
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    probe_ours = probe.permute(0, 2, 3, 1).contiguous() if image else probe
    torch_bn = (torch.nn.BatchNorm2d if image else torch.nn.BatchNorm1d)(c, momentum=0.3).double()
    with torch.no_grad():
        torch_bn.weight.copy_(torch.linspace(0.5, 2.0, c))
        torch_bn.bias.copy_(torch.linspace(-1.0, 1.0, c))
    ref = _reference(x, torch_bn, probe, steps=2)
    torch_bn.eval()
    ref_eval = torch_bn(x).detach()

    def prog():
        bn = mt.nn.BatchNorm(mt.Dim("c", c), momentum=0.3)
        bn.weight.data.copy_(mt.from_global(torch.linspace(0.5, 2.0, c).float(), f"c:{c}").local)
        bn.bias.data.copy_(mt.from_global(torch.linspace(-1.0, 1.0, c).float(), f"c:{c}").local)
        bn.double()
        got = []
        for _ in range(2):
            t = mt.from_global(ours, shape, requires_grad=True)
            y = bn(t)
            mt.reduce_sum(y * mt.from_global(probe_ours, shape)).backward()
            got.append((y.to_global().detach(), t.grad.to_global()))
        bn.eval()
        return got, bn(mt.from_global(ours, shape)).to_global(), bn.running_var.mesh_tensor.to_global()

    for got, got_eval, running_var in mt.launch(prog, mesh=mesh, rules=rules):
        for (y, g), (ry, rg) in zip(got, ref):
            back = (lambda t: t.permute(0, 3, 1, 2)) if image else (lambda t: t)
            torch.testing.assert_close(back(y), ry)
            torch.testing.assert_close(back(g), rg)
        torch.testing.assert_close(running_var, torch_bn.running_var)
        torch.testing.assert_close((got_eval.permute(0, 3, 1, 2) if image else got_eval), ref_eval)


def test_statistics_are_one_all_reduce_of_sum_and_squares():
    def prog():
        bn = mt.nn.BatchNorm(mt.Dim("c", 3), affine=False)
        x = mt.from_global(rand(8, 4, 3), "batch:8,h:4,c:3")
        mt.reset_comm_stats()
        bn(x)
        return mt.comm_stats().as_dict()

    for stats in mt.launch(prog, mesh="b:2,s:2", rules="batch:b; h:s"):
        # the float64 sums and squares of 3 channels, over both axes at once
        assert stats == {"all_reduce@b,s": {"calls": 1, "bytes": 2 * 3 * 8}}
