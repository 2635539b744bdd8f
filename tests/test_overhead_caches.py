"""The caches that keep meshtorch's per-op Python small (benchmarks/overhead.py) never serve a
stale entry: layouts are cached per rules object and keyed by (shape, mesh); lowering plans by
everything they depend on (input layouts, grad mask and mode, output shape, rules, mesh, rank);
broadcast shapes, einsum plans and alignments depend on shapes alone. Each test runs the same
shapes under settings that must give different answers, in sequence and in threads."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import ShapeError
from meshtorch.layout import LayoutRules
from meshtorch.lowering.lower import align
from meshtorch.mesh import Mesh


def _layouts_and_values():
    """The layouts an op gives a fixed set of shapes under the current rules, and its values."""
    x = mt.from_global(torch.arange(24.0).reshape(4, 6), "a:4,c:6")
    y = mt.from_global(torch.arange(6.0), "c:6")
    z = x * y + 1.0
    s = mt.reduce_sum(z, "c")
    return str(z.layout), str(s.layout), tuple(z.local.shape), s.to_global().tolist()


def test_same_shapes_under_other_rules_in_sequence_get_other_layouts():
    want = (torch.arange(24.0).reshape(4, 6) * torch.arange(6.0) + 1).sum(1).tolist()
    runs = [("b:2", "a:b"), ("b:2", "c:b"), ("b:2", ""), ("b:2", "a:b"), ("b:1", "a:b"), ("", "")]
    seen = []
    for mesh, rules in runs:
        out = mt.launch(_layouts_and_values, mesh=mesh, rules=rules)[0]
        assert out[3] == want, (mesh, rules)
        seen.append(out[:3])
    assert seen[0] == ("a:b", "a:b", (2, 6))
    assert seen[1] == ("c:b", "replicated", (4, 3))
    assert seen[2] == ("replicated", "replicated", (4, 6))
    assert seen[3] == seen[0]  # back to the first rules: still right
    assert seen[4] == ("a:b", "a:b", (4, 6))  # one processor, axis of size 1: a split of 1
    assert seen[5] == ("replicated", "replicated", (4, 6))


def test_rules_objects_keep_their_own_layouts():
    shape, mesh = mt.Shape("a:4,c:6"), Mesh("b:2")
    r1, r2 = LayoutRules("a:b"), LayoutRules("c:b")
    for _ in range(2):  # the second round is served from the caches
        assert r1.layout(shape, mesh).split == {"a": ("b",)}
        assert r2.layout(shape, mesh).split == {"c": ("b",)}
        assert r1.layout(shape, Mesh("m:2")).split == {}  # another mesh, another entry
    # a copy of the rules starts with its own cache
    odd = mt.Shape("a:3")  # torch.chunk pieces 2 and 1
    copy = LayoutRules(r1)
    mine, theirs = copy.layout(odd, mesh), r1.layout(odd, mesh)
    assert mine is not theirs and mine == theirs
    assert [copy.layout(odd, mesh).local_sizes_at({"b": i}) for i in (0, 1)] == [(2,), (1,)]


def test_threads_with_different_rules_at_once():
    results: dict[str, list] = {}
    errors = []

    def run(rules):
        try:
            for _ in range(5):
                results.setdefault(rules, []).append(
                    mt.launch(_layouts_and_values, mesh="b:2", rules=rules))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in ("a:b", "c:b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for rules, layout in [("a:b", "a:b"), ("c:b", "c:b")]:
        for per_processor in results[rules]:
            assert all(out[0] == layout for out in per_processor), (rules, per_processor)


def test_shape_hash_is_rebuilt_when_unpickled_in_another_process():
    s = mt.Shape("batch:2,length:3")
    code = ("import pickle, sys, meshtorch as mt; s = pickle.loads(sys.stdin.buffer.read()); "
            "d = {mt.Shape('batch:2,length:3'): 1}; print(d[s], s == mt.Shape('batch:2,length:3'))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(s), capture_output=True,
                         check=True)
    assert out.stdout.decode().split() == ["1", "True"]
    r = pickle.loads(pickle.dumps(LayoutRules("batch:b")))
    assert r.rules == {"batch": ("b",)} and r.layout(s, Mesh("b:2")).split == {"batch": ("b",)}


def test_equal_shapes_compare_by_names_and_sizes():
    a, b = mt.Shape("x:2,y:3"), mt.Shape([mt.Dim("x", 2), mt.Dim("y", 3)])
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != mt.Shape("x:2,y:4") and a != mt.Shape("y:3,x:2") and a != mt.Shape("x:2")


def test_align_permutes_and_unsqueezes_for_any_order():
    t = torch.arange(6.0).reshape(2, 3)
    for _ in range(2):  # second time from the cache
        assert torch.equal(align(t, ("a", "b"), ("a", "b")), t)
        assert torch.equal(align(t, ("a", "b"), ("b", "a")), t.T)
        assert torch.equal(align(t, ("a", "b"), ("c", "b", "d", "a")), t.T.reshape(1, 3, 1, 2))
        assert torch.equal(align(t, ["a", "b"], ["a", "c", "b"]), t.reshape(2, 1, 3))


def test_cached_plans_still_check_every_call():
    x = mt.ones("batch:2,d:3")
    dense = mt.nn.Dense(mt.Dim("d", 3), mt.Dim("h", 4))
    assert dense(x).shape == mt.Shape("batch:2,h:4")
    assert dense(mt.ones("length:5,d:3")).shape == mt.Shape("length:5,h:4")
    for _ in range(2):
        with pytest.raises(ShapeError, match="expects dim"):
            dense(mt.ones("batch:2,e:3"))
    # an output given as a generator is read once, also when the plan is cached
    w = mt.ones("d:3,h:4")
    for _ in range(2):
        assert mt.einsum(x, w, output_shape=(n for n in ["batch", "h"])).shape == mt.Shape("batch:2,h:4")
    # a scalar operand in another position is another broadcast plan
    assert (2.0 - x).to_global().tolist() == (1.0 - x + 1.0 - 1.0 + 1.0).to_global().tolist()
    for _ in range(2):
        with pytest.raises(ShapeError, match="neither a MeshTensor nor a scalar"):
            x + [1.0]


def test_a_plan_is_reused_and_a_changed_key_gets_another():
    from meshtorch.lowering.lower import plan_of

    def prog():
        x = mt.from_global(torch.arange(24.0).reshape(4, 6), "a:4,c:6")
        w = mt.from_global(torch.ones(6), "c:6", requires_grad=True)
        p = plan_of("multiply", [x, w], x.shape)
        same = plan_of("multiply", [x, w], x.shape) is p
        with torch.no_grad():
            no_grad = plan_of("multiply", [x, w], x.shape)
        frozen = plan_of("multiply", [x, w.detach()], x.shape)
        y = (x * w).to_global()
        return same, p.adapters, no_grad is p, no_grad.adapters, frozen is p, frozen.adapters, y

    want = torch.arange(24.0).reshape(4, 6)
    # under a:b the replicated w needs its gradient summed along b (one adapter), but only when
    # grad mode is on and w requires grad
    for same, n, ng_same, ng_n, fr_same, fr_n, y in mt.launch(prog, mesh="b:2", rules="a:b"):
        assert same and n == 1
        assert not ng_same and ng_n == 0
        assert not fr_same and fr_n == 0
        assert torch.equal(y, want)
    # other rules, same shapes: another plan, with nothing to adapt
    for same, n, *_, y in mt.launch(prog, mesh="b:2", rules=""):
        assert same and n == 0 and torch.equal(y, want)
    # one processor: a plan with no adapters
    for same, n, *_, y in mt.launch(prog, mesh="b:1", rules="a:b"):
        assert same and n == 0 and torch.equal(y, want)


def test_plan_keys_stand_for_rules_mesh_and_rank_by_one_number():
    """A context numbers its (rules, mesh, rank) once for the plans' keys: contexts alike share
    plans, other rules (or rules swapped on the context) get their own, and a context copied with
    its number (as unpickling in another process would bring one) numbers itself again."""
    import copy

    from meshtorch.comm.base import LocalCommunicator
    from meshtorch.context import ProcessorContext, use
    from meshtorch.lowering import lower as lowering

    def plan(ctx):
        with use(ctx):
            x = mt.ones("a:4,c:6")
            return lowering.plan_of("sum", [x], mt.Shape("c:6"), reduced={"a": "sum"})

    a, b = ProcessorContext(LocalCommunicator(), LayoutRules("a:x")), ProcessorContext(LocalCommunicator())
    same = ProcessorContext(LocalCommunicator(), LayoutRules("a:x"))
    assert plan(a) is plan(same) and plan(a) is not plan(b)
    assert a.plan_scope[2] == same.plan_scope[2] != b.plan_scope[2]
    a.rules = LayoutRules("c:x")  # swapped on the context: numbered again
    assert plan(a) is not plan(same) and a.plan_scope[2] != same.plan_scope[2]
    moved = copy.copy(b)
    moved.plan_scope = (*b.plan_scope[:3], object())  # another process's mark
    assert plan(moved) is plan(b) and moved.plan_scope[3] is b.plan_scope[3]


def test_the_dynamo_test_falls_back_to_is_compiling_without_is_dynamo_compiling():
    # torch.compiler.is_dynamo_compiling is documented as internal: in a torch without it the
    # lowering's per-op test is torch.compiler.is_compiling (a fresh process: the module is made once)
    import subprocess
    import sys

    code = ("import torch; del torch.compiler.is_dynamo_compiling; import meshtorch as mt; "
            "from meshtorch.lowering import lower; "
            "assert lower.is_dynamo_compiling is torch.compiler.is_compiling; "
            "print(mt.einsum('a b, b -> a', mt.ones('a:2,b:3'), mt.ones('b:3')).to_global().tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3.0, 3.0]"


def test_current_without_its_frame_is_current_on_every_thread():
    """``here.ctx or current()`` (the lowering's per-op read of the context, issue 27) is
    ``current()``: a thread's own context inside ``use()``, else the process default of the moment
    (the torch backend's processor), also after a ``use()`` block that began under another default."""
    from meshtorch import context as C
    from meshtorch.comm.base import LocalCommunicator

    def now():
        return C.here.ctx or C.current()

    a, b, c = (C.ProcessorContext(LocalCommunicator()) for _ in range(3))
    before = C._process
    try:
        C.set_process_context(a)
        assert now() is C.current() is a
        with C.use(b):
            assert C.here.ctx is C.current() is b
            with C.use(c):
                assert C.here.ctx is C.current() is c
            assert C.here.ctx is C.current() is b
            C.set_process_context(c)
            seen = []
            thread = threading.Thread(target=lambda: seen.append((now(), C.current())))
            thread.start()
            thread.join()
            assert seen == [(c, c)]
        assert now() is C.current() is c
    finally:
        C._process = before
    assert C.current() is (before or C.current())


def test_a_thread_local_context_is_read_inside_a_compiled_program():
    """The processor's context is a thread's own inside ``use()``: a compiled program reads it there
    (torch 2.11's Dynamo read a thread-local's class attribute instead, so a compiled step on a
    thread-processor ran on the one-processor default and failed naming a missing mesh axis)."""
    import meshtorch as mt

    def prog():  # (one processor: Dynamo is not thread-safe, two threads must not compile at once)
        x = mt.from_global(torch.arange(8.0).reshape(2, 4), "batch:2,d:4")
        f = torch.compile(lambda x: (mt.reduce_sum(x * 2, "d").local, mt.current().mesh.axis_names),
                          fullgraph=True, backend="eager")
        return f(x)

    [(local, axes)] = mt.launch(prog, mesh="b:1", rules="batch:b")
    assert local.tolist() == [12.0, 44.0] and axes == ("b",)


def test_a_use_block_left_on_another_thread_leaves_that_threads_default():
    """A generator holding ``with mt.use(ctx): yield`` may be finished on another thread, which has
    no context of its own: leaving the block there keeps that thread's default (it raised
    AttributeError)."""
    from meshtorch.context import ProcessorContext, here, use

    ctx = mt.current()

    def held():
        with use(ctx):
            yield

    errors = []

    def finish():
        try:
            gen.close()
            errors.append(mt.current())
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(e)

    before = here.ctx
    try:
        gen = held()
        next(gen)
        t = threading.Thread(target=finish)
        t.start()
        t.join()
    finally:
        here.ctx = before  # (this thread's block was never left here: later tests see no context)
    assert len(errors) == 1 and isinstance(errors[0], ProcessorContext), errors


@pytest.mark.parametrize("scalar", ["float32", "float64", "int64", "int8"])
def test_numpys_scalars_are_scalars_as_torch_takes_them(scalar):
    """np.float32(2) * x was refused ("neither a MeshTensor nor a scalar") while np.float64 (a float
    subclass) worked: every numpy real scalar is a scalar operand, with torch's result."""
    np = pytest.importorskip("numpy")
    x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,b:3")
    s = getattr(np, scalar)(2)
    plain = x.to_global()
    for got, want in (((s * x), plain * s), ((x + s), plain + s), ((x - s), plain - s)):
        assert torch.equal(got.to_global(), want), scalar


def test_a_lowered_ops_result_is_made_as_checked_elsewhere_makes_it():
    # lower() builds its result with MeshTensor._checked_elsewhere's body inlined (a Python frame
    # less per op): the same attributes, each set, a tracer seeing the result as it sees any made
    x = mt.from_global(torch.arange(6.0).reshape(2, 3), "a:2,c:3")
    y = mt.reduce_sum(x * 2.0, "c")
    want = mt.MeshTensor._checked_elsewhere(y.local, y.shape, y.layout, y.name)
    assert type(y) is type(want) is mt.MeshTensor
    assert {s: getattr(y, s) for s in mt.MeshTensor.__slots__} == {
        s: getattr(want, s) for s in mt.MeshTensor.__slots__}
    assert y.to_global().tolist() == [6.0, 24.0]
