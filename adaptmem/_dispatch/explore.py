"""Choosing residency by measured items per second, not by what fits.

[Note: exploring residency] What fits says little about what is fast: with a slow link,
every weight resident at a smaller batch beats a larger batch that pages part of the model
per forward; with a fast link, the larger batch may win. So ``model=`` measures what it runs
and keeps the faster:

- A placement (the resident bytes of each model) is measured over ``SAMPLES`` calls that
  ran at one size without an out-of-memory error, timed around the call, items counted at
  the first model's forward (the leading dimension of its first tensor argument). While it
  is measured its size record is held at the size that fits (``SizeRecord.hold``): no probe
  above it, so measuring costs no failed attempt and every sample is of one configuration.
  Its rate is the best of those samples: load from other processes only ever slows a call,
  so the fastest is the least disturbed. The first call after a placement changes is not a
  sample (the pager learns that forward, without prefetch).
- Then one neighbour is tried: twice the resident bytes (all of them at most), else half.
  Going up leaves less room: where the function could be traced, the new placement's
  record starts at the size the first call's prediction says fits next to the added
  weights (never above the size in use) and climbs towards where it says nothing fits, or
  what failed at the best placement if smaller (see [Note: predicting the first size] in
  ``_execution/auto.py``), so the trial is predicted to run without an out-of-memory
  error; without a prediction it learns that what failed at the best placement fails
  there too and starts at half of it. Going down leaves more room: the size in use
  fits, and the trial runs it. Either trial is judged at a size it already runs, not at the
  larger one it might climb to afterwards: exploring costs no failed attempt of its own,
  and a placement with less resident that loses at the size in use is not given the
  chance to win with a larger batch (the limit of this rule).
- After the trial the placement goes back to the best one and measures it again: the
  trial is compared with the mean of the best's rates before and after, so load that came
  or went in between weighs on both alike. A trial at least ``GAIN`` faster is kept and
  exploring goes on in that direction; a first trial up that loses leaves down to try; a
  direction that loses ends exploring. Then the decorator stays where it is and its search
  climbs as usual, measuring nothing (no clock read, no hook, one counter per call), until
  ``EPOCH`` calls have passed or the placement changed for memory (taken again), when
  everything is forgotten and exploring starts again.
- Generator and async functions are not explored: their work runs after the call returns,
  so no call can be timed (measuring them held their size record at every call, and they
  never probed a larger batch again).
- A trial up is made only when the bytes it adds are at most half of the memory free
  between calls, and never to a residency at or above one that had to be given back to
  activations (compute out of memory at the smallest size) in the same epoch. Weights that
  do not fit when moved put the models back where they were and count as given back. A
  change of engine (see [Note: paging or chunking] in engine.py) forgets what was measured,
  not what was given back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Explorer", "Measured", "clock"]

logger = logging.getLogger("adaptmem")

SAMPLES = 3  # clean calls at one size measured per placement
GAIN = 1.03  # how much faster a trial must be than the best so far to be kept
EPOCH = 1024  # calls after which what was measured is forgotten and exploring starts again
MIN_STEP = 1 << 20  # residency changes smaller than this are not worth a re-placement
ROOM_SHARE = 0.5  # a trial up adds at most this share of the memory free between calls

clock: Callable[[], float] = time.perf_counter  # read when a measuring explorer is made


@dataclass(frozen=True)
class Measured:
    """A placement's resident bytes per model, its best items per second, at what size."""

    resident: tuple[int, ...]
    rate: float
    size: int


class _Items:
    """Counts the items a model's forwards see: the leading dimension of the first tensor
    argument (1 for a forward without one)."""

    def __init__(self) -> None:
        self.items = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                self.items += value.shape[0] if value.dim() else 1
                return
        self.items += 1


class Explorer:
    """Measures the placements a decorated function runs at and proposes the next one
    (see [Note: exploring residency])."""

    def __init__(self, model: nn.Module, weights: list[int], name: str) -> None:
        self.model = model
        self.weights = tuple(weights)
        self.name = name
        self.clock = clock
        self.counter = _Items()
        self._hook: Any = None
        self.trials = 0
        self.forget()

    def forget(self) -> None:
        """Start exploring afresh: nothing measured, nothing tried."""
        self.best: Measured | None = None
        self.trial: int = 0  # +1 or -1 while the current placement is a trial against best
        self.pending: tuple[Measured, int] | None = None  # a trial measured, and its direction
        self.kept: int = 0  # the direction of the last trial kept
        self.tried: set[tuple[int, ...]] = set()
        self.too_much: tuple[int, ...] | None = None  # residency given back this epoch
        self.samples: list[float] = []
        self.sample_size = 0
        self.placements = -1  # the placement count this explorer knows of
        self.calls = 0
        self.watching = True

    # -- the calls -------------------------------------------------------------------------

    def mark(self) -> tuple[float, int]:
        """Before a measured call: the time and items counted so far."""
        if self._hook is None:
            self._hook = self.model.register_forward_pre_hook(self.counter, with_kwargs=True)
        return self.clock(), self.counter.items

    def tick(self, placements: int) -> None:
        """After a call while not measuring: count it towards the epoch, and look again when
        the epoch ends or the placement changed for memory."""
        self.calls += 1
        if self.calls >= EPOCH or placements != self.placements:
            self.forget()

    def moved(self, placements: int) -> None:
        """The placement changed as this explorer knows (its move, a give-back): the next
        call is the new placement's first, not a sample."""
        self.placements = placements
        self.samples.clear()
        self.sample_size = 0

    def switched(self, placements: int) -> None:
        """The engine changed at the same resident bytes: what was measured under the old
        one is forgotten, the residency given back this epoch is not (see [Note: paging or
        chunking] in engine.py)."""
        too_much = self.too_much
        self.forget()
        self.too_much = too_much
        self.placements = placements

    def observe(self, mark: tuple[float, int], resident: tuple[int, ...], placements: int,
                size: int, clean: bool, free: Callable[[], int]
                ) -> tuple[tuple[int, ...], int] | None:
        """After a measured call (``mark`` taken before it) at ``resident`` running ``size``:
        record it; return the resident bytes to move to and the direction (+1 more, -1
        fewer), or None to stay."""
        seconds = self.clock() - mark[0]
        items = self.counter.items - mark[1]
        self.calls += 1
        if placements != self.placements:  # changed for memory (taken again): start afresh
            self.forget()
            self.placements = placements
        if self.sample_size == 0:  # the placement's first call (the pager learns it)
            self.sample_size = -1
            return None
        if not clean or items <= 0 or seconds <= 0:
            self.samples.clear()
            return None
        if size != self.sample_size:
            self.samples.clear()
            self.sample_size = size
        self.samples.append(items / seconds)
        if len(self.samples) < SAMPLES:
            return None
        here = Measured(resident, max(self.samples), size)
        self.samples.clear()
        return self._judge(here, free)

    def gave_back(self, resident: tuple[int, ...]) -> None:
        """``resident`` ran out of memory at the smallest size: never try it, or more, this
        epoch; what runs next is judged against the best placement measured."""
        self.too_much = resident
        if self.best is not None and self._at_or_above(self.best.resident):
            self.best = None
        self.trial = -1 if self.best is not None else 0
        self.kept = 0
        self.watching = True

    def stop(self) -> None:
        """Stop counting items (the model is given back or exploring is done)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- the choice ------------------------------------------------------------------------

    def _judge(self, here: Measured, free: Callable[[], int]
               ) -> tuple[tuple[int, ...], int] | None:
        best, trial = self.best, self.pending
        if self.trial and best is not None:
            # A trial measured: back to the best, measured again around it.
            self.pending, self.trial = (here, self.trial), 0
            return best.resident, -self.pending[1]
        if trial is not None and best is not None:
            # Back at the best: compare the trial with its rate before and after, so load
            # that came or went meanwhile weighs on both sides alike.
            self.pending = None
            measured, direction = trial
            best = Measured(best.resident, (best.rate + here.rate) / 2, here.size)
            if measured.rate >= GAIN * best.rate:
                logger.info("%s: %s resident runs %.0f items/s against %.0f at %s: kept",
                            self.name, _mib(measured.resident), measured.rate, best.rate,
                            _mib(best.resident))
                best, self.kept = measured, direction
            else:
                logger.info("%s: %s resident runs %.0f items/s against %.0f at %s: not kept",
                            self.name, _mib(measured.resident), measured.rate, best.rate,
                            _mib(best.resident))
                # Up lost: down is still to try. A direction that went on and lost: done.
                self.kept = 0 if self.kept == 0 and direction > 0 else 2
        else:
            best = here
        self.best = best
        move = self._next(best, free)
        if move is not None:
            return move
        self._done()
        if here.resident != best.resident:
            return best.resident, (1 if sum(best.resident) > sum(here.resident) else -1)
        return None

    def _next(self, best: Measured, free: Callable[[], int]
              ) -> tuple[tuple[int, ...], int] | None:
        if self.kept == 2:
            return None
        up = tuple(min(w, max(2 * r, w // 4)) for w, r in zip(self.weights, best.resident,
                                                              strict=True))
        down = tuple(r // 2 if r // 2 >= MIN_STEP else 0 for r in best.resident)
        options = [(up, 1), (down, -1)] if self.kept == 0 else (
            [(up, 1)] if self.kept > 0 else [(down, -1)])
        for candidate, direction in options:
            added = sum(candidate) - sum(best.resident)
            if (abs(added) < MIN_STEP or candidate in self.tried
                    or self._at_or_above(candidate)
                    or (direction > 0 and added > ROOM_SHARE * free())):
                continue
            self.tried.add(best.resident)
            self.tried.add(candidate)
            self.trial = direction
            self.trials += 1
            logger.info("%s: trying %s resident (best so far %s, %.0f items/s at size %d)",
                        self.name, _mib(candidate), _mib(best.resident), best.rate, best.size)
            return candidate, direction
        return None

    def _done(self) -> None:
        self.watching = False
        self.calls = 0
        self.stop()

    def _at_or_above(self, resident: tuple[int, ...]) -> bool:
        limit = self.too_much
        return limit is not None and all(r >= m for r, m in zip(resident, limit, strict=True))


def _mib(resident: tuple[int, ...]) -> str:
    return "+".join(f"{r / 2**20:.1f} MiB" for r in resident)
