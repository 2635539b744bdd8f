"""PNG timeline of a pipeline schedule (matplotlib, imported only when called).

Example:
    >>> import tempfile, os
    >>> from meshtorch.pipeline import build_schedule
    >>> from meshtorch.pipeline.plot import timeline
    >>> path = os.path.join(tempfile.mkdtemp(), "1f1b.png")
    >>> timeline(build_schedule("1f1b", 4, 6), path) == path and os.path.getsize(path) > 0
    True
    >>> timeline(build_schedule("interleaved", 2, 4, virtual_stages=2), path) == path
    True
"""

from __future__ import annotations

import textwrap

from meshtorch.errors import PipelineError
from meshtorch.files import save_figure
from meshtorch.pipeline.schedule import BACKWARD, FORWARD, WEIGHT, Schedule
from meshtorch.pipeline.simulate import Simulation

# RGB of each action kind (matplotlib's "tab" blue, orange, green)
COLORS = {FORWARD: (0.30, 0.45, 0.69), BACKWARD: (0.87, 0.52, 0.32), WEIGHT: (0.33, 0.66, 0.41)}


def timeline(schedule: Schedule, path: str, simulation: Simulation | None = None,
             title: str | None = None, xlabel: str | None = None) -> str:
    """Draw one row per stage, one box per action (forward blue, backward orange,
    weight gradient green; later chunks of a stage in darker shades), labelled with
    the micro-batch (and ``.chunk`` with virtual stages), in unit slots or, given
    ``simulation``, in its predicted seconds (or measured ones, put in a :class:`Simulation`'s
    ``start``/``end``: then say so with ``xlabel``); write a PNG to ``path`` and return ``path``.

    Raises:
        PipelineError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PipelineError("the pipeline timeline needs matplotlib: pip install 'meshtorch[plot]'") from e
    v = schedule.virtual_stages
    width = max(6.0, 0.35 * schedule.slots)
    fig, ax = plt.subplots(figsize=(width, 0.6 * schedule.stages + 1.4))
    for a in schedule.actions:
        if simulation is None:
            x0, w = float(a.slot), 1.0
        else:
            x0, w = simulation.start[a], simulation.end[a] - simulation.start[a]
        shade = 1.0 - 0.45 * a.chunk / max(1, v - 1)
        color = tuple(c * shade for c in COLORS[a.kind])
        ax.broken_barh([(x0, w)], (a.stage - 0.4, 0.8), facecolors=color, edgecolors="white")
        label = f"{a.microbatch}.{a.chunk}" if v > 1 else str(a.microbatch)
        ax.text(x0 + w / 2, a.stage, label, ha="center", va="center", fontsize=6 if v > 1 else 7,
                color="white")
    ax.set_yticks(range(schedule.stages))
    ax.set_yticklabels([f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel or ("time slot" if simulation is None else "seconds (simulated)"))
    bubble = schedule.bubble_fraction() if simulation is None else simulation.bubble_fraction
    chunks = f" × {v} chunks" if v > 1 else ""
    kinds = "blue forward, orange input gradient, green weight gradient" if schedule.split_backward \
        else "blue forward, orange backward"
    text = title or (f"{schedule.name}: {schedule.stages} stages{chunks} × {schedule.microbatches} "
                     f"micro-batches, bubble {bubble:.1%} ({kinds})")
    # about 12 characters of 9-point text per inch (with the margins): a long title wraps
    ax.set_title("\n".join(textwrap.wrap(text, int(12 * width))), fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path
