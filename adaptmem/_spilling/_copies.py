"""The background copies of one step: out to the next tier in forward, back in backward.

One writer and one reader thread for the process (the copies of a tier are sequential
anyway, and reads must not queue behind writes). Bytes waiting to be written are memory not
yet freed, and so are an accelerator's bytes on their way to host memory (the device
memory a copy reads stays allocated until it lands; the writer thread waits for each), so
forward waits while more than ``Limits.max_pending()`` are under way.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._common.threads import SmallStackPool
from ._heap import TRIM_EVERY, hold_mmap_threshold, release_mmap_threshold, return_freed_memory
from ._locks import HeldLock
from ._saved import Entry, EntryState
from ._settings import StepSettings
from ._stats import SpillStats
from ._tiers import DiskFile, Transfers, byte_view, default_directory

__all__ = ["Copier", "Copies"]

logger = logging.getLogger("adaptmem")


class Copier(str, enum.Enum):
    """The process's copy threads (named ``adaptmem-spill-<value>``)."""

    WRITE = "write"
    READ = "read"


_executors: dict[Copier, concurrent.futures.ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()


def _executor(kind: Copier) -> concurrent.futures.ThreadPoolExecutor:
    with _executors_lock:
        pool = _executors.get(kind)
        if pool is None:
            # A 1 MiB stack, not the default 8 MiB: under a memory cap (RLIMIT_DATA) a
            # thread's whole stack counts, touched or not. Its thread starts now.
            pool = _executors[kind] = SmallStackPool(
                1, 1 << 20, thread_name_prefix=f"adaptmem-spill-{kind.value}")
            pool.submit(int).result()
        return pool


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_executors.clear)


class Copies:
    """One step's copies out and back, its scratch file and movers, and the first error a
    copy out met (raised in the step)."""

    def __init__(self, settings: StepSettings, stats: SpillStats, lock: HeldLock) -> None:
        self.settings = settings
        self.stats = stats
        self.lock = lock
        self.room = threading.Condition(lock)  # type: ignore[arg-type]
        self.link = settings.link
        self.disk: DiskFile | None = None
        self.movers: dict[torch.device, Transfers | None] = {}
        self.pending_bytes = 0
        self.futures: set[concurrent.futures.Future[Any]] = set()
        self.error: OSError | None = None
        self.discarded = False
        self.ended = False  # the step's block ended: an error now has no one to raise it
        self.holds_mmap_threshold = False
        self.freed_untrimmed = self.read_untrimmed = 0  # see [Note: glibc heap]

    # -- tiers -----------------------------------------------------------------------------

    def ready(self, device: torch.device) -> bool:
        """Whether ``device``'s tensors have somewhere to go, made ready: their mover, and
        the scratch file if they go to disk. Called before anything of a spill is set up,
        so a spill directory that is gone raises here (an OSError saying so) and nothing
        is left half done."""
        through_host = self.link.through_host(device)
        if not through_host and self.settings.to == "host":
            return False  # the host tier is the CPU's own memory
        if through_host and self._mover(device) is None:
            return False
        if self._to_disk(through_host):
            self._disk_file()
        return True

    def _to_disk(self, through_host: bool) -> bool:
        # CPU tensors go to disk; accelerator tensors to host memory unless a directory
        # was named (then on through pinned host memory to the file).
        return not through_host or self.settings.to not in (None, "host")

    def _mover(self, device: torch.device) -> Transfers | None:
        if device not in self.movers:
            try:
                self.movers[device] = self.link.mover(device)
            except (AttributeError, RuntimeError):  # a backend without streams (MPS)
                logger.info("spill: %s has no streams; its saved tensors stay", device)
                self.movers[device] = None
        return self.movers[device]

    def _disk_file(self) -> DiskFile:
        if self.disk is None:
            directory = self.settings.to
            if directory is None or directory == "host":
                directory = default_directory()
            self.disk = DiskFile(directory)
        return self.disk

    # -- out -------------------------------------------------------------------------------

    def copy_out(self, entry: Entry, storage: torch.UntypedStorage, max_pending: int) -> None:
        """Start copying ``storage`` out; forward waits while ``max_pending`` bytes queue."""
        device = entry.device
        src = byte_view(storage, device)
        through_host = self.link.through_host(device)
        to_disk = self._to_disk(through_host)
        if through_host:
            mover = self.movers[device]
            assert mover is not None  # ready made sure
            entry.host, entry.event = mover.to_host(src)
            if not to_disk:
                # Stored once the copy lands; until then the device memory it reads stays
                # allocated, so it counts as pending like a write to disk.
                entry.state = EntryState.STORED
                self._wait_for_room(entry.nbytes, max_pending)
                self.submit(Copier.WRITE, self.landed, entry)
                return
        else:
            entry.source = src
            if self.settings.mmap_threshold is not None and not self.holds_mmap_threshold:
                self.holds_mmap_threshold = True
                hold_mmap_threshold(self.settings.mmap_threshold)
        entry.offset = self._disk_file().reserve(entry.nbytes)
        self._wait_for_room(entry.nbytes, max_pending)
        self.submit(Copier.WRITE, self.write, entry)

    def _wait_for_room(self, nbytes: int, max_pending: int) -> None:
        """Forward waits while copies out of ``max_pending`` bytes or more are under way;
        then ``nbytes`` more are."""
        with self.room:
            if self.pending_bytes and self.pending_bytes + nbytes > max_pending:
                start = time.perf_counter()
                while self.pending_bytes and self.pending_bytes + nbytes > max_pending:
                    self.room.wait()
                self.stats.seconds_waiting += time.perf_counter() - start
            self.pending_bytes += nbytes

    def _done_pending(self, nbytes: int) -> None:
        with self.room:
            self.pending_bytes -= nbytes
            self.room.notify_all()

    def landed(self, entry: Entry) -> None:
        """(On the writer thread.) Wait for ``entry``'s copy to host memory to land: its
        device memory is free to go then."""
        try:
            if entry.event is not None and not self.discarded:
                entry.event.synchronize()
        finally:
            self._done_pending(entry.nbytes)

    def write(self, entry: Entry) -> None:
        """(On the writer thread.) Copy ``entry`` to the scratch file and free its memory."""
        start = time.perf_counter()
        try:
            if self.discarded:
                return
            data = entry.host if entry.host is not None else entry.source
            assert data is not None and self.disk is not None
            if entry.event is not None:
                entry.event.synchronize()
            self.disk.write(data, entry.offset)
        except OSError as exc:
            # Raised later, in the step's thread. Its frames here would hold ``entry`` alive,
            # and with it the scratch file, for as long as the caller keeps the error.
            chained: BaseException | None = exc
            while chained is not None:
                chained.__traceback__ = None
                chained = chained.__cause__ or chained.__context__
            with self.lock:
                entry.state = EntryState.KEPT  # still in memory: the step stays correct
                first, unraised = self.error is None, self.ended and not self.discarded
                if first:
                    self.error = exc
            if first and unraised:
                logger.warning("%s. The step had ended: the tensors whose copy failed stayed "
                               "in memory (the step is correct) instead of being spilled", exc)
            return
        finally:
            self.stats.seconds_writing += time.perf_counter() - start
            self._done_pending(entry.nbytes)
        with self.lock:
            entry.state = EntryState.STORED
            freed = entry.source is not None  # a CPU activation (host copies are pinned)
            entry.source = entry.host = None  # frees the activation (the last reference)
        if freed:
            self.freed_untrimmed += entry.nbytes
            if self.freed_untrimmed >= TRIM_EVERY:
                self.freed_untrimmed = 0
                # Queued, not called: this call's arguments hold ``entry`` until it returns.
                _executor(Copier.WRITE).submit(return_freed_memory)

    # -- back ------------------------------------------------------------------------------

    def read(self, entry: Entry) -> tuple[torch.Tensor, Any]:
        """(On the reader thread.) ``entry``'s bytes back on its device, and the event that
        marks the copy done (None on the CPU)."""
        start = time.perf_counter()
        try:
            with self.lock:
                host, disk = entry.host, self.disk
            through_host = self.link.through_host(entry.device)
            if host is None:
                assert disk is not None
                self.read_untrimmed += entry.nbytes
                if self.read_untrimmed >= TRIM_EVERY:  # about what backward freed since
                    self.read_untrimmed = 0
                    return_freed_memory()
                host = disk.read(entry.offset, entry.nbytes, pin=through_host)
            if not through_host:
                return host, None
            mover = self.movers[entry.device]
            assert mover is not None
            return mover.to_device(host, after=entry.event)
        finally:
            self.stats.seconds_reading += time.perf_counter() - start

    def use(self, entry: Entry, data: torch.Tensor, done: Any) -> None:
        """The current stream waits for the copy back ``done`` before it reads ``data``."""
        if done is not None:
            mover = self.movers[entry.device]
            assert mover is not None
            mover.use(data, done)

    def submit(self, kind: Copier, fn: Callable[[Entry], Any], entry: Entry) -> Any:
        """Run ``fn(entry)`` on the ``kind`` thread; ``discard`` waits for it."""
        future = _executor(kind).submit(fn, entry)
        with self.lock:
            self.futures.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.futures.discard(future)

    # -- lifetime --------------------------------------------------------------------------

    def idle(self, step_ended: bool) -> None:
        """No entry needs the scratch file: close it once the step ended, else empty it."""
        if self.disk is not None:
            if step_ended:
                self.close()
            else:
                self.disk.empty()

    def free(self, offset: int, nbytes: int) -> None:
        """An entry's region of the scratch file is needed no more: later entries reuse it."""
        if self.disk is not None and offset >= 0:
            self.disk.free(offset, nbytes)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def end(self) -> OSError | None:
        """The step ended: let go of glibc's mmap threshold (see [Note: glibc heap]). The
        first error a copy out met so far, for the step to raise; a later one is logged."""
        if self.holds_mmap_threshold:
            self.holds_mmap_threshold = False
            release_mmap_threshold()
        with self.lock:
            self.ended = True
            return self.error

    def discard(self) -> None:
        """Write nothing more, and wait for the copies under way."""
        with self.lock:
            self.discarded = True
            futures = list(self.futures)
        concurrent.futures.wait(futures)
