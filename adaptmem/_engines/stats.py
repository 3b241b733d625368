"""Counters every engine reports through: plain numbers, printable, comparable."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from .._common.devices import format_bytes
from .._common.peak import fake_mode

__all__ = ["Stats", "PagingStats", "PlacementStats", "LoadStats", "TraceCounts"]

# [Note: a trace is not counted] ``initial_batchsize="auto"`` and ``model=`` run the
# function on fake tensors to predict its peak; an engine it calls counted that forward as
# if it were real (a pager's forwards, transfers and bytes moved: 168 forwards after a call
# that ran 4). An engine's forward under a fake mode (``TraceCounts``) puts its figures back
# as they were when it ends. Only that forward's own figures: an engine runs one forward at
# a time, and other threads' forwards of other engines meanwhile are counted as usual.


@dataclass
class Stats:
    """Base for engine counters: ``as_dict()``, ``reset()`` and a readable ``str``. Plain
    values only, so that stats pickle (returned from a worker process), deep-copy and go
    through ``dataclasses.asdict``."""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self, f.name))
                for f in fields(self) if not f.name.startswith("_")}

    def snapshot(self) -> dict[str, Any]:
        """The figures, to ``restore`` (see [Note: a trace is not counted])."""
        return self.as_dict()

    def restore(self, state: dict[str, Any]) -> None:
        """Put back the figures of a ``snapshot``, but for refinements, which change the
        plan for real wherever they are made."""
        for name, value in state.items():
            if name != "refinements":
                setattr(self, name, value)

    def reset(self) -> None:
        for f in fields(self):
            if not f.name.startswith("_"):
                setattr(self, f.name, f.default_factory() if callable(f.default_factory)
                        else f.default)  # type: ignore[misc]

    def __str__(self) -> str:
        parts = []
        for k, v in self.as_dict().items():
            if isinstance(v, dict) and ("bytes" in k):
                v = "{" + ", ".join(f"{d}: {format_bytes(n)}" for d, n in v.items()) + "}"
                parts.append(f"{k}={v}")
            else:
                parts.append(f"{k}={format_bytes(v)}" if k.endswith("bytes") or "bytes_" in k
                             else f"{k}={v}")
        return f"{type(self).__name__}(" + ", ".join(parts) + ")"


@dataclass
class PagingStats(Stats):
    """What a Pager did. A prefetch miss is a unit compute had to wait for."""

    bytes_moved: int = 0
    transfers: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    refinements: int = 0
    peak_device_bytes: int = 0
    forwards: int = 0


@dataclass
class PlacementStats(Stats):
    """What a Chunker or Splitter did at unit boundaries."""

    boundary_crossings: int = 0
    bytes_converted: int = 0
    forwards: int = 0


@dataclass
class LoadStats(Stats):
    """What a load read, from where, and how long it took.

    ``bytes_read`` counts checkpoint bytes read (each tensor once); ``bytes_direct`` those of
    them read past the page cache (O_DIRECT, for parts of the file the cache did not hold);
    ``bytes_mapped`` those left backed by the file (``copy=False``); ``bytes_by_device`` the
    bytes that ended up on each device, every copy counted (a handle may keep a host and a
    device copy).
    """

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0
    bytes_by_device: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    format: str = ""
    bytes_mapped: int = 0
    bytes_direct: int = 0
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


class TraceCounts:
    """An engine's forwards under a trace leave its ``stats`` as they were: see [Note: a
    trace is not counted]."""

    __slots__ = ("stats", "saved")

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.saved: dict[str, Any] | None = None

    def begin(self) -> None:
        """An outermost forward begins: its figures are kept if it runs under a trace."""
        self.saved = self.stats.snapshot() if fake_mode() is not None else None

    def end(self) -> None:
        """That forward ended: a traced one's figures are put back."""
        if self.saved is not None:
            self.stats.restore(self.saved)
            self.saved = None
