"""Standard output whose reader may go away before the program ends (``meshtorch train ... | head``).

The ``meshtorch`` command (:mod:`meshtorch.cli`) and each processor a ``--backend torch`` launch
starts (:mod:`meshtorch.launcher.processes`) write their lines through :class:`ReaderMayLeave`:
once the reader of the pipe is gone their lines are dropped, and the run goes on (it still writes
its checkpoint, ``summary.json`` and ``loss.png``) instead of failing with ``BrokenPipeError`` at
its next line. This module imports nothing of meshtorch (nor torch), so that both the command line,
which starts without torch, and a processor may use it.

Example:
    >>> from meshtorch.streams import reader_may_leave
    >>> with reader_may_leave():
    ...     print("step 1")
    step 1
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any


class ReaderMayLeave:
    """A stream, whose reader may go away before the program ends: from then on its lines are
    dropped, and the program goes on instead of failing with ``BrokenPipeError`` at its next line.
    The stream's descriptor is pointed at ``/dev/null`` too, so that its buffered lines flush
    without another error when the interpreter exits.

    Example:
        >>> class Gone:
        ...     def write(self, text):
        ...         raise BrokenPipeError(32, "Broken pipe")
        >>> out = ReaderMayLeave(Gone())
        >>> out.write("step 1"), out.gone
        (6, True)
    """

    def __init__(self, stream: Any) -> None:
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)
        except (AttributeError, OSError, ValueError):  # no descriptor (io.UnsupportedOperation is both)
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the stream's
        return getattr(self.stream, name)


def _same_pipe(a: Any, b: Any) -> bool:
    """Whether streams ``a`` and ``b`` write to one pipe (``2>&1 | head``): a reader gone from one is
    gone from both."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's capture)
        return False
    return os.path.samestat(sa, sb) and stat.S_ISFIFO(sa.st_mode)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """``sys.stdout`` as a :class:`ReaderMayLeave` while the block runs, and ``sys.stderr`` too where
    it writes to the same pipe (``2>&1 | head``). On the way out both are flushed through it before
    the streams are put back: lines still buffered when the reader left (``PYTHONUNBUFFERED``
    unset) are dropped there, not at the interpreter's exit, which would fail it with status 120.

    Example:
        >>> import sys
        >>> from meshtorch.streams import reader_may_leave
        >>> with reader_may_leave():
        ...     print(type(sys.stdout).__name__)
        ReaderMayLeave
    """
    saved = sys.stdout, sys.stderr
    wrapped = [ReaderMayLeave(saved[0])]
    sys.stdout = wrapped[0]
    if _same_pipe(*saved):
        wrapped.append(ReaderMayLeave(saved[1]))
        sys.stderr = wrapped[1]
    try:
        yield
    finally:
        for stream in wrapped:
            stream.flush()
        sys.stdout, sys.stderr = saved
