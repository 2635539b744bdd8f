"""``cross_entropy_rows``, ``mt.cross_entropy``'s fused hard-target path for bf16/fp16 logits (and
float32 logits on the CPU, bitwise the eager chunks under an ``aot_eager`` compile): the
float32 loss and the gradient of the float64 computation on the same logits, across chunk boundaries,
with ``ignore_index`` and ``z_loss``, on every layout the strategies draw (a split vocabulary takes
the composed float32 path: the same numbers); nothing float32 [rows, vocab] saved for the backward
(saved-tensor hooks), the CPU allocator's peak a chunk's, not the rows', ``torch.compile(fullgraph=True)``
and the planner's trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd

import meshtorch as mt
import meshtorch.caching as caching
import meshtorch.ops.cross_entropy_rows as rows_module
import meshtorch.ops.nn as nn_ops
from bench_harness import load_benchmark
from mesh_harness import aten_ops, meshes, rules_for, torch_mode_flags_kept
from meshtorch.compiler import compile_step, graph_breaks
from meshtorch.ops.cross_entropy_rows import CHUNK_BYTES, chunk_bytes, chunk_rows, cross_entropy_rows

ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # the relative step between neighbours


def reference(x: torch.Tensor, ids: torch.Tensor, ignore_index, z_loss: float) -> torch.Tensor:
    """Per-row loss of ``x`` [rows, vocab] as ``mt.cross_entropy`` defines it, by torch's own ops
    in whatever dtype ``x`` has (float64 here)."""
    per = F.cross_entropy(x, ids, ignore_index=-1000 if ignore_index is None else ignore_index,
                          reduction="none") + z_loss * torch.logsumexp(x, -1).square()
    return per if ignore_index is None else per.masked_fill(ids == ignore_index, 0.0)


def logits_and_ids(n: int, v: int, dtype, ignore_index, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    if ignore_index is not None:
        ids[::3] = ignore_index
    return x, ids, torch.randn(n, generator=g, dtype=torch.float64)


def assert_float64_loss_and_gradient(x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor, loss: torch.Tensor,
                                     ignore_index=None, z_loss: float = 0.0) -> None:
    """``loss`` within float32 rounding of the float64 loss of the same low-precision logits ``x``,
    and ``x.grad`` (from ``(loss * up).sum().backward()``) within one step of ``x``'s dtype of the
    float64 gradient."""
    x64 = x.detach().double().requires_grad_()
    want = reference(x64, ids, ignore_index, z_loss)
    (want * up).sum().backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=ULP[x.dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
@pytest.mark.parametrize("z_loss", [0.0, 0.25])
def test_rows_are_the_float64_loss_and_gradient_across_chunk_boundaries(dtype, ignore_index, z_loss):
    """11 rows in chunks of 4 (4, 4, 3): the loss within float32 rounding of the float64 loss of the
    same low-precision logits (and of meshtorch's former formula, log_softmax in float32), the
    gradient the float64 gradient rounded to the logits' dtype (within one step of it)."""
    n, v = 11, 37
    x, ids, up = logits_and_ids(n, v, dtype, ignore_index)
    x = x.requires_grad_()
    with chunk_bytes(4 * v * 4):
        loss = cross_entropy_rows(x, ids, ignore_index=ignore_index, z_loss=z_loss)
        (loss * up.float()).sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype
    assert_float64_loss_and_gradient(x, ids, up, loss, ignore_index, z_loss)
    safe = ids.clamp(0, v - 1)
    former = -torch.log_softmax(x.detach(), -1, dtype=torch.float32).gather(-1, safe[:, None]).squeeze(-1)
    former = former + z_loss * torch.logsumexp(x.detach().float(), -1).square()
    if ignore_index is not None:
        former = former.masked_fill(ids == ignore_index, 0.0)
    torch.testing.assert_close(loss, former, rtol=1e-6, atol=1e-6)
    if ignore_index is not None:
        assert (x.grad[ids == ignore_index] == 0).all() and (loss[ids == ignore_index] == 0).all()


@pytest.mark.parametrize("z_loss, ignore_index", [(0.0, None), (0.25, 3)])
def test_the_generated_kernels_are_the_float64_loss_and_gradient(z_loss, ignore_index):
    """``chunk_bytes(0)`` (CUDA's default, forced on the CPU here): the rows whole in two compiled
    kernels, the float32 loss and the gradient of the float64 computation, as the chunks give them;
    the compiled forward and backward ran (no fallback), and autograd keeps the logits, ids and a
    float32 number per row."""
    from meshtorch.ops.cross_entropy_rows import _Kernels

    n, v = 11, 37
    x, ids, up = logits_and_ids(n, v, torch.bfloat16, ignore_index)
    x = x.requires_grad_()
    saved = []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    calls = _Kernels.compiled_calls
    with chunk_bytes(0), keep:
        loss = cross_entropy_rows(x, ids, ignore_index=ignore_index, z_loss=z_loss)
    (loss * up.float()).sum().backward()
    assert "cpu" not in _Kernels.failed and _Kernels.compiled_calls == calls + 2, _Kernels.last_error
    assert max(t.numel() for t in saved if t.dtype == torch.float32) == n, [(t.dtype, t.shape) for t in saved]
    assert_float64_loss_and_gradient(x, ids, up, loss, ignore_index, z_loss)
    if ignore_index is not None:
        assert (x.grad[ids == ignore_index] == 0).all() and (loss[ids == ignore_index] == 0).all()


def test_kernels_that_fail_to_compile_fall_back_to_chunks_with_one_warning(monkeypatch):
    """Where Inductor cannot compile for the device (it raises BackendCompilerFailed, a missing C++
    compiler among its causes), the rows run in that device's fallback chunks (the same numbers)
    and a RuntimeWarning names the failure, once."""
    import warnings

    import meshtorch.ops.cross_entropy_rows as rows_mod

    class NoBackend(Exception):
        pass

    def broken(fn):
        def call(*args):
            raise NoBackend("no Inductor backend for this device\nmore")
        return call

    monkeypatch.setattr(rows_mod, "_compiled", broken)
    monkeypatch.setattr(rows_mod, "_compile_failed", lambda: NoBackend)
    for name, value in (("failed", {}), ("forward", None), ("backward", None)):
        monkeypatch.setattr(rows_mod._Kernels, name, value)
    n, v = 9, 23
    x, ids, up = logits_and_ids(n, v, torch.bfloat16, None)
    x = x.requires_grad_()
    said = (r"generating its kernels failed on cpu \(NoBackend: no Inductor backend for this device\); "
            r"the rows run in chunks of 2 MiB")
    with chunk_bytes(0), pytest.warns(RuntimeWarning, match=said):
        loss = cross_entropy_rows(x, ids)
    with chunk_bytes(0), warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call chunks without a word
        again = cross_entropy_rows(x, ids)
    (loss * up.float()).sum().backward()
    assert_float64_loss_and_gradient(x, ids, up, loss)
    torch.testing.assert_close(again, loss)


def test_a_users_bad_ids_raise_their_error_and_leave_the_kernels_on(monkeypatch):
    """Ids of the wrong length inside the compiled kernel: the user gets the error the chunks give
    in torch's own words, no warning, and the next good call runs in the kernels (nothing marked
    failed: a user's error is not a missing backend)."""
    import warnings

    import meshtorch.ops.cross_entropy_rows as rows_mod

    for name, value in (("failed", {}), ("forward", None), ("backward", None)):
        monkeypatch.setattr(rows_mod._Kernels, name, value)
    x, ids, _ = logits_and_ids(6, 16, torch.bfloat16, None)
    with chunk_bytes(0), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises((RuntimeError, IndexError)):
            cross_entropy_rows(x.requires_grad_(), ids[:5])
        assert rows_mod._Kernels.failed == {}
        saved = []
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        with keep:
            cross_entropy_rows(x, ids)
    # the kernels' forward keeps a float32 number per row (the chunks' keeps none without z_loss)
    assert [t.shape for t in saved if t.dtype == torch.float32] == [torch.Size([6])], saved


def test_a_traced_backward_runs_the_kernels_formula_inline(monkeypatch):
    """A backward that Dynamo traces (compiled autograd) gets the kernels' backward as the formula
    inline, from the saved log-sum-exp: calling the compiled kernel there would trace its lock (a
    graph break per call) and compile inside a compile. The float64 gradient."""
    import meshtorch.ops.cross_entropy_rows as rows_mod

    x, ids, up = logits_and_ids(6, 16, torch.bfloat16, None)
    x = x.requires_grad_()
    with chunk_bytes(0):
        loss = cross_entropy_rows(x, ids)

    def no_kernel(*args):
        raise AssertionError("the compiled kernel was called inside a traced backward")

    monkeypatch.setattr(rows_mod, "_kernel_call", no_kernel)
    monkeypatch.setattr(rows_mod, "is_dynamo_compiling", lambda: True)  # (as Dynamo tracing it)
    (loss * up.float()).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (reference(x64, ids, None, 0.0) * up).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=ULP[torch.bfloat16], atol=1e-6)


@pytest.mark.parametrize("private_test", ["stack", "flag", "none"])
def test_under_a_dispatch_mode_the_kernels_formula_runs_as_it_is(monkeypatch, private_test):
    """A FLOP counter (a TorchDispatchMode, under which Dynamo does not compile) around the loss:
    the kernels' formula runs uncompiled, the same numbers, and the kernels are not marked failed,
    whether the mode is found on this thread's mode stack or (a torch without that) from torch's
    flag. Without either private test, a compile under one fails like any other: chunks and the
    warning, the same numbers still."""
    import types

    from torch.utils.flop_counter import FlopCounterMode

    import meshtorch.ops.cross_entropy_rows as rows_mod

    for name, value in (("failed", {}), ("forward", None), ("backward", None)):
        monkeypatch.setattr(rows_mod._Kernels, name, value)
    if private_test != "stack":  # (a torch without the first, or without both)
        from torch.utils import _python_dispatch

        flag = _python_dispatch.is_in_torch_dispatch_mode if private_test == "flag" else None
        monkeypatch.setattr(caching, "_mode_tests", (None, None, flag))
    if private_test == "none":
        # the kernels' functions as copies of new code objects: a compile tried under a mode
        # marks its code as never to compile again in this process (torch 2.13: any later
        # torch.compile of it finds "no compiled frames"), which would leave every later test
        # on this worker without the kernels
        for name in ("_rows_forward", "_whole_grad"):
            f = getattr(rows_mod, name)
            copy = types.FunctionType(f.__code__.replace(), f.__globals__, name)
            monkeypatch.setattr(rows_mod, name, copy)
    n, v = 9, 23
    x, ids, up = logits_and_ids(n, v, torch.bfloat16, None)
    x = x.requires_grad_()
    import warnings
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with chunk_bytes(0), FlopCounterMode(display=False) as flops:
            loss = cross_entropy_rows(x, ids)
            (loss * up.float()).sum().backward()
    assert flops.get_total_flops() >= 0
    # with torch's test the formula ran uncompiled; without it the compile under the mode fails
    # (this call chunks) or, on torch 2.11, runs eagerly: a warning only where a backend was refused
    if private_test != "none":
        assert rows_mod._Kernels.failed == {}
    failed = "cpu" in rows_mod._Kernels.failed
    assert any("generating its kernels failed" in str(w.message) for w in said) == failed
    assert_float64_loss_and_gradient(x, ids, up, loss)


@pytest.mark.parametrize("dynamo_reads", ["stack", "flag"])
def test_modes_left_on_other_threads_do_not_keep_the_kernels_uncompiled(monkeypatch, dynamo_reads):
    """torch's "a dispatch mode is active" flag is one per process: two threads each entering a
    FLOP counter, the first leaving before the second (thread-processors counting their own FLOPs)
    leave it set after both have exited. Where Dynamo asks the thread's mode stack (torch >= 2.10)
    the loss does too: here, with no mode on this thread, the kernels compile and run. Where
    Dynamo reads the flag (older torch, stood for by its config switched off), it would skip the
    kernels and mark them never to compile again: the loss runs their formula uncompiled while the
    flag is set, and compiles them once it is clear."""
    import threading

    from torch.utils import _python_dispatch
    from torch.utils.flop_counter import FlopCounterMode

    import meshtorch.ops.cross_entropy_rows as rows_mod

    switch = hasattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile")  # (torch >= 2.10)
    if dynamo_reads == "stack" and not switch:
        pytest.skip("this torch's Dynamo reads the process-wide flag only (the 'flag' case)")
    if dynamo_reads == "flag" and switch:
        monkeypatch.setattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with FlopCounterMode(display=False):
            a_in.set()
            b_in.wait()
        a_out.set()

    def second():
        a_in.wait()
        with FlopCounterMode(display=False):
            b_in.set()
            a_out.wait()

    def loss_and_gradient():
        x, ids, up = logits_and_ids(9, 23, torch.bfloat16, None)
        x = x.requires_grad_()
        with chunk_bytes(0):
            loss = cross_entropy_rows(x, ids)
            (loss * up.float()).sum().backward()
        assert_float64_loss_and_gradient(x, ids, up, loss)

    for name, value in (("failed", {}), ("forward", None), ("backward", None)):
        monkeypatch.setattr(rows_mod._Kernels, name, value)
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    with torch_mode_flags_kept():  # (torch's own state, as it was before the test)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        leaked = _python_dispatch.is_in_torch_dispatch_mode()
        calls = rows_mod._Kernels.compiled_calls
        loss_and_gradient()
        compiled_while_set = rows_mod._Kernels.compiled_calls - calls
    # (what the test stands on: torch's flag left set, where torch still keeps one per process)
    assert leaked or not hasattr(_python_dispatch, "_is_in_torch_dispatch_mode")
    assert compiled_while_set == (2 if dynamo_reads == "stack" else 0), rows_mod._Kernels.last_error
    calls = rows_mod._Kernels.compiled_calls
    loss_and_gradient()  # the flag clear again: compiled (not marked never to compile)
    assert rows_mod._Kernels.compiled_calls == calls + 2 and rows_mod._Kernels.failed == {}, \
        rows_mod._Kernels.last_error


@pytest.mark.parametrize("off", ["stance", "disable"])
def test_with_dynamo_off_the_kernels_rows_run_in_chunks(monkeypatch, off):
    """Under ``torch.compiler.set_stance("force_eager")`` or with Dynamo disabled, compiled functions
    run eagerly: the kernels' formulas would make float32 [rows, vocab] blocks, so the rows go in
    chunks (the saved tensors show it: no float32 number per row kept), the same numbers."""
    import contextlib

    n, v = 9, 23
    x, ids, up = logits_and_ids(n, v, torch.bfloat16, None)
    x = x.requires_grad_()
    saved = []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    import meshtorch.ops.cross_entropy_rows as rows_mod

    for name, value in (("failed", {}), ("forward", None), ("backward", None)):
        monkeypatch.setattr(rows_mod._Kernels, name, value)  # (compiled anew under the setting)
    if off == "disable":
        monkeypatch.setattr(torch._dynamo.config, "disable", True)
    eager = torch.compiler.set_stance("force_eager") if off == "stance" else contextlib.nullcontext()
    with chunk_bytes(0), keep, eager:
        loss = cross_entropy_rows(x, ids)
    assert not [t for t in saved if t.dtype == torch.float32], [(t.dtype, t.shape) for t in saved]
    (loss * up.float()).sum().backward()
    assert rows_mod._Kernels.failed == {}  # (nothing compiled, nothing failed: later calls compile)
    assert_float64_loss_and_gradient(x, ids, up, loss)


def test_any_dim_order_and_one_row_chunks():
    """The vocabulary first (a copy to rows, and back), chunks of one row."""
    x, ids, _ = logits_and_ids(6, 5, torch.bfloat16, None, seed=1)
    t = x.t().contiguous().requires_grad_()  # [vocab, rows]
    with chunk_bytes(4 * 5 * 1):
        loss = cross_entropy_rows(t, ids, dim=0)
        loss.sum().backward()
    x64 = x.double().requires_grad_()
    want = reference(x64, ids, None, 0.0)
    want.sum().backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(t.grad.double(), x64.grad.t(), rtol=ULP[torch.bfloat16], atol=1e-6)


def whole_float32(x: torch.Tensor, ids: torch.Tensor, ignore_index, z_loss: float) -> torch.Tensor:
    """The whole-tensor float32 formula (meshtorch's before ``cross_entropy_rows``): per-row
    ``-log_softmax(x, dtype=float32)[ids] + z_loss * logsumexp**2``, ignored rows 0."""
    safe = ids.clamp(0, x.shape[-1] - 1)
    per = -torch.log_softmax(x, -1, dtype=torch.float32).gather(-1, safe[:, None]).squeeze(-1)
    per = per + z_loss * torch.logsumexp(x.float(), -1).square()
    return per if ignore_index is None else per.masked_fill(ids == ignore_index, 0.0)


@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       ignore_index=st.sampled_from([None, -100]), z_loss=st.sampled_from([0.0, 0.1]))
@settings(max_examples=25, deadline=None)
def test_any_chunk_size_gives_the_whole_tensor_float32_loss_and_gradient(data, dtype, ignore_index, z_loss):
    """Chunks of a drawn number of bytes (below one row's: a row a chunk; rows that do not divide
    evenly: a shorter last chunk; more than all rows: one chunk): the loss of the whole-tensor
    float32 formula within float32 rounding, its gradient the formula's float32 gradient within a
    step of the logits' dtype."""
    n, v = data.draw(st.integers(1, 13), "rows"), data.draw(st.integers(2, 40), "vocab")
    row = 4 * v
    size = data.draw(st.one_of(st.integers(1, row - 1), st.integers(row, row * (n + 2))), "chunk bytes")
    x, ids, up = logits_and_ids(n, v, dtype, ignore_index, seed=data.draw(st.integers(0, 99), "seed"))
    x = x.requires_grad_()
    with chunk_bytes(size):
        assert chunk_rows(v, "cpu") == max(1, size // row)
        loss = cross_entropy_rows(x, ids, ignore_index=ignore_index, z_loss=z_loss)
        (loss * up.float()).sum().backward()
    ref_x = x.detach().float().requires_grad_()  # (a float32 leaf: its gradient rounded nowhere)
    want = whole_float32(ref_x, ids, ignore_index, z_loss)
    (want * up.float()).sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=ULP.get(dtype, 1e-6), atol=1e-6)


def _softmax_kernels(n: int, v: int) -> int:
    """How many ``_log_softmax`` kernels (one per chunk) a forward and backward of cross_entropy_rows
    over CPU bf16 logits [n, v] runs."""
    x, ids, _ = logits_and_ids(n, v, torch.bfloat16, None)
    x.requires_grad_()
    names, _ = aten_ops(lambda: cross_entropy_rows(x, ids).sum().backward())
    assert names.count("_softmax.default") == names.count("_log_softmax.default"), names
    return names.count("_log_softmax.default")


def test_the_chunk_size_is_per_device_type_and_restored_after_the_block():
    """``chunk_bytes(n, "cuda")`` leaves the CPU's chunks as they were, ``chunk_bytes(n, "cpu")``
    and ``chunk_bytes(n)`` change them; each block's exit (an error's too) restores the sizes."""
    n, v = 10, 16
    before = dict(CHUNK_BYTES)
    assert CHUNK_BYTES["cpu"] >= 4 * v * n and _softmax_kernels(n, v) == 1  # the default: one chunk
    with chunk_bytes(4 * v * 3, "cuda"):
        assert _softmax_kernels(n, v) == 1 and chunk_rows(v, "cuda") == 3
        assert chunk_rows(v, "xpu") == 3  # (other accelerators: CUDA's)
    with chunk_bytes(4 * v * 3, "cpu"):
        assert _softmax_kernels(n, v) == 4  # 3, 3, 3, 1
        assert chunk_rows(v, "cuda") == before["cuda"] // (4 * v)
    with pytest.raises(RuntimeError, match="inside"), chunk_bytes(4 * v * 5):
        assert _softmax_kernels(n, v) == 2 and chunk_rows(v, "cuda") == 5
        raise RuntimeError("inside")
    assert CHUNK_BYTES == before


def _sizes_seen(set_here: bool) -> list[int]:
    """This processor's CPU chunk rows of a 16-word vocabulary at three points: processor 0
    sets 3 rows inside the program when ``set_here``; the barriers order the reads."""
    rank, seen = mt.current().rank, []
    if set_here and rank == 0:
        with chunk_bytes(4 * 16 * 3, "cpu"):
            mt.current().comm.barrier()
            seen.append(chunk_rows(16, "cpu"))
            mt.current().comm.barrier()
    else:
        mt.current().comm.barrier()
        seen.append(chunk_rows(16, "cpu"))
        mt.current().comm.barrier()
    seen.append(chunk_rows(16, "cpu"))
    return seen


def test_a_chunk_size_set_in_a_program_is_that_processors_and_one_around_a_launch_every_ones():
    """Inside a thread-processor's program the setting is its own (the others keep theirs, and
    none outlives the block: review15 saw a setting made on two processors left in the process's
    table after the launch); around mt.launch the process's, which every thread-processor reads."""
    before, default = dict(CHUNK_BYTES), CHUNK_BYTES["cpu"] // (4 * 16)
    assert mt.launch(_sizes_seen, True, mesh="b:2") == [[3, default], [default, default]]
    assert CHUNK_BYTES == before
    with chunk_bytes(4 * 16 * 5, "cpu"):
        assert mt.launch(_sizes_seen, False, mesh="b:2") == [[5, 5], [5, 5]]
    assert CHUNK_BYTES == before


def test_a_meta_trace_chunks_as_the_device_it_plans_for():
    """The planner's meta logits take the chunk of the device a trace prices (``trace(device=)``)."""
    def rows():
        return chunk_rows(100, "meta")

    with chunk_bytes(400 * 3, "cpu"), chunk_bytes(400 * 7, "cuda"):
        assert mt.plan.trace(rows, mesh="b:1", device="cpu").result == 3
        assert mt.plan.trace(rows, mesh="b:1", device="cuda").result == 7
        assert rows() == 7  # (no trace: a GPU's, as any accelerator's)


@pytest.mark.parametrize("n", [-1, 1.5, True, "16"])
def test_a_chunk_size_that_is_not_a_positive_whole_number_raises(n):
    with pytest.raises(mt.errors.ArgumentError, match=r"whole number of bytes, 0 or more"), chunk_bytes(n):
        pass


@pytest.mark.parametrize("device_type", ["gpu", "cuda:0", 3])
def test_a_chunk_size_s_device_type_must_be_one(device_type):
    before = dict(CHUNK_BYTES)
    with pytest.raises(mt.errors.ArgumentError, match=r"device type"), chunk_bytes(1024, device_type):
        pass
    assert CHUNK_BYTES == before


@pytest.mark.parametrize("ignore_index", [None, -100])
@pytest.mark.parametrize("bad", [-1, 8])
def test_a_target_outside_the_vocabulary_raises_the_id_check_s_error(ignore_index, bad):
    """bf16 logits: the same ArgumentError as float32's path, whether gather finds the bad id
    (no ignore_index, ids on the host) or check_ids does first; alone, no gather error chained."""
    logits = mt.from_global(torch.zeros(2, 3, 8, dtype=torch.bfloat16), "batch:2,length:3,vocab:8")
    ids = mt.from_global(torch.tensor([[1, bad, 0], [3, 5, 2]]), "batch:2,length:3")
    with pytest.raises(mt.errors.ArgumentError, match=rf"targets hold {bad}, outside dim 'vocab'") as e:
        mt.cross_entropy(logits, ids, "vocab", ignore_index=ignore_index)
    assert e.value.__suppress_context__ or e.value.__context__ is None


SIZES = st.integers(1, 5)


@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       z_loss=st.sampled_from([0.0, 0.1]), reduction=st.sampled_from(["none", "mean", "sum"]))
@settings(max_examples=16, deadline=None)
def test_rows_dtypes_give_the_float32_loss_on_any_layout(data, dtype, z_loss, reduction):
    """``mt.cross_entropy`` of bf16/fp16 (and, on the CPU, float32) logits on a drawn mesh and rules
    (the vocabulary whole: rows, in chunks of 2 rows; split: the composed float32 path) is the
    float64 loss of the same logits within float32 rounding, its gradient the float64 one within a
    step of the logits' dtype (float32's: a few of its steps)."""
    mesh = data.draw(meshes())
    rules = data.draw(rules_for(mesh, ["batch", "length", "vocab"]))
    b, n, v = data.draw(SIZES), data.draw(SIZES), data.draw(st.integers(2, 9))
    ignore = data.draw(st.sampled_from([None, -100, v - 1]))
    x, ids, up = logits_and_ids(b * n, v, dtype, ignore, seed=data.draw(st.integers(0, 99)))
    ids[0] = 0  # one position counts, so the mean is a number
    shape = f"batch:{b},length:{n},vocab:{v}"

    def program():
        lg = mt.from_global(x.reshape(b, n, v), shape, requires_grad=True)
        per = mt.cross_entropy(lg, mt.from_global(ids.reshape(b, n), f"batch:{b},length:{n}"), "vocab",
                               ignore_index=ignore, z_loss=z_loss, reduction=reduction)
        weights = mt.from_global(up.reshape(b, n).float(), f"batch:{b},length:{n}")
        (mt.reduce_sum(per * weights) if reduction == "none" else per).backward()
        return per.dtype, per.to_global(), lg.grad.to_global()

    x64 = x.double().requires_grad_()
    per64 = reference(x64, ids, ignore, z_loss)
    counted = ids != ignore if ignore is not None else torch.ones_like(ids, dtype=torch.bool)
    want = {"none": per64, "sum": per64.sum(), "mean": per64.sum() / counted.sum()}[reduction]
    (want * up).sum().backward() if reduction == "none" else want.backward()
    with chunk_bytes(4 * v * 2):
        outs = mt.launch(program, mesh=mesh, rules=rules)
    for dt, got, grad in outs:
        assert dt == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(got.double().reshape(want.shape), want.detach(), rtol=4e-6, atol=4e-6)
        torch.testing.assert_close(grad.double().reshape(b * n, v), x64.grad, rtol=ULP.get(dtype, 1e-5),
                                   atol=1e-6)


def _float32_loss_kernels(device: str | None = None) -> list[str]:
    """The ATen ops (CPU) or traced kernels (``device``: ``mt.plan.trace`` on the meta backend,
    pricing that device) of a forward and backward of the mean float32 loss of logits [6, 40]."""
    n, v = 6, 40

    def step():  # (drawn by the language: meta tensors in a trace)
        lg = mt.random.normal(f"batch:{n},vocab:{v}", seed=0).requires_grad_()
        ids = mt.cast(mt.random.uniform(f"batch:{n}", 0, v, seed=1) * 0.999, torch.int64)
        mt.reduce_mean(mt.cross_entropy(lg, ids, "vocab")).backward()

    if device is None:
        return aten_ops(step)[0]
    return [k[0] for k in mt.plan.trace(step, mesh="b:1", rules="batch:b", device=device).kernels]


def test_float32_logits_take_the_rows_on_the_cpu_and_cuda_and_the_formula_on_other_devices(monkeypatch):
    """On the CPU (``FLOAT32_DEVICES``) float32 logits take cross_entropy_rows (its backward a
    softmax, no log-softmax backward), as the planner's traces pricing a CPU and a GPU do (CUDA's
    rows: the generated kernels, priced by a reduction and a product that move their bytes); a
    device taken out of ``FLOAT32_DEVICES`` takes the formula (log_softmax and gather, whose
    backward is log_softmax's), eager and traced."""
    rows = _float32_loss_kernels()
    assert "_softmax.default" in rows and "_log_softmax_backward_data.default" not in rows, rows
    traced_cpu, traced_gpu = _float32_loss_kernels("cpu"), _float32_loss_kernels("cuda")
    assert "_softmax" in traced_cpu and "_log_softmax_backward_data" not in traced_cpu, traced_cpu
    assert "_log_softmax" not in traced_gpu and "_log_softmax_backward_data" not in traced_gpu, traced_gpu
    assert "amax" in traced_gpu, traced_gpu
    monkeypatch.setattr(rows_module, "FLOAT32_DEVICES", ("cpu",))
    traced_gpu = _float32_loss_kernels("cuda")
    assert "_softmax" not in traced_gpu and "_log_softmax_backward_data" in traced_gpu, traced_gpu
    monkeypatch.setattr(rows_module, "FLOAT32_DEVICES", ())
    formula = _float32_loss_kernels()
    assert "_softmax.default" not in formula and "_log_softmax_backward_data.default" in formula, formula


@pytest.mark.parametrize("ignore_index", [None, -100])
@pytest.mark.parametrize("z_loss", [0.0, 0.1])
def test_compiled_float32_rows_are_the_eager_chunks_bitwise(ignore_index, z_loss):
    """Float32 logits traced by Dynamo take the eager chunks' own ops over the rows as one chunk:
    under ``aot_eager`` (the same ATen ops) the loss and gradient are bitwise those of the eager
    rows in chunks of 3 rows (11 rows: 3 + 3 + 3 + 2), so that a compiled float32 step keeps the
    eager step's values; no graph break."""
    n, v = 11, 30
    x0, ids, up = logits_and_ids(n, v, torch.float32, ignore_index)

    def loss_and_grad(fn):
        x = x0.clone().requires_grad_()
        loss = fn(x)
        (loss * up.float()).sum().backward()
        return loss.detach(), x.grad

    def rows(x):
        return cross_entropy_rows(x, ids, ignore_index=ignore_index, z_loss=z_loss)

    torch._dynamo.reset()
    try:
        compiled = loss_and_grad(torch.compile(rows, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    with chunk_bytes(4 * v * 3):
        eager = loss_and_grad(rows)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert graph_breaks() == {}


def _saved_by_loss(n: int, v: int) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of every tensor autograd saves for the backward of the mean bf16 loss."""
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    logits = mt.from_global(torch.randn(2, n // 2, v).bfloat16(), f"batch:2,length:{n // 2},vocab:{v}",
                            requires_grad=True)
    ids = mt.from_global(torch.randint(0, v, (2, n // 2)), f"batch:2,length:{n // 2}")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = mt.reduce_mean(mt.cross_entropy(logits, ids, "vocab", ignore_index=-100, z_loss=1e-4))
    loss.backward()
    return saved


def test_nothing_float32_rows_by_vocab_is_saved_for_the_backward(monkeypatch):
    """Saved: the bf16 logits and numbers per row. The former formula (``ROWS_DTYPES`` empty) saved
    the float32 [rows, vocab] log-probabilities: the check sees them there."""
    n, v = 8, 300
    saved = _saved_by_loss(n, v)
    assert (torch.bfloat16, n * v) in saved, saved
    assert max(k for dt, k in saved if dt == torch.float32) <= n, saved
    monkeypatch.setattr(nn_ops, "ROWS_DTYPES", ())
    assert (torch.float32, n * v) in _saved_by_loss(n, v)


def test_the_cpu_allocator_peak_is_a_chunk_not_the_rows(monkeypatch):
    """torch.profiler's allocations (``benchmarks/allocator_peak.py``) over a forward and backward of
    bf16 logits [250, 1000] in chunks of 32 rows: at most the logits, their gradient and three
    chunks of float32 (a chunk, its cast copy, the CPU's float32 product before its bf16 copy) and
    a few KiB; the former formula holds two float32 copies of the rows more."""
    step_peaks = load_benchmark("allocator_peak").step_peaks
    n, v = 250, 1000
    x0, ids, _ = logits_and_ids(n, v, torch.bfloat16, None)

    def step(x):
        x.grad = None
        cross_entropy_rows(x, ids).mean().backward()

    def former(x):
        x.grad = None
        (-torch.log_softmax(x, -1, dtype=torch.float32).gather(-1, ids[:, None])).mean().backward()

    def made():
        return x0.clone().requires_grad_()

    chunk = 4 * v * 32
    with chunk_bytes(chunk):
        peak = min(step_peaks(made, step, 2))
    logits = n * v * 2
    bound = 2 * logits + 3 * chunk + 16 * 1024
    assert 2 * logits <= peak <= bound, (peak, bound)
    assert min(step_peaks(made, former, 2)) >= 2 * logits + 2 * n * v * 4


def test_compiled_with_fullgraph_is_the_eager_loss_and_saves_no_float32_rows():
    """``compile_step(fullgraph=True)`` (Dynamo traces the autograd.Function: one chunk, the
    backward from the saved log-sum-exp): no break, the eager loss and gradient, and the backward
    graph takes nothing float32 [rows, vocab]."""
    backward_inputs = []

    def bw(gm, inputs):
        backward_inputs.extend((t.dtype, t.numel()) for t in inputs if isinstance(t, torch.Tensor))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=bw)
    b, n, v = 2, 6, 40
    x, ids, _ = logits_and_ids(b * n, v, torch.bfloat16, -100)

    def loss_fn(lg, tg):
        return mt.reduce_mean(mt.cross_entropy(lg, tg, "vocab", ignore_index=-100, z_loss=0.01,
                                               reduction="none"))

    torch._dynamo.reset()
    results = []
    for fn in (loss_fn, compile_step(loss_fn, backend, fullgraph=True)):
        lg = mt.from_global(x.reshape(b, n, v), f"batch:{b},length:{n},vocab:{v}", requires_grad=True)
        loss = fn(lg, mt.from_global(ids.reshape(b, n), f"batch:{b},length:{n}"))
        loss.backward()
        results.append((loss.item(), lg.grad.to_global()))
    torch._dynamo.reset()
    (eager, eager_grad), (compiled, grad) = results
    assert graph_breaks() == {}
    assert compiled == pytest.approx(eager, rel=1e-6)
    torch.testing.assert_close(grad.float(), eager_grad.float(), rtol=ULP[torch.bfloat16], atol=1e-6)
    assert (torch.bfloat16, b * n * v) in backward_inputs, backward_inputs
    assert max(k for dt, k in backward_inputs if dt == torch.float32) <= b * n, backward_inputs


def test_the_planner_traces_the_chunks_and_their_peak(monkeypatch):
    """The meta backend's trace (``mt.plan.trace``) of a bf16 loss step runs the chunks: a
    ``_log_softmax`` forward and a ``_softmax`` backward per chunk; its peak holds a chunk, not the
    rows, two float32 copies of the rows below the former formula's."""
    n, v = 64, 512

    def step():  # the logits a product of small factors: the loss is the peak
        h = mt.cast(mt.random.normal(f"batch:{n},d:4", seed=0), torch.bfloat16).requires_grad_()
        w = mt.cast(mt.random.normal(f"d:4,vocab:{v}", seed=2), torch.bfloat16).requires_grad_()
        logits = mt.einsum("batch d, d vocab -> batch vocab", h, w)
        ids = mt.cast(mt.random.uniform(f"batch:{n}", 0, v, seed=1) * 0.999, torch.int64)
        mt.reduce_mean(mt.cross_entropy(logits, ids, "vocab")).backward()

    chunk = 4 * v * 10
    with chunk_bytes(chunk):  # 7 chunks, the last of 4 rows
        rows_trace = mt.plan.trace(step, mesh="b:1", rules="batch:b")
    counts = {}
    for key, c in rows_trace.kernels.items():
        counts[key[0]] = counts.get(key[0], 0) + c
    assert counts["_log_softmax"] == counts["_softmax"] == 7, counts
    monkeypatch.setattr(nn_ops, "ROWS_DTYPES", ())
    former = mt.plan.trace(step, mesh="b:1", rules="batch:b")
    assert "_softmax" not in {k[0] for k in former.kernels}
    # the logits and their gradient (bf16), a chunk and its cast copy, the small factors
    assert rows_trace.peak_bytes <= 2 * n * v * 2 + 3 * chunk + 8192, rows_trace.peak_bytes
    # the former formula: also the float32 log-probabilities and their gradient
    assert former.peak_bytes - rows_trace.peak_bytes >= 2 * n * v * 4, (rows_trace.peak_bytes,
                                                                         former.peak_bytes)


def test_the_planner_traces_a_gpus_kernels_as_one_read_of_the_logits():
    """Planned for a GPU (``chunk_bytes`` 0 there by default), the meta trace makes no float32
    [rows, vocab] block, and no softmax kernel: its peak is the logits, their gradient and the
    small factors, below a trace in chunks."""
    n, v = 64, 512

    def step():
        h = mt.cast(mt.random.normal(f"batch:{n},d:4", seed=0), torch.bfloat16).requires_grad_()
        w = mt.cast(mt.random.normal(f"d:4,vocab:{v}", seed=2), torch.bfloat16).requires_grad_()
        logits = mt.einsum("batch d, d vocab -> batch vocab", h, w)
        ids = mt.cast(mt.random.uniform(f"batch:{n}", 0, v, seed=1) * 0.999, torch.int64)
        mt.reduce_mean(mt.cross_entropy(logits, ids, "vocab")).backward()

    assert CHUNK_BYTES["cuda"] == 0
    gpu = mt.plan.trace(step, mesh="b:1", rules="batch:b", device="cuda")
    assert not {"_softmax", "_log_softmax"} & {k[0] for k in gpu.kernels}, gpu.kernels
    with chunk_bytes(4 * v * 10, "cuda"):
        chunked = mt.plan.trace(step, mesh="b:1", rules="batch:b", device="cuda")
    # the logits and their gradient (bf16) and small factors: under a quarter of a float32 block more
    assert gpu.peak_bytes < 2 * n * v * 2 + n * v, gpu.peak_bytes
    assert chunked.peak_bytes - gpu.peak_bytes >= 4 * v * 10, (gpu.peak_bytes, chunked.peak_bytes)


def test_the_bf16_lm_step_compiles_once_as_one_graph_with_the_eager_losses(monkeypatch):
    """The tiny LM under bf16 autocast (its loss on cross_entropy_rows) compiled with
    ``fullgraph=True`` (``aot_eager``): one forward and one backward graph over three AdamW steps,
    no break, the eager steps' losses."""
    from meshtorch import amp
    from meshtorch.models import DecoderLM, TransformerConfig

    cfg = TransformerConfig(vocab=32, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=8,
                            tie_embeddings=False)
    g = torch.Generator().manual_seed(0)
    data = [tuple(torch.randint(0, 32, (4, 8), generator=g) for _ in range(2)) for _ in range(3)]
    graphs = {"forward": 0, "backward": 0}

    def counted(kind):
        def compiler(gm, _):
            graphs[kind] += 1
            return make_boxed_func(gm.forward)
        return compiler

    def train(backend):
        model = DecoderLM(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def loss_of(ids, tgt):
            with amp.autocast(torch.bfloat16):
                return model.loss(ids, tgt)

        fn = loss_of if backend is None else compile_step(loss_of, backend, fullgraph=True)
        losses = []
        for ids, tgt in data:
            loss = fn(mt.from_global(ids, "batch:4,length:8"), mt.from_global(tgt, "batch:4,length:8"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    calls = []
    monkeypatch.setattr(nn_ops, "cross_entropy_rows",
                        lambda *a, **k: calls.append(1) or cross_entropy_rows(*a, **k))
    torch._dynamo.reset()
    eager = train(None)
    assert len(calls) == len(data)  # (the eager steps' loss is cross_entropy_rows)
    monkeypatch.undo()
    compiled = train(aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward")))
    torch._dynamo.reset()
    assert graphs == {"forward": 1, "backward": 1} and graph_breaks() == {}
    assert compiled == pytest.approx(eager, rel=1e-5)


@pytest.mark.parametrize(("z_loss", "ignore"), [(0.0, None), (1e-2, None), (0.0, -100), (1e-2, -100)])
def test_a_gradient_penalty_differentiates_the_rows_gradient_again(z_loss, ignore):
    """A backward with ``create_graph=True`` (a gradient-norm penalty) gives a gradient autograd
    differentiates again, as the whole-tensor formula's: the second-order term of an earlier weight
    (it was silently dropped: the first backward's result was a constant)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, dtype=torch.float64, generator=gen)
    a0 = torch.randn(6, 8, dtype=torch.float64, generator=gen)
    w0 = torch.randn(8, 11, dtype=torch.float64, generator=gen)
    ids = torch.tensor([0, 3, 10, -100 if ignore else 4, 4])

    def second_order(loss_of):
        a, w = a0.clone().requires_grad_(), w0.clone().requires_grad_()
        g_w, = torch.autograd.grad(loss_of(x @ a @ w).sum(), w, create_graph=True)
        return torch.autograd.grad(g_w.square().sum(), a)[0]

    def formula(t):
        kept = ids != -100
        ce = F.cross_entropy(t, ids.clamp(min=0), reduction="none")
        return (ce + z_loss * torch.logsumexp(t, -1).square()) * kept

    got = second_order(lambda t: cross_entropy_rows(t, ids, ignore_index=ignore, z_loss=z_loss))
    want = second_order(formula)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
