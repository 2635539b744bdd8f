"""Counters of collective calls and bytes, per kind and per set of axes.

Bytes are *payload* bytes: the size of the local tensor this processor hands
to the collective (for ``shift``/``permute``: the bytes it actually sends).
The planner turns payloads into link time with ring/tree cost formulas.

Example:
    >>> from meshtorch.comm.stats import CommStats
    >>> s = CommStats()
    >>> s.record("all_reduce", ("b",), 64)
    >>> s.bytes(axis="b"), s.calls(kind="all_reduce")
    (64, 1)
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from meshtorch.caching import constant_result


class CommStats:
    """Calls and payload bytes per ``(kind, axes)``; one object per processor."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
        self._bytes: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
        self._watchers: list[Callable[[str, tuple[str, ...], int], None]] = []
        self._async_watchers: list[Callable[[], Callable[[], None]]] = []

    def record(self, kind: str, axes: tuple[str, ...], nbytes: int) -> None:
        self._calls[(kind, axes)] += 1
        self._bytes[(kind, axes)] += int(nbytes)
        for watcher in self._watchers:
            watcher(kind, axes, nbytes)

    def started(self) -> Callable[[], None] | None:
        """The call just recorded runs asynchronously: tell the watchers that follow waits (the
        planner's, which prices the compute run until the wait as overlapping the call); what to
        call once it has been waited for, or ``None`` when nobody follows.

        Example:
            >>> s, seen = CommStats(), []
            >>> with s.watching(lambda *call: seen.append(call), waits=lambda: lambda: seen.append("waited")):
            ...     s.record("all_reduce", ("b",), 8)
            ...     waited = s.started()
            ...     waited()
            >>> seen
            [('all_reduce', ('b',), 8), 'waited']
        """
        if not self._async_watchers:
            return None
        told = [w() for w in self._async_watchers]

        def waited() -> None:
            for tell in told:
                tell()

        return waited

    @contextmanager
    def watching(self, watcher: Callable[[str, tuple[str, ...], int], None],
                 waits: Callable[[], Callable[[], None]] | None = None) -> Iterator[None]:
        """Also tell ``watcher(kind, axes, nbytes)`` of every call recorded in the block (and, with
        ``waits``, of every asynchronous one: :meth:`started` calls ``waits()``, and the function it
        returns when the call is waited for).

        Example:
            >>> s, seen = CommStats(), []
            >>> with s.watching(lambda *call: seen.append(call)):
            ...     s.record("all_gather", ("m",), 32)
            >>> seen
            [('all_gather', ('m',), 32)]
        """
        self._watchers.append(watcher)
        if waits is not None:
            self._async_watchers.append(waits)
        try:
            yield
        finally:
            self._watchers.remove(watcher)
            if waits is not None:
                self._async_watchers.remove(waits)

    def reset(self) -> None:
        self._calls.clear()
        self._bytes.clear()

    def _select(self, table: dict, axis: str | tuple[str, ...] | None, kind: str | None) -> int:
        if isinstance(axis, str):
            axis = (axis,)
        return sum(
            v
            for (k, axes), v in table.items()
            if (kind is None or k == kind) and (axis is None or axes == tuple(axis))
        )

    def bytes(self, axis: str | tuple[str, ...] | None = None, kind: str | None = None) -> int:
        """Payload bytes, optionally only over exactly ``axis`` and/or of one ``kind``."""
        return self._select(self._bytes, axis, kind)

    def calls(self, axis: str | tuple[str, ...] | None = None, kind: str | None = None) -> int:
        """Number of calls, filtered like :meth:`bytes`."""
        return self._select(self._calls, axis, kind)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{"kind@axes": {"calls": n, "bytes": b}}``, sorted, JSON-ready."""
        return {
            f"{k}@{','.join(axes)}": {"calls": self._calls[(k, axes)], "bytes": self._bytes[(k, axes)]}
            for k, axes in sorted(self._calls)
        }

    def copy(self) -> CommStats:
        out = CommStats()
        out._calls.update(self._calls)
        out._bytes.update(self._bytes)
        return out

    def __add__(self, other: CommStats) -> CommStats:
        out = self.copy()
        for key, v in other._calls.items():
            out._calls[key] += v
            out._bytes[key] += other._bytes[key]
        return out

    def __sub__(self, other: CommStats) -> CommStats:
        out = self.copy()
        for key, v in other._calls.items():
            out._calls[key] -= v
            out._bytes[key] -= other._bytes[key]
            if not out._calls[key] and not out._bytes[key]:
                del out._calls[key], out._bytes[key]
        return out

    def __str__(self) -> str:
        rows = [f"{'collective':<16}{'axes':<10}{'calls':>8}{'bytes':>14}"]
        for key, v in self.as_dict().items():
            kind, axes = key.split("@")
            rows.append(f"{kind:<16}{axes:<10}{v['calls']:>8}{v['bytes']:>14}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"CommStats({self.as_dict()})"


# --------------------------------------------------------- collectives of a traced step
# Under torch.compile a collective's Python runs once, when Dynamo traces it, while its graph
# runs at every call. So a trace notes each collective (kind, axes, bytes) in a tally, the
# tally's number is a constant the compiled function returns, and the caller counts the tally
# once per run (meshtorch.compiler.compile_step). The two functions below run at trace time
# only: Dynamo calls a function marked assume_constant_result and keeps its result.
Tally = tuple[tuple[str, tuple[str, ...], int], ...]
_tallies: dict[int, list[tuple[str, tuple[str, ...], int]]] = {}
_numbers = itertools.count(1)
_open = threading.local()  # this thread's tally being traced (Dynamo traces on the caller's thread)



@constant_result
def begin_traced() -> int:
    """Open a new tally for the collectives traced next on this thread; its number."""
    number = next(_numbers)
    _tallies[number] = _open.tally = []
    return number


@constant_result
def note_traced(kind: str, axes: tuple[str, ...], nbytes: int) -> int:
    """Note a traced collective in this thread's open tally (none open: not counted)."""
    tally = getattr(_open, "tally", None)
    if tally is not None:
        tally.append((kind, tuple(axes), int(nbytes)))
    return 0


def traced_tally(number: int) -> Tally:
    """The collectives noted in tally ``number`` (a run of its graph makes each once).

    Example:
        >>> from meshtorch.comm.stats import begin_traced, note_traced, traced_tally
        >>> n = begin_traced(); _ = note_traced("all_reduce", ("b",), 64)
        >>> traced_tally(n)
        (('all_reduce', ('b',), 64),)
    """
    return tuple(_tallies.get(number, ()))
