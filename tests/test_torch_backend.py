"""The torch.distributed backend (gloo, CPU) against the threads backend and dense torch.

One process group per mesh size runs the whole op battery and returns every
processor's view (values, gradients, collective counters); the tests then
compare them with plain float64 torch on one processor and with the same
battery on the threads backend.
"""

from __future__ import annotations

import time

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import CommError, MeshError, ProcessorError

# one xdist worker runs the whole module: its module fixture launches gloo processes once
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("test_torch_backend")]

RULES = "batch:b; seq:m; d:m; ff:m; vocab:m"
B, S, D, F, V, E = 4, 4, 8, 8, 8, 6


def _t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _shift_ref(t, k, dim, wrap):
    out = torch.roll(t, k, dim)
    if not wrap:
        idx = torch.arange(t.shape[dim])
        keep = (idx - k >= 0) & (idx - k < t.shape[dim])
        shape = [1] * t.dim()
        shape[dim] = -1
        out = out * keep.reshape(shape).to(t.dtype)
    return out


def _cases():
    """name -> (inputs [(global tensor, named shape)], meshtorch fn, dense torch fn or None)."""
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    tgt = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(6))
    x = (_t(B, D, seed=1), "batch:4,d:8")
    logits = (_t(B, V, seed=7), "batch:4,vocab:8")
    return {
        # contracted d split on m, output split ff on m: reduce_scatter
        "einsum_reduce_scatter": ([x, (_t(D, F, seed=2), "d:8,ff:8")],
                                  lambda a, w: mt.einsum("batch d, d ff -> batch ff", a, w),
                                  lambda a, w: a @ w),
        # contracted d split on m, output replicated on m: all_reduce
        "einsum_all_reduce": ([x, (_t(D, E, seed=3), "d:8,e:6")],
                              lambda a, w: mt.einsum("batch d, d e -> batch e", a, w),
                              lambda a, w: a @ w),
        # every split dim of the inputs is split the same way in the output: local
        "einsum_local": ([(_t(B, E, seed=4), "batch:4,e:6"), (_t(E, V, seed=8), "e:6,vocab:8")],
                         lambda a, w: mt.einsum("batch e, e vocab -> batch vocab", a, w),
                         lambda a, w: a @ w),
        # seq split on m in the input but not in the output (ff takes m): all_gather / all_to_all
        "einsum_all_gather": ([(_t(S, E, seed=9), "seq:4,e:6"), (_t(E, F, seed=10), "e:6,ff:8")],
                              lambda p, q: mt.einsum("seq e, e ff -> ff seq", p, q),
                              lambda p, q: (p @ q).T),
        # the output splits vocab, which the replicated operand does not have: local slice
        "einsum_outer": ([(_t(V, seed=11), "vocab:8"), (_t(B, E, seed=12), "batch:4,e:6")],
                         lambda c, a: mt.einsum("vocab, batch e -> batch e vocab", c, a),
                         lambda c, a: a[:, :, None] * c),
        # the weight is split on the contracted d but the activation holds d whole
        "einsum_fsdp_weight": ([(_t(B, S, D, seed=13), "batch:4,seq:4,d:8"), (_t(D, F, seed=14), "d:8,ff:8")],
                               lambda h, w: mt.einsum("batch seq d, d ff -> batch seq ff", h, w),
                               lambda h, w: h @ w),
        "reduce_sum": ([x], lambda a: mt.reduce_sum(a, "d"), lambda a: a.sum(1)),
        "reduce_max": ([x], lambda a: mt.reduce_max(a, "d"), lambda a: a.max(1).values),
        "reduce_mean_batch": ([x], lambda a: mt.reduce_mean(a, "batch"), lambda a: a.mean(0)),
        "reduce_logsumexp": ([logits], lambda a: mt.reduce_logsumexp(a, "vocab"),
                             lambda a: a.logsumexp(1)),
        "softmax": ([logits], lambda a: mt.softmax(a, "vocab"), lambda a: a.softmax(1)),
        "layer_norm": ([x], lambda a: mt.layer_norm(a, "d"),
                       lambda a: torch.nn.functional.layer_norm(a, (D,), eps=1e-5)),
        "reshape_merge": ([(_t(B, S, E, seed=15), "batch:4,seq:4,e:6")],
                          lambda a: mt.reshape(a, "batch:4,se:24"), lambda a: a.reshape(B, S * E)),
        "reshape_split": ([x], lambda a: mt.reshape(a, "batch:4,d1:2,d2:4"), lambda a: a.reshape(B, 2, 4)),
        # seq holds m, ff is replicated; after the transpose ff holds m: all_to_all
        "relayout_transpose": ([(_t(S, F, seed=16), "seq:4,ff:8")],
                               lambda a: mt.transpose(a, ["ff", "seq"]), lambda a: a.T),
        "relayout_rename": ([x], lambda a: mt.rename(a, "d", "e8"), lambda a: a),
        "shift_split_dim": ([(_t(B, S, seed=17), "batch:4,seq:4")],
                            lambda a: mt.shift(a, "seq", 1), lambda a: _shift_ref(a, 1, 1, False)),
        "shift_wrap_far": ([(_t(B, S, seed=18), "batch:4,seq:4")],
                           lambda a: mt.shift(a, "seq", -3, wrap=True), lambda a: _shift_ref(a, -3, 1, True)),
        "gather_split_vocab": ([(_t(V, E, seed=19), "vocab:8,e:6"), (ids, "batch:4,seq:4")],
                               lambda tab, i: mt.embedding(tab, i, "vocab"), lambda tab, i: tab[i]),
        "cross_entropy": ([logits, (tgt, "batch:4")], lambda lg, t: mt.cross_entropy(lg, t, "vocab"),
                          lambda lg, t: torch.nn.functional.cross_entropy(lg, t, reduction="none")),
        # no dense torch twin: compared with the one-processor run (layout-invariant masks)
        "dropout": ([x], lambda a: mt.dropout(a, 0.5, seed=3), None),
    }


def _probe(shape, seed=99):
    return _t(*shape, seed=seed) if len(shape) else torch.tensor(0.7, dtype=torch.float64)


def battery() -> dict:
    """Every case on this processor: gathered outputs, input grads, and collective counters."""
    out = {}
    for name, (inputs, fn, _) in _cases().items():
        mt.reset_comm_stats()
        xs = [mt.from_global(t, s, requires_grad=t.is_floating_point()) for t, s in inputs]
        y = fn(*xs)
        probe = mt.from_global(_probe(y.shape.sizes), y.shape)
        mt.reduce_sum(y * probe).backward()
        grads = [x.grad.to_global() if x.requires_grad else None for x in xs]
        out[name] = {"value": y.to_global().detach(), "grads": grads, "stats": mt.comm_stats().as_dict()}
    return out


def battery_and_mismatch() -> dict:
    """The battery, then a collective one processor skips (with check=True)."""
    out = battery()
    comm = mt.current().comm
    x = mt.from_global(_t(B, D, seed=1), "batch:4,d:8")
    try:
        if comm.coords["m"] == 0:
            mt.reduce_sum(x, "d")  # all_reduce over m
        x.to_global()  # all_gather over m
        out["mismatch"] = None
    except CommError as e:
        out["mismatch"] = str(e)
    # the check runs before any payload moves, so the group is still in step
    out["after"] = comm.all_reduce(torch.ones(1, dtype=torch.float64), "m").item()
    if comm.backend == "torch":  # groups created lazily, on first use, as for meshes of many axes
        import meshtorch.comm.torch as ct

        eager, ct.EAGER_AXES = ct.EAGER_AXES, 0
        try:
            lazy = ct.TorchCommunicator(comm.mesh, timeout=60)
        finally:
            ct.EAGER_AXES = eager
        me = torch.tensor([float(comm.rank)])
        out["lazy"] = [lazy.all_reduce(me, axes).item() for axes in ("m", ("b", "m"), "b", "m")]
    return out


def timeout_then_fail() -> str:
    """Processor 0 waits in a collective processor 1 never joins, then fails."""
    comm = mt.current().comm
    if comm.rank == 1:
        time.sleep(30)  # never joins; the parent must terminate it
        return "late"
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), "m")
    except CommError as e:
        raise ValueError(f"after {time.monotonic() - t0:.1f}s: {e}") from e
    return "no timeout"


def _dense_reference() -> dict:
    ref = {}
    for name, (inputs, _, fn) in _cases().items():
        if fn is None:
            continue
        xs = [t.clone().requires_grad_(t.is_floating_point()) for t, _ in inputs]
        y = fn(*xs)
        (y * _probe(tuple(y.shape))).sum().backward()
        ref[name] = {"value": y.detach(), "grads": [x.grad if x.requires_grad else None for x in xs]}
    return ref


@pytest.fixture(scope="module")
def dense():
    return _dense_reference()


@pytest.fixture(scope="module")
def single():
    return battery()  # one processor, no mesh: the layout-invariance reference for dropout


@pytest.fixture(scope="module")
def runs():
    """{n: (torch results per processor, threads results per processor)} for 2 and 4 processes."""
    out = {}
    for mesh in ("b:1,m:2", "b:2,m:2"):
        t = mt.launch(battery_and_mismatch, mesh=mesh, rules=RULES, backend="torch", check=True, timeout=60)
        th = mt.launch(battery_and_mismatch, mesh=mesh, rules=RULES, check=True, timeout=60)
        out[mt.Mesh(mesh).size] = (t, th)
    return out


def _close(a, b, tol):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("n", [2, 4])
def test_ops_match_dense_torch_values_and_grads(runs, dense, n):
    torch_runs, _ = runs[n]
    for rank, res in enumerate(torch_runs):
        for name, ref in dense.items():
            got = res[name]
            assert _close(got["value"], ref["value"], 1e-9), f"{name} value on processor {rank} of {n}"
            for i, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
                assert _close(g, r, 1e-9), f"{name} grad of input {i} on processor {rank} of {n}"


@pytest.mark.parametrize("n", [2, 4])
def test_ops_match_threads_backend_and_counters(runs, n):
    torch_runs, thread_runs = runs[n]
    for rank, (a, b) in enumerate(zip(torch_runs, thread_runs)):
        for name in _cases():
            assert _close(a[name]["value"], b[name]["value"], 1e-12), f"{name} on processor {rank}"
            for g, h in zip(a[name]["grads"], b[name]["grads"]):
                assert _close(g, h, 1e-12), f"{name} grads on processor {rank}"
            # same collectives, same payload bytes, per kind and axes
            assert a[name]["stats"] == b[name]["stats"], name


def test_dropout_is_layout_invariant_on_processes(runs, single):
    ref = single["dropout"]["value"]
    x = _t(B, D, seed=1)
    assert set(torch.unique(ref / x).round(decimals=9).tolist()) == {0.0, 2.0}
    for n in (2, 4):
        for res in runs[n][0]:
            assert torch.equal(res["dropout"]["value"], ref)


def test_battery_exercises_every_collective_kind(runs):
    kinds = {k.split("@")[0] for res in runs[4][0] for case in _cases() for k in res[case]["stats"]}
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute"} <= kinds


@pytest.mark.parametrize("n", [2, 4])
def test_skipped_collective_raises_on_every_processor_with_both_call_sites(runs, n):
    for backend_runs in runs[n]:
        for rank, res in enumerate(backend_runs):
            msg = res["mismatch"]
            assert msg is not None, f"processor {rank} did not notice the skipped collective"
            assert "collective mismatch" in msg and "all_reduce" in msg and "all_gather" in msg
            # both sides' user call sites: the reduce_sum line and the to_global line
            assert msg.count("test_torch_backend.py:") == 2, msg
            assert res["after"] == 2.0


def test_timeout_names_collective_and_failure_propagates_without_hang():
    t0 = time.monotonic()
    with pytest.raises(ProcessorError) as info:
        mt.launch(timeout_then_fail, mesh="m:2", backend="torch", timeout=3)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 0 and err.coords == {"m": 0}
    assert isinstance(err.__cause__, ValueError)
    msg = str(err)
    assert "all_reduce" in msg and "within the 3 s timeout" in msg
    assert "test_torch_backend.py:" in msg and "in timeout_then_fail" in msg
    assert elapsed < 28, "processor 1 (sleeping 30 s) should have been terminated"


def test_launch_errors_before_spawning():
    with pytest.raises(MeshError, match="nprocs=3"):
        mt.launch(battery, mesh="m:2", backend="torch", nprocs=3)
    with pytest.raises(ProcessorError, match="picklable"):
        mt.launch(lambda: 1, mesh="m:2", backend="torch")


def test_init_distributed_rejects_mesh_of_wrong_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(MeshError, match="mesh 'b:2,m:2' has 4 processors but 2 processes"):
        mt.init_distributed("b:2,m:2")


# what torch 2.13's gloo raised, a plain RuntimeError, in a collective whose peer process had exited
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                    "closed by peer [127.0.0.1]:3227. This is typically caused by a remote worker crashing. "
                    "Check the logs of the remote worker before reporting an error.")
DistNetworkError = torch.distributed.DistNetworkError


@pytest.mark.parametrize("raised, peer_left", [
    (RuntimeError(GLOO_PEER_CLOSED), True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [10.77.0.2]:4051: Connection reset by peer"),
     True),
    # the rendezvous store's connection to a host that went away, and to one never reached
    (DistNetworkError("recvValue failed on SocketImpl(fd=7): Connection reset by peer"), True),
    (DistNetworkError("The client socket has timed out after 300000ms while trying to connect to "
                      "(10.77.0.1, 29621)."), False),
    (RuntimeError("Unsupported address family"), False),
])
def test_joining_the_world_names_a_processor_that_left_while_it_connected(monkeypatch, raised, peer_left):
    def init_process_group(*args, **kwargs):
        raise raised

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(RuntimeError) as e:
        mt.init_distributed("b:1", store=torch.distributed.HashStore(), rank=0, world_size=1, device="cpu",
                            timeout=5)
    if peer_left:
        assert isinstance(e.value, CommError) and e.value.__cause__ is raised
        assert str(e.value) == ("joining the world of 1 processes failed because a processor exited or "
                                f"crashed while it was connecting ({raised})")
    else:  # torch's own error, untouched
        assert e.value is raised


@pytest.mark.parametrize("n", [2, 4])
def test_lazily_created_groups_reduce_over_the_right_processors(runs, n):
    mesh = mt.Mesh("b:1,m:2" if n == 2 else "b:2,m:2")
    for rank, res in enumerate(runs[n][0]):
        want = [float(sum(mesh.group(rank, axes))) for axes in (("m",), ("b", "m"), ("b",), ("m",))]
        assert res["lazy"] == want
