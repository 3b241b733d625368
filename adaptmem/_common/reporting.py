"""Where statistics are found: every engine and decorated function that keeps figures
registers them here, so ``adaptive.memory_stats()`` can show them all in one place.

[Note: one place for statistics] A source registers an object with ``as_dict()`` (its live
counters) under a section name, for as long as its owner lives: a pager until it is
collected, a decorated function while its module keeps it. Nothing is copied at
registration; readers take a snapshot with ``as_dict()`` when they ask. Owners are held
weakly, so registering never keeps a model or a handle alive.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["Reports", "report", "live_reports", "untouched"]

# [Note: a trace is not counted] ``initial_batchsize="auto"`` and ``model=`` run the
# function on fake tensors to predict its peak; the engines it calls count that run as if it
# were real (a pager's forwards, transfers and bytes moved: 168 forwards after a call that
# ran 4). Their figures are put back as they were when the trace ends. A source that can be
# put back offers ``snapshot()`` and ``restore(state)``; the decorators' own counters, which
# a trace does not touch, offer neither.


class Reports(Protocol):
    """What a statistics source offers: its figures as a plain dict."""

    def as_dict(self) -> dict[str, Any]: ...


_lock = threading.Lock()
_order = itertools.count()
_live: dict[int, tuple[int, str, Reports]] = {}  # id(owner) -> (order, section, stats)


def _forget(key: int) -> None:
    with _lock:
        _live.pop(key, None)


def report(owner: object, section: str, stats: Reports) -> None:
    """Show ``stats`` under ``section`` (e.g. ``"pager"``) while ``owner`` lives.

    Registering the same owner again replaces its entry.
    """
    key = id(owner)
    with _lock:
        fresh = key not in _live
        _live[key] = (next(_order), section, stats)
    if fresh:
        weakref.finalize(owner, _forget, key)


def live_reports() -> list[tuple[str, Reports]]:
    """(section, stats) of every live source, oldest first."""
    with _lock:
        entries = sorted(_live.values(), key=lambda e: e[0])
    return [(section, stats) for _, section, stats in entries]


@contextlib.contextmanager
def untouched() -> Iterator[None]:
    """Every live source's figures as they were before the block (those that can be put
    back): see [Note: a trace is not counted]."""
    with _lock:
        sources = [stats for _, _, stats in _live.values() if hasattr(stats, "restore")]
    saved = [(stats, stats.snapshot()) for stats in sources]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for stats, state in saved:
            stats.restore(state)  # type: ignore[attr-defined]
