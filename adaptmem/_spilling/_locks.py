"""Locks of a spilling step that the step's own garbage cannot deadlock on.

[Note: releases deferred while a lock is held]
A spilled tensor's ``Entry`` gives its region of the scratch file back when it is collected
(``Entry.__del__``), which takes the step's lock and then the scratch file's. A collection
can run inside any allocation, and so inside code that already holds one of them: the
scratch file's free list is searched under its own lock, and a cycle collected there that
freed an entry of the same step waited on that lock, held by its own thread, for good (a
graph reachable only through a reference cycle: a traceback, an object that holds itself).
A thread holding the file's lock could also collect an entry whose release waits for the
step's lock, held by a second thread that waits for the file's. So these locks count how
many of them the calling thread holds, and a release (``when_free``) that comes while it
holds any is queued and runs once the thread has let the last one go: a collection never
waits on a lock, and the locks are taken in one order, the step's before the file's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HeldLock", "when_free"]

logger = logging.getLogger("adaptmem")
_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)  # type: ignore[no-any-return]


def when_free(fn: Callable[..., None], *args: Any) -> None:
    """Call ``fn(*args)`` now, or, while this thread holds a ``HeldLock``, once it holds
    none (see [Note: releases deferred while a lock is held])."""
    if _depth():
        pending = getattr(_local, "pending", None)
        if pending is None:
            pending = _local.pending = []
        pending.append((fn, args))
    else:
        fn(*args)


def _run_pending() -> None:
    pending = getattr(_local, "pending", None)
    while pending:
        fn, args = pending.pop(0)
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a release that fails must not stop the others
            logger.exception("adaptive.spill: a deferred release failed")


class HeldLock:
    """``lock`` (a ``Lock`` or ``RLock``), counting this thread's holds; the last release
    runs what ``when_free`` queued meanwhile. Works under a ``threading.Condition``."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        # A Condition waiting on an RLock releases and restores all of its holds.
        for name in ("_release_save", "_acquire_restore", "_is_owned"):
            if hasattr(lock, name):
                setattr(self, name, getattr(lock, name))

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        _local.depth = _depth() + 1  # before: a collection in acquire() is deferred too
        got = False
        try:
            got = bool(self._lock.acquire(blocking, timeout))
        finally:  # not taken (or a Ctrl-C while waiting): the count goes back
            if not got:
                _local.depth -= 1
        return got

    def release(self) -> None:
        self._lock.release()
        _local.depth -= 1
        if not _local.depth:
            _run_pending()

    def __enter__(self) -> HeldLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
