"""DTensor interop on gloo processes: placements, values and gradients both ways."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import CommError

# one xdist worker runs the whole module: its module fixture launches gloo processes once
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("test_dtensor")]

G = torch.arange(96, dtype=torch.float64).reshape(4, 6, 4) / 7


def _global(shape: str) -> torch.Tensor:
    """G with its dims permuted into the order ``shape`` names them."""
    names = [p.split(":")[0] for p in shape.split(",")]
    return G.permute([("a", "b", "c").index(n) for n in names]).contiguous()


def _case(shape: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshtorch.dtensor import device_mesh

    g = _global(shape)
    x = mt.from_global(g, shape, requires_grad=True)
    dt = mt.to_dtensor(x)
    back = mt.from_dtensor(dt, shape)
    # a DTensor built by torch with other placements is redistributed into our layout
    other = distribute_tensor(g, device_mesh(), [Shard(2)] + [Replicate()] * (dt.device_mesh.ndim - 1))
    theirs = mt.from_dtensor(other, shape)
    # gradients flow through both conversions
    (mt.from_dtensor(dt * 3, shape) * x).local.sum().backward()
    return {
        "placements": [repr(p) for p in dt.placements],
        "names": dt.device_mesh.mesh_dim_names,
        "full": dt.full_tensor(),
        "local_same": torch.equal(dt.to_local(), x.local) and torch.equal(back.local, x.local),
        "back_layout": str(back.layout),
        "theirs": theirs.to_global().detach(),
        "theirs_layout_same": theirs.layout == x.layout,
        "grad": x.grad.to_global(),
    }


def program(groups: list[tuple[str, list[str]]]) -> list[list[dict]]:
    """Each group's shapes under its rules: one launch serves several rule sets on a mesh."""
    out = []
    for rules, shapes in groups:
        mt.current().rules = mt.LayoutRules(rules)
        out.append([_case(s) for s in shapes])
    return out


SHAPES_1D = ["a:4,b:6,c:4", "b:6,a:4,c:4", "c:4,b:6,a:4"]
SHAPES_2D = ["a:4,b:6,c:4", "c:4,a:4,b:6", "b:6,c:4,a:4"]
# a dim over both axes: in mesh order one Shard per axis (DTensor cuts left to right); against
# it, c:(y,x) cuts over y first, which torch 2.13 writes as _StridedShard on x with split_factor
# 2 (y's pieces); c after a holds nothing (a took both axes); b:6 over (x,y) is uneven, torch.chunk
# pieces 2, 1, 2, 1, as DTensor cuts them
SHAPES_MULTI = ["a:4,b:6,c:4", "c:4,b:6,a:4", "b:6,c:4,a:4"]


@pytest.fixture(scope="module")
def runs():
    (one,) = zip(*mt.launch(program, [("a:m; c:m", SHAPES_1D)], mesh="m:2", backend="torch", timeout=60))
    two, multi = zip(*mt.launch(program, [("a:x; b:y; c:y", SHAPES_2D),
                                          ("a:(x,y); c:(y,x); b:(x,y)", SHAPES_MULTI)],
                                mesh="x:2,y:2", backend="torch", timeout=120))
    return list(one), list(two), list(multi)


# expected placements per mesh axis, from the layout rules by hand
EXPECTED_1D = [["Shard(dim=0)"], ["Shard(dim=1)"], ["Shard(dim=0)"]]
EXPECTED_2D = [["Shard(dim=0)", "Shard(dim=1)"], ["Shard(dim=1)", "Shard(dim=0)"],
               ["Shard(dim=2)", "Shard(dim=0)"]]
EXPECTED_MULTI = [["Shard(dim=0)", "Shard(dim=0)"], ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
                  ["Shard(dim=0)", "Shard(dim=0)"]]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_round_trip_values_placements_and_grads(runs, which):
    shapes, expected, names = ((SHAPES_1D, EXPECTED_1D, ("m",)), (SHAPES_2D, EXPECTED_2D, ("x", "y")),
                               (SHAPES_MULTI, EXPECTED_MULTI, ("x", "y")))[which]
    for rank, per_proc in enumerate(runs[which]):
        for shape, want, got in zip(shapes, expected, per_proc):
            g = _global(shape)
            assert got["names"] == names
            assert got["placements"] == want, (shape, rank)
            assert torch.equal(got["full"], g), (shape, rank)
            assert got["local_same"], (shape, rank)
            assert torch.equal(got["theirs"], g), (shape, rank)
            assert got["theirs_layout_same"]
            # d/dx sum(3x * x) = 6x
            assert torch.allclose(got["grad"], 6 * g), (shape, rank)


def test_to_dtensor_needs_torch_backend():
    def f():
        return mt.to_dtensor(mt.from_global(G, "a:4,b:6,c:4"))  # threads backend: no DeviceMesh

    with pytest.raises(mt.errors.ProcessorError) as info:
        mt.launch(f, mesh="m:2", rules="a:m")
    assert isinstance(info.value.__cause__, CommError)
    assert "backend='torch'" in str(info.value)
