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
    """``(available, total)`` bytes for this process: what the machine has, within the memory
    limit of its control group (a container's, see [Note: a container's memory limit]) and
    under the cap when one is set.

    Raises:
        OSError: none of these can be read (psutil fails and the system has no other count).

    >>> cpu_memory_info()[1] > 0
    True
    """
    machine = _machine_memory()
    group = _cgroup_memory(machine[0] if machine else _NO_LIMIT)
    if machine is None and group is None:
        raise OSError("free CPU memory is unknown here: psutil.virtual_memory() failed (is "
                      "/proc/meminfo readable?), the system reports no page counts and no "
                      "cgroup memory limit could be read; give capacities in bytes rather "
                      "than 'auto'")
    available, total = machine or (_NO_LIMIT, _NO_LIMIT)
    if group is not None:
        available, total = min(available, group[0]), min(total, group[1])
    if _limit_bytes is not None and _cap_bytes is not None:
        left = max(0, _limit_bytes - _status_kib("VmData"))
        available, total = min(available, left), min(total, _cap_bytes)
    return available, total


def _machine_memory() -> tuple[int, int] | None:
    """``(available, total)`` bytes of the machine: psutil's, else the kernel's page counts
    (free pages only, so less: /proc/meminfo unreadable), else None."""
    try:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:  # no /proc/meminfo, not allowed to read it: a probe must not fail
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None


# [Note: a container's memory limit]
# A container's memory limit (``docker run -m``, a Kubernetes pod's ``limits.memory``, a
# systemd unit's ``MemoryMax``) belongs to its control group: cgroup v2's ``memory.max``,
# against ``memory.current``, or cgroup v1's ``memory.limit_in_bytes``, against
# ``memory.usage_in_bytes``. The machine's figures (psutil, /proc/meminfo) do not see it,
# and a process that goes over it is killed by the kernel, with no error the decorators
# could adapt to. So free CPU memory is the least of the machine's available memory and
# what the limit of each group leaves (the process's own group and those above it: a limit
# binds everything under it), and the total is the least of the machine's and the limits.
# A group's usage counts the page cache of files read in it (a checkpoint loaded): the
# kernel reclaims those pages before it kills, so they count as free (``memory.stat``'s
# ``inactive_file`` and ``active_file``, v1's ``total_``), as the machine's available
# memory counts its page cache, except file pages mapped into a process (``file_mapped``,
# v1's ``total_mapped_file``: a model loaded with ``copy=False`` reads its weights there,
# and evicting them would make every forward read the disk). Counting only the inactive
# pages, as the kubelet's working set does, left a container that had read its 1 GiB
# checkpoint twice (the second read makes the pages active, and they stay charged to the
# group after the process ends) with 192 MiB free of a 1.5 GiB limit where 1.1 GiB
# allocated (measured in a real cgroup v1 group). ``memory.high`` (throttling, not
# killing) is not read.
# The groups are found once, in /proc/self/cgroup under /sys/fs/cgroup: the process's own
# folder and each above it, where a folder missing (a container that sees its own group at
# /sys/fs/cgroup, not the host's path) is passed over for the one above. Only groups
# with a limit then are kept: a limit added later to a group that had none is not seen
# (its value changing is). Each read is then two small files a limited group, and its
# ``memory.stat`` only where the limit leaves less than the machine. No files, odd
# contents: no limit, the machine's figures.
_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"
_NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as about 2**63
# (limit file, usage file, stat file, key prefix in it: v1's "total_") per limited group
_groups: list[tuple[str, str, str, str]] | None = None


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _group_bytes(path: str) -> int | None:
    """The bytes a cgroup file ``path`` holds (a limit, a usage); None for no limit ("max",
    v1's about 2**63) or no reading."""
    try:
        text = _read_text(path).strip()
        nbytes = None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
    return nbytes if nbytes is not None and 0 <= nbytes < _NO_LIMIT else None


def control_group_folders(controller: str) -> list[tuple[str, bool]]:
    """This process's control groups for ``controller``: its own group's folder, then each
    above it up to the root (a limit binds everything under it). A folder may not exist (a
    container that sees its own group at the root, see [Note: a container's memory limit]):
    reading its files then fails. adaptmem's loader reads the groups' CPU quota.

    Args:
        controller: the controller whose cgroup v1 hierarchy to look in ("memory", "cpu");
            cgroup v2 has one hierarchy for all.

    Returns:
        ``(folder, v1)`` pairs, each folder ending in "/", ``v1`` true for cgroup v1's
        (whose files are named otherwise); [] where /proc/self/cgroup cannot be read.

    >>> all(folder.endswith("/") for folder, v1 in control_group_folders("cpu"))
    True
    """
    try:
        lines = _read_text(_PROC_CGROUP).splitlines()
    except (OSError, ValueError):
        return []
    found = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:  # cgroup v2
            folder, v1 = _CGROUP_ROOT, False
        elif controller in controllers.split(","):  # cgroup v1's hierarchy holding it
            # mounted under its controllers' names ("cpu,cpuacct"), often linked from each
            folder, v1 = f"{_CGROUP_ROOT}/{controllers}", True
            if not os.path.isdir(folder):
                folder = f"{_CGROUP_ROOT}/{controller}"
        else:
            continue
        parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
        found += [("/".join([folder, *parts[:depth]]) + "/", v1)
                  for depth in range(len(parts), -1, -1)]
    return found


def _limited_groups() -> list[tuple[str, str, str, str]]:
    """The files of this process's control groups that limit memory, found once."""
    global _groups
    if _groups is not None:
        return _groups
    found: list[tuple[str, str, str, str]] = []
    for group, v1 in control_group_folders("memory"):
        names = (("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_")
                 if v1 else ("memory.max", "memory.current", "memory.stat", ""))
        if _group_bytes(group + names[0]) is not None:
            found.append((group + names[0], group + names[1], group + names[2], names[3]))
    _groups = found
    return found


def _cgroup_memory(machine_available: int) -> tuple[int, int] | None:
    """``(room, limit)``: the least any limited control group of this process leaves free,
    and the smallest limit; None where none limits memory (see [Note: a container's memory
    limit])."""
    room, limits = machine_available, []
    for limit_file, usage_file, stat_file, prefix in _limited_groups():
        limit, used = _group_bytes(limit_file), _group_bytes(usage_file)
        if limit is None or used is None:
            continue
        left = limit - used
        if left < room:  # the limit binds: its reclaimable page cache is free too
            left = min(limit, left + _page_cache(stat_file, prefix))
        room = min(room, max(0, left))
        limits.append(limit)
    return (room, min(limits)) if limits else None


def _page_cache(path: str, prefix: str) -> int:
    """The bytes of a cgroup's page cache the kernel can reclaim, from its ``memory.stat``
    (keys after ``prefix``: v1's "total_"): its file pages less those mapped into a process,
    at least the inactive ones; 0 where there is no reading."""
    wanted = {f"{prefix}inactive_file": "inactive", f"{prefix}active_file": "active",
              f"{prefix}mapped_file" if prefix else "file_mapped": "mapped"}
    found = dict.fromkeys(wanted.values(), 0)
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in wanted:
                    found[wanted[name]] = max(0, int(value))
    except (OSError, ValueError):
        return 0
    inactive = found["inactive"]
    return max(inactive, inactive + found["active"] - found["mapped"])


def get_available_cpu_memory() -> int:
    """Bytes this process can still allocate: what the machine reports as available, within
    a container's memory limit and under the cap if one is set (see ``cpu_memory_info``).

    >>> get_available_cpu_memory() > 0
    True
    """
    return cpu_memory_info()[0]
