"""Who never joined a ``torch``-backend collective that timed out, and what the others were doing.

gloo and NCCL only say that a collective timed out. Every member of the group that did join it times
out too, at about the same moment; so on a timeout each of them writes where it waits (the collective,
its axes and the user's call site) into the world's rendezvous store, waits a few seconds for the
others' reports, and reads them: a member that wrote none never joined (it is stopped, stuck outside
any collective, or gone), a member that waits in another collective took another path (a mismatch).
The store is ``torch.distributed``'s default store, reached through a private function; where a torch
version lacks it, :func:`diagnose` returns None and the error says only that some member never joined.

Example:
    >>> from meshtorch.comm.absent import describe
    >>> from meshtorch.mesh import Mesh
    >>> text, mismatch = describe(
    ...     {"kind": "all_reduce", "axes": ["m"], "group": [0, 1, 2]},
    ...     {1: {"kind": "all_reduce", "axes": ["m"], "group": [0, 1, 2], "site": "a.py:3 in f"}},
    ...     [0, 1, 2], 0, Mesh("m:3"))
    >>> text[:60], mismatch
    ("processor 2 {'m': 2} never joined it: it is waiting in no co", False)
"""

from __future__ import annotations

import json
import time
from typing import Any

from meshtorch.mesh import Mesh

_KEY = "meshtorch/waiting/{}"
# how long a processor whose collective timed out waits for the other members' reports
REPORT_GRACE_S = 5.0


def default_store() -> Any:
    """The ``torch.distributed`` world's store (the rendezvous's), or None where this torch has no
    ``_get_default_store`` or no world is initialised."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API: missing or failing means no diagnosis
        return None


def describe(mine: dict, reports: dict[int, dict], group: list[int], rank: int,
             mesh: Mesh) -> tuple[str, bool]:
    """What became of the other members of ``group`` (``reports``: member -> where it waits, as
    :func:`diagnose` reads them), and whether some member waits in another collective (a mismatch)."""
    absent = [r for r in group if r != rank and r not in reports]
    elsewhere = {r: rep for r, rep in reports.items()
                 if (rep.get("kind"), rep.get("axes"), rep.get("group")) !=
                 (mine["kind"], mine["axes"], mine["group"])}
    parts = []
    if absent:
        names = ", ".join(f"{r} {mesh.coords(r)}" for r in absent)
        verb = "never joined it: it is" if len(absent) == 1 else "never joined it: they are"
        parts.append(f"processor{'s' if len(absent) > 1 else ''} {names} {verb} waiting in no collective "
                     "(stopped, stuck in a computation, or gone)")
    for r, rep in sorted(elsewhere.items()):
        parts.append(f"processor {r} {mesh.coords(r)} is waiting in {rep.get('kind')} over axes "
                     f"{tuple(rep.get('axes') or ())} called at {rep.get('site')}")
    return "; ".join(parts), bool(elsewhere)


def diagnose(kind: str, axes: tuple[str, ...], site: str, group: list[int], rank: int, mesh: Mesh,
             grace: float = REPORT_GRACE_S) -> tuple[str, bool] | None:
    """After this processor's ``kind`` over ``axes`` (called at ``site``) timed out: report it in the
    store, wait up to ``grace`` seconds for the other members of ``group`` to report theirs, and
    :func:`describe` the outcome; None where there is no store to meet in."""
    store = default_store()
    if store is None:
        return None
    mine = {"kind": kind, "axes": list(axes), "group": list(group), "site": site}
    try:
        store.set(_KEY.format(rank), json.dumps(mine))
        reports: dict[int, dict] = {}
        deadline = time.monotonic() + grace
        while True:
            for r in group:
                if r != rank and r not in reports and store.check([_KEY.format(r)]):
                    reports[r] = json.loads(store.get(_KEY.format(r)))
            if len(reports) == len(group) - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a store that fails (its host gone) leaves the plain message
        return None
    return describe(mine, reports, group, rank, mesh)
