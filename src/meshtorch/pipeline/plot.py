"""PNG timeline of a pipeline schedule (matplotlib, imported only when called).

Example:
    >>> import tempfile, os
    >>> from meshtorch.pipeline import build_schedule
    >>> from meshtorch.pipeline.plot import timeline
    >>> path = os.path.join(tempfile.mkdtemp(), "1f1b.png")
    >>> timeline(build_schedule("1f1b", 4, 6), path) == path and os.path.getsize(path) > 0
    True
"""

from __future__ import annotations

from meshtorch.errors import PipelineError
from meshtorch.pipeline.schedule import FORWARD, Schedule
from meshtorch.pipeline.simulate import Simulation


def timeline(schedule: Schedule, path: str, simulation: Simulation | None = None,
             title: str | None = None) -> str:
    """Draw one row per stage, one box per action (forward blue, backward orange,
    labelled with the micro-batch), in unit slots or, given ``simulation``, in
    its predicted seconds; write a PNG to ``path`` and return ``path``.

    Raises:
        PipelineError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PipelineError("the pipeline timeline needs matplotlib: pip install 'meshtorch[plot]'") from e
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * schedule.slots), 0.6 * schedule.stages + 1.2))
    for a in schedule.actions:
        if simulation is None:
            x0, w = float(a.slot), 1.0
        else:
            x0, w = simulation.start[a], simulation.end[a] - simulation.start[a]
        color = "#4c72b0" if a.kind == FORWARD else "#dd8452"
        ax.broken_barh([(x0, w)], (a.stage - 0.4, 0.8), facecolors=color, edgecolors="white")
        ax.text(x0 + w / 2, a.stage, str(a.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(schedule.stages))
    ax.set_yticklabels([f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time slot" if simulation is None else "seconds (simulated)")
    bubble = schedule.bubble_fraction() if simulation is None else simulation.bubble_fraction
    ax.set_title(title or f"{schedule.name}: {schedule.stages} stages × {schedule.microbatches} "
                 f"micro-batches, bubble {bubble:.1%} (blue forward, orange backward)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
