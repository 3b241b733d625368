"""Where spilled bytes go: a scratch file on disk, or (pinned) host memory.

Every tier moves raw bytes: a saved tensor's whole storage, viewed as a flat ``uint8``
tensor. Views are rebuilt on top of the restored bytes by the hooks, never by a tier.

[Note: scratch files] A disk tier's file is created already unlinked (``O_TMPFILE``, or
created and removed at once where that is missing), so the spill directory never lists it
and no crash, interrupt or ``kill -9`` can leave one behind: the kernel reclaims the space
when the descriptor closes.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import re
import tempfile
import threading
from typing import Any, Protocol

import torch

from .._common.devices import stream_module
from .._common.libc import libc_function
from ._locks import HeldLock

__all__ = ["DiskFile", "check_directory", "default_directory", "in_memory", "host_buffer",
           "byte_view", "Mover", "Transfers", "HostLink"]

logger = logging.getLogger("adaptmem")

_DISK_FULL = {28, 27, 122}  # ENOSPC, EFBIG, EDQUOT
_FULL_WHY = {27: "the file reached the largest size allowed (ulimit -f, or the file "
                 "system's limit)",
             122: "the disk quota is used up"}


def byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    with torch.no_grad():
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _buffer(t: torch.Tensor) -> memoryview:
    # No numpy: a memoryview straight over the CPU bytes (the caller keeps ``t`` alive).
    n = t.numel()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else \
        memoryview(b"")


_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_madvise = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
                         ctypes.c_int)


def _huge_pages(t: torch.Tensor) -> None:
    """Ask for transparent huge pages for a fresh CPU buffer before it is filled: one page
    fault per 2 MiB instead of per 4 KiB (measured 0.75 -> 2.6 GB/s for 8 MiB reads while
    the mmap threshold is low; see RESULTS.md). Advice only: ignored where unsupported."""
    if _MADV_HUGEPAGE is None or t.numel() < (4 << 20):
        return
    if _madvise is not None:
        start = (t.data_ptr() + 4095) & ~4095
        end = (t.data_ptr() + t.numel()) & ~4095
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of CPU memory, page-locked when ``pin`` and the platform allows it. Always
    on the CPU, whatever ``torch.set_default_device`` says (a training script that makes
    ``cuda`` the default would otherwise get a second device copy, not a host one)."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        except RuntimeError:  # pinned memory is scarce; pageable still works, only slower
            pass
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


def check_directory(path: str | os.PathLike[str]) -> str:
    """The absolute path of a directory a scratch file can be created in, else ValueError."""
    if not os.fspath(path):
        raise ValueError("to='' names no directory: pass an existing directory to spill "
                         "into (to='.' for this one), or to='host' for (pinned) host memory")
    directory = os.path.abspath(os.fspath(path))
    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a directory"
        raise ValueError(
            f"to={os.fspath(path)!r} {what}: pass an existing directory to spill into, "
            f"or to='host' for (pinned) host memory"
        )
    try:
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise ValueError(
            f"to={os.fspath(path)!r}: cannot create a scratch file there ({exc.strerror}); "
            f"pass a directory this process can write to, or to='host'"
        ) from exc
    return directory


# [Note: a spill directory in memory] Many distributions mount /tmp as tmpfs (Fedora, Arch,
# Debian 13), whose files are kept in memory (as shared memory, which a cgroup's limit
# counts too): a saved tensor written there frees nothing, while the statistics, which
# count the process's own resident memory, would say it did. The default directory is
# therefore the temporary one only when a disk backs it, else /var/tmp (a disk by the
# Filesystem Hierarchy Standard); a directory passed as ``to=`` that memory backs is taken,
# with a warning. Which file system holds a directory is read from /proc/self/mountinfo (the
# longest mount point above it); elsewhere it is not known, and nothing is said.
_IN_MEMORY = {"tmpfs", "ramfs", "hugetlbfs"}
_OCTAL = re.compile(r"\\([0-7]{3})")


def in_memory(directory: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type of ``directory`` when memory backs it (tmpfs), else None. See
    [Note: a spill directory in memory]."""
    try:
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    path = os.path.realpath(directory)
    best, kind = "", None
    for fields in mounts:
        if "-" not in fields:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])  # "\040": a space
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-") + 1]
    return kind if kind in _IN_MEMORY else None


def default_directory() -> str:
    """Where a spill without ``to=`` writes on the CPU: the temporary directory, unless
    memory backs it (see [Note: a spill directory in memory])."""
    temporary = check_directory(tempfile.gettempdir())
    kind = in_memory(temporary)
    if kind is None:
        return temporary
    try:
        disk = check_directory("/var/tmp")
    except ValueError:
        disk = None
    if disk is not None and in_memory(disk) is None:
        logger.info("spill: the temporary directory %s is %s (kept in memory); spilling "
                    "to %s instead", temporary, kind, disk)
        return disk
    logger.warning("spill: the temporary directory %s is %s, which keeps its files in "
                   "memory, so spilled tensors free nothing; pass to= a directory on a disk",
                   temporary, kind)
    return temporary


def _unusable(directory: str, exc: OSError) -> OSError:
    """``exc``, met making a scratch file in ``directory`` after ``check_directory`` took
    it (it was removed since, say), as an error that says what is wrong and what to do."""
    try:
        check_directory(directory)
    except ValueError as problem:
        message = f"adaptive.spill cannot make its scratch file: {problem}"
        return OSError(exc.errno, message) if exc.errno is not None else OSError(message)
    return exc


def _pages(nbytes: int) -> int:
    return (nbytes + 4095) // 4096 * 4096


class DiskFile:
    """One unlinked scratch file (see [Note: scratch files]). A region freed by the entry
    that used it is reused by later ones (best fit, neighbours merged), so a step that
    keeps one graph alive while others come and go holds the file at what is alive at
    once, not at all it ever spilled; the file is emptied whenever nothing in it is needed."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        try:
            self._file = tempfile.TemporaryFile(dir=directory, buffering=0)
        except OSError as exc:
            raise _unusable(directory, exc) from None  # its temporary name says nothing
        self.fd = self._file.fileno()
        self._end = 0
        self._free: list[tuple[int, int]] = []  # (offset, bytes), by offset, never adjacent
        # See [Note: releases deferred while a lock is held] in _locks.py.
        self._lock = HeldLock(threading.Lock())

    def reserve(self, nbytes: int) -> int:
        """The offset of a region of ``nbytes`` (aligned to 4 KiB for the page cache)."""
        size = _pages(nbytes)
        with self._lock:
            fits = [(n, i) for i, (_, n) in enumerate(self._free) if n >= size]
            if not fits:
                offset = self._end
                self._end += size
                return offset
            n, i = min(fits)
            offset = self._free[i][0]
            if n == size:
                del self._free[i]
            else:
                self._free[i] = (offset + size, n - size)
            return offset

    def free(self, offset: int, nbytes: int) -> None:
        """The region ``reserve`` gave at ``offset`` is needed no more."""
        size = _pages(nbytes)
        with self._lock:
            i = bisect.bisect(self._free, (offset, 0))
            if i < len(self._free) and self._free[i][0] == offset + size:  # merge the next
                size += self._free.pop(i)[1]
            if i and sum(self._free[i - 1]) == offset:  # and the previous
                offset, before = self._free.pop(i - 1)
                size += before
                i -= 1
            if offset + size == self._end:
                self._end = offset
            else:
                self._free.insert(i, (offset, size))

    def write(self, data: torch.Tensor, offset: int) -> None:
        """Write the CPU bytes ``data`` at ``offset``; OSError (a full disk) says so."""
        view = _buffer(data)
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], offset + done)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise OSError(
                    exc.errno,
                    f"adaptive.spill could not write {len(view)} bytes to its scratch file in "
                    f"{self.directory} ({exc.strerror}): "
                    f"{_FULL_WHY.get(exc.errno, 'the disk is full')}. Free space there, "
                    f"pass to= a directory on a disk with room, or raise threshold/limit so "
                    f"less is spilled",
                ) from exc
            raise
        finally:
            view.release()

    def read(self, offset: int, nbytes: int, pin: bool) -> torch.Tensor:
        """The ``nbytes`` at ``offset``, in a new CPU buffer."""
        out = host_buffer(nbytes, pin)
        if not pin:
            _huge_pages(out)
        view = _buffer(out)
        done = 0
        try:
            while done < nbytes:
                n = os.preadv(self.fd, [view[done:]], offset + done)
                if n == 0:
                    raise OSError(f"scratch file in {self.directory} ended early at {done} bytes")
                done += n
        finally:
            view.release()
        return out

    def empty(self) -> None:
        """Give the disk space back; later regions start at offset 0 again."""
        with self._lock:
            self._end = 0
            self._free.clear()
            os.ftruncate(self.fd, 0)

    def close(self) -> None:
        self._file.close()


class Mover:
    """Copies between an accelerator and host memory on a side stream, device-generically
    (``torch.cuda``, ``torch.xpu``, ...). The copies are ordered after the work already
    queued on the current stream, and the current stream waits for a copy back before use.

    Not exercised by the CPU test suite: see the README's limitations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        api = stream_module(device)
        if api is None:
            raise RuntimeError(f"{device} has no streams to copy on")
        self._api: Any = api
        self.side: Any = self._api.Stream(device)

    def to_host(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A pinned host copy of the device bytes ``src`` and the event that marks it done;
        ``src`` may be dropped at once (its memory is not reused before the copy ends)."""
        current = self._api.current_stream(self.device)
        host = host_buffer(src.numel(), pin=True)
        self.side.wait_stream(current)
        with self._api.stream(self.side):
            host.copy_(src, non_blocking=True)
            src.record_stream(self.side)
            done = self.side.record_event()
        return host, done

    def to_device(self, host: torch.Tensor, after: Any = None) -> tuple[torch.Tensor, Any]:
        """A device copy of ``host`` (after the event ``after``) and the event marking it."""
        with self._api.stream(self.side):
            if after is not None:
                self.side.wait_event(after)
            out = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(host, non_blocking=True)
            done = self.side.record_event()
        return out, done

    def use(self, restored: torch.Tensor, done: Any) -> None:
        """Make the current stream wait for ``done`` before it reads ``restored``."""
        current = self._api.current_stream(self.device)
        current.wait_event(done)
        restored.record_stream(current)


class Transfers(Protocol):
    """What a step needs of a ``Mover``: copies to host memory and back, and the wait
    before a restored copy is read."""

    def to_host(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def to_device(self, host: torch.Tensor, after: Any = None) -> tuple[torch.Tensor, Any]: ...

    def use(self, restored: torch.Tensor, done: Any) -> None: ...


class HostLink:
    """How a device's tensors reach host memory: whether they go through it (an
    accelerator's do; the CPU's are host memory already) and what copies them there.
    ``Spill(link=...)`` takes another, e.g. one that drives the accelerator path with CPU
    copies."""

    def through_host(self, device: torch.device) -> bool:
        """Whether ``device``'s tensors go through host memory (and a ``mover``)."""
        return device.type != "cpu"

    def mover(self, device: torch.device) -> Transfers:
        """What copies ``device``'s tensors; raises RuntimeError where it has no streams."""
        return Mover(device)
