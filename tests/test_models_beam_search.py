"""mt.models.beam_search against a dense reference beam search written here (plain torch over the
one-processor model's full recomputation, no cache) on several meshes: same best sequences, same
scores; and `meshtorch generate --beams`."""

import functools

import pytest
import torch

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate

CFG = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=10)
PROMPTS = [[1, 2, 3], [4, 4, 9], [7, 0, 5]]


@functools.cache
def _reference(prompts, steps, beams):
    model = DecoderLM(CFG, seed=3).eval()
    best = []
    for p in prompts:
        live = [(0.0, list(p))]
        for _ in range(steps):
            seqs = torch.tensor([s for _, s in live])
            with torch.no_grad():
                logits = model(mt.from_global(seqs, f"batch:{len(live)},length:{seqs.shape[1]}")).to_global()
            logp = logits[:, -1].double().log_softmax(-1)
            cands = [(score + logp[b, t].item(), b, t) for b, (score, _) in enumerate(live)
                     for t in range(CFG.vocab)]
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            live = [(score, list(live[b][1]) + [t]) for score, b, t in cands[:beams]]
        score, seq = max(live, key=lambda c: c[0])
        best.append((seq[len(p):], score))
    return best


@pytest.mark.parametrize("mesh,rules", [("m:1", ""), ("b:2", "batch:b"),
                                        ("m:2", "heads:m; d_ff:m; vocab:m"),
                                        ("b:2,m:2", "batch:b; heads:m; vocab:m")])
def test_beam_search_equals_the_dense_reference(mesh, rules):
    want = _reference(tuple(map(tuple, PROMPTS)), steps=4, beams=3)

    def prog():
        model = DecoderLM(CFG, seed=3)
        return beam_search(model, PROMPTS, 4, beams=3, return_scores=True)

    for seqs, scores in mt.launch(prog, mesh=mesh, rules=rules):
        assert seqs == [s for s, _ in want]
        torch.testing.assert_close(torch.tensor(scores), torch.tensor([s for _, s in want]),
                                   rtol=1e-5, atol=1e-5)


def test_one_beam_is_greedy():
    model = DecoderLM(CFG, seed=3)
    assert beam_search(model, PROMPTS, 5, beams=1) == generate(model, PROMPTS, 5)


def test_limit_and_bad_arguments():
    model = DecoderLM(CFG, seed=3)
    seqs = beam_search(model, PROMPTS, 3, beams=2, limit=5)
    assert all(t < 5 for s in seqs for t in s)
    with pytest.raises(mt.errors.ArgumentError, match="beams"):
        beam_search(model, PROMPTS, 3, beams=0)
    with pytest.raises(mt.errors.ArgumentError, match="beams"):
        beam_search(model, PROMPTS, 3, beams=6, limit=5)
