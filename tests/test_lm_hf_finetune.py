"""``meshtorch train --init-from DIR --tokenizer DIR`` and ``meshtorch export``, against transformers.

The references are independent of meshtorch: transformers' own loss on the same
batch, one step of transformers + ``torch.optim.AdamW`` (with torch's gradient
clipping), and the ``tokenizers`` library's own encoding. Every model and
tokenizer is tiny, random and built here (no downloads).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from meshtorch import cli
from meshtorch.data import Corpus, LMBatches
from meshtorch.data.corpus import DataError
from meshtorch.errors import ArgumentError
from run_harness import write_corpus

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB, BATCH, LENGTH, LR = 304, 4, 16, 1e-3
EOS = "<|endoftext|>"
RUN = ["--batch", str(BATCH), "--length", str(LENGTH), "--lr", str(LR), "--warmup", "0", "--lr-schedule",
       "constant", "--log-every", "1", "--eval-batches", "1", "--sample-tokens", "8", "--no-progress"]


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    # norms at 1 and biases at 0 would let a misplaced norm or bias pass unnoticed
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A corpus, a byte-level BPE trained on it, and a tiny random Llama and GPT-2 saved as HF dirs."""
    root = tmp_path_factory.mktemp("hf")
    (root / "corpus").mkdir()
    text = write_corpus(root / "corpus", files=12)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(sorted(str(p) for p in (root / "corpus").iterdir()), trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(root / "tok")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    perturbed(llama).save_pretrained(root / "llama")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    perturbed(gpt2).save_pretrained(root / "gpt2")
    return {"corpus": text, "tok": str(root / "tok"), "llama": str(root / "llama"),
            "gpt2": str(root / "gpt2"), "bpe": tok}


def first_window(files) -> torch.Tensor:
    """The ``[batch, length + 1]`` token window of step 0, as the run reads it (seed 0)."""
    import meshtorch as mt
    from meshtorch.data.hf_tokenizer import HFTokenizer

    corpus = Corpus.from_path(files["corpus"], tokenizer=HFTokenizer(files["tok"]))
    ids, tgt = mt.launch(lambda: [t.to_global() for t in LMBatches(corpus.train, BATCH, LENGTH).at(0)])[0]
    return torch.cat([ids, tgt[:, -1:]], dim=1)


def hf_step(path: str, window: torch.Tensor, weight_decay: float) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' loss on ``window`` and its weights after one AdamW step (clipped at norm 1)."""
    # eval(): GPT-2's config asks for dropout 0.1, the run's --dropout is 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    loss = hf(input_ids=window, labels=window).loss  # transformers shifts the labels itself
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    params = dict(hf.named_parameters())
    groups = [{"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99)).step()
    return loss.item(), {k: v.detach() for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("arch, mesh, rules, wd, backend", [
    ("llama", "b:1", "", 0.01, "threads"),
    ("llama", "m:2", "heads:m; kv_heads:m; d_ff:m; vocab:m", 0.01, "threads"),
    # one process per processor (gloo): each reads its own slices of the safetensors file
    ("llama", "b:2", "batch:b; d_ff:b", 0.01, "torch"),
    # GPT-2's attention biases are [heads, d_kv] matrices here, spared like transformers' vectors
    ("gpt2", "b:2", "batch:b", 0.01, "threads"),
])
def test_fine_tune_step_equals_transformers_and_exports(files, tmp_path, capsys, arch, mesh, rules, wd,
                                                        backend):
    out, export = str(tmp_path / "run"), str(tmp_path / "export")
    flags = ["--init-from", files[arch], "--tokenizer", files["tok"], "--data", files["corpus"],
             "--mesh", mesh, "--rules", rules, "--weight-decay", str(wd), "--backend", backend,
             "--timeout", "60", *RUN]
    assert cli.main(["train", "--steps", "1", "--out", out, *flags]) == 0
    capsys.readouterr()
    want_loss, want = hf_step(files[arch], first_window(files), wd)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        got_loss = json.loads(f.readline())["loss"]
    assert got_loss == pytest.approx(want_loss, abs=2e-5)  # metrics round to 5 decimals
    assert want_loss > 1.0  # a real loss, not a vacuous comparison

    assert cli.main(["export", "--checkpoint", out, "--out", export]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    got = load_file(os.path.join(export, "model.safetensors"))
    start = load_file(os.path.join(files[arch], "model.safetensors"))
    moved = 0
    for key, w in got.items():
        ref = want[key] if key in want else want["lm_head.weight"]
        # one AdamW step moves each weight by about LR. Its first step is LR·g/(|g| + 1e-8): where a
        # gradient is near 1e-8, float rounding of g moves the update by a fraction of LR, so a few
        # elements may differ by up to LR/10; all the others agree to float rounding
        d = (w - ref).abs()
        if key.endswith("c_attn.bias"):
            # the key bias adds one constant to a query's scores, which softmax ignores: its true
            # gradient is 0, so Adam's step on it is g/|g| of rounding noise, on either side
            d = torch.cat([d[:32], d[64:]])
        assert d.max() < LR / 10 and (d > 1e-6).sum() <= max(1, d.numel() // 1000), (key, d.max())
        moved += int((start[key] - w).abs().max() > LR / 2) if key in start else 0
    assert moved > len(got) // 2  # the weights did take a step
    back = transformers.AutoModelForCausalLM.from_pretrained(export)  # transformers reads the export
    assert back.config.model_type == arch
    assert transformers.AutoTokenizer.from_pretrained(export).eos_token == EOS


def test_resume_continues_a_fine_tune_exactly(files, tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    flags = ["--init-from", files["llama"], "--tokenizer", files["tok"], "--data", files["corpus"], *RUN]
    assert cli.main(["train", "--steps", "4", "--out", a, *flags]) == 0
    assert cli.main(["train", "--steps", "2", "--out", b, *flags]) == 0
    assert cli.main(["train", "--steps", "4", "--resume", b, *flags]) == 0
    capsys.readouterr()
    losses = [[json.loads(line)["loss"] for line in open(os.path.join(d, "metrics.jsonl"))] for d in (a, b)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and len(losses[0]) == 4
    assert cli.main(["generate", "--checkpoint", b, "--prompt", "def f", "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def f")


def test_corpus_ids_are_the_tokenizers_own_encoding(files):
    from meshtorch.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(files["tok"])
    corpus = Corpus.from_path(files["corpus"], tokenizer=tok)
    bpe, eos = files["bpe"], files["bpe"].token_to_id(EOS)
    texts = {f: open(os.path.join(files["corpus"], f)).read() for f in sorted(os.listdir(files["corpus"]))}
    streams = {f: bpe.encode(t).ids + [eos] for f, t in texts.items()}
    both = sorted(np.concatenate([corpus.train, corpus.heldout]).tolist())
    assert both == sorted(i for s in streams.values() for i in s)  # every file, nothing else
    assert tok.eos == eos and tok.sample_limit == bpe.get_vocab_size() and tok.vocab_size == VOCAB
    assert any(corpus.train[: len(s)].tolist() == s for s in streams.values())  # the first file, in order
    assert tok.decode(tok.encode("def f0_1(x):")) == "def f0_1(x):"


@pytest.mark.parametrize("flags, needle", [
    (["--heads", "8"], "--heads 8 conflicts with --init-from"),
    (["--layers", "3"], "num_hidden_layers -> layers=2"),
    (["--model", "moe"], "--init-from loads a decoder-only LM"),
])
def test_flags_that_contradict_the_config_are_named(files, flags, needle, capsys):
    assert cli.main(["train", "--init-from", files["llama"], "--steps", "1", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_tokenizer_and_length_must_fit_the_model(files, tmp_path):
    from meshtorch.recipes.lm import TrainConfig, train

    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ArgumentError, match="has 300 ids but --init-from .* has vocab_size=128"):
        train(TrainConfig.of(init_from=str(tmp_path / "small"), tokenizer=files["tok"], steps=1))
    with pytest.raises(ArgumentError, match="--length 64 is longer than the 32 positions .*n_positions=32"):
        train(TrainConfig.of(init_from=files["gpt2"], tokenizer=files["tok"], steps=1, length=64))
    with pytest.raises(DataError, match="no end-of-text token"):
        bare = tokenizers.Tokenizer(tokenizers.models.BPE())
        os.makedirs(tmp_path / "bare")
        bare.save(str(tmp_path / "bare" / "tokenizer.json"))
        train(TrainConfig.of(tokenizer=str(tmp_path / "bare"), steps=1))


def test_fitted_tokenizer_options_are_checked(files, tmp_path):
    from meshtorch.recipes.lm import TrainConfig, train

    with pytest.raises(ArgumentError, match="'bpe:12': give the BPE's number of ids, at least 260"):
        train(TrainConfig.of(tokenizer="bpe:12", data=files["corpus"], steps=1, out=str(tmp_path / "a")))
    with pytest.raises(ArgumentError, match="--model seq2seq spells numbers in bytes"):
        train(TrainConfig.of(model="seq2seq", tokenizer=files["tok"], steps=1, out=str(tmp_path / "b")))


def test_auto_tokenizer_picks(files, tmp_path, monkeypatch):
    import sys

    from meshtorch.recipes.lm import TrainConfig
    from meshtorch.recipes.lm.pretrained import resolve_tokenizer

    out = str(tmp_path / "run")
    assert resolve_tokenizer(TrainConfig.of(init_from=files["llama"]), out).run.tokenizer == "bytes"
    exported = str(tmp_path / "with_tok")
    transformers.AutoModelForCausalLM.from_pretrained(files["llama"]).save_pretrained(exported)
    transformers.AutoTokenizer.from_pretrained(files["tok"]).save_pretrained(exported)
    # the model's own tokenizer, kept in the run: a copy that tokenizes alike
    from meshtorch.recipes.lm.run_files import tokenizer_digest

    kept = resolve_tokenizer(TrainConfig.of(init_from=exported), out).run.tokenizer
    assert kept == os.path.join(os.path.abspath(out), "tokenizer")
    assert tokenizer_digest(kept) == tokenizer_digest(exported)
    assert resolve_tokenizer(TrainConfig.of(model="seq2seq"), out).run.tokenizer == "bytes"
    fitted = resolve_tokenizer(TrainConfig.of(data=files["corpus"]), out).run.tokenizer
    assert fitted == os.path.join(os.path.abspath(out), "tokenizer")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed: bytes
    assert resolve_tokenizer(TrainConfig.of(data=files["corpus"]), out).run.tokenizer == "bytes"
