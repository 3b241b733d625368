"""What spilling did, and ``memory_stats()``: every figure about memory in one place."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from .._common.devices import format_bytes
from .._common.reporting import live_reports
from .._engines.stats import Stats
from ..cpu_memory import cpu_memory_info, held_bytes

__all__ = ["SpillStats", "MemoryStats", "memory_stats", "track", "track_step", "in_use_bytes"]


@dataclass
class SpillStats(Stats):
    """What a ``spill`` handle did.

    ``tensors_saved`` counts every tensor autograd saved inside the handle; of those,
    ``tensors_spilled`` were copied out (each storage once), ``tensors_shared`` were views of
    or repeats of a storage already spilled, and ``tensors_kept`` stayed where they were
    (under the threshold, below the limit, parameters, views of parameters, buffers or
    inputs). ``tensors_restored`` counts spilled storages handed back to backward,
    ``bytes_in`` the bytes read back for them (a storage whose copy out had not finished
    comes back from memory, unread; a second backward through a retained graph reads
    again). ``seconds_waiting`` is time the
    training step itself waited: for copies out to drain in forward, for copies back that
    prefetching had not finished in backward. ``seconds_writing`` / ``seconds_reading`` are
    the time the background copies took. ``peak_device_bytes`` is the most memory read in
    use on the device: when a tensor was restored, and when one was saved and the tensors
    saved since the last reading could have crossed the limit (memory in use is read no
    more often than that; [Note: reading memory in use] in ``_limits.py``).
    """

    steps: int = 0
    tensors_saved: int = 0
    tensors_spilled: int = 0
    tensors_shared: int = 0
    tensors_kept: int = 0
    tensors_restored: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    seconds_waiting: float = 0.0
    seconds_writing: float = 0.0
    seconds_reading: float = 0.0
    peak_device_bytes: int = 0


_lock = threading.Lock()
_live: dict[int, SpillStats] = {}  # the stats of live handles (or their live steps), by id
_retired = SpillStats()  # totals of handles already collected
_steps: dict[int, int] = {}  # live steps by id of their stats
_orphans: set[int] = set()  # stats whose handle was collected while steps still update them


def _handle_gone(stats: SpillStats) -> None:
    # Backward may run after the handle is gone (``with adaptive.spill():`` around forward
    # only): its step keeps counting restores into ``stats``, which is added to the
    # retired totals only once its last step is gone too.
    with _lock:
        if _steps.get(id(stats)):
            _orphans.add(id(stats))
        else:
            _retire(stats)


def _step_gone(stats: SpillStats) -> None:
    with _lock:
        key = id(stats)
        _steps[key] -= 1
        if _steps[key]:
            return
        del _steps[key]
        if key in _orphans:
            _orphans.discard(key)
            _retire(stats)


def _retire(stats: SpillStats) -> None:
    _live.pop(id(stats), None)
    _add(_retired, stats)


def _add(into: SpillStats, other: SpillStats) -> None:
    for f in fields(other):
        if f.name.startswith("_"):
            continue
        if f.name.startswith("peak"):
            setattr(into, f.name, max(getattr(into, f.name), getattr(other, f.name)))
        else:
            setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


def track(owner: object, stats: SpillStats) -> None:
    """Count ``stats`` in the process totals, now and after ``owner`` is collected."""
    with _lock:
        _live[id(stats)] = stats
    weakref.finalize(owner, _handle_gone, stats)


def track_step(step: object, stats: SpillStats) -> None:
    """``step`` updates ``stats`` for as long as it lives (after its handle, maybe)."""
    with _lock:
        _steps[id(stats)] = _steps.get(id(stats), 0) + 1
    weakref.finalize(step, _step_gone, stats)


def _totals() -> SpillStats:
    total = SpillStats()
    with _lock:
        _add(total, _retired)
        for stats in list(_live.values()):
            _add(total, stats)
    return total


def in_use_bytes(device: torch.device) -> int:
    """Memory in use on ``device``: bytes allocated by torch on an accelerator, the process's
    anonymous resident memory (what ``set_cpu_memory_limit`` caps) on the CPU."""
    if device.type == "cpu":
        return held_bytes()
    api = getattr(torch, device.type, None)
    allocated = getattr(api, "memory_allocated", None)
    if allocated is None:
        return 0
    return int(allocated(device) if device.type != "mps" else allocated())


def _peak_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _devices() -> dict[str, dict[str, int]]:
    out = {"cpu": {"in_use_bytes": in_use_bytes(torch.device("cpu")),
                   "peak_resident_bytes": _peak_kib("VmHWM"),
                   "capacity_bytes": cpu_memory_info()[1]}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = {
                "in_use_bytes": int(torch.cuda.memory_allocated(i)),
                "peak_bytes": int(torch.cuda.max_memory_allocated(i)),
                "reserved_bytes": int(torch.cuda.memory_reserved(i)),
            }
    return out


class MemoryStats(Mapping[str, dict[str, Any]]):
    """A snapshot of memory figures by section: ``"spill"`` (all spill handles of the
    process), ``"devices"`` (memory in use and peaks), then one section per live statistics
    source (pagers, chunkers, splitters, loads, spill handles, decorated functions) and per
    engine handed to ``memory_stats``. Read it like a dict; ``print`` it for a summary."""

    def __init__(self, sections: dict[str, dict[str, Any]]) -> None:
        self._sections = sections

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self._sections[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sections)

    def __len__(self) -> int:
        return len(self._sections)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """A plain nested dict (a copy)."""
        return {k: dict(v) for k, v in self._sections.items()}

    def __repr__(self) -> str:
        return f"MemoryStats({self._sections!r})"

    def __str__(self) -> str:
        lines = ["adaptmem memory statistics"]
        for name, section in self._sections.items():
            lines.append(f"  {name}:")
            for key, value in section.items():
                if isinstance(value, dict):
                    lines.append(f"    {key}:")
                    lines += [f"      {k:<20} {_show(f'{key}.{k}', v)}" for k, v in value.items()]
                else:
                    lines.append(f"    {key:<22} {_show(key, value)}")
        return "\n".join(lines)


def _show(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and "bytes" in key:
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (list, tuple)) and len(value) > 4:
        # A load's missing keys can run to hundreds: the summary shows a few and the count.
        return f"{', '.join(map(str, value[:3]))}, ... ({len(value)} in all)"
    return str(value)


def _unique(name: str, taken: Mapping[str, Any]) -> str:
    """``name``, or with ``#2``, ``#3``, ... after its first word when the name is taken
    (``"pager (GPT2Model)"``, ``"pager#2 (GPT2Model)"``)."""
    head, sep, tail = name.partition(" ")
    n = 2
    unique = name
    while unique in taken:
        unique, n = f"{head}#{n}{sep}{tail}", n + 1
    return unique


def memory_stats(*engines: Any) -> MemoryStats:
    """Every memory figure in one place: what spilling moved (all ``spill`` handles of the
    process), memory in use and peak per device, and the statistics of every live source:
    each pager, chunker and splitter, each model loaded with ``load`` (while the model
    lives), each spill handle, and each decorated function that keeps statistics (once it
    has been called), in the order they were made. A source disappears when it is
    collected. See [Note: one place for statistics].

    Sections are named for the source and what it holds: ``"pager (GPT2LMHeadModel)"``,
    ``"chunker (ResNet)"``, ``"load (model.safetensors)"``, ``"spill handle"``; a second
    source of the same name gets ``#2`` after its first word (``"pager#2 (ResNet)"``).

    Args:
        *engines: extra handles whose ``stats`` (or ``Stats`` objects themselves) to
            include, e.g. a ``LoadStats`` whose model is gone; one already shown as a live
            source is not repeated. Each gets a section named for its type.

    Returns:
        A ``MemoryStats``: a read-only mapping of section name to a dict of figures;
        ``print`` it for a readable summary, ``as_dict()`` for plain dicts.

    Raises:
        TypeError: an argument has no ``stats`` and is no ``Stats``.

    Example:
        >>> from adaptmem import adaptive
        >>> stats = adaptive.memory_stats()
        >>> list(stats)[:2]
        ['spill', 'devices']
        >>> stats["spill"]["bytes_out"] >= 0
        True
    """
    sections: dict[str, dict[str, Any]] = {"spill": _totals().as_dict(), "devices": _devices()}
    shown: set[int] = set()
    for name, source in live_reports():
        figures = source.as_dict()
        shown.add(id(source))
        if figures.get("calls", None) == 0:
            continue  # a decorated function never called: nothing to say, only noise
        sections[_unique(name, sections)] = figures
    for engine in engines:
        stats: Any = engine if isinstance(engine, Stats) else getattr(engine, "stats", None)
        if not callable(getattr(stats, "as_dict", None)):  # Stats, or a decorator's CallStats
            raise TypeError(
                f"memory_stats takes engines with a .stats (a Pager, Chunker, Splitter, spill "
                f"handle, decorated function) or Stats objects, got {type(engine).__name__} "
                f"{engine!r}"
            )
        if id(stats) in shown:
            continue
        sections[_unique(type(engine).__name__.lower(), sections)] = stats.as_dict()
        shown.add(id(stats))
    return MemoryStats(sections)
