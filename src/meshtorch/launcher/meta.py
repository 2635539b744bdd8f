"""``mt.launch(fn, backend="meta")``: processor 0 alone, on ``meta`` tensors, for planning.

Collectives are only counted, so one representative processor stands for
the whole mesh; the launch returns its result alone.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.launcher.meta import run_meta
    >>> run_meta(lambda: mt.current().mesh.size, (), {}, mt.Mesh("b:64"), mt.LayoutRules(""))
    64
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshtorch.comm.meta import MetaCommunicator
from meshtorch.context import ProcessorContext, use
from meshtorch.launcher.failures import processor_error
from meshtorch.layout import LayoutRules
from meshtorch.mesh import Mesh


def run_meta(fn: Callable[..., Any], args: tuple, kwargs: dict, mesh: Mesh, rules: LayoutRules,
             rank: int = 0) -> Any:
    """``fn(*args, **kwargs)`` as processor ``rank`` (default 0) of ``mesh`` under
    ``torch.device("meta")``.

    Example:
        >>> import meshtorch as mt
        >>> from meshtorch.launcher.meta import run_meta
        >>> run_meta(lambda: torch.ones(2).device.type, (), {}, mt.Mesh("m:4"), mt.LayoutRules(""))
        'meta'
    """
    comm = MetaCommunicator(mesh, rank)
    ctx = ProcessorContext(comm, rules)
    try:
        with use(ctx), torch.device("meta"):
            return fn(*args, **kwargs)
    except Exception as e:
        raise processor_error(e, rank, mesh.coords(rank), where="(meta backend)") from e
