"""What one ``with spill():`` step was asked to do: the handle's options when it began."""

from __future__ import annotations

from dataclasses import dataclass

from ._tiers import HostLink

__all__ = ["StepSettings"]


@dataclass(frozen=True)
class StepSettings:
    """A ``Spill`` handle's options, fixed for one step (see ``spill`` for each)."""

    threshold: int
    limit: int | str  # bytes, or "auto"
    keep_free: float  # limit="auto": the share of free memory kept for backward
    max_pending: int | str  # bytes, or "auto"
    prefetch: int
    to: str | None  # "host", a directory, or None (the default tier)
    mmap_threshold: int | None
    link: HostLink
