"""meshtorch train's metrics where people look: TensorBoard events that TensorBoard's own reader reads
back with the metrics.jsonl values, and the summary's tokens/s and model-FLOP utilisation."""

from __future__ import annotations

import json
import os
import sys

import pytest

from meshtorch import cli
from meshtorch.errors import MeshTorchError
from meshtorch.recipes.lm.telemetry import MetricsBoard
from run_harness import tiny_train

pytestmark = pytest.mark.timeout(300)

BATCH, LENGTH, STEPS = 8, 16, 6
D_MODEL, HEADS, D_KV, D_FF, LAYERS = 16, 2, 8, 32, 2
TINY = tiny_train(d_model=D_MODEL, heads=HEADS, d_kv=D_KV, d_ff=D_FF, layers=LAYERS, batch=BATCH,
                  length=LENGTH, warmup=2, mesh="b:1", rules="", steps=STEPS, log_every=2)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(6):  # files split between train and held-out
        (d / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40)))
    return str(d)


def _train(out, text, *flags):
    assert cli.main(["train", "--out", out, "--data", text, *TINY, *flags]) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(out, "summary.json")) as f:
        return records, json.load(f)


def test_tensorboard_events_hold_the_metrics_jsonl_values(text, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    records, summary = _train(out, text, "--tensorboard")
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in loss] == [2, 4, 6] == [r["step"] for r in records]
    # event files hold float32
    assert [v for _, v in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    tok = [e.value for e in events.Scalars("train/tokens_per_s")]
    assert tok == pytest.approx([r["tokens_per_s"] for r in records], rel=1e-6)
    (held,) = events.Scalars("run/heldout_loss")
    assert (held.step, held.value) == (STEPS, pytest.approx(summary["heldout_loss"], rel=1e-6))


def test_summary_reports_tokens_per_second_and_model_flop_utilisation(text, tmp_path):
    out = str(tmp_path / "plain")
    _, summary = _train(out, text)
    assert not os.path.exists(os.path.join(out, "tensorboard"))  # only with --tensorboard
    # tokens/s uses the exact training time, which train_s rounds to 10 ms
    tokens, t = STEPS * BATCH * LENGTH, summary["train_s"]
    assert tokens / (t + 0.005) - 0.1 <= summary["tokens_per_s"] <= tokens / max(t - 0.005, 1e-9) + 0.1
    # the model's FLOPs per token by hand: 6 per matmul weight (the learned positions are a lookup, the
    # tied embedding is the output matmul) plus the attention score and value products
    matmul_params = summary["parameters"] - LENGTH * D_MODEL
    per_token = 6 * matmul_params + 12 * LAYERS * HEADS * D_KV * LENGTH
    assert summary["model_flops_per_s"] == pytest.approx(per_token * summary["tokens_per_s"], rel=1e-3)
    peak = summary["peak_flops_per_s"]
    assert peak > 1e8  # a measured matmul rate, not a placeholder
    assert summary["model_flop_utilisation"] == pytest.approx(summary["model_flops_per_s"] / peak, abs=1e-4)


def test_tensorboard_flag_without_the_package_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(MeshTorchError, match=r"--tensorboard needs the tensorboard package.*meshtorch\["):
        MetricsBoard(str(tmp_path), enabled=True)
    board = MetricsBoard(str(tmp_path), enabled=False)  # without the flag nothing is imported
    board.write({"step": 1, "loss": 1.0})
    board.close({"steps": 1})
    assert os.listdir(tmp_path) == []
