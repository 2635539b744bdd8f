"""How much of meshtorch's forward is the language's per-op Python: the forward replayed without it.

A diagnosis for issue 27's last line (meshtorch data parallel vs DDP, ``fsdp_vs_fsdp2.py``): there
meshtorch's backward is as fast as DDP's and its forward is slower by about the Python that the
language runs per op (``dp_phases.py``, ``forward_calls.py``), paid with cold caches between large
kernels. This script bounds what a structural fix (a module's local program recorded once and
replayed) could win, on one processor, without collectives:

- ``meshtorch``: ``DecoderLM.loss`` of ``fsdp_vs_fsdp2``'s LM on one process's rows, eager;
- ``replayed``: the same forward's top-level torch calls, recorded once under a
  ``TorchFunctionMode`` (each call, its arguments, which earlier call made each tensor argument) and
  replayed from a list by one Python loop: the kernels the eager forward runs and none of the
  language's Python (no plans, layouts, MeshTensors, module frames). Calls that make a value but
  no tensor (``.shape``, ``.dtype``, ``torch.equal``) are not replayed: their values are constants
  of the recording, as is the input (the bound replays one fixed batch);
- ``plain torch twin``: ``fsdp_vs_fsdp2.BlockLM`` with the same weights and rows.

Each step runs forward+loss (timed: the stepping thread's CPU time, ``time.thread_time``) and a
backward, variants interleaved in a balanced order. The replay's loss must equal the eager one
bitwise (checked). It is a bound, not a feature: the replay skips every Python side effect (a
collective, ``mt.overlap()``'s reads, meshtorch's counter-based dropout draws, comm stats) and runs
an ``autograd.Function`` as the torch calls inside its forward (a ``TorchFunctionMode`` does not see
``Function.apply``), so its gradients differ from the eager ones by rounding where the loss's
custom backward (``cross_entropy_rows``) would have run.

Run:
    python benchmarks/replay_bound.py [--rounds 30] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import fsdp_vs_fsdp2 as bench
import torch
from dp_phases import interleaved
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

import meshtorch as mt
from meshtorch.models import DecoderLM, TransformerConfig


class _Recorder(TorchFunctionMode):
    """Every top-level torch call that makes a tensor, with where its tensor arguments came from."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.slots: dict[int, int] = {}  # id(tensor made by a recorded call) -> its slot
        self.kept: list[Any] = []  # every recorded argument and result, alive: no id is reused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made, _ = tree_flatten(out)
        outs = [(j, o) for j, o in enumerate(made) if isinstance(o, torch.Tensor)]
        if not outs and out is not None:
            # a value (.shape, .dtype, torch.equal, numel): a constant of the recording, as the
            # eager forward's Python used it (this bound replays one fixed input); a call that
            # returns None (a write: t[i] = v) is replayed
            return out
        flat, spec = tree_flatten((args, kwargs))
        fills = [(i, self.slots[id(a)]) for i, a in enumerate(flat)
                 if isinstance(a, torch.Tensor) and id(a) in self.slots]
        self.kept.append((flat, out))
        stored = flat.copy()
        for i, _ in fills:  # (filled at each replay: the recording's own activations not held)
            stored[i] = None
        places: list[tuple[int, int]] | None = []
        for j, o in outs:
            if id(o) not in self.slots:  # (an in-place op returns its input: the same slot)
                self.slots[id(o)] = len(self.slots)
            places.append((j, self.slots[id(o)]))
        made_here = self.slots[id(out)] if isinstance(out, torch.Tensor) else None
        self.calls.append((func, stored, spec, fills, places if made_here is None else made_here))
        return out


class Replay:
    """The recorded forward of ``fn`` (a function of no arguments returning a tensor), replayed by
    calling it: its torch calls in order, each tensor argument the one its recorded maker made in
    this replay (parameters and inputs are the recording's own objects)."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        rec = _Recorder()
        with rec:
            self.recorded = fn()
        self.result = rec.slots[id(self.recorded)]
        self.slots = len(rec.slots)
        self.calls = rec.calls

    def __call__(self) -> torch.Tensor:
        made: list[Any] = [None] * self.slots
        for f, flat, spec, fills, places in self.calls:
            if fills:
                flat = flat.copy()
                for i, k in fills:
                    flat[i] = made[k]
            args, kwargs = tree_unflatten(flat, spec)
            out = f(*args, **kwargs)
            if type(places) is int:  # (a tensor out, its slot: the usual call)
                made[places] = out
            else:  # (a tuple or list holding tensors: split's chunks)
                outs, _ = tree_flatten(out)
                for j, k in places:
                    made[k] = outs[j]
        return made[self.result]


def forward_timed(fn: Callable[[], torch.Tensor]) -> Callable[[], float]:
    """A step of ``fn``: its forward's CPU seconds (returned), then its backward, untimed."""
    def step() -> float:
        t = time.thread_time()
        loss = fn()
        spent = time.thread_time() - t
        loss.backward()
        return spent
    return step


def variants(quick: bool) -> tuple[dict[str, Callable[[], torch.Tensor]], int]:
    """The three forwards (meshtorch, its replay, the twin) of one process's rows of
    ``fsdp_vs_fsdp2``'s LM, and the replay's number of torch calls."""
    cfg = TransformerConfig(**(bench.QUICK_CONFIG if quick else bench.CONFIG))
    rows = (bench.QUICK_BATCH if quick else bench.BATCH) // 2
    length = bench.QUICK_LENGTH if quick else bench.LENGTH
    data = bench.batch(0, cfg.vocab, rows, length)
    x, y = data[:, :-1], data[:, 1:]
    shape = f"batch:{rows},length:{length}"
    model = DecoderLM(cfg, seed=0)
    twin = bench.BlockLM(model)

    def meshtorch() -> torch.Tensor:
        return model.loss(mt.from_global(x, shape), mt.from_global(y, shape)).local

    for _ in range(3):  # (the lowering's plans made: the recording is a steady-state forward)
        meshtorch().backward()
    replayed = Replay(meshtorch)
    again = replayed()
    if not torch.equal(again, replayed.recorded):
        raise SystemExit(f"replay_bound: the replayed loss {again.item()} is not the eager one "
                         f"{replayed.recorded.item()}")
    return {"meshtorch": meshtorch, "replayed": replayed,
            "plain torch twin": lambda: twin.loss(x, y)}, len(replayed.calls)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30, help="interleaved steps of each variant")
    p.add_argument("--quick", action="store_true", help="fsdp_vs_fsdp2's small LM")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fns, calls = variants(args.quick)
    times = interleaved({name: forward_timed(fn) for name, fn in fns.items()}, args.rounds)
    twin = times["plain torch twin"]
    print(f"forward+loss of one process's rows, median CPU ms of {args.rounds} interleaved steps "
          f"(the replay: {calls} torch calls, its loss bitwise the eager one)\n")
    print("| variant | CPU ms | paired / twin |\n|---|---|---|")
    for name, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, twin))
        print(f"| {name} | {1e3 * statistics.median(ts):.2f} | {ratio:.3f} |")
    print(f"\nload average (1 min) {os.getloadavg()[0]:.2f}; torch {torch.__version__}; "
          f"`python benchmarks/replay_bound.py {' '.join(sys.argv[1:] if argv is None else argv)}`")


if __name__ == "__main__":
    main()
