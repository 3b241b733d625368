"""Thread pools whose threads get small stacks, leaving the rest of the process alone.

glibc keeps an exited thread's stack mapped for the next one, and a cap on the data segment
(``set_cpu_memory_limit``, ``ulimit -d``) counts a thread's whole stack, touched or not: 8 MiB
a thread by default. adaptmem's own threads only read, fault and copy, so they get small
stacks. Python sets the stack size of new threads for the whole process
(``threading.stack_size``); a pool here sets it only while it starts a thread, under one lock
that every such pool shares, and puts it back at once: two loads at once cannot leave it
changed, and a thread the program starts elsewhere gets a small stack only if it starts in
those few microseconds."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["SmallStackPool"]

_STACK_LOCK = threading.Lock()


class SmallStackPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose threads have stacks of ``stack_bytes``."""

    def __init__(self, max_workers: int, stack_bytes: int, **kwargs: Any) -> None:
        super().__init__(max_workers, **kwargs)
        self._stack_bytes = stack_bytes

    def _adjust_thread_count(self) -> None:  # where ThreadPoolExecutor starts its threads
        if len(self._threads) >= self._max_workers:  # type: ignore[attr-defined]
            super()._adjust_thread_count()  # type: ignore[misc]
            return
        with _STACK_LOCK:
            previous = threading.stack_size(self._stack_bytes)
            try:
                super()._adjust_thread_count()  # type: ignore[misc]
            except RuntimeError:
                # The system starts no more threads (RLIMIT_NPROC, a cgroup's pids.max): the
                # work queued runs on the threads there are. With none, the caller is told
                # (the work is queued: shut the pool down with cancel_futures=True).
                if not self._threads:  # type: ignore[attr-defined]
                    raise
                self._max_workers = len(self._threads)  # type: ignore[attr-defined]
            finally:
                threading.stack_size(previous)
