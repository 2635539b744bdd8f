"""``mt.save(..., data=loader)`` where each processor reads its own rows: each processor's own loader
position is saved and restored, so a resumed run reads the rows the uninterrupted run read."""

from __future__ import annotations

import json
import os

import pytest
import torch

import meshtorch as mt
from meshtorch.checkpoint.index import index_checksum, read_index
from meshtorch.errors import CheckpointError
from meshtorch.tensor import MeshTensor, layout_for

MESH, RULES = "b:2", "batch:b"
ROWS, D = 2, 3  # rows per processor per step, features


class ShardLoader:
    """This processor's own stream of rows (its shard of a dataset), of which a filter drops some
    (as packing or dropping over-long samples does): how far each processor got differs."""

    def __init__(self):
        self.rank, self.pos = mt.current().rank, 0

    def _row(self, k: int) -> torch.Tensor:
        return torch.randn(D, generator=torch.Generator().manual_seed(1000 * self.rank + k))

    def next(self) -> torch.Tensor:
        rows = []
        while len(rows) < ROWS:
            row = self._row(self.pos)
            self.pos += 1
            if row.sum() > 0:
                rows.append(row)
        return torch.stack(rows)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def _setup():
    model = mt.nn.Dense(mt.Dim("d", D), mt.Dim("out", 2)).reset_parameters(seed=3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), ShardLoader()


def _steps(model, opt, loader, n: int) -> tuple[list[list[float]], list[float]]:
    """``n`` steps over the processors' own rows: the rows this processor read, and the losses."""
    rows, losses = [], []
    shape = mt.Shape([mt.Dim("batch", ROWS * mt.current().mesh.size), mt.Dim("d", D)])
    for _ in range(n):
        local = loader.next()
        rows += local.tolist()
        x = MeshTensor(local, shape, layout_for(shape))
        opt.zero_grad()
        loss = mt.reduce_mean(model(x) ** 2)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return rows, losses


def straight(n: int):
    return _steps(*_setup(), n)


def first_part(path: str, n: int, background: bool):
    model, opt, loader = _setup()
    out = _steps(model, opt, loader, n)
    mt.save(path, model=model, optimizer=opt, step=n, data=loader, background=background)
    mt.checkpoint.wait()
    return out + (loader.pos,)


def resumed(path: str, n: int):
    model, opt, loader = _setup()
    info = mt.load(path, model=model, optimizer=opt, data=loader)
    assert info["data"] == {"pos": loader.pos}  # this processor's own position
    return _steps(model, opt, loader, n)


def _check_resume(tmp_path, backend: str, background: bool = False) -> None:
    path = str(tmp_path / "ckpt")
    kw = {"mesh": MESH, "rules": RULES, "backend": backend}
    want = mt.launch(straight, 6, **kw)
    first = mt.launch(first_part, path, 3, background, **kw)
    assert first[0][2] != first[1][2]  # the processors got to different positions
    second = mt.launch(resumed, path, 3, **kw)
    for rank in range(2):
        assert first[rank][0] + second[rank][0] == want[rank][0], rank  # the same rows
        assert first[rank][1] + second[rank][1] == want[rank][1], rank  # bitwise the same losses
    index = read_index(path)
    assert index["data_per_processor"] == [{"pos": first[0][2]}, {"pos": first[1][2]}]
    assert index["data"] == {"pos": first[0][2]}  # processor 0's, as an older reader takes it


@pytest.mark.parametrize("background", [False, True])
def test_each_processor_resumes_from_its_own_position_on_threads(tmp_path, background):
    """Only processor 0's position was saved and every processor was given it back: processor 1
    re-read or skipped rows on resuming, and the run silently trained on other data."""
    _check_resume(tmp_path, "threads", background)


def test_each_processor_resumes_from_its_own_position_on_processes(tmp_path):
    _check_resume(tmp_path, "torch")


def _load_on(path: str, with_data: bool):
    model = mt.nn.Dense(mt.Dim("d", D), mt.Dim("out", 2)).reset_parameters(seed=9)
    before = model.kernel.detach().clone()
    loader = ShardLoader()
    try:
        info = mt.load(path, model=model, data=loader if with_data else None)
    except CheckpointError as e:
        return str(e), torch.equal(before, model.kernel), loader.pos
    return info["data"], torch.equal(before, model.kernel), loader.pos


def test_positions_per_processor_on_another_processor_count_are_refused(tmp_path):
    """No rule maps two processors' own positions to four (or one): a load with data= is refused on
    every processor before anything is copied; one without data= loads the model, and its
    info["data"] is None (there is no position of this processor)."""
    path = str(tmp_path / "ckpt")
    mt.launch(first_part, path, 2, False, mesh=MESH, rules=RULES)
    for mesh in ("b:4", "b:1"):
        for error, unchanged, pos in mt.launch(_load_on, path, True, mesh=mesh, rules=RULES):
            assert "data position per processor" in error and "2 processors" in error, error
            assert unchanged and pos == 0
    for data, unchanged, _ in mt.launch(_load_on, path, False, mesh="b:4", rules=RULES):
        assert data is None and not unchanged
    assert _load_on(path, False)[0] is None  # one processor, outside a launch


def _save_equal(path: str) -> None:
    model = mt.nn.Dense(mt.Dim("d", D), mt.Dim("out", 2))
    mt.save(path, model=model, data={"epoch": 1, "pos": 7}, step=1)


def test_equal_positions_are_saved_once_and_load_on_any_processor_count(tmp_path):
    """A loader every processor steps alike (meshtorch's LMBatches: each builds its slice of the same
    global batch) has one position: it is saved once, as before, and restores on any mesh."""
    path = str(tmp_path / "ckpt")
    mt.launch(_save_equal, path, mesh=MESH, rules=RULES)
    index = read_index(path)
    assert "data_per_processor" not in index and index["version"] == 2
    assert index["data"] == {"epoch": 1, "pos": 7}
    got = mt.launch(lambda: mt.load(path, model=mt.nn.Dense(mt.Dim("d", D), mt.Dim("out", 2)))["data"],
                    mesh="b:4", rules=RULES)
    assert got == [{"epoch": 1, "pos": 7}] * 4


def test_an_index_with_positions_for_another_processor_count_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    mt.launch(first_part, path, 1, False, mesh=MESH, rules=RULES)
    ipath = os.path.join(mt.checkpoint.latest(path), "index.json")
    index = json.loads(open(ipath).read())
    assert index["version"] == 3
    index["data_per_processor"].append({"pos": 1})
    index["index_sha256"] = index_checksum(index)
    open(ipath, "w").write(json.dumps(index))
    message = r"data_per_processor.*one position per processor of the mesh b:2 \(2\), got 3"
    with pytest.raises(CheckpointError, match=message):
        read_index(path)


def _save_per_dp(path: str) -> None:
    """Each data-parallel replica reads its own shard: its position is its dp coordinate."""
    model = mt.nn.Dense(mt.Dim("d", D), mt.Dim("out", 2)).reset_parameters(seed=3)
    mt.save(path, model=model, data={"dp_shard": mt.current().coords["dp"]}, step=1)


def _load_per_dp(path: str, with_data: bool):
    model = mt.nn.Dense(mt.Dim("d", D), mt.Dim("out", 2)).reset_parameters(seed=9)
    before = model.kernel.detach().clone()
    state = {}

    class Loader:
        def load_state_dict(self, s):
            state.update(s)

    try:
        info = mt.load(path, model=model, data=Loader() if with_data else None)
    except CheckpointError as e:
        return dict(mt.current().coords), str(e), torch.equal(before, model.kernel), state
    return dict(mt.current().coords), info["data"], torch.equal(before, model.kernel), state


def test_positions_per_processor_on_another_mesh_of_as_many_processors_are_refused(tmp_path):
    """Saved on dp:2,tp:2, the positions were handed out by rank on tp:2,dp:2 and dp:4 (as many
    processors): rank 1 is dp 0 on dp:2,tp:2 but dp 1 on tp:2,dp:2, so replicas resumed on another
    replica's shard. A position belongs to a processor's coordinates: on another mesh (other axes,
    sizes or order) data= is refused on every processor before anything is copied, naming both
    meshes, and a load without data= gives info["data"] None; on the saved mesh each gets its own."""
    path = str(tmp_path / "ckpt")
    mt.launch(_save_per_dp, path, mesh="dp:2,tp:2")
    for mesh in ("tp:2,dp:2", "dp:4"):
        for _, error, unchanged, state in mt.launch(_load_per_dp, path, True, mesh=mesh):
            assert "data position per processor" in error, error
            assert "'dp:2,tp:2'" in error and f"'{mesh}'" in error, error
            assert unchanged and state == {}
        for _, data, unchanged, _ in mt.launch(_load_per_dp, path, False, mesh=mesh):
            assert data is None and not unchanged
    for coords, data, unchanged, state in mt.launch(_load_per_dp, path, True, mesh="dp:2,tp:2"):
        assert data == state == {"dp_shard": coords["dp"]} and not unchanged
