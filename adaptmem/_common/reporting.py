"""Where statistics are found: every engine and decorated function that keeps figures
registers them here, so ``adaptive.memory_stats()`` can show them all in one place.

[Note: one place for statistics] A source registers an object with ``as_dict()`` (its live
counters) under a section name, for as long as its owner lives: a pager until it is
collected, a decorated function while its module keeps it. Nothing is copied at
registration; readers take a snapshot with ``as_dict()`` when they ask. Owners are held
weakly, so registering never keeps a model or a handle alive.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Protocol

__all__ = ["Reports", "report", "live_reports"]


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
