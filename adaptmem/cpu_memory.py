"""Cap the memory this process may hold, so CPU out-of-memory paths can be exercised.

The cap is ``RLIMIT_DATA``, which on Linux (4.7 and later) counts the heap and every private
writable mapping: the allocations that hold tensors. It is not ``RLIMIT_AS``: a process that
imported torch already reserves about 3 GiB of address space it never touches, so an
address-space cap either fails at once or allows far more memory than asked.

[Note: file mappings and the cap] ``RLIMIT_DATA`` counts a private writable mapping of a
file (what ``adaptive.load(..., copy=False)`` makes: copy-on-write, so writes stay in this
process) at its whole length the moment it is mapped, although its pages are the file's
page cache, not memory the process holds, until one is written. So a model loaded with
``copy=False`` under the cap would count its whole checkpoint against it, which defeats
zero-copy loading, and on a CPU the pager's host masters would compete with its own device
copies for the same cap. ``map_file`` raises the cap's limit by a
mapping's length while the mapping lives (the loader maps with it), so only what the process
really holds counts: its heap, tensors, device copies. A mapping made before the cap was set
is already left out (it is address space reserved when the cap is set, see
``set_cpu_memory_limit``); either way the limit comes down by its length when the mapping
is collected. Pages of it that are written become the process's own and are then not counted
(the pager never writes a parameter's master; a buffer the forward writes in place is copied
back to its master, a few pages at most).
"""

from __future__ import annotations

import math
import mmap
import numbers
import os
import sys
import weakref
from types import ModuleType

import psutil

resource: ModuleType | None
try:
    import resource
except ImportError:  # Windows: no rlimits, so no cap (set_cpu_memory_limit says so)
    resource = None

__all__ = ["set_cpu_memory_limit", "get_available_cpu_memory", "cpu_memory_info", "held_bytes",
           "map_file"]

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
    torch's thread pool is started first (OpenMP ends the process when a thread it starts
    later cannot map its stack): raise ``torch.set_num_threads`` before the cap, not after.
    Address space reserved but never touched (torch reserves much at import) does not, nor
    do checkpoints mapped by ``adaptive.load(..., copy=False)``, before or after the cap was
    set (see [Note: file mappings and the cap]).

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
    if not sys.platform.startswith("linux") or resource is None:
        raise OSError(
            f"set_cpu_memory_limit needs Linux (RLIMIT_DATA counts mappings only there); "
            f"this is {sys.platform}{'' if resource else ' without the resource module'}: "
            f"leave the CPU uncapped here, or cap it on Linux"
        )
    if _original_limit is None:
        _original_limit = resource.getrlimit(resource.RLIMIT_DATA)
    if gib is None:
        resource.setrlimit(resource.RLIMIT_DATA, _original_limit)
        _limit_bytes = _cap_bytes = None
        return
    if (isinstance(gib, bool) or not isinstance(gib, numbers.Real) or not gib > 0
            or not math.isfinite(gib)):  # numbers.Real: NumPy's numbers too
        raise ValueError(f"gib must be a positive, finite number of GiB (e.g. 8 or 1.5), "
                         f"got {gib!r}")
    gib = float(gib)
    _start_thread_pool()
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
    if (hard != resource.RLIM_INFINITY and soft > hard) or soft >= 2**63:
        top = "an rlimit's largest value" if soft >= 2**63 else f"{hard} bytes"
        raise ValueError(f"gib={gib} is above this process's hard data limit of {top}")
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    _limit_bytes, _cap_bytes = soft, cap


def _start_thread_pool() -> None:
    """Start torch's intra-op threads (OpenMP's, which BLAS and oneDNN share) before a cap:
    each new thread maps a stack that the cap counts, and OpenMP ends the whole process
    when it cannot make one ("libgomp: Thread creation failed") instead of raising an error
    the decorators could adapt to. One elementwise op over more than torch's grain size
    (32768 elements) runs on every thread once, so they exist from then on."""
    import torch

    if torch.get_num_threads() > 1:
        torch.ones(1 << 18).add_(1)


def map_file(fileno: int) -> mmap.mmap:
    """A private (copy-on-write) mapping of the whole open file ``fileno``, left out of the
    cap while it lives: when a cap is set, its limit goes up by the file's length before
    mapping, and down again when the mapping is collected. See [Note: file mappings and the
    cap]; ``adaptive.load(..., copy=False)`` maps checkpoints with it.

    Args:
        fileno: the descriptor of a regular file open for reading, not empty.

    Returns:
        The ``mmap.mmap`` (``access=mmap.ACCESS_COPY``).

    Raises:
        OSError / ValueError: as ``mmap.mmap`` raises them (an empty file, a bad descriptor).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(bytes(4096)); f.flush()
        ...     len(map_file(f.fileno()))
        4096
    """
    nbytes = os.fstat(fileno).st_size
    raised = _limit_bytes is not None
    if raised:
        _move_limit(nbytes)
    try:
        mapping = mmap.mmap(fileno, 0, access=mmap.ACCESS_COPY)  # type: ignore[attr-defined]
    except BaseException:
        if raised:
            _move_limit(-nbytes)
        raise
    # Collected under a cap: its length leaves VmData, so the limit follows, whether the
    # mapping was counted as reserved address space (made before the cap) or raised above.
    weakref.finalize(mapping, _move_limit, -len(mapping))
    return mapping


def _move_limit(delta: int) -> None:
    """Move the soft ``RLIMIT_DATA`` of the cap in force by ``delta`` bytes."""
    global _limit_bytes
    if _limit_bytes is None or _original_limit is None or resource is None:
        return
    soft = max(0, _limit_bytes + delta)
    hard = _original_limit[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    _limit_bytes = soft


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
