"""mt.nn.MeshParameter: each parameter is drawn once, for its final path, with the values of a
direct mt.random draw; lazily drawn parameters behave as drawn ones everywhere they are read."""

from __future__ import annotations

import copy
import math
import pickle
from collections import Counter

import pytest
import torch

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig
from meshtorch.nn import parameter as mp

D, H = mt.Dim("d", 4), mt.Dim("h", 6)


def counting(calls: list[str]):
    def init(shape, seed, stream):
        calls.append(stream)
        return mt.random.normal(shape, seed=seed, stream=stream)

    return init


def nested(calls: list[str]) -> mt.nn.Module:
    """Built bottom-up: every Dense exists before the Sequentials that hold it."""
    inner = mt.nn.Sequential(mt.nn.Dense(D, H, init=counting(calls)), mt.relu,
                             mt.nn.Dense(H, D, init=counting(calls)))
    return mt.nn.Sequential(mt.nn.LayerNorm(D), mt.nn.Sequential(inner))


def test_nested_sequential_draws_each_parameter_once_for_its_final_path():
    calls: list[str] = []
    model = nested(calls)
    assert calls == []  # attaching re-labels, it draws nothing
    out = model(mt.ones("batch:2,d:4"))
    list(model.parameters())
    model.state_dict()
    dict(model.named_mesh_parameters())
    assert calls == ["1.0.0.kernel", "1.0.2.kernel"]
    for path, shape in [("1.0.0.kernel", "d:4,h:6"), ("1.0.2.kernel", "h:6,d:4")]:
        want = mt.random.normal(shape, seed=0, stream=path).local
        assert torch.equal(model.get_parameter(path), want), path
    assert out.shape == mt.Shape("batch:2,d:4")
    # reset_parameters draws again, now, once per parameter
    model.reset_parameters(seed=4)
    assert Counter(calls) == {"1.0.0.kernel": 2, "1.0.2.kernel": 2}
    assert torch.equal(model.get_parameter("1.0.2.kernel"),
                       mt.random.normal("h:6,d:4", seed=4, stream="1.0.2.kernel").local)


def test_reading_a_parameter_attribute_draws_it():
    calls: list[str] = []
    dense = mt.nn.Dense(D, H, init=counting(calls))
    p = dense._parameters["kernel"]
    assert not p.materialized and p.stream == "kernel"
    ptr = p.data_ptr()
    assert torch.equal(dense.kernel, mt.random.normal("d:4,h:6", seed=0, stream="kernel").local)
    assert p.materialized and p.data_ptr() == ptr  # filled in place: the storage is the one made first
    assert calls == ["kernel"]
    # attached elsewhere, the path changes and so do the values (drawn again, once)
    seq = mt.nn.Sequential(dense)
    assert not p.materialized and p.stream == "0.kernel"
    seq(mt.ones("d:4"))
    seq(mt.ones("d:4"))
    assert calls == ["kernel", "0.kernel"]


def _std(name: str, cfg: TransformerConfig) -> float | None:
    """The init of each DecoderLM parameter, from the model's documented initialisation."""
    depth = math.sqrt(2 * cfg.layers)
    leaf = name.rsplit(".", 2)
    if name == "embed.table":
        return 0.02
    if name == "decoder.pos.table":
        return 0.01
    if leaf[-1] in ("weight", "bias"):
        return None
    return {"q": cfg.d_model ** -0.5, "k": cfg.d_model ** -0.5, "v": cfg.d_model ** -0.5,
            "o": (cfg.heads * cfg.d_kv) ** -0.5 / depth, "wi": cfg.d_model ** -0.5,
            "wo": cfg.d_ff ** -0.5 / depth, "head": cfg.d_model ** -0.5}[leaf[-2]]


def test_decoder_lm_draws_each_parameter_once_with_direct_mt_random_values(monkeypatch):
    calls: list[str] = []
    for kind, factory in list(mp.INITS.items()):
        def wrapped(*a, _factory=factory, **kw):
            fn = _factory(*a, **kw)
            return lambda s, seed, st: (calls.append(st), fn(s, seed, st))[1]

        monkeypatch.setitem(mp.INITS, kind, wrapped)
    cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=3, max_length=8,
                            tie_embeddings=False)
    model = DecoderLM(cfg, seed=7)
    ids = mt.from_global(torch.arange(12).reshape(2, 6) % 16, "batch:2,length:6")
    model.loss(ids, ids).backward()
    torch.optim.SGD(model.parameters(), lr=0.1)
    model.state_dict()
    names = [n for n, _ in model.named_parameters()]
    assert Counter(calls) == Counter(names)  # every parameter drawn exactly once
    for name, view in model.named_mesh_parameters():
        std = _std(name, cfg)
        if std is None:
            want = torch.full(view.shape.sizes, 1.0 if name.endswith("weight") else 0.0)
        else:
            want = mt.random.normal(view.shape, 0.0, std, seed=7, stream=name).local
        assert torch.equal(view.local.detach(), want), name


def test_values_are_the_same_on_a_split_mesh_and_read_from_outside_the_launch():
    cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=8)
    one = {n: v.to_global() for n, v in DecoderLM(cfg, seed=3).named_mesh_parameters()}

    def build():
        return mt.nn.Sequential(mt.nn.Dense(D, H), mt.nn.Dense(H, D)), mt.current().coords

    def run():
        return {n: v.to_global() for n, v in DecoderLM(cfg, seed=3).named_mesh_parameters()}

    for got in mt.launch(run, mesh="b:2,m:2", rules="batch:b; heads:m; d_ff:m; vocab:m"):
        assert got.keys() == one.keys() and all(torch.equal(got[n], one[n]) for n in one)
    # built on a processor, first read after the launch: drawn for that processor's slice
    ref = mt.random.kaiming_normal("h:6,d:4", fan_in=["h"], gain=1.0, seed=0, stream="1.kernel").local
    for model, coords in mt.launch(build, mesh="m:2", rules="h:m"):
        assert not model[1]._parameters["kernel"].materialized
        part = slice(3 * coords["m"], 3 * coords["m"] + 3)
        assert torch.equal(model[1].kernel, ref[part])


def test_deepcopy_pickle_state_dict_and_conversion_of_unread_parameters():
    fresh = lambda: nested([])  # noqa: E731
    want = {n: p.detach().clone() for n, p in fresh().named_parameters()}
    copied = copy.deepcopy(fresh())
    assert all(torch.equal(p, want[n]) for n, p in copied.named_parameters())
    assert copy.deepcopy(fresh()).state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in fresh().state_dict().items())
    halves = fresh().to(torch.float16)
    assert all(torch.equal(p, want[n].half()) for n, p in halves.named_parameters())
    # pickled with its values (initializers are closures; the values are what a copy needs)
    back = pickle.loads(pickle.dumps(mt.nn.Sequential(mt.nn.Dense(D, H))))
    p = back.get_parameter("0.kernel")
    assert isinstance(p, mt.nn.MeshParameter) and p.mesh_shape == mt.Shape("d:4,h:6")
    assert torch.equal(p, mt.random.kaiming_normal("d:4,h:6", fan_in=["d"], gain=1.0, seed=0,
                                                   stream="0.kernel").local)
    # loading a state dict overwrites without drawing
    calls: list[str] = []
    target = nested(calls)
    target.load_state_dict({k: v + 1 for k, v in want.items()})
    assert calls == [] and torch.equal(target.get_parameter("1.0.2.kernel"), want["1.0.2.kernel"] + 1)


def test_meta_backend_builds_parameters_without_storage():
    cfg = TransformerConfig(vocab=32768, d_model=1024, heads=16, d_kv=64, d_ff=4096, layers=4, max_length=64)

    def build():
        model = DecoderLM(cfg)
        return {p.device.type for p in model.parameters()}, model.num_parameters()

    (devices, n), = mt.launch(build, mesh="m:8", rules="vocab:m; heads:m; d_ff:m", backend="meta")
    assert devices == {"meta"}
    assert n == 32768 * 1024 + 64 * 1024 + 4 * (4 * 1024 * 1024 + 2 * 1024 * 4096 + 4 * 1024) + 2 * 1024


def test_parameter_errors_name_the_parameter():
    with pytest.raises(mt.errors.ShapeError, match="unknown initializer 'nope'"):
        mt.nn.MeshParameter("d:4", init="nope")
    bad = mt.nn.Sequential(mt.nn.Dense(D, H, init=lambda s, seed, st: mt.zeros("h:6")))
    with pytest.raises(mt.errors.ShapeError, match=r"parameter '0.kernel' returned shape \[h:6\]"):
        bad(mt.ones("d:4"))


@pytest.mark.parametrize("given", [{"seed": 1}, {"stream": "w"}])
def test_a_layer_refuses_a_seed_of_its_own_and_names_the_fix(given):
    with pytest.raises(mt.errors.ArgumentError, match=r"reset_parameters\(seed=s\)"):
        mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2), **given)
    # the fix: the layer drawn from seed 1 is the 1-processor draw of its kernel's path
    layer = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2)).reset_parameters(seed=1)
    want = mt.random.kaiming_normal("d:4,h:2", gain=1.0, fan_in=["d"], seed=1, stream="kernel")
    assert torch.equal(layer.kernel.mesh_tensor.to_global(), want.to_global())


def test_attribute_reads_answer_as_torch_s_and_draw_a_lazy_parameter_once():
    """Module.__getattr__ finds parameters and submodules itself (one Python frame less per read in
    a forward, issue 27): every kind of name answers as torch.nn.Module's own __getattr__ does, a
    missing one with torch's error, and a lazy parameter is drawn at its first read."""
    class Net(mt.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 2))
            self.register_buffer("steps", torch.zeros(()))
            self.register_parameter("gone", None)
            self.register_module("empty", None)

    net = Net()
    lazy = net.layer._parameters["kernel"]
    assert not lazy.materialized
    assert net.layer.kernel is lazy and lazy.materialized  # drawn at the first read
    for name in ("layer", "steps", "gone", "empty"):
        assert getattr(net, name) is torch.nn.Module.__getattr__(net, name), name
    assert net.layer.bias is net.layer._parameters["bias"]
    with pytest.raises(AttributeError, match="'Net' object has no attribute 'missing'"):
        _ = net.missing


def test_a_layer_keeps_the_view_of_its_weights_while_they_are_its_own():
    """Module.mesh_view, a layer's read of its weights in one Python frame (issue 27), keeps the
    MeshTensor it made while the parameter is the same object, of the same local size, and drawn;
    otherwise it reads as ``.mesh_tensor`` does: a relabelled parameter drawn again for its new
    path, a new parameter, a resized storage refused with the constructor's error, and copies
    with views of their own parameters (and their adapters' memos)."""
    calls: list[str] = []
    dense = mt.nn.Dense(D, H, init=counting(calls))
    v = dense.mesh_view("kernel")
    assert calls == ["kernel"] and dense.mesh_view("kernel") is v and v.local is dense.kernel
    assert v.shape == dense.kernel.mesh_shape and v._adapted is dense.kernel._adapted
    x = mt.random.normal("batch:3,d:4", seed=1)
    want = x.to_global() @ dense.kernel.detach() + dense.bias.detach()
    assert torch.equal(dense(x).to_global(), want)
    # attached under a parent: drawn again, once, for its path there
    model = mt.nn.Sequential(dense)
    w = dense.mesh_view("kernel")
    assert calls == ["kernel", "0.kernel"] and w.local is dense.kernel
    assert torch.equal(w.local, mt.random.normal(w.shape, seed=0, stream="0.kernel").local)
    assert torch.equal(model(x).to_global(), x.to_global() @ dense.kernel.detach() + dense.bias.detach())
    # a new parameter
    dense.kernel = mt.nn.MeshParameter([D, H], init="ones")
    assert dense.mesh_view("kernel").local is dense.kernel and dense.mesh_view("kernel").local.sum() == 24
    # a storage of another size: refused, naming the sizes, as the constructor does
    dense.kernel.data = torch.zeros(2, 2)
    with pytest.raises(mt.errors.ShapeError, match=r"needs a local slice of size \[4, 6\], got \[2, 2\]"):
        dense.mesh_view("kernel")
    other = mt.nn.Dense(D, H)
    kept = other.mesh_view("kernel")
    for twin in (copy.deepcopy(other), pickle.loads(pickle.dumps(other))):
        t = twin.mesh_view("kernel")
        assert t is not kept and t.local is twin.kernel and t._adapted is twin.kernel._adapted
        assert torch.equal(t.local, kept.local)
    assert mt.nn.Dense(D, H, bias=False).mesh_view("bias") is None


def test_hooks_and_a_compiled_call_run_on_meshtorch_modules_as_on_torch_ones():
    """mt.nn.Module.__call__ calls forward itself only where torch's would do nothing else (issue
    27: one Python frame per layer, not two): a module's own and global forward hooks, and a
    compiled call (``module.compile()``), take torch's path."""
    dense = mt.nn.Dense(D, H)
    x = mt.random.normal("batch:3,d:4", seed=1)
    plain = dense(x * 2).to_global() + 1
    pre = dense.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    post = dense.register_forward_hook(lambda m, args, out: out + 1)
    assert torch.equal(dense(x).to_global(), plain)
    pre.remove()
    post.remove()
    seen = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__))
    try:
        assert torch.equal(mt.nn.Sequential(dense)(x).to_global(), dense(x).to_global())
    finally:
        hook.remove()
    assert seen == ["Dense", "Sequential", "Dense"]
    dense._compiled_call_impl = lambda *args, **kwargs: ("compiled", args)
    assert dense(x) == ("compiled", (x,))


def test_a_patched_torch_call_or_an_unknown_one_is_called_not_skipped(monkeypatch):
    """The one-frame call mirrors torch's ``_wrapped_call_impl``: where ``torch.nn.Module.__call__``
    is another function (a profiler patched it) or this torch's call is not the one mirrored
    (``_KNOWN_TORCH_CALL`` None: its hook tables moved), torch's own call runs, so its wrapper sees
    every meshtorch layer, as it sees torch's."""
    import meshtorch.nn.module as module

    dense = mt.nn.Dense(D, H)
    x = mt.random.normal("batch:3,d:4", seed=1)
    want = dense(x).to_global()
    assert module._KNOWN_TORCH_CALL is torch.nn.Module._wrapped_call_impl  # this torch: the shortcut
    seen = []
    original = torch.nn.Module.__call__

    def wrapper(self, *args, **kwargs):
        seen.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", wrapper)
    assert torch.equal(dense(x).to_global(), want) and seen == ["Dense"]
    monkeypatch.setattr(torch.nn.Module, "__call__", original)
    monkeypatch.setattr(module, "_KNOWN_TORCH_CALL", None)
    calls = []
    monkeypatch.setattr(torch.nn.Module, "_call_impl",
                        lambda self, *a, **k: calls.append(1) or self.forward(*a, **k))
    assert torch.equal(dense(x).to_global(), want) and calls == [1]


def test_torchs_profiler_sees_meshtorch_layers_as_it_sees_torchs():
    """torch's profiler finds module calls by torch.nn.Module.__call__'s frames (with_stack,
    with_modules, the memory profiler): while it runs, the one-frame call takes torch's path, so a
    profile names every meshtorch layer as it names torch's (review: the Dense vanished)."""
    from torch.profiler import ProfilerActivity, profile

    dense, lin = mt.nn.Dense(D, H), torch.nn.Linear(4, 2)
    x = mt.random.normal("batch:3,d:4", seed=1)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, with_modules=True) as prof:
        dense(x)
        lin(torch.ones(3, 4))
    names = {e.name for e in prof.events() if e.name.startswith("nn.Module: ")}
    if "nn.Module: Linear_0" not in names:  # torch's own layer, the reference
        pytest.skip("this torch's profiler names no module, not even torch.nn.Linear (torch 2.11+cu130 "
                    "on a host without a GPU records no Python events)")
    assert "nn.Module: Dense_0" in names, names


def test_a_layer_that_has_run_pickles_and_its_copy_gives_the_same_values():
    """A layer keeps plans (holding local functions) in BoundedCaches: a copy or pickle starts them
    empty, so torch.save(model) of a model that has run works (it raised 'Can't pickle local
    object')."""
    import io
    import pickle

    dense = mt.nn.Dense(D, H)
    x = mt.random.normal("batch:3,d:4", seed=1)
    want = dense(x).to_global()
    copy = pickle.loads(pickle.dumps(dense))
    assert torch.equal(copy(x).to_global(), want)
    buf = io.BytesIO()
    torch.save(dense, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x).to_global(), want)
