"""mt.models.beam_search against a dense reference beam search written here (plain torch over the
one-processor model's full recomputation, no cache; transformers' rules for end-of-sequence ids and
the length penalty) on several meshes: same best sequences, same scores. Against transformers'
own generate(num_beams=): tests/test_hf_user_probes.py."""

import functools

import pytest
import torch

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig, beam_search, generate

CFG = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=10)
PROMPTS = [[1, 2, 3], [4, 4, 9], [7, 0, 5]]


@functools.cache
def _reference(prompts, steps, beams, eos=(), length_penalty=1.0):
    """Each prompt's best (new tokens, score), one prompt at a time, by transformers' rules: of the
    (1 + len(eos)) * beams best candidates, one ending in eos (or at the last step) among the first
    `beams` finishes, scored total / its new tokens ** length_penalty; the best that did not end run
    on; a prompt is done once `beams` have finished and the best running total, so scored at the
    present length, is no better than the worst of them."""
    model = DecoderLM(CFG, seed=3).eval()
    best = []
    for p in prompts:
        live, done = [(0.0, list(p))], []
        for step in range(steps):
            seqs = torch.tensor([s for _, s in live])
            with torch.no_grad():
                logits = model(mt.from_global(seqs, f"batch:{len(live)},length:{seqs.shape[1]}")).to_global()
            logp = logits[:, -1].double().log_softmax(-1)
            cands = [(score + logp[b, t].item(), b, t) for b, (score, _) in enumerate(live)
                     for t in range(CFG.vocab)]
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            cands = cands[:max(2, 1 + len(eos)) * beams]
            last = step == steps - 1
            for rank, (score, b, t) in enumerate(cands):
                new = live[b][1][len(p):] + [t]
                if rank < beams and (last or t in eos):
                    done.append((score / len(new) ** length_penalty, new))
            done = sorted(done, key=lambda d: -d[0])[:beams]
            live = [(score, live[b][1] + [t]) for score, b, t in cands if t not in eos][:beams]
            if len(done) == beams and live[0][0] / (step + 1) ** length_penalty <= done[-1][0]:
                break
        score, seq = done[0]
        best.append((seq, score))
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


@pytest.mark.parametrize("eos,length_penalty", [((1,), 1.0), ((8, 3), 1.0), ((1, 2), 0.0)])
def test_beam_search_ends_hypotheses_at_eos_as_the_reference(eos, length_penalty):
    """Seen: beam_search ran all max_new_tokens past the model's eos (generate stopped there), so
    a hypothesis that had ended was extended and scored with tokens after its eos. Each prompt's
    best finished hypothesis, its eos included, the shorter rows padded with the first eos id (the
    config has no pad_token_id); on meshes that split batch (3 prompts over 2: rows repeated)."""
    want = _reference(tuple(map(tuple, PROMPTS)), 6, 3, eos, length_penalty)
    cut = [s for s, _ in want]
    assert len({len(s) for s in cut}) > 1 and min(map(len, cut)) < 6, cut  # rows end at different steps
    n = max(map(len, cut))
    rows = [s + [eos[0]] * (n - len(s)) for s in cut]

    def prog():
        model = DecoderLM(CFG, seed=3)
        return beam_search(model, PROMPTS, 6, beams=3, eos=eos, length_penalty=length_penalty,
                           return_scores=True)

    for mesh, rules in [("m:1", ""), ("b:2", "batch:b; vocab:b")]:
        for seqs, scores in mt.launch(prog, mesh=mesh, rules=rules):
            assert seqs == rows, (mesh, seqs, rows)
            torch.testing.assert_close(torch.tensor(scores), torch.tensor([s for _, s in want]),
                                       rtol=1e-5, atol=1e-5)


def test_one_beam_is_greedy_up_to_eos_and_ignore_eos_runs_on():
    model = DecoderLM(CFG, seed=3)
    free = generate(model, PROMPTS, 6)
    eos = [free[0][2], free[2][4]]
    greedy = generate(model, PROMPTS, 6, eos=eos)
    assert len(greedy[0]) < 6 and beam_search(model, PROMPTS, 6, beams=1, eos=eos) == greedy
    assert beam_search(model, PROMPTS, 6, 3, eos=eos, ignore_eos=True) == beam_search(model, PROMPTS, 6, 3)


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
    with pytest.raises(mt.errors.ArgumentError, match="length_penalty=nan"):
        beam_search(model, PROMPTS, 3, beams=2, length_penalty=float("nan"))
