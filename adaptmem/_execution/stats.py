"""What a decorated function counts, and what it tells an ``on_adapt`` callback.

[Note: cheap counting] The settled success path of ``@adaptive.batch`` costs about two
microseconds, and reading the clock costs a twentieth of that on a loaded machine, so that
path only increments ``calls`` and compares the size with the last one. The clock is read
before an attempt only where the record says it may fail: a size not yet known to fit (the
first calls, a probe), and every retry. An attempt at a size that had fitted before which
runs out of memory anyway (memory got tighter) is counted in ``failed_attempts`` and
``untimed_failures``, its duration unknown. Counters are plain integers: calls from several
threads at once may lose an increment, never corrupt a record or a retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._common.devices import default_device, free_memory
from .._common.errors import add_note

__all__ = ["CallStats", "Adaptation", "AdaptationKind", "Watch"]

logger = logging.getLogger("adaptmem")

AdaptationKind = Literal["probe", "shrink", "fits", "gave_up", "moved"]


class CallStats:
    """Counters of one decorated function, live: read them any time, ``reset()`` to start over.

    Attributes:
        calls: calls that reached their first attempt.
        attempts: runs of the function (``batch``) or of a step (``range``, ``chunked``).
        failed_attempts: attempts that ran out of memory (under ``group=``, also attempts
            whose result was dropped because another rank ran out).
        retries: attempts made again, smaller, after a failed one.
        seconds_lost: time spent in failed attempts that were timed (see
            ``untimed_failures``).
        untimed_failures: failed attempts at a size that had fitted before, whose time is
            not measured so that the success path stays cheap (see [Note: cheap counting]).
        last_size, smallest_size, largest_size: sizes of attempts that succeeded (None
            before the first), leaving out the last step of a range that was shorter
            because that was all that was left.

    Example:
        >>> from adaptmem import adaptive
        >>> @adaptive.batch(initial_batchsize=8)
        ... def f(batchsize):
        ...     return batchsize
        >>> f(), f()
        (8, 8)
        >>> f.stats.calls, f.stats.failed_attempts, f.stats.last_size
        (2, 0, 8)
    """

    __slots__ = ("kind", "name", "what", "calls", "_extra_attempts", "failed_attempts",
                 "retries", "seconds_lost", "untimed_failures", "last_size", "smallest_size",
                 "largest_size")

    def __init__(self, kind: str, name: str, what: str) -> None:
        self.kind = kind
        self.name = name
        self.what = what
        self.reset()

    def reset(self) -> None:
        """Set every counter back to zero and forget the sizes."""
        self.calls = 0
        self._extra_attempts = 0  # attempts beyond the first of each call
        self.failed_attempts = 0
        self.retries = 0
        self.seconds_lost = 0.0
        self.untimed_failures = 0
        self.last_size: int | None = None
        self.smallest_size: int | None = None
        self.largest_size: int | None = None

    @property
    def attempts(self) -> int:
        return self.calls + self._extra_attempts

    def saw(self, size: int) -> None:
        """An attempt at ``size`` succeeded and ``size`` differs from the last one."""
        self.last_size = size
        if self.smallest_size is None or size < self.smallest_size:
            self.smallest_size = size
        if self.largest_size is None or size > self.largest_size:
            self.largest_size = size

    def retried(self) -> None:
        """A failed attempt is made again, smaller."""
        self.retries += 1
        self._extra_attempts += 1

    def range_started(self) -> None:
        """A range or chunked call begins; ``step_started`` counts its attempts."""
        self.calls += 1
        self._extra_attempts -= 1  # the call's first step is its first attempt

    def step_started(self) -> None:
        """A range or chunked call makes one more attempt."""
        self._extra_attempts += 1

    def failed(self, seconds: float | None) -> None:
        """An attempt failed after ``seconds`` (None: not timed)."""
        self.failed_attempts += 1
        if seconds is None:
            self.untimed_failures += 1
        else:
            self.seconds_lost += seconds

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (a snapshot)."""
        return {
            "calls": self.calls,
            "attempts": self.attempts,
            "failed_attempts": self.failed_attempts,
            "retries": self.retries,
            "seconds_lost": self.seconds_lost,
            "untimed_failures": self.untimed_failures,
            f"last_{self.what}": self.last_size,
            f"smallest_{self.what}": self.smallest_size,
            f"largest_{self.what}": self.largest_size,
        }

    def __str__(self) -> str:
        sizes = "none succeeded yet" if self.last_size is None else (
            f"last {self.last_size}, {self.smallest_size}..{self.largest_size}")
        untimed = f", {self.untimed_failures} untimed" if self.untimed_failures else ""
        return (f"{self.kind} {self.name}: {_count(self.calls, 'call')}, "
                f"{_count(self.attempts, 'attempt')} ({self.failed_attempts} failed, "
                f"{self.seconds_lost:.3g} s lost{untimed}), {_count(self.retries, 'retry')}; "
                f"{self.what} {sizes}")

    def __repr__(self) -> str:
        return f"CallStats({self.as_dict()})"


def _count(n: int, word: str) -> str:
    plural = word[:-1] + "ies" if word.endswith("y") else word + "s"
    return f"{n} {word if n == 1 else plural}"


@dataclass(frozen=True)
class Adaptation:
    """One change of size, as handed to an ``on_adapt`` callback.

    Attributes:
        function: the decorated function's qualified name.
        kind: ``"probe"`` (a call tries ``new_size``, above ``old_size``, the largest size
            known to fit), ``"shrink"`` (``old_size`` ran out of memory, here or on another
            rank; the call retries at ``new_size``), ``"fits"`` (``new_size`` ran to the end
            after ``old_size``, the call's first size, ran out) or ``"gave_up"``
            (``old_size``, the smallest allowed, ran out; the call raises, ``new_size`` is
            None) or ``"moved"`` (a call starts at ``new_size``, not ``old_size``, the size
            the last call ran, without a failure or a probe: free memory moved to where
            another size is known to fit).
        old_size, new_size: as above.
        free_bytes: free memory on the function's device when it happened (None if unknown).
        rank: the global rank under ``group=``, else None.
        failed_rank: under ``group=``, for ``"shrink"`` and ``"gave_up"``, the first rank
            that ran out of memory; else None.
    """

    function: str
    kind: AdaptationKind
    old_size: int
    new_size: int | None
    free_bytes: int | None
    rank: int | None = None
    failed_rank: int | None = None


class Watch:
    """What a call reports to: the function's ``CallStats`` and its ``on_adapt`` callback.

    [Note: a failing callback] An exception from ``on_adapt`` propagates out of the decorated
    call, with a note naming the callback. It is called only after the size record has
    learned what happened, so the next call starts from a consistent record; the call that
    raised is abandoned. Under ``group=`` the other ranks then wait for this one at the next
    exchange and raise ``RankError`` after ``group_timeout``: a callback must not raise there.
    """

    __slots__ = ("stats", "callback", "device", "rank")

    def __init__(self, stats: CallStats, callback: Callable[[Adaptation], Any] | None,
                 device: torch.device | None) -> None:
        self.stats = stats
        self.callback = callback
        self.device = device
        self.rank: int | None = None

    def tell(self, kind: AdaptationKind, old: int, new: int | None,
             failed_rank: int | None = None) -> None:
        """Hand an ``Adaptation`` to the callback, if there is one."""
        callback = self.callback
        if callback is None:
            return
        if failed_rank is None and kind in ("shrink", "gave_up"):
            failed_rank = self.rank  # None without a group
        event = Adaptation(self.stats.name, kind, old, new, self._free(), self.rank,
                           failed_rank)
        try:
            callback(event)
        except Exception as exc:  # see [Note: a failing callback]
            add_note(exc, f"raised by the on_adapt callback {callback!r} of "
                          f"{self.stats.name} for {event}")
            raise

    def _free(self) -> int | None:
        try:
            return free_memory(self.device if self.device is not None else default_device())
        except Exception:  # an event must never hide the user's work
            return None
