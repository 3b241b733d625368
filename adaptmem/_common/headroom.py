"""How much of a device's free memory an engine may fill with weights.

[Note: headroom]
Weights an engine places share the device with what the forward needs: activations, the
copies made at unit or device boundaries, the caching allocator's slack, and on the CPU the
rest of the process. So every engine that sizes itself from free memory (the pager's
resident set and automatic unit size, chunk's ``capacity="auto"``, split's ``"auto"``
capacities, the CLI's ``--budget auto``) keeps back one reserve, by one rule: the larger of
10% of the device's total memory and 512 MiB, but never more than half of what is free, so a
device with little memory left (another tenant, a per-process memory fraction) still takes
weights, half of its free memory for them and half for the rest; unless the caller names the
reserve. One rule means a model that ``adaptmem plan`` says fits also fits when any engine
places it.
"""

from __future__ import annotations

from typing import Any

import torch

from .devices import memory_info, parse_size

__all__ = ["MIN_RESERVE", "RESERVE_SHARE", "reserve_bytes", "weight_room"]

RESERVE_SHARE = 0.10  # of the device's total memory
MIN_RESERVE = 512 * 1024**2


def reserve_bytes(free: int, total: int, reserve: Any = "auto") -> int:
    """The bytes kept back on a device with ``free`` of ``total`` bytes free: ``"auto"`` (see
    [Note: headroom]), or what the caller gives (bytes or ``"2GiB"``; None keeps nothing
    back)."""
    if isinstance(reserve, str) and reserve == "auto":
        return min(max(int(total * RESERVE_SHARE), MIN_RESERVE), free // 2)
    return 0 if reserve is None else parse_size(reserve, "reserve")


def weight_room(device: torch.device, reserve: Any = "auto") -> tuple[int, int]:
    """``(room, reserve)`` in bytes: free memory on ``device`` minus the reserve."""
    free, total = memory_info(device)
    kept = reserve_bytes(free, total, reserve)
    return max(0, free - kept), kept
