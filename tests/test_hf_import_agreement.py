"""``from_hf`` on a mesh: every processor reads the files itself (each host its own copy), so they
agree before going on, as ``mt.import_consolidated`` does: a read failing on one processor fails
all of them, and configs that differ between processors are refused on all, naming the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import meshtorch as mt
import meshtorch.models.hf as hf
from meshtorch.models import DecoderLM, TransformerConfig, export_hf, from_hf

CFG = TransformerConfig(vocab=32, d_model=8, heads=2, kv_heads=1, d_kv=4, d_ff=16, layers=1, max_length=8,
                        positions="rotary", norm="rms", activation="silu", gated=True)
RULES = "heads:m; d_ff:m"


@pytest.fixture
def copies(tmp_path) -> tuple[str, str]:
    """Two hosts' copies of one exported Llama."""
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    mt.launch(lambda: export_hf(good, DecoderLM(CFG, seed=1)))
    shutil.copytree(good, bad)
    return good, bad


def _load_on_each(good: str, bad: str) -> tuple[str | None, float | None]:
    """Processor 1 loads from ``bad``, the others from ``good``: the error it raised (its type and
    text), or the model's eps where it loaded one."""
    try:
        model = from_hf(bad if mt.current().rank == 1 else good)
    except Exception as e:  # noqa: BLE001 - what each processor raised is the result
        return f"{type(e).__name__}: {e}", None
    return None, model.cfg.eps


def test_a_read_failing_on_one_processor_fails_every_processor(copies, monkeypatch):
    """Processor 1's read of a weight failed: it raised, and processor 0 went on to its next
    collective (the NaN check's all_reduce), where it met processor 1's next one, or waited."""
    read = hf.read_slice

    def failing(src, piece, sizes, region):
        if mt.current().rank == 1:
            raise OSError("Input/output error")
        return read(src, piece, sizes, region)

    monkeypatch.setattr(hf, "read_slice", failing)
    got = mt.launch(_load_on_each, *copies, mesh="m:2", rules=RULES)
    assert got[1] == ("OSError: Input/output error", None)
    assert got[0][0].startswith("CheckpointError: from_hf(") and "reading the weights failed on " \
        "processor 1: OSError: Input/output error" in got[0][0], got


def test_building_the_model_failing_on_one_processor_fails_every_processor(copies, monkeypatch):
    """Processor 1 ran out of memory building the model (after the configs agreed): every
    processor raises, processor 0 naming processor 1's error, none left in a collective."""
    build = hf.DecoderLM

    def failing(cfg, *args, **kwargs):
        if mt.current().rank == 1:
            raise MemoryError("no room for the model")
        return build(cfg, *args, **kwargs)

    monkeypatch.setattr(hf, "DecoderLM", failing)
    got = mt.launch(_load_on_each, *copies, mesh="m:2", rules=RULES)
    assert got[1] == ("MemoryError: no room for the model", None)
    assert got[0][0].startswith("CheckpointError: from_hf(") and "failed on processor 1: MemoryError: " \
        "no room for the model" in got[0][0], got


def test_a_missing_file_on_one_processor_fails_every_processor(copies):
    good, bad = copies
    os.remove(os.path.join(bad, "model.safetensors"))
    got = mt.launch(_load_on_each, good, bad, mesh="m:2", rules=RULES)
    assert got[1][0].startswith("CheckpointError:") and "holds no model weights" in got[1][0], got
    assert "failed on processor 1: CheckpointError:" in got[0][0] and "no model was built" in got[0][0], got


def test_configs_that_differ_between_processors_are_refused_on_every_processor(copies):
    """Processor 1's host had another config.json (its rms_norm_eps): the processors built models
    that compute differently, and nothing said so."""
    good, bad = copies
    with open(os.path.join(bad, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({**config, "rms_norm_eps": 1e-3}, f)
    got = mt.launch(_load_on_each, good, bad, mesh="m:2", rules=RULES)
    for error, _ in got:
        assert error is not None and "the processors read different configs, eps=1e-05 on processor 0 " \
            "and 0.001 on processor 1" in error, got
    assert mt.launch(_load_on_each, good, good, mesh="m:2", rules=RULES) == [(None, 1e-5)] * 2
