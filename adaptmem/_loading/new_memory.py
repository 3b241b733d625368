"""New memory for the tensors a load makes: faulted in ahead of the reads, or filled straight
from the page cache without being zeroed first.

See [Note: faulting new memory ahead] and [Note: filling new memory from the page cache].
``NewMemory`` belongs to one load (a ``Reader``); its methods are safe to call from the
reader threads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from .._common.libc import libc_function, resident_pages

__all__ = ["NewMemory", "populate"]

logger = logging.getLogger("adaptmem")

# [Note: faulting new memory ahead]
# What a fresh process does pay per new page is work in the kernel (finding, zeroing and
# mapping it: 0.25-0.3 s for 0.46 GiB on the 2-core VM, one core busy throughout), and one
# thread does it all when `preadv` faults the pages it copies into. So before reading, every
# new CPU tensor of the load that is not filled from the page cache (below; nor those of a
# built model: its constructor wrote them) is handed, in file order and _CHUNK at a time, to
# the worker threads that fault its pages in with MADV_POPULATE_WRITE (Linux 5.14+; the
# kernel walks the range in one call, no trap per page): the reader then mostly copies into
# memory that exists, and on a cold file the faults overlap the disk. It writes nothing (a
# page already present is skipped) and faults only memory the load fills anyway, so the peak
# is unchanged. Measured in fresh processes on the 2-core VM: 0.46 GiB from the page cache in
# 141-183 ms with two faulting threads against 266-327 ms without (`benchmarks/loading.py`).
# Where madvise refuses it (older kernels), reading goes on as before.
#
# [Note: filling new memory from the page cache]
# Faulted in ahead or not, every new page is zeroed by the kernel and then overwritten by the
# copy from the page cache: two passes over memory where one would do. userfaultfd's
# UFFDIO_COPY does it in one: it gives a missing page of a registered range a new page that
# already holds bytes copied from a source address. So a large tensor whose bytes the page
# cache holds (`Reader.empty_for`) is not faulted in ahead; each piece read into it registers
# the piece's whole pages, copies them from the file's shared read-only mapping (the one
# `DirectReads` asks mincore about) with UFFDIO_COPY, and unregisters them. The pages are
# ordinary anonymous memory then: unlike a private mapping of the file, which also copies
# without zeroing but loses its pages when the file is truncated (see [Note: reading
# speed]), nothing depends on the file afterwards. The source pages the copy maps are
# unmapped again after each piece (MADV_DONTNEED on a shared mapping drops only this
# process's page-table entries, not the cache), so the load's resident size does not grow by
# the file. Measured on the 2-core VM, fresh processes, GPT-2 small's 0.46 GiB from the page
# cache: 0.12-0.16 s with two threads against 0.20-0.22 s faulting ahead and copying.
# A page of a registered range that anything else touched would wait for a handler that
# never comes, so:
# - the descriptor is opened with UFFD_USER_MODE_ONLY (Linux 5.11+; it is also what lets a
#   process without privileges open one where vm.unprivileged_userfaultfd is 0): a fault
#   from the kernel (a read() into such a page) fails with EFAULT instead of waiting;
# - only memory of tensors this load made, that nobody else holds yet, is registered, only
#   the whole pages of one piece, and only while that piece is copied (unregistered in a
#   finally); a piece's partial first and last pages, shared with its neighbours, are read
#   as before;
# - the descriptor is closed with the load, which unregisters whatever is left.
# Pages that exist already (memory the allocator reused: a second load in a process often
# gets much of it) are found first with mincore and read as before, in one read per run of
# them: trying each with UFFDIO_COPY (EEXIST) and reading it alone made such a load 3-4x
# slower. Everything is read as before where the system refuses: no userfaultfd (other
# architectures, seccomp in many containers, gVisor), a kernel older than 5.11, or a copy
# that fails (EFAULT: the file was truncated meanwhile, and the read says so). And where
# new memory gets transparent huge pages (the policy is "always", or "madvise" with torch's
# THP_MEM_ALLOC_ENABLE=1), nothing is filled: UFFDIO_COPY maps 4 KiB pages, and weights
# the system would keep in huge pages are worth more than the copy it saves.
_MADV_POPULATE_WRITE = 23
_MADV_DONTNEED = 4
_STEP = 4 * 2**20  # bytes copied before their source is unmapped again
_PAGE = mmap.PAGESIZE
_madvise = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
                         ctypes.c_int)
_drop = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
                      ctypes.c_int)  # MADV_DONTNEED, kept apart from `populate`'s
_syscall = libc_function("syscall", None, ctypes.c_long)
_ioctl = libc_function("ioctl", [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p], ctypes.c_int)
_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())  # syscall numbers
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_UFFDIO_REGISTER_MODE_MISSING = 1
_UFFDIO_COPY_BIT = 1 << 0x03  # in the ioctls a registered range allows


def _iowr(nr: int, size: int, direction: int = 3) -> int:
    return (direction << 30) | (size << 16) | (_UFFD_API << 8) | nr


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64),
                ("ioctls", ctypes.c_uint64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


_UFFDIO_API = _iowr(0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(0x00, ctypes.sizeof(_Register))
_UFFDIO_UNREGISTER = _iowr(0x01, ctypes.sizeof(_Range), direction=2)
_UFFDIO_COPY = _iowr(0x03, ctypes.sizeof(_Copy))
_fills = (_USERFAULTFD is not None and _syscall is not None and _ioctl is not None
          and _drop is not None)  # False once the system refused a userfaultfd


def _whole_pages(start: int, end: int) -> tuple[int, int]:
    """The first and the end of the whole pages inside ``[start, end)``."""
    return -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE


def populate(address: int, nbytes: int) -> None:
    """Fault in the whole pages of ``[address, address + nbytes)`` for writing, where the
    system can (see [Note: faulting new memory ahead])."""
    global _madvise
    start, end = _whole_pages(address, address + nbytes)
    if (_madvise is not None and end > start
            and _madvise(start, end - start, _MADV_POPULATE_WRITE) != 0
            and ctypes.get_errno() == errno.EINVAL):  # a kernel without MADV_POPULATE_WRITE
        _madvise = None


def _huge_pages_wanted() -> bool:
    """Whether new memory gets transparent huge pages here: the system's policy is "always",
    or "madvise" and torch asks for them (``THP_MEM_ALLOC_ENABLE=1``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            policy = f.read()
    except OSError:
        return False
    return "[always]" in policy or (
        "[madvise]" in policy and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1")


def _open_userfaultfd() -> int | None:
    """A userfaultfd for user-mode faults only; None where the system refuses one or new
    memory gets huge pages (then never asked again in this process, unless it ran out of
    descriptors)."""
    global _fills
    if _USERFAULTFD is None:
        return None
    if _huge_pages_wanted():  # UFFDIO_COPY maps 4 KiB pages: the weights would lose them
        _fills = False
        logger.debug("adaptmem.load: new memory gets transparent huge pages here; it is "
                     "faulted in and copied into, not filled page by page")
        return None
    fd = int(_syscall(ctypes.c_long(_USERFAULTFD),
                      ctypes.c_long(os.O_CLOEXEC | _UFFD_USER_MODE_ONLY)))
    if fd < 0:
        err = ctypes.get_errno()
        if err not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            _fills = False
            logger.debug("adaptmem.load: no userfaultfd (%s); new memory is faulted in and "
                         "copied into", os.strerror(err))
        return None
    api = _Api(_UFFD_API, 0, 0)
    if _ioctl(fd, _UFFDIO_API, ctypes.byref(api)) != 0:
        os.close(fd)
        _fills = False
        return None
    return fd


def _unmap_source(start: int, end: int) -> None:
    """Unmap the whole pages of ``[start, end)`` of a shared file mapping (MADV_DONTNEED: the
    page cache keeps them)."""
    low, high = _whole_pages(start, end)
    if high > low:
        _drop(low, high - low, _MADV_DONTNEED)


def _register(fd: int, start: int, end: int) -> bool:
    request = _Register(_Range(start, end - start), _UFFDIO_REGISTER_MODE_MISSING, 0)
    if _ioctl(fd, _UFFDIO_REGISTER, ctypes.byref(request)) != 0:
        return False
    if not request.ioctls & _UFFDIO_COPY_BIT:  # registered, but cannot be copied into
        _ioctl(fd, _UFFDIO_UNREGISTER, ctypes.byref(_Range(start, end - start)))
        return False
    return True


def _missing(start: int, end: int) -> list[tuple[int, int]]:
    """The runs ``(a, b)`` of whole pages in ``[start, end)`` (page-aligned) that have no page
    yet, in order (mincore on anonymous memory); all of it where mincore cannot say."""
    flags = resident_pages(start, end - start)
    if flags is None:
        return [(start, end)]
    return [(start + m.start() * _PAGE, start + m.end() * _PAGE)
            for m in re.finditer(b"\0+", flags)]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (in order) with neighbours joined: one read each."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _copy_run(fd: int, start: int, end: int, delta: int, left: list[tuple[int, int]]) -> int:
    """Copy pages ``[start, end)`` from ``start + delta`` on, _STEP at a time, each step's
    source unmapped after it; pages found to exist meanwhile go to ``left``. Returns where
    copying stopped (``end`` when done)."""
    at = start
    while at < end:
        step = min(end, at + _STEP)
        stop = _copy(fd, at, step, delta, left)
        _unmap_source(at + delta, step + delta)
        if stop < step:
            return stop
        at = step
    return end


def _copy(fd: int, start: int, end: int, delta: int, existing: list[tuple[int, int]]) -> int:
    """UFFDIO_COPY pages ``[start, end)`` from ``start + delta`` on; pages that exist are
    added to ``existing`` and skipped. Returns where copying stopped (``end`` when done)."""
    at = start
    retries = 0
    while at < end:
        request = _Copy(at, at + delta, end - at, 0, 0)
        if _ioctl(fd, _UFFDIO_COPY, ctypes.byref(request)) == 0:
            return end
        err = ctypes.get_errno()
        if request.copy > 0:  # partly done (EAGAIN): go on from there
            at += request.copy
        elif err == errno.EEXIST:  # a page that exists: the ordinary read fills it
            existing.append((at, at + _PAGE))
            at += _PAGE
        elif err == errno.EAGAIN and retries < 8:  # the address space changed meanwhile
            retries += 1
        else:  # EFAULT (truncated file, I/O error), ENOMEM, ...: the ordinary read says why
            return at
    return end


class NewMemory:
    """The new CPU tensors of one load: faulted in ahead on worker threads, or marked to be
    filled from the page cache piece by piece (see the notes above)."""

    def __init__(self) -> None:
        self._faulting: dict[int, list[Future[None]]] = {}  # storage address -> its chunks
        self._filled: set[int] = set()  # addresses of tensors filled from the page cache
        self._fd: int | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Forget the tensors; call once no read is running."""
        self._faulting.clear()
        self._filled.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def fill_later(self, tensor: torch.Tensor) -> bool:
        """Mark new, untouched ``tensor``, whose bytes the page cache holds, to be filled
        from it as it is read; False where the system cannot."""
        if self._descriptor() is None:
            return False
        self._filled.add(tensor.data_ptr())
        return True

    def fills(self, address: int) -> bool:
        """Whether the tensor at ``address`` is filled from the page cache."""
        return address in self._filled

    def fill(self, address: int, source: int | None, n: int) -> list[tuple[int, int]]:
        """Copy ``n`` bytes from ``source`` (in a mapping of a file) into ``[address,
        address + n)``, new memory nothing else touches meanwhile: every whole page there
        that has no page yet gets one holding its bytes. Returns the spans ``(start, end)``,
        relative to ``address``, left for the caller to read: the partial first and last
        page, pages that exist (memory the allocator reused), and everything where the
        system refuses."""
        first, end = _whole_pages(address, address + n)
        fd = self._descriptor() if source is not None and end > first else None
        runs = _missing(first, end) if fd is not None else []
        if fd is None or source is None or not runs:
            return [(0, n)]
        if not _register(fd, first, end):
            populate(address, n)  # as the faulting threads would have: one call, no traps
            return [(0, n)]
        left: list[tuple[int, int]] = []
        done = address  # everything before is copied or in ``left``
        try:
            for a, b in runs:
                left.append((done, a))
                done = _copy_run(fd, a, b, source - address, left)
                if done < b:  # the copy failed: the ordinary read says why
                    left.append((done, b))
                    done = b
                    break
        finally:
            _ioctl(fd, _UFFDIO_UNREGISTER, ctypes.byref(_Range(first, end - first)))
        left.append((done, address + n))
        return _merged([(a - address, b - address) for a, b in left if b > a])

    def _descriptor(self) -> int | None:
        with self._lock:
            if self._fd is None and _fills:
                self._fd = _open_userfaultfd()
            return self._fd

    def fault_ahead(self, tensors: list[torch.Tensor],
                    submit: Callable[..., Future[None] | None], chunk: int) -> None:
        """Start faulting in the pages of ``tensors`` (ordinary CPU memory; others, and those
        filled from the page cache, are skipped) on worker threads (``submit(fn, *args)``,
        None where no thread can start: the reads then fault them), in order, ``chunk``
        bytes at a time."""
        if _madvise is None:
            return
        storages = [t.untyped_storage() for t in tensors
                    if t.device.type == "cpu" and not t.is_pinned()
                    and t.data_ptr() not in self._filled]
        spans = [(s.data_ptr(), s.nbytes()) for s in storages]
        spans = [(a, n) for a, n in spans if n >= _PAGE]
        if not spans:
            return
        for address, nbytes in spans:
            if address in self._faulting:  # one storage behind several tensors (ties)
                continue
            chunks = self._faulting[address] = []
            for done in range(0, nbytes, chunk):
                started = submit(populate, address + done, min(chunk, nbytes - done))
                if started is None:
                    return
                chunks.append(started)

    def faulted(self, dest: torch.Tensor, start: int, end: int, chunk: int) -> None:
        """Wait until the faulting threads are done with bytes ``[start, end)`` of ``dest``:
        faulting them here too would only repeat their work."""
        if not self._faulting:  # nothing faulted ahead: staging buffers, built models
            return
        storage = dest.untyped_storage()
        chunks = self._faulting.get(storage.data_ptr())
        if not chunks:
            return
        base = dest.data_ptr() - storage.data_ptr()
        for i in range((base + start) // chunk, min(len(chunks), -(-(base + end) // chunk))):
            chunks[i].result()
