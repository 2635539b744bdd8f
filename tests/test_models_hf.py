"""Hugging Face in and out: Llama (rotary, RMSNorm, SwiGLU, grouped-query attention) and GPT-2.

The reference is transformers' own model: ``from_hf`` must give its logits and,
after one backward pass, its gradients, on any mesh; ``export_hf`` must write a
directory that ``AutoModelForCausalLM.from_pretrained`` loads with our logits.
Every model here is a small random one built locally (no downloads).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import meshtorch as mt
from mesh_harness import meshes, rules_for
from meshtorch.errors import CheckpointError
from meshtorch.models import DecoderLM, TransformerConfig, export_hf, from_hf, generate, hf_map

transformers = pytest.importorskip("transformers")

RULES = "batch:b; heads:m; d_ff:m; vocab:m"
# float32 rounding here is ~4e-7 (the rotary angles are float64 on our side, float32 on theirs)
TOL = 1e-5
BATCH, LENGTH, VOCAB = 4, 12, 96


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    # random init leaves norms at 1 and biases at 0: perturb every weight so that a norm or bias
    # loaded into the wrong place cannot go unnoticed
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def small_llama(seed: int = 0, **kw):
    opts = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
    opts.update(kw)
    torch.manual_seed(seed)
    return perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**opts)), seed + 1).eval()


def data(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    d = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    return d[:, :-1], d[:, 1:]


def named(x: torch.Tensor) -> mt.MeshTensor:
    return mt.from_global(x, f"batch:{x.shape[0]},length:{x.shape[1]}")


def hf_logits_and_grads(hf) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, tgt = data()
    hf.zero_grad()
    logits = hf(ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def ours(source, mesh: str, rules: str, **kw) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Our logits and gathered gradients, on every processor, for a model loaded by from_hf."""
    ids, tgt = data()

    def prog():
        model = from_hf(source, **kw).eval()
        logits = model(named(ids))
        model.loss(named(ids), named(tgt)).backward()
        return logits.to_global().detach(), {n: v.grad.to_global() for n, v in model.named_mesh_parameters()}

    return mt.launch(prog, mesh=mesh, rules=rules)


def check_against_hf(hf, source, mesh: str, rules: str) -> None:
    want, hf_grads = hf_logits_and_grads(hf)
    assert want.std().item() > 0.1  # the logits vary: the comparison is not vacuous

    def grads_as_ours():
        # HF's gradients, moved to our names by the loader under test; the logits check above
        # pins the name map down independently
        return {n: v.to_global() for n, v in from_hf(hf_grads, config=hf.config).named_mesh_parameters()}

    want_grads = mt.launch(grads_as_ours)[0]
    for rank, (logits, grads) in enumerate(ours(source, mesh, rules)):
        assert (logits - want).abs().max().item() < TOL, f"processor {rank}"
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=f"{name} on {rank}")


@pytest.mark.parametrize("mesh, rules", [("b:1", ""), ("b:2,m:2", RULES),
                                         ("m:2", "heads:m; kv_heads:m; d_ff:m"), ("b:2", "length:b")])
def test_llama_directory_logits_and_gradients_equal_transformers(tmp_path, mesh, rules):
    hf = small_llama()
    hf.save_pretrained(tmp_path)
    check_against_hf(hf, str(tmp_path), mesh, rules)


def test_llama_without_grouping_tied_with_biases_and_rope_theta():
    hf = small_llama(seed=3, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                     mlp_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    check_against_hf(hf, hf, "b:2,m:2", RULES)
    cfg = mt.launch(lambda: from_hf(hf).cfg)[0]
    assert (cfg.kv_heads, cfg.tie_embeddings, cfg.bias, cfg.rotary_base) == (0, True, True, 500.0)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data_=st.data())
def test_llama_on_drawn_meshes_and_rules(tmp_path_factory, data_):
    mesh = data_.draw(meshes(max_procs=4))
    rules = data_.draw(rules_for(mesh, ["batch", "length", "heads", "d_ff", "vocab", "d_model", "d_kv"]))
    path = tmp_path_factory.mktemp("llama")
    hf = small_llama()
    hf.save_pretrained(path)
    check_against_hf(hf, str(path), mesh, rules)


def test_sharded_checkpoint_each_processor_reads_only_its_slices(tmp_path, monkeypatch):
    hf = small_llama()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    read: dict[int, int] = {}
    plain = hf_map.Source.read

    def counting(self, key, region):
        t = plain(self, key, region)
        rank = mt.current().rank
        read[rank] = read.get(rank, 0) + t.numel()
        return t

    monkeypatch.setattr(hf_map.Source, "read", counting)
    ids, _ = data()

    def prog():
        model = from_hf(str(tmp_path)).eval()
        return model(named(ids)).to_global().detach(), sum(p.numel() for p in model.parameters())

    with torch.no_grad():
        want = hf(ids).logits
    outs = mt.launch(prog, mesh="b:2,m:2", rules=RULES)
    total = sum(p.numel() for p in hf.parameters())
    for rank, (logits, local) in enumerate(outs):
        assert (logits - want).abs().max().item() < TOL
        assert read[rank] == local < total  # exactly its slices, never a whole copy


def our_model(seed: int = 4, **kw) -> DecoderLM:
    cfg = TransformerConfig(vocab=VOCAB, d_model=32, heads=4, d_kv=8, d_ff=48, layers=2, max_length=32, **kw)
    return perturbed(DecoderLM(cfg, seed=seed), seed)


LLAMA_STYLE = dict(positions="rotary", norm="rms", activation="silu", gated=True, kv_heads=2,
                   tie_embeddings=False, eps=1e-5)
GPT2_STYLE = dict(bias=True, activation="gelu_tanh", tie_embeddings=True)


@pytest.mark.parametrize("style, kind", [(LLAMA_STYLE, "llama"), (GPT2_STYLE, "gpt2"),
                                         (dict(GPT2_STYLE, tie_embeddings=False, activation="gelu"), "gpt2")])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, style, kind):
    ids, _ = data()

    def prog():
        model = our_model(**style)
        export_hf(tmp_path, model)
        return model(named(ids)).to_global().detach()

    want = mt.launch(prog, mesh="b:2,m:2", rules=RULES)[0]
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == kind
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        got = hf(ids).logits
    assert want.std().item() > 0.1
    assert (got - want).abs().max().item() < TOL


def test_hf_to_ours_to_hf_is_bitwise_and_shards(tmp_path):
    hf = small_llama(seed=5)
    hf.save_pretrained(tmp_path / "in")

    def prog():
        export_hf(tmp_path / "out", from_hf(str(tmp_path / "in")), max_shard_bytes=30_000)

    mt.launch(prog, mesh="m:2", rules="heads:m; d_ff:m")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    written = {}
    for f in set(index["weight_map"].values()):
        written.update(load_file(tmp_path / "out" / f))
    original = hf.state_dict()
    assert written.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(written[k], v), k
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), original.values()))


def test_grouped_query_decoding_with_cache_equals_without():
    def prog():
        model = our_model(**LLAMA_STYLE)
        return generate(model, [[1, 2, 3], [4, 5, 6]], 5), generate(model, [[1, 2, 3], [4, 5, 6]], 5,
                                                                     use_cache=False)

    for cached, recomputed in mt.launch(prog, mesh="m:2", rules="heads:m; kv_heads:m"):
        assert cached == recomputed and len(cached[0]) == 5


def test_default_models_keep_their_parameters():
    cfg = TransformerConfig(vocab=16, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)
    model = DecoderLM(cfg)
    shapes = {n: v.shape.names for n, v in model.named_mesh_parameters()}
    assert shapes["decoder.blocks.0.attn.k.kernel"] == ("d_model", "heads", "d_kv")
    assert not any(".wg." in n for n in shapes)


def test_what_cannot_be_expressed_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="rope_type='dynamic' is not supported"):
        from_hf(small_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(CheckpointError, match="mlp_bias"):
        from_hf(small_llama(attention_bias=True))
    with pytest.raises(CheckpointError, match="pass config="):
        from_hf(small_llama().state_dict())
    with pytest.raises(CheckpointError, match=r"not gpt2: .*norm='rms'.*not llama: .*positions='learned'"):
        mt.launch(lambda: export_hf(tmp_path, our_model(norm="rms")))
    bad_split = r"'kv_heads' \(num_key_value_heads=2\).*rule 'kv_heads:m'"
    with pytest.raises(mt.MeshTorchError, match=bad_split):
        mt.launch(lambda: from_hf(small_llama()), mesh="m:4", rules="kv_heads:m")


def _trained_config(flags: list[str]) -> TransformerConfig:
    """The TransformerConfig a ``meshtorch train`` run of ``flags`` trains (its own parser)."""
    import argparse

    from meshtorch.recipes.lm.flags import add_train_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    cfg = config_from_args(parser.parse_args([f for flag in flags for f in flag.split(" ", 1)]))
    return cfg.model.config(vocab=VOCAB, length=cfg.run.length)


def test_export_of_a_default_run_names_the_train_flags_that_make_an_architecture(tmp_path):
    """Seen: `meshtorch export` of a default-shaped run listed the fields that fit no architecture
    but not the `meshtorch train` flags that would make one."""
    cfg = _trained_config([])
    want = (r"not gpt2: bias=False .*; a meshtorch train run with --bias for a gpt2 or --positions rotary "
            r"--norm rms --gated for a llama makes one")
    with pytest.raises(CheckpointError, match=want):
        mt.launch(lambda: export_hf(tmp_path, DecoderLM(cfg)))


@given(model=st.sampled_from(["lm", "moe", "seq2seq"]), positions=st.sampled_from(["learned", "rotary"]),
       norm=st.sampled_from(["layer", "rms"]), bias=st.booleans(), gated=st.booleans(),
       kv_heads=st.sampled_from([0, 1, 2]), d_kv=st.sampled_from([8, 16]))
@settings(max_examples=25, deadline=None)
def test_the_named_train_flags_make_the_architecture(model, positions, norm, bias, gated, kv_heads, d_kv):
    # drawn runs' flags plus the flags the error names: the config trained has no misfit left
    assume(not (model == "moe" and gated))  # MoE experts are not gated: no such run
    flags = [f"--model {model}", f"--positions {positions}", f"--norm {norm}",
             "--bias" if bias else "--no-bias", "--gated" if gated else "--no-gated",
             f"--kv-heads {kv_heads}", "--heads 4", f"--d-kv {d_kv}", "--d-model 32"]
    cfg = _trained_config(flags)
    from meshtorch.models import hf as hf_export

    for arch in hf_export.ARCHITECTURES.values():
        named = hf_export.train_flags(cfg, arch)
        assert (named == []) == (arch.misfits(cfg) == [])
        assert arch.misfits(_trained_config(flags + named)) == [], (arch.MODEL_TYPE, named)
