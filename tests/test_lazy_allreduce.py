"""Mesh-TensorFlow's lazy all-reduce: a replicated tensor used by several ops that vary along an
axis has its gradient summed locally and reduced once per axis group.

The counts are a real threads-backend step's, taken by the communicator alone
(``mt.comm_stats()``, no tracer), against a hand derivation; values and gradients against the
same computation in dense torch on one processor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import meshes, rules_for
from meshtorch.lowering import adapters as ca
from meshtorch.lowering.fused import Fused
from meshtorch.lowering.redistribute import run_shared
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.plan import measure, trace

MESH, RULES = "b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"
BATCH, LENGTH, D_MODEL = 4, 6, 12


def lm_config(layers: int, gated: bool = False) -> TransformerConfig:
    return TransformerConfig(vocab=36, d_model=D_MODEL, heads=4, d_kv=3, d_ff=20, layers=layers,
                             max_length=LENGTH, gated=gated)


def lm_step(layers: int, gated: bool = False, counted=None):
    """An SPMD program: one forward and backward of the LM; the model-axis all_reduces of the
    step (``counted``: read the counters, or ``None`` inside a planner trace)."""
    cfg = lm_config(layers, gated)

    def program():
        model = DecoderLM(cfg, seed=0)
        data = torch.randint(0, cfg.vocab, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(3))
        shape = f"batch:{BATCH},length:{LENGTH}"
        ids, targets = mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape)
        before = mt.comm_stats().copy()
        with measure():
            model.loss(ids, targets).backward()
        if counted is not None:
            diff = mt.comm_stats() - before
            return diff.calls("m", "all_reduce"), diff.bytes("m", "all_reduce")

    return program


def mesh_tf_model_axis(layers: int) -> tuple[int, int]:
    """Mesh-TF's model-axis all_reduces of one forward and backward of the LM on ``b:2,m:2``
    under ``batch:b; heads:m; d_ff:m; vocab:m``, derived by hand (calls, payload bytes).

    Every processor holds batch/2 sequences; an activation slice [batch/2, length, d_model] in
    float32 is ``act`` bytes, a per-position scalar [batch/2, length] is ``pos`` bytes.

    Per layer, four all_reduces of ``act``:
      forward:  the attention output projection contracts heads (split on m): 1;
                the feed-forward output projection contracts d_ff (split on m): 1;
      backward: q, k and v all read the normed input (replicated on m) against weights split
                on heads: their partial gradients are added locally, then reduced: 1;
                the feed-forward input projection, against d_ff split: 1.
    Outside the layers:
      forward:  the embedding lookup sums the rows of the table split on vocab: ``act``;
                the softmax over vocab (split): its max, its sum of exponentials and the
                target's logit, three all_reduces of ``pos``;
      backward: the output layer's input gradient (the table split on vocab): ``act``.
    """
    act = BATCH // 2 * LENGTH * D_MODEL * 4
    pos = BATCH // 2 * LENGTH * 4
    return 4 * layers + 2 + 3, (4 * layers + 2) * act + 3 * pos


@pytest.mark.parametrize("gated", [False, True])
def test_lm_layer_moves_mesh_tf_model_axis_bytes(gated):
    counts = {n: mt.launch(lm_step(n, gated, counted=True), mesh=MESH, rules=RULES) for n in (1, 2, 3)}
    for n, per_proc in counts.items():
        assert per_proc == [mesh_tf_model_axis(n)] * 4, n
    act = BATCH // 2 * LENGTH * D_MODEL * 4
    for n in (2, 3):
        (calls, nbytes), (calls_less, nbytes_less) = counts[n][0], counts[n - 1][0]
        assert (calls - calls_less, nbytes - nbytes_less) == (4, 4 * act)


def test_the_planner_predicts_the_lazy_reduction():
    est = {n: mt.plan.estimate(lm_step(n), MESH, RULES, device="a100") for n in (1, 2)}
    for n, e in est.items():
        calls, nbytes = mesh_tf_model_axis(n)
        assert e.calls_per_axis["m"]["all_reduce"] == calls
        assert e.bytes_per_axis["m"]["all_reduce"] == nbytes
    meta = trace(lm_step(2), mesh=MESH, rules=RULES, backend="meta")
    assert meta.comm.bytes("m", "all_reduce") - est[1].bytes_per_axis["m"]["all_reduce"] \
        == 4 * BATCH // 2 * LENGTH * D_MODEL * 4


def _dense(x, ws, c):
    """The reference: four contractions of ``x`` (one under another dim name) and one
    elementwise use, on one processor."""
    y1 = torch.einsum("bd,dh->bh", x, ws[0])
    y2 = torch.einsum("bd,dh->bh", x, ws[1])
    y3 = torch.einsum("bd,dk->bk", x, ws[2])
    y4 = torch.einsum("bd,dh->bh", x, ws[0])
    return ((y1 * c[0]).sum() + (y2 * c[1]).sum() + (y3 * c[2]).sum() + (x * x * c[3]).sum()
            + (y4 * c[4]).sum())


@given(data=st.data())
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_values_and_gradients_equal_dense_torch(data):
    mesh = data.draw(meshes(max_procs=8))
    rules = data.draw(rules_for(mesh, ["batch", "d", "h", "k"]))
    fused = data.draw(st.booleans())
    g = torch.Generator().manual_seed(0)

    def rnd(*size):
        return torch.randn(*size, generator=g, dtype=torch.float64)

    x, ws = rnd(4, 8), [rnd(8, 4), rnd(8, 4), rnd(8, 12)]
    c = [rnd(4, 4), rnd(4, 4), rnd(4, 12), rnd(4, 8), rnd(4, 4)]
    ref_x, ref_ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    ref_loss = _dense(ref_x, ref_ws, c)
    ref_loss.backward()

    def program():
        mx = mt.from_global(x, "batch:4,d:8", requires_grad=True)
        mws = [mt.from_global(w, s, requires_grad=True)
               for w, s in zip(ws, ["d:8,h:4", "d:8,h:4", "d:8,k:12"])]
        specs = ["batch:4,h:4"] * 2 + ["batch:4,k:12", "batch:4,d:8", "rows:4,h:4"]
        mc = [mt.from_global(t, s) for t, s in zip(c, specs)]
        ys = [mt.einsum("batch d, d h -> batch h", mx, mws[0]),
              mt.einsum("batch d, d h -> batch h", mx, mws[1])]
        with torch.no_grad():  # a use outside autograd neither shares nor disturbs the shared one
            mt.einsum("batch d, d k -> batch k", mx, mws[2])
        if fused:  # the third contraction on the fused-reduction path
            f = Fused()
            f.lower("einsum", [mx, mws[2]], mt.Shape("batch:4,k:12"),
                    lambda view, a, b: torch.einsum("bd,dk->bk", a, b), reduced={"d": "sum"})
            (y3,) = f.run()
        else:
            y3 = mt.einsum("batch d, d k -> batch k", mx, mws[2])
        # x under another name: where the rules lay ``rows`` out as ``batch``, the same slice
        y4 = mt.einsum("rows d, d h -> rows h", mt.rename(mx, "batch", "rows"), mws[0])
        terms = [mt.reduce_sum(y * t) for y, t in zip(ys + [y3], mc)] + [mt.reduce_sum(mx * mx * mc[3])]
        loss = terms[0] + terms[1] + terms[2] + terms[3] + mt.reduce_sum(y4 * mc[4])
        loss.backward()
        return (loss.item(), mx.grad.to_global(), [w.grad.to_global() for w in mws])

    for loss, gx, gws in mt.launch(program, mesh=mesh, rules=rules):
        assert loss == pytest.approx(ref_loss.item(), rel=1e-9)
        torch.testing.assert_close(gx, ref_x.grad, rtol=1e-9, atol=1e-9)
        for gw, rw in zip(gws, ref_ws):
            torch.testing.assert_close(gw, rw.grad, rtol=1e-9, atol=1e-9)


def three_uses():
    """x replicated on m, three contractions against weights split on m (two on h, one on k) and
    an elementwise use; the model-axis all_reduces of the backward and a gradient entry."""
    x = mt.from_global(torch.ones(4, 8), "batch:4,d:8", requires_grad=True)
    ys = [mt.einsum("batch d, d h -> batch h", x, mt.ones("d:8,h:4") * (i + 1)) for i in range(2)]
    y3 = mt.einsum("batch d, d k -> batch k", x, mt.ones("d:8,k:12"))
    loss = mt.reduce_sum(ys[0]) + mt.reduce_sum(ys[1]) + mt.reduce_sum(y3) + mt.reduce_sum(x * 3)
    before = mt.comm_stats().copy()
    loss.backward()
    diff = mt.comm_stats() - before
    return diff.calls("m", "all_reduce"), diff.bytes("m", "all_reduce"), x.grad.to_global()[0, 0].item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_three_uses_reduce_the_input_gradient_once(backend):
    """One all_reduce of x's gradient over m, where one per use ran before, on threads and on
    two gloo processes."""
    out = mt.launch(three_uses, mesh="m:2", rules="h:m; k:m", backend=backend, nprocs=2)
    # d loss / d x = 4·1 + 4·2 + 12·1 + 3; one all_reduce of x's [4, 8] float32 gradient slice
    assert out == [(1, 4 * 8 * 4, 27.0)] * 2


def test_shared_adapters_follow_the_slice_and_the_processor():
    """An in-place update of the slice (an optimizer step) makes the next use adapt afresh; a
    use after a backward shares again; each processor keeps its own."""

    def program():
        comm = mt.current().comm
        x = mt.from_global(torch.arange(4.0).reshape(2, 2), "batch:2,d:2", requires_grad=True)
        steps = ((ca.all_gather, "m", (0,)),)   # whole along m, the gradient reduce_scattered
        a = run_shared(x.local, x.adapter_memo(), steps)
        calls = comm.stats.calls("m", "all_gather")
        same = (run_shared(x.local, x.adapter_memo(), steps) is a
                and comm.stats.calls("m", "all_gather") == calls)
        (a * 2).sum().backward()
        again = run_shared(x.local, x.adapter_memo(), steps) is a
        with torch.no_grad():
            x.local.add_(10.0)
        fresh = run_shared(x.local, x.adapter_memo(), steps)
        (fresh * 3).sum().backward()
        return same, again, fresh is not a, fresh.tolist(), x.grad.local.tolist(), id(a)

    out = mt.launch(program, mesh="m:2", rules="batch:m")
    assert [o[:3] for o in out] == [(True, True, True)] * 2
    # every processor gathered the updated whole; each slice's gradient is 2·2 + 3·2 (two
    # processors' uses summed by the reduce_scatter)
    assert [o[3] for o in out] == [[[10.0, 11.0], [12.0, 13.0]]] * 2
    assert [o[4] for o in out] == [[[10.0, 10.0]]] * 2
    assert out[0][5] != out[1][5]
