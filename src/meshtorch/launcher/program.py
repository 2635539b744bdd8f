"""One processor's program as a launch runs it: the user's function, then what must be finished
before the processor ends.

That is its background checkpoint save (``mt.save(..., background=True)``) if one is still in
flight: the launch returns once it is committed, so the next launch (a notebook's resume cell)
loads it, and a write that failed raises from the launch on every processor, as ``mt.checkpoint.wait()``
does, instead of surfacing as a warning when Python exits.

Example:
    >>> from meshtorch.launcher.program import run_program
    >>> run_program(max, (2, 3), {})
    3
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from meshtorch.context import current


def run_program(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)``, then wait for this processor's background save (every processor
    of the launch calls it, so the save's agreement on its outcome meets)."""
    out = fn(*args, **kwargs)
    background = sys.modules.get("meshtorch.checkpoint.background")  # (no save without it imported)
    if background is not None and background.in_flight(current().key):
        from meshtorch.checkpoint.writer import wait

        wait()
    return out
