"""Hugging Face in and out as users drive it, against transformers itself (the reference).

What tests/test_models_hf.py, test_models_gpt2.py and test_lm_hf_finetune.py leave out: key/value
heads split over another axis than the query heads, our greedy and beam decoding against
transformers' ``generate``, the token ids of the config (``bos/eos/pad_token_id``) through
``from_hf`` -> ``export_hf`` and ``meshtorch train --init-from`` -> ``meshtorch export``, and
what a user may get wrong (``heads=`` against a config, a bare ``LlamaModel``, ``--length`` past
``max_position_embeddings``), each an error naming the field. Models are tiny and random.
"""

from __future__ import annotations

import json

import pytest
import torch

import meshtorch as mt
from meshtorch import cli
from meshtorch.errors import ArgumentError, CheckpointError
from meshtorch.models import beam_search, export_hf, from_hf, generate
from meshtorch.models.decode import until_eos
from run_harness import write_corpus
from test_models_hf import check_against_hf, data, small_llama

transformers = pytest.importorskip("transformers")


def small_gpt2(**kw):
    opts = dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=5, eos_token_id=6)
    opts.update(kw)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**opts)).eval()


def named(x: torch.Tensor) -> mt.MeshTensor:
    return mt.from_global(x, f"batch:{x.shape[0]},length:{x.shape[1]}")


def test_key_value_heads_split_over_another_axis_than_the_query_heads():
    # the drawn rules of test_models_hf never split kv_heads; here queries go over one axis,
    # keys and values over the other
    check_against_hf(small_llama(num_key_value_heads=2), small_llama(num_key_value_heads=2), "a:2,b:2",
                     "heads:a; kv_heads:b; batch:b")


def test_greedy_and_beam_decoding_equal_transformers_generate():
    hf = small_llama(num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    prompts = torch.randint(0, hf.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # every prompt token attended (an id equal to pad_token_id would otherwise count as padding)
        kw = dict(attention_mask=torch.ones_like(prompts), do_sample=False, eos_token_id=None, pad_token_id=0)
        greedy = hf.generate(prompts, max_new_tokens=12, **kw)[:, 5:].tolist()
        beams = hf.generate(prompts, max_new_tokens=6, num_beams=3, length_penalty=0.0, **kw)[:, 5:].tolist()

    def prog():
        model = from_hf(hf)
        # ignore_eos: transformers' generate above was told eos_token_id=None
        return (generate(model, prompts.tolist(), 12, ignore_eos=True),
                beam_search(model, prompts.tolist(), 6, beams=3, ignore_eos=True))

    for got_greedy, got_beams in mt.launch(prog, mesh="a:2,b:2", rules="heads:a; d_ff:a; batch:b; d_model:b"):
        assert got_greedy == greedy and got_beams == beams


@pytest.mark.parametrize("seed,lengths", [(5, [4, 1, 3]), (3, [1, 1, 8])], ids=["all-end", "one-runs-on"])
def test_beam_search_ends_at_the_configs_eos_as_transformers_generate(seed, lengths):
    """Seen: beam_search ran all its tokens past the config's eos_token_id (a hypothesis went on after
    its eos), where transformers' generate(num_beams=) keeps a hypothesis that ends, scored by its
    mean log-probability (length_penalty 1.0), and stops once no running one may beat those kept.
    Transformers' defaults; two eos ids made likely, so the rows end at different steps (or, with
    `one-runs-on`, one at the last: the whole row); the scores are its sequences_scores."""
    hf = small_llama(num_key_value_heads=1, eos_token_id=[7, 11], pad_token_id=3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for e in (7, 11):
            hf.lm_head.weight[e] += 0.2 * torch.randn(hf.lm_head.weight.shape[1], generator=g)
    prompts = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=8,
                          num_beams=3, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[:, 5:].tolist()
    assert [len(until_eos(row, [7, 11])) for row in want] == lengths

    def prog():
        model = from_hf(hf)
        return beam_search(model, prompts.tolist(), 8, beams=3, return_scores=True)

    for seqs, scores in mt.launch(prog, mesh="a:2,b:2", rules="heads:a; vocab:a; batch:b"):
        assert seqs == want
        torch.testing.assert_close(torch.tensor(scores, dtype=torch.float32), out.sequences_scores,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad", [3, None], ids=["pad_token_id", "no-pad"])
def test_generation_stops_at_the_configs_eos_as_transformers_generate(pad):
    """Seen: generate ran max_new_tokens past the model's eos_token_id, where transformers' generate
    ends each sequence at its eos (finished rows get pad_token_id, else the first eos id) and stops
    once all have ended."""
    hf = small_llama(num_key_value_heads=1)
    prompts = torch.randint(0, hf.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=12)
    with torch.no_grad():
        full = hf.generate(prompts, eos_token_id=None, pad_token_id=0, **kw)[:, 5:].tolist()
    # a list of eos ids, as Llama 3 has: each row meets one, at different steps
    eos = [full[0][2], full[1][6], full[2][1]]
    hf.config.eos_token_id, hf.config.pad_token_id = eos, pad
    hf.generation_config.eos_token_id = eos  # (what generate stops at: generation_config.json's)
    with torch.no_grad():
        want = hf.generate(prompts, eos_token_id=eos, pad_token_id=eos[0] if pad is None else pad,
                           **kw)[:, 5:].tolist()
    assert len(want[0]) < 12 and any(len(until_eos(row, eos)) < len(row) for row in want)  # rows padded

    def prog():
        model = from_hf(hf)
        rows = prompts.tolist()
        # sampled: the same draws as without eos, up to each row's eos
        free = generate(model, rows, 12, temperature=1.0, seed=3, ignore_eos=True)
        stops = [free[0][4], free[1][2], free[2][7]]
        sampled = generate(model, rows, 12, temperature=1.0, seed=3, eos=stops)
        return generate(model, rows, 12), generate(model, rows, 12, ignore_eos=True), free, stops, sampled

    for greedy, ignoring, free, stops, sampled in mt.launch(prog, mesh="b:2", rules="batch:b; heads:b"):
        assert greedy == want and ignoring == full
        n, filler = max(len(until_eos(row, stops)) for row in free), stops[0] if pad is None else pad
        assert sampled == [until_eos(row, stops) + [filler] * (n - len(until_eos(row, stops)))
                           for row in free] and n < 12


@pytest.mark.parametrize("pad", [-1, 96], ids=["legacy-minus-one", "past-the-vocab"])
def test_a_pad_token_id_outside_the_vocab_pads_with_the_eos(pad):
    """Seen (review16d): a config's pad_token_id=-1 (a legacy LLaMA's; from_hf takes it) went back into
    the model as the next input of a finished row: 'embedding: ids hold -1' as soon as one row ended
    before the others. A pad that is no id of the vocabulary pads with the first eos id, as without
    a pad_token_id; the other rows go on as without eos."""
    hf = small_llama(num_key_value_heads=1, pad_token_id=-1)  # (transformers refuses a Llama's 96)
    prompts = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(2)).tolist()

    def prog(eos_at):
        model = from_hf(hf)
        free = generate(model, prompts, 10, ignore_eos=True)
        if eos_at is None:
            return free
        ids = model.cfg.extra["hf_config"]
        ids["eos_token_id"], ids["pad_token_id"] = [free[r][i] for r, i in eos_at], pad
        return generate(model, prompts, 10)

    free = mt.launch(prog, None)[0]
    # an eos each row meets at a different step (the first whose id the rows before never emitted)
    eos_at = [(0, 1), (2, 4)]
    eos = [free[r][i] for r, i in eos_at]
    cut = [until_eos(row, eos) for row in free]
    assert 1 < len({len(c) for c in cut}), cut  # one row ends before another
    want = [c + [eos[0]] * (max(map(len, cut)) - len(c)) for c in cut]
    for mesh, rules in [("b:1", ""), ("b:2", "batch:b; vocab:b")]:
        assert all(got == want for got in mt.launch(prog, eos_at, mesh=mesh, rules=rules)), mesh


def test_generate_names_eos_for_the_stop_it_no_longer_takes():
    hf = small_llama(num_key_value_heads=1)
    with pytest.raises(ArgumentError, match=r"generate\(stop=3\) is gone: pass eos=3.*pads it"):
        generate(from_hf(hf), [[1, 2]], 4, stop=3)


@pytest.mark.parametrize("tokenizer", ["init-from", "bytes"])
def test_meshtorch_generate_stops_at_eos_unless_told_to_ignore_it(tmp_path, capsys, monkeypatch, tokenizer):
    """A fine-tune with --init-from's own tokenizer stops at its config.json's eos_token_id; one with
    another tokenizer (here bytes: the directory has no tokenizer.json) at that tokenizer's end of
    text. Seen (review16d): it stopped at config.json's id, another vocabulary's (a byte here).
    --beams stops there too (it ran all --tokens)."""
    from meshtorch.data import ByteTokenizer
    from meshtorch.data.hf_tokenizer import train_bpe
    from meshtorch.recipes.lm.generate import prompt_ids

    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", files=4)
    hf = small_llama(vocab_size=304, num_hidden_layers=1)
    if tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        texts = [f.read_text() for f in sorted((tmp_path / "corpus").iterdir())]
        tok = train_bpe(texts, 300, tmp_path / "llama")
    ids = prompt_ids(tok, "def f")

    def greedy():  # the greedy continuation, over the ids the tokenizer may emit
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0, suppress_tokens=list(range(tok.sample_limit, 304)),
                              attention_mask=torch.ones(1, len(ids), dtype=torch.int64))
        return out[0, len(ids):].tolist()

    full = greedy()
    if tokenizer == "bytes":  # the byte tokenizer's end of text made likely: the model emits it
        with torch.no_grad():
            hf.lm_head.weight[tok.eos] = hf.lm_head.weight[full[4]] * 1.5
        full = greedy()
        k = full.index(tok.eos)
        # config.json's id (and generation_config.json's): a byte before the end of text
        hf.config.eos_token_id = hf.generation_config.eos_token_id = full[0]
        assert 0 < k < 7 and full[0] != tok.eos
    else:
        k = full.index(full[3])
        hf.config.eos_token_id = hf.generation_config.eos_token_id = full[3]
        assert full[3] != tok.eos
    hf.save_pretrained(tmp_path / "llama")
    # a step at lr 1e-12 moves no float32 weight: the checkpoint is transformers' model, with its eos
    assert cli.main(["train", "--init-from", str(tmp_path / "llama"), "--data", str(tmp_path / "corpus"),
                     "--steps", "1", "--lr", "1e-12", "--batch", "2", "--length", "16", "--eval-batches", "1",
                     "--sample-tokens", "8", "--temperature", "0", "--prompt", "def f", "--no-progress",
                     "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    # the run's own sample, and meshtorch generate's, stop at the eos
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sample"] == tok.decode(ids + full[:k + 1]), summary["sample"]
    run = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def f", "--temperature", "0",
           "--tokens", "8"]
    assert cli.main(run) == 0
    assert capsys.readouterr().out == tok.decode(ids + full[:k + 1]) + "\n"
    assert cli.main([*run, "--ignore-eos"]) == 0
    assert capsys.readouterr().out == tok.decode(ids + full) + "\n" != tok.decode(ids + full[:k + 1]) + "\n"
    # one beam is greedy decoding, up to the same eos (it ran all --tokens before)
    assert cli.main([*run, "--beams", "1"]) == 0
    assert capsys.readouterr().out == tok.decode(ids + full[:k + 1]) + "\n"
    assert cli.main([*run, "--beams", "1", "--ignore-eos"]) == 0
    assert capsys.readouterr().out == tok.decode(ids + full) + "\n"
    # a checkpoint from before the run recorded whose tokenizer it has: told by comparing the tokenizers
    from meshtorch.recipes.lm import generate as recipe

    ckpt, want = recipe.checkpoint_dir(str(tmp_path / "run")), [tok.eos] if tokenizer == "bytes" else None
    assert recipe.run_eos(ckpt, None, tok) == want
    real = recipe.checkpoint_extra

    def older(path):
        extra = real(path)
        return {**extra, "tokenizer": {k: v for k, v in extra["tokenizer"].items() if k != "init_from"}}

    monkeypatch.setattr(recipe, "checkpoint_extra", older)
    assert "init_from" not in recipe.checkpoint_extra(ckpt)["tokenizer"]
    assert recipe.run_eos(ckpt, None, tok) == want


def _token_ids(config) -> tuple:
    return config.bos_token_id, config.eos_token_id, config.pad_token_id


@pytest.mark.parametrize("make", [
    lambda: small_llama(bos_token_id=0, eos_token_id=[1, 7], pad_token_id=3),  # Llama 3 lists its eos ids
    lambda: small_gpt2(),
], ids=["llama", "gpt2"])
def test_export_keeps_the_token_ids(tmp_path, make):
    """Seen: export_hf wrote no bos/eos/pad_token_id, so transformers filled in its class defaults
    (a Llama's bos=1, eos=2: other tokens of this vocabulary) and generate() never stopped."""
    hf = make()
    hf.save_pretrained(tmp_path / "in")
    mt.launch(lambda: export_hf(tmp_path / "out", from_hf(str(tmp_path / "in"))), mesh="m:2", rules="heads:m")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert _token_ids(back.config) == _token_ids(hf.config)
    assert back.generation_config.eos_token_id == hf.config.eos_token_id
    # and from a model object
    mt.launch(lambda: export_hf(tmp_path / "obj", from_hf(hf)))
    assert _token_ids(transformers.AutoConfig.from_pretrained(tmp_path / "obj")) == _token_ids(hf.config)
    # token_ids= (a model trained with another tokenizer): those given, the source's dropped
    mt.launch(lambda: export_hf(tmp_path / "tok", from_hf(hf), token_ids={"eos_token_id": [9, 4]}))
    back = json.loads((tmp_path / "tok" / "config.json").read_text())
    pad = hf.config.pad_token_id if back["model_type"] == "llama" else None  # a Llama's padding_id
    assert (back.get("bos_token_id"), back["eos_token_id"], back.get("pad_token_id")) == (None, [9, 4], pad)
    with pytest.raises(ArgumentError, match="eos_id is no token id field; it takes bos_token_id"):
        export_hf(tmp_path / "bad", from_hf(hf), token_ids={"eos_id": 9})
    if back["model_type"] == "llama":
        with pytest.raises(ArgumentError, match="a llama's pad_token_id is the model's \\(3: its padding_id"):
            export_hf(tmp_path / "bad", from_hf(hf), token_ids={"pad_token_id": 5})


def test_generation_config_eos_ids_are_where_generation_stops_as_in_transformers(tmp_path):
    """An instruct model lists its end-of-turn ids in generation_config.json, config.json one id:
    transformers' generate stops at the former, and pads finished rows with that file's
    pad_token_id. from_hf reads them (from the directory, or a model object's generation_config),
    generate stops and pads as transformers' does, and the export writes the eos ids into
    config.json, where transformers finds them again; a bad file or field is refused by name."""
    hf = small_llama(num_key_value_heads=1, eos_token_id=2)
    prompts = torch.randint(0, hf.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=12)
    with torch.no_grad():
        full = hf.generate(prompts, eos_token_id=None, pad_token_id=0, **kw)[:, 5:].tolist()
    eos = [full[0][3], full[1][5], full[2][1]]  # each row meets one, at different steps
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = eos, 7
    hf.save_pretrained(tmp_path / "in")
    assert json.loads((tmp_path / "in" / "config.json").read_text())["eos_token_id"] == 2
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "in").eval()
    assert loaded.generation_config.eos_token_id == eos
    with torch.no_grad():
        want = loaded.generate(prompts, **kw)[:, 5:].tolist()
    assert len(want[0]) < 12 and want != full and 7 in want[1]  # (a finished row padded with 7)

    def prog(source):
        model = from_hf(source)
        export_hf(tmp_path / "out", model)
        return model.cfg.token_ids("eos_token_id"), generate(model, prompts.tolist(), 12)

    for source in (str(tmp_path / "in"), hf):
        ids, got = mt.launch(prog, source, mesh="b:2", rules="batch:b")[0]
        assert ids == eos and got == want
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        assert back.config.eos_token_id == eos and back.generation_config.eos_token_id == eos
    # without a generation_config.json, config.json's
    (tmp_path / "in" / "generation_config.json").unlink()
    assert mt.launch(lambda: from_hf(str(tmp_path / "in")).cfg.token_ids("eos_token_id"))[0] == [2]
    # a file that names no eos (or null) leaves config.json's
    (tmp_path / "in" / "generation_config.json").write_text('{"eos_token_id": null, "pad_token_id": 4}')
    kept = mt.launch(lambda: from_hf(str(tmp_path / "in")).cfg.extra["hf_config"])[0]
    assert (kept["eos_token_id"], kept["pad_token_id"]) == (2, 4)
    wrong = "eos_token_id is '2'; it must be a token id or a list of them"
    for text, said in (("{", "is not valid JSON"), ("[2]", "holds a JSON list, not an object"),
                       ('{"eos_token_id": "2"}', wrong),
                       ('{"pad_token_id": [1]}', r"pad_token_id is \[1\]; it must be a token id, e.g.")):
        (tmp_path / "in" / "generation_config.json").write_text(text)
        with pytest.raises(CheckpointError, match=said):
            from_hf(str(tmp_path / "in"))


@pytest.mark.parametrize("tokenizer", ["init-from", "bytes", "scratch"])
def test_fine_tune_and_export_keep_the_token_ids(tmp_path, capsys, tokenizer):
    """A fine-tune with --init-from's own tokenizer exports config.json's bos/eos ids; one with another
    (bytes: the directory has no tokenizer.json) the run's tokenizer's end-of-text id for both; a run
    from scratch (a BPE it fits) null for both, as ``meshtorch generate`` stops at none there. Seen:
    the fine-tune on bytes exported the source's ids, another vocabulary's (bytes 0x00 and 0x01 here);
    a run from scratch no fields, so transformers took a Llama's class defaults (bytes 0x01 and 0x02)
    and stopped where meshtorch does not. A Llama's pad_token_id is the model's padding_id."""
    from meshtorch.data import ByteTokenizer
    from meshtorch.data.hf_tokenizer import train_bpe

    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus", files=4)
    hf = small_llama(vocab_size=304, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                     max_position_embeddings=16)
    hf.save_pretrained(tmp_path / "llama")
    if tokenizer == "init-from":
        train_bpe([f.read_text() for f in sorted((tmp_path / "corpus").iterdir())], 300, tmp_path / "llama")
    run = ["--batch", "2", "--length", "16", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    model = (["--positions", "rotary", "--norm", "rms", "--gated", "--layers", "1", "--d-model", "16",
              "--heads", "2", "--d-ff", "32"] if tokenizer == "scratch" else
             ["--init-from", str(tmp_path / "llama")])
    assert cli.main(["train", *model, "--data", str(tmp_path / "corpus"), "--steps", "1",
                     "--out", str(tmp_path / "run"), *run]) == 0
    assert cli.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    back = json.loads((tmp_path / "out" / "config.json").read_text())
    eos = ByteTokenizer.eos
    want = {"init-from": (0, 1, 2), "bytes": (eos, eos, 2), "scratch": (None, None, None)}[tokenizer]
    assert (back["bos_token_id"], back["eos_token_id"], back.get("pad_token_id")) == want
    if tokenizer == "scratch":  # (written: a missing field would be transformers' class default)
        assert "eos_token_id" in back and "bos_token_id" in back
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert transformers.GenerationConfig.from_model_config(config).eos_token_id == want[1]
    capsys.readouterr()


def test_a_length_past_the_rotary_positions_is_named_before_the_run(tmp_path):
    """Seen: `meshtorch train --init-from llama --length 32` with max_position_embeddings=16 started
    and failed at its first step with "raise TransformerConfig.max_length", which no flag sets."""
    from meshtorch.recipes.lm import TrainConfig, train

    small_llama(vocab_size=304, max_position_embeddings=16).save_pretrained(tmp_path / "llama")
    named = r"--length 32 .*\(max_position_embeddings=16\).*raise max_position_embeddings in its config"
    with pytest.raises(ArgumentError, match=named):
        train(TrainConfig.of(init_from=str(tmp_path / "llama"), tokenizer="bytes", steps=1, length=32,
                             out=str(tmp_path / "run")))


def test_heads_against_the_config_is_refused():
    """Seen: from_hf(gpt2, heads=2) with n_head=4 in the config built a 2-head model from 4-head
    weights: logits off by 3e-2, no error."""
    gpt2 = small_gpt2()
    with pytest.raises(CheckpointError, match=r"heads=2\) but the config has n_head=4"):
        from_hf(gpt2, heads=2)
    with pytest.raises(CheckpointError, match=r"heads=2\) but the config has n_head=4"):
        from_hf(gpt2.state_dict(), config=gpt2.config, heads=2)
    with pytest.raises(CheckpointError, match=r"heads=2\) but the config has num_attention_heads=4"):
        from_hf(small_llama(), heads=2)
    assert from_hf(gpt2, heads=4).cfg.heads == 4  # the config's own count is fine


def test_a_bare_model_needs_tied_embeddings():
    """Seen: from_hf(LlamaForCausalLM(...).model), which the docs list, failed with "weight
    'lm_head.weight' is missing ... are the config and the weights from one model?"."""
    with pytest.raises(CheckpointError, match="tie_word_embeddings=False.*LlamaForCausalLM"):
        from_hf(small_llama().model)
    with pytest.raises(CheckpointError, match="tie_word_embeddings=False.*GPT2LMHeadModel"):
        from_hf(small_gpt2(tie_word_embeddings=False).transformer)
    tied = small_llama(tie_word_embeddings=True)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        want = tied(ids).logits
    got = mt.launch(lambda: from_hf(tied.model)(named(ids)).to_global())[0]
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("tie", [False, True])
def test_the_pad_tokens_lookups_train_nothing_as_in_transformers(tie):
    """Seen: a Llama with pad_token_id (transformers' nn.Embedding(padding_idx=pad_token_id)) gets no
    gradient in the pad row from lookups of that id; ours got 0.8 there. Tied, the output layer's
    share of that row still trains, in both."""
    pad = int(data()[0][0, 0])  # an id the batch holds
    hf = small_llama(pad_token_id=pad, tie_word_embeddings=tie)
    check_against_hf(hf, hf, "b:2,m:2", "batch:b; vocab:m; d_model:b; heads:m")


def test_a_pipelined_llama_has_its_rope_theta_and_padding():
    """Seen: the pipeline's stages built rotary tables at the default base 10000 whatever
    rope_theta said: a Llama with rope_theta=50 gave a loss off by 2e-2 when pipelined, silently
    (every Llama 3 has rope_theta=500000)."""
    from meshtorch.pipeline.lm import lm_pipeline

    ids, tgt = data()
    hf = small_llama(rope_parameters={"rope_type": "default", "rope_theta": 50.0},
                     pad_token_id=int(ids[0, 0]))
    hf.zero_grad()
    logits = hf(ids).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    want.backward()

    def prog():
        model = from_hf(hf)
        # one SGD step at lr 1 takes the gradient off the weights: the table holds old - grad after it
        pipe = lm_pipeline(model.cfg, model=model, microbatches=1,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=1))
        loss = pipe.step(named(ids), named(tgt))
        return loss, dict(model.named_mesh_parameters())["embed.table"].to_global()

    (loss, table), _ = mt.launch(prog, mesh="stage:2")
    assert abs(loss - want.item()) < 1e-5
    emb = hf.model.embed_tokens.weight
    torch.testing.assert_close(emb.detach() - table, emb.grad, rtol=1e-4, atol=1e-6)


def test_a_directory_from_hf_cannot_read_says_what_to_do(tmp_path):
    """Seen: a save_pretrained(safe_serialization=False) directory (pytorch_model.bin) got "export one
    with mt.export_consolidated"; one without config.json was called "a Llama state dict"."""
    hf = small_llama()
    (tmp_path / "bin").mkdir()
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    hf.config.save_pretrained(tmp_path / "bin")
    resave = r"pytorch_model.bin .*save_pretrained\(path\) .*model.safetensors"
    with pytest.raises(CheckpointError, match=resave):
        from_hf(str(tmp_path / "bin"))
    with pytest.raises(CheckpointError, match="no such directory"):
        from_hf(str(tmp_path / "absent"))
    hf.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"bare' has no config.json.*num_attention_heads"):
        from_hf(str(tmp_path / "bare"))


def test_a_pad_token_id_counted_from_the_end_is_the_last_id(tmp_path):
    """Seen: pad_token_id=-1 (legacy LLaMA conversions) was refused as "not an id of vocab_size";
    transformers' nn.Embedding(padding_idx=-1) takes it as the last id, vocab_size - 1. The
    export writes it back as the source spelled it."""
    hf = small_llama(pad_token_id=-1)
    assert hf.model.embed_tokens.padding_idx == hf.config.vocab_size - 1
    assert int((data()[0] == hf.config.vocab_size - 1).sum()) > 0  # the batch looks that id up
    check_against_hf(hf, hf, "b:2,m:2", "batch:b; vocab:m; d_model:b; heads:m")
    assert mt.launch(lambda: from_hf(hf).cfg.padding_id)[0] == hf.config.vocab_size - 1
    mt.launch(lambda: export_hf(tmp_path, from_hf(hf)))
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == -1
    with pytest.raises(CheckpointError, match=r"pad_token_id=-97 is not an id of vocab_size=96"):
        from_hf(small_llama(), config={**small_llama().config.to_dict(), "pad_token_id": -97})


def test_the_models_padding_id_is_the_exports_pad_token_id(tmp_path):
    """Seen: export_hf wrote the pad_token_id from_hf had kept in cfg.extra over the model's own
    padding_id: a model given another padding_id exported the source's, and transformers then
    froze another row than the model had."""
    import dataclasses

    from meshtorch.models import DecoderLM, TransformerConfig

    kept = {"hf_config": {"eos_token_id": 7, "pad_token_id": 3}}
    cfg = TransformerConfig(vocab=32, d_model=8, heads=2, kv_heads=1, d_kv=4, d_ff=16, layers=1, max_length=8,
                            positions="rotary", norm="rms", activation="silu", gated=True, extra=kept)
    for padding_id, want in ((5, 5), (-1, None), (3, 3)):
        out, model_cfg = tmp_path / str(padding_id), dataclasses.replace(cfg, padding_id=padding_id)
        mt.launch(lambda out=out, model_cfg=model_cfg: export_hf(out, DecoderLM(model_cfg)))
        back = transformers.AutoConfig.from_pretrained(out)
        assert (back.pad_token_id, back.eos_token_id) == (want, 7)


def test_a_gpt2_with_a_padding_id_is_not_exported_as_one():
    """Seen: a GPT-2-shaped model with padding_id exported as a GPT-2 without it: transformers'
    GPT-2 embedding has no padding_idx (its config's pad_token_id freezes nothing), so the export
    would train another model; now the export names padding_id among GPT-2's misfits."""
    import dataclasses

    from meshtorch.models import DecoderLM, gpt2, hf

    gpt = mt.launch(lambda: from_hf(small_gpt2()).cfg)[0]
    cfg = dataclasses.replace(gpt, padding_id=3)
    assert hf.train_flags(cfg, gpt2) == ["--padding-id -1"]
    with pytest.raises(CheckpointError, match=r"not gpt2: padding_id=3 \(GPT-2: -1\)"):
        mt.launch(lambda: export_hf("/nonexistent", DecoderLM(cfg)))


def test_a_directory_without_weights_is_named_as_such(tmp_path):
    """Seen: an empty directory, or one holding only a config and a tokenizer, was told to "load it
    with transformers and re-save it", which fails there too: nothing holds weights."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"'[^']*empty' holds no model weights .*it is empty\)"):
        from_hf(str(tmp_path / "empty"))
    small_llama().config.save_pretrained(tmp_path / "config_only")
    (tmp_path / "config_only" / "tokenizer.json").write_text("{}")
    held = r"no model weights .*it holds config.json, tokenizer.json\)"
    with pytest.raises(CheckpointError, match=held) as e:
        from_hf(str(tmp_path / "config_only"))
    assert "re-save" not in str(e.value)


@pytest.mark.parametrize("mesh, rules", [("b:1", ""), ("m:2", "vocab:m"), ("b:2", "d_model:b"),
                                         ("a:2,b:2", "vocab:a; d_model:b"), ("a:2,b:2", "vocab:(a,b)")])
def test_the_pad_row_starts_at_zero_as_in_transformers(mesh, rules):
    """Seen: a model with padding_id drew the pad row like any other, where transformers'
    nn.Embedding(padding_idx) starts it at zero (a pad token then embeds to nothing until its
    other uses train it). The row may lie in any processor's piece of vocab (21 of 32: the
    second half, the third quarter); every other row is the model without padding_id's, bitwise."""
    from meshtorch.models import DecoderLM, TransformerConfig

    assert torch.nn.Embedding(32, 8, padding_idx=21).weight[21].abs().sum() == 0  # the reference
    base = dict(vocab=32, d_model=8, heads=2, d_kv=4, d_ff=16, layers=1, max_length=8)

    def tables():
        return [DecoderLM(TransformerConfig(**base, padding_id=p), seed=3).embed.table.mesh_tensor.to_global()
                for p in (21, -1)]

    padded, plain = mt.launch(tables, mesh=mesh, rules=rules)[0]
    want = plain.clone()
    want[21] = 0
    assert plain[21].abs().sum() > 0 and torch.equal(padded, want)
    assert torch.equal(plain, mt.launch(tables)[0][1])  # the default draws as on one processor
