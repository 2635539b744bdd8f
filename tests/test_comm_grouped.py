"""Grouped collectives (one flat call for many tensors of one axis group) and their async handles.

Reference: the same tensors through the per-tensor collectives, and the values by hand (each
processor's tensors are filled from its rank, so sums and gathers are known in closed form).
Every backend counts one call per grouped collective; the torch backend is run on 2 and 4 gloo
processes with ``async_op=True`` handles waited on after other work.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from memory_harness import BLOCK, grouped_gather_peaks
from meshtorch.comm.grouped import Handle
from meshtorch.errors import CommError
from meshtorch.plan import trace

SHAPES = [((4, 4), 0), ((3, 2, 4), 2), ((8,), 0), ((2, 4), 1)]


def tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=g) for s, _ in SHAPES]


def grouped_vs_single(axes="b") -> dict:
    """Grouped (sync and async, issued before other work and waited after it) vs per-tensor
    results on this processor, and the calls each counted."""
    comm = mt.current().comm
    xs, dims = tensors(comm.rank), [d for _, d in SHAPES]
    before = comm.stats.copy()
    works = [comm.all_gather_grouped(xs, axes, dims, async_op=True),
             comm.reduce_scatter_grouped(xs, axes, dims, async_op=True),
             comm.all_reduce_grouped(xs, axes, async_op=True)]
    # other collectives and compute may run while the grouped ones are in flight
    busy = comm.all_reduce(torch.ones(3), axes)
    got = [w.wait() for w in works]
    grouped = comm.stats - before
    before = comm.stats.copy()
    want = [[comm.all_gather(x, axes, d) for x, d in zip(xs, dims)],
            [comm.reduce_scatter(x, axes, d) for x, d in zip(xs, dims)],
            [comm.all_reduce(x, axes) for x in xs]]
    single = comm.stats - before
    sync = comm.all_gather_grouped(xs, axes, dims)
    return {"got": got, "want": want, "sync": sync, "busy": busy.tolist(), "grouped": grouped.as_dict(),
            "single": single.as_dict(), "handles": all(isinstance(w, Handle) for w in works)}


def check(results: list[dict], n: int) -> None:
    for r in results:
        assert r["handles"] and r["busy"] == [float(n)] * 3
        for got, want in zip(r["got"], r["want"]):
            for g, w in zip(got, want):
                assert g.shape == w.shape and torch.equal(g, w)
        for g, w in zip(r["sync"], r["want"][0]):
            assert torch.equal(g, w)
        # one call per grouped collective (plus the busy all_reduce), one per tensor otherwise
        calls = {k: v["calls"] for k, v in r["grouped"].items()}
        assert calls == {"all_gather@b": 1, "reduce_scatter@b": 1, "all_reduce@b": 2}
        assert r["single"]["all_gather@b"]["calls"] == len(SHAPES)
        # the same payload bytes as the per-tensor calls
        for kind in ("all_gather@b", "reduce_scatter@b"):
            assert r["grouped"][kind]["bytes"] == r["single"][kind]["bytes"]


def test_grouped_match_per_tensor_calls_on_threads():
    check(mt.launch(grouped_vs_single, mesh="b:2"), 2)
    check(mt.launch(grouped_vs_single, mesh="b:4"), 4)


def test_grouped_run_asynchronously_on_gloo_processes():
    check(mt.launch(grouped_vs_single, mesh="b:2", backend="torch", timeout=60), 2)


def sum_by_hand() -> list:
    comm = mt.current().comm
    a, b = torch.full((2, 2), comm.rank + 1.0), torch.arange(4.0) * (comm.rank + 1)
    return [t.tolist() for t in comm.reduce_scatter_grouped([a, b], "b", [1, 0])]


def test_a_grouped_gathers_peak_is_its_flat_buffers_and_copies_on_gloo():
    """The allocator's peak (torch.profiler's memory events, ``benchmarks/allocator_peak.py``) of
    a block's grouped all_gather on 2 gloo processes, against the bytes derived by hand: ``L``
    the block's local bytes (alive throughout), the packed input ``L`` (each piece copied into it
    once), gloo's staging buffer and the result ``2L`` each, the unpacked copies ``2L``. Unpacking
    once the call is done holds the result and its copies, not the packed input too (which
    would be ``6L``): with one flat buffer a block's copies cannot be views of it (a piece of
    each member lies in every member's row), so ``2L`` result + ``2L`` copies is the least."""
    local = sum(math.prod(s) * 4 for s, _ in BLOCK)
    for peaks in mt.launch(grouped_gather_peaks, mesh="b:2", backend="torch", timeout=120):
        # (the allocator rounds each block up to 64 bytes; the block's pieces are multiples of it)
        assert (peaks["call"], peaks["unpack"]) == (6 * local, 5 * local), (peaks, local)
        # packing: the input, and at most the 60 x 60 float block torch's CPU copy_ transposes
        # through (a piece gathered along an inner dim); not a copy of that piece (32 KiB) first
        assert 0 <= peaks["pack"] - 2 * local <= 60 * 60 * 4, (peaks, local)
    # the planner (meta backend, gloo's buffers) holds the same bytes
    assert [trace(gather_step, wait, mesh="b:2", staging="gloo").peak_bytes for wait in (False, True)] == [
        6 * local, 5 * local]


def gather_step(wait: bool) -> None:
    """A block's grouped all_gather, the whole call measured, or (``wait``) only its wait."""
    pieces, dims = [torch.randn(s) for s, _ in BLOCK], [d for _, d in BLOCK]
    comm = mt.current().comm
    work = comm.all_gather_grouped(pieces, "b", dims, async_op=True) if wait else None
    with mt.plan.measure():
        if work is not None:
            work.wait()
        else:
            comm.all_gather_grouped(pieces, "b", dims)


def test_grouped_reduce_scatter_by_hand():
    # member j keeps column j of a (1 + 2 = 3) and elements 2j, 2j+1 of b * (1 + 2)
    assert mt.launch(sum_by_hand, mesh="b:2") == [[[[3.0], [3.0]], [0.0, 3.0]], [[[3.0], [3.0]], [6.0, 9.0]]]


def test_meta_counts_one_call_per_grouped_collective():
    def f():
        comm = mt.current().comm
        xs = [torch.empty(4, 8, device="meta"), torch.empty(8, device="meta")]
        out = comm.reduce_scatter_grouped(xs, "b", [0, 0], async_op=True).wait()
        return [tuple(t.shape) for t in out], comm.stats.as_dict()

    shapes, stats = mt.launch(f, mesh="b:4", backend="meta")[0]
    assert shapes == [(1, 8), (2,)]
    assert stats == {"reduce_scatter@b": {"calls": 1, "bytes": 4 * (32 + 8)}}


def refuse(kind: str):
    comm = mt.current().comm
    if kind == "uneven":
        comm.reduce_scatter_grouped([torch.ones(3)], "b", [0])
    elif kind == "release":
        comm.all_reduce_grouped((torch.ones(2),), "b", release=True)
    else:
        comm.all_reduce_grouped([torch.ones(2), torch.ones(2, dtype=torch.float64)], "b")


@pytest.mark.parametrize("kind,words", [("uneven", "not divisible by the group size 2"),
                                        ("dtypes", "one dtype"), ("release", "pass a list")])
def test_uneven_pieces_mixed_dtypes_and_a_tuple_to_release_are_refused(kind, words):
    with pytest.raises(CommError, match=words):
        mt.launch(refuse, kind, mesh="b:2")


def test_one_processor_groups_return_inputs_uncounted():
    xs = [torch.ones(2)]
    comm = mt.current().comm
    before = comm.stats.calls()
    assert comm.all_reduce_grouped(xs, ()) == xs
    assert comm.reduce_scatter_grouped(xs, (), [0], async_op=True).wait() == xs
    assert comm.stats.calls() == before


def drawn(shapes: list, dims: list, axes) -> bool:
    """Grouped calls over ``axes`` of tensors of ``shapes`` (filled from the rank) give the
    per-tensor calls' bits."""
    comm = mt.current().comm
    g = torch.Generator().manual_seed(comm.rank)
    xs = [torch.randn(s, generator=g) for s in shapes]
    def equal(got, want) -> bool:
        return all(torch.equal(a, b) for a, b in zip(got, want))

    def one_buffer(got) -> bool:
        """Contiguous views of one flat result that is exactly their bytes (keeping them all
        costs nothing more than separate tensors)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in got}
        return (all(t.is_contiguous() for t in got) and len(storages) == 1
                and sum(storages.values()) == sum(t.numel() * t.element_size() for t in got))

    given = list(xs)  # released: emptied once packed
    scattered = comm.reduce_scatter_grouped(given, axes, dims, async_op=True, release=True).wait()
    reduced = comm.all_reduce_grouped(list(xs), axes)
    return (equal(comm.all_gather_grouped(xs, axes, dims),
                  [comm.all_gather(x, axes, d) for x, d in zip(xs, dims)])
            and equal(scattered, [comm.reduce_scatter(x, axes, d) for x, d in zip(xs, dims)])
            and equal(reduced, [comm.all_reduce(x, axes) for x in xs])
            and given == [] and one_buffer(scattered) and one_buffer(reduced))


@st.composite
def groups(draw):
    mesh, axes, n = draw(st.sampled_from([("b:2", "b", 2), ("b:2,m:2", "m", 2), ("b:2,m:2", ("b", "m"), 4)]))
    shapes, dims = [], []
    for _ in range(draw(st.integers(1, 4))):
        rank = draw(st.integers(1, 3))
        shape = [draw(st.integers(1, 3)) for _ in range(rank)]
        d = draw(st.integers(0, rank - 1))
        shape[d] *= n  # reduce_scatter's dim divides by the group
        shapes.append(tuple(shape))
        dims.append(d)
    return mesh, axes, shapes, dims


@given(groups())
@settings(max_examples=10, deadline=None)
def test_drawn_groups_match_per_tensor_calls_bitwise(case):
    mesh, axes, shapes, dims = case
    assert all(mt.launch(functools.partial(drawn, shapes, dims, axes), mesh=mesh))
