"""A Hugging Face tokenizer (``tokenizer.json``) in place of bytes: ``meshtorch train --tokenizer DIR``.

It reads a directory written by ``save_pretrained`` (or a ``tokenizer.json``
file) with the ``tokenizers`` library; a directory without ``tokenizer.json``
(a slow tokenizer's ``vocab.json`` + ``merges.txt``) is read with
``transformers.AutoTokenizer`` when transformers is installed. Neither is a
dependency of meshtorch: ``pip install 'meshtorch[hf]'``.

The end-of-text id (files are joined by it, samples start from it) is the
``eos_token`` of ``tokenizer_config.json``, else the first of the usual
special tokens the vocabulary has (``<|endoftext|>``, ``</s>``, ...).

Example:
    >>> import tempfile
    >>> from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    >>> from meshtorch.data.hf_tokenizer import HFTokenizer
    >>> t = Tokenizer(models.BPE()); t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    >>> t.train_from_iterator(["def f(x):\\n    return x\\n"] * 50, trainers.BpeTrainer(
    ...     vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
    ...     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    >>> path = tempfile.mkdtemp() + "/tokenizer.json"; t.save(path)
    >>> tok = HFTokenizer(path)
    >>> tok.eos, tok.vocab_size % 8, tok.encode("def f(x):") == t.encode("def f(x):").ids
    (0, 0, True)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from meshtorch.data.corpus import DataError
from meshtorch.files import write_atomic

FILE = "tokenizer.json"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
# encoding is ~2 MB/s per core (the byte-level pre-tokenizer's regex): texts of at least this many
# characters are encoded once per machine and their ids kept in the cache (see :func:`ids_cache_dir`)
CACHE_MIN_CHARS = 1 << 20
CACHE_KEEP = 4  # encoded corpora kept in the cache, the most recently used first


def ids_cache_dir() -> str:
    """Where encoded corpora are kept: ``corpus-ids/`` in :func:`meshtorch.caching.cache_root`."""
    from meshtorch.caching import cache_root

    return os.fspath(cache_root() / "corpus-ids")


def _backend(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` of ``path`` (a tokenizer.json, or a directory)."""
    file = path if os.path.isfile(path) else os.path.join(path, FILE)
    if os.path.isfile(file):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"--tokenizer {path!r} needs the tokenizers library: pip install "
                            "'meshtorch[hf]'") from None
        try:
            return Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception for any unreadable file
            raise DataError(f"--tokenizer {path!r}: {file} is not a tokenizers file ({e}); pass a tokenizer "
                            "directory (or its tokenizer.json) as save_pretrained writes it") from None
    if not os.path.isdir(path):
        raise DataError(f"--tokenizer {path!r} is neither a directory nor a {FILE} file; pass a "
                        "directory written by a tokenizer's save_pretrained")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"--tokenizer {path!r} has no {FILE}; reading its other files needs transformers: "
                        "pip install 'meshtorch[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(path).backend_tokenizer
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"--tokenizer {path!r}: transformers cannot read a fast tokenizer there ({e})") from e


def _eos_token(path: str) -> str | None:
    cfile = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "tokenizer_config.json")
    if not os.path.isfile(cfile):
        return None
    try:
        with open(cfile) as f:
            eos = json.load(f).get("eos_token")
    except (ValueError, AttributeError) as e:  # not JSON, or not an object
        raise DataError(f"--tokenizer: {cfile} is not a tokenizer config (a JSON object; {e}); fix or "
                        "remove it") from None
    return eos.get("content") if isinstance(eos, dict) else eos


class HFTokenizer:
    """A Hugging Face tokenizer with :class:`~meshtorch.data.ByteTokenizer`'s interface.

    Attributes:
        vocab_size: the tokenizer's ids (added tokens included) rounded up to a multiple of
            ``multiple``, so that ``vocab`` can be split over mesh axes; a model loaded with
            ``--init-from`` keeps its own (it must be at least :attr:`sample_limit`).
        sample_limit: the number of ids the tokenizer has; samplers draw below it.
        eos: the end-of-text id.
    """

    def __init__(self, path: str | os.PathLike, multiple: int = 8):
        self.path = os.fspath(path)
        self.tok = _backend(self.path)
        self.sample_limit = self.tok.get_vocab_size(with_added_tokens=True)
        self.vocab_size = -(-self.sample_limit // multiple) * multiple
        vocab = self.tok.get_vocab(with_added_tokens=True)
        named = _eos_token(self.path)
        eos = named if named in vocab else next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise DataError(f"--tokenizer {self.path!r} has no end-of-text token (no eos_token in "
                            f"tokenizer_config.json, none of {list(EOS_CANDIDATES)}); add one, e.g. "
                            "'<|endoftext|>' as a special token")
        self.eos = vocab[eos]

    @property
    def name(self) -> str:
        return f"tokenizer:{self.path}"

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> list[int]:
        """The tokenizer's ids of ``text`` (no special tokens added), optionally ended by ``eos``."""
        if bos:
            raise DataError(f"--tokenizer {self.path!r}: meshtorch frames texts with eos only")
        return self.arrays([text])[0].tolist() + ([self.eos] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def arrays(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Each text's ids (encoded in one parallel batch), ``uint16`` when they fit, else ``uint32``.

        Texts of :data:`CACHE_MIN_CHARS` or more in all are encoded once per machine: their ids are
        kept in :func:`ids_cache_dir` under the hash of the tokenizer and the texts, so a rerun on the
        same data (and every process of a run after the first) reads them instead.
        """
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        strs = [t if isinstance(t, str) else bytes(t).decode("utf-8", errors="replace") for t in texts]
        if sum(map(len, strs)) < CACHE_MIN_CHARS:
            return self._encode(strs, dtype)
        key = hashlib.sha256(self.tok.to_str().encode())
        for s in strs:
            data = s.encode("utf-8", errors="surrogatepass")
            key.update(len(data).to_bytes(8, "little") + data)
        path = os.path.join(ids_cache_dir(), key.hexdigest()[:32] + ".npz")
        cached = _read_ids(path, len(strs), dtype)
        if cached is not None:
            return cached
        out = self._encode(strs, dtype)
        _write_ids(path, out)
        return out

    def _encode(self, strs: list[str], dtype: type) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: ~15% less time
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [np.asarray(e.ids, dtype=dtype) for e in encode(strs, add_special_tokens=False)]


def _read_ids(path: str, n: int, dtype: type) -> list[np.ndarray] | None:
    """The ids :func:`_write_ids` kept in ``path`` for ``n`` texts, or None (absent or unreadable:
    then they are encoded again and the file rewritten)."""
    try:
        with np.load(path) as f:
            ids, lengths = f["ids"], f["lengths"]
        os.utime(path)  # most recently used: kept when the cache is pruned
    except (OSError, KeyError, ValueError, EOFError):
        return None
    if len(lengths) != n or int(lengths.sum()) != len(ids) or ids.dtype != dtype:
        return None
    return np.split(ids, np.cumsum(lengths)[:-1])


def _write_ids(path: str, arrays: list[np.ndarray]) -> None:
    """Keep ``arrays`` in ``path`` (atomically) and prune the cache to its :data:`CACHE_KEEP` newest
    files. A cache that cannot be written only costs the next run the encoding again."""
    import io

    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        buf = io.BytesIO()
        np.savez(buf, ids=np.concatenate(arrays) if arrays else np.zeros(0, np.uint16),
                 lengths=np.array([len(a) for a in arrays], np.int64))
        write_atomic(path, buf.getvalue())
        kept = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".npz")),
                      key=os.path.getmtime, reverse=True)
        for old in kept[CACHE_KEEP:]:
            os.remove(old)
    except OSError:
        pass


def train_bpe(texts: Sequence[str | bytes], vocab_size: int, path: str | os.PathLike,
              sample_bytes: int = 2_000_000) -> HFTokenizer:
    """Fit a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` included) to ``texts`` and
    save it in directory ``path`` (``tokenizer.json`` + ``tokenizer_config.json``, which
    ``transformers.AutoTokenizer`` reads too); the tokenizer.

    It is fitted to evenly spaced texts of about ``sample_bytes`` in all, which is enough for a
    small vocabulary and takes about a second. Any text encodes (byte-level: no unknown ids).

    Example:
        >>> import tempfile
        >>> from meshtorch.data.hf_tokenizer import train_bpe
        >>> tok = train_bpe(["def f(x):\\n    return x\\n"] * 20, 300, tempfile.mkdtemp())
        >>> tok.sample_limit <= 300, tok.decode(tok.encode("    return x")) == "    return x"
        (True, True)
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError("a BPE tokenizer trained on the data needs the tokenizers library: pip install "
                        "'meshtorch[hf]' (or --tokenizer bytes)") from None
    total = sum(len(t) for t in texts)
    stride = max(1, round(total / max(1, sample_bytes)))
    sample = [t if isinstance(t, str) else bytes(t).decode("utf-8", errors="replace")
              for t in texts[::stride]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_CANDIDATES[0]], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    # each file appears whole or not at all: a process that reads it meanwhile never sees a part
    write_atomic(os.path.join(path, FILE), tok.to_str(pretty=True).encode())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_CANDIDATES[0]}
    write_atomic(os.path.join(path, "tokenizer_config.json"), json.dumps(config).encode())
    return HFTokenizer(path)
