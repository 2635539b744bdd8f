"""DecoderLM vs an independent plain-PyTorch implementation, and layout invariance."""

from __future__ import annotations

import math

import pytest
import torch

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig

TINY = dict(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=2, max_length=8)


def ids_batch(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length + 1), generator=g)


def _norm(x, P, name, cfg):
    if cfg.norm == "rms":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * P[name + ".weight"]
    return torch.nn.functional.layer_norm(x, (cfg.d_model,), P[name + ".weight"], P[name + ".bias"], cfg.eps)


def _rope(x, offset=0):
    # x: [b, t, h, k]; pairs (i, i + k/2) rotate by pos * 10000^(-i/(k/2))
    t, k = x.shape[1], x.shape[-1]
    half = k // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = (torch.arange(t, dtype=torch.float64) + offset)[:, None] * inv
    c, s = ang.cos().to(x.dtype)[None, :, None, :], ang.sin().to(x.dtype)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


ACT = {"gelu": torch.nn.functional.gelu, "relu": torch.relu,
       "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
       "silu": torch.nn.functional.silu}


def reference_logits(P: dict[str, torch.Tensor], cfg: TransformerConfig, ids: torch.Tensor) -> torch.Tensor:
    """The same LM written in plain torch over [batch, length, ...] tensors."""
    b, t = ids.shape
    x = P["embed.table"][ids]
    if cfg.positions == "learned":
        x = x + P["decoder.pos.table"][:t]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(cfg.layers):
        p = f"decoder.blocks.{i}."
        h = _norm(x, P, p + "ln_attn", cfg)
        q, k, v = (torch.einsum("btd,dhk->bthk", h, P[p + f"attn.{w}.kernel"]) for w in "qkv")
        if cfg.positions == "rotary":
            q, k = _rope(q), _rope(k)
        s = torch.einsum("bthk,bshk->bhts", q, k) / math.sqrt(cfg.d_kv)
        a = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = torch.einsum("bhts,bshk->bthk", a, v)
        x = x + torch.einsum("bthk,hkd->btd", o, P[p + "attn.o.kernel"])
        h = _norm(x, P, p + "ln_ffn", cfg)
        x = x + ACT[cfg.activation](h @ P[p + "ffn.wi.kernel"]) @ P[p + "ffn.wo.kernel"]
    x = _norm(x, P, "decoder.ln_f", cfg)
    return x @ (P["embed.table"].T if cfg.tie_embeddings else P["head.kernel"])


def _params(model) -> dict[str, torch.Tensor]:
    return {n: v.to_global().detach() for n, v in model.named_mesh_parameters()}


@pytest.mark.parametrize("opts", [
    dict(positions="learned", tie_embeddings=True, norm="layer", activation="gelu"),
    dict(positions="rotary", tie_embeddings=False, norm="rms", activation="relu"),
])
def test_lm_matches_plain_torch_on_a_2x2_mesh(opts):
    cfg = TransformerConfig(**TINY, **opts)
    data = ids_batch(4, 6, cfg.vocab)

    def prog():
        model = DecoderLM(cfg, seed=3)
        ids = mt.from_global(data[:, :-1], "batch:4,length:6")
        tgt = mt.from_global(data[:, 1:], "batch:4,length:6")
        logits = model(ids)
        loss = model.loss(ids, tgt)
        loss.backward()
        grads = {n: v.grad.to_global() for n, v in model.named_mesh_parameters()}
        return logits.to_global().detach(), loss.item(), _params(model), grads

    outs = mt.launch(prog, mesh="b:2,m:2", rules="batch:b; heads:m; d_ff:m; vocab:m")
    logits, loss, P, grads = outs[0]
    ref_P = {n: t.clone().requires_grad_(True) for n, t in P.items()}
    ref = reference_logits(ref_P, cfg, data[:, :-1])
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, cfg.vocab), data[:, 1:].reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(logits, ref.detach(), atol=1e-5, rtol=1e-5)
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_P[n].grad, atol=1e-5, rtol=1e-4, msg=n)
    for rank, out in enumerate(outs[1:], 1):
        torch.testing.assert_close(out[0], logits, msg=f"processor {rank}")


def train_loop(cfg: TransformerConfig, batch_fn, steps: int = 10, model_cls=DecoderLM) -> list[float]:
    """This processor's losses of ``steps`` clipped AdamW steps from seed 1 (run inside a launch)."""
    model = model_cls(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        loss = batch_fn(model, step)
        opt.zero_grad()
        loss.backward()
        mt.optim.clip_grad_norm_(model, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def train_losses(cfg: TransformerConfig, mesh: str, rules: str, steps: int = 10, model_cls=DecoderLM,
                 batch_fn=None) -> list[float]:
    """Losses of ``steps`` AdamW steps on fixed random batches, from processor 0."""
    return mt.launch(train_loop, cfg, batch_fn, steps, model_cls, mesh=mesh, rules=rules)[0]


def lm_batch(cfg, batch=4, length=6):
    def fn(model, step):
        data = ids_batch(batch, length, cfg.vocab, seed=step % 2)
        ids = mt.from_global(data[:, :-1], f"batch:{batch},length:{length}")
        tgt = mt.from_global(data[:, 1:], f"batch:{batch},length:{length}")
        return model.loss(ids, tgt)
    return fn


LAYOUTS = [
    ("b:1", ""),
    ("b:2,m:2", "batch:b; heads:m; d_ff:m; vocab:m"),
    ("b:2,m:2,e:2", "batch:b; heads:m; d_ff:m; vocab:e; d_kv:e"),
]


def test_lm_training_is_layout_invariant():
    cfg = TransformerConfig(**TINY, positions="rotary")
    runs = {mesh: train_losses(cfg, mesh, rules, batch_fn=lm_batch(cfg)) for mesh, rules in LAYOUTS}
    base = runs["b:1"]
    assert base[-1] < base[0] - 0.2, f"10 steps should learn something: {base}"
    for mesh, losses in runs.items():
        assert losses == pytest.approx(base, rel=1e-4), mesh


def test_kv_cache_decoding_matches_recomputation_on_any_mesh():
    from meshtorch.models import generate

    cfg = TransformerConfig(**{**TINY, "max_length": 12}, positions="rotary")

    def prog():
        model = DecoderLM(cfg, seed=5)
        prompts = [[1, 2, 3], [4, 5, 6]]
        greedy = generate(model, prompts, 6)
        assert greedy == generate(model, prompts, 6, use_cache=False)
        sampled = generate(model, prompts, 6, temperature=1.0, top_k=4, seed=2)
        assert sampled == generate(model, prompts, 6, temperature=1.0, top_k=4, seed=2, use_cache=False)
        return greedy, sampled

    one = mt.launch(prog)[0]
    assert len(one[0][0]) == 6
    outs = mt.launch(prog, mesh="b:2,m:2", rules="batch:b; heads:m; vocab:m")
    assert all(o == one for o in outs)


def test_decoding_caches_the_requests_positions_not_max_length():
    """Seen (review16d): the KV cache held max_length positions whatever the request (a Llama 3.1's
    131072: 64 MiB a row for this toy and a write over all of them for each token). generate and
    beam_search size it to the prompt and its new tokens; the tokens are the plain-torch greedy
    reference's, also with the cache's positions split unevenly (memory_length 9 over 2)."""
    from meshtorch.models import beam_search, generate

    cfg = TransformerConfig(**{**TINY, "max_length": 4096}, positions="rotary")
    prompts, steps = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 6
    P = _params(DecoderLM(cfg, seed=5))
    seq = torch.tensor(prompts)
    for _ in range(steps):  # greedy decoding by full recomputation in plain torch
        seq = torch.cat([seq, reference_logits(P, cfg, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    want = seq[:, 3:].tolist()

    def prog():
        model = DecoderLM(cfg, seed=5)
        sizes, made = [], model.new_cache

        def new_cache(batch, dtype=torch.float32, length=None):
            cache = made(batch, dtype, length)
            sizes.append(cache.entries[0]["k"].shape["memory_length"].size)
            return cache

        model.new_cache = new_cache
        short = DecoderLM(TransformerConfig(**{**TINY, "max_length": 9}, positions="rotary"), seed=5)
        beams = beam_search(model, prompts, steps, beams=3)
        assert beams == beam_search(short, prompts, steps, beams=3)  # the same weights, 9 positions
        return generate(model, prompts, steps), beam_search(model, prompts, steps, beams=1), beams, sizes

    for mesh, rules in [("b:1", ""), ("b:3,m:2", "batch:b; memory_length:m; heads:m")]:
        for greedy, one_beam, _, sizes in mt.launch(prog, mesh=mesh, rules=rules):
            assert greedy == one_beam == want, mesh
            assert sizes == [3 + steps] * 3, sizes  # each decode of the model
