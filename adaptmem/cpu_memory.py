"""Cap the memory this process may hold, so CPU out-of-memory paths can be exercised.

The cap is ``RLIMIT_DATA``, which on Linux (4.7 and later) counts the heap and every private
writable mapping: the allocations that hold tensors. It is not ``RLIMIT_AS``: a process that
imported torch already reserves about 3 GiB of address space it never touches, so an
address-space cap either fails at once or allows far more memory than asked.
"""

from __future__ import annotations

import os
import resource
import sys

import psutil

__all__ = ["set_cpu_memory_limit", "get_available_cpu_memory", "cpu_memory_info", "held_bytes"]

_GIB = 1024**3
_original_limit: tuple[int, int] | None = None
_limit_bytes: int | None = None  # the RLIMIT_DATA soft limit set
_cap_bytes: int | None = None  # the cap asked for (the limit less reserved address space)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def held_bytes() -> int:
    """Memory this process holds: its anonymous resident memory (``RssAnon``), what the cap
    counts, read cheaply enough to ask once per saved tensor; the resident set size where
    there is no ``/proc`` (not Linux).

    >>> held_bytes() > 0
    True
    """
    try:
        with open("/proc/self/statm", "rb") as f:
            parts = f.read().split()
    except OSError:
        return int(psutil.Process().memory_info().rss)
    # resident less file-backed and shared pages: the same count as RssAnon in status
    return (int(parts[1]) - int(parts[2])) * os.sysconf("SC_PAGE_SIZE")


def set_cpu_memory_limit(gib: float | None) -> None:
    """Let this process hold about ``gib`` GiB of memory in total; ``None`` lifts the cap.

    Allocations beyond the cap fail with the allocator's real error (torch's
    ``DefaultCPUAllocator: can't allocate memory``, Python's ``MemoryError``), which is what
    adaptmem's decorators adapt to. Memory the process already holds counts toward the cap.
    Address space reserved but never touched (torch reserves much at import) does not.

    Args:
        gib: the cap in GiB (float allowed), or None to restore the limit found first.

    Raises:
        ValueError: ``gib`` is not positive, or is below what the process already holds.
        OSError: the platform has no ``RLIMIT_DATA`` enforcement (only Linux is supported).

    Example:
        >>> from adaptmem import adaptive
        >>> adaptive.cpu_memory.set_cpu_memory_limit(8)     # doctest: +SKIP
        >>> adaptive.cpu_memory.set_cpu_memory_limit(None)  # doctest: +SKIP
    """
    global _original_limit, _limit_bytes, _cap_bytes
    if not sys.platform.startswith("linux"):
        raise OSError(
            f"set_cpu_memory_limit needs Linux (RLIMIT_DATA counts mappings only there); "
            f"this is {sys.platform}"
        )
    if _original_limit is None:
        _original_limit = resource.getrlimit(resource.RLIMIT_DATA)
    if gib is None:
        resource.setrlimit(resource.RLIMIT_DATA, _original_limit)
        _limit_bytes = _cap_bytes = None
        return
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ValueError(f"gib must be a positive number of GiB (e.g. 8 or 1.5), got {gib!r}")
    held = held_bytes()
    cap = int(gib * _GIB)
    if cap <= held:
        raise ValueError(
            f"gib={gib} ({cap} bytes) is below the {held} bytes this process already holds; "
            f"ask for more than {held / _GIB:.2f} GiB"
        )
    # Reserved-but-untouched data mappings count toward RLIMIT_DATA, not toward "held".
    reserved = max(0, _status_kib("VmData") - held)
    soft = cap + reserved
    hard = _original_limit[1]
    if hard != resource.RLIM_INFINITY and soft > hard:
        raise ValueError(f"gib={gib} is above this process's hard data limit of {hard} bytes")
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    _limit_bytes, _cap_bytes = soft, cap


def cpu_memory_info() -> tuple[int, int]:
    """``(available, total)`` bytes for this process: under the cap when one is set."""
    vm = psutil.virtual_memory()
    if _limit_bytes is None or _cap_bytes is None:
        return int(vm.available), int(vm.total)
    left = max(0, _limit_bytes - _status_kib("VmData"))
    return min(int(vm.available), left), min(int(vm.total), _cap_bytes)


def get_available_cpu_memory() -> int:
    """Bytes this process can still allocate: under the cap if one is set, else what the
    machine reports as available.

    >>> get_available_cpu_memory() > 0
    True
    """
    return cpu_memory_info()[0]
