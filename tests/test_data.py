"""meshtorch.data: tokenizer, stdlib corpus split, sharded resumable batches."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import meshtorch as mt
from meshtorch.data import ByteTokenizer, Corpus, DataError, LMBatches
from meshtorch.data.corpus import STDLIB_SKIP, is_heldout, list_files, stdlib_root


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'π'\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos and ids[-1] == tok.eos and len(ids) == len(text.encode()) + 2
    assert tok.decode(ids) == text
    assert tok.vocab_size % 8 == 0 and tok.vocab_size > tok.eos


def test_unigram_entropy_is_hand_derived():
    c = Corpus(np.array([1, 1, 2, 3], np.uint16), np.array([5, 5, 5, 7], np.uint16), "t")
    p = np.array([0.5, 0.25, 0.25])
    assert c.unigram_entropy("train") == pytest.approx(float(-(p * np.log(p)).sum()))
    assert c.unigram_entropy("heldout") == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_stdlib_corpus_split_by_file_hash():
    c = Corpus.stdlib()
    files = list_files(stdlib_root(), (".py",), STDLIB_SKIP)
    # the test packages are left out, the rest of the library kept
    assert not any(set(f.split(os.sep)[:-1]) & {"test", "tests", "idle_test", "encodings"} for f in files)
    assert "os.py" in files and os.path.join("json", "decoder.py") in files
    assert os.path.join("unittest", "case.py") in files
    held = [f for f in files if is_heldout(f, 5.0)]
    assert c.files == (len(files) - len(held), len(held))
    assert 0 < len(held) < len(files) // 5
    sizes = {f: os.path.getsize(os.path.join(stdlib_root(), f)) for f in held}
    # each file's bytes plus one eos separator
    assert len(c.heldout) == sum(sizes.values()) + len(held)
    first = sorted(held)[0]
    with open(os.path.join(stdlib_root(), first), "rb") as f:
        head = f.read()
    assert bytes(c.heldout[: len(head)].astype(np.uint8)) == head
    assert 2.0 < c.unigram_entropy() < 4.5


def test_single_file_and_missing_path(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("".join(f"line {i}\n" for i in range(200)))
    c = Corpus.from_path(str(p), heldout_percent=10)
    assert bytes(np.concatenate([c.train, c.heldout]).astype(np.uint8)) == p.read_bytes()
    assert chr(c.heldout[0]) == "l" and 0.05 < len(c.heldout) / len(p.read_bytes()) < 0.15
    with pytest.raises(DataError, match="--data"):
        Corpus.from_path(str(tmp_path / "nope"))


class Spy(np.ndarray):
    """Records which token positions are read."""

    def __getitem__(self, idx):
        if isinstance(idx, np.ndarray):
            self.read.update(np.asarray(idx).ravel().tolist())
        return np.asarray(super().__getitem__(idx))


def test_batches_each_processor_reads_only_its_part():
    tokens = np.arange(2000, dtype=np.uint16)

    def prog():
        spy = tokens.view(Spy)
        spy.read = set()
        ids, tgt = LMBatches(spy, batch=4, length=8, seed=3).at(5)
        return ids.to_global(), tgt.to_global(), spy.read

    (ref_ids, ref_tgt, ref_read), = mt.launch(prog)
    outs = mt.launch(prog, mesh="b:2,m:2", rules="batch:b; length:m")
    for ids, tgt, read in outs:
        assert torch.equal(ids, ref_ids) and torch.equal(tgt, ref_tgt)
        # a quarter of the rows×columns, plus one target column each
        assert len(read) == 2 * (4 + 1)
    assert set().union(*(r for _, _, r in outs)) == ref_read
    assert torch.equal(ref_tgt[:, :-1], ref_ids[:, 1:])
    assert torch.equal(ref_ids % 8, torch.arange(8).expand(4, 8))  # whole windows


def test_batches_are_deterministic_resumable_and_cover_an_epoch():
    tokens = np.arange(81, dtype=np.uint16)  # 10 windows of 8+1
    a = LMBatches(tokens, batch=2, length=8, seed=7)
    seen = [a.next()[0].to_global()[:, 0].tolist() for _ in range(5)]
    assert sorted(sum(seen, [])) == list(range(0, 80, 8))
    b = LMBatches(tokens, batch=2, length=8, seed=7)
    b.load_state_dict(LMBatches(tokens, batch=2, length=8, seed=7, step=3).state_dict())
    assert b.next()[0].to_global()[:, 0].tolist() == seen[3]
    c = LMBatches(tokens, batch=2, length=8, seed=8)
    assert [c.next()[0].to_global()[:, 0].tolist() for _ in range(5)] != seen
