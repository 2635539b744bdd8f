"""Llama rope scaling (``rope_type`` ``llama3``, as every Llama 3.1 / 3.2 / 3.3 has, and ``linear``)
through ``from_hf``, the model, ``export_hf``, ``meshtorch train --init-from`` and ``meshtorch plan
--init-from``, against transformers itself (its rotary frequencies, logits, loss and gradients).

Before: ``from_hf`` refused every scaled config, so no Llama 3.1+ could be fine-tuned. ``dynamic`` and
``yarn`` (which depend on the sequence length or scale attention) are still refused, by name. Models
are tiny and random.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import meshtorch as mt
from meshtorch import cli
from meshtorch.errors import ArgumentError, CheckpointError
from meshtorch.models import TransformerConfig, export_hf, from_hf, llama
from meshtorch.models.rope import inverse_frequencies
from run_harness import write_corpus
from test_models_hf import data, hf_logits_and_grads, named, small_llama

transformers = pytest.importorskip("transformers")

# head_dim 8 at rope_theta 10: wavelengths 6.3, 11.2, 19.9, 35.3 against original / high_freq_factor
# = 8 and original / low_freq_factor = 32, so one frequency is kept, two blended and one divided
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}
KINDS = {"llama3": LLAMA3, "linear": LINEAR}


def scaled_llama(kind: str, **kw):
    return small_llama(rope_parameters=dict(KINDS[kind]), max_position_embeddings=64, **kw)


def ours_of(rope: dict) -> dict:
    return {k: v for k, v in rope.items() if k != "rope_theta"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_inverse_frequencies_equal_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = scaled_llama(kind)
    want, attention_scale = ROPE_INIT_FUNCTIONS[kind](hf.config, "cpu")
    assert attention_scale == 1.0  # both only change the frequencies
    got = inverse_frequencies(8, KINDS[kind]["rope_theta"], ours_of(KINDS[kind]))
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    plain = inverse_frequencies(8, KINDS[kind]["rope_theta"])
    ratio = (plain / got).tolist()
    if kind == "llama3":  # kept, blended, blended, divided by factor
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < ratio[2] < 8.0 and ratio[3] == pytest.approx(8.0)
    else:
        assert ratio == pytest.approx([4.0] * 4)


@pytest.mark.parametrize("both", [1.0, 2.0, 4.0])
def test_equal_low_and_high_freq_factors_load_as_transformers_computes_them(both):
    """Seen (review16d): low_freq_factor == high_freq_factor was refused ('the blend divides by their
    difference'), though transformers loads such a config (it only warns): no band is blended, each
    frequency is kept or divided by factor. Logits as transformers' too."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**LLAMA3, "low_freq_factor": both, "high_freq_factor": both}
    hf = small_llama(rope_parameters=dict(rope), max_position_embeddings=64)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    got = inverse_frequencies(8, rope["rope_theta"], ours_of(rope))
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    ratio = (inverse_frequencies(8, rope["rope_theta"]) / got).tolist()
    assert {round(r, 6) for r in ratio} == {1.0, 8.0}, ratio  # kept or divided, none blended
    ids = data()[0]
    with torch.no_grad():
        logits = hf(ids).logits
    got_logits = mt.launch(lambda: from_hf(hf).eval()(named(ids)).to_global(), mesh="m:2", rules="heads:m")
    assert all((g - logits).abs().max().item() < 1e-5 for g in got_logits)


@pytest.mark.parametrize("mesh, rules", [("b:1", ""), ("b:2,m:2", "length:b; heads:m; kv_heads:m")],
                         ids=["one", "ring+heads"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_loss_and_gradients_equal_transformers(kind, mesh, rules):
    hf = scaled_llama(kind)
    want, hf_grads = hf_logits_and_grads(hf)
    ids, tgt = data()
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, want.shape[-1]), tgt.reshape(-1)).item()
    with torch.no_grad():  # the same weights without the scaling: the scaling is not a no-op here
        plain = small_llama(rope_parameters={"rope_type": "default", "rope_theta": KINDS[kind]["rope_theta"]},
                            max_position_embeddings=64)(ids).logits
    assert (plain - want).abs().max().item() > 1e-2

    def prog():
        model = from_hf(hf).eval()
        ring = model.decoder.uses_ring(named(ids))
        logits = model(named(ids)).to_global()
        loss = model.loss(named(ids), named(tgt))
        loss.backward()
        return ring, logits, loss.item(), {n: v.grad.to_global() for n, v in model.named_mesh_parameters()}

    def grads_as_ours():
        return {n: v.to_global() for n, v in from_hf(hf_grads, config=hf.config).named_mesh_parameters()}

    want_grads = mt.launch(grads_as_ours)[0]
    for ring, logits, loss, grads in mt.launch(prog, mesh=mesh, rules=rules):
        assert ring == ("length" in rules)  # the length-split layout runs ring attention
        assert (logits - want).abs().max().item() < 1e-5
        assert loss == pytest.approx(want_loss, abs=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_export_round_trip(tmp_path, kind):
    hf = scaled_llama(kind)
    ids = data()[0]

    def prog():
        model = from_hf(hf)
        export_hf(tmp_path, model)
        return model.cfg.rope_scaling, from_hf(str(tmp_path)).cfg.rope_scaling

    mine, back = mt.launch(prog, mesh="m:2", rules="heads:m")[0]
    assert mine == back == ours_of(KINDS[kind])
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.rope_parameters == hf.config.rope_parameters
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


def test_configs_as_transformers_4_wrote_them():
    """transformers 4.x: ``rope_scaling`` (the older ``"type"`` key too) beside a top-level ``rope_theta``;
    a llama3 scaling without ``original_max_position_embeddings`` takes max_position_embeddings, as
    transformers does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
            "rope_theta": 10.0}
    old = llama.config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (old.rotary_base, old.rope_scaling) == (10.0, {"rope_type": "linear", "factor": 4.0})
    short = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = llama.config_from_hf({**base, "rope_scaling": short})
    assert cfg.rope_scaling == {**short, "original_max_position_embeddings": 64}
    theirs = transformers.LlamaConfig(**{**base, "rope_scaling": dict(short)})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")
    got = inverse_frequencies(8, 10.0, cfg.rope_scaling).float()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_what_is_not_supported_is_named():
    supported = "supported: 'linear', 'llama3', or no scaling"
    for kind in ("dynamic", "yarn"):
        with pytest.raises(CheckpointError, match=f"rope_type='{kind}' is not supported .*{supported}"):
            from_hf(small_llama(rope_parameters={"rope_type": kind, "factor": 2.0, "rope_theta": 1e4}))
    bad = {**LLAMA3, "low_freq_factor": 5.0}
    with pytest.raises(CheckpointError, match=r"high_freq_factor=4.0 must be at least low_freq_factor=5.0"):
        llama.config_from_hf({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                              "num_hidden_layers": 1, "num_attention_heads": 4, "rope_parameters": bad})
    rotary = dict(d_model=8, heads=2, d_kv=4, positions="rotary")
    with pytest.raises(ArgumentError, match=r"'linear' takes exactly \['factor'\]; unknown \['x'\]"):
        TransformerConfig(**rotary, rope_scaling={"rope_type": "linear", "factor": 2.0, "x": 1})
    with pytest.raises(ArgumentError, match="factor=0 must be a finite number > 0"):
        TransformerConfig(**rotary, rope_scaling={"rope_type": "linear", "factor": 0})
    with pytest.raises(mt.MeshTorchError, match="rescales rotary positions, but positions='learned'"):
        TransformerConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})


def test_fine_tune_plan_and_export_keep_the_scaling(tmp_path, capsys):
    """``meshtorch train --init-from`` a Llama 3.1-style model: its first loss is transformers' on the
    same window (the scaled frequencies train), the checkpoint keeps the scaling, ``meshtorch export``
    writes it back, and ``meshtorch plan --init-from`` plans it (a contradicting flag refused)."""
    from meshtorch.data import ByteTokenizer, Corpus, LMBatches
    from meshtorch.recipes.lm.generate import checkpoint_dir, model_config

    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", files=4)
    hf = scaled_llama("llama3", vocab_size=304, num_hidden_layers=1)
    hf.save_pretrained(tmp_path / "llama")
    out, export = str(tmp_path / "run"), str(tmp_path / "export")
    run = ["--init-from", str(tmp_path / "llama"), "--data", corpus, "--batch", "2", "--length", "16",
           "--log-every", "1", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    assert cli.main(["train", "--steps", "2", "--out", out, *run]) == 0
    text = Corpus.from_path(corpus, tokenizer=ByteTokenizer())
    ids, tgt = mt.launch(lambda: [t.to_global() for t in LMBatches(text.train, 2, 16).at(0)])[0]
    with torch.no_grad():
        want = hf(ids).logits
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, 304), tgt.reshape(-1)).item()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert json.loads(f.readline())["loss"] == pytest.approx(want_loss, abs=2e-5)
    assert model_config(checkpoint_dir(out))[1].rope_scaling == ours_of(LLAMA3)  # what generate builds
    assert cli.main(["export", "--checkpoint", out, "--out", export]) == 0
    written = json.loads(open(os.path.join(export, "config.json")).read())
    assert written["rope_parameters"] == LLAMA3
    capsys.readouterr()

    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    plan = ["plan", "--init-from", str(tmp_path / "config_only"), "--batch", "2", "--length", "16", "--json"]
    assert cli.main(plan) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == sum(p.numel() for p in hf.parameters())
    assert cli.main([*plan, "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}']) == 2
    assert "--rope-scaling {'rope_type': 'linear', 'factor': 2.0} conflicts with --init-from" in \
        capsys.readouterr().err


def test_the_flag_trains_a_model_from_scratch_with_a_scaling(capsys):
    from meshtorch.recipes.lm.config import TrainConfig, check_config

    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = TrainConfig.of(positions="rotary", rope_scaling=scaling)
    assert cfg.model_config(264).rope_scaling == scaling
    with pytest.raises(ArgumentError, match="--rope-scaling rescales rotary positions, but --positions is"):
        check_config(TrainConfig.of(rope_scaling=scaling))
    with pytest.raises(ArgumentError, match="--rope-scaling rope_type='yarn' is not supported"):
        TrainConfig.of(positions="rotary", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert cli.main(["plan", "--positions", "rotary", "--rope-scaling", "linear"]) == 2
    assert "argument --rope-scaling: not JSON" in capsys.readouterr().err
