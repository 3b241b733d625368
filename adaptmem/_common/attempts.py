"""What code running inside a retried training step tells the step's retries.

A step under ``@adaptive.batch(accumulate=...)`` runs as attempts at smaller and smaller
sizes until one fits. Code inside an attempt learns of it here (a context variable, so
threads and tasks keep their own): ``adaptive.microbatches`` files the batch's length (see
[Note: a batch shorter than its size] in ``_execution/accumulate.py``), and a spill handle
files how to undo what a failed attempt made it change (see [Note: a failed attempt's
escalation] in ``_spilling/_spill.py``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

__all__ = ["Attempt", "current_attempt", "enter_attempt", "leave_attempt"]


class Attempt:
    """One call of a retried step, across its attempts: the batch lengths ``microbatches``
    was asked to split in the attempt running now, by size; and what to undo once an
    attempt at a smaller size succeeded."""

    __slots__ = ("split", "undo")

    def __init__(self) -> None:
        self.split: dict[int, int] = {}
        self.undo: list[Callable[[], None]] = []


_ATTEMPT: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar(
    "adaptmem_attempt", default=None)


def current_attempt() -> Attempt | None:
    """The retried step running in this context, or None."""
    return _ATTEMPT.get()


def enter_attempt(attempt: Attempt) -> contextvars.Token[Attempt | None]:
    """Run the code until ``leave_attempt(token)`` as part of ``attempt``."""
    return _ATTEMPT.set(attempt)


def leave_attempt(token: contextvars.Token[Attempt | None]) -> None:
    _ATTEMPT.reset(token)
