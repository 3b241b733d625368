"""Reading a checkpoint past the page cache, straight into the tensors that keep it.

See [Note: reading past the page cache]. ``DirectReads`` belongs to one load (a ``Reader``):
it makes the new tensors that can take O_DIRECT reads, says whether the page cache holds a
range of a file, and reads what it does not hold.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable

import torch

from .._common.libc import libc_function, resident_pages

__all__ = ["DirectReads", "DIRECT_PIECE", "soft_limit"]

logger = logging.getLogger("adaptmem")

# [Note: reading past the page cache]
# A buffered read of a file the page cache does not hold makes new memory twice: the kernel
# fills page-cache pages first, then copies them into the tensor, which is new memory too.
# On the 2-core VM, where new memory is most of a load's cost, that made a cold copying load
# 2.6-4x the disk's sequential read time (GPT-2 large, 2.88 GiB). So a tensor of at least
# _DIRECT_MIN bytes that is read without conversion gets memory laid out for O_DIRECT: an
# anonymous mapping of its own, the tensor placed in it so that its address and its file
# offset agree modulo _DIRECT_ALIGN (`DirectReads.empty`). A piece the page cache does not
# hold is then read with O_DIRECT straight into the tensor: the disk writes into the memory
# that keeps the weights, the page cache gets nothing. Aligning a read's start down and its
# end up writes the file's own bytes into the same places, or into the mapping's slack
# around the tensor, never into other memory. The storage has exactly the tensor's bytes
# (`torch.frombuffer`), and it is freed with the tensor. Reads run on the loader's threads
# (at least four, see [Note: the loader's pool]; one per core, at most four, under a cap on
# the data segment, where each thread costs cap), in pieces of up to _DIRECT_PIECE, so
# that the disk has enough requests in flight: on the VM,
# 16 MiB reads reached 1.1-1.2 GB/s from one thread, 1.4 GB/s from two and 1.5-1.7 from
# four, 64 MiB reads 1.3-1.4 and 1.6-1.7 GB/s from one and two, the buffered floor 1.7-1.8
# GB/s; GPT-2 small, whose tensors are mostly 2-9 MiB, loaded cold in 0.36-0.45 s with four
# threads against 0.70 s and more with two. Whether the page cache holds a piece is asked
# with mincore on an untouched shared mapping of the file, which reads nothing (a RWF_NOWAIT
# read that misses starts reading the file into the cache, which would read it twice): a
# tensor the cache holds whole gets ordinary memory (with every large tensor in a mapping of
# its own, the demo's capped batch search failed once in four runs), and a cached piece of a
# partly cached one is copied from the cache; both are filled without zeroing them first
# where the system allows (see [Note: filling new memory from the page cache]), else their
# new pages are faulted in ahead in one call (MADV_POPULATE_WRITE): a warm load never
# touches the disk. mincore tells the truth only about files the process owns, may write or
# holds CAP_FOWNER over (Linux 5.0+, `can_do_mincore`): for any other file (a model store of
# another user, files baked into an image for a non-root user) it says every page is
# resident, and every cold load went through the page cache. For those files cachestat
# (Linux 6.5+) counts the cached pages instead (`_mincore_truthful`, `_cached_pages`); where
# it is missing or refused (kernels since 2025 restrict it as mincore), a one-byte
# RWF_NOWAIT read of the range's first and last page, on a duplicate of the buffered
# descriptor, says whether they are cached (`_page_cached`): a miss starts reading just that
# page (the descriptor reads no further ahead, POSIX_FADV_RANDOM), 4 KiB of the cache per
# probe, and stays a miss for the load (`_probe`); the range is taken for cached only when
# both pages are. Where that is refused too, residency is unknown and the file is read
# through the page cache, as where there is no mincore. Where the file system refuses
# O_DIRECT (open or read fails with EINVAL: tmpfs on older kernels, some FUSE file systems),
# the file is read through the page cache as before.
# A file read this way is not left in the page cache: loading it again reads the disk again,
# at the same speed.
#
# [Note: a file that shrinks during a load]
# The file is mapped (`_view`) at the length it has when its first large tensor is made,
# which is not the length its header was checked against: a trainer saving over the same
# path truncates it first. Nothing reads the mapping from this process (mincore reads
# nothing), but bytes past its end are other memory: a copy from there (UFFDIO_COPY) put
# unrelated bytes into weights, and unmapping its source (MADV_DONTNEED) zapped unrelated
# pages, Python's heap among them (a crash). So every range is checked against the
# mapping's length: one past it is not copied from (`source`) nor taken for cached
# (`cached`), and the ordinary read says the file is truncated (a LoadError) or reads what
# was written back meanwhile. A file that shrinks after it is mapped leaves pages of the
# mapping past its new end: a user-mode access there would raise SIGBUS, but only the kernel
# touches them, and UFFDIO_COPY then fails with EFAULT, which leaves the piece to the
# ordinary read too.
_DIRECT_ALIGN = 4096  # offsets, lengths and addresses of O_DIRECT reads (512-byte sectors too)
_DIRECT_MIN = 2**20  # smaller tensors (biases, norms) are ordinary memory, read buffered
DIRECT_PIECE = 64 * 2**20
_O_DIRECT = getattr(os, "O_DIRECT", None)
_preadv = getattr(os, "preadv", None)
_nowait = getattr(os, "RWF_NOWAIT", None)
_fadvise = getattr(os, "posix_fadvise", None)
_PAGE = mmap.PAGESIZE


_mmap = libc_function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long], ctypes.c_void_p)
_munmap = libc_function("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value
# cachestat is 451 on every architecture but alpha (561), where it is not asked.
_syscall = None if platform.machine().startswith("alpha") else libc_function(
    "syscall", None, ctypes.c_long)
_SYS_CACHESTAT = 451
_CAP_FOWNER = 3


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback",
                                                "nr_evicted", "nr_recently_evicted")]


def _cached_pages(fd: int, offset: int, n: int) -> int | None:
    """How many pages of bytes ``[offset, offset + n)`` of ``fd`` the page cache holds, from
    cachestat (Linux 6.5+); None where it is missing or refused."""
    if _syscall is None:
        return None
    got = _Cachestat()
    if _syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd),
                ctypes.byref(_CachestatRange(offset, n)), ctypes.byref(got),
                ctypes.c_uint(0)) != 0:
        return None
    return int(got.nr_cache)


def _page_cached(fd: int, offset: int) -> bool | None:
    """Whether the page cache holds the page of ``fd`` at ``offset``, from a one-byte
    RWF_NOWAIT read (a miss starts reading that page); None where such reads are refused."""
    if _preadv is None or _nowait is None:
        return None
    try:
        _preadv(fd, [bytearray(1)], offset, _nowait)
    except BlockingIOError:
        return False
    except OSError:  # EOPNOTSUPP, EINVAL: a file system without it
        return None
    return True


def _has_fowner() -> bool:
    """Whether this process holds CAP_FOWNER (Linux; False where that cannot be read)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def _mincore_truthful(name: str, fileno: int, fowner: Callable[[], bool]) -> bool:
    """Whether mincore tells this process which pages of ``name`` (open as ``fileno``) are
    cached: it owns the file, has CAP_FOWNER (``fowner()``) or may write it, as the kernel
    decides."""
    if os.fstat(fileno).st_uid == os.geteuid() or fowner():
        return True
    if os.access in os.supports_effective_ids:
        return os.access(name, os.W_OK, effective_ids=True)
    return os.access(name, os.W_OK)


def soft_limit(kind: str) -> int | None:
    """The soft limit on resource ``kind`` (``"RLIMIT_DATA"``, ...); None when unlimited or
    where there are no such limits (not POSIX)."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(getattr(resource, kind))[0]
    return None if soft == resource.RLIM_INFINITY else soft


class DirectReads:
    """O_DIRECT reads for one load of ``files`` checkpoint files (see [Note: reading past
    the page cache]). Thread-safe once a file's tensors are made (``empty``)."""

    def __init__(self, files: int = 1) -> None:
        # A second descriptor per file: only while that stays well inside the limit on
        # open files (a directory of per-tensor files may hold hundreds).
        self._allowed = (_O_DIRECT is not None and _preadv is not None and _mmap is not None
                         and 2 * files + 64 <= (soft_limit("RLIMIT_NOFILE") or sys.maxsize))
        self._fds: dict[str, int | None] = {}  # file -> its O_DIRECT descriptor, or None
        self._stale: list[int] = []  # descriptors given up on, closed in close()
        self._views: dict[str, tuple[int, int]] = {}  # file -> untouched mapping (address, size)
        # Files mincore lies about (see [Note: reading past the page cache]): -> (whether
        # cachestat answers, the descriptor asked); those nothing answers for are in _unknown.
        self._probes: dict[str, tuple[bool, int]] = {}
        self._unknown: set[str] = set()
        self._missed: dict[str, set[int]] = {}  # file -> pages RWF_NOWAIT probes missed
        self._has_fowner: bool | None = None
        self._regions: dict[int, tuple[int, int]] = {}  # tensor address -> its mapping's span
        self._lock = threading.Lock()
        self.bytes = 0  # read past the page cache

    def close(self) -> None:
        """Close descriptors and mappings; call once no read is running."""
        dups = [fd for stat, fd in self._probes.values() if not stat]
        for fd in [*self._fds.values(), *self._stale, *dups]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._stale = []
        for address, size in self._views.values():
            _munmap(address, size)
        self._views.clear()
        self._regions.clear()
        self._probes.clear()
        self._unknown.clear()
        self._missed.clear()

    def _fowner(self) -> bool:
        if self._has_fowner is None:
            self._has_fowner = _has_fowner()
        return self._has_fowner

    def active(self, name: str) -> bool:
        """Whether ``name`` is read past the page cache (buffered reads of it must not read
        ahead: that would pull what is read directly into the cache)."""
        return self._fds.get(name) is not None

    def region(self, address: int) -> tuple[int, int] | None:
        """The mapping behind a tensor made by ``empty`` that starts at ``address``."""
        return self._regions.get(address)

    def empty(self, name: str, fileno: int, start: int, shape: tuple[int, ...],
              dtype: torch.dtype) -> torch.Tensor | None:
        """A new CPU tensor for the contiguous bytes at ``start`` of ``name``, when they are
        large: one that O_DIRECT reads can fill where the page cache lacks some of them,
        ordinary memory where it holds them all (copied from there, see ``source``); None
        when the tensor is small or the file cannot be read so."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes < _DIRECT_MIN or start % dtype.itemsize or not self._open(name, fileno):
            return None
        if self.cached(name, start, nbytes):  # a warm tensor: ordinary memory
            return torch.empty(shape, dtype=dtype)
        phase = start % _DIRECT_ALIGN
        length = -(-(phase + nbytes) // _DIRECT_ALIGN) * _DIRECT_ALIGN
        try:
            memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:  # out of memory or of mappings: torch's allocator says which
            return None
        flat = torch.frombuffer(memory, dtype=dtype, count=nbytes // dtype.itemsize,
                                offset=phase)
        base = flat.data_ptr() - phase
        self._regions[flat.data_ptr()] = (base, base + length)
        return flat.view(shape)

    def _open(self, name: str, fileno: int) -> bool:
        if name not in self._fds:
            fd = None
            if self._allowed and self._view(name, fileno):
                with contextlib.suppress(OSError):
                    fd = os.open(name, os.O_RDONLY | int(_O_DIRECT or 0)
                                 | getattr(os, "O_CLOEXEC", 0))
                if fd is not None and not _same_file(fd, fileno):
                    # See [Note: a file replaced during a load]: ``fileno`` is the one read.
                    logger.info("adaptmem.load: %s was replaced during the load; reading it "
                                "through the page cache", name)
                    os.close(fd)
                    fd = None
            self._fds[name] = fd
            if fd is not None and not _mincore_truthful(name, fileno, self._fowner):
                if _cached_pages(fd, 0, _PAGE) is not None:
                    self._probes[name] = (True, fd)
                elif _page_cached(fileno, 0) is not None:
                    self._probes[name] = (False, os.dup(fileno))  # ``fileno`` may be closed
                else:
                    logger.info("adaptmem.load: cannot tell which pages of %s the page cache "
                                "holds (mincore would say all: the file is not this user's "
                                "to write); reading it through the cache", name)
                    self._unknown.add(name)
            if fd is not None and _fadvise is not None:
                # Small tensors read through the cache must not read ahead into large ones.
                with contextlib.suppress(OSError):
                    _fadvise(fileno, 0, 0, os.POSIX_FADV_RANDOM)
        return self._fds[name] is not None

    def _view(self, name: str, fileno: int) -> bool:
        """Map ``name`` shared and read-only for ``cached``: address space only, no reads,
        and (not private and writable) no charge against a cap on the data segment."""
        size = os.fstat(fileno).st_size
        address = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fileno, 0) if size else None
        if address in (None, _MAP_FAILED):
            return False
        self._views[name] = (address, size)
        return True

    def source(self, name: str, offset: int, n: int) -> int | None:
        """The address of bytes ``[offset, offset + n)`` of ``name`` in its shared read-only
        mapping, where there is one and it holds them all: cached bytes can be copied from
        there. None past the mapping's end (see [Note: a file that shrinks during a load])."""
        view = self._views.get(name)
        if view is None or offset < 0 or offset + n > view[1]:
            return None
        return view[0] + offset

    def cached(self, name: str, offset: int, n: int) -> bool:
        """Whether the page cache holds every page of bytes ``[offset, offset + n)``; False
        for bytes past the end of the mapping (the read finds out what is there)."""
        view = self._views.get(name)
        if view is None or name in self._unknown:
            return True
        address, size = view
        if offset + n > size:  # See [Note: a file that shrinks during a load]
            return False
        first = offset // _PAGE * _PAGE
        pages = -(-(offset + n - first) // _PAGE)
        if pages <= 0:
            return True
        probe = self._probes.get(name)
        if probe is not None:
            stat, fd = probe
            if stat:
                held = _cached_pages(fd, first, pages * _PAGE)
                return held is None or held >= pages
            return self._probe(name, fd, first, first + (pages - 1) * _PAGE)
        flags = resident_pages(address + first, pages * _PAGE)
        return flags is None or b"\0" not in flags

    def _probe(self, name: str, fd: int, *pages: int) -> bool:
        """Whether the cache holds ``pages`` of ``name``, asked with RWF_NOWAIT reads of
        ``fd``; a page such a read missed stays a miss (the read brought it in)."""
        missed = self._missed.setdefault(name, set())
        for page in pages:
            hit = page not in missed and _page_cached(fd, page)
            if hit is None:
                return True
            if not hit:
                missed.add(page)
                return False
        return True

    def read(self, name: str, fileno: int, region: tuple[int, int], address: int, offset: int,
             n: int) -> int:
        """Read up to ``n`` bytes at ``offset`` of ``name`` to ``address`` (inside
        ``region``) with O_DIRECT; 0 when that cannot be done."""
        fd = self._fds.get(name)
        lead = offset % _DIRECT_ALIGN
        start = address - lead
        length = -(-(lead + n) // _DIRECT_ALIGN) * _DIRECT_ALIGN
        if (fd is None or start % _DIRECT_ALIGN
                or start < region[0] or start + length > region[1]):
            return 0
        try:
            got = int(_preadv(fd, [(ctypes.c_char * length).from_address(start)],  # type: ignore[misc]
                              offset - lead))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # This file system takes no O_DIRECT reads (or not at this alignment). The
            # descriptor stays open until close(): other threads may be reading with it.
            logger.info("adaptmem.load: %s refuses O_DIRECT reads (%s); reading it through "
                        "the page cache", name, exc)
            with self._lock:
                if self._fds.get(name) == fd:
                    self._fds[name] = None
                    self._stale.append(fd)
            if _fadvise is not None:
                with contextlib.suppress(OSError):
                    _fadvise(fileno, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return 0
        got = max(0, min(n, got - lead))
        with self._lock:
            self.bytes += got
        return got


def _same_file(a: int, b: int) -> bool:
    """Whether descriptors ``a`` and ``b`` are open on the same file."""
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
