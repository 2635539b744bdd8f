"""Programs the memory tests run on the torch backend (module level: they travel to processes)."""

from __future__ import annotations

import torch

from bench_harness import load_benchmark

allocator_peak = load_benchmark("allocator_peak")

SIDE = (8, 4, 128)  # 16 KiB of float32


def _run(kind: str, dim: int, t: torch.Tensor) -> torch.Tensor:
    import meshtorch as mt

    comm = mt.current().comm
    if kind == "all_reduce":
        return comm.all_reduce(t, "b")
    if kind == "all_gather":
        return comm.all_gather(t, "b", dim=dim)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(t, "b", dim=dim)
    return comm.all_to_all(t, "b", split_dim=dim, concat_dim=2 - dim)


def collective_step(kind: str, dim: int) -> tuple:
    """The step the planner traces: the input made before the measured block, the collective in it."""
    import meshtorch as mt

    t = torch.ones(SIDE)
    with mt.plan.measure():
        r = _run(kind, dim, t)
    return tuple(r.shape)


CASES = [("all_reduce", 0), ("all_gather", 0), ("all_gather", 1), ("reduce_scatter", 0),
         ("reduce_scatter", 1), ("all_to_all", 0), ("all_to_all", 1)]


def collective_peaks() -> dict:
    """For each of :data:`CASES`, the allocator's peak during the collective, its input made
    before (the least of two calls)."""
    return {case: min(allocator_peak.step_peaks(lambda: torch.ones(SIDE), lambda t, c=case: _run(*c, t), 2))
            for case in CASES}


def training_step_peak(cfg, vocab: int) -> int:
    return allocator_peak.training_step_peak(cfg, vocab)


def late_step_peak(cfg, vocab: int, late: int, delay: float) -> int:
    """:func:`training_step_peak`, processor ``late`` issuing each asynchronous grouped all_gather
    (a prefetch) ``delay`` seconds after it is due: deterministically the late peer of a loaded
    machine, for whom the others' gathers in flight wait (gloo holds their staging buffers
    until it joins)."""
    import time

    import meshtorch as mt

    comm = mt.current().comm
    if comm.rank != late:
        return training_step_peak(cfg, vocab)
    start = comm.all_gather_grouped

    def gather(*args, **kwargs):
        if kwargs.get("async_op"):
            time.sleep(delay)
        return start(*args, **kwargs)

    comm.all_gather_grouped = gather
    try:
        return training_step_peak(cfg, vocab)
    finally:
        del comm.all_gather_grouped


def step_flops_and_peak(cfg, vocab: int) -> tuple[int, int]:
    """A real steady-state step's FLOPs (``torch.utils.flop_counter``, no planner) and the
    least allocator peak of three steps."""
    from torch.utils.flop_counter import FlopCounterMode

    from meshtorch.recipes.lm.steps import prepare

    peak = allocator_peak.training_step_peak(cfg, vocab)
    step, batch = prepare(cfg, vocab)
    with FlopCounterMode(display=False) as counter:
        step.run([batch], 1)
    return counter.get_total_flops(), peak


def pipelined_step_peak(cfg, vocab: int) -> int:
    """The least allocator peak of three steady-state steps of ``meshtorch train --pipeline-stages``'s
    step of ``cfg`` on this processor (after the warm-up of ``prepare``)."""
    from itertools import count

    from meshtorch.recipes.lm.steps import prepare

    steps = count(1)
    return min(allocator_peak.step_peaks(lambda: prepare(cfg, vocab, pipelined=True),
                                         lambda s: s[0].run([s[1]], next(steps))))


def measure_all(jobs: list) -> list:
    """Each ``(function, args, rules)`` of ``jobs`` run in turn in this one world under its
    rules: the memory tests measure every step on a mesh in one launch rather than starting
    fresh processes for each (each measurement profiles its own allocations from its start)."""
    from meshtorch.context import current
    from meshtorch.layout import LayoutRules

    ctx = current()
    keep = ctx.rules
    out = []
    try:
        for fn, args, rules in jobs:
            ctx.rules = LayoutRules(rules)
            out.append(fn(*args))
    finally:
        ctx.rules = keep
    return out


# a block's parameters as a grouped all_gather gets them: local pieces, each with its gathered dim
BLOCK = [((64, 128), 0), ((128, 64), 1), ((32, 256), 0), ((256,), 0)]


def _block() -> list[torch.Tensor]:
    return [torch.randn(s) for s, _ in BLOCK]


def _gather_issued() -> tuple:
    """The block and its grouped all_gather, issued and (by the transport) completed."""
    import time

    import meshtorch as mt

    pieces = _block()
    work = mt.current().comm.all_gather_grouped(pieces, "b", [d for _, d in BLOCK], async_op=True)
    while not work.is_completed():
        time.sleep(0.001)
    return pieces, work


def grouped_gather_peaks() -> dict:
    """The allocator's peak bytes (the least of three) of a block's grouped all_gather: packing
    its pieces, the whole call (blocking), and unpacking once the call is done (the wait)."""
    import meshtorch as mt
    from meshtorch.comm.grouped import pack_gather

    dims = [d for _, d in BLOCK]

    def least(setup, step) -> int:
        return min(allocator_peak.step_peaks(setup, step, 1)[0] for _ in range(3))

    return {"pack": least(_block, lambda ts: pack_gather(ts, dims, "b")),
            "call": least(_block, lambda ts: mt.current().comm.all_gather_grouped(ts, "b", dims)),
            "unpack": least(_gather_issued, lambda s: s[1].wait())}
