"""``mt.import_consolidated`` on a mesh: every processor agrees before any copies (one host's copy of
the files may be damaged), and a file's named dims (``meshtorch_dims``) must be the model's."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import meshtorch as mt
from meshtorch.errors import CheckpointError

RULES = "d_ff:m"


def make_model(first: str = "d", d_ff: int = 8) -> mt.nn.Module:
    d, ff = mt.Dim(first, 4), mt.Dim("d_ff", d_ff)
    return mt.nn.Sequential(mt.nn.Dense(d, ff), mt.relu, mt.nn.Dense(ff, mt.Dim("out", 4)))


def tensors_of(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def damage(path: str, how: str) -> None:
    """Damage the copy of the files at ``path`` as one host's copy might be."""
    fname = os.path.join(path, "model.safetensors")
    if how == "a tensor missing":
        tensors, meta = tensors_of(path)
        del tensors["2.kernel"]
        safetensors.torch.save_file(tensors, fname, metadata=meta)
    elif how == "cut short":
        raw = open(fname, "rb").read()
        open(fname, "wb").write(raw[:-40])
    elif how == "another shape":
        tensors, meta = tensors_of(path)
        tensors["2.kernel"] = torch.zeros(8, 5)
        safetensors.torch.save_file(tensors, fname)  # no meshtorch_dims: checked by sizes
    else:
        shutil.rmtree(path)


def _import_on_each(good: str, bad: str) -> tuple[str | None, list[str]]:
    """Processor 1 imports from ``bad`` (its host's damaged copy), the others from ``good``: what it
    raised, and the parameters that changed."""
    model = make_model().reset_parameters(seed=9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        mt.import_consolidated(bad if mt.current().rank == 1 else good, model)
        error = None
    except CheckpointError as e:
        error = str(e)
    return error, [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]


@pytest.mark.parametrize("how, message", [
    ("a tensor missing", r"'2.kernel' \(key '2.kernel'\) is not in"),
    ("cut short", "is not a complete safetensors file"),
    ("another shape", "'2.kernel' has shape"),
    ("missing", "no model.safetensors"),
])
def test_one_processors_bad_copy_makes_every_processor_refuse_and_none_copy(tmp_path, how, message):
    """Processor 0 went on and copied its slices while processor 1 raised: the processors held
    different models (or waited for processor 1 at their next collective). All raise now, the
    others naming processor 1, and no processor changed a parameter."""
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    mt.export_consolidated(good, make_model().reset_parameters(seed=1))
    shutil.copytree(good, bad)
    damage(bad, how)
    got = mt.launch(_import_on_each, good, bad, mesh="m:2", rules=RULES)
    assert got[1][0] is not None and re.search(message, got[1][0]), got
    assert got[0][0] is not None and "processor 1" in got[0][0] and "nothing was loaded" in got[0][0], got
    assert re.search(message, got[0][0]), got
    assert got[0][1] == [] and got[1][1] == []


def test_one_processors_bad_copy_on_processes(tmp_path):
    """The same over the torch backend (gloo): processor 0 does not return with its copy made."""
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    mt.export_consolidated(good, make_model().reset_parameters(seed=1))
    shutil.copytree(good, bad)
    damage(bad, "a tensor missing")
    got = mt.launch(_import_on_each, good, bad, mesh="m:2", rules=RULES, backend="torch")
    assert "processor 1" in got[0][0] and "'2.kernel'" in got[0][0] and "'2.kernel'" in got[1][0], got
    assert got[0][1] == [] and got[1][1] == []


def test_dims_of_other_names_are_refused_naming_both(tmp_path):
    """The sizes matched, so a kernel saved over [d, d_ff] loaded into one over [e, d_ff]: the
    names the export recorded are the model's contract, and a file of other dims is another model's."""
    mt.export_consolidated(str(tmp_path), make_model().reset_parameters(seed=1))
    model = make_model("e").reset_parameters(seed=9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"'0.kernel'.*\[e:4,d_ff:8\].*\[d:4,d_ff:8\]") as err:
        mt.import_consolidated(str(tmp_path), model)
    assert "order" not in str(err.value)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_dims_in_another_order_are_refused_saying_so(tmp_path):
    """A square kernel saved over [d, h] has the sizes of one over [h, d]: loading it copied the
    transpose's values silently."""
    saved = mt.nn.Dense(mt.Dim("d", 4), mt.Dim("h", 4)).reset_parameters(seed=1)
    mt.export_consolidated(str(tmp_path), saved)
    swapped = mt.nn.Dense(mt.Dim("h", 4), mt.Dim("d", 4)).reset_parameters(seed=2)
    with pytest.raises(CheckpointError, match=r"'kernel'.*\[h:4,d:4\].*\[d:4,h:4\].*another order"):
        mt.import_consolidated(str(tmp_path), swapped)


def test_dims_are_checked_under_rename_and_in_sharded_exports(tmp_path):
    mt.export_consolidated(str(tmp_path), make_model().reset_parameters(seed=1), max_shard_bytes=100)
    assert "model.safetensors.index.json" in os.listdir(tmp_path)
    renamed = mt.nn.Sequential(make_model("e"))  # parameters 0.0.kernel ..., keys 0.kernel ...
    message = r"'0.0.kernel' has shape \[e:4,d_ff:8\].* holds '0.kernel' with dims \[d:4,d_ff:8\]"
    with pytest.raises(CheckpointError, match=message):
        mt.import_consolidated(str(tmp_path), renamed, rename=lambda n: n.removeprefix("0."))


def test_files_without_meshtorch_dims_load_by_sizes(tmp_path):
    """A file another tool wrote has no meshtorch_dims: the sizes are all there is to check."""
    want = make_model().reset_parameters(seed=1)
    tensors = {n: p.detach().clone() for n, p in want.named_parameters()}
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    model = make_model("e").reset_parameters(seed=9)
    assert mt.import_consolidated(str(tmp_path), model) == list(tensors)
    assert all(torch.equal(p, tensors[n]) for n, p in model.named_parameters())


def test_a_damaged_meshtorch_dims_is_named(tmp_path):
    mt.export_consolidated(str(tmp_path), make_model().reset_parameters(seed=1))
    tensors, _ = tensors_of(str(tmp_path))
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"),
                                metadata={"meshtorch_dims": json.dumps({"0.kernel": "d"})})
    with pytest.raises(CheckpointError, match=r"meshtorch_dims.*'0.kernel'"):
        mt.import_consolidated(str(tmp_path), make_model())


def test_a_shard_lacking_a_tensor_its_index_names_is_named(tmp_path):
    mt.export_consolidated(str(tmp_path), make_model().reset_parameters(seed=1), max_shard_bytes=100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    wmap["2.kernel"] = wmap["0.kernel"]  # a stale index: the shard it names holds another tensor
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'2.kernel'.* puts '2.kernel' in .*which does not hold it"):
        mt.import_consolidated(str(tmp_path), make_model())


class PlainDense(torch.nn.Module):
    """A plain torch module of mt.nn.Dense's parameter names and sizes (its dims are made up:
    dim0, dim1)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kernel = torch.nn.Parameter(torch.randn(4, 6, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(6, generator=g))


def _mt_dense(seed: int) -> mt.nn.Dense:
    return mt.nn.Dense(mt.Dim("d", 4), mt.Dim("out", 6)).reset_parameters(seed=seed)


def _import_into_mt(path: str):
    model = _mt_dense(9)
    names = mt.import_consolidated(path, model)
    return names, {n: view.to_global() for n, view in model.named_mesh_parameters()}


def _import_into_plain(path: str):
    model = PlainDense(9)
    return mt.import_consolidated(path, model), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh", ["", "m:2"])
def test_files_move_between_plain_torch_and_mt_parameters_both_ways(tmp_path, mesh):
    """A plain torch parameter's dims are made-up names (dim0, dim1): its file was refused by an
    mt.nn parameter of the same sizes, and an mt.nn export by a plain parameter ([dim0:4,dim1:6] but
    [d:4,out:6]), which loaded before the dims were checked. Made-up names on either side say nothing,
    so the sizes are checked; two real name lists still must match (the tests above)."""
    kw = {"mesh": mesh, "rules": "out:m"} if mesh else {}
    plain, mine = PlainDense(1), _mt_dense(2)
    want_plain = {n: p.detach().clone() for n, p in plain.named_parameters()}
    want_mt = {n: p.detach().clone() for n, p in mine.named_parameters()}
    mt.export_consolidated(str(tmp_path / "plain"), plain)
    mt.export_consolidated(str(tmp_path / "mt"), mine)
    assert "dim0" in tensors_of(str(tmp_path / "plain"))[1]["meshtorch_dims"]
    for names, got in mt.launch(_import_into_mt, str(tmp_path / "plain"), **kw):
        assert names == ["kernel", "bias"]
        assert all(torch.equal(got[n], want_plain[n]) for n in names)
    for names, got in mt.launch(_import_into_plain, str(tmp_path / "mt"), **kw):
        assert names == ["kernel", "bias"]
        assert all(torch.equal(got[n], want_mt[n]) for n in names)


class WithLinear(mt.nn.Module):
    """An mt.nn module holding a plain torch layer: its dims are made up as lin_weight_dim0, ..."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)


def test_a_plain_layer_inside_an_mt_module_moves_to_a_plain_module_both_ways(tmp_path):
    """Inside an mt.nn module a plain parameter's made-up dims are <name>_dim<i>; a plain module's
    are dim<i>: the two were refused as other dims, both ways."""
    torch.manual_seed(0)
    mixed, plain = WithLinear(), torch.nn.Sequential()
    plain.lin = torch.nn.Linear(4, 3)
    mt.export_consolidated(str(tmp_path / "mixed"), mixed)
    mt.export_consolidated(str(tmp_path / "plain"), plain)
    into_plain, into_mixed = torch.nn.Sequential(), WithLinear()
    into_plain.lin = torch.nn.Linear(4, 3)
    assert mt.import_consolidated(str(tmp_path / "mixed"), into_plain) == ["lin.weight", "lin.bias"]
    assert mt.import_consolidated(str(tmp_path / "plain"), into_mixed) == ["lin.weight", "lin.bias"]
    for got, want in ((into_plain, mixed), (into_mixed, plain)):
        assert torch.equal(got.lin.weight, want.lin.weight) and torch.equal(got.lin.bias, want.lin.bias)
