"""mt.local_attention against dense masked attention (values and gradients) on drawn meshes with
the length split, and its communication: one block of keys and one of values per split boundary."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import check_op, meshes, multi_rules_for, rand


def _dense(block):
    def f(q, k, v):
        n = q.shape[1]
        i = torch.arange(n)
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - block)
        s = torch.einsum("blhf,bmhf->bhlm", q, k) * q.shape[-1] ** -0.5
        a = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        return torch.einsum("bhlm,bmhf->blhf", a, v)
    return f


@given(data=st.data(), block=st.sampled_from([1, 2, 4]))
@settings(max_examples=10, deadline=None)
def test_local_attention_matches_dense_masked_attention(data, block):
    mesh = data.draw(meshes())
    rules = data.draw(multi_rules_for(mesh, ["batch", "length", "heads"]))
    b, n, h, f = 2, 16, 2, 4
    shape = f"batch:{b},length:{n},heads:{h},d_kv:{f}"
    inputs = [(rand(b, n, h, f, seed=s), shape) for s in range(3)]
    pieces = mt.launch(lambda: mt.zeros(shape).layout.axes_of("length"), mesh=mesh, rules=rules)[0]
    sizes = dict(p.split(":") for p in mesh.split(","))
    local = n // max(1, int(torch.tensor([int(sizes[a]) for a in pieces]).prod()))
    if local % block:
        with pytest.raises(mt.errors.ShapeError, match="block"):
            mt.launch(lambda: mt.local_attention(*(mt.from_global(t, s) for t, s in inputs), block),
                      mesh=mesh, rules=rules)
        return
    check_op(lambda q, k, v: mt.local_attention(q, k, v, block), _dense(block), inputs, mesh, rules)


def test_halo_is_one_block_per_boundary():
    block, f = 2, 4

    def prog():
        q, k, v = (mt.from_global(rand(1, 16, f, seed=s).float(), f"batch:1,length:16,d_kv:{f}",
                                  requires_grad=True) for s in range(3))
        mt.reset_comm_stats()
        y = mt.local_attention(q, k, v, block)
        fwd = mt.comm_stats().as_dict()
        mt.reset_comm_stats()
        mt.reduce_sum(y).backward()
        return fwd, mt.comm_stats().as_dict()

    halo = block * f * 4  # one block of float32 rows
    outs = mt.launch(prog, mesh="x:4", rules="length:x")
    for rank, (fwd, bwd) in enumerate(outs):
        # keys and values: each processor but the last sends its last block to the right...
        assert fwd == {"permute@x": {"calls": 2, "bytes": 2 * halo if rank < 3 else 0}}
        # ...and the halos' gradients go back to the left (the loss's own scalar all_reduce aside)
        assert bwd["permute@x"] == {"calls": 2, "bytes": 2 * halo if rank > 0 else 0}
        assert set(bwd) <= {"permute@x", "all_reduce@x"}
