"""Why meshtorch's forward on one processor is slower than its plain twin at full size (issue 27):
the Python between two large kernels runs with cold caches.

A large matmul (1024 x 1024 x 1024 fp32, 12 MB of operands: a d_ff projection of the
benchmarks' LM at batch 8 x 128) leaves the core's caches (and on a shared machine much of
the L3) holding its matrices. The next Python and torch dispatch code then comes back from
memory. This script times, on this thread (``time.thread_time_ns``, one intra-op thread),
small calls made right after such a matmul ("cold") and right after the same call ("hot"):

- a tiny torch op (``v + 1`` on 256 floats): the dispatcher alone;
- a plain Python loop over a dict: the interpreter alone;
- ``x @ W + b`` in torch and a meshtorch ``Dense`` layer on one token: one layer of each
  model's forward, without the arithmetic (the matmul is [1, 256] x [256, 1024]).

The cold - hot difference is what each of a forward's ~25 large kernels costs the Python
that follows it; the ``Dense`` row over the ``x @ W + b`` row is how much more of it
meshtorch's lowering (plans, layouts, the MeshTensor wrapper, module calls) runs per layer.
At small batches the kernels leave the caches warm, so the same Python costs its hot price:
hence a gap that grows with the batch while the ATen kernels cost the same on both sides.

Run:
    python benchmarks/cold_python.py [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import meshtorch as mt
from meshtorch.nn import Dense


def timed(fn, calls: int, before) -> float:
    """Median thread CPU microseconds of ``fn()`` run right after ``before()``."""
    ts = []
    for _ in range(calls):
        before()
        t0 = time.thread_time_ns()
        fn()
        ts.append(time.thread_time_ns() - t0)
    return statistics.median(ts) / 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="timed calls of each kind")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    table = {i: str(i) for i in range(2000)}
    v = torch.randn(1, 256)
    layer = Dense(mt.Dim("d_model", 256), mt.Dim("d_ff", 1024))
    x = torch.randn(1, 1, 256, requires_grad=True)
    xm = mt.from_global(x, "batch:1,length:1,d_model:256")
    w, bias = (t.detach().clone().requires_grad_() for t in (layer.kernel, layer.bias))

    def python_loop():
        return sum(len(table[i]) for i in range(0, 2000, 7))

    calls = {"tiny torch op (v + 1)": lambda: v + 1,
             "Python loop (286 dict reads)": python_loop,
             "torch x @ W + b (1 token)": lambda: x @ w + bias,
             "meshtorch Dense (1 token)": lambda: layer(xm)}
    for fn in calls.values():  # warm: plans made, parameters drawn
        for _ in range(5):
            fn()
    print("| call | after a 1024^3 matmul (us) | hot (us) | cold - hot (us) |\n|---|---|---|---|")
    for name, fn in calls.items():
        cold = timed(fn, args.calls, lambda: torch.mm(a, b))
        hot = timed(fn, args.calls, fn)
        print(f"| {name} | {cold:.1f} | {hot:.1f} | {cold - hot:.1f} |")
    print(f"\nload average (1 min) {os.getloadavg()[0]:.2f}; torch {torch.__version__}; "
          f"`python benchmarks/cold_python.py --calls {args.calls}`")


if __name__ == "__main__":
    main()
