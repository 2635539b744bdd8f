"""Greedy, sampled (temperature, top-k) and beam-search decoding with a KV cache.

Every processor runs the same loop (SPMD): the next-token logits are gathered
(``[batch, vocab]`` is small) and sampled by Gumbel-max with noise from
:func:`meshtorch.random.uniform_whole`, a pure function of the seed, the step and
the element, so all processors pick the same tokens under any layout, and a CUDA
processor draws the same noise as a CPU one. The tokens stay on the processor's
device until the end.
Decoding adds one position at a time, which no axis can split: under rules that
split ``length`` (sequence parallelism), ``generate`` runs with ``length`` whole.

Example:
    >>> import torch, meshtorch as mt
    >>> from meshtorch.models import DecoderLM, TransformerConfig, generate
    >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
    >>> model = DecoderLM(cfg, seed=0)
    >>> out = generate(model, [[1, 2, 3]], max_new_tokens=4)
    >>> out == generate(model, [[1, 2, 3]], max_new_tokens=4, use_cache=False), len(out[0])
    (True, 4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from meshtorch.context import current, processor_device, use
from meshtorch.errors import ArgumentError, ShapeError
from meshtorch.layout import LayoutRules
from meshtorch.ops.array import slice as mt_slice
from meshtorch.ops.einsum import einsum
from meshtorch.ops.reshape import rename
from meshtorch.random import uniform_whole
from meshtorch.shape import Dim
from meshtorch.tensor import MeshTensor, from_global


def pick(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, *, seed: int = 0,
         stream: int | str = 0, limit: int | None = None) -> torch.Tensor:
    """Next ids from ``[batch, vocab]`` logits: argmax if ``temperature == 0``, else a
    sample from ``softmax(logits / temperature)`` over the ``top_k`` best (0: all), as
    :func:`~meshtorch.ops.select.sample_with_temperature` draws it: the argmax of
    ``logits + temperature * g`` for Gumbel noise ``g`` from ``uniform_whole([batch, vocab],
    seed=seed, stream=stream)`` (row ``i`` gets the same noise whatever the number of rows,
    on any device). Ids ``>= limit`` are never picked.

    Example:
        >>> import torch
        >>> from meshtorch.models.decode import pick
        >>> pick(torch.tensor([[0.0, 3.0, 1.0]])).tolist()
        [1]
        >>> pick(torch.tensor([[0.0, 3.0, 9.0]]), limit=2).tolist()
        [1]
        >>> pick(torch.tensor([[0.0, 50.0, 0.0]]), 1.0, seed=3).tolist()
        [1]
    """
    logits = logits.detach().float()
    if limit is not None:
        logits = logits.clone()
        logits[:, limit:] = float("-inf")
    if temperature <= 0:
        return logits.argmax(-1)
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    rows, vocab = logits.shape
    u = uniform_whole([Dim("batch", rows), Dim("vocab", vocab)], seed=seed, stream=stream,
                      device=logits.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
    return (logits.double() + temperature * gumbel).argmax(-1)


def room(max_length: int, prompt: int) -> int:
    """How many tokens a model of ``max_length`` positions can add to a prompt of ``prompt`` tokens:
    each new token is predicted from the positions before it, so the last one is predicted from
    a context of all ``max_length`` positions (0 when the prompt is longer than that).

    Example:
        >>> from meshtorch.models.decode import room
        >>> room(8, 3), room(8, 8), room(8, 9)
        (6, 1, 0)
    """
    return max(0, max_length - prompt + 1)


def _pad_rows(seq: torch.Tensor, n: int) -> torch.Tensor:
    """``seq``'s rows repeated up to a multiple of ``n`` (the pieces the rules split ``batch``
    into); callers keep the first rows of the result."""
    rows = seq.shape[0]
    return seq.repeat(-(-rows // n) * n // rows + 1, 1)[: -(-rows // n) * n]


def _last(logits: MeshTensor) -> torch.Tensor:
    n = logits.shape["length"].size
    return mt_slice(logits, "length", n - 1, 1).to_global().squeeze(1)


@contextmanager
def length_whole() -> Iterator[None]:
    """Run the block under the current rules less any rule for ``length``: decoding adds one
    position at a time, which no axis can split.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.models.decode import length_whole
        >>> def f():
        ...     with length_whole():
        ...         inside = mt.current().rules.axis_of("length")
        ...     return inside, mt.current().rules.axis_of("length")
        >>> mt.launch(f, mesh="m:2", rules="length:m")
        [(None, 'm'), (None, 'm')]
    """
    ctx = current()
    if ctx.rules.axis_of("length") is None:
        yield
        return
    rules = LayoutRules({d: a for d, a in ctx.rules.rules.items() if d != "length"})
    inner = dataclasses.replace(ctx, rules=rules)
    try:
        with use(inner):
            yield
    finally:
        ctx.random_calls = inner.random_calls  # random streams stay in step with the other processors


def stop_ids(model, eos: int | Sequence[int] | None = None,
             ignore_eos: bool = False) -> tuple[list[int], int]:
    """The ids :func:`generate` stops a sequence at and the id it pads finished sequences with:
    ``eos`` if given, else the model's config's ``eos_token_id`` (:meth:`TransformerConfig.token_ids`:
    a model loaded by :func:`~meshtorch.models.from_hf`, or a checkpoint of one, knows it); the pad
    is the config's ``pad_token_id``, else the first eos id, as in transformers' ``generate``. A
    ``pad_token_id`` that is no id of the vocabulary (a legacy LLaMA's ``-1``) is not: a finished
    row's pad goes back into the model as its next input, so the first eos id pads it.
    ``ignore_eos`` (or no eos known): ``([], -1)``, no stop.

    Example:
        >>> from meshtorch.models import DecoderLM, TransformerConfig
        >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1,
        ...                         extra={"hf_config": {"eos_token_id": [3, 5]}})
        >>> model = DecoderLM(cfg)
        >>> stop_ids(model), stop_ids(model, eos=9), stop_ids(model, ignore_eos=True)
        (([3, 5], 3), ([9], 9), ([], -1))
    """
    if ignore_eos:
        return [], -1
    ids = model.cfg.token_ids("eos_token_id") if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not ids:
        return [], -1
    pads = [p for p in model.cfg.token_ids("pad_token_id") if 0 <= p < model.cfg.vocab]
    return ids, pads[0] if pads else ids[0]


def until_eos(tokens: Sequence[int], eos: Sequence[int]) -> list[int]:
    """``tokens`` up to and including the first of the ids ``eos`` (the padding :func:`generate`
    puts after it dropped); all of them if none is there.

    Example:
        >>> until_eos([4, 9, 2, 0, 0], [2]), until_eos([4, 9], [2])
        ([4, 9, 2], [4, 9])
    """
    out = list(tokens)
    at = next((i for i, t in enumerate(out) if t in eos), None)
    return out if at is None else out[: at + 1]


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, use_cache: bool = True, limit: int | None = None,
             eos: int | Sequence[int] | None = None, ignore_eos: bool = False,
             stop: int | None = None) -> list[list[int]]:
    """Continue each prompt by ``max_new_tokens`` tokens (fewer if ``max_length`` is reached: a
    prompt of ``n`` tokens gets at most ``max_length - n + 1``, the last predicted from a full
    context; :func:`room` says how many; or fewer once every sequence has ended).

    A sequence ends at an end-of-sequence id (:func:`stop_ids`: ``eos``, else the model's
    config's ``eos_token_id``, e.g. a Llama's from :func:`~meshtorch.models.from_hf`), which it
    emits; from then on it gets the pad id (the config's ``pad_token_id``, else the first eos
    id), as transformers' ``generate`` pads finished rows, and decoding stops once every
    sequence has ended. :func:`until_eos` cuts a row after its eos.

    Args:
        model: a :class:`~meshtorch.models.DecoderLM` (anything with ``new_cache(batch, length=)``
            and ``forward(ids, cache)``); the KV cache holds the prompt's and the new tokens'
            positions, not ``max_length``'s.
        prompts: token ids, all of the same length (at least 1).
        temperature, top_k: sampling (``temperature=0``: greedy).
        use_cache: reuse keys/values (else recompute the whole prefix each step;
            the results are the same).
        limit: never emit ids ``>= limit`` (e.g. padding entries of the vocab).
        eos: the end-of-sequence id(s) (default: the config's; none for a model trained from
            scratch, which then runs ``max_new_tokens``).
        ignore_eos: never stop at an end-of-sequence id (``meshtorch generate --ignore-eos``).
        stop: removed (an :class:`~meshtorch.errors.ArgumentError` naming ``eos=``): it ran every
            row on until all had emitted the id; ``eos=`` pads each row after its own.

    Returns:
        The new tokens of each prompt (all rows of one length).
    """
    if stop is not None:
        raise ArgumentError(f"generate(stop={stop}) is gone: pass eos={stop}, which ends each sequence at "
                            "its own eos and pads it after that with the pad id (stop= ran every sequence "
                            "on until all had emitted the id); decode.until_eos(row, [id]) cuts a row after "
                            "its eos, and ignore_eos=True never stops")
    if not 0 <= temperature < float("inf") or top_k < 0 or max_new_tokens < 0:
        raise ArgumentError(f"generate: temperature={temperature} must be >= 0 (0: greedy), top_k={top_k} "
                            f">= 0 (0: all) and max_new_tokens={max_new_tokens} >= 0")
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1 or 0 in lengths:
        raise ShapeError(f"generate needs non-empty prompts of one length, got lengths {sorted(lengths)}: "
                         f"call it once per length")
    stops, pad = stop_ids(model, eos, ignore_eos)
    with length_whole():
        return _generate(model, prompts, max_new_tokens, temperature, top_k, seed, use_cache, limit, stops,
                         pad)


def _generate(model, prompts, max_new_tokens, temperature, top_k, seed, use_cache, limit, stops, pad):
    lengths = {len(p) for p in prompts}
    was_training = model.training
    model.eval()
    n0 = lengths.pop()
    max_new_tokens = min(max_new_tokens, room(model.cfg.max_length, n0))
    rows = len(prompts)
    # the tokens live on the processor's device: one copy of the prompts there, none per token
    dev = processor_device()
    seq = torch.tensor([list(p) for p in prompts], dtype=torch.int64, device=dev)
    # the rules may split batch: repeat the prompts up to a multiple of that axis, keep the first rows
    ctx = current()
    seq = _pad_rows(seq, ctx.rules.pieces("batch", ctx.mesh))
    batch = Dim("batch", seq.shape[0])
    # the cache holds the request's positions (the last new token is never fed back), not max_length's
    length = min(model.cfg.max_length, n0 + max_new_tokens)
    cache = model.new_cache(batch, length=length) if use_cache else None
    ids = seq
    out: list[torch.Tensor] = []
    stop = torch.tensor(stops, dtype=torch.int64, device=dev)
    done = torch.zeros(seq.shape[0], dtype=torch.bool, device=dev)
    try:
        for step in range(max_new_tokens):
            x = from_global(ids, [batch, Dim("length", ids.shape[1])])
            nxt = pick(_last(model(x, cache)), temperature, top_k, seed=seed, stream=step, limit=limit)
            if stops:
                # a finished row gets the pad id; one that emits an eos id finishes
                nxt = torch.where(done, pad, nxt)
                done |= torch.isin(nxt, stop)
            out.append(nxt)
            seq = torch.cat([seq, nxt[:, None]], 1)
            ids = nxt[:, None] if use_cache else seq
            if stops and bool(done[:rows].all()):  # the repeated rows past `rows` are not returned
                break
    finally:
        model.train(was_training)
    return torch.stack(out, 1)[:rows].tolist() if out else [[] for _ in prompts]


@torch.no_grad()
def beam_search(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, beams: int, *,
                limit: int | None = None, eos: int | Sequence[int] | None = None, ignore_eos: bool = False,
                length_penalty: float = 1.0, return_scores: bool = False):
    """The likeliest continuation of each prompt found by a beam search of width ``beams``, as
    transformers' ``generate(num_beams=beams)`` finds it (its defaults: ``length_penalty=1.0``,
    ``early_stopping=False``).

    Every step extends each of the ``beams`` running sequences of a prompt by every token and ranks
    those by total log-probability (ties: the lower beam, then the lower token, first). Of the best
    ``(1 + number of eos ids) * beams`` (at least ``2 * beams``), one that ends in an end-of-sequence
    id (:func:`stop_ids`: ``eos``, else the config's ``eos_token_id``) is a finished hypothesis if it
    is among the first ``beams`` (below them it is dropped); the ``beams`` best that did not end run
    on. A prompt keeps its ``beams`` best finished hypotheses by ``total log-probability / new
    tokens ** length_penalty`` (its eos counted); at the last step (``max_new_tokens``, or fewer if
    ``max_length`` is reached: :func:`room`) the running sequences finish too. A prompt is done
    once it holds ``beams`` finished hypotheses and its best running sequence, so scored at its
    present length, is no better than the worst of them (transformers' heuristic); the search
    stops when every prompt is done. Without eos ids (``ignore_eos``, or a model trained from
    scratch) every sequence runs to the last step. ``beams=1`` is greedy decoding, as
    :func:`generate` does it.

    The beams share one KV cache of ``prompts × beams`` rows, reordered after each step by the
    beams' parents with a one-hot einsum, so it works under any rules (those that split ``batch``
    included).

    Args:
        model: a :class:`~meshtorch.models.DecoderLM`.
        prompts: token ids, all of the same length (at least 1).
        limit: never emit ids ``>= limit``.
        eos, ignore_eos: the end-of-sequence ids, as :func:`generate` takes them.
        length_penalty: the exponent of the new tokens' count a finished hypothesis's total
            log-probability is divided by (0: the total; transformers' default 1.0: the mean).
        return_scores: also return each best sequence's score (as transformers' ``sequences_scores``).

    Returns:
        The new tokens of each prompt's best sequence, its eos included, the shorter rows padded
        with the pad id (:func:`stop_ids`) to the longest (:func:`until_eos` cuts them), and with
        ``return_scores`` the scores.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate
        >>> cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
        >>> model = DecoderLM(cfg, seed=0)
        >>> beam_search(model, [[1, 2]], 3, beams=1) == generate(model, [[1, 2]], 3)
        True
        >>> len(beam_search(model, [[1, 2]], 3, beams=4)[0])
        3
        >>> first = generate(model, [[1, 2]], 3)[0][0]  # ends at once with that as its eos
        >>> beam_search(model, [[1, 2]], 3, beams=1, eos=first) == [[first]]
        True
    """
    if beams < 1 or max_new_tokens < 0:
        raise ArgumentError(f"beam_search: beams={beams} must be >= 1 and "
                            f"max_new_tokens={max_new_tokens} >= 0")
    if not 0 * length_penalty == 0:  # nan and the infinities
        raise ArgumentError(f"beam_search: length_penalty={length_penalty} must be a finite number "
                            "(transformers' default: 1.0)")
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1 or 0 in lengths:
        raise ShapeError(f"beam_search needs non-empty prompts of one length, got lengths {sorted(lengths)}: "
                         f"call it once per length")
    vocab = model.cfg.vocab
    if (limit if limit is not None else vocab) < beams:
        raise ArgumentError(f"beam_search: beams={beams} exceeds the {limit or vocab} tokens it may emit")
    stops, pad = stop_ids(model, eos, ignore_eos)
    with length_whole():
        seqs, scores = _beam_search(model, prompts, max_new_tokens, beams, limit, stops, pad, length_penalty)
    return (seqs, scores) if return_scores else seqs


def _beam_search(model, prompts, max_new_tokens, beams, limit, stops, pad, length_penalty):
    was_training = model.training
    model.eval()
    rows, n0 = len(prompts), len(prompts[0])
    steps = min(max_new_tokens, room(model.cfg.max_length, n0))
    if steps == 0:
        return [[] for _ in prompts], [0.0] * rows
    ctx = current()
    dev = processor_device()
    prompt = _pad_rows(torch.tensor([list(p) for p in prompts], dtype=torch.int64, device=dev),
                       ctx.rules.pieces("batch", ctx.mesh))
    groups = prompt.shape[0]
    batch = Dim("batch", groups * beams)
    cache = model.new_cache(batch, length=min(model.cfg.max_length, n0 + steps))
    ids = prompt.repeat_interleave(beams, 0)             # row g * beams + b: beam b of prompt g
    inf = float("-inf")
    # only the first beam of each prompt is live at the start, so the first step's beams differ
    score = torch.full((groups, beams), inf, dtype=torch.float64, device=dev)
    score[:, 0] = 0.0
    out = torch.zeros(groups, beams, 0, dtype=torch.int64, device=dev)
    # each prompt's best finished hypotheses, best first: score, new tokens (pad after), length
    kept = torch.full((groups, beams), inf, dtype=torch.float64, device=dev)
    kept_seq = torch.full((groups, beams, steps), pad, dtype=torch.int64, device=dev)
    kept_len = torch.zeros(groups, beams, dtype=torch.int64, device=dev)
    open_ = torch.ones(groups, dtype=torch.bool, device=dev)  # may a better hypothesis still finish
    stop = torch.tensor(stops, dtype=torch.int64, device=dev)
    firsts = torch.arange(groups, device=dev)[:, None] * beams  # row of each prompt's first beam
    # enough candidates that `beams` of them go on when the best all end (transformers' count)
    wide = max(2, 1 + len(stops)) * beams
    rank = torch.arange(wide, device=dev)[None, :]
    try:
        for step in range(steps):
            logits = _last(model(from_global(ids, [batch, Dim("length", ids.shape[1])]), cache)).double()
            if limit is not None:
                logits[:, limit:] = inf
            vocab = logits.shape[-1]
            cand = (score[:, :, None] + logits.log_softmax(-1).view(groups, beams, vocab)).view(groups, -1)
            # a stable sort: among equal scores the lower (beam, token) first, as the reference order
            best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :wide]
            total = cand.gather(1, best)
            parent, token = best // vocab, best % vocab
            seqs = torch.cat([out.gather(1, parent[:, :, None].expand(-1, -1, step)), token[:, :, None]], 2)
            last = step == steps - 1
            ends = torch.ones_like(token, dtype=torch.bool) if last else torch.isin(token, stop)
            # an ending below the first `beams` is dropped; a done prompt takes no more
            finished = ends & (rank[:, :best.shape[1]] < beams) & open_[:, None]
            new = torch.where(finished, total / (step + 1) ** length_penalty, inf)
            merged = torch.cat([kept, new], 1)  # the kept first: among equal scores they stay
            pick = torch.sort(merged, dim=1, descending=True, stable=True).indices[:, :beams]
            kept = merged.gather(1, pick)
            padded = torch.cat([seqs, seqs.new_full((groups, seqs.shape[1], steps - step - 1), pad)], 2)
            kept_seq = torch.cat([kept_seq, padded], 1).gather(1, pick[:, :, None].expand(-1, -1, steps))
            kept_len = torch.cat([kept_len, torch.where(finished, step + 1, 0)], 1).gather(1, pick)
            if last:
                break
            # the `beams` best that did not end run on
            live = torch.where(ends, inf, total)
            going = torch.sort(live, dim=1, descending=True, stable=True).indices[:, :beams]
            score = live.gather(1, going)
            parent, token = parent.gather(1, going), token.gather(1, going)
            out = seqs.gather(1, going[:, :, None].expand(-1, -1, step + 1))
            # transformers' early_stopping=False: done once `beams` have finished and the best running
            # sequence, scored at its present length, does not beat the worst of them
            full = (kept_len > 0).all(1)
            open_ &= ~full | (score[:, 0] / (step + 1) ** length_penalty > kept.min(1).values)
            if not bool(open_[:rows].any()):  # the repeated rows past `rows` are not returned
                break
            _reorder(cache, (parent + firsts).flatten())
            ids = token.reshape(-1, 1)
    finally:
        model.train(was_training)
    n = int(kept_len[:rows, 0].max())
    return kept_seq[:rows, 0, :n].tolist(), kept[:rows, 0].tolist()


def _reorder(cache, rows_from: torch.Tensor) -> None:
    """Row ``j`` of every cached key and value becomes row ``rows_from[j]``: a one-hot einsum over
    ``batch``, which needs no indexing of a split dim."""
    n = rows_from.numel()
    rows = torch.arange(n, device=rows_from.device)
    if torch.equal(rows_from, rows):
        return
    entry = cache.entries[0]["k"]
    onehot = torch.zeros(n, n, dtype=entry.dtype, device=rows_from.device)
    onehot[rows_from, rows] = 1.0
    pick = from_global(onehot, [Dim("batch", n), Dim("beam_row", n)])
    for e in cache.entries:
        for key in ("k", "v"):
            t = e[key]
            moved = einsum(t, pick, output_shape=["beam_row"] + [d for d in t.names if d != "batch"])
            e[key] = rename(moved, "beam_row", "batch")
