"""The prefetch schedule: the modules that acquire weights, in the order the learned forward
called them, and what each copies. While one runs, the next ``prefetch`` steps' weights are
copied to the device, within this forward only: a copy made before the next forward could
miss weights edited in between (through ``.data``, which no version counter sees).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._common.oom import is_oom
from .._engines.hoststore import HOST, Slot
from .slots import SlotTable

__all__ = ["Schedule"]


class Schedule:
    """Steps (module ids) in call order, with their slots and host masters, and a cursor
    at the step expected next."""

    __slots__ = ("ahead", "table", "steps", "needs", "masters", "cursor")

    def __init__(self, ahead: int, table: SlotTable) -> None:
        self.ahead = ahead  # steps prefetched past the running one
        self.table = table
        self.steps: list[int] = []
        self.needs: list[tuple[Slot, ...]] = []
        self.masters: list[tuple[torch.Tensor, ...]] = []  # what each step copies
        self.cursor = 0

    def rebuild(self, order: Sequence[int], needs: dict[int, tuple[Slot, ...]]) -> None:
        """The modules of ``order`` that acquire something (``needs``), in that order."""
        self.steps = [mid for mid in order if mid in needs]
        self.needs = [needs[mid] for mid in self.steps]
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
        end = pos + self.ahead + 1
        table = self.table
        for k in range(pos + 1, end if end < n else n):
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
