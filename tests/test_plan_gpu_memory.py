"""A GPU plan's memory is the caching allocator's: each storage a block, a fragmentation margin
and the CUDA context on top (plan/allocator.py), and a plan fits what is left of the GPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.plan.allocator import block_bytes, reserved_bytes, usable_bytes
from meshtorch.plan.devices import device, load_spec, save_spec
from meshtorch.plan.estimate import from_trace

MiB = 2 ** 20


@given(st.integers(1, 64 * MiB))
@settings(max_examples=60, deadline=None)
def test_a_block_is_the_request_rounded_as_the_allocator_cuts_segments(n):
    b = block_bytes(n)
    assert b % 512 == 0 and b >= n
    if n < 10 * MiB:  # cut from a 2 MiB or 20 MiB segment, the rest split off: only 512-byte rounding
        assert b - n < 512
    else:  # a segment of its own, 2 MiB-rounded; its rest is split off only when over 1 MiB
        size = -(-n // 512) * 512
        segment = -(-size // (2 * MiB)) * (2 * MiB)
        assert b == (size if segment - size > MiB else segment)
        assert b - n < MiB + 512


def _step():
    a = mt.random.normal("batch:3", seed=1)                      # 12 B: one 512-byte block
    b = mt.random.normal(f"batch:{11 * MiB // 4}", seed=2)       # 11 MiB: its whole 12 MiB segment
    c = mt.random.normal(f"batch:{21 * MiB // 8}", seed=3)       # 10.5 MiB: split off a 12 MiB one
    with mt.plan.measure():
        return [x * 2 for x in (a, b, c)]                         # a copy of each alive at once


def test_a_trace_for_a_gpu_holds_each_storage_as_its_block():
    host = mt.plan.trace(_step, mesh="b:1", device="cpu")
    gpu = mt.plan.trace(_step, mesh="b:1", device="cuda")
    assert host.peak_bytes == 2 * (12 + 11 * MiB + 21 * MiB // 2)
    assert gpu.peak_bytes == 2 * (512 + 12 * MiB + 21 * MiB // 2)


def test_a_gpu_plan_fits_what_the_context_and_the_margin_leave():
    spec = device("h100")
    assert spec.memory_margin == 0.10 and spec.context_bytes == 2 ** 29
    usable = spec.usable_memory
    m, ctx = 0.10, 2 ** 29
    assert reserved_bytes(usable, m, ctx) <= spec.memory_bytes < reserved_bytes(usable + 2, m, ctx)
    t = mt.plan.trace(_step, mesh="b:1", device="cuda")
    # a device as small as the step's peak plus its margin and context: fits to the byte, not one less
    exact = reserved_bytes(t.peak_bytes, 0.10, 2 ** 29)
    for capacity, fits in ((exact + 1, True), (exact - 2, False)):
        small = dataclasses.replace(spec, memory_bytes=capacity)
        est = from_trace(t, "b:1", small)
        assert est.fits is fits and est.memory_capacity == usable_bytes(capacity, 0.10, 2 ** 29)
    # a CPU spec has neither: its plans compare the peak with the memory itself
    cpu = dataclasses.replace(device("a100"), memory_margin=0.0, context_bytes=0)
    assert cpu.usable_memory == cpu.memory_bytes


def test_a_device_file_carries_the_allocator_numbers(tmp_path):
    spec = dataclasses.replace(device("h100"), memory_margin=0.25, context_bytes=3 * 2 ** 28)
    save_spec(spec, tmp_path / "gpu.json")
    back = load_spec(tmp_path / "gpu.json")
    assert (back.memory_margin, back.context_bytes) == (0.25, 3 * 2 ** 28)
    assert back.usable_memory == usable_bytes(spec.memory_bytes, 0.25, 3 * 2 ** 28)
    d = json.loads((tmp_path / "gpu.json").read_text())
    del d["memory_margin"], d["context_bytes"]   # an older file: neither, so no allowance
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_spec(tmp_path / "old.json").usable_memory == spec.memory_bytes


# A hand-made compiled step: p (a parameter, 100 B); x -> mm -> h -> gelu -> g -> mm -> o in the
# forward; in the backward a fused pair reads g (-> dg) and h, dg (-> dh). Storages are 40 B.
MM, ELT = ("mm", "float32", 8, 120, (1, 1, 1, 1), 1, 0), ("gelu", "float32", 0, 80, (), 1, 0)
P, X, H, G, O, DG, DH, DX = 1, 2, 3, 4, 5, 6, 7, 8
SEQ = [(MM, ((X, 40), (P, 100)), ((H, 40),)), (ELT, ((H, 40),), ((G, 40),)),
       (MM, ((G, 40), (P, 100)), ((O, 40),)),
       (ELT, ((G, 40),), ((DG, 40),)), (ELT, ((H, 40), (DG, 40)), ((DH, 40),))]
BACKWARD = [False, False, False, True, True]
EVENTS = [(P, 100), (X, 40), (H, 40), (G, 40), (O, 40), (DG, 40), (G, -40), (DH, 40), (DG, -40), (H, -40)]
AT = [3, 4, 5, 6, 8]
KIND = {P: "parameters"}


def test_a_compiled_step_keeps_neither_fused_temporaries_nor_what_it_can_remake():
    from meshtorch.plan.compiled_memory import compiled_timeline, peak_of
    from meshtorch.plan.tracing import KINDS

    eager = [(float(i), s, d) for i, (s, d) in enumerate(EVENTS)]
    assert peak_of(eager, [], KIND, KINDS)[0] == 100 + 5 * 40   # p, x, h, g, o and dg at once
    got = compiled_timeline(SEQ, AT, BACKWARD, EVENTS, KIND)
    # dg lives inside the backward's fused kernel; g is dropped after its forward reader (h, which
    # remakes it, is alive in the backward anyway); dh, a result, is written into h, which that
    # kernel reads last (Inductor's in-place buffer): h's storage lives on as dh's
    assert [(s, d) for _, s, d in got] == [(P, 100), (X, 40), (H, 40), (G, 40), (O, 40), (G, -40)]
    assert peak_of(got, [], KIND, KINDS) == (100 + 4 * 40, {"parameters": 100, "gradients": 0,
                                                            "optimizer": 0, "activations": 160})


@st.composite
def _allocations(draw):
    """Allocation events (serial, +bytes / -bytes) of storages of drawn kinds, and measured windows
    (event index ranges, some with no event in them)."""
    from meshtorch.plan.tracing import KINDS

    events, kind, alive = [], {}, {}
    for serial in range(1, draw(st.integers(0, 14)) + 1):
        if alive and draw(st.booleans()):
            freed = draw(st.sampled_from(sorted(alive)))
            events.append((freed, -alive.pop(freed)))
        else:
            alive[serial] = draw(st.integers(1, 100))
            events.append((serial, alive[serial]))
            kind[serial] = draw(st.sampled_from(KINDS))
    cuts = sorted(draw(st.lists(st.integers(0, len(events)), max_size=6)))
    return events, list(zip(cuts[::2], cuts[1::2])), kind


@settings(max_examples=150, deadline=None)
@given(_allocations())
def test_the_peak_is_the_most_alive_at_any_moment_of_a_window(step):
    """The eager trace's peak and the compiled timeline's are one computation (peak_of): against the
    bytes alive at every moment of every window, its start included, even where no event falls in
    it (the compiled peak missed those)."""
    from meshtorch.plan.compiled_memory import peak_of
    from meshtorch.plan.tracing import KINDS, Tracer

    events, windows, kind = step
    moments = [k for start, end in (windows or [(0, len(events))]) for k in range(start, end + 1)]
    live = [sum(d for _, d in events[:k]) for k in moments]
    most = max(live, default=0)
    at = moments[live.index(most)] if most else 0  # the first moment it is reached
    alive = {}
    for serial, delta in events[:at]:
        alive[serial] = alive.get(serial, 0) + delta
    want = (most, {k: sum(n for s, n in alive.items() if kind[s] == k) for k in KINDS})
    tracer = Tracer()
    tracer.events, tracer.windows, tracer.kind = events, windows, kind
    assert tracer.peak() == want
    assert peak_of([(float(i), s, d) for i, (s, d) in enumerate(events)], windows, kind, KINDS) == want


def test_what_costs_more_to_keep_than_to_save_is_saved():
    from meshtorch.plan.compiled_memory import compiled_timeline

    # h is not read in the backward (freed after gelu) and is twice g: remaking g would keep 80 B
    # for 40, so g is saved as in eager (its fused backward reader makes a result of another size)
    seq = [SEQ[0], SEQ[1], SEQ[2], (ELT, ((G, 40),), ((DG, 20),))]
    events = [(P, 100), (X, 40), (H, 80), (G, 40), (H, -80), (O, 40), (DG, 20), (G, -40)]
    got = compiled_timeline(seq, [3, 4, 6, 7], [False, False, False, True], events, KIND)
    assert [(p, s, d) for p, s, d in got] == [(float(i), s, d) for i, (s, d) in enumerate(events)]


def test_what_a_backward_matmul_reads_is_saved_not_remade():
    """Inductor's min-cut partitioner never remakes a forward result that an unfused backward op
    (a matmul's weight gradient) reads (``ban_recompute_materialized_backward``: it would be
    materialized there anyway), however cheap its inputs: GELU's output before the second
    feed-forward matmul is saved (measured on an H200: both [tokens, d_ff] tensors of every layer)."""
    from meshtorch.plan.compiled_memory import compiled_timeline

    seq = [SEQ[0], SEQ[1], SEQ[2], (MM, ((G, 40),), ((DG, 40),))]
    events = [(P, 100), (X, 40), (H, 80), (G, 40), (O, 40), (DG, 40), (G, -40), (H, -80)]
    got = compiled_timeline(seq, [3, 4, 5, 6], [False, False, False, True], events, KIND)
    assert [(p, s, d) for p, s, d in got] == [(float(i), s, d) for i, (s, d) in enumerate(events)]
    # read by a fused backward op instead, with h alive there anyway: remade, g freed after o's mm
    seq[3] = (ELT, ((G, 40),), ((DG, 40),))
    got = compiled_timeline(seq, [3, 4, 5, 6], [False, False, False, True], events, KIND)
    assert (4.75, G, -40) in got and (6.0, G, -40) not in got


def test_a_fused_kernel_writes_its_result_into_an_input_it_reads_last():
    """Inductor's in-place buffers: the loss's gradient takes the saved logits' storage, which the
    backward's fused kernel reads for the last time (measured on an H200: the compiled step's peak
    holds one of the two [tokens, vocab] tensors, not both). A same-size input still read later, or
    of another size, is not taken."""
    from meshtorch.plan.compiled_memory import compiled_timeline

    L, DL = 11, 12   # logits (saved), their gradient
    seq = [(MM, ((X, 40), (P, 100)), ((L, 80),)), (ELT, ((L, 80),), ((DL, 80),))]
    events = [(P, 100), (X, 40), (L, 80), (DL, 80), (L, -80)]
    got = compiled_timeline(seq, [3, 4], [False, True], events, KIND)
    assert [(s, d) for _, s, d in got] == [(P, 100), (X, 40), (L, 80)]
    # the logits read again after the kernel: two storages
    seq.append((MM, ((L, 80),), ((DX, 40),)))
    events = [(P, 100), (X, 40), (L, 80), (DL, 80), (DX, 40), (L, -80)]
    got = compiled_timeline(seq, [3, 4, 5], [False, True, True], events, KIND)
    assert [(s, d) for _, s, d in got] == [(s, d) for s, d in events]
    # a result of another size: two storages
    seq = [seq[0], (ELT, ((L, 80),), ((DL, 40),))]
    events = [(P, 100), (X, 40), (L, 80), (DL, 40), (L, -80)]
    got = compiled_timeline(seq, [3, 4], [False, True], events, KIND)
    assert [(s, d) for _, s, d in got] == [(s, d) for s, d in events]
    # of the same size in another dtype (bf16 logits, a float32 result of half as many elements): two
    seq = [seq[0], (ELT, ((L, 80),), ((DL, 80),))]
    events = [(P, 100), (X, 40), (L, 80), (DL, 80), (L, -80)]
    dtypes = {L: torch.bfloat16, DL: torch.float32}
    got = compiled_timeline(seq, [3, 4], [False, True], events, KIND, dtypes)
    assert [(s, d) for _, s, d in got] == [(s, d) for s, d in events]
    assert len(compiled_timeline(seq, [3, 4], [False, True], events, KIND, {L: torch.bfloat16,
                                                                           DL: torch.bfloat16})) == 3


def test_without_autograds_task_id_nothing_is_remade(monkeypatch):
    """torch._C._current_graph_task_id (private) says which ops ran in the backward; a torch without
    it plans a compiled step with its fused temporaries dropped but nothing remade."""
    import torch

    from meshtorch.plan.tracing import _in_backward
    from meshtorch.recipes.lm import TrainConfig
    from meshtorch.recipes.lm.steps import training_step

    cfg = TrainConfig.of(d_model=32, heads=4, d_kv=8, d_ff=64, layers=1, batch=4, length=16,
                         precision="bf16", mesh="b:1", rules="batch:b")

    def peak(compiled: bool) -> int:
        return mt.plan.trace(training_step(cfg, 512), mesh="b:1", rules="batch:b", compiled=compiled,
                             device="cuda").peak_bytes

    eager, remade = peak(False), peak(True)
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    assert not _in_backward()
    fused_only = peak(True)
    assert remade < fused_only < eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the shared H100 rows are checked in "
                    "test_plan_roofline.py)")
def test_the_planned_peak_is_the_allocators_on_this_gpu_cuda():
    # the 124M GPT-2 step of benchmarks/gpu_step.py (bf16, 8 x 1024 tokens), eager, as meshtorch train runs
    # it on one GPU: torch.cuda.max_memory_allocated over 3 steps from the built model, against the plan
    from bench_harness import load_benchmark
    from meshtorch.recipes.lm.steps import training_step

    gpu_step = load_benchmark("gpu_step")
    size = gpu_step.SIZES["124m"]
    cfg = gpu_step.train_config(size, "bf16", False, "cuda", lr=3e-4)
    data = gpu_step.batches(size["vocab"], size["batch"], size["length"], 3)
    measured = gpu_step.run_meshtorch(cfg, size["vocab"], data, torch.device("cuda"))["peak_bytes"]
    planned = mt.plan.trace(training_step(cfg, size["vocab"]), mesh="b:1", rules="batch:b", device="cuda")
    assert planned.peak_bytes == pytest.approx(measured, rel=0.1)


def test_an_input_still_needed_is_not_taken_over():
    """In-place only into an input the program is done with: not one that a storage remade later
    in the backward is made from (h: g is remade from it after dh's kernel), nor one held past the
    result's end (the logits l, kept by their caller until after their gradient's last use)."""
    from meshtorch.plan.compiled_memory import compiled_timeline

    Y = 9
    seq = [SEQ[0], SEQ[1], SEQ[2], (ELT, ((H, 40),), ((DH, 40),)), (MM, ((DH, 40), (P, 100)), ((Y, 40),)),
           (ELT, ((G, 40),), ((DG, 20),))]
    events = [(P, 100), (X, 40), (H, 40), (G, 40), (O, 40), (DH, 40), (Y, 40), (DH, -40), (DG, 20), (G, -40),
              (H, -40)]
    got = compiled_timeline(seq, [3, 4, 5, 6, 7, 9], [False, False, False, True, True, True], events, KIND)
    assert (5.0, DH, 40) in got and (10.0, H, -40) in got   # dh its own storage; h alive to its end
    assert (4.75, G, -40) in got                            # (g remade from h in the last kernel)
    L, DL = 11, 12
    seq = [(MM, ((X, 40), (P, 100)), ((L, 80),)), (ELT, ((L, 80),), ((DL, 80),)),
           (MM, ((DL, 80),), ((Y, 40),))]
    events = [(P, 100), (X, 40), (L, 80), (DL, 80), (Y, 40), (DL, -80), (Y, -40), (X, -40), (L, -80)]
    got = compiled_timeline(seq, [3, 4, 5], [False, True, True], events, KIND)
    assert [(s, d) for _, s, d in got] == events


def test_what_only_its_own_kernel_reads_in_the_forward_is_never_made_there():
    """A recomputed storage that no forward op after its fused run reads (the loss's float32
    log-probabilities, gathered inside the run) never exists in the forward: Inductor makes it
    inside the kernel and remakes it in the backward's."""
    from meshtorch.plan.compiled_memory import compiled_timeline

    K = 9
    seq = [SEQ[0], SEQ[1], (ELT, ((G, 40),), ((K, 40),)), (MM, ((K, 40), (P, 100)), ((O, 40),)),
           (ELT, ((G, 40), (H, 40)), ((DG, 20),))]
    events = [(P, 100), (X, 40), (H, 40), (G, 40), (K, 40), (O, 40), (DG, 20), (G, -40), (H, -40)]
    got = compiled_timeline(seq, [3, 4, 5, 6, 7], [False, False, False, False, True], events, KIND)
    assert G not in {s for _, s, _ in got} and (4.0, K, 40) in got


def test_a_fused_run_ends_at_a_host_read_and_at_the_backward():
    """Views and detaches do not end a run (Inductor fuses through them); a host read (``.item()``:
    a graph break) and the start of the backward (a second graph) do."""
    from meshtorch.plan.kernels import fusible_runs

    view, item = ("view", "float32", 0, 0, (), 0, 0), ("_local_scalar_dense", "float32", 0, 0, (), 0, 0)
    seq = [(ELT, (), ()), (view, (), ()), (ELT, (), ()), (item, (), ()), (ELT, (), ())]
    assert fusible_runs(seq) == [(0, 3), (4, 5)]
    assert fusible_runs(seq[:3], backward=[False, False, True]) == [(0, 1), (2, 3)]


def test_the_forward_and_the_backward_are_two_graphs_in_the_timeline_too():
    """Consecutive memory-bound ops on either side of the backward's start are two runs: t, made by
    the forward's and read by the backward's, is remade there from h (alive anyway), and dt, the
    backward kernel's result, has its own storage. As one run (the flags ignored) t would never
    leave the kernel and dt would be written into h."""
    from meshtorch.plan.compiled_memory import compiled_timeline

    T, DT = 9, 10
    seq = [SEQ[0], (ELT, ((H, 40),), ((T, 40),)), (ELT, ((T, 40),), ((DT, 40),))]
    events = [(P, 100), (X, 40), (H, 40), (T, 40), (DT, 40), (T, -40), (H, -40)]
    got = compiled_timeline(seq, [3, 4, 5], [False, False, True], events, KIND)
    assert {s for _, s, _ in got} == {P, X, H, DT}
    assert {s for _, s, _ in compiled_timeline(seq, [3, 4, 5], [False] * 3, events, KIND)} == {P, X, H}
