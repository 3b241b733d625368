"""Giving memory that spilling freed back to the system, on glibc.

[Note: glibc heap] glibc serves a large allocation from its heap once a block that size was
freed (its mmap threshold adapts upward), and keeps freed heap blocks resident: memory
freed by spilling would stay in the process. So the writer thread calls ``malloc_trim(0)``
each time copies out have freed another 8 MiB of CPU activations, and the reader thread
before a read each time another 8 MiB came back (backward frees about as much): free heap
pages go back to the system and resident memory falls, without changing any setting of the
allocator. ``malloc_trim`` leaves the heap's address space in place, and ``RLIMIT_DATA``
(``cpu_memory.set_cpu_memory_limit``) counts address space: under such a cap a step can
fail with its resident memory well below it. For that case ``spill(mmap_threshold=)`` opts
in to fixing glibc's ``M_MMAP_THRESHOLD`` from a step's first CPU spill until it ends, so
large tensors are mapped and unmapped; afterwards the threshold is set to 32 MiB, where the
adaptive one ends up (glibc offers no way back to the adaptive behaviour): a process-wide
setting, hence not the default.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._common.devices import parse_size
from .._common.libc import libc_function

__all__ = ["TRIM_EVERY", "check_mmap_threshold", "fixed_mmap_threshold",
           "hold_mmap_threshold", "release_mmap_threshold", "return_freed_memory"]

TRIM_EVERY = 8 << 20  # bytes freed (or read back) between two trims of one step


@functools.cache
def _glibc(name: str) -> Any:
    """glibc's function ``name`` through ctypes, or None (another C library or platform)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return libc_function(name, None, ctypes.c_int)


def return_freed_memory() -> None:
    """See [Note: glibc heap]."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(ctypes.c_size_t(0))


_M_MMAP_THRESHOLD = -3
_mmap_lock = threading.Lock()
_mmap_users = 0  # steps (and blocks) holding glibc's mmap threshold fixed


def hold_mmap_threshold(nbytes: int) -> None:
    """See [Note: glibc heap]: ``nbytes`` from the first holder on."""
    global _mmap_users
    with _mmap_lock:
        _mmap_users += 1
        if _mmap_users == 1:
            _glibc("mallopt")(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes))


def release_mmap_threshold() -> None:
    """32 MiB once the last holder is done (glibc cannot go back to adaptive)."""
    global _mmap_users
    with _mmap_lock:
        _mmap_users -= 1
        if _mmap_users == 0:
            _glibc("mallopt")(_M_MMAP_THRESHOLD, ctypes.c_int(32 << 20))


def check_mmap_threshold(value: int | str | None) -> int | None:
    """``spill(mmap_threshold=)`` in bytes, checked (None stays None)."""
    if value is None:
        return None
    nbytes = parse_size(value, "mmap_threshold")
    if _glibc("mallopt") is None:
        raise ValueError(
            f"mmap_threshold={value!r} sets glibc's M_MMAP_THRESHOLD, and this process does not "
            f"run on glibc ({sys.platform}, {platform.libc_ver()[0] or 'unknown C library'}); "
            f"leave it None"
        )
    if not 0 < nbytes <= 32 << 20:
        raise ValueError(f"mmap_threshold must be more than 0 and at most 32MiB (glibc's "
                         f"largest), e.g. '1MiB'; got {value!r}")
    return nbytes


@contextlib.contextmanager
def fixed_mmap_threshold(nbytes: int) -> Iterator[None]:
    """Inside, glibc's mmap threshold is ``nbytes`` as during a step under
    ``spill(mmap_threshold=nbytes)`` (see [Note: glibc heap]), e.g. for a step without
    spilling that is compared with one that spills. Nothing changes off glibc."""
    if _glibc("mallopt") is None:
        yield
        return
    hold_mmap_threshold(nbytes)
    try:
        yield
    finally:
        release_mmap_threshold()
