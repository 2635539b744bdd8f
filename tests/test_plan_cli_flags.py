"""``meshtorch plan`` plans what ``meshtorch train`` runs: the same flags (one parser's definitions) make
the same :class:`TrainConfig`, ``--init-from`` reads a Hugging Face config.json alone, flags of the run
that do not change a step change nothing, and ``--compile`` prices the compiled step."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshtorch as mt
from meshtorch.cli import build_parser, main
from meshtorch.recipes.lm.cli import config_from_args
from meshtorch.recipes.lm.config import OPTIONS
from meshtorch.recipes.lm.plan_cli import PLAN_ONLY, config_of
from meshtorch.recipes.lm.steps import build_model

TINY = ["--layers", "1", "--d-model", "32", "--d-kv", "8", "--d-ff", "64", "--heads", "4", "--batch", "4",
        "--length", "16"]

# each a few flag sets of meshtorch train, all valid together (kv-heads and heads 4, an even d_kv)
CHOICES = {
    "--kv-heads": ["0", "2"], "--positions": ["learned", "rotary"], "--norm": ["layer", "rms"],
    "--activation": ["gelu", "relu", "silu"], "--rotary-base": ["10000", "500000"],
    "--attention": ["auto", "gather"], "--clip": ["0", "0.5"], "--optimizer": ["adamw", "adafactor"],
    "--precision": ["fp32", "bf16"], "--microbatches": ["2", "4"], "--schedule": ["gpipe", "1f1b"],
    "--pipeline-stages": ["1", "2"], "--model": ["lm", "moe"], "--dropout": ["0", "0.1"],
    "--mesh": ["b:2", "b:2,m:2"], "--rules": ["batch:b", "batch:b; d_ff:m"],
    "--steps": ["3"], "--out": ["elsewhere"], "--lr": ["0.1"], "--tokenizer": ["bytes", "bpe:512"],
}
SWITCHES = ["--gated", "--no-gated", "--compile", "--recompute", "--tie-embeddings", "--no-tie-embeddings"]


def both(flags: list[str]) -> tuple:
    """The config ``meshtorch train`` and ``meshtorch plan`` make of ``flags``."""
    train = config_from_args(build_parser("train").parse_args(["train", *flags]))
    plan, vocab = config_of(build_parser("plan").parse_args(["plan", *flags]))
    return train, plan, vocab


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(CHOICES)), st.integers(0, 9), max_size=8),
       st.lists(st.sampled_from(SWITCHES), max_size=3, unique=True))
def test_plan_makes_the_config_train_makes_of_the_same_flags(picks, switches):
    flags = [a for k, i in picks.items() for a in (k, CHOICES[k][i % len(CHOICES[k])])] + switches
    train, plan, _ = both(flags)
    assert plan == train
    assert plan.options() == train.options()  # every option, by name


def test_plan_defaults_are_trains_and_the_vocab_is_the_tokenizers():
    train, plan, vocab = both([])
    assert plan == train and plan.parallelism.mesh == "b:2" and plan.optimizer.name == "adamw"
    assert both(["--tokenizer", "bytes"])[2] == 264 and both(["--tokenizer", "bpe:500"])[2] == 504
    args = build_parser("plan").parse_args(["plan", "--vocab", "77"])
    assert config_of(args)[1] == 77
    # the planner's own options are not options of the run, and every one is a flag of meshtorch plan
    assert not set(PLAN_ONLY) & set(OPTIONS) and set(PLAN_ONLY) <= set(vars(args))


@pytest.mark.parametrize("flags", [[],
                                   ["--kv-heads", "2", "--gated", "--positions", "rotary", "--norm", "rms"],
                                   ["--no-tie-embeddings", "--activation", "relu", "--model", "moe",
                                    "--layers", "2"]])
def test_the_planned_parameters_are_those_of_trains_model(capsys, flags):
    """The plan traces the model of train's config: its parameter count is the model's, built from the
    config ``meshtorch train`` makes of the same flags (on one processor)."""
    args = TINY + flags + ["--mesh", "b:2", "--rules", "batch:b"]
    assert main(["plan", *args, "--vocab", "64", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["parameters"]
    cfg = config_from_args(build_parser("train").parse_args(["train", *args]))
    assert planned == mt.plan.trace(lambda: build_model(cfg, 64), mesh="b:1").parameters
    # and a flag that changes the model changes the plan: untied adds an output layer of vocab x d_model
    if "--no-tie-embeddings" not in flags:
        assert main(["plan", *args, "--vocab", "64", "--no-tie-embeddings", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["parameters"] - planned == 64 * 32


def llama_dir(tmp_path, **sizes) -> str:
    """A directory with only a Llama config.json (transformers' LlamaConfig fields), no weights."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", **sizes}
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_init_from_a_llama_config_json_plans_that_model(capsys, tmp_path):
    path = llama_dir(tmp_path)
    assert main(["plan", "--init-from", path, "--batch", "4", "--length", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # untied embedding and output 2 x 320 x 32; per block: q and o 32 x (4 x 8), k and v 32 x (2 x 8),
    # SwiGLU 3 x 32 x 64, two RMS norms 2 x 32 (no biases); the final norm 32
    block = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    assert out["parameters"] == 2 * 320 * 32 + 2 * block + 32
    assert os.listdir(path) == ["config.json"]  # the weights were never needed
    # the model's architecture comes from config.json, as in meshtorch train: a contradiction is refused
    assert main(["plan", "--init-from", path, "--d-model", "64"]) == 2
    assert "--d-model 64 conflicts with --init-from" in capsys.readouterr().err
    assert main(["plan", "--init-from", path, "--vocab", "64"]) == 2
    assert "--vocab 64 conflicts with --init-from" in capsys.readouterr().err


def test_flags_of_the_run_that_do_not_change_a_step_change_nothing(capsys, tmp_path):
    """--steps, --out, --data, --lr, ... are accepted (a train command line plans with train -> plan)
    and the plan is the same; nothing is written."""
    base = ["plan", *TINY, "--vocab", "64", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    out = tmp_path / "run"
    assert main(base + ["--steps", "7", "--out", str(out), "--lr", "1", "--log-every", "3",
                        "--checkpoint-every", "2", "--data", str(tmp_path / "none.txt")]) == 0
    assert json.loads(capsys.readouterr().out) == plain and not out.exists()
    assert main(base + ["--no-such-flag"]) == 2  # an unknown flag is argparse's error


def test_compile_prices_the_compiled_step(capsys):
    """--compile is priced with elementwise chains fused (fewer kernels to launch on an h100)."""
    base = ["plan", *TINY, "--vocab", "64", "--hardware", "h100", "--json"]
    assert main(base) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main(base + ["--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert (eager["compiled"], compiled["compiled"]) == (False, True)
    assert compiled["flops"] == eager["flops"] and compiled["step_seconds"] < eager["step_seconds"]
    # the search prices the compiled step too: its best is the compiled plan of the layout it picks
    assert main(base + ["--compile", "--search", "--processors", "2"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert main(base + ["--compile", "--mesh", best["mesh"], "--rules", best["rules"]]) == 0
    assert best["step_seconds"] == pytest.approx(json.loads(capsys.readouterr().out)["step_seconds"])
    assert main(base + ["--compile", "--pipeline-stages", "2"]) == 2  # train's own refusal
    assert "--compile compiles the plain step" in capsys.readouterr().err


def test_device_is_trains_and_a_hardware_name_there_is_deprecated(capsys):
    base = ["plan", *TINY, "--vocab", "64", "--json"]
    assert main(base + ["--device", "cuda", "--backend", "torch"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["device"] == "tpu-v2" and "deprecated" not in out.err
    args = build_parser("plan").parse_args(base + ["--device", "cuda"])
    assert (args.device, args.hardware) == ("cuda", "tpu-v2")


def test_a_llama_3_8b_config_plans_on_8_h100s_with_fsdp(capsys, tmp_path):
    """Llama-3-8B's config.json at its real size, FSDP over 8 processors: the layered trace (two
    shallow depths, extrapolated) gives its exact parameter count."""
    path = llama_dir(tmp_path, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192)
    run = ["plan", "--init-from", path, "--batch", "16", "--length", "8192", "--precision", "bf16",
           "--mesh", "b:8", "--rules", "batch:b; d_model:b", "--hardware", "h100", "--json"]
    assert main(run) == 0
    out = json.loads(capsys.readouterr().out)
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert out["parameters"] == 2 * 128256 * 4096 + 32 * block + 4096 == 8_030_261_248
    # FSDP: each processor holds an eighth of the (fp32) parameters, and AdamW's two moments
    assert out["memory_bytes"]["parameters"] == pytest.approx(4 * 8_030_261_248 / 8, rel=0.01)
    assert out["memory_bytes"]["optimizer"] == pytest.approx(2 * 4 * 8_030_261_248 / 8, rel=0.01)
    # two sequences of 8192 per GPU keep more activations than an 80 GB H100 holds; recomputed, they fit
    assert not out["fits"]
    assert main(run + ["--recompute"]) == 0
    recomputed = json.loads(capsys.readouterr().out)
    assert recomputed["fits"] and recomputed["flops"] > out["flops"]
    # overlapped (the default) at no memory cost: the gathered fp32 weights, cast to bf16 for their
    # matmuls, are freed after the cast (they were kept to their gradient: 72.3 GiB against 44.3)
    assert recomputed["overlap"] and recomputed["reshard_after_forward"]
    assert main(run + ["--recompute", "--no-overlap"]) == 0
    per_use = json.loads(capsys.readouterr().out)
    assert not per_use["overlap"]
    assert recomputed["memory_bytes"]["total"] <= per_use["memory_bytes"]["total"]


@pytest.mark.parametrize("flags", [["--precision", "bf16", "--kv-heads", "2", "--gated", "--no-overlap"],
                                   ["--no-overlap", "--recompute", "--rules", "batch:b; d_model:b"],
                                   ["--recompute", "--rules", "batch:b; d_model:b"],
                                   ["--precision", "bf16", "--kv-heads", "2", "--gated"],
                                   ["--compile", "--precision", "bf16"]])
def test_layered_plan_equals_the_full_trace(capsys, flags):
    """--layered (the default) extrapolates from two shallow depths: the same parameters, FLOPs, bytes
    and memory as tracing every layer, the step time within 1%. A step that overlaps (the default;
    not under --compile) has its peak within 10%: the flat buffers of grouped calls are cut by
    megabytes, not by layers, and this model's one-layer step peaks elsewhere than its deeper ones
    (the extrapolation starts at one layer)."""
    base = ["plan", *TINY, "--layers", "4", "--vocab", "64", "--hardware", "h100", "--json", *flags]
    plans = []
    for flag in ("--layered", "--no-layered"):
        assert main(base + [flag]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    layered, full = plans
    for key in ("parameters", "flops", "bytes_per_axis", "calls_per_axis"):
        assert layered[key] == full[key], key
    if "--no-overlap" in flags or "--compile" in flags:
        assert layered["memory_bytes"] == full["memory_bytes"]
    else:
        assert layered["memory_bytes"]["total"] == pytest.approx(full["memory_bytes"]["total"], rel=0.1)
    assert layered["step_seconds"] == pytest.approx(full["step_seconds"], rel=0.01)


def test_recompute_under_bf16_recomputes_in_bf16(capsys):
    """--recompute --precision bf16 plans (the meta backend's autocast is re-entered for the
    recomputation, as torch.utils.checkpoint restores torch.autocast): the recomputed forward's
    matmuls are bf16 FLOPs, the float32 ones (the optimizer, the loss) are those of the step without it."""
    base = ["plan", *TINY, "--layers", "2", "--vocab", "64", "--precision", "bf16", "--json"]
    by_dtype = []
    for flags in ([], ["--recompute"]):
        assert main(base + flags) == 0
        by_dtype.append(json.loads(capsys.readouterr().out)["flops_by_dtype"])
    plain, recomputed = by_dtype
    assert recomputed.get("float32", 0) == plain.get("float32", 0)
    assert recomputed["bfloat16"] > plain["bfloat16"]
