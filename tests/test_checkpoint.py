"""Checkpoints: resharding save/load, atomicity, checksums, errors, bitwise resume, HF export."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import meshtorch as mt
from meshtorch.checkpoint import writer as save_mod
from meshtorch.errors import CheckpointError, ProcessorError

RULES_A = "batch:b; d_in:b; d_ff:m; vocab:m"
RULES_B = "d_ff:m; cls:m"


def make_model(d_ff: int = 8, dropout: float = 0.0) -> mt.nn.Module:
    vocab, d_in = mt.Dim("vocab", 8), mt.Dim("d_in", 4)
    ff, cls = mt.Dim("d_ff", d_ff), mt.Dim("cls", 4)
    return mt.nn.Sequential(mt.nn.Embedding(vocab, d_in), mt.nn.LayerNorm(d_in), mt.nn.Dense(d_in, ff),
                            mt.relu, mt.nn.Dropout(dropout), mt.nn.Dense(ff, cls))


class Data:
    """A resumable stream of batches: batch ``pos`` is a pure function of ``pos``."""

    def __init__(self):
        self.pos = 0

    def next(self):
        g = torch.Generator().manual_seed(500 + self.pos)
        self.pos += 1
        ids = torch.randint(0, 8, (4,), generator=g)
        return mt.from_global(ids, "batch:4"), mt.from_global((ids * 3) % 4, "batch:4")

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def make_opt(model, kind):
    if kind == "adamw":
        return torch.optim.AdamW(mt.optim.weight_decay_groups(model, 0.01), lr=5e-2)
    return mt.optim.Adafactor(model, lr=5e-2, beta1=0.9, min_dim_size_to_factor=4)


def train(model, opt, data, steps, sched=None):
    losses = []
    for _ in range(steps):
        ids, y = data.next()
        opt.zero_grad()
        loss = mt.reduce_mean(mt.cross_entropy(model(ids), y, "cls"))
        loss.backward()
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def snapshot(model, opt):
    """Global values of every parameter and optimizer state tensor (bitwise)."""
    out = {f"p/{n}": v.to_global().detach().clone() for n, v in model.named_mesh_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, val in state.items():
            if val.dim() == 0:
                out[f"s/{names[id(p)]}/{key}"] = val.clone()
                continue
            shape = save_mod.state_shape(opt, p, key, val, names[id(p)])
            view = mt.MeshTensor(val, shape, mt.tensor.layout_for(shape))
            out[f"s/{names[id(p)]}/{key}"] = view.to_global().clone()
    return out


def assert_bitwise(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_save_on_2x2_load_on_m4_and_one_processor_bitwise(tmp_path, kind):
    path = str(tmp_path / "ckpt")

    def save_run():
        model = make_model()
        opt = make_opt(model, kind)
        train(model, opt, Data(), 3)
        mt.save(path, model=model, optimizer=opt, step=3)
        return snapshot(model, opt)

    saved = mt.launch(save_run, mesh="b:2,m:2", rules=RULES_A)[0]
    assert any(k.endswith("exp_avg") or k.endswith("vr") for k in saved)

    def load_run():
        model = make_model().reset_parameters(seed=123)
        opt = make_opt(model, kind)
        info = mt.load(path, model=model, optimizer=opt)
        local = sum(p.numel() * p.element_size() for p in model.parameters())
        local += sum(v.numel() * v.element_size() for s in opt.state.values()
                     for v in s.values() if v.dim() > 0)
        return info["step"], info["bytes_read"], local, snapshot(model, opt)

    for mesh, rules in [("m:4", RULES_B), ("", "")]:
        for step, read, local, snap in mt.launch(load_run, mesh=mesh, rules=rules):
            assert step == 3
            assert read == local  # only the regions this processor holds, each once
            assert_bitwise(snap, saved)

    # each byte written once: the pieces of every tensor add up to its global size
    path = mt.checkpoint.latest(path)
    index = json.load(open(os.path.join(path, "index.json")))
    stored = {}
    for fname in index["files"]:
        with safe_open(os.path.join(path, fname), "pt") as f:
            for key in f.keys():
                stored[key.split("@")[0]] = stored.get(key.split("@")[0], 0) + f.get_tensor(key).numel()
    for name, entry in index["tensors"].items():
        numel = 1
        for _, s in entry["dims"]:
            numel *= s
        assert stored[name] == numel, name


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")

    def first():
        model = make_model()
        mt.save(path, model=model, step=1)
        return {n: v.to_global().clone() for n, v in model.named_mesh_parameters()}

    before = mt.launch(first, mesh="b:2,m:2", rules=RULES_A)[0]
    real = save_mod._write_file

    def flaky(fpath, tensors):
        if mt.current().rank == 1:
            with open(fpath, "wb") as f:
                f.write(b"half a file")
            raise OSError("disk full (simulated)")
        real(fpath, tensors)

    monkeypatch.setattr(save_mod, "_write_file", flaky)

    def second():
        model = make_model().reset_parameters(seed=77)
        with pytest.raises(CheckpointError, match="disk full|failed on some processor"):
            mt.save(path, model=model, step=2)
        return True

    assert all(mt.launch(second, mesh="b:2,m:2", rules=RULES_A))
    assert sorted(os.listdir(path)) == ["latest", "step-000001"]  # no temp dir left behind
    monkeypatch.setattr(save_mod, "_write_file", real)

    def reload():
        model = make_model().reset_parameters(seed=5)
        info = mt.load(path, model=model)
        return info["step"], {n: v.to_global() for n, v in model.named_mesh_parameters()}

    step, after = mt.launch(reload, mesh="m:4", rules=RULES_B)[2]
    assert step == 1
    assert_bitwise(after, before)


def test_overwrite_replaces_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    for step in (1, 2):
        mt.save(path, model=make_model().reset_parameters(seed=step), step=step)
    model = make_model()
    assert mt.load(path, model=model)["step"] == 2
    want = make_model().reset_parameters(seed=2)
    assert torch.equal(model[2].kernel, want[2].kernel)
    assert not torch.equal(model[2].kernel, make_model()[2].kernel)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_written_files_get_the_mode_open_gives_them(tmp_path):
    """Files written through a temporary one (tempfile's and safetensors' 0o600) get what the umask
    allows, as index.json does: seen, a run's slices, metrics.jsonl and tokenizer readable by its
    owner only, so another user of a shared run directory could not generate from it."""
    from meshtorch.files import write_atomic

    old = os.umask(0o027)
    try:
        mt.save(str(tmp_path / "ckpt"), model=make_model(), step=1)
        mt.export_consolidated(str(tmp_path / "hf"), make_model())
        write_atomic(str(tmp_path / "metrics.jsonl"), b"{}\n")
    finally:
        os.umask(old)
    modes = {os.path.relpath(os.path.join(root, n), tmp_path): os.stat(os.path.join(root, n)).st_mode & 0o777
             for root, _, names in os.walk(tmp_path) for n in names}
    assert any(name.endswith(".safetensors") for name in modes) and "metrics.jsonl" in modes
    assert modes == dict.fromkeys(modes, 0o640)


def test_corrupted_file_gives_checksum_error(tmp_path):
    path = str(tmp_path / "ckpt")
    mt.launch(lambda: mt.save(path, model=make_model()), mesh="m:2", rules=RULES_B)
    fname = os.path.join(mt.checkpoint.latest(path), "slices-00001.safetensors")
    raw = bytearray(open(fname, "rb").read())
    raw[-3] ^= 0xFF
    open(fname, "wb").write(bytes(raw))
    with pytest.raises(ProcessorError) as e:
        mt.launch(lambda: mt.load(path, model=make_model()), mesh="m:2", rules=RULES_B)
    cause = e.value.__cause__
    assert isinstance(cause, CheckpointError)
    assert "checksum" in str(cause) and "slices-00001.safetensors" in str(cause)
    # ... and on one processor, which needs that file's region too
    with pytest.raises(CheckpointError, match="checksum mismatch in .*slices-00001"):
        mt.load(path, model=make_model())


def test_load_errors_name_tensor_and_file(tmp_path):
    path = str(tmp_path / "ckpt")
    mt.save(path, model=make_model(), step=0)
    shape_msg = r"'model/2.kernel' has shape \[d_in:4,d_ff:16\] here but \[d_in:4,d_ff:8\] in .*slices-00000"
    with pytest.raises(CheckpointError, match=shape_msg):
        mt.load(path, model=make_model(d_ff=16))
    bigger = mt.nn.Sequential(make_model(), mt.nn.Dense(mt.Dim("cls", 4), mt.Dim("out", 2)))
    with pytest.raises(CheckpointError, match=r"'model/0.0.table' is missing from checkpoint .*index.json"):
        mt.load(path, model=bigger)
    dtype_msg = r"'model/0.table' is torch.float64 here but float32 in .*slices"
    with pytest.raises(CheckpointError, match=dtype_msg):
        mt.load(path, model=make_model().double())
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        mt.load(str(tmp_path / "nope"), model=make_model())
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        mt.load(path, model=make_model(), optimizer=make_opt(make_model(), "adamw"))


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    path = str(tmp_path / "ckpt")

    def setup():
        model = make_model(dropout=0.25)
        opt = make_opt(model, "adamw")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return model, opt, sched, Data()

    def straight():
        model, opt, sched, data = setup()
        return train(model, opt, data, 20, sched)

    def first_half():
        model, opt, sched, data = setup()
        losses = train(model, opt, data, 10, sched)
        mt.save(path, model=model, optimizer=opt, scheduler=sched, step=10, data=data)
        return losses

    def second_half():
        model, opt, sched, data = setup()
        mt.random.normal("x:3", seed=None)  # disturb the random streams: load must restore them
        info = mt.load(path, model=model, optimizer=opt, scheduler=sched, data=data)
        assert info["step"] == 10 and data.pos == 10 and info["data"] == {"pos": 10}
        return train(model, opt, data, 10, sched)

    mesh, rules = "b:2,m:2", RULES_A
    want = mt.launch(straight, mesh=mesh, rules=rules)[0]
    got = mt.launch(first_half, mesh=mesh, rules=rules)[0] + mt.launch(second_half, mesh=mesh, rules=rules)[0]
    assert got == want  # bitwise
    assert len(set(want)) > 15  # the losses move; dropout masks differ per step


def test_export_consolidated_import_on_other_mesh_and_sharded(tmp_path):
    def export(sub, shard):
        model = make_model().reset_parameters(seed=3)
        mt.export_consolidated(str(tmp_path / sub), model, max_shard_bytes=shard)
        return {n: v.to_global() for n, v in model.named_mesh_parameters()}

    want = mt.launch(export, "one", 1 << 30, mesh="b:2,m:2", rules=RULES_A)[0]
    mt.launch(export, "many", 200, mesh="b:2,m:2", rules=RULES_A)
    assert sorted(os.listdir(tmp_path / "one")) == ["model.safetensors"]
    many = sorted(os.listdir(tmp_path / "many"))
    assert "model.safetensors.index.json" in many and len(many) > 3
    with safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("2.kernel"), want["2.kernel"])
        assert json.loads(f.metadata()["meshtorch_dims"])["2.kernel"] == [["d_in", 4], ["d_ff", 8]]

    def load(sub):
        model = make_model()
        mt.import_consolidated(str(tmp_path / sub), model)
        return {n: v.to_global() for n, v in model.named_mesh_parameters()}

    for sub in ("one", "many"):
        for got in mt.launch(load, sub, mesh="m:4", rules=RULES_B):
            assert_bitwise(got, want)
    with pytest.raises(CheckpointError, match="'2.kernel' has shape"):
        mt.import_consolidated(str(tmp_path / "one"), make_model(d_ff=16))


def test_the_old_consolidated_names_warn_and_do_the_same(tmp_path):
    # mt.export_hf / mt.import_hf were meshtorch's names, not Hugging Face's: deprecated for a release
    model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 3)).reset_parameters(seed=1)
    with pytest.warns(DeprecationWarning, match="export_consolidated"):
        assert mt.export_hf(str(tmp_path), model) == ["model.safetensors"]
    fresh = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 3)).reset_parameters(seed=2)
    with pytest.warns(DeprecationWarning, match="import_consolidated"):
        assert sorted(mt.import_hf(str(tmp_path), fresh)) == ["bias", "kernel"]
    assert torch.equal(fresh.kernel, model.kernel) and torch.equal(fresh.bias, model.bias)


LAYOUTS = [("", ""), ("m:4", RULES_B), ("b:2,m:2", RULES_A), ("x:2,y:2", "vocab:x; d_in:y; cls:x"),
           ("b:4", "d_ff:b; vocab:b"), ("b:2,m:2", "d_in:m; d_ff:b")]


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS))
def test_any_layout_to_any_layout_roundtrip(src, dst):
    _roundtrip(src, dst)


# dims over several axes, in mesh order and against it (d_ff:(y,x) cuts over y first)
MULTI = [("b:2,m:2", "d_ff:(b,m); vocab:(m,b); cls:b"), ("x:2,y:2", "d_ff:(y,x); cls:(x,y); vocab:y")]


@pytest.mark.parametrize("src, dst", [(MULTI[0], MULTI[1]), (MULTI[1], ("", "")),
                                      (("m:4", RULES_B), MULTI[0])])
def test_multi_axis_layouts_reshard_exactly(src, dst):
    _roundtrip(src, dst)


@pytest.mark.parametrize("src, dst", [(("b:2,m:2", "d_ff:(b,m); vocab:(m,b)"), ("b:4", "d_ff:b; cls:b")),
                                      (("x:2,y:2", "d_ff:(y,x); d_in:x"), ("b:2,m:2", "d_ff:(b,m)"))])
def test_uneven_layouts_reshard_exactly(src, dst):
    # d_ff 6 over 4 processors: torch.chunk pieces (2, 1, 2, 1 nested; 2, 2, 2, 0 over one axis)
    _roundtrip(src, dst, d_ff=6)


def _roundtrip(src, dst, **model_kw):
    """Save under ``src`` (mesh, rules), load under ``dst``: bitwise the saved values, each
    processor reading exactly the bytes of its slices."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")

        def save_run():
            model = make_model(**model_kw).reset_parameters(seed=11)
            mt.save(path, model=model)
            return {n: v.to_global() for n, v in model.named_mesh_parameters()}

        def load_run():
            model = make_model(**model_kw)
            read = mt.load(path, model=model)["bytes_read"]
            assert read == sum(p.numel() * p.element_size() for p in model.parameters())
            return {n: v.to_global() for n, v in model.named_mesh_parameters()}

        want = mt.launch(save_run, mesh=src[0], rules=src[1])[0]
        for got in mt.launch(load_run, mesh=dst[0], rules=dst[1]):
            assert_bitwise(got, want)


def test_plain_torch_module_checkpoints_replicated(tmp_path):
    path = str(tmp_path / "ckpt")

    def run():
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 2)
        mt.save(path, model=lin, step=4)
        return lin.weight.detach().clone()

    want = mt.launch(run, mesh="b:2")[0]
    assert sorted(os.listdir(mt.checkpoint.latest(path))) == ["index.json", "slices-00000.safetensors"]
    lin = torch.nn.Linear(3, 2)
    assert mt.load(path, model=lin)["step"] == 4
    assert torch.equal(lin.weight, want)


def _save_on_processes(path: str) -> int:
    for step in (1, 2, 3):  # the last in the background: processor 0's writer awaits the other process's file
        mt.save(path, model=make_model().reset_parameters(seed=step), step=step, keep=2, background=step == 3)
    mt.checkpoint.wait()
    return os.getpid()


def test_processes_of_the_torch_backend_save_into_processor_0s_directory(tmp_path):
    # each process has its own id, but they all write into the one temp directory processor 0 named
    # (synchronous saves, and a background one whose processes tell processor 0 by marker files)
    path = str(tmp_path / "ckpt")
    pids = mt.launch(_save_on_processes, path, mesh="m:2", rules=RULES_B, backend="torch")
    assert len(set(pids)) == 2
    assert sorted(os.listdir(path)) == ["latest", "step-000002", "step-000003"]
    assert len([f for f in os.listdir(mt.checkpoint.latest(path)) if f.startswith("slices-")]) == 2
    model = make_model()
    assert mt.load(path, model=model)["step"] == 3
    want = make_model().reset_parameters(seed=3)
    assert_bitwise({n: v.to_global() for n, v in model.named_mesh_parameters()},
                   {n: v.to_global() for n, v in want.named_mesh_parameters()})
