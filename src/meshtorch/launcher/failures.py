"""How a processor's exception reaches the caller of a launch.

The caller gets one exception that is *both* a :class:`ProcessorError` (it
names the failing processor's rank and coordinates) and an instance of the
class the processor raised, so ``except mt.errors.ShapeError`` or
``except KeyError`` catches it as if it had been raised in the caller. The
processor's own exception is the ``__cause__``; from another process its
formatted traceback is, in turn, that exception's cause.

Example:
    >>> import meshtorch as mt
    >>> from meshtorch.launcher.failures import processor_error
    >>> err = processor_error(mt.errors.ShapeError("dim d is 3, not 4"), 1, {"m": 1})
    >>> isinstance(err, mt.errors.ShapeError), isinstance(err, mt.errors.ProcessorError)
    (True, True)
    >>> str(err)
    "processor 1 {'m': 1} raised ShapeError: dim d is 3, not 4"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshtorch.errors import CommError, MeshTorchError, ProcessorError

# after the first failure, how long a launch waits for the other processors' reports (to
# tell a root cause from the CommErrors it provokes) before it gives up on them
FAILURE_GRACE_S = 2.0

# attributes some built-in exceptions keep outside __dict__ (OSError.errno, KeyError's key is in args)
_BUILTIN_FIELDS = ("errno", "strerror", "filename", "filename2", "name", "path", "obj")


class RemoteTraceback(MeshTorchError):
    """The formatted traceback of an exception raised in another process."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def _rebuild(original: type, message: str, rank: int | None, coords: dict, args: tuple, state: dict):
    """Unpickle a combined error (its class is made at run time, so pickle cannot name it)."""
    err = _combined_class(original)(message, rank, coords)
    err.args = args
    err.__dict__.update(state)
    return err


class _OnProcessor(ProcessorError):
    """Mixed into the class a processor raised: ``str`` is the processor's message."""

    _original: type[BaseException] = Exception

    def __init__(self, message: str, rank: int | None = None, coords: dict | None = None):
        ProcessorError.__init__(self, message, rank, coords)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:
        state = {k: v for k, v in self.__dict__.items() if k not in ("message", "rank", "coords")}
        return _rebuild, (self._original, self.message, self.rank, self.coords, self.args, state)


_COMBINED: dict[type, type] = {}


def _combined_class(original: type[BaseException]) -> type[ProcessorError]:
    """``class ProcessorShapeError(ProcessorError, ShapeError)``, made once per original class."""
    original = getattr(original, "_original", original)
    if original not in _COMBINED:
        name = f"Processor{original.__name__}"
        body = {"_original": original, "__module__": __name__,
                "__doc__": f"{original.__name__} raised on a processor."}
        _COMBINED[original] = type(name, (_OnProcessor, original), body)
    return _COMBINED[original]


def processor_error(exc: BaseException, rank: int, coords: dict, where: str = "",
                    note: str = "") -> ProcessorError:
    """The exception to raise in the caller for ``exc``, raised on processor ``rank``.

    It is an instance of ``type(exc)`` and of :class:`ProcessorError`, keeps
    ``exc``'s ``args`` and attributes, and has ``exc`` as its ``__cause__``.
    Exceptions that are not ``Exception``s (``KeyboardInterrupt``,
    ``SystemExit``) or whose class cannot be subclassed become a plain
    :class:`ProcessorError`. ``where`` is added after the coordinates, e.g.
    ``"(meta backend)"``; ``note`` is added at the end of the message, e.g. what
    became of the other processors.

    Example:
        >>> from meshtorch.launcher.failures import processor_error
        >>> err = processor_error(KeyError("w"), 0, {"b": 0})
        >>> isinstance(err, KeyError), err.args, err.coords
        (True, ('w',), {'b': 0})
    """
    original = getattr(type(exc), "_original", type(exc))
    message = f"processor {rank} {coords}{' ' + where if where else ''} raised {original.__name__}: {exc}"
    if note:
        message += f" ({note})"
    err: ProcessorError | None = None
    if isinstance(exc, Exception) and original is not ProcessorError:
        try:
            err = _combined_class(original)(message, rank, coords)
        except TypeError:  # a class that cannot be a base, or whose instance layout conflicts
            err = None
    if err is None:
        err = ProcessorError(message, rank, coords)
    else:
        _copy_state(exc, err)
    err.__cause__ = exc
    return err


def _copy_state(exc: BaseException, err: ProcessorError) -> None:
    """Give ``err`` what a handler of ``type(exc)`` may read: its args and attributes."""
    err.args = exc.args
    for field in _BUILTIN_FIELDS:
        if hasattr(exc, field):
            try:
                setattr(err, field, getattr(exc, field))
            except (AttributeError, TypeError):  # read-only on this class
                pass
    err.__dict__.update({k: v for k, v in vars(exc).items() if k not in ("message", "rank", "coords")})


def root_cause(order: Sequence[int], is_abandonment: Callable[[int], bool]) -> int:
    """The rank whose failure to report: the first failure that is not another
    processor's abandonment (a ``CommError`` provoked by the first failure).

    Example:
        >>> from meshtorch.launcher.failures import root_cause
        >>> root_cause([3, 1], lambda rank: rank == 3)
        1
    """
    return ([r for r in order if not is_abandonment(r)] or list(order))[0]


def is_comm_error(exc: Any) -> bool:
    """Whether ``exc`` is a :class:`CommError` (the abandonment a failure provokes in its group)."""
    return isinstance(exc, CommError)
