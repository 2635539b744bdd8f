"""Each kind of file meshtorch writes goes through meshtorch.files: where the replace of the new file
fails, the old one is whole and no temporary file is left (a rerun's summary, a checkpoint's index and
pointer, a background save's marker, the probe of a shared run directory, a plot, an exported
tokenizer file)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import meshtorch as mt
from meshtorch import cli
from meshtorch.files import save_figure
from run_harness import tiny_train
from test_files import a_failed_replace_keeps_everything


@pytest.mark.parametrize("name", ["index.json", "latest"])
def test_a_checkpoint_whose_index_or_pointer_cannot_be_replaced_keeps_the_previous_one(tmp_path, monkeypatch,
                                                                                       name):
    path = str(tmp_path / "ckpt")
    model = mt.nn.Dense(mt.Dim("d", 2), mt.Dim("h", 2))
    mt.save(path, model=model, step=1)
    a_failed_replace_keeps_everything(monkeypatch, tmp_path, name, lambda: mt.save(path, model=model, step=2))
    assert os.path.basename(mt.checkpoint.latest(path)) == "step-000001"


def test_a_background_saves_marker_is_whole_or_absent(tmp_path, monkeypatch):
    from meshtorch.checkpoint.background import wait_markers, write_marker

    a_failed_replace_keeps_everything(monkeypatch, tmp_path, ".done-00000",
                                      lambda: write_marker(str(tmp_path), 0, "ab12", None))
    write_marker(str(tmp_path), 0, "ab12", None)
    assert wait_markers(str(tmp_path), range(1)) == {0: {"sha256": "ab12"}}


def test_the_probe_of_a_shared_run_directory_leaves_nothing_where_it_fails(tmp_path, monkeypatch):
    from meshtorch.recipes.lm import nodes

    out = tmp_path / "out"
    out.mkdir()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(nodes.secrets, "token_hex", lambda n: "ab" * n)
    try:
        a_failed_replace_keeps_everything(monkeypatch, out, nodes._PROBE + "ab" * 8,
                                          lambda: nodes.check_shared_out(str(out)))
        nodes.check_shared_out(str(out))  # processor 0 sees its own probe, then removes it
        assert os.listdir(out) == []
    finally:
        dist.destroy_process_group()


def test_a_figure_that_cannot_be_replaced_keeps_the_old_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from meshtorch.pipeline.plot import timeline
    from meshtorch.pipeline.schedule import build
    from meshtorch.recipes.lm.report import plot_losses

    (tmp_path / "loss.png").write_bytes(b"old plot")
    (tmp_path / "gpipe.svg").write_bytes(b"old plot")
    metrics = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}]

    def losses():
        return plot_losses(str(tmp_path / "loss.png"), metrics, [(2, 2.6)], 2.0, "byte")

    def schedule():
        return timeline(build("gpipe", 2, 2), str(tmp_path / "gpipe.svg"))

    a_failed_replace_keeps_everything(monkeypatch, tmp_path, "loss.png", losses)
    a_failed_replace_keeps_everything(monkeypatch, tmp_path, "gpipe.svg", schedule)
    assert losses()
    schedule()
    # each in the format its name says, as fig.savefig(path) would write it
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in (tmp_path / "gpipe.svg").read_bytes()[:1000]
    assert sorted(os.listdir(tmp_path)) == ["gpipe.svg", "loss.png"]


def test_save_figure_takes_the_format_from_the_name_or_the_argument(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, _ = plt.subplots()
    try:
        save_figure(fig, tmp_path / "a.pdf")
        save_figure(fig, tmp_path / "b.out", format="svg")
    finally:
        plt.close(fig)
    assert (tmp_path / "a.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"<svg" in (tmp_path / "b.out").read_bytes()[:1000]


def test_an_exported_tokenizer_file_is_whole_or_the_old_one(tmp_path, monkeypatch):
    import meshtorch.launcher
    from meshtorch.recipes.lm import export

    src, out = tmp_path / "tokenizer", tmp_path / "hf"
    src.mkdir()
    out.mkdir()
    (src / "tokenizer.json").write_text('{"new": 1}')
    (out / "tokenizer.json").write_text('{"old": 1}')
    monkeypatch.setattr(export, "checkpoint_dir", lambda path: path)
    monkeypatch.setattr(export, "run_tokenizer", lambda path: type("Tok", (), {"path": str(src)})())
    monkeypatch.setattr(meshtorch.launcher, "launch", lambda prog: [[]])  # the model's files: not this test's
    a_failed_replace_keeps_everything(monkeypatch, tmp_path, "tokenizer.json",
                                      lambda: export.export_checkpoint("ckpt", str(out)))
    assert export.export_checkpoint("ckpt", str(out)) == ["config.json", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"new": 1}'


def test_a_rerun_whose_summary_cannot_be_replaced_keeps_the_last_summary(tmp_path, monkeypatch, capsys):
    text = tmp_path / "corpus"
    text.mkdir()
    for i in range(6):  # as test_lm_trainer's corpus: some files go to the held-out split
        (text / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40)))
    out = str(tmp_path / "run")
    flags = ["--data", str(text), *tiny_train(mesh="b:1", rules="", steps=2)]
    assert cli.main(["train", "--out", out, *flags]) == 0
    with open(os.path.join(out, "summary.json"), "rb") as f:
        last = f.read()
    with monkeypatch.context() as m:
        from test_files import replace_fails

        replace_fails(m, "summary.json")
        assert cli.main(["train", "--out", out, "--resume", out, *flags]) != 0
    assert "No space left on device (injected)" in capsys.readouterr().err
    with open(os.path.join(out, "summary.json"), "rb") as f:
        assert f.read() == last
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
