"""``initial_batchsize="auto"``: start where the call is predicted to fit.

[Note: starting where it fits] A search from a large initial size pays one out-of-memory
error per halving before its first success; on a GPU each is a partial forward thrown away.
So at its first call an ``"auto"`` function is traced twice on fake tensors
(``FakeTensorMode``: shapes and dtypes only, no memory, no kernels; tensors the function
reaches through its arguments or closures are taken as fakes of themselves), at two batch
sizes, while the peak tracker counts the bytes each trace allocates. The two peaks fit
``fixed + per_item * batch`` (see [Note: predicting peak memory on meta] in
``_planning/peak.py``), and the largest batch whose predicted peak stays within 80% of the
memory free at that moment is traced in turn: a peak that is not linear in the batch (the
outputs a function gathers dominate at small sizes) shows there, and the line is drawn again
through the largest size known to fit and the one that did not, at most three times. The
largest size whose own trace fits becomes the function's initial (and largest) size. What fake
tensors cannot see (allocator rounding, workspaces, kernels that allocate outside torch) is
what the margin is for; an out-of-memory error still has the last word and the usual search
takes over from there. A function that cannot run on fake tensors (``.item()``,
data-dependent shapes, custom kernels, tensors of a device the fake mode does not know) is
not predicted: that is logged once and the search starts at ``max_batchsize``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._common.devices import default_device, format_bytes, free_memory
from .._common.peak import NotPredictable, PeakPrediction, PeakTracker, fit

__all__ = ["AUTO", "DEFAULT_MAX_BATCHSIZE", "AutoStart"]

logger = logging.getLogger("adaptmem")

AUTO = "auto"
DEFAULT_MAX_BATCHSIZE = 65536
TRACE_SIZES = (8, 16)
CHECKS = 3  # traces of a predicted size before settling on the largest one that fitted
MARGIN = 0.8


def _trace(call: Callable[[int], Any], size: int) -> int:
    """Bytes ``call(size)`` allocates at its peak, run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = PeakTracker()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            result = call(size)
            del result
    except Exception as exc:  # noqa: BLE001 - any failure on fake tensors: no prediction
        raise NotPredictable(f"{type(exc).__name__}: {exc}") from None
    return tracker.peak


class AutoStart:
    """The initial size of an ``"auto"`` function, decided at its first call (see
    [Note: starting where it fits])."""

    def __init__(self, name: str, floor: int, ceiling: int,
                 device: torch.device | None) -> None:
        self.name = name
        self.floor = floor
        self.ceiling = ceiling
        self.device = device
        self.prediction: PeakPrediction | None = None
        self.reason = ""  # why there is no prediction
        self.initial: int | None = None
        self._lock = threading.Lock()

    def decide(self, call: Callable[[int], Any]) -> int:
        """The initial size: predicted once (thread-safe), then the same for every call."""
        with self._lock:
            if self.initial is None:
                self.initial = self._decide(call)
            return self.initial

    def _search(self, call: Callable[[int], Any], free: int) -> tuple[int, PeakPrediction]:
        """The largest size whose traced peak fits ``MARGIN * free``, and the last fit."""
        budget = MARGIN * free
        large = min(TRACE_SIZES[1], self.ceiling)
        small = max(1, min(TRACE_SIZES[0], large // 2))
        if small >= large:
            raise NotPredictable(f"max_batchsize {self.ceiling} leaves no two sizes to trace")
        peaks = {small: _trace(call, small), large: _trace(call, large)}
        prediction = fit((small, large), (peaks[small], peaks[large]))
        candidate = self._clamp(prediction.largest(free, MARGIN))
        for _ in range(CHECKS):
            if candidate in peaks:
                break
            peaks[candidate] = _trace(call, candidate)
            if peaks[candidate] <= budget:
                break
            base = max((n for n, p in peaks.items() if p <= budget and n < candidate),
                       default=min(peaks))
            if base >= candidate:
                break
            prediction = fit((base, candidate), (peaks[base], peaks[candidate]))
            candidate = min(candidate - 1, self._clamp(prediction.largest(free, MARGIN)))
        fitting = [n for n, p in peaks.items() if p <= budget]
        return self._clamp(max(fitting, default=self.floor)), prediction

    def _clamp(self, size: int) -> int:
        return max(self.floor, min(self.ceiling, size))

    def _decide(self, call: Callable[[int], Any]) -> int:
        device = self.device if self.device is not None else default_device()
        free = free_memory(device)
        try:
            start, prediction = self._search(call, free)
        except NotPredictable as exc:
            self.reason = str(exc)
            logger.info("%s: initial_batchsize='auto' could not trace the function on fake "
                        "tensors (%s); the search starts at max_batchsize=%d",
                        self.name, exc, self.ceiling)
            return self.ceiling
        self.prediction = prediction
        logger.info("%s: initial_batchsize='auto' predicts %s per item + %s fixed; %s free on "
                    "%s, so the search starts at batchsize=%d",
                    self.name, format_bytes(int(prediction.per_item_bytes)),
                    format_bytes(prediction.fixed_bytes), format_bytes(free), device, start)
        return start
