"""Text corpora as token streams, split into train and held-out by file hash.

The default corpus is the ``.py`` sources of the running Python's standard
library, without its test packages (``test/``, the regression suite: over half
the bytes, with deliberately malformed and oddly encoded files among them; and
``tests/``, ``idle_test/`` and the ``test/`` of packages) and its generated tables
(``encodings/``' codec tables, ``pydoc_data/``): library code, present on every
machine, no download. Files are read in sorted
order and each goes to the held-out split when the hash of its relative path
says so, so the split is the same on every machine with the same Python.

Example:
    >>> from meshtorch.data import Corpus
    >>> c = Corpus.from_texts({"a.py": "x = 1\\n", "b.py": "y = 2\\n"}, heldout_percent=50)
    >>> len(c.train) + len(c.heldout), round(c.unigram_entropy("train"), 3) > 0
    (14, True)
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from meshtorch.data.tokenizer import ByteTokenizer, Tokenizer
from meshtorch.errors import MeshTorchError

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
# the stdlib corpus leaves out its test packages (the regression suite test/ alone is half its
# bytes) and generated tables: the samples are meant to look like library code, not like
# assertEqual runs, malformed-input fixtures or codec tables, and the first run encodes a third
# of the text
STDLIB_SKIP = ("test", "tests", "idle_test", "encodings", "pydoc_data")


class DataError(MeshTorchError, ValueError):
    """A corpus or data option is unusable (missing path, too little text)."""


def path_hash(relpath: str) -> int:
    return int.from_bytes(hashlib.sha1(relpath.replace(os.sep, "/").encode()).digest()[:4], "big")


def is_heldout(relpath: str, percent: float) -> bool:
    """Whether a file goes to the held-out split: by the sha1 of its relative path."""
    return (path_hash(relpath) % 10000) < percent * 100


def stdlib_root() -> str:
    """Directory of the running Python's standard library."""
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str, suffixes: tuple[str, ...] | None, skip: tuple[str, ...] = ()) -> list[str]:
    """Files under ``root`` (relative paths, sorted), skipping installed packages, caches and the
    directories named one of ``skip``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and d not in skip
                             and not d.startswith("."))
        for f in sorted(filenames):
            if suffixes is None or f.endswith(suffixes):
                out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return out


def read_dir(root: str, suffixes: tuple[str, ...] | None = None,
             skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """The contents of the files under ``root`` (with one of ``suffixes``, not in a directory named
    one of ``skip``), by relative path."""
    texts = {}
    for rel in list_files(root, suffixes, skip):
        with open(os.path.join(root, rel), "rb") as f:
            texts[rel] = f.read()
    return texts


def train_texts(path: str | None, heldout_percent: float = 5.0) -> list[bytes]:
    """The texts of ``--data`` ``path`` that :meth:`Corpus.from_path` trains on (not the held-out
    files; a single file whole): what a tokenizer may be fitted to."""
    if path is None or os.path.isdir(path):
        texts = read_dir(stdlib_root(), (".py",), STDLIB_SKIP) if path is None else read_dir(path)
        return [t for rel, t in sorted(texts.items()) if not is_heldout(rel, heldout_percent)]
    if not os.path.isfile(path):
        raise DataError(f"--data {path!r} is neither a file nor a directory")
    return _split_file(path, heldout_percent)[:1]


def _split_file(path: str, heldout_percent: float) -> list[bytes]:
    """A text file's train and held-out parts: its last ``heldout_percent``, from a line break."""
    with open(path, "rb") as f:
        data = f.read()
    cut = int(len(data) * (1 - heldout_percent / 100))
    nl = data.rfind(b"\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return [data[:cut], data[cut:]]


@dataclass
class Corpus:
    """A train and a held-out token stream (``uint16`` numpy arrays; ``uint32`` for a tokenizer
    of more than 65536 ids).

    Files are joined with the tokenizer's ``eos`` id between them.
    """

    train: np.ndarray
    heldout: np.ndarray
    name: str
    files: tuple[int, int] = (0, 0)

    @classmethod
    def from_texts(cls, texts: Mapping[str, str | bytes], heldout_percent: float = 5.0,
                   name: str = "texts", tokenizer: Tokenizer | None = None) -> Corpus:
        """Split named texts by the hash of their names; ``tokenizer`` (default bytes) encodes them."""
        tok = tokenizer or ByteTokenizer()
        parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
        held = {rel for rel in texts if is_heldout(rel, heldout_percent)}
        if not held and len(texts) > 1 and heldout_percent > 0:
            # too few files for the hash to pick any: hold out the one with the smallest hash
            held = {min(texts, key=path_hash)}
        names = sorted(texts)
        for rel, ids in zip(names, tok.arrays([texts[rel] for rel in names])):
            parts[rel in held].append(np.append(ids, np.array(tok.eos, ids.dtype)))
        join = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.uint16)  # noqa: E731
        corpus = cls(join(parts[False]), join(parts[True]), name, (len(parts[False]), len(parts[True])))
        return corpus

    @classmethod
    def stdlib(cls, heldout_percent: float = 5.0, tokenizer: Tokenizer | None = None) -> Corpus:
        """The running Python's standard library ``.py`` files (no download), without its tests."""
        root = stdlib_root()
        texts = read_dir(root, (".py",), STDLIB_SKIP)
        return cls.from_texts(texts, heldout_percent, f"python-stdlib:{root}", tokenizer)._checked()

    @classmethod
    def from_dir(cls, root: str, heldout_percent: float = 5.0, suffixes: tuple[str, ...] | None = None,
                 name: str | None = None, tokenizer: Tokenizer | None = None) -> Corpus:
        """Every file under ``root`` (or with one of ``suffixes``), split by path hash."""
        return cls.from_texts(read_dir(root, suffixes), heldout_percent, name or root, tokenizer)._checked()

    @classmethod
    def from_path(cls, path: str | None, heldout_percent: float = 5.0,
                  tokenizer: Tokenizer | None = None) -> Corpus:
        """``None``: the stdlib corpus; a directory: its files; a file: its last
        ``heldout_percent`` of bytes (at a line break) are held out."""
        if path is None:
            return cls.stdlib(heldout_percent, tokenizer)
        if os.path.isdir(path):
            return cls.from_dir(path, heldout_percent, tokenizer=tokenizer)
        if not os.path.isfile(path):
            raise DataError(f"--data {path!r} is neither a file nor a directory; give a text file or a "
                            "directory of text files, or leave --data out for the Python stdlib corpus")
        tr, ho = (tokenizer or ByteTokenizer()).arrays(_split_file(path, heldout_percent))
        return cls(tr, ho, path, (1, 1))._checked()

    def _checked(self) -> Corpus:
        if len(self.train) < 2 or len(self.heldout) < 2:
            raise DataError(f"corpus {self.name!r} has {len(self.train)} train and {len(self.heldout)} "
                            "held-out tokens; it needs text in both splits — add more files or text")
        return self

    def split(self, which: str) -> np.ndarray:
        if which not in ("train", "heldout"):
            raise DataError(f"split {which!r} is not 'train' or 'heldout'")
        return self.train if which == "train" else self.heldout

    def unigram_entropy(self, which: str = "heldout") -> float:
        """Entropy (nats per token) of the split's own token frequencies: the loss
        of the best model that ignores context."""
        counts = np.bincount(self.split(which), minlength=1).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())
