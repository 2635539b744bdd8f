"""benchmarks/gpu_step.py, the one-GPU benchmark, dry-run on the CPU: its variants train the same
model alike, its loss check catches a model that differs, its FLOP count is the stated convention,
and the dry run makes no CUDA call.

The compiled variants are left out here (Inductor takes minutes on 2 cores); the GPU check
(benchmarks/gpu_check.sh) runs them.
"""

from __future__ import annotations

import doctest
import json

import pytest
import torch

from bench_harness import load_benchmark
from meshtorch.models import TransformerConfig

gpu_step = load_benchmark("gpu_step")  # it imports its neighbour overhead.py (PlainLM)

EAGER = ["--dry-run", "--variants", "meshtorch-eager,plain-eager", "--steps", "2", "--warmup", "1"]


def _no_cuda(monkeypatch):
    """Make every CUDA query the script could make fail the test."""
    def called(*a, **k):
        raise AssertionError("the dry run made a CUDA call")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a query, as on a machine without one
    for name in ("synchronize", "max_memory_allocated", "reset_peak_memory_stats",
                 "get_device_name", "current_device", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, called)


def test_dry_run_trains_meshtorch_and_plain_alike_without_cuda(tmp_path, monkeypatch):
    _no_cuda(monkeypatch)
    assert gpu_step.main([*EAGER, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_step.json").read_text())
    tiny = report["sizes"]["tiny"]
    mesh, plain = tiny["variants"]["meshtorch-eager"], tiny["variants"]["plain-eager"]
    assert mesh["status"] == plain["status"] == "ok"
    assert len(mesh["losses"]) == len(plain["losses"]) == 3
    assert plain["losses"][-1] < plain["losses"][0]  # the optimizer steps: the Zipf unigram is learnt
    assert mesh["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert mesh["losses_agree"] and mesh["loss_reference"] == "plain-eager"
    assert mesh["peak_memory_gib"] is None and mesh["step_ms"] > 0
    # (the ratio is stored to 4 decimals: a relative tolerance missed it when a slow plain step,
    # under load, made it 0.015)
    assert tiny["ratios"]["eager"] == round(mesh["step_ms"] / plain["step_ms"], 4)
    # tiny: 2 layers, d_model 64, 4 heads x 16, vocab 512, length 64; N = parameters - 64·64 positions
    assert tiny["parameters"] == 512 * 64 + 64 * 64 + 2 * (4 * 64 * 64 + 2 * 64 * 256 + 4 * 64) + 2 * 64
    assert tiny["flops_per_token"] == 6 * (tiny["parameters"] - 64 * 64) + 12 * 2 * 4 * 16 * 64
    assert tiny["flops_per_step"] == tiny["flops_per_token"] * 4 * 64
    md = (tmp_path / "gpu_step.md").read_text()
    assert "FLOPs/token = 6·N + 12·layers·heads·d_kv·length" in md
    assert "| meshtorch-eager |" in md and "| plain-eager |" in md and "ok (max" in md


def test_profile_reports_each_variants_top_ops(tmp_path):
    """``--profile N``: N more steps per variant under torch.profiler; on the CPU no GPU figures, the
    top ops by self CPU time (matmuls among them: the step runs its Dense layers), in the JSON and
    the markdown."""
    assert gpu_step.main([*EAGER, "--profile", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_step.json").read_text())["sizes"]["tiny"]["variants"]
    for name in ("meshtorch-eager", "plain-eager"):
        p = rows[name]["profile"]
        assert p["steps"] == 1 and p["wall_ms"] > 0 and p["device_busy_ms"] is None
        assert "device_idle_unprofiled_ms" in p and p["device_idle_unprofiled_ms"] is None
        names = [k["name"] for k in p["top"]]
        assert len(names) == len(set(names)) > 0 and "aten::mm" in names, names
        assert all(k["ms"] >= 0 and k["calls"] > 0 for k in p["top"])
    md = (tmp_path / "gpu_step.md").read_text()
    assert "| meshtorch-eager |" in md and "GPU idle ms" in md


def test_the_table_says_what_the_host_ran_while_the_gpu_waited():
    """On a GPU the profile finds the GPU's idle gaps and what the host was running in the longest
    (its innermost events at the gap's middle), and the table lists them per variant: here the
    H200 run's report with gaps put into one variant's profile."""
    from pathlib import Path
    from types import SimpleNamespace as E

    report = json.loads((Path(gpu_step.__file__).parent / "results" / "h200" / "gpu_step.json").read_text())

    def ev(name, a, b):
        return E(name=name, time_range=E(start=a, end=b))

    kernels = [ev("gemm", 0, 100), ev("add", 90, 120), ev("gemm", 130, 140), ev("gemm", 1400, 1500)]
    host = [ev("ProfilerStep#1", 0, 1600), ev("aten::copy_", 200, 1300), ev("cudaMemcpyAsync", 250, 1250)]
    gaps = gpu_step.idle_gaps(kernels, host)
    assert gaps["count"] == 1 and gaps["total_us"] == 1260.0   # 120 -> 130 is under 20 us
    assert gaps["top"] == [{"us": 1260.0, "host": ["cudaMemcpyAsync", "aten::copy_", "ProfilerStep#1"]}]
    report["sizes"]["124m"]["variants"]["meshtorch-eager"]["profile"]["gaps"] = gaps
    md = gpu_step.markdown(report)
    assert ("- meshtorch-eager: 1 gaps, 1.26 ms; 1.26 ms in cudaMemcpyAsync < aten::copy_ < ProfilerStep#1"
            in md), md


def test_loss_check_catches_a_plain_model_that_differs(tmp_path, monkeypatch):
    # attention that sees the future: the plain twin no longer computes meshtorch's model
    monkeypatch.setattr(gpu_step.PlainLM, "_attend",
                        lambda self, q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert gpu_step.main([*EAGER, "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_step.json").read_text())
    mesh = report["sizes"]["tiny"]["variants"]["meshtorch-eager"]
    # small initial weights attend almost evenly, so the first losses differ little; training parts them
    assert mesh["losses_agree"] is False and mesh["loss_max_rel_diff"] > 1e-3
    assert "DIFFER" in (tmp_path / "gpu_step.md").read_text()


def test_a_failing_variant_is_a_row_and_fails_the_run(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_step, "run_plain", broken)
    assert gpu_step.main(["--dry-run", "--variants", "plain-eager", "--out", str(tmp_path)]) == 1
    plain = json.loads((tmp_path / "gpu_step.json").read_text())["sizes"]["tiny"]["variants"]["plain-eager"]
    assert plain == {"status": "error", "error": "RuntimeError: boom", "wall_s": plain["wall_s"]}
    assert "| plain-eager | error: RuntimeError: boom |" in (tmp_path / "gpu_step.md").read_text()


def test_a_spent_budget_skips_what_has_not_started(tmp_path):
    assert gpu_step.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_step.json").read_text())["sizes"]["tiny"]["variants"]
    assert list(rows) == list(gpu_step.VARIANTS)
    assert all(r["status"] == "skipped" for r in rows.values())
    assert "| plain-compiled | skipped: --budget-s 0 spent |" in (tmp_path / "gpu_step.md").read_text()


def test_the_124m_step_is_7_tflop_under_the_stated_convention():
    cfg = TransformerConfig(vocab=50304, d_model=768, heads=12, d_kv=64, d_ff=3072, layers=12,
                            max_length=1024)
    w = gpu_step.work_of(cfg, 124_392_960, batch=8, length=1024)  # the reference H100 run's count
    # N = 124,392,960 - 1024·768 positions; attention 12·12·12·64·1024 a token
    assert (w.matmul_params, w.attention_per_token) == (124_392_960 - 1024 * 768, 113_246_208)
    assert w.per_step == (6 * 123_606_528 + 113_246_208) * 8192  # 7.00 TFLOP
    assert "= 854.9 MFLOP" in w.formula(cfg, 1024)


def test_doctests_of_the_script():
    assert doctest.testmod(gpu_step).failed == 0


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        gpu_step.parse(["--sizes", "7b"])
    with pytest.raises(SystemExit):
        gpu_step.parse(["--variants", "plain"])
    a = gpu_step.parse(["--quick"])
    assert (a.sizes, a.steps, a.warmup, a.precision, a.loss_rtol) == (["124m", "1b"], 5, 3, "bf16", 1e-2)
    d = gpu_step.parse(["--dry-run"])
    assert (d.sizes, d.precision, d.variants) == (["tiny"], "fp32", list(gpu_step.VARIANTS))


def test_compiled_saved_lists_what_the_eager_step_saves_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks/compiled_saved.py (by hand on a GPU), its eager half on the CPU: the loss saves the
    bf16 logits once ([tokens, vocab]; cross_entropy_rows keeps them, no float32 copy), each layer's
    feed-forward its two [tokens, d_ff] tensors (the first matmul's output for GELU's backward, GELU's
    for the second matmul's weight gradient), and a plan is priced beside it."""
    _no_cuda(monkeypatch)
    compiled_saved = load_benchmark("compiled_saved")
    args = ["--device", "cpu", "--d-model", "64", "--layers", "2", "--batch", "1", "--length", "32",
            "--vocab", "300", "--variants", "eager", "--out", str(tmp_path)]
    assert compiled_saved.main(args) == 0
    eager = json.loads((tmp_path / "compiled_saved.json").read_text())["variants"]["eager"]
    count = {(d, n): c for _, d, n, c in eager["saved"]}
    tokens = 32
    assert count.get(("bfloat16", tokens * 300 * 2)) == 1 and ("float32", tokens * 300 * 4) not in count
    assert count.get(("bfloat16", tokens * 256 * 2)) == 2 * 2, eager["saved"]
    assert eager["peak_bytes"] is None and eager["planned_bytes"] > eager["saved_bytes"] > 0
