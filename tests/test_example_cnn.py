"""examples/cnn.py: the CNN trained with image height split over one axis and batch over another
gives the one-processor losses, step for step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import meshtorch as mt

_PATH = Path(__file__).resolve().parents[1] / "examples" / "cnn.py"


def _example():
    spec = importlib.util.spec_from_file_location("example_cnn", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cnn_with_height_and_batch_split_equals_one_processor():
    cnn = _example()
    one = mt.launch(cnn.train, steps=4)[0]
    split = mt.launch(cnn.train, mesh="d:2,s:2", rules="batch:d; h:s", steps=4)
    for losses in split:
        assert losses == pytest.approx(one, rel=1e-5, abs=1e-6)
    assert one[-1] < one[0]  # it learns
