"""Byte-level tokenizer: ids 0–255 are bytes, then a few special ids.

The vocabulary is rounded up to a multiple of 8 so that ``vocab`` can be split
over mesh axes of size 2, 4 or 8.

Example:
    >>> from meshtorch.data import ByteTokenizer
    >>> tok = ByteTokenizer()
    >>> tok.encode("hé"), tok.decode(tok.encode("hé") + [tok.eos]), tok.vocab_size
    ([104, 195, 169], 'hé', 264)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    """What a corpus, the trainer and the sampler need of a tokenizer (bytes or Hugging Face's)."""

    vocab_size: int  # the model's vocabulary: the ids, rounded up so that mesh axes divide it
    eos: int  # joins files; samples start from it

    @property
    def sample_limit(self) -> int: ...  # ids below it are what a sampler may draw

    @property
    def name(self) -> str: ...  # for run banners and checkpoints

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def arrays(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids, plus ``pad``, ``bos`` and ``eos`` specials.

    Attributes:
        vocab_size: 256 + specials, rounded up to a multiple of ``multiple``.
    """

    pad, bos, eos = 256, 257, 258

    def __init__(self, multiple: int = 8):
        self.vocab_size = -(-259 // multiple) * multiple

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes), optionally framed by ``bos``/``eos``."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([self.bos] if bos else []) + list(data) + ([self.eos] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of byte ids; specials and ids past 255 are dropped, bad UTF-8 replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def sample_limit(self) -> int:
        """Ids below this are what a sampler may produce (bytes and ``eos``, never pad or bos)."""
        return self.eos + 1

    @property
    def name(self) -> str:
        return "bytes"

    def arrays(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Each text's ids as a ``uint16`` array (no specials): what a corpus stores."""
        raw = [t.encode() if isinstance(t, str) else bytes(t) for t in texts]
        return [np.frombuffer(r, dtype=np.uint8).astype(np.uint16) for r in raw]
