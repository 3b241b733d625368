"""The simulated caching allocator: bytes counted per device, a byte limit, CUDA's OOM text.

A model, not a copy, of CUDA's caching allocator: blocks are rounded up to 512 bytes; when
the cached (reserved but unused) bytes cannot hold a block, a segment is reserved (2 MiB, or
what is missing rounded up to 2 MiB); past the limit the cache is emptied once and the allocation
tried again, then ``torch.OutOfMemoryError`` is raised with CUDA's message. Fragmentation is
not modelled: any cached bytes serve any block (see [Note: emptying whole segments]).

[Note: emptying whole segments]
The real allocator's ``empty_cache`` (and its release before an OOM) frees only segments
with no block in use; a segment that holds one keeps its free part cached. Without
fragmentation the blocks in use pack into the fewest segments, so emptying leaves
``allocated`` rounded up to a whole segment reserved, never ``allocated`` itself: that
would strand the free tail of the last segment in use, and the next segment grown on top
of it could pass the limit where the same blocks fitted before the release. Likewise a
block larger than the cached bytes takes them plus a new segment for what is missing, not
a segment of its own whole size, which would count the cached bytes only while they alone
hold it. So reserved is always a whole number of segments, and whether an allocation fits
depends on the bytes allocated only (``allocated + block`` within the limit, in whole
segments), never on what happened to be cached: a size that fitted still fits after an
out-of-memory error at a larger one has emptied the cache. A real allocator also depends
on its history through fragmentation, which this model leaves out.

[Note: the host memory of cached blocks]
A simulated block's values live in a host tensor (its "backing"). Allocating and freeing
those on the host costs what a GPU's caching allocator does not (malloc, page faults on the
first write, munmap), for every copy a pager makes. So the allocator keeps the host storage
of a freed block whose backing owned all of it (``keep``), within its cached bytes (reserved
minus allocated) and ``HOST_CACHE_LIMIT``, and the next allocation of exactly that size
takes it back (``reuse``): what a real allocator does with device memory. ``empty_cache``,
and the release before an OOM, drop it with the cached bytes. A reused block holds whatever
the last one wrote, as uninitialised memory on a GPU does.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["Allocator", "round_block"]

_BLOCK = 512
_SEGMENT = 2 * 1024**2
HOST_CACHE_LIMIT = 1024**3  # host bytes kept for freed blocks, per device


def round_block(nbytes: int) -> int:
    return 0 if nbytes <= 0 else -(-nbytes // _BLOCK) * _BLOCK


def _segment(block: int) -> int:
    return max(_SEGMENT, -(-block // _SEGMENT) * _SEGMENT)


def _segments_in_use(allocated: int) -> int:
    """What stays reserved when the cache is emptied (see [Note: emptying whole segments])."""
    return -(-allocated // _SEGMENT) * _SEGMENT


def _format(n: float) -> str:
    # CUDA's own format_size: bytes, KiB, MiB, GiB with two decimals.
    if n <= 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


class Allocator:
    """One simulated device's memory: what is allocated, reserved, and the limit."""

    def __init__(self, index: int, total: int) -> None:
        self.index = index
        self.total = total
        self.fraction = 1.0
        self.allocated = 0
        self.peak_allocated = 0
        self.reserved = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.count = 0  # allocations alive
        self.peak_count = 0
        self.allocated_total = 0  # bytes ever allocated and freed, for memory_stats()
        self.freed_total = 0
        self.reserved_total = 0  # bytes ever reserved and given back
        self.released_total = 0
        self._lock = threading.Lock()
        # See [Note: the host memory of cached blocks]: storages by size, and their bytes.
        self._host: dict[int, list[Any]] = {}
        self._host_bytes = 0

    @property
    def limit(self) -> int:
        return int(self.total * self.fraction)

    def allocate(self, nbytes: int) -> int:
        """Count a block of ``nbytes`` (returns its rounded size) or raise CUDA's OOM."""
        block = round_block(nbytes)
        if block == 0:
            return 0
        with self._lock:
            cached = self.reserved - self.allocated
            if cached < block:
                grow = _segment(block - cached)  # see [Note: emptying whole segments]
                if self.reserved + grow > self.limit:
                    # Like the real allocator: give cached segments back, then try once more.
                    self._release_cached()
                    self._drop_host()
                    grow = _segment(block - (self.reserved - self.allocated))
                if self.reserved + grow > self.limit:
                    self.num_ooms += 1
                    raise torch.OutOfMemoryError(self._oom_message(block))
                self.reserved += grow
                self.reserved_total += grow
                self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.allocated += block
            self.allocated_total += block
            self.num_allocs += 1
            self.count += 1
            self.peak_allocated = max(self.peak_allocated, self.allocated)
            self.peak_count = max(self.peak_count, self.count)
        return block

    def _release_cached(self) -> None:
        """Give back the segments no allocation uses (the lock is held)."""
        kept = _segments_in_use(self.allocated)
        self.released_total += self.reserved - kept
        self.reserved = kept

    def free(self, block: int) -> None:
        if block == 0:  # an empty tensor: nothing was allocated for it (see ``allocate``)
            return
        with self._lock:
            self.allocated -= block
            self.freed_total += block
            self.num_frees += 1
            self.count -= 1

    def empty_cache(self) -> None:
        with self._lock:
            self._release_cached()
            self._drop_host()

    def keep(self, nbytes: int, storage: Any) -> None:
        """Hold a freed block's host storage of ``nbytes`` for ``reuse``, if the cached bytes
        cover it (see [Note: the host memory of cached blocks])."""
        with self._lock:
            total = self._host_bytes + nbytes
            if total <= self.reserved - self.allocated and total <= HOST_CACHE_LIMIT:
                self._host.setdefault(nbytes, []).append(storage)
                self._host_bytes = total

    def reuse(self, nbytes: int) -> Any:
        """A kept host storage of exactly ``nbytes``, or None."""
        with self._lock:
            kept = self._host.get(nbytes)
            if not kept:
                return None
            self._host_bytes -= nbytes
            return kept.pop()

    def _drop_host(self) -> None:
        self._host.clear()
        self._host_bytes = 0

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_allocated = self.allocated
            self.peak_reserved = self.reserved
            self.peak_count = self.count

    def reset_accumulated(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats``: the counts of what was allocated
        and freed (bytes, blocks, segments) and of OOMs start again from 0."""
        with self._lock:
            self.num_allocs = self.num_frees = self.num_ooms = 0
            self.allocated_total = self.freed_total = 0
            self.reserved_total = self.released_total = 0

    def _oom_message(self, block: int) -> str:
        free = max(0, self.total - self.reserved)
        cached = self.reserved - self.allocated
        allowed = ""
        if self.fraction < 1.0:
            allowed = (f" Process has {_format(self.limit)} memory allowed "
                       f"(set_per_process_memory_fraction={self.fraction:g}).")
        return (
            f"CUDA out of memory. Tried to allocate {_format(block)}. GPU {self.index} has a "
            f"total capacity of {_format(self.total)} of which {_format(free)} is free. "
            f"Including non-PyTorch memory, this process has {_format(self.reserved)} memory "
            f"in use.{allowed} "
            f"Of the allocated memory {_format(self.allocated)} is allocated by PyTorch, and "
            f"{_format(cached)} is reserved by PyTorch but unallocated. If reserved but "
            f"unallocated memory is large try setting "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            f"documentation for Memory Management  "
            f"(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables) "
            f"[simulated by adaptmem.testing.simulated_cuda]"
        )

    def stats(self) -> dict[str, int]:
        """What ``torch.cuda.memory_stats`` gives, every key ``memory_summary`` reads: one
        pool (the simulation does not tell small blocks from large, so the small pool stays
        empty), nothing split or oversize; segments counted in 2 MiB."""
        with self._lock:
            count = self.count
            reserved = (self.reserved, self.peak_reserved, self.reserved_total,
                        self.released_total)
            allocated = (self.allocated, self.peak_allocated, self.allocated_total,
                         self.freed_total)
            allocations = (count, self.peak_count, self.num_allocs, self.num_frees)
            segments = tuple(-(-n // _SEGMENT) for n in reserved)
            pooled = {"allocated_bytes": allocated, "active_bytes": allocated,
                      "requested_bytes": allocated, "reserved_bytes": reserved,
                      "inactive_split_bytes": (0, 0, 0, 0), "allocation": allocations,
                      "active": allocations, "segment": segments,
                      "inactive_split": (0, 0, 0, 0)}
            fields = ("current", "peak", "allocated", "freed")
            out: dict[str, int] = {}
            for name, values in pooled.items():
                for pool, scale in (("all", 1), ("large_pool", 1), ("small_pool", 0)):
                    out.update({f"{name}.{pool}.{f}": v * scale
                                for f, v in zip(fields, values, strict=True)})
            for name in ("oversize_allocations", "oversize_segments"):
                out.update({f"{name}.{f}": 0 for f in fields})
            out.update(num_ooms=self.num_ooms, num_alloc_retries=0, num_sync_all_streams=0,
                       num_device_alloc=segments[2], num_device_free=segments[3],
                       max_split_size=-1)
            return out
