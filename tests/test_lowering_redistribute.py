"""The one engine that moves data between layouts: values, gradients and the number of collectives
for random layouts of random shapes on random meshes, against slices of the global tensor."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.layout import Layout
from meshtorch.lowering.redistribute import redistribute
from meshtorch.mesh import Mesh
from meshtorch.shape import Shape

MESHES = ["p:2", "p:4", "p:2,q:2"]


@st.composite
def cases(draw):
    mesh = Mesh(draw(st.sampled_from(MESHES)))
    ndim = draw(st.integers(1, 3))
    shape = Shape([mt.Dim(n, draw(st.sampled_from([4, 8]))) for n in "xyz"[:ndim]])

    def split():
        dims = draw(st.permutations([d.name for d in shape] + [None] * len(mesh.axis_names)))
        return {d: a for a, d in zip(mesh.axis_names, dims) if d is not None}

    return mesh, shape, split(), split()


def _piece(t: torch.Tensor, layout: Layout, coords: dict[str, int]) -> torch.Tensor:
    return t[tuple(slice(s, s + n) for s, n in layout.slices(coords))]


@given(cases())
@settings(max_examples=30, deadline=None)
def test_redistribute_gives_the_slices_and_gradients_with_one_collective_per_moved_split_axis(case):
    mesh, shape, src_split, dst_split = case
    src, dst = Layout(shape, mesh, src_split), Layout(shape, mesh, dst_split)
    g = torch.randn(shape.sizes, generator=torch.Generator().manual_seed(0))
    w = torch.randn(shape.sizes, generator=torch.Generator().manual_seed(1))

    def prog():
        coords = mt.current().coords
        x = _piece(g, src, coords).clone().requires_grad_()
        mt.reset_comm_stats()
        out = redistribute(x, src, dst)
        calls = mt.comm_stats().calls()
        # the gradient of sum(out * w) over the global tensor, given in dst's layout
        out.backward(_piece(w, dst, coords))
        return (torch.equal(out, _piece(g, dst, coords)), torch.equal(x.grad, _piece(w, src, coords)),
                calls, mt.comm_stats().as_dict())

    # an axis that was split and is held elsewhere (or nowhere) afterwards costs one collective;
    # one that becomes split costs none (a local slice)
    before = {a: shape.index(d) for d, a in src_split.items()}
    after = {a: shape.index(d) for d, a in dst_split.items()}
    want = sum(1 for a in before if before[a] != after.get(a))
    for values, grads, calls, stats in mt.launch(prog, mesh=str(mesh)):
        assert values and grads, (mesh, shape, src_split, dst_split)
        assert calls == want, (mesh, shape, src_split, dst_split, stats)


def test_an_axis_moving_to_a_free_dim_is_one_all_to_all_and_to_global_gathers():
    def prog():
        x = mt.from_global(torch.arange(16.0).reshape(4, 4), "x:4,y:4")
        mt.reset_comm_stats()
        y = mt.relayout(x, "u:4,v:4")
        moved = mt.comm_stats().as_dict()
        mt.reset_comm_stats()
        whole = y.to_global()
        return moved, mt.comm_stats().calls(kind="all_gather"), whole.tolist()

    for moved, gathers, whole in mt.launch(prog, mesh="p:2", rules="x:p; v:p"):
        assert list(moved) == ["all_to_all@p"] and moved["all_to_all@p"]["calls"] == 1
        assert gathers == 1 and whole == torch.arange(16.0).reshape(4, 4).tolist()
