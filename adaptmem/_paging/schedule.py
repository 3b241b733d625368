"""The prefetch schedule: the modules that acquire weights, in the order the learned forward
called them, and what each copies. While one runs, the next ``prefetch`` steps' weights are
copied to the device, within this forward only: a copy made before the next forward could
miss weights edited in between (through ``.data``, which no version counter sees).

[Note: prefetch depth counts the units that matter]
``prefetch=1`` means "while a unit computes, the next one is on its way". Counted in steps,
a tiny step (a LayerNorm's 4 KiB between two 1 MiB Linears) would be the only copy in flight
while a large unit computes, and the link would idle until the next large unit's own hook
asked for it. So a step smaller than an eighth of the largest step does not count toward the
depth: the lookahead from each step reaches ``prefetch`` steps that matter, plus the small
ones between them, whose bytes together stay under one largest step (so the device holds at
most about one more unit than the depth says).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._common.oom import is_oom
from .._engines.hoststore import HOST, Slot
from .slots import SlotTable

__all__ = ["Schedule", "lookahead_ends"]

SMALL_SHARE = 8  # a step under 1/8 of the largest does not count toward the depth


def lookahead_ends(sizes: Sequence[int], ahead: int) -> list[int]:
    """For each step, the index where its prefetch stops (exclusive): ``ahead`` steps that
    matter past it, with the small steps between them, whose bytes stay under one largest
    step. See [Note: prefetch depth counts the units that matter]."""
    n = len(sizes)
    largest = max(sizes, default=0)
    small = largest // SMALL_SHARE
    ends = []
    for pos in range(n):
        end, counted, extra = pos + 1, 0, 0
        while end < n and counted < ahead:
            if sizes[end] > small:
                counted += 1
            elif extra + sizes[end] <= largest:
                extra += sizes[end]
            else:
                counted += 1  # small steps past one largest step's worth count again
            end += 1
        ends.append(end)
    return ends


class Schedule:
    """Steps (module ids) in call order, with their slots and host masters, and a cursor
    at the step expected next."""

    __slots__ = ("ahead", "table", "steps", "needs", "masters", "ends", "cursor")

    def __init__(self, ahead: int, table: SlotTable) -> None:
        self.ahead = ahead  # steps prefetched past the running one
        self.table = table
        self.steps: list[int] = []
        self.needs: list[tuple[Slot, ...]] = []
        self.masters: list[tuple[torch.Tensor, ...]] = []  # what each step copies
        self.ends: list[int] = []  # per step: where its lookahead stops (exclusive)
        self.cursor = 0

    def rebuild(self, order: Sequence[int], needs: dict[int, tuple[Slot, ...]]) -> None:
        """The modules of ``order`` that acquire something (``needs``), in that order."""
        self.steps = [mid for mid in order if mid in needs]
        self.needs = [needs[mid] for mid in self.steps]
        self.refresh()
        self.ends = lookahead_ends([sum(s.nbytes for s in step) for step in self.needs],
                                   self.ahead)

    def refresh(self) -> None:
        """Read each step's host masters again (a slot adopted new data as its master)."""
        self.masters = [tuple(s.master for s in step) for step in self.needs]

    def restart(self) -> None:
        """A new outermost call: expect the first step."""
        self.cursor = 0

    def prefetch_after(self, mid: int) -> None:
        """Module ``mid`` runs: start copying what the next steps need, as far as the budget
        allows. An out-of-memory error stops it quietly: prefetching is an optimisation, and
        the demand path adapts."""
        steps = self.steps
        n = len(steps)
        pos = self.cursor
        if pos < n and steps[pos] == mid:  # the usual case: the step expected next
            self.cursor = pos + 1
        else:
            found = self._find(mid)
            if found is None:
                return
            pos = found
        table = self.table
        for k in range(pos + 1, self.ends[pos]):
            ahead: Sequence[Slot] = self.needs[k]
            masters: tuple[torch.Tensor, ...] | None = self.masters[k]
            for s in ahead:  # usually all of it is on the host
                if s.state is not HOST:
                    ahead = [s for s in ahead if s.state is HOST]
                    masters = None
                    break
            if not ahead:
                continue
            if table.budget is not None and not table.fits(sum(s.nbytes for s in ahead)):
                return
            try:
                table.fetch(ahead, masters)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                return

    def _find(self, mid: int) -> int | None:
        """The step of ``mid`` at or after the cursor (wrapping around), and moves the
        cursor past it."""
        steps, n, start = self.steps, len(self.steps), self.cursor
        for i in range(n):
            pos = (start + i) % n
            if steps[pos] == mid:
                self.cursor = pos + 1
                return pos
        return None
