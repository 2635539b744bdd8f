"""What a training run shows and writes besides its steps: progress, utilisation, held-out loss, loss.png.

Example:
    >>> from meshtorch.models import TransformerConfig
    >>> from meshtorch.recipes.lm.report import step_flops
    >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
    >>> step_flops(cfg, tokens=32, length=8, params=16 * 8 + 8 * 8 + 4 * 8 * 2 * 4 + 2 * 8 * 16 + 3 * 2 * 8)
    156672.0
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from meshtorch.context import processor_device
from meshtorch.data import Corpus
from meshtorch.data.tokenizer import Tokenizer
from meshtorch.files import save_figure
from meshtorch.models import TransformerConfig, generate
from meshtorch.models.decode import stop_ids, until_eos
from meshtorch.plan.devices import matmul_rate
from meshtorch.recipes.lm.config import TrainConfig
from meshtorch.recipes.lm.generate import prompt_ids
from meshtorch.recipes.lm.run_files import is_init_froms_tokenizer, sample_eos


class Progress:
    """tqdm when installed, else one line rewritten in place (or plain lines when not a tty)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.n, self.enabled = total, initial, enabled
        self.bar = None
        self.last = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)
        except ImportError:
            self.tty = sys.stdout.isatty()

    def update(self, n: int, info: dict[str, str]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            self.bar.set_postfix(info, refresh=False)
            return
        now = time.time()
        if n < self.total and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        width = 24
        done = int(width * n / self.total)
        text = f"[{'#' * done}{'.' * (width - done)}] {n}/{self.total} " + " ".join(
            f"{k}={v}" for k, v in info.items())
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and getattr(self, "tty", False):
            print()


def plot_losses(path: str, metrics: list[dict], heldout: list[tuple[int, float]], entropy: float,
                unit: str = "byte") -> bool:
    """Write ``loss.png`` (losses in nats per ``unit``: byte or token) if matplotlib is importable;
    return whether it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train loss")
    if heldout:
        ax.plot(*zip(*heldout), "o-", label="held-out loss")
    ax.axhline(entropy, color="gray", ls="--", label=f"{unit}-unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel(f"nats / {unit}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return True


def matmul_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square ``dtype`` matmul on the default device (this processor's: see
    ``mt.launch(device=)``): the utilisation yardstick. 512×512 with torch's current threads
    on the CPU; 4096×4096 on a GPU."""
    device = processor_device()
    return matmul_rate(4096 if device.type == "cuda" else 512, dtype, 0.1, device)


def step_flops(mcfg: TransformerConfig, tokens: int, length: int, params: int) -> float:
    """Training FLOPs of one step: 6·(matmul params)·tokens plus the attention score products."""
    if mcfg.positions == "learned":
        params -= mcfg.max_length * mcfg.d_model  # a lookup, not a matmul
    if not mcfg.tie_embeddings:
        params -= mcfg.vocab * mcfg.d_model
    attn = 12 * mcfg.layers * mcfg.heads * mcfg.d_kv * length * tokens
    return 6.0 * params * tokens + attn


def evaluate(model: torch.nn.Module, heldout: Any, n: int) -> float:
    """Mean loss over ``n`` fixed held-out batches (nats per token)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            total += model.loss(*heldout.at(i)).item()
    model.train()
    return total / n


def bits_per_byte(loss: float, heldout: Any, n: int, tok: Tokenizer) -> float:
    """The held-out ``loss`` (mean nats per token over ``n`` batches) in bits per byte of the text the
    targets decode to: what compares runs with different tokenizers (an end-of-text id counts as
    a token but no byte).

    Example:
        >>> import numpy as np
        >>> from meshtorch.data import ByteTokenizer, LMBatches
        >>> b = LMBatches(np.frombuffer(b"abcdefghi", np.uint8).astype(np.uint16), batch=2, length=4)
        >>> round(bits_per_byte(math.log(2), b, 1, ByteTokenizer()), 6)
        1.0
    """
    tokens = nbytes = 0
    for i in range(n):
        targets = heldout.windows_at(i)[:, 1:]
        tokens += targets.size
        nbytes += sum(len(tok.decode(row.tolist()).encode("utf-8")) for row in targets)
    return loss * tokens / math.log(2) / max(1, nbytes)


def against_unigram(loss: float, entropy: float, unit: str) -> str:
    """The held-out loss against the unigram entropy (the loss of a model that learned only how often
    each token occurs), with how far it is below (or above) it and whether that is the 1 nat a model
    that learned context reaches.

    Example:
        >>> print(against_unigram(4.5, 6.174, "token"))
        held-out loss 4.500 nats/token vs token-unigram entropy 6.174 (1.674 below: learned)
        >>> print(against_unigram(5.5, 6.174, "byte"))
        held-out loss 5.500 nats/byte vs byte-unigram entropy 6.174 (0.674 below: not yet 1 nat/byte below it)
        >>> print(against_unigram(7.492, 6.174, "byte"))
        held-out loss 7.492 nats/byte vs byte-unigram entropy 6.174 (1.318 above: not yet 1 nat/byte below it)
    """
    gap = entropy - loss
    where = f"{gap:.3f} below" if gap >= 0 else f"{-gap:.3f} above"
    verdict = "learned" if loss <= entropy - 1.0 else f"not yet 1 nat/{unit} below it"
    return (f"held-out loss {loss:.3f} nats/{unit} vs {unit}-unigram entropy {entropy:.3f} "
            f"({where}: {verdict})")


def report(cfg: TrainConfig, model: torch.nn.Module, heldout: Any, corpus: Corpus | None, tok: Tokenizer,
           lead: bool) -> dict[str, Any]:
    """Held-out evaluation and a generated sample (printed by processor 0)."""
    if cfg.model.name == "seq2seq":
        from meshtorch.data.seq2seq import exact_match

        # --eval-batches batches of held-out numbers (default 8 x --batch 16 = 128), greedy-decoded
        acc, examples = exact_match(model, heldout, batches=cfg.run.eval_batches)
        if lead:
            print(f"held-out exact-match accuracy: {acc:.3f} ({len(examples)} numbers)")
            for src, want, got in examples[:3]:
                print(f"  {src!r} -> {got!r} (want {want!r})")
        return {"heldout_accuracy": acc, "heldout_numbers": len(examples),
                "heldout_loss": evaluate(model, heldout, cfg.run.eval_batches)}
    loss = evaluate(model, heldout, cfg.run.eval_batches)
    bpb = bits_per_byte(loss, heldout, cfg.run.eval_batches, tok)
    entropy = corpus.unigram_entropy("heldout")
    prompt = prompt_ids(tok, cfg.run.prompt)
    # a fine-tune with another tokenizer than --init-from's stops at that tokenizer's end of text
    init_from = cfg.run.init_from
    eos = sample_eos(model, tok, init_from, is_init_froms_tokenizer(init_from, cfg.run.tokenizer))
    new = generate(model, [prompt], cfg.run.sample_tokens, temperature=cfg.run.temperature, top_k=40,
                   seed=cfg.run.seed, limit=tok.sample_limit, eos=eos)[0]
    new = until_eos(new, stop_ids(model, eos)[0])  # the padding after the model's eos, if it emitted one
    sample = tok.decode(prompt + new)
    if lead:
        unit = "byte" if tok.name == "bytes" else "token"
        print(f"{against_unigram(loss, entropy, unit)}; {bpb:.3f} bits/byte")
        print("sample:\n" + "-" * 40 + "\n" + sample + "\n" + "-" * 40)
    return {"heldout_loss": loss, "heldout_bits_per_byte": bpb, "unigram_entropy": entropy, "sample": sample}
