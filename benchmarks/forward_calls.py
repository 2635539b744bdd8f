"""What one forward+loss runs besides its kernels: Python calls and ATen ops, meshtorch vs plain.

A diagnosis of the one-processor and data-parallel forward's gap (issue 27), in counts that do
not move with the machine's load (``dp_phases.py`` times the same forward, ±1-2 ms a run on a
shared box). Per-op Python run between large kernels is paid with cold caches
(``cold_python.py``), so each Python frame counts. On one processor, without collectives:
meshtorch's ``DecoderLM`` vs its plain twin (``fsdp_vs_fsdp2.BlockLM``), same weights and rows;
then data parallel (``batch:b`` under ``mt.overlap()``) on 2 thread processors, processor 0's
forward. Each forward is counted after warm-up steps (the caches and the overlap's lasting
entries filled), with ``sys.setprofile`` (Python frames, calls into C) and a dispatch mode (ATen
ops, tests/mesh_harness.aten_ops's way).

Run:
    python benchmarks/forward_calls.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import fsdp_vs_fsdp2 as bench
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def counts(fn) -> tuple[int, int, int]:
    """Python frames, calls into C functions and ATen ops of one ``fn()``."""
    n = [0, 0]

    def profile(frame, event, arg):
        if event == "call":
            n[0] += 1
        elif event == "c_call":
            n[1] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    with _Ops() as ops:
        fn()
    return n[0], n[1], ops.n


def _data_parallel(cfg: TransformerConfig, data: torch.Tensor, shape: str) -> tuple[int, int, int]:
    model = DecoderLM(cfg, seed=0)

    def loss():
        return model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))

    with mt.overlap():
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss().backward()
        return counts(loss)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fsdp_vs_fsdp2's small LM")
    args = p.parse_args(argv)
    cfg = TransformerConfig(**(bench.QUICK_CONFIG if args.quick else bench.CONFIG))
    batch, length = (bench.QUICK_BATCH, bench.QUICK_LENGTH) if args.quick else (bench.BATCH, bench.LENGTH)
    torch.set_num_threads(1)
    rows = batch // 2
    data = bench.batch(0, cfg.vocab, rows, length)
    shape = f"batch:{rows},length:{length}"
    model = DecoderLM(cfg, seed=0)
    twin = bench.BlockLM(model)
    ours = lambda: model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape))  # noqa: E731
    plain = lambda: twin.loss(data[:, :-1], data[:, 1:])  # noqa: E731
    for _ in range(3):
        ours().backward()
        plain().backward()
    rows_out = [("meshtorch, one processor", counts(ours)), ("plain torch twin", counts(plain))]
    whole = bench.batch(0, cfg.vocab, batch, length)
    dp = mt.launch(lambda: _data_parallel(cfg, whole, f"batch:{batch},length:{length}"),
                   mesh="b:2", rules="batch:b")[0]
    rows_out.append(("meshtorch batch:b, mt.overlap(), processor 0 of 2 threads", dp))
    print("| forward+loss | Python frames | calls into C | ATen ops |\n|---|---|---|---|")
    for name, (frames, c_calls, ops) in rows_out:
        print(f"| {name} | {frames} | {c_calls} | {ops} |")
    flag = " --quick" if args.quick else ""
    print(f"\ntorch {torch.__version__}; `python benchmarks/forward_calls.py{flag}`")


if __name__ == "__main__":
    main()
