"""Human-readable output of a placement: a text table and an optional PNG.

Example:
    >>> from meshtorch.placement import OpGraph, Problem, place
    >>> from meshtorch.placement.report import table
    >>> g = OpGraph()
    >>> _ = g.add_node("a", acc_time=1.0, cpu_time=1.0)
    >>> print(table(place(g, Problem(devices=1))).splitlines()[0])
    stage  device  nodes   compute      comm    memory      load
"""

from __future__ import annotations

from pathlib import Path

from meshtorch.errors import PlacementError
from meshtorch.files import save_figure
from meshtorch.placement.problem import Placement


def _bytes(x: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{x / size:.2f}{unit}"
    return f"{x:.0f}B"


def table(p: Placement) -> str:
    """Stages (nodes, compute, communication, memory, load), bottleneck, throughput."""
    rows = [f"{'stage':>5}  {'device':<6} {'nodes':>6} {'compute':>9} {'comm':>9} "
            f"{'memory':>9} {'load':>9}"]
    b = p.bottleneck if p.stages and p.latency is None else -1
    for i, s in enumerate(p.stages):
        dev = s.kind if s.replicas == 1 else f"{s.kind}x{s.replicas}"
        if p.problem.interleaved:  # chunk i runs on device i mod p
            dev = f"{s.kind}{i % p.problem.devices}"
        mark = "  <- bottleneck" if i == b else ""
        rows.append(
            f"{i:>5}  {dev:<6} {len(s.nodes):>6} {s.compute:>9.4g} {s.comm:>9.4g} "
            f"{_bytes(s.memory):>9} {s.load:>9.4g}{mark}"
        )
    if p.latency is not None:
        rows.append(f"latency (one sample, end to end): {p.latency:.6g}")
    else:
        rows.append(f"max load (time per sample): {p.max_load:.6g}   "
                    f"throughput: {p.throughput:.6g} samples per time unit")
    extra = ""
    if "ideals" in p.info:
        extra = f" ({p.info['supernodes']} supernodes, {p.info['ideals']} ideals, " \
                f"{p.info['pairs']} stage candidates)"
    if p.info.get("optimal") is False:
        extra += f" (time limit hit; lower bound {p.info.get('lower_bound')})"
    if p.info.get("gap") is not None:
        extra += f" (proven gap {100 * p.info['gap']:.2f}%)"
    rows.append(f"algorithm: {p.algorithm}   solve time: {p.solve_seconds:.3f} s{extra}")
    if p.violations:
        rows.append("VIOLATIONS: " + "; ".join(p.violations))
    return "\n".join(rows)


def plot(p: Placement, path: str | Path) -> None:
    """Write a PNG of the stage loads (compute, communication, sync) and memory."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlacementError(
            "--png needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    xs = list(range(len(p.stages)))
    comp = [s.compute / s.replicas for s in p.stages]
    comm = [s.comm / s.replicas for s in p.stages]
    sync = [s.sync for s in p.stages]
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(xs) + 2), 3.5))
    ax.bar(xs, comp, label="compute")
    ax.bar(xs, comm, bottom=comp, label="communication")
    ax.bar(xs, sync, bottom=[a + b for a, b in zip(comp, comm)], label="all-reduce")
    for x, s in zip(xs, p.stages):
        ax.text(x, s.load, f"{len(s.nodes)} ops\n{_bytes(s.memory)}", ha="center", va="bottom",
                fontsize=7)
    ax.set_xticks(xs, [f"{i}:{s.kind}" for i, s in zip(xs, p.stages)])
    ax.set_ylabel("load (time per sample)")
    ax.set_title(f"{p.algorithm}: max load {p.max_load:.4g}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
