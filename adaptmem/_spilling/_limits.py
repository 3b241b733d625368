"""When a step spills: memory in use against the limit, and how much may wait to be copied
out before forward waits."""

from __future__ import annotations

import torch

from .._common.devices import memory_info
from ._settings import StepSettings
from ._stats import SpillStats, in_use_bytes

__all__ = ["Limits"]


class Limits:
    """One step's limits, and the most memory it saw in use (``stats.peak_device_bytes``)."""

    def __init__(self, settings: StepSettings, stats: SpillStats) -> None:
        self.settings = settings
        self.stats = stats
        self.reserves: dict[torch.device, int] = {}
        self.pending: int | None = None

    def in_use(self, device: torch.device) -> int:
        """Memory in use on ``device`` now; counted into the peak."""
        in_use = in_use_bytes(device)
        if in_use > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = in_use
        return in_use

    def over_limit(self, device: torch.device) -> bool:
        """Whether a tensor saved on ``device`` now should be spilled."""
        in_use = self.in_use(device)
        if self.settings.limit != "auto":
            return in_use > int(self.settings.limit)
        # "auto": keep a share (half, more after a step ran out) of what was free at the
        # step's first large save free for backward (gradients, restored activations,
        # workspace). Free memory is read the way the allocator will fail: under a CPU cap,
        # what the cap leaves.
        free = memory_info(device)[0]
        reserve = self.reserves.get(device)
        if reserve is None:
            reserve = self.reserves[device] = int(free * self.settings.keep_free)
        return free < reserve

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
