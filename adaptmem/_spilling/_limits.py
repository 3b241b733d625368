"""When a step spills: memory in use against the limit, and how much may wait to be copied
out before forward waits.

[Note: reading memory in use] Asking an accelerator how much memory is in use is not free:
``torch.cuda.memory_allocated`` builds the allocator's whole statistics dictionary, and
``limit="auto"`` also asks the driver for free memory. Asked at every saved tensor of a
megabyte or more, that made a 7 ms training step on an H200 take 15-26 ms with nothing to
spill. So the step reuses a reading while the tensors saved since (of every size) could not
have crossed the limit: forward's memory grows mostly by what it saves, so while twice the
bytes saved since a reading stay below that reading's distance to the limit, and the
reading is under 10 ms old (gradients between two forwards in one block, other threads and
processes move memory too), its decision is taken to hold. It is a heuristic: memory that
grows some other way within those 10 ms goes unseen until the next reading. Far from the
limit (or far above it, ``limit=0``) that is a reading every 10 ms or every few hundred
megabytes saved; near it, a reading per tensor, as before. On the CPU, memory in use is the
process's resident memory, which moves with the C library's heap: there, where spilling
starts varied from run to run as much before this change as after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .._common.devices import memory_info
from ._settings import StepSettings
from ._stats import SpillStats, in_use_bytes

__all__ = ["Limits"]


@dataclass
class _Reading:
    in_use: int  # bytes in use on the device when read
    limit: int  # the limit then, as bytes in use (limit="auto": from the free memory then)
    saved: int = 0  # bytes saved on the device since
    at: float = field(default_factory=time.monotonic)


_REUSE_SECONDS = 0.01  # how long a reading may stand in for memory in use


class Limits:
    """One step's limits, and the most memory it read in use (``stats.peak_device_bytes``)."""

    def __init__(self, settings: StepSettings, stats: SpillStats) -> None:
        self.settings = settings
        self.stats = stats
        self.reserves: dict[torch.device, int] = {}
        self.readings: dict[torch.device, _Reading] = {}
        self.pending: int | None = None

    def in_use(self, device: torch.device) -> int:
        """Memory in use on ``device`` now; counted into the peak."""
        in_use = in_use_bytes(device)
        if in_use > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = in_use
        return in_use

    def over_limit(self, device: torch.device, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` saved on ``device`` now should be spilled; see
        [Note: reading memory in use]."""
        reading = self.readings.get(device)
        if reading is not None:
            reading.saved += nbytes
            if (2 * reading.saved < abs(reading.in_use - reading.limit)
                    and time.monotonic() - reading.at < _REUSE_SECONDS):
                return reading.in_use > reading.limit
        in_use = self.in_use(device)
        self.readings[device] = _Reading(in_use, self._limit(device, in_use))
        return in_use > self.readings[device].limit

    def count(self, device: torch.device, nbytes: int) -> None:
        """A tensor of ``nbytes`` saved on ``device`` that is not spilled whatever the limit
        (under the threshold): memory in use grew by it since the last reading."""
        reading = self.readings.get(device)
        if reading is not None:
            reading.saved += nbytes

    def _limit(self, device: torch.device, in_use: int) -> int:
        if self.settings.limit != "auto":
            return int(self.settings.limit)
        if self.settings.keep_free >= 1.0:
            # All of it kept for backward: every saved tensor over the threshold is spilled,
            # as with limit=0. Worked out from free memory, the limit would be memory in use
            # give or take what moved since the first save: noise would decide, and the
            # first large save would always stay.
            return 0
        # "auto": keep a share (half, more after a step ran out) of what was free at the
        # step's first large save free for backward (gradients, restored activations,
        # workspace). Free memory is read the way the allocator will fail: under a CPU cap,
        # what the cap leaves. Over the limit is less free than that share.
        free = memory_info(device)[0]
        reserve = self.reserves.get(device)
        if reserve is None:
            reserve = self.reserves[device] = int(free * self.settings.keep_free)
        return in_use + free - reserve

    def max_pending(self) -> int:
        """Bytes that may wait to be copied out before forward waits."""
        if self.pending is None:
            if self.settings.max_pending == "auto":
                # Bytes waiting to be written are memory not yet freed: an eighth of what is
                # free at the first spill, so a slow disk cannot let forward run out.
                free = memory_info(torch.device("cpu"))[0]
                self.pending = max(1, min(128 * 2**20, free // 8))
            else:
                self.pending = int(self.settings.max_pending)
        return self.pending
