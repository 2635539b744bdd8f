"""``meshtorch.models``: Transformers written in named dims.

Dims are named ``batch, length, d_model, heads, d_kv, d_ff, vocab, experts``,
so the Mesh-TensorFlow paper's layouts are one rules string, e.g.
``"batch:b; heads:m; d_ff:m; vocab:m"`` (add ``experts:b`` for MoE).

Example:
    >>> from meshtorch.models import DecoderLM, TransformerConfig
    >>> cfg = TransformerConfig(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
    >>> DecoderLM(cfg).num_parameters()
    880
"""

from meshtorch.models.config import TransformerConfig
from meshtorch.models.decode import beam_search, generate
from meshtorch.models.hf import export_hf, from_hf, hf_config
from meshtorch.models.lm import Block, DecoderLM, KVCache
from meshtorch.models.moe import MoE
from meshtorch.models.seq2seq import EncoderDecoder

__all__ = ["TransformerConfig", "DecoderLM", "Block", "KVCache", "generate", "EncoderDecoder", "MoE",
           "from_hf", "export_hf", "hf_config", "beam_search"]
