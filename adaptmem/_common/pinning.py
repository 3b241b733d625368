"""Page-locked host memory of the size asked for, and giving pinned memory back.

[Note: pinned memory at its size]
torch's host allocator on CUDA rounds every pinned allocation up to a power of two (and keeps
freed blocks page-locked for reuse): a pager's pack of a unit of 33 MiB took 64 MiB of
page-locked host memory, a 13B-parameter Llama's layers (605 MiB in float16) 1 GiB each: up
to 2x the weights, in memory that the system cannot swap or reclaim. So large
pinned buffers (``EXACT_FROM`` bytes and up) are anonymous memory of their own, mapped at
their size (rounded to pages) and registered with CUDA (``cudaHostRegister``): page-locked
as ``pin_memory=True`` makes them, ``is_pinned()`` true, copies from them asynchronous, but
no larger than asked. A ``Region`` lives while any tensor over it does (each holds a
``memoryview`` of it); when the last goes, it is unregistered and unmapped, or, inside a
``pinned_cache_kept()`` block, kept registered for the next buffer it fits (a ``model=``
placement removes its pagers only to page the same models again: pinning gigabytes again
costs seconds). ``release_pinned()`` gives the kept ones back with torch's cached blocks.
Where registering is not possible (no CUDA, ROCm, a driver that refuses), torch's
allocator pins instead, rounded as before. Small buffers go to torch's allocator too:
rounding them costs little, and its cache makes them cheap to pin again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import weakref
from collections.abc import Iterator, Sequence

import torch

__all__ = ["EXACT_FROM", "Region", "extent", "pinned_cache_kept", "pinned_copy", "pinned_empty",
           "release_kept", "release_pinned"]

logger = logging.getLogger("adaptmem")

EXACT_FROM = 2**20  # bytes; smaller pinned buffers come from torch's allocator
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not one
_PAGE = mmap.PAGESIZE

_pinned_kept = threading.local()  # .depth: pinned_cache_kept blocks open in this thread
_lock = threading.Lock()
_kept: list[Region] = []  # registered regions nothing uses, kept for reuse


class Region:
    """Anonymous host memory registered with CUDA as page-locked (see [Note: pinned memory
    at its size]): ``memory`` (an ``mmap``) starts at ``address``."""

    __slots__ = ("memory", "address")

    def __init__(self, memory: mmap.mmap, address: int) -> None:
        self.memory = memory
        self.address = address


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A new uint8 host tensor of ``nbytes`` bytes in page-locked memory (values undefined):
    memory of its own registered with CUDA at that size (rounded to pages) from
    ``EXACT_FROM`` bytes up where CUDA allows it, else torch's ``pin_memory=True``. Raises
    torch's ``RuntimeError`` when no pinned memory can be had (callers fall back to
    pageable memory)."""
    if nbytes >= EXACT_FROM and torch.version.hip is None and torch.cuda.is_available():
        region = _kept_region(nbytes) or _new_region(nbytes)
        if region is not None:
            # The tensor holds ``view``, and every view of the tensor its storage: when the
            # last goes, so does ``view``, and the region is retired.
            view = memoryview(region.memory)
            weakref.finalize(view, _retire, region).atexit = False
            return torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of dense ``t`` (on any device) in pinned host memory, laid out as
    ``torch.empty_like`` lays it out (see ``pinned_empty``); ``t`` itself when it is pinned
    already. Raises torch's ``RuntimeError`` when no pinned memory can be had."""
    if t.is_cpu and t.is_pinned():
        return t
    if t.numel() * t.element_size() < EXACT_FROM:
        return (t if t.is_cpu else t.to("cpu")).pin_memory()
    # The strides a copy keeps (empty_like's: a dense layout such as channels_last stays,
    # anything else becomes contiguous), on the meta device: no memory.
    stride = torch.empty_like(t, device="meta").stride()
    nbytes = extent(t.shape, stride) * t.element_size()
    return pinned_empty(nbytes).view(t.dtype).as_strided(t.shape, stride).copy_(t)


def extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many elements a tensor of ``shape`` and ``stride`` spans in its storage."""
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _retire(region: Region) -> None:
    """No tensor is over ``region`` any more, so no copy reads it (a pager synchronizes
    before it lets go of its masters): kept for reuse inside a ``pinned_cache_kept()``
    block, else unregistered and unmapped."""
    if getattr(_pinned_kept, "depth", 0):
        with _lock:
            _kept.append(region)
        return
    _unregister(region)


def _kept_region(nbytes: int) -> Region | None:
    """The smallest kept region that holds ``nbytes`` without wasting as much as rounding
    up to a power of two would."""
    with _lock:
        fits = [r for r in _kept if nbytes <= len(r.memory) < 2 * nbytes + _PAGE]
        if not fits:
            return None
        best = min(fits, key=lambda r: len(r.memory))
        _kept.remove(best)
        return best


def _new_region(nbytes: int) -> Region | None:
    """A new region of ``nbytes`` (rounded up to pages), registered; None when the memory or
    the registration is refused (logged)."""
    length = -(-nbytes // _PAGE) * _PAGE
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: torch's allocator pins
        return None
    try:
        # Private, as malloc's memory is: a forked child gets a copy, not the same pages.
        memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        logger.debug("adaptmem: %d bytes of host memory refused (%s)", length, exc)
        return None
    # The address, through a buffer export that ends with the statement.
    region = Region(memory, ctypes.addressof(ctypes.c_char.from_buffer(memory)))
    try:
        error = int(torch.cuda.cudart().cudaHostRegister(region.address, length, _PORTABLE))
    except (AttributeError, RuntimeError) as exc:  # a build without the binding
        error, reason = -1, str(exc)
    else:
        reason = f"CUDA error {error}"
    if error:
        logger.debug("adaptmem: registering %d bytes as pinned failed (%s); torch's "
                     "allocator pins instead", length, reason)
        memory.close()
        return None
    return region


def _unregister(region: Region) -> None:
    """Unregister ``region`` (best effort: a device with a sticky error refuses; its memory
    is unmapped anyway when the region goes)."""
    try:
        error = int(torch.cuda.cudart().cudaHostUnregister(region.address))
    except Exception as exc:  # noqa: BLE001 - at exit, or CUDA gone: nothing to do
        error = -1
        logger.debug("adaptmem: unregistering pinned memory failed (%s)", exc)
    if error > 0:
        logger.debug("adaptmem: unregistering pinned memory failed (CUDA error %d)", error)
    with contextlib.suppress(BufferError):  # still exported: unmapped when it goes
        region.memory.close()


@contextlib.contextmanager
def pinned_cache_kept() -> Iterator[None]:
    """Within the block, pinned memory let go of stays page-locked for reuse and
    ``release_pinned`` gives nothing back: a placement that removes its pagers only to page
    the same models again reuses that memory, where freeing and pinning it again would cost
    a device synchronize and seconds a GiB."""
    depth = getattr(_pinned_kept, "depth", 0)
    _pinned_kept.depth = depth + 1
    try:
        yield
    finally:
        _pinned_kept.depth = depth


def release_kept() -> None:
    """Unregister and unmap the regions kept for reuse (see ``pinned_cache_kept``) that
    nothing took."""
    with _lock:
        kept = list(_kept)
        _kept.clear()
    for region in kept:
        _unregister(region)


def release_pinned() -> None:
    """Give back the pinned host memory kept for reuse: regions let go of inside
    ``pinned_cache_kept()`` blocks, and the blocks torch's host allocator keeps page-locked
    after they were freed (each rounded up to a power of two), so that a pager's host copies
    do not stay held after ``remove()``. Blocks still in use, or read by a copy in flight,
    stay; so does all of torch's on a device with a sticky error, whose frees fail (best
    effort: that is logged, not raised)."""
    if getattr(_pinned_kept, "depth", 0):
        return
    release_kept()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            try:
                empty()
            except RuntimeError as exc:
                logger.debug("adaptmem: torch's pinned cache was not emptied (%s)", exc)
