"""``progress=True``: items done, the current step and the retries of a range or chunked call.

[Note: where progress goes] With tqdm installed (``pip install adaptmem[progress]``) a bar
goes to stderr, through tqdm, the only place the library writes to a stream, and only when
the caller asked for progress. Without tqdm the same line goes to the ``adaptmem`` logger
at INFO, at most every ``LOG_EVERY`` seconds and once at the end, so a long call is visible
in a job's log without flooding it. Under ``group=`` only the group's rank 0 shows progress
(its own items), as one bar per rank would garble a shared terminal.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .stats import CallStats

__all__ = ["Progress", "LOG_EVERY"]

logger = logging.getLogger("adaptmem")

LOG_EVERY = 10.0  # seconds between progress lines on the logger


def load_tqdm() -> Any:
    """tqdm's bar class, or None when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """Progress of one call over ``total`` items (see [Note: where progress goes])."""

    def __init__(self, stats: CallStats, total: int, what: str) -> None:
        self.stats = stats
        self.total = total
        self.what = what
        self.done = 0
        self._retries = stats.retries  # the counters are the function's; show this call's
        self._shown: tuple[int, int] | None = None
        self._logged = time.monotonic()
        bar = load_tqdm()
        self.bar = None if bar is None else bar(total=total, desc=stats.name, unit="item",
                                                dynamic_ncols=True)

    def advance(self, items: int, step: int) -> None:
        """``items`` more are done; the call goes on with ``step``."""
        self.done += items
        retries = self.stats.retries - self._retries
        if self.bar is not None:
            if self._shown != (step, retries):
                self._shown = (step, retries)
                self.bar.set_postfix_str(f"{self.what}={step}, retries={retries}",
                                         refresh=False)
            self.bar.update(items)
            return
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY or self.done >= self.total:
            self._logged = now
            logger.info("%s: %d/%d items (%.0f%%), %s=%d, %d retries", self.stats.name,
                        self.done, self.total, 100.0 * self.done / max(self.total, 1),
                        self.what, step, retries)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
