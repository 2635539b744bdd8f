"""torch.compile of a meshtorch step: one graph per processor, no graph breaks, the eager step's
loss, gradients and collective counts (torch's own compiled run against the uncompiled one).

Cost: tracing meshtorch's Python is the price of a compile, so the models are tiny, only one
test runs inductor (on a small step), the others ``aot_eager`` (the same ATen ops as eager, so
the results are bitwise the eager ones), and the threads test compiles a two-layer MLP rather
than the LM (its processors trace in turn); the LM on two processors is compiled once, on gloo,
where the processes trace in parallel.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import meshtorch as mt
from meshtorch.compiler import compile_step, graph_breaks
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.recipes.lm import TrainConfig
from meshtorch.recipes.lm.config import check_config

# untied: an eager step reduces a tied table's two gradient parts at once, a compiled step each
# part (docs/training.md), so the tables would differ by rounding and the steps after them too
CFG = TransformerConfig(vocab=32, d_model=16, heads=2, d_kv=8, d_ff=32, layers=1, max_length=8,
                        tie_embeddings=False)
SHAPE = "batch:4,length:8"
D, H = mt.Dim("d_model", 8), mt.Dim("d_ff", 16)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing and leaves nothing compiled behind (Dynamo's caches and
    counters are per process, shared by every test of the session)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, CFG.vocab, (4, 8), generator=g) for _ in range(2)) for _ in range(n)]


def train(backend, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of the tiny LM (gradients clipped eagerly), eager (``backend=None``)
    or compiled; the losses and the whole (global) gradients of the last step."""
    model = DecoderLM(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = model.loss if backend is None else compile_step(model.loss, backend)
    losses = []
    for ids, tgt in batches(steps):
        loss = loss_fn(mt.from_global(ids, SHAPE), mt.from_global(tgt, SHAPE))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.to_global() for n, p in model.named_mesh_parameters()}
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, grads


class Recorder:
    """A ``torch.compile`` backend that keeps the names of the ops Dynamo's graphs call
    (backward bodies of autograd functions included), then runs them as ``aot_eager``."""

    def __init__(self):
        self.ops: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs):
        for m in gm.modules():
            if isinstance(m, torch.fx.GraphModule):
                self.ops += [str(n.target) for n in m.graph.nodes if n.op == "call_function"]
        return aot_eager(gm, inputs)

    def count(self, fragment: str) -> int:
        return sum(fragment in op for op in self.ops)


def mlp_program(x_global: torch.Tensor) -> tuple:
    """A two-layer MLP's loss and gradients, eager and compiled (``aot_eager``, graph recorded),
    and the collectives each counted."""
    model = mt.nn.Sequential(mt.nn.Dense(D, H), mt.relu, mt.nn.Dense(H, D))

    def loss_fn(x):
        y = model(x)
        return mt.reduce_sum(y * y)

    runs = []
    recorder = Recorder()
    for fn in (loss_fn, compile_step(loss_fn, recorder)):
        mt.reset_comm_stats()
        model.zero_grad(set_to_none=True)
        loss = fn(mt.from_global(x_global, "batch:4,d_model:8"))
        loss.backward()
        grads = {n: p.grad.to_global() for n, p in model.named_mesh_parameters()}
        runs.append((loss.item(), grads, mt.comm_stats().as_dict()))
    return runs, recorder.count("meshtorch.collective"), recorder.count("_c10d_functional")


def gloo_program() -> tuple:
    """Two steps of the tiny LM, eager and compiled (``aot_eager``, graph recorded), on this
    process; with the collectives each counted, the graph breaks and the graphs compiled (one:
    the eager code between the steps must not invalidate the first step's graph)."""
    eager = train(None)
    eager_stats = mt.comm_stats().as_dict()
    mt.reset_comm_stats()
    counters.clear()
    recorder = Recorder()
    compiled = train(recorder)
    return (eager, eager_stats, compiled, mt.comm_stats().as_dict(), graph_breaks(),
            counters["stats"]["unique_graphs"], recorder.count("_c10d_functional"),
            recorder.count("meshtorch.collective"))


class Compiles:
    """A ``torch.compile`` backend (``aot_eager``, the eager ATen ops) that counts the graphs
    it is handed: Dynamo's forward graphs and AOTAutograd's backward graphs. Each compile of
    the step adds one of each; a recompile would add more."""

    def __init__(self):
        self.forward = self.backward = 0

        def fw(gm, inputs):
            self.forward += 1
            return make_boxed_func(gm.forward)

        def bw(gm, inputs):
            self.backward += 1
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def __call__(self, gm, inputs):
        return self.backend(gm, inputs)


def train_counted(steps: int = 5, profiled: tuple[int, ...] = ()
                  ) -> tuple[list[float], list[float], list[tuple[int, int]]]:
    """``steps`` steps of the tiny LM eager and compiled (``fullgraph=True``, :class:`Compiles`),
    from the same weights: the losses of each and, after each compiled step, the graphs
    compiled so far (forward, backward). The compiled steps numbered in ``profiled`` (from 0)
    run, forward and backward, under ``torch.profiler.profile()``."""
    eager, _ = train(None, steps)
    counted = Compiles()
    model = DecoderLM(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = compile_step(model.loss, counted, fullgraph=True)
    losses, graphs = [], []
    for i, (ids, tgt) in enumerate(batches(steps)):
        with torch.profiler.profile() if i in profiled else nullcontext():
            loss = loss_fn(mt.from_global(ids, SHAPE), mt.from_global(tgt, SHAPE))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        losses.append(loss.item())
        graphs.append((counted.forward, counted.backward))
    return eager, losses, graphs


def test_lm_step_compiles_once_as_one_graph():
    """The LM's training step (forward, loss, backward) under ``fullgraph=True`` compiles on the
    first step and never again over five AdamW steps (clipping and the update run eagerly
    between them), with the eager step's losses."""
    eager, losses, graphs = train_counted()
    assert graphs == [(1, 1)] * 5
    assert losses == pytest.approx(eager, rel=1e-5)
    assert graph_breaks() == {}


def test_lm_step_compiles_once_with_the_profiler_started_and_stopped():
    """A compiled step run under ``torch.profiler`` (as ``benchmarks/gpu_step.py --profile``
    does) uses the graph compiled without it: the profiler's flag, a module global flipped by
    the profiler, is no guard of the graph (mt.nn.Module.__call__ reads it only in eager). The
    profiler on at the second and third steps, off at the fourth, on at the fifth: still the
    first step's graph, with the eager step's losses."""
    eager, losses, graphs = train_counted(5, profiled=(1, 2, 4))
    assert graphs == [(1, 1)] * 5
    assert losses == pytest.approx(eager, rel=1e-5)
    assert graph_breaks() == {}


def test_lm_step_on_thread_processors_compiles_once_per_processor():
    """`meshtorch train --compile`'s default: the threads backend, the batch split over ``b:2``.
    Each processor compiles its graph (collectives as opaque ops) on its first step, then none
    over the next four; the losses are the eager ones on every processor."""
    out = mt.launch(train_counted, mesh="b:2", rules="batch:b")
    assert graph_breaks() == {}
    assert counters["stats"]["unique_graphs"] == 2  # one per processor
    for eager, losses, graphs in out:
        assert graphs == [(1, 1)] * 5
        assert losses == pytest.approx(eager, rel=1e-5)


def test_plans_of_a_compiled_step_are_the_eager_plans(monkeypatch):
    """Under compile the plans (the lowering's, einsum's, elementwise broadcasting's) resolve
    outside the trace, from the same memos the eager steps fill: compiling after an eager step
    plans nothing new."""
    from meshtorch.lowering import elementwise
    from meshtorch.lowering import lower as lowering_plan
    from meshtorch.ops import einsum

    monkeypatch.setattr(lowering_plan, "_RESOLVED_NAMES", {})  # as if nothing compiled before
    model = DecoderLM(CFG, seed=0)
    ids, tgt = (mt.from_global(t, SHAPE) for t in batches(1)[0])
    model.loss(ids, tgt).backward()
    memos = (lowering_plan._PLANS, einsum._PLANS, elementwise._NARY)
    eager = {id(p) for memo in memos for p in memo.values()}
    compile_step(model.loss, "eager")(ids, tgt).backward()
    resolved = [getattr(lowering_plan.RESOLVED, n) for n in lowering_plan._RESOLVED_NAMES.values()]
    assert sum(isinstance(p, lowering_plan.Plan) for p in resolved) > 10  # every lowered op's
    assert all(id(p) in eager for p in resolved)


def test_one_processor_forward_is_one_graph_without_breaks():
    model = DecoderLM(CFG, seed=0)
    ids, tgt = (mt.from_global(t, SHAPE) for t in batches(1)[0])
    explained = torch._dynamo.explain(model.loss)(ids, tgt)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_one_processor_inductor_step_matches_eager():
    # the MLP, not the LM: inductor's C++ kernels are the cost, so the fewer the better
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = mt.nn.Sequential(mt.nn.Dense(D, H), mt.gelu, mt.nn.Dense(H, D))

    def loss_fn(x):
        return mt.reduce_sum(mt.gelu(model(x)) ** 2)

    results = []
    for fn in (loss_fn, compile_step(loss_fn, "inductor")):
        model.zero_grad(set_to_none=True)
        loss = fn(mt.from_global(x, "batch:4,d_model:8"))
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (loss, grads) = results
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for g, want in zip(grads, eager_grads):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    assert graph_breaks() == {}


def test_a_compiled_step_under_a_flop_counter_runs_uncompiled_and_later_steps_compile():
    """A compiled step called under ``FlopCounterMode`` (a user counting a step's FLOPs) runs as
    it is: the eager value, the matmul's 2*m*n*k FLOPs counted. Calling the compiled function
    there would mark compile_step's wrapper code never to compile again in the process (torch
    2.13): afterwards the same step, and a new one, still compile, one graph each."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    kernel = mt.from_global(w, "d_model:8,d_ff:16")

    def loss_fn(x):
        return mt.reduce_sum(mt.einsum(x, kernel, output_shape="batch:4,d_ff:16"))

    step = compile_step(loss_fn, backend="eager")
    xs = mt.from_global(x, "batch:4,d_model:8")
    with FlopCounterMode(display=False) as flops:
        counted = step(xs).item()
    assert flops.get_total_flops() == 2 * 4 * 8 * 16
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled under the counter
    want = (x @ w).sum().item()
    assert counted == pytest.approx(want, rel=1e-6)
    assert step(xs).item() == pytest.approx(want, rel=1e-6)
    other = compile_step(lambda t: mt.reduce_sum(t * 2), backend="eager")
    assert other(xs).item() == pytest.approx(2 * x.sum().item(), rel=1e-6)
    assert counters["stats"]["unique_graphs"] == 2 and graph_breaks() == {}


def test_a_compiled_step_compiles_where_dynamo_compiles_under_a_mode_and_inside_a_compile():
    """Under a dispatch mode that ignores compile internals (as selective checkpointing's does)
    Dynamo compiles, and so does a compiled step (one graph); a compiled step called inside an
    outer ``torch.compile(fullgraph=True)`` is traced into that one graph (the mode test is not
    traced: it would break the graph)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Quiet(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    xs = mt.from_global(x, "batch:4,d_model:8")
    step = compile_step(lambda t: mt.reduce_sum(t * 3), backend="eager")
    with Quiet():
        assert step(xs).item() == pytest.approx(3 * x.sum().item(), rel=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    inner = compile_step(lambda t: mt.reduce_sum(t * 2), backend="eager")
    outer = torch.compile(lambda t: inner(t) * 5, backend="eager", fullgraph=True)
    assert outer(xs).item() == pytest.approx(10 * x.sum().item(), rel=1e-6)
    assert counters["stats"]["unique_graphs"] == 2 and graph_breaks() == {}


def test_two_thread_processors_run_collectives_as_opaque_ops_of_the_graph():
    """Rules split the batch and d_ff over one axis, so the forward and backward all-gather,
    reduce-scatter and all-reduce; each processor compiles one graph without breaks, whose
    collectives are ``meshtorch::collective`` ops, and the step equals the eager one bitwise
    and the one-processor step to rounding."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = mt.launch(mlp_program, x, mesh="b:2", rules="batch:b; d_ff:b")
    assert graph_breaks() == {}
    assert counters["stats"]["unique_graphs"] == 2  # one graph per processor
    (one, _), _, _ = mt.launch(mlp_program, x)[0]
    for (eager, compiled), opaque, functional in out:
        assert opaque > 0 and functional == 0
        assert compiled[0] == eager[0] and compiled[0] == pytest.approx(one[0], rel=1e-5)
        for name, g in compiled[1].items():
            torch.testing.assert_close(g, eager[1][name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(g, one[1][name], msg=name)
        assert compiled[2] == eager[2]
        assert {"all_gather@b", "reduce_scatter@b", "all_reduce@b"} <= set(eager[2])


def real_and_fake_strides() -> list[tuple]:
    """Per collective, the strides of the op's real result and of its fake (what inductor
    compiles against, and asserts on the real result)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank = mt.current().rank
    x = torch.arange(8.0).reshape(2, 4) + 10 * rank
    out = []
    for name, args in [("all_gather", ("b", 1)), ("all_gather", ("b", 0)), ("all_reduce", ("b", "sum")),
                       ("reduce_scatter", ("b", 1, "sum")), ("all_to_all", ("b", 1, 0, None, None))]:
        t = x.t() if name == "all_reduce" else x  # a transposed input, which clone would keep
        call = repr(("b:2", rank, name, args, {}))
        real = torch.ops.meshtorch.collective.default(t, call)
        with FakeTensorMode() as mode:
            fake = torch.ops.meshtorch.collective.default(mode.from_tensor(t), call)
        out.append((name, args, real.shape, real.stride(), fake.shape, fake.stride()))
    return out


def test_the_compiled_collectives_fake_result_has_the_real_results_strides():
    """Inductor asserts the fake's strides on the real result, and the backends lay out a result
    differently (the meta backend's all_gather along dim 1 is a transposed view, the threads
    backend's a ``torch.cat``), so the op returns both contiguous (seen: ``meshtorch train
    --compile --rules 'batch:b; d_model:b'`` failed with "expected size 32==32, stride 32==1")."""
    import meshtorch.comm.compiled  # noqa: F401  (registers the op)

    for results in mt.launch(real_and_fake_strides, mesh="b:2"):
        for name, args, shape, stride, fake_shape, fake_stride in results:
            assert (fake_shape, fake_stride) == (shape, stride), (name, args)


@pytest.mark.timeout(240)  # two processes each trace the LM; tens of seconds on a loaded machine
def test_two_gloo_processes_run_functional_collectives_in_one_graph():
    """On the torch backend the collectives are traced as torch.distributed functional
    collectives: one graph per process, no breaks, the eager step's losses, gradients and
    collective counts (counted at every run of the graph, not once per trace)."""
    out = mt.launch(gloo_program, mesh="b:2", rules="batch:b; d_ff:b", backend="torch", nprocs=2)
    # AdamW's first update is about lr * sign(gradient), so the second step's gradients depend
    # on the rounding of tiny first-step sums: the one-processor run is matched on the losses
    one_losses, _ = train(None)
    for eager, eager_stats, compiled, stats, breaks, graphs, functional, opaque in out:
        assert breaks == {} and graphs == 1
        assert functional > 0 and opaque == 0
        assert compiled[0] == eager[0] and compiled[0] == pytest.approx(one_losses, rel=1e-4)
        for name, g in compiled[1].items():
            torch.testing.assert_close(g, eager[1][name], rtol=0, atol=0, msg=name)
        assert stats == eager_stats and stats["all_reduce@b"]["calls"] > 0


def call_while_the_other_processor_fx_traces(compiled, tracing, called) -> float | str:
    """Processor 1 calls its compiled step while processor 0's compile is inside an FX trace (its
    backend symbolic-traces, as AOTAutograd's make_fx does, and holds the trace until processor
    1's call has returned): the value, or what the call raised."""
    x = torch.ones(4)
    if mt.current().rank == 0:
        def backend(gm, inputs):
            def held(t):
                tracing.set()
                called.wait(60)
                return t

            torch.fx.symbolic_trace(held)  # torch.fx's process-wide tracing flag is set in here
            return gm.forward

        compiled.wait(60)
        return compile_step(lambda t: t.sum(), backend)(x).item()
    step = compile_step(lambda t: (2 * t).sum(), "eager")
    step(x)  # compiled before processor 0 compiles
    compiled.set()
    tracing.wait(60)
    try:
        return step(x).item()
    except RuntimeError as e:
        return str(e)
    finally:
        called.set()


def test_a_processor_calls_its_compiled_step_while_another_compiles():
    """torch.fx's 'symbolically tracing' flag is one per process: while one thread-processor's
    compile traced, torch 2.11 refused another's call of its compiled step ('Detected that you
    are using FX to symbolically trace a dynamo-optimized function')."""
    import threading

    events = [threading.Event() for _ in range(3)]
    assert mt.launch(call_while_the_other_processor_fx_traces, *events, mesh="b:2") == [4.0, 8.0]


def test_dynamos_fx_trace_check_is_back_once_the_compiled_steps_return():
    """The check thread-processors' compiled steps turn off (Dynamo's process-wide
    ``force_compile_during_fx_trace`` on torch 2.11) is back to its setting after the launch: left
    on, a user's own FX trace of a compiled function would go through."""
    config = torch._dynamo.config
    if not hasattr(config, "force_compile_during_fx_trace"):
        pytest.skip("this torch's Dynamo has no force_compile_during_fx_trace")
    before = config.force_compile_during_fx_trace

    def step():
        x = mt.from_global(torch.arange(4.0), "batch:4")
        return compile_step(mt.reduce_sum, backend="eager")(x).item()

    assert mt.launch(step, mesh="b:2", rules="batch:b") == [6.0, 6.0]
    assert config.force_compile_during_fx_trace == before
    from meshtorch import compiler

    assert compiler._fx_off["calls"] == 0


@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_a_fake_cuda_guard_that_fails_to_register_leaves_launches_alone(monkeypatch, launched_from):
    """Registering the fake CUDA guard is only for traces: where torch's call raises, a launch (from
    the main thread or another) still runs; it hung forever when launched from a thread."""
    import threading

    from meshtorch.launcher import threads

    def refuse():
        raise RuntimeError("no fake guard here")

    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet", refuse, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads.keep_fake_cuda_guard.cache_clear()
    try:
        got = []
        if launched_from == "main":
            got.append(mt.launch(lambda: 1, mesh="b:2"))
        else:
            t = threading.Thread(target=lambda: got.append(mt.launch(lambda: 1, mesh="b:2")), daemon=True)
            t.start()
            t.join(30)
        assert got == [[1, 1]]
    finally:
        threads.keep_fake_cuda_guard.cache_clear()


# thread-processors compile, the launch ends, then the launching process traces again
AFTER_PROCESSORS_TRACED = """
import sys, threading, torch, meshtorch as mt
from meshtorch.compiler import compile_step

def step():
    x = mt.from_global(torch.arange(4.0), "batch:4")
    return compile_step(mt.reduce_sum, backend="eager")(x).item()

def launch():
    print(mt.launch(step, mesh="b:2", rules="batch:b"), flush=True)

if sys.argv[1] == "main":
    launch()
else:  # launched from a thread that ends before the next trace
    t = threading.Thread(target=launch)
    t.start()
    t.join()
print(step(), flush=True)
"""


@pytest.mark.skipif(not torch.backends.cuda.is_built() or torch.cuda.is_available(),
                    reason="only a CUDA build of torch without a visible GPU registers a fake CUDA guard")
@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_a_trace_after_thread_processors_traced_does_not_crash(launched_from):
    """On a CUDA build of torch without a visible GPU (torch 2.11 CUDA on this CPU), each
    processor thread's first trace registered a fake CUDA device guard that the thread owns, for
    the whole process: once the processors ended, the next trace segfaulted in
    ``FakeTensorMode.__enter__``. In a subprocess, so that a crash fails this test only."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AFTER_PROCESSORS_TRACED, launched_from],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[6.0,", "6.0]", "6.0"]


def test_compile_with_pipeline_stages_is_refused():
    with pytest.raises(mt.errors.MeshTorchError, match="--compile"):
        check_config(TrainConfig.of(compile=True, pipeline_stages=2, mesh="b:2"))
