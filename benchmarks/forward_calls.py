"""What one training step runs besides its kernels: Python frames and ATen ops, meshtorch vs plain.

A diagnosis of the data-parallel step's gap to DDP (issue 27), in counts that do not move with
the machine's load (``dp_phases.py`` times the same step, ±1-2 ms a run on a shared box). Per-op
Python run between large kernels is paid with cold caches (``cold_python.py``), so each Python
frame counts. Rows:

* one processor, without collectives: meshtorch's ``DecoderLM`` vs its plain twin
  (``fsdp_vs_fsdp2.BlockLM``), same weights and rows;
* data parallel (``batch:b`` under ``mt.overlap()``) on 2 thread processors, then on 2 gloo
  processes beside DDP of the twin (as ``fsdp_vs_fsdp2``'s variants), processor 0's counts.

Each step is counted after warm-up steps (the caches, the overlap's lasting entries and DDP's
buckets made): its forward+loss and its backward, with ``sys.setprofile`` (Python frames, calls
into C) in one step and a dispatch mode (ATen ops, tests/mesh_harness.aten_ops's way) in the next.

Run:
    python benchmarks/forward_calls.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import fsdp_vs_fsdp2 as bench
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig

Counts = tuple[int, int, int]  # Python frames, calls into C functions, ATen ops
WARMUP = 3


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def frames_of(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``, and the Python frames and calls into C it ran."""
    n = [0, 0]

    def profile(frame, event, arg):
        if event == "call":
            n[0] += 1
        elif event == "c_call":
            n[1] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, n[0], n[1]


def _aten(fn: Callable[[], Any]) -> tuple[Any, int]:
    with _Ops() as ops:
        out = fn()
    return out, ops.n


def step_counts(loss: Callable[[], Any], zero_grad: Callable[[], None]) -> tuple[Counts, Counts]:
    """The forward+loss's and the backward's counts of a step ``zero_grad(); loss().backward()``,
    after :data:`WARMUP` such steps: frames in one step, ATen ops in the next."""
    for _ in range(WARMUP):
        zero_grad()
        loss().backward()
    zero_grad()
    made, f_frames, f_calls = frames_of(loss)
    _, b_frames, b_calls = frames_of(made.backward)
    zero_grad()
    made, f_ops = _aten(loss)
    _, b_ops = _aten(made.backward)
    return (f_frames, f_calls, f_ops), (b_frames, b_calls, b_ops)


def _zero(model: torch.nn.Module) -> Callable[[], None]:
    return lambda: model.zero_grad(set_to_none=True)


def meshtorch_data_parallel(cfg: TransformerConfig, whole: torch.Tensor) -> tuple[Counts, Counts]:
    """Processor ``b``'s counts of a ``batch:b`` step under ``mt.overlap()`` (run by mt.launch)."""
    model = DecoderLM(cfg, seed=0)
    shape = f"batch:{whole.shape[0]},length:{whole.shape[1] - 1}"

    def loss():
        return model.loss(mt.from_global(whole[:, :-1], shape), mt.from_global(whole[:, 1:], shape))

    with mt.overlap():
        return step_counts(loss, _zero(model))


def ddp(cfg: TransformerConfig, whole: torch.Tensor) -> tuple[Counts, Counts]:
    """This gloo process's counts of DDP's step of the twin on its rows (run by mt.launch)."""
    net = torch.nn.parallel.DistributedDataParallel(bench.BlockLM(DecoderLM(cfg, seed=0)))
    rows = whole.shape[0] // dist.get_world_size()
    local = whole[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]

    def loss():
        return F.cross_entropy(net(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())

    return step_counts(loss, _zero(net))


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
    table = [
        ("meshtorch, one processor", step_counts(
            lambda: model.loss(mt.from_global(data[:, :-1], shape), mt.from_global(data[:, 1:], shape)),
            _zero(model))),
        ("plain torch twin", step_counts(lambda: twin.loss(data[:, :-1], data[:, 1:]), _zero(twin))),
    ]
    whole = bench.batch(0, cfg.vocab, batch, length)
    dp = dict(mesh="b:2", rules="batch:b")
    table.append(("meshtorch batch:b, mt.overlap(), 2 threads",
                  mt.launch(meshtorch_data_parallel, cfg, whole, **dp)[0]))
    table.append(("meshtorch batch:b, mt.overlap(), 2 gloo processes",
                  mt.launch(meshtorch_data_parallel, cfg, whole, backend="torch", **dp)[0]))
    table.append(("DDP, 2 gloo processes", mt.launch(ddp, cfg, whole, backend="torch", **dp)[0]))
    print("Processor 0's counts per phase of one step (forward+loss / backward)\n")
    print("| step | Python frames | calls into C | ATen ops |\n|---|---|---|---|")
    for name, (fwd, bwd) in table:
        print(f"| {name} | {fwd[0]} / {bwd[0]} | {fwd[1]} / {bwd[1]} | {fwd[2]} / {bwd[2]} |")
    flag = " --quick" if args.quick else ""
    print(f"\ntorch {torch.__version__}; `python benchmarks/forward_calls.py{flag}`")


if __name__ == "__main__":
    main()
