"""A synthetic sequence-to-sequence task: spell numbers out in English words.

``"4721"`` → ``"four thousand seven hundred twenty-one"``. Numbers 0–9999 are
split into train and held-out by the hash of their digits, so the held-out
accuracy measures generalisation. Batches are a pure function of
``(seed, step)`` and each processor builds only its rows.

Example:
    >>> from meshtorch.data.seq2seq import spell
    >>> spell(4721), spell(0), spell(1015)
    ('four thousand seven hundred twenty-one', 'zero', 'one thousand fifteen')
"""

from __future__ import annotations

import numpy as np
import torch

from meshtorch.data.corpus import is_heldout
from meshtorch.data.tokenizer import ByteTokenizer
from meshtorch.shape import Dim, Shape
from meshtorch.tensor import MeshTensor, layout_for, local_slices

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
       "sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def spell(n: int) -> str:
    """English words for ``0 <= n < 10000``."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    if n < 1000:
        return ONES[n // 100] + " hundred" + (" " + spell(n % 100) if n % 100 else "")
    return ONES[n // 1000] + " thousand" + (" " + spell(n % 1000) if n % 1000 else "")


class SpellingTask:
    """Batches ``(src, tgt_in, tgt_out, weights)`` of the spelling task.

    ``src [batch, length:max_source]`` holds the digits (padded), ``tgt_in``
    starts with ``bos``, ``tgt_out`` ends with ``eos`` then padding, and
    ``weights`` is 1 on real target positions.
    """

    max_source, max_target = 8, 48

    def __init__(self, batch: int, seed: int = 0, step: int = 0, heldout_percent: float = 10.0,
                 split: str = "train"):
        self.batch, self.seed, self.step = batch, seed, step
        self.tok = ByteTokenizer()
        self.numbers = np.array([n for n in range(10000)
                                 if is_heldout(str(n), heldout_percent) == (split == "heldout")])

    def heldout(self, batches: int) -> SpellingTask:
        """The held-out numbers, as a task whose ``at(i)`` gives fixed batches."""
        return SpellingTask(self.batch, seed=999, split="heldout")

    def encode(self, numbers: np.ndarray) -> tuple[torch.Tensor, ...]:
        tok = self.tok
        src = torch.full((len(numbers), self.max_source), tok.pad, dtype=torch.int64)
        tin = torch.full((len(numbers), self.max_target), tok.pad, dtype=torch.int64)
        tout = torch.full_like(tin, tok.pad)
        for i, n in enumerate(numbers):
            s, t = tok.encode(str(int(n))), tok.encode(spell(int(n)), eos=True)
            src[i, : len(s)] = torch.tensor(s)
            tout[i, : len(t)] = torch.tensor(t)
            tin[i, 0] = tok.bos
            tin[i, 1 : len(t)] = torch.tensor(t[:-1])
        return src, tin, tout, (tout != tok.pad).float()

    def numbers_at(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return self.numbers[rng.integers(0, len(self.numbers), self.batch)]

    def at(self, step: int) -> tuple[MeshTensor, ...]:
        """The batch of ``step``; this processor encodes only its rows."""
        b = Dim("batch", self.batch)
        tgt = Shape([b, Dim("length", self.max_target)])
        shapes = [Shape([b, Dim("length", self.max_source)]), tgt, tgt, tgt]
        rows = local_slices(layout_for(shapes[0]))[0]
        parts = self.encode(self.numbers_at(step)[rows])
        out = []
        for t, shape in zip(parts, shapes):
            layout = layout_for(shape)
            out.append(MeshTensor(t[(slice(None),) + local_slices(layout)[1:]].contiguous(), shape, layout))
        return tuple(out)

    def next(self) -> tuple[MeshTensor, ...]:
        out = self.at(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state is not None:
            self.step, self.seed = int(state["step"]), int(state["seed"])


def exact_match(model, task: SpellingTask, batches: int = 2) -> tuple[float, list[tuple[str, str, str]]]:
    """Fraction of held-out numbers spelled exactly (greedy), and (source, wanted, got) examples."""
    tok = task.tok
    right, total, examples = 0, 0, []
    for i in range(batches):
        src = task.at(i)[0]
        got = model.greedy(src, tok.bos, task.max_target)
        for n, row in zip(task.numbers_at(i), got.tolist()):
            text = tok.decode(row[: row.index(tok.eos)] if tok.eos in row else row)
            want = spell(int(n))
            right += text == want
            total += 1
            examples.append((str(int(n)), want, text))
    return right / total, examples
