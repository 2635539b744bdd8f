"""Spatial partitioning: convolutions, transposed convolutions, pools and the halo exchange,
on 1-3-axis meshes against dense torch (values and gradients), and their communication
against the analytic halo size."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import meshtorch as mt
from mesh_harness import check_op, fwd_bwd_counts, meshes, multi_rules_for, rand

SET = settings(max_examples=12, deadline=None)
PADS = st.sampled_from(["same", "valid", 1])


def _tf_pads(padding, n, span, stride):
    """TensorFlow's SAME/VALID padding, written out: (before, after)."""
    if padding == "same":
        out = -(-n // stride)
        total = max((out - 1) * stride + span - n, 0)
        return total // 2, total - total // 2
    return (0, 0) if padding == "valid" else (padding, padding)


def _check_or_reject(fn, *args, **kwargs):
    """Run a check; a layout whose halo is wider than a neighbour's slice is not a case."""
    try:
        fn(*args, **kwargs)
    except mt.errors.LayoutError as e:
        assert "halo wider than a slice" in str(e)
        assume(False)


@given(data=st.data(), rank=st.sampled_from([1, 2]), padding=PADS, stride=st.sampled_from([1, 2]),
       dilation=st.sampled_from([1, 2]), k=st.sampled_from([1, 2, 3]))
@SET
def test_conv_matches_dense(data, rank, padding, stride, dilation, k):
    mesh = data.draw(meshes())
    dims = ["h", "w"][:rank]
    sizes = [data.draw(st.sampled_from([7, 8, 12])) for _ in dims]
    b, c, o = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 3])), 2
    rules = data.draw(multi_rules_for(mesh, ["batch", *dims, "c", "out"]))
    x, w = rand(b, *sizes, c, seed=1), rand(*[k] * rank, c, o, seed=2)
    xs = ",".join([f"batch:{b}", *[f"{d}:{n}" for d, n in zip(dims, sizes)], f"c:{c}"])
    ks = ",".join([*[f"k{d}:{k}" for d in dims], f"c:{c}", f"out:{o}"])
    span = dilation * (k - 1) + 1
    pads = [p for n in reversed(sizes) for p in _tf_pads(padding, n, span, stride)]
    conv = (F.conv1d, F.conv2d)[rank - 1]
    mt_conv = (mt.conv1d, mt.conv2d)[rank - 1]

    def dense(x, w):  # channels first for torch, explicit padding
        xt = F.pad(x.movedim(-1, 1), pads)
        wt = w.movedim(-1, 0).movedim(-1, 1)
        return conv(xt, wt, stride=stride, dilation=dilation).movedim(1, -1)

    _check_or_reject(check_op, lambda x, w: mt_conv(x, w, dims, [f"k{d}" for d in dims], padding, stride,
                                                    dilation), dense, [(x, xs), (w, ks)], mesh, rules)


def test_conv2d_with_one_output_channel_per_processor_matches_dense():
    # hypothesis found it: torch's CPU conv backward refused the permuted one-channel weight
    # ("slow_conv2d: grad_weight must be contiguous")
    x, w = rand(2, 7, 7, 3, seed=1), rand(2, 2, 3, 2, seed=2)
    check_op(lambda x, w: mt.conv2d(x, w, ["h", "w"], ["kh", "kw"], "same"),
             lambda x, w: F.conv2d(F.pad(x.movedim(-1, 1), (0, 1, 0, 1)),
                                   w.permute(3, 2, 0, 1)).movedim(1, -1),
             [(x, "batch:2,h:7,w:7,c:3"), (w, "kh:2,kw:2,c:3,out:2")], "x:2", "out:x")


def test_conv3d_matches_dense_with_depth_split():
    x, w = rand(1, 4, 4, 6, 2, seed=3), rand(3, 1, 3, 2, 2, seed=4)
    check_op(lambda x, w: mt.conv3d(x, w),
             lambda x, w: F.conv3d(x.movedim(-1, 1), w.permute(4, 3, 0, 1, 2),
                                   padding=(1, 0, 1)).movedim(1, -1),
             [(x, "batch:1,d:4,h:4,w:6,c:2"), (w, "kd:3,kh:1,kw:3,c:2,out:2")], "x:2,y:2", "d:x; w:y")


@given(data=st.data(), rank=st.sampled_from([1, 2]), padding=PADS, stride=st.sampled_from([1, 2, 3]),
       k=st.sampled_from([1, 2, 3]))
@SET
def test_conv_transpose_matches_dense(data, rank, padding, stride, k):
    mesh = data.draw(meshes())
    dims = ["h", "w"][:rank]
    sizes = [data.draw(st.sampled_from([4, 5, 8])) for _ in dims]
    rules = data.draw(multi_rules_for(mesh, ["batch", *dims, "c", "out"]))
    x, w = rand(2, *sizes, 2, seed=5), rand(*[k] * rank, 2, 3, seed=6)
    xs = ",".join(["batch:2", *[f"{d}:{n}" for d, n in zip(dims, sizes)], "c:2"])
    ks = ",".join([*[f"k{d}:{k}" for d in dims], "c:2", "out:3"])
    # output sizes and front crops: TF's SAME (n*s) and VALID (every reached position), torch's int
    crop = {"same": max(k - stride, 0) // 2, "valid": 0}.get(padding, padding)
    outs = [{"same": n * stride, "valid": n * stride + max(k - stride, 0)}.get(
        padding, (n - 1) * stride + k - 2) for n in sizes]
    assume(min(outs) >= 1)
    tconv = (F.conv_transpose1d, F.conv_transpose2d)[rank - 1]
    mt_tconv = (mt.conv_transpose1d, mt.conv_transpose2d)[rank - 1]

    def dense(x, w):
        full = tconv(x.movedim(-1, 1), w.movedim(-2, 0).movedim(-1, 1), stride=stride)
        for i, m in enumerate(outs):  # crop the front, zeros past the full output's end
            full = full.narrow(2 + i, crop, min(m, full.shape[2 + i] - crop))
            full = F.pad(full, [0, 0] * (rank - 1 - i) + [0, m - full.shape[2 + i]])
        return full.movedim(1, -1)

    _check_or_reject(check_op, lambda x, w: mt_tconv(x, w, dims, [f"k{d}" for d in dims], padding, stride),
                     dense, [(x, xs), (w, ks)], mesh, rules)


def _pool_ref(x, dims_at, size, stride, padding, is_max):
    """Windows by unfold: pads are NaN and take no part (nanmean; max over the rest)."""
    y = x
    for i in dims_at:
        n = y.shape[i]
        before, after = _tf_pads(padding, n, size, stride)
        pad = [0, 0] * (y.dim() - 1 - i) + [before, after]
        y = F.pad(y, pad, value=math.nan).unfold(i, size, stride)
    wins = y.flatten(-len(dims_at))
    if is_max:
        return torch.where(wins.isnan(), -math.inf, wins).amax(-1)
    return wins.nanmean(-1)


@given(data=st.data(), rank=st.sampled_from([1, 2]), padding=st.sampled_from(["same", "valid"]),
       size=st.sampled_from([2, 3]), stride=st.sampled_from([None, 1, 2]), is_max=st.booleans())
@SET
def test_pool_matches_dense(data, rank, padding, size, stride, is_max):
    mesh = data.draw(meshes())
    dims = ["h", "w"][:rank]
    sizes = [data.draw(st.sampled_from([6, 7, 8])) for _ in dims]
    rules = data.draw(multi_rules_for(mesh, ["batch", *dims, "c"]))
    x = rand(2, *sizes, 3, seed=7)
    xs = ",".join(["batch:2", *[f"{d}:{n}" for d, n in zip(dims, sizes)], "c:3"])
    op = mt.max_pool if is_max else mt.avg_pool
    _check_or_reject(check_op, lambda x: op(x, dims, size, stride, padding),
                     lambda t: _pool_ref(t, range(1, 1 + rank), size, stride or size, padding, is_max),
                     [(x, xs)], mesh, rules)


@given(data=st.data(), left=st.integers(0, 2), right=st.integers(0, 2), wrap=st.booleans(),
       n=st.sampled_from([7, 8, 12]))
@SET
def test_halo_exchange_is_a_window_of_the_padded_dim(data, left, right, wrap, n):
    mesh = data.draw(meshes())
    rules = data.draw(multi_rules_for(mesh, ["t", "p"]))
    x = rand(3, n, seed=8)
    g = torch.linspace(-1, 1, 3 * (n + left + right), dtype=torch.float64)

    def prog():
        xm = mt.from_global(x, f"p:3,t:{n}", requires_grad=True)
        t = mt.halo_exchange(xm, "t", left, right, wrap=wrap)
        (ps, pn), (ts, tn) = xm.layout.slices(mt.current().coords)
        # the window's share of a fixed global weight, so that the gradient is checkable
        wt = g.reshape(3, -1)[ps:ps + pn, ts:ts + tn + left + right]
        (t * wt).sum().backward()
        return t.detach(), (ps, pn, ts, tn), xm.grad.local

    try:
        outs = mt.launch(prog, mesh=mesh, rules=rules)
    except mt.errors.LayoutError:
        assume(False)
    def padded(t):
        return torch.cat([t[:, n - left:], t, t[:, :right]], 1) if wrap else F.pad(t, (left, right))

    for t, (ps, pn, ts, tn), _ in outs:
        assert torch.equal(t, padded(x)[ps:ps + pn, ts:ts + tn + left + right])
    # the gradient: each distinct window's loss as a function of the global x, summed (the halos'
    # gradients come back from the neighbours that used them)
    xr = x.clone().requires_grad_()
    windows = dict.fromkeys((ps, pn, ts, tn) for _, (ps, pn, ts, tn), _ in outs)
    weights = g.reshape(3, -1)
    loss = sum((padded(xr)[ps:ps + pn, ts:ts + tn + left + right]
                * weights[ps:ps + pn, ts:ts + tn + left + right]).sum() for ps, pn, ts, tn in windows)
    loss.backward()
    total = torch.zeros(3, n, dtype=torch.float64)
    for _, (ps, pn, ts, tn), grad in outs:
        total[ps:ps + pn, ts:ts + tn] = grad
    torch.testing.assert_close(total, xr.grad)


def _halo_bytes(mesh_sizes, h, w, b, c, k, split):
    """Analytic halo volume of a 'same', stride-1 k x k conv (8-byte floats), summed over processors:
    along h (P pieces) each of the P - 1 inner boundaries carries (k - 1) rows of b * w * c both ways
    together; along w (Q pieces) each of the Q - 1 boundaries carries (k - 1) columns of the
    h-extended slice, b * (h / P + k - 1) * c, in every one of the P rows of processors."""
    P, Q = (mesh_sizes.get(split.get("h"), 1), mesh_sizes.get(split.get("w"), 1))
    along_h = (P - 1) * (k - 1) * b * w * c * 8
    along_w = P * (Q - 1) * (k - 1) * b * (h // P + (k - 1 if P > 1 else 0)) * c * 8
    return along_h, along_w


@pytest.mark.parametrize("mesh,rules", [("x:4", "h:x"), ("x:2,y:2", "h:x; w:y"), ("x:2,y:4", "h:y; w:x"),
                                        ("x:2,y:2", "h:(x,y)")])
def test_conv_sends_exactly_the_halo(mesh, rules):
    b, h, w, c, o, k = 2, 8, 8, 3, 4, 3

    def inputs():
        x = mt.from_global(rand(b, h, w, c, seed=1), f"batch:{b},h:{h},w:{w},c:{c}", requires_grad=True)
        kern = mt.from_global(rand(k, k, c, o, seed=2), f"kh:{k},kw:{k},c:{c},out:{o}", requires_grad=True)
        return x, kern

    stats = mt.launch(fwd_bwd_counts(inputs, lambda x, kern: mt.conv2d(x, kern)), mesh=mesh, rules=rules)
    sizes = {p.split(":")[0]: int(p.split(":")[1]) for p in mesh.split(",")}
    split = {}
    for part in rules.split(";"):
        d, axes = (s.strip() for s in part.split(":"))
        split[d] = axes.strip("()").replace(",", "")
    if "(" in rules:  # h over (x, y): one group of 4 pieces
        sizes["xy"] = sizes["x"] * sizes["y"]
    along_h, along_w = _halo_bytes(sizes, h, w, b, c, k, split)

    def permuted(which):
        return sum(v["bytes"] for s in stats for key, v in s[which].items() if key.startswith("permute"))

    assert permuted(0) == along_h + along_w  # forward
    assert permuted(1) == along_h + along_w  # backward: the halos' gradients go back
    for fwd, bwd in stats:
        assert set(fwd) == {key for key in fwd if key.startswith("permute")}
        # backward also sums the replicated kernel's gradient over the processors that split the image
        assert {key.split("@")[0] for key in bwd} <= {"permute", "all_reduce"}
        assert sum(v["bytes"] for key, v in bwd.items() if key.startswith("all_reduce")) == k * k * c * o * 8


def test_halo_wider_than_a_slice_names_dim_axis_and_mesh():
    def prog():
        x = mt.from_global(rand(1, 8, 1), "batch:1,h:8,c:1")
        return mt.conv1d(x, mt.ones("kw:7,c:1,out:1", dtype=torch.float64), dims="h").to_global()

    with pytest.raises(mt.errors.LayoutError) as e:
        mt.launch(prog, mesh="x:8", rules="h:x")
    msg = str(e.value)
    assert "'h'" in msg and "axis x" in msg and "mesh 'x:3'" in msg, msg
    # the mesh it proposes works
    assert torch.allclose(mt.launch(prog, mesh="x:3", rules="h:x")[0], mt.launch(prog, mesh="x:1")[0])


def test_conv_argument_errors_name_the_dims():
    x, k = mt.ones("batch:1,h:4,c:2"), mt.ones("kw:3,c:2,out:1")
    with pytest.raises(mt.errors.ShapeError, match="no spatial dim 'w'"):
        mt.conv1d(x, k)
    with pytest.raises(mt.errors.ShapeError, match="one output-channel dim"):
        mt.conv1d(x, mt.ones("kw:3,d:2,out:1"), dims="h")
    with pytest.raises(mt.errors.ArgumentError, match="stride"):
        mt.conv1d(x, k, dims="h", stride=0)


@given(data=st.data(), k=st.integers(-5, 5), wrap=st.booleans(), n=st.sampled_from([7, 9, 12]))
@SET
def test_shift_over_several_axes_or_uneven_sends_only_the_halo(data, k, wrap, n):
    mesh = data.draw(meshes())
    rules = data.draw(multi_rules_for(mesh, ["t"]))
    x = rand(2, n, seed=9)
    ref = torch.roll(x, k, 1) if wrap else F.pad(x, (max(k, 0), max(-k, 0)))[:, max(-k, 0):max(-k, 0) + n]

    def prog():
        xm = mt.from_global(x, f"p:2,t:{n}")
        mt.reset_comm_stats()
        y = mt.shift(xm, "t", k, wrap=wrap)
        sent = mt.comm_stats().as_dict()
        return y.to_global(), sent

    outs = mt.launch(prog, mesh=mesh, rules=rules)
    # the pieces torch.chunk cuts, axis after axis (an uneven split may leave some empty)
    sizes = dict((a, int(s)) for a, s in (p.split(":") for p in mesh.split(",")))
    axes = rules.split(":", 1)[1].strip("()").split(",") if rules else []
    pieces = [torch.arange(n)]
    for a in axes:
        cut = [p.chunk(sizes[a]) for p in pieces]
        pieces = [c for p, cs in zip(pieces, cut) for c in (*cs, *[p[:0]] * (sizes[a] - len(cs)))]
    for y, st_ in outs:
        torch.testing.assert_close(y, ref)
        # a shift by no more than the smallest piece sends at most |k| columns of 2 floats, and
        # never gathers (a piece narrower than the shift makes the halo come from further away)
        if abs(k) <= min(len(p) for p in pieces):
            assert all(key.startswith("permute") for key in st_), st_
            assert sum(v["bytes"] for v in st_.values()) <= abs(k) * 2 * 8
