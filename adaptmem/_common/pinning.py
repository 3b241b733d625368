"""Page-locked host memory of the size asked for, and giving pinned memory back.

[Note: pinned memory at its size]
torch's host allocator on CUDA rounds every pinned allocation up to a power of two (and
keeps freed blocks page-locked for reuse): a pager's pack of a unit of 33 MiB took 64 MiB of
page-locked host memory, a 13B-parameter Llama's layers (605 MiB in float16) 1 GiB each: up
to 2x the weights, in memory that the system cannot swap or reclaim. So large pinned
buffers (``EXACT_FROM`` bytes and up) are anonymous memory of their own, mapped at their
size (rounded to pages) and registered with CUDA (``cudaHostRegister``): page-locked as
``pin_memory=True`` makes them, ``is_pinned()`` true, copies from them asynchronous, but no
larger than asked. A ``Region`` lives while any tensor over it does (each holds a
``memoryview`` of it); when the last goes, it is unregistered and unmapped, or, inside a
``pinned_cache_kept()`` block, kept registered for the next buffer it fits (a ``model=``
placement removes its pagers only to page the same models again, or to time one chunked
call before paging them again: pinning gigabytes again costs seconds). ``release_kept()``
gives the kept ones back, and ``release_pinned()`` those with torch's cached blocks.
Where registering is not possible (no CUDA, ROCm, Windows, a driver that refuses), torch's
allocator pins instead, rounded as before. Small buffers go to torch's allocator too:
rounding them costs little, and its cache makes them cheap to pin again.

What torch's allocator did for its blocks is done here for the regions:
- A failed runtime call leaves its error pending for the thread, and torch's next kernel
  launch raises it as its own (an "out of memory" that is not the kernel's). So each failed
  call is followed by ``cudaGetLastError``, from torch's binding where it has one, else from
  the runtime ``libtorch_cuda`` links; where neither is found nothing is registered.
- The runtime registers with the thread's current device, making it a context if it had none
  (hundreds of MiB on that GPU). So a region is registered, and unregistered, with the
  device its first copies go to current, or one that has a context already; where no device
  has one yet, torch's allocator pins.
- torch's allocator holds a freed block until the copies reading it completed (by event).
  A region has no such guard, and its registration is portable (a region kept and reused
  may serve another device), so retiring one synchronizes every device that has a context
  first (a pager dropped with a copy in flight; ``remove()`` has synchronized already).
- Unregistering inside a CUDA graph capture would break it: a region let go of in the
  capturing thread is kept until ``release_kept()`` (a capture in another thread is not
  seen: drop paged models outside captures). A region the driver refuses to unregister (for
  another reason than CUDA being gone) stays mapped: its address mapped again would lie
  under a stale registration. A forked child forgets the kept regions (no registration
  carries over a fork).
- The garbage collector retires regions wherever it runs, inside the code that holds the
  kept list too: retiring takes no lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["EXACT_FROM", "Region", "extent", "pinned_cache_kept", "pinned_copy", "pinned_empty",
           "release_kept", "release_pinned"]

logger = logging.getLogger("adaptmem")

EXACT_FROM = 2**20  # bytes; smaller pinned buffers come from torch's allocator
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not one
_PAGE = mmap.PAGESIZE

_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
_UNLOADING = 4  # cudaErrorCudartUnloading: the process is exiting

_pinned_kept = threading.local()  # .depth: pinned_cache_kept blocks open in this thread
_lock = threading.RLock()
_kept: list[Region] = []  # registered regions nothing uses, kept for reuse
_leaked: list[Region] = []  # regions the driver would not unregister: never unmapped
_libcudart: Any = False  # the CUDA runtime library torch loaded (False: not looked for)


class Region:
    """Anonymous host memory registered with CUDA as page-locked (see [Note: pinned memory
    at its size]): ``memory`` (an ``mmap``) starts at ``address``; registered and
    unregistered with ``device`` current, one that had a CUDA context already."""

    __slots__ = ("memory", "address", "device")

    def __init__(self, memory: mmap.mmap, address: int, device: int) -> None:
        self.memory = memory
        self.address = address
        self.device = device


def pinned_empty(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """A new uint8 host tensor of ``nbytes`` bytes in page-locked memory (values undefined):
    memory of its own registered with CUDA at that size (rounded to pages) from
    ``EXACT_FROM`` bytes up where CUDA allows it, else torch's ``pin_memory=True``.
    ``device``: the CUDA device its copies go to (registered with it current, so that no
    other device gets a context). Raises torch's ``RuntimeError`` when no pinned memory can
    be had (callers fall back to pageable memory)."""
    if nbytes >= EXACT_FROM and torch.version.hip is None and torch.cuda.is_available():
        region = _kept_region(nbytes) or _new_region(nbytes, device)
        if region is not None:
            # The tensor holds ``view``, and every view of the tensor its storage: when the
            # last goes, so does ``view``, and the region is retired.
            view = memoryview(region.memory)
            weakref.finalize(view, _retire, region).atexit = False
            return torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pinned_copy(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A copy of ``t`` (on any device) in pinned host memory, laid out as
    ``torch.empty_like`` lays it out (see ``pinned_empty``, and there ``device``); ``t``
    itself when it is pinned already. Raises torch's ``RuntimeError`` when no pinned memory
    can be had."""
    if t.is_cpu and t.is_pinned():
        return t
    if (t.numel() * t.element_size() < EXACT_FROM or t.is_quantized
            or t.layout != torch.strided):  # layouts a byte buffer cannot hold: torch's
        return (t if t.is_cpu else t.to("cpu")).pin_memory()
    # The strides a copy keeps (empty_like's: a dense layout such as channels_last stays,
    # anything else becomes contiguous), on the meta device: no memory.
    stride = torch.empty_like(t, device="meta").stride()
    nbytes = extent(t.shape, stride) * t.element_size()
    return pinned_empty(nbytes, device).view(t.dtype).as_strided(t.shape, stride).copy_(t)


def extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many elements a tensor of ``shape`` and ``stride`` spans in its storage."""
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _retire(region: Region) -> None:
    """No tensor is over ``region`` any more: kept for reuse inside a ``pinned_cache_kept()``
    block (or while a CUDA graph is being captured, where unregistering would break the
    capture), else unregistered and unmapped. Called by the garbage collector too, in any
    thread and inside any code, ``_kept_region`` included: it takes no lock (one append is
    atomic)."""
    if getattr(_pinned_kept, "depth", 0) or _capturing():
        _kept.append(region)
        return
    _unregister(region)


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - no CUDA any more: nothing is captured
        return False


def _kept_region(nbytes: int) -> Region | None:
    """The smallest kept region that holds ``nbytes`` without wasting as much as rounding
    up to a power of two would."""
    with _lock:
        fits = [r for r in list(_kept) if nbytes <= len(r.memory) < 2 * nbytes + _PAGE]
        if not fits:
            return None
        best = min(fits, key=lambda r: len(r.memory))
        _kept.remove(best)
        return best


def _context_device(device: torch.device | None) -> int | None:
    """The CUDA device to register memory with: ``device``'s, else the current one where it
    has a context, else the first that has one; None when none has (registering would make
    one)."""
    if device is not None and device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    current = torch.cuda.current_device()
    if has_context is None:
        return current
    try:
        for index in (current, *range(torch.cuda.device_count())):
            if has_context(index):
                return index
    except RuntimeError:  # a build that cannot tell: as torch's allocator, the current one
        return current
    return None


def _new_region(nbytes: int, device: torch.device | None) -> Region | None:
    """A new region of ``nbytes`` (rounded up to pages), registered; None when the memory or
    the registration is refused (logged), or where a refusal could not be cleared."""
    length = -(-nbytes // _PAGE) * _PAGE
    index = _context_device(device)
    if not hasattr(mmap, "MAP_PRIVATE") or index is None or _last_error() is None:
        return None  # Windows, no context yet, or no way to clear a failed call's error
    try:
        # Private, as malloc's memory is: a forked child gets a copy, not the same pages.
        memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        logger.debug("adaptmem: %d bytes of host memory refused (%s)", length, exc)
        return None
    # The address, through a buffer export that ends with the statement.
    region = Region(memory, ctypes.addressof(ctypes.c_char.from_buffer(memory)), index)
    error = _call(region.device, "cudaHostRegister", region.address, length, _PORTABLE)
    if error:
        logger.debug("adaptmem: registering %d bytes as pinned failed (%s); torch's "
                     "allocator pins instead", length, error)
        memory.close()
        return None
    return region


def _call(device: int, name: str, *args: int) -> int:
    """CUDA runtime function ``name`` called with ``device`` current: 0, or its error code
    (-1: the call could not be made). A failed call's error is cleared: the runtime keeps
    it for the thread, and torch's next kernel launch would raise it as its own."""
    try:
        with torch.cuda.device(device):
            error = int(getattr(torch.cuda.cudart(), name)(*args))
    except Exception as exc:  # noqa: BLE001 - CUDA gone (at exit, a simulation that ended)
        logger.debug("adaptmem: %s failed (%s)", name, exc)
        return -1
    if error:
        clear = _last_error()
        if clear is not None:
            clear()
    return error


def _last_error() -> Callable[[], Any] | None:
    """``cudaGetLastError`` of the CUDA runtime torch uses (it clears the thread's last
    error): from torch's binding where it has it (the simulation's has; torch 2.14's has
    not), else from the runtime torch links (``_find_libcudart``). None where neither is
    found."""
    binding = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if binding is not None:
        return binding  # type: ignore[no-any-return]
    global _libcudart
    if _libcudart is False:
        _libcudart = _find_libcudart()
    return getattr(_libcudart, "cudaGetLastError", None)


def _find_libcudart() -> Any:
    """The CUDA runtime torch links, its symbols looked up through ``libtorch_cuda`` (the
    library, then what it depends on: torch's ``libcudart``, whatever its file is named);
    None (logged once) in a build without it, and then nothing is registered."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
    try:
        library = ctypes.CDLL(path)
        library.cudaGetLastError  # noqa: B018 - raises AttributeError where it is not found
    except (OSError, AttributeError):
        logger.info("adaptmem: the CUDA runtime's cudaGetLastError was not found: pinned "
                    "memory comes from torch's allocator, rounded up to powers of two")
        return None
    return library


def _unregister(region: Region) -> None:
    """Wait for copies that may still read ``region`` (a pager garbage-collected with a copy
    in flight: torch's allocator waited for those by event, registered memory has no such
    guard), then unregister and unmap it. Where the driver refuses the unregistering for
    another reason than the memory not being registered or CUDA being gone, the memory
    stays mapped (leaked): unmapped, its address could be mapped again under a stale
    registration."""
    _synchronize_all()
    error = _call(region.device, "cudaHostUnregister", region.address)
    if error in (0, _NOT_REGISTERED, _UNLOADING) or (error == -1 and not _cuda_alive()):
        with contextlib.suppress(BufferError):  # still exported: unmapped when it goes
            region.memory.close()
    else:
        logger.debug("adaptmem: unregistering pinned memory failed (CUDA error %d); its "
                     "%d bytes stay mapped", error, len(region.memory))
        _leaked.append(region)


def _synchronize_all() -> None:
    """Wait for every device that has a context: the registration is portable, so a region
    reused for another device than its first (or a restored storage, for any) may be read
    by copies to any of them."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    with contextlib.suppress(Exception):  # CUDA gone: nothing to wait for
        for index in range(torch.cuda.device_count()):
            if has_context is None or has_context(index):
                torch.cuda.synchronize(index)


def _cuda_alive() -> bool:
    """Whether the CUDA runtime can still be called (not after a simulation ended, at exit
    or in a forked child): a call that raised then is no refusal to unregister."""
    try:
        return bool(torch.cuda.is_available()) and not torch.cuda._is_in_bad_fork()
    except Exception:  # noqa: BLE001
        return False


def _forget_in_child() -> None:
    """In a forked child: no registration carried over, and the lock may be held."""
    global _lock
    _lock = threading.RLock()
    _kept.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


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
    if _capturing():
        return
    kept = []
    with _lock:
        while _kept:  # pop by pop: _retire appends without the lock
            kept.append(_kept.pop())
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
