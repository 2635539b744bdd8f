"""benchmarks/fsdp_vs_fsdp2.py compares like with like and counts what runs.

Its plain twin computes DecoderLM's loss and gradients from the same weights,
block by block; a tiny run of the whole benchmark (2 gloo processes) gives
every variant the same losses, meshtorch's counters agree with the dispatcher's,
and the torch variants' payloads are the hand-derived ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import meshtorch as mt
from bench_harness import BENCHMARKS, load_benchmark
from meshtorch.models import DecoderLM, TransformerConfig

bench = load_benchmark("fsdp_vs_fsdp2")


@pytest.mark.parametrize("opts", [dict(), dict(bias=True, tie_embeddings=False, activation="gelu_tanh")])
def test_block_lm_has_decoder_lms_loss_and_gradients(opts):
    cfg = TransformerConfig(vocab=24, d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, max_length=8, **opts)
    ours = DecoderLM(cfg, seed=3)
    with torch.no_grad():  # biases and norms start at 0 and 1: make them count
        for p in ours.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    twin = bench.BlockLM(ours)
    assert len(twin.blocks) == cfg.layers and all(p.is_contiguous() for p in twin.parameters())
    data = torch.randint(0, cfg.vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    shape = "batch:3,length:8"
    loss = ours.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))
    loss.backward()
    ref = twin.loss(data[:, :-1], data[:, 1:])
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    grads = {n: v.grad.to_global() for n, v in ours.named_mesh_parameters()}
    assert sorted(twin.names.values()) == sorted(grads)
    for name, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, grads[twin.names[name]].reshape(p.shape), rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_a_tiny_run_compares_equal_steps_and_counts_every_collective(tmp_path):
    limits = load_benchmark("limits")
    lim = tmp_path / "limits.json"  # given, as run_all.py gives them: not measured again here
    limits.save(limits.Limits(flops_per_core=1e11, bytes_per_core=5e10, cores=2), lim)
    # a process of its own, as run_all.py runs it (its workers are spawned from the script's module)
    subprocess.run([sys.executable, str(BENCHMARKS / "fsdp_vs_fsdp2.py"), "--quick", "--rounds", "2",
                    "--steps", "1", "--warmup", "1", "--memory-steps", "1", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=240, env={**os.environ, limits.ENV: str(lim)})
    report = json.loads((tmp_path / "fsdp_vs_fsdp2.json").read_text())
    assert "| DDP |" in (tmp_path / "fsdp_vs_fsdp2.md").read_text()
    # 2 warm-up steps (at least), the counted step and 2 rounds of 1 step: the same 5 batches for all
    assert report["losses_compared"] == 5
    assert all(len(v) == 5 for v in report["losses"].values())
    assert max(report["loss_max_difference"].values()) < 1e-5
    v = report["variants"]
    for name in bench.RULES:  # the dispatcher saw every call meshtorch's communicator made
        stats = v[name]["comm_stats"]
        assert v[name]["collective_calls"] == sum(s["calls"] for s in stats.values())
        assert v[name]["payload_bytes"] == sum(s["bytes"] for s in stats.values())
    cfg = bench.QUICK_CONFIG
    params = report["parameters"]
    root = cfg["vocab"] * cfg["d_model"] + cfg["max_length"] * cfg["d_model"] + 2 * cfg["d_model"]
    # DDP all-reduces every gradient once; FSDP2 all-gathers each half of the parameters once
    # (again in backward for the blocks, not the root, when resharding) and reduce-scatters
    # every gradient (all dims of this model are even: no padding)
    assert v["ddp"]["payload_bytes_by_kind"] == {"all_reduce": 4 * params}  # a steady step: no broadcast
    keep = v["fsdp2_keep"]["payload_bytes_by_kind"]
    assert keep == {"all_gather": 2 * params, "reduce_scatter": 4 * params}
    assert v["fsdp2"]["payload_bytes_by_kind"] == {"all_gather": 2 * params + 2 * (params - root),
                                                   "reduce_scatter": 4 * params}
    assert v["fsdp2_keep"]["collective_calls_by_kind"] == {"all_gather": cfg["layers"] + 1,
                                                           "reduce_scatter": cfg["layers"] + 1}
    # the allocator held at least each process's parameters and AdamW's two moments (sharded for
    # FSDP), and DDP also the whole gradients
    for name in ("meshtorch_fsdp", "fsdp2", "fsdp2_keep"):
        assert v[name]["peak_bytes"] >= 3 * 4 * params // 2
    for name in ("meshtorch_dp", "ddp"):
        assert v[name]["peak_bytes"] >= 4 * 4 * params
    assert set(report["ratios"]) == set(bench.PAIRS)
    for table in ("ratios", "cpu_ratios"):
        assert all(len(r["per_round"]) == 2 and r["median"] > 0 for r in report[table].values())
    assert all(0 < f < 1 for f in report["flop_limit_fraction"].values())
    assert all(0 < f < 1 for f in report["flop_limit_fraction_cpu_time"].values())


def test_allocator_peak_lets_an_asynchronous_call_go_at_its_wait():
    # FSDP2 issues all-gathers with async_op=True when it prefetches: the measured call must
    # return its work at once (gloo holds the tensors until it completes) and let go at wait()
    allocator_peak = load_benchmark("allocator_peak")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out, inp = torch.zeros(4), torch.arange(4.0)
        with allocator_peak.caller_frees():
            # looked up inside: caller_frees swaps the functions; torch < 2.13 spells it _into_tensor
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(out, inp, async_op=True)
            assert isinstance(work, allocator_peak._Waited)
            work.wait()
            assert gather(out, inp + 1) is None  # blocking calls stay blocking
        torch.testing.assert_close(out, torch.arange(1.0, 5.0))
    finally:
        dist.destroy_process_group()


def test_pairs_run_only_their_variants_and_unknown_ones_are_named(tmp_path, capsys):
    args = bench.parse(["--pairs", "meshtorch_dp/ddp", "--quick"])
    assert args.variants == ["meshtorch_dp", "ddp"] and args.pairs == ["meshtorch_dp/ddp"]
    both = bench.parse(["--pairs", "meshtorch_fsdp/meshtorch_fsdp_per_use,meshtorch_dp/ddp"])
    assert both.variants == ["meshtorch_fsdp", "meshtorch_dp", "ddp", "meshtorch_fsdp_per_use"]
    assert bench.reference(both.variants) == "meshtorch_fsdp"
    assert bench.reference(args.variants) == "meshtorch_dp"
    with pytest.raises(SystemExit):
        bench.parse(["--pairs", "meshtorch_dp/fsdp2"])
    assert "--pairs: meshtorch_dp/fsdp2; choose from meshtorch_fsdp/fsdp2" in capsys.readouterr().err
    # a summary of one pair from two processes' records: its ratio, losses against its meshtorch variant
    record = {"wall": {"meshtorch_dp": [[0.3, 0.2]], "ddp": [[0.2, 0.2]]},
              "cpu": {"meshtorch_dp": [[0.1, 0.1]], "ddp": [[0.1, 0.1]]},
              "losses": {"meshtorch_dp": [1.0, 2.0], "ddp": [1.5, 2.5]},
              "counted": {n: {"calls": {"all_reduce": 1}, "bytes": {"all_reduce": 4}}
                          for n in ("meshtorch_dp", "ddp")},
              "peaks": {"meshtorch_dp": 10, "ddp": 20}, "matmul_rate_cpu_time": 1e11}
    other = {**record, "losses": {"meshtorch_dp": [1.0, 2.0], "ddp": [0.5, 1.5]}}
    out = bench.summarise([record, other], ["meshtorch_dp/ddp"])
    assert list(out["ratios"]) == ["meshtorch_dp/ddp"] and out["ratios"]["meshtorch_dp/ddp"]["median"] == 1.25
    assert out["loss_max_difference"] == {"meshtorch_dp": 0.0, "ddp": 0.0}  # DDP's averaged over processes


def test_a_run_of_some_pairs_does_not_replace_the_whole_runs_results(tmp_path):
    """``--pairs meshtorch_dp/ddp`` wrote its one ratio over benchmarks/results/fsdp_vs_fsdp2.*,
    the committed figures of every comparison: it prints only, unless given ``--out``."""
    assert bench.results_folder(bench.parse([])) == bench.RESULTS
    assert bench.results_folder(bench.parse(["--pairs", ",".join(bench.PAIRS)])) == bench.RESULTS
    assert bench.results_folder(bench.parse(["--pairs", "meshtorch_dp/ddp"])) is None
    given = bench.parse(["--pairs", "meshtorch_dp/ddp", "--out", str(tmp_path)])
    assert bench.results_folder(given) == tmp_path
