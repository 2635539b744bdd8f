"""``meshtorch.data``: byte tokenizer, text corpora and sharded batches.

Example:
    >>> from meshtorch.data import ByteTokenizer, Corpus
    >>> Corpus.from_texts({"a": "hello", "b": "world"}, heldout_percent=50).files
    (1, 1)
"""

from meshtorch.data.batches import LMBatches
from meshtorch.data.corpus import Corpus, DataError
from meshtorch.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "DataError", "LMBatches"]
