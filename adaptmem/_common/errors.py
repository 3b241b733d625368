"""The exception classes adaptmem raises; all derive from AdaptmemError."""

from __future__ import annotations

import builtins
import threading
from typing import Any

from .enums import TextEnum

__all__ = [
    "Phase",
    "AdaptmemError",
    "CommandLineError",
    "OutOfMemoryError",
    "PlacementError",
    "LoadError",
    "RankError",
    "oom_error_for",
    "first_line",
    "add_note",
    "EXCEPTION_GROUP",
]

# ``BaseExceptionGroup`` (Python 3.11+), None before: what ``asyncio.TaskGroup`` raises.
EXCEPTION_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` as ``exc.add_note`` does (Python 3.11+); on Python 3.10, which
    prints no notes, append it to a string message instead, so that it is still seen."""
    method = getattr(exc, "add_note", None)
    if method is not None:
        method(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])


def first_line(exc: BaseException, limit: int = 200, typed: bool = True) -> str:
    """The first line of ``exc``'s message (``Type: ...`` when ``typed``), cut to ``limit``
    characters; the type's name when the message is empty."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{type(exc).__name__}: {lines[0]}" if typed else lines[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


class AdaptmemError(RuntimeError):
    """Root of every error adaptmem raises on its own account."""


class CommandLineError(Exception):
    """A mistake in what was asked on the ``adaptmem`` command line: the console script
    reports it in one line on stderr with exit status 2, never a traceback."""


class Phase(TextEnum):
    """Where memory ran out; compares equal to its text (``Phase.TRANSFER == "transfer"``)."""

    COMPUTE = "compute"  # inside the user's function: a smaller batch or step helps
    TRANSFER = "transfer"  # while moving weights to a device: finer units help


class OutOfMemoryError(AdaptmemError):
    """Memory ran out and adaptmem could not adapt further.

    Instances raised by adaptmem are also instances of the original out-of-memory type
    (``torch.OutOfMemoryError``, ``MemoryError``, ...), so existing ``except`` clauses keep
    working. ``phase`` says where memory ran out: ``"compute"`` (inside the user's function)
    or ``"transfer"`` (while moving weights to a device), a ``Phase`` equal to that text.
    ``beyond_device`` is True for a transfer error whose weights, needed at once, are more
    than the device can ever hold (its memory, its memory fraction or ``device_budget``):
    no smaller batch and no residency given back can help.
    """

    phase: Phase = Phase.COMPUTE
    engine_id: int | None = None  # a transfer error's pager (its id()), for model=
    beyond_device: bool = False


class PlacementError(AdaptmemError):
    """A model could not be paged, chunked or split as asked."""


class LoadError(AdaptmemError):
    """A checkpoint could not be read or does not match the model."""


class RankError(AdaptmemError):
    """Another rank of a ``group=`` call raised, or the ranks could not exchange in time.

    ``rank`` is the global rank that raised (None when no rank answered for it: one died,
    hung, or stopped calling the function); ``error_type`` and ``error_message`` are the
    name and text of that rank's error (None if it gave none). The rank that raised gets
    its own error, with its traceback, not this one.
    """

    def __init__(self, message: str, rank: int | None = None, error_type: str | None = None,
                 error_message: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.error_message = error_message


_oom_types: dict[type[BaseException], type[OutOfMemoryError]] = {}
_oom_types_lock = threading.Lock()


def oom_error_for(original: BaseException) -> type[OutOfMemoryError]:
    """The OutOfMemoryError subclass that is also an instance of ``type(original)``."""
    return _oom_type(type(original))


def _oom_type(base: type[BaseException]) -> type[OutOfMemoryError]:
    if issubclass(base, OutOfMemoryError):
        return base
    if EXCEPTION_GROUP is not None and issubclass(base, EXCEPTION_GROUP):
        return OutOfMemoryError  # a group is built from its errors: the group is the cause
    with _oom_types_lock:
        cls = _oom_types.get(base)
        if cls is None:
            try:
                cls = type(f"OutOfMemoryError[{base.__name__}]", (OutOfMemoryError, base),
                           {"__reduce__": _reduce_oom, "_base": base})
                # Constructed with one message argument whatever the original took, and
                # printed as that message (NumPy's _ArrayMemoryError.__str__ reads
                # attributes only its own constructor sets).
                cls.__init__ = RuntimeError.__init__  # type: ignore[assignment,misc]
                cls.__str__ = BaseException.__str__  # type: ignore[assignment,method-assign]
            except TypeError:  # an incompatible layout (an OSError subclass, say)
                cls = OutOfMemoryError
            cls.__module__ = __name__
            _oom_types[base] = cls
        return cls


def _reduce_oom(error: OutOfMemoryError) -> tuple[Any, ...]:
    """Pickle a made-up class's error as its original type, so that it crosses processes
    (multiprocessing, ``torch.multiprocessing.spawn``) as the same kind of error."""
    return _rebuild_oom, (type(error)._base, error.args, dict(error.__dict__))  # type: ignore[attr-defined]


def _rebuild_oom(base: type[BaseException], args: tuple[Any, ...],
                 state: dict[str, Any]) -> OutOfMemoryError:
    error = _oom_type(base)(*args)
    error.__dict__.update(state)
    return error
