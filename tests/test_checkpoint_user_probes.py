"""What a demanding user's checkpoints met: a failed ``mt.load`` leaves the model and optimizer as they
were, and a checkpoint of another model is refused also when it holds tensors the model lacks."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import meshtorch as mt
from meshtorch.errors import CheckpointError, ProcessorError

RULES = "d_ff:m"


def make_model(d_ff: int = 8, depth: int = 2) -> mt.nn.Module:
    d, ff = mt.Dim("d", 4), mt.Dim("d_ff", d_ff)
    layers = [mt.nn.Dense(d, ff), mt.relu, mt.nn.Dense(ff, d)]
    if depth == 3:
        layers += [mt.relu, mt.nn.Dense(d, mt.Dim("out", 2))]
    return mt.nn.Sequential(*layers)


def trained(model, steps: int = 2):
    """``model`` and an AdamW over it after ``steps`` steps (so it has moments and step counts)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = mt.from_global(torch.linspace(-1, 1, 8).reshape(2, 4), "batch:2,d:4")
    for _ in range(steps):
        opt.zero_grad()
        mt.reduce_mean(model(x) ** 2).backward()
        opt.step()
    return opt


def state_of(model, opt) -> dict[str, torch.Tensor]:
    """This processor's parameters and optimizer state, copied (to see whether a load touched them)."""
    out = {f"p/{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"s/{names[id(p)]}/{k}": v.clone() for k, v in st.items()})
    return out


def corrupt_last_file(path: str) -> None:
    """Flip a byte of the slices file processor 1 wrote (it holds d_ff's second half)."""
    fname = os.path.join(mt.checkpoint.latest(path), "slices-00001.safetensors")
    raw = bytearray(open(fname, "rb").read())
    raw[-3] ^= 0xFF
    open(fname, "wb").write(bytes(raw))


# (how the loading model differs, the error it gets); each fails after the first tensors would load
FAILURES = [
    ("deeper", "'model/4.kernel' is missing"),
    ("another last layer", "'model/2.kernel' has shape"),
    ("sgd", "holds AdamW state, not SGD"),
    ("corrupt", "checksum mismatch in .*slices-00001"),
]


@pytest.mark.parametrize("change, message", FAILURES)
def test_a_failed_load_leaves_the_model_and_optimizer_as_they_were(tmp_path, change, message):
    """A load that raises changed nothing, on every processor: a user who catches the error (and,
    say, starts from scratch or loads another checkpoint) does not train a half-loaded model."""
    path = str(tmp_path / "ckpt")

    def save():
        model = make_model().reset_parameters(seed=1)
        mt.save(path, model=model, optimizer=trained(model), step=2)

    mt.launch(save, mesh="m:2", rules=RULES)
    if change == "corrupt":
        corrupt_last_file(path)

    def load():
        if change == "deeper":
            model = make_model(depth=3)
        elif change == "another last layer":
            last = mt.nn.Dense(mt.Dim("d_ff", 8), mt.Dim("out", 4))  # saved: [d_ff, d]
            model = mt.nn.Sequential(make_model()[0], mt.relu, last)
        else:
            model = make_model()
        model.reset_parameters(seed=9)
        opt = trained(model, 1)
        if change == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
            opt.step()
        before = state_of(model, opt)
        with pytest.raises(CheckpointError, match=message):
            mt.load(path, model=model, optimizer=opt)
        after = state_of(model, opt)
        assert sorted(after) == sorted(before)
        return [k for k in before if not torch.equal(before[k], after[k])]

    assert mt.launch(load, mesh="m:2", rules=RULES) == [[], []]


def test_every_processor_raises_when_one_finds_its_file_corrupt(tmp_path):
    """Only processor 1 reads the damaged file; processor 0 raises too, before it changed anything."""
    path = str(tmp_path / "ckpt")
    mt.launch(lambda: mt.save(path, model=make_model().reset_parameters(seed=1)), mesh="m:2", rules=RULES)
    corrupt_last_file(path)

    def load():
        model = make_model().reset_parameters(seed=9)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            mt.load(path, model=model)
        except CheckpointError as e:
            return str(e), all(torch.equal(before[n], p) for n, p in model.named_parameters())
        return None

    got = mt.launch(load, mesh="m:2", rules=RULES)
    assert "failed on processor 1: CheckpointError: checksum mismatch" in got[0][0]
    assert "checksum mismatch" in got[1][0]
    assert got[0][1] and got[1][1]


def test_a_checkpoint_holding_tensors_the_model_lacks_is_refused_unless_strict_false(tmp_path):
    """A 3-layer checkpoint loaded into a 2-layer model loaded silently (its first two layers); it is
    another model's checkpoint, so it is an error naming the tensors and strict=False, which loads
    the model's tensors and ignores the rest (a subset on purpose: fine-tuning, 2BW's previous.*)."""
    path = str(tmp_path / "ckpt")
    saved = make_model(depth=3).reset_parameters(seed=4)
    mt.save(path, model=saved, step=1)
    model = make_model().reset_parameters(seed=5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"'model/4.kernel'.* not in the model.*strict=False"):
        mt.load(path, model=model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert mt.load(path, model=model, strict=False)["step"] == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(saved.named_parameters())[n]), n
    with pytest.raises(ProcessorError):  # the same on a mesh: every processor refuses it
        mt.launch(lambda: mt.load(path, model=make_model()), mesh="m:2", rules=RULES)


@pytest.mark.parametrize("change, message", [("deeper", r"'4.kernel' \(key '4.kernel'\) is not in"),
                                             ("another last layer", "'2.kernel' has shape")])
def test_a_failed_import_consolidated_leaves_the_model_as_it_was(tmp_path, change, message):
    """import_consolidated, too, checks every parameter against the files before it copies any."""
    mt.export_consolidated(str(tmp_path), make_model().reset_parameters(seed=1))
    if change == "deeper":
        model = make_model(depth=3)
    else:
        model = mt.nn.Sequential(make_model()[0], mt.relu, mt.nn.Dense(mt.Dim("d_ff", 8), mt.Dim("out", 6)))
    model.reset_parameters(seed=9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=message):
        mt.import_consolidated(str(tmp_path), model)
    assert [n for n, p in model.named_parameters() if not torch.equal(before[n], p)] == []


def test_a_save_refused_before_writing_says_why_on_every_processor(tmp_path):
    """The message said only 'failed before writing; nothing was changed': the reason (a data value
    JSON cannot store, a path that is a file) was in the chained exception only, which a log of
    str(error) or another processor never shows."""
    path = str(tmp_path / "ckpt")

    def save():
        data = {"pos": 3, "sampler": object()} if mt.current().rank == 1 else {"pos": 3}
        try:
            mt.save(path, model=make_model(), data=data)
        except CheckpointError as e:
            return str(e)
        return None

    got = mt.launch(save, mesh="m:2", rules=RULES)
    assert "processor 1" in got[0] and all("data holds object" in text for text in got), got
    assert not os.path.exists(path) or not os.listdir(path)
    open(tmp_path / "file", "w").close()
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        mt.save(str(tmp_path / "file"), model=make_model())


def test_loading_a_consolidated_export_names_import_consolidated(tmp_path):
    mt.export_consolidated(str(tmp_path), make_model())
    with pytest.raises(CheckpointError, match=r"model.safetensors.*mt.import_consolidated"):
        mt.load(str(tmp_path), model=make_model())


class _LoaderRefusingOnOne:
    """A data= object whose state only processor 0 takes back (another dataset on processor 1)."""

    def state_dict(self) -> dict:
        return {"pos": 3}

    def load_state_dict(self, state: dict) -> None:
        if mt.current().rank == 1:
            raise ValueError("loader of another dataset")


def _load_refused_by_one_loader(path: str) -> str:
    torch.manual_seed(0)
    mt.save(path, model=torch.nn.Linear(2, 2), data=_LoaderRefusingOnOne())
    try:
        mt.load(path, model=torch.nn.Linear(2, 2), data=_LoaderRefusingOnOne())
    except Exception as e:  # noqa: BLE001 - what each processor raised is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_data_state_one_processor_refuses_raises_on_every_processor(tmp_path):
    """After the model's load agreed, a loader that refuses its state on one processor only made
    that one raise while the others waited for it at the final barrier (review15b): every
    processor now raises, the others naming the one that failed."""
    out = mt.launch(_load_refused_by_one_loader, str(tmp_path / "ck"), mesh="b:2")
    assert out[1] == "ValueError: loader of another dataset"
    assert out[0].startswith("CheckpointError") and "processor 1" in out[0] and "loader of another" in out[0]


def _load_unverified(path: str) -> str:
    try:
        mt.load(path, model=make_model().reset_parameters(seed=9), verify=False)
    except Exception as e:  # noqa: BLE001 - what each processor raised is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_a_read_failing_on_one_processor_after_the_checks_raises_on_every_processor(tmp_path, backend):
    """With verify=False a damaged piece is found only while it is read, after the agreement: processor
    1 raised it while processor 0 loaded its slices and met a bare CommError ("processor 1 left")
    at the next collective. Every processor now raises the reason, saying the model is partly loaded."""
    path = str(tmp_path / "ckpt")
    mt.launch(lambda: mt.save(path, model=make_model().reset_parameters(seed=1)), mesh="m:2", rules=RULES)
    fname = os.path.join(mt.checkpoint.latest(path), "slices-00001.safetensors")
    with safe_open(fname, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model/2.kernel@4,0"] = torch.zeros(17)  # the index says [4, 4]
    save_file(tensors, fname)
    got = mt.launch(_load_unverified, path, mesh="m:2", rules=RULES, backend=backend)
    assert got[1].startswith("CheckpointError: tensor 'model/2.kernel'"), got
    assert got[0].startswith("CheckpointError") and "processor 1" in got[0] and "partly loaded" in got[0], got
    assert "'model/2.kernel'" in got[0]
