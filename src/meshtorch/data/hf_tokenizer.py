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

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from meshtorch.data.corpus import DataError

FILE = "tokenizer.json"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def _backend(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` of ``path`` (a tokenizer.json, or a directory)."""
    file = path if os.path.isfile(path) else os.path.join(path, FILE)
    if os.path.isfile(file):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"--tokenizer {path!r} needs the tokenizers library: pip install "
                            "'meshtorch[hf]'") from None
        return Tokenizer.from_file(file)
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
    with open(cfile) as f:
        eos = json.load(f).get("eos_token")
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
        """Each text's ids (encoded in one parallel batch), ``uint16`` when they fit, else ``uint32``."""
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        strs = [t if isinstance(t, str) else bytes(t).decode("utf-8", errors="replace") for t in texts]
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: ~15% less time
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [np.asarray(e.ids, dtype=dtype) for e in encode(strs, add_special_tokens=False)]


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
    tok.save(os.path.join(path, FILE))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_CANDIDATES[0]}, f)
    return HFTokenizer(path)
