"""``adaptive.spill``: saved activations go to the next tier during forward and come back,
prefetched in reverse save order, during backward.

[Note: what is spilled] The unit is a tensor's whole storage: a view saved for backward
keeps all of its storage alive, so only spilling the storage frees memory, and two views of
one storage (or one tensor saved twice) are copied out once and restored into one shared
storage again. Parameters stay, and so do views of a leaf (a tensor autograd did not make:
a parameter, frozen or not, a buffer, an input): something outside the graph holds their
storage, so a copy would free nothing (``nn.Linear`` saves ``weight.t()``). Tensors saved
while backward runs (recomputation by ``torch.utils.checkpoint``, double backward) stay
too: they are used at once.

[Note: version check] Autograd does not check the version counter of a tensor whose saving
a hook took over, so this module does: each saved tensor keeps a storage-less alias that
shares its version counter (``detach`` shares it; ``set_`` then drops the storage), and a
restore that finds the counter moved raises autograd's own error.

[Note: kept tensors] A tensor that stays must not be handed back to autograd as it is:
a saved output holds its own grad_fn, and a node that holds it through a hook's Python
object is a cycle across C++ that Python's gc cannot see, so a graph that backward never
frees (an interrupted step) would leak. A detached alias shares the storage and version
counter without the grad_fn, and gets the same version check as a spilled tensor.

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

import concurrent.futures
import contextlib
import ctypes
import functools
import logging
import os
import platform
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .._common.devices import format_bytes, memory_info, parse_size
from .._common.oom import is_oom
from ._stats import SpillStats, in_use_bytes, track
from ._tiers import DiskFile, Mover, byte_view, check_directory

__all__ = ["Spill", "spill", "fixed_mmap_threshold"]

logger = logging.getLogger("adaptmem")
F = TypeVar("F", bound=Callable[..., Any])

PENDING, STORED, KEPT = 0, 1, 2  # copy out in flight; in the tier; copy out failed, in memory

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)

_executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()


def _executor(kind: str) -> concurrent.futures.ThreadPoolExecutor:
    # One writer and one reader thread for the process: the copies of a tier are sequential
    # anyway, and reads must not queue behind writes.
    with _executors_lock:
        pool = _executors.get(kind)
        if pool is None:
            pool = _executors[kind] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"adaptmem-spill-{kind}")
            # Start its thread now with a 1 MiB stack, not the default 8 MiB: under a memory
            # cap (RLIMIT_DATA) a thread's whole stack counts, touched or not.
            previous = threading.stack_size(1 << 20)
            try:
                pool.submit(int).result()
            finally:
                threading.stack_size(previous)
        return pool


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_executors.clear)


@functools.cache
def _glibc(name: str) -> Any:
    """glibc's function ``name`` through ctypes, or None (another C library or platform)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


_TRIM_EVERY = 8 << 20  # bytes freed (or read back) between two trims of one step


def _return_freed_memory() -> None:
    """See [Note: glibc heap]."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(ctypes.c_size_t(0))


_M_MMAP_THRESHOLD = -3
_mmap_lock = threading.Lock()
_mmap_users = 0  # steps (and blocks) holding glibc's mmap threshold fixed


def _hold_mmap_threshold(nbytes: int) -> None:
    """See [Note: glibc heap]: ``nbytes`` from the first holder on."""
    global _mmap_users
    with _mmap_lock:
        _mmap_users += 1
        if _mmap_users == 1:
            _glibc("mallopt")(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes))


def _release_mmap_threshold() -> None:
    """32 MiB once the last holder is done (glibc cannot go back to adaptive)."""
    global _mmap_users
    with _mmap_lock:
        _mmap_users -= 1
        if _mmap_users == 0:
            _glibc("mallopt")(_M_MMAP_THRESHOLD, ctypes.c_int(32 << 20))


def _check_mmap_threshold(value: int | str | None) -> int | None:
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
    _hold_mmap_threshold(nbytes)
    try:
        yield
    finally:
        _release_mmap_threshold()


def _accelerated(device: torch.device) -> bool:
    """Whether ``device``'s tensors go through host memory (and a ``Mover``)."""
    return device.type != "cpu"


def _in_backward() -> bool:
    return _graph_task_id is not None and _graph_task_id() != -1


class _Entry:
    """One spilled storage: where its bytes are, and its restored copy while one lives."""

    __slots__ = ("step", "seq", "device", "nbytes", "state", "source", "host", "offset",
                 "event", "storage_ref", "restored", "restored_ref", "read", "uses_left",
                 "handed_back", "__weakref__")

    def __init__(self, step: _Step, seq: int, device: torch.device, nbytes: int,
                 storage: torch.UntypedStorage) -> None:
        self.step = step
        self.seq = seq
        self.device = device
        self.nbytes = nbytes
        self.state = PENDING
        self.source: torch.Tensor | None = None  # the original bytes until written (CPU)
        self.host: torch.Tensor | None = None  # the host copy (accelerators)
        self.offset = -1  # in the scratch file
        self.event: Any = None  # marks the device-to-host copy done
        self.storage_ref = weakref.ref(storage)
        # The restored copy is held until every saved tensor over it was unpacked once
        # (backward's last use of it), then only weakly (for a retain_graph second pass).
        self.restored: torch.UntypedStorage | None = None
        self.restored_ref: Callable[[], torch.UntypedStorage | None] | None = None
        self.uses_left = 0
        self.handed_back = False  # counted in tensors_restored
        self.read: concurrent.futures.Future[Any] | None = None  # a restore under way

    def __del__(self) -> None:
        try:
            self.step.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to tidy
            pass


class _Packed:
    """What autograd holds for a spilled saved tensor: its entry, its view geometry, and an
    alias that shares its version counter (see [Note: version check])."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "alias", "version", "maker")

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        self.entry = entry
        entry.uses_left += 1
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        version = t._version
        with torch.no_grad():
            alias = t.detach()
            alias.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
        if _set_version is not None:
            _set_version((alias,), (version,))  # set_ counted as a write; undo that
        else:
            version = alias._version
        self.alias = alias
        self.version = version
        self.maker = _maker(t)

    def check_version(self) -> None:
        now = self.alias._version
        if now != self.version:
            size = list(self.alias.size() if isinstance(self, _Kept) else self.size)
            what = f"[{self.alias.type()} {size}]" + self.maker
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: {what} is at version {now}; expected version "
                f"{self.version} instead. Hint: the tensor was saved inside adaptive.spill and "
                f"changed in place afterwards; clone it before the in-place operation."
            )


class _Kept(_Packed):
    """A saved tensor that stays: a detached alias of it (see [Note: kept tensors])."""

    __slots__ = ()

    def __init__(self, t: torch.Tensor) -> None:  # noqa: D107 - no entry, no geometry
        self.alias = t.detach()
        self.version = t._version
        self.maker = _maker(t)


def _maker(t: torch.Tensor) -> str:
    # A string, never the node itself: holding grad_fn would make the cycle that
    # [Note: kept tensors] is about.
    fn = t.grad_fn
    return "" if fn is None else f", which is output {t.output_nr} of {type(fn).__name__},"


def _keep(t: torch.Tensor, stats: SpillStats) -> Any:
    stats.tensors_kept += 1
    if t.grad_fn is None:
        return t  # a leaf or a tensor outside autograd: no cycle to make
    return _Kept(t)


class _Step:
    """The hooks and state of one ``with spill():`` block."""

    def __init__(self, handle: Spill) -> None:
        self.handle = handle
        self.stats = handle._stats
        self.lock = threading.RLock()
        self.room = threading.Condition(self.lock)
        self.by_storage: weakref.WeakValueDictionary[Any, _Entry] = weakref.WeakValueDictionary()
        self.by_seq: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()
        self.seq = 0
        self.live = 0
        self.reserves: dict[torch.device, int] = {}
        self.disk: DiskFile | None = None
        self.movers: dict[torch.device, Mover | None] = {}
        self.pending_bytes = 0
        self.max_pending: int | None = None
        self.futures: set[concurrent.futures.Future[Any]] = set()
        self.error: OSError | None = None
        self.error_raised = False
        self.exited = False
        self.discarded = False
        self.holds_mmap_threshold = False
        self.freed_untrimmed = self.read_untrimmed = 0  # see [Note: glibc heap]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # -- forward: saving -------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        stats = self.stats
        stats.tensors_saved += 1
        if (_in_backward() or type(t) is not torch.Tensor or t.layout != torch.strided
                or t.device.type == "meta" or (t.requires_grad and t.is_leaf)):
            return _keep(t, stats)
        base = t._base
        if base is not None and base.is_leaf:  # see [Note: what is spilled]
            return _keep(t, stats)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes < self.handle.threshold:
            return _keep(t, stats)
        if self.error is not None:
            if not self.error_raised:
                self.error_raised = True
                raise self.error
            return _keep(t, stats)
        device = t.device
        key = (device, storage.data_ptr())
        with self.lock:
            entry = self.by_storage.get(key)
            if entry is not None and entry.storage_ref() is not storage:
                entry = None  # the address was freed and reused since
        if entry is not None:
            stats.tensors_shared += 1
            return _Packed(entry, t)
        if not self._over_limit(device) or not self._has_tier(device):
            return _keep(t, stats)
        entry = self._spill(storage, device, nbytes, key)
        return _Packed(entry, t)

    def _in_use(self, device: torch.device) -> int:
        in_use = in_use_bytes(device)
        if in_use > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = in_use
        return in_use

    def _over_limit(self, device: torch.device) -> bool:
        in_use = self._in_use(device)
        if self.handle.limit != "auto":
            return in_use > int(self.handle.limit)
        # "auto": keep a share (half, more after a step ran out) of what was free at the
        # step's first large save free for backward (gradients, restored activations,
        # workspace). Free memory is read the way the allocator will fail: under a CPU cap,
        # what the cap leaves.
        free = memory_info(device)[0]
        reserve = self.reserves.get(device)
        if reserve is None:
            reserve = self.reserves[device] = int(free * self.handle.keep_free)
        return free < reserve

    def _max_pending(self, device: torch.device) -> int:
        if self.max_pending is None:
            if self.handle.max_pending == "auto":
                # Bytes waiting to be written are memory not yet freed: an eighth of what is
                # free at the first spill, so a slow disk cannot let forward run out.
                free = memory_info(torch.device("cpu"))[0]
                self.max_pending = max(1, min(128 * 2**20, free // 8))
            else:
                self.max_pending = int(self.handle.max_pending)
        return self.max_pending

    def _has_tier(self, device: torch.device) -> bool:
        if not _accelerated(device):
            return self.handle.to != "host"  # the host tier is the CPU's own memory
        return self._mover(device) is not None

    def _mover(self, device: torch.device) -> Mover | None:
        if device not in self.movers:
            try:
                self.movers[device] = Mover(device)
            except (AttributeError, RuntimeError):  # a backend without streams (MPS)
                logger.info("spill: %s has no streams; its saved tensors stay", device)
                self.movers[device] = None
        return self.movers[device]

    def _disk_file(self) -> DiskFile:
        if self.disk is None:
            directory = self.handle.to
            if directory is None or directory == "host":
                directory = check_directory(tempfile.gettempdir())
            self.disk = DiskFile(directory)
        return self.disk

    def _spill(self, storage: torch.UntypedStorage, device: torch.device, nbytes: int,
               key: Any) -> _Entry:
        src = byte_view(storage, device)
        # CPU tensors go to disk; accelerator tensors to host memory unless a directory
        # was named (then on through pinned host memory to the file).
        to_disk = not _accelerated(device) or self.handle.to not in (None, "host")
        with self.lock:
            entry = _Entry(self, self.seq, device, nbytes, storage)
            self.live += 1
            self.by_storage[key] = entry
            self.by_seq[self.seq] = entry
            self.seq += 1
        self.stats.tensors_spilled += 1
        self.stats.bytes_out += nbytes
        if _accelerated(device):
            mover = self.movers[device]
            assert mover is not None  # _has_tier made sure
            entry.host, entry.event = mover.to_host(src)
            if not to_disk:
                entry.state = STORED
                return entry
        else:
            entry.source = src
            if self.handle.mmap_threshold is not None and not self.holds_mmap_threshold:
                self.holds_mmap_threshold = True
                _hold_mmap_threshold(self.handle.mmap_threshold)
        entry.offset = self._disk_file().reserve(nbytes)
        limit = self._max_pending(device)
        with self.room:
            if self.pending_bytes and self.pending_bytes + nbytes > limit:
                start = time.perf_counter()
                while self.pending_bytes and self.pending_bytes + nbytes > limit:
                    self.room.wait()
                self.stats.seconds_waiting += time.perf_counter() - start
            self.pending_bytes += nbytes
        self._submit("write", self._write, entry)
        return entry

    def _submit(self, kind: str, fn: Callable[..., Any], entry: _Entry) -> Any:
        future = _executor(kind).submit(fn, entry)
        with self.lock:
            self.futures.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.futures.discard(future)

    def _write(self, entry: _Entry) -> None:
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
            with self.lock:
                entry.state = KEPT  # still in memory: the step stays correct
                if self.error is None:
                    self.error = exc
            return
        finally:
            self.stats.seconds_writing += time.perf_counter() - start
            with self.room:
                self.pending_bytes -= entry.nbytes
                self.room.notify_all()
        with self.lock:
            entry.state = STORED
            freed = entry.source is not None  # a CPU activation (host copies are pinned)
            entry.source = entry.host = None  # frees the activation (the last reference)
        if freed:
            self.freed_untrimmed += entry.nbytes
            if self.freed_untrimmed >= _TRIM_EVERY:
                self.freed_untrimmed = 0
                # Queued, not called: this call's arguments hold ``entry`` until it returns.
                _executor("write").submit(_return_freed_memory)

    # -- backward: restoring ---------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            packed.check_version()
            return packed.alias
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[no-any-return]
        packed.check_version()
        entry = packed.entry
        storage = entry.step.restore(entry)
        with torch.no_grad():
            out = torch.empty(0, dtype=packed.dtype, device=entry.device)
            return out.set_(storage, packed.offset, packed.size, packed.stride)

    def restore(self, entry: _Entry) -> torch.UntypedStorage:
        with self.lock:
            if self.discarded:
                raise RuntimeError(
                    "this saved tensor was spilled inside an adaptive.spill block that ended "
                    "with an exception, and its copy was discarded then; run the forward again"
                )
            if entry.state != STORED and entry.source is not None:
                if not entry.handed_back:  # not written yet: still in memory, no copy back
                    entry.handed_back = True
                    self.stats.tensors_restored += 1
                return entry.source.untyped_storage()
            restored = entry.restored
            if restored is None and entry.restored_ref is not None:
                restored = entry.restored_ref()
            if restored is not None:
                entry.uses_left -= 1
                if entry.uses_left <= 0:
                    entry.restored = None
                return restored
            future, entry.read = entry.read, None
            if future is None:
                future = self._submit("read", self._read, entry)
            self._prefetch_before(entry.seq)
        ready = future.done()
        if not ready:
            start = time.perf_counter()
            concurrent.futures.wait([future])
            self.stats.seconds_waiting += time.perf_counter() - start
        data, done = future.result()
        if done is not None:
            mover = self.movers[entry.device]
            assert mover is not None
            mover.use(data, done)
        storage = data.untyped_storage()
        with self.lock:
            entry.restored_ref = weakref.ref(storage)
            entry.uses_left -= 1
            entry.restored = storage if entry.uses_left > 0 else None
        stats = self.stats
        stats.prefetch_hits += ready
        stats.prefetch_misses += not ready
        stats.tensors_restored += not entry.handed_back
        entry.handed_back = True
        stats.bytes_in += entry.nbytes
        self._in_use(entry.device)
        return storage

    def _prefetch_before(self, seq: int) -> None:
        """Start restoring the next entries backward will want: those saved just before."""
        depth = self.handle.prefetch
        ahead = 0
        s = seq - 1
        lowest = max(-1, seq - 1 - (4 * depth + 16))
        while ahead < depth and s > lowest:
            entry = self.by_seq.get(s)
            s -= 1
            if entry is None or entry.state != STORED:
                continue
            if entry.read is None:
                if entry.restored is not None or (
                        entry.restored_ref is not None and entry.restored_ref() is not None):
                    continue
                entry.read = self._submit("read", self._read, entry)
            ahead += 1

    def _read(self, entry: _Entry) -> tuple[torch.Tensor, Any]:
        start = time.perf_counter()
        try:
            with self.lock:
                host, disk = entry.host, self.disk
            accelerated = _accelerated(entry.device)
            if host is None:
                assert disk is not None
                self.read_untrimmed += entry.nbytes
                if self.read_untrimmed >= _TRIM_EVERY:  # about what backward freed since
                    self.read_untrimmed = 0
                    _return_freed_memory()
                host = disk.read(entry.offset, entry.nbytes, pin=accelerated)
            if not accelerated:
                return host, None
            mover = self.movers[entry.device]
            assert mover is not None
            return mover.to_device(host, after=entry.event)
        finally:
            self.stats.seconds_reading += time.perf_counter() - start

    # -- lifetime --------------------------------------------------------------------------

    def release(self) -> None:
        """An entry died: nothing needs its bytes any more."""
        with self.lock:
            self.live -= 1
            if self.live == 0 and self.disk is not None:
                if self.exited:
                    self._close()
                else:
                    self.disk.empty()

    def _close(self) -> None:
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def _end(self) -> None:
        if self.holds_mmap_threshold:
            self.holds_mmap_threshold = False
            _release_mmap_threshold()

    def finish(self) -> None:
        """The block ended normally: the scratch file lives on while saved tensors need it."""
        self._end()
        with self.lock:
            self.exited = True
            if self.live == 0:
                self._close()
        s = self.stats
        if self.seq:
            logger.info("spill: %d saved tensors (%s) copied out, %s copied back so far, "
                        "%.3f s waited", self.seq, format_bytes(s.bytes_out),
                        format_bytes(s.bytes_in), s.seconds_waiting)
        if self.error is not None and not self.error_raised:
            self.error_raised = True
            raise self.error

    def discard(self) -> None:
        """The block ended with an exception: drop every copy and the scratch file now."""
        self._end()
        with self.lock:
            self.discarded = True
            futures = list(self.futures)
        concurrent.futures.wait(futures)
        with self.lock:
            for seq in range(self.seq):
                entry = self.by_seq.get(seq)
                if entry is not None:
                    entry.source = entry.host = entry.read = entry.restored = None
            self.exited = True
            self._close()


class Spill:
    """A ``spill`` handle: a context manager (and decorator) for training steps. See
    ``spill``."""

    def __init__(self, threshold: int | str = "1MiB", limit: int | str = "auto",
                 to: str | os.PathLike[str] | None = None, *, prefetch: int = 2,
                 max_pending: int | str = "auto",
                 mmap_threshold: int | str | None = None) -> None:
        self.threshold = parse_size(threshold, "threshold")
        if isinstance(limit, str) and limit.strip().lower() == "auto":
            self.limit: int | str = "auto"
        else:
            try:
                self.limit = parse_size(limit, "limit")
            except ValueError as exc:
                raise ValueError(f"{exc}; or limit='auto' to spill only what does not fit") \
                    from None
        if to is None or (isinstance(to, str) and to == "host"):
            self.to: str | None = to
        elif isinstance(to, (str, os.PathLike)):
            self.to = check_directory(to)
        else:
            raise TypeError(
                f"to must be 'host', a directory path, or None (the default tier), got "
                f"{type(to).__name__} {to!r}"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a whole number of tensors, 0 or more, "
                             f"got {prefetch!r}")
        self.prefetch = prefetch
        self.keep_free = 0.5  # limit="auto": the share of free memory kept for backward
        self.max_pending: int | str = "auto" if max_pending == "auto" else max(
            1, parse_size(max_pending, "max_pending"))
        self.mmap_threshold = _check_mmap_threshold(mmap_threshold)
        self._stats = SpillStats()
        self._local = threading.local()
        track(self, self._stats)

    @property
    def stats(self) -> SpillStats:
        """What this handle spilled and restored, over all its steps so far."""
        return self._stats

    def __repr__(self) -> str:
        limit = self.limit if self.limit == "auto" else format_bytes(int(self.limit))
        return (f"Spill(threshold={format_bytes(self.threshold)}, limit={limit}, "
                f"to={self.to or 'default'}, prefetch={self.prefetch})")

    def __enter__(self) -> Spill:
        steps = self._local.__dict__.setdefault("steps", [])
        step = _Step(self)
        step.hooks.__enter__()
        steps.append(step)
        self._stats.steps += 1
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        step = self._local.steps.pop()
        step.hooks.__exit__(exc_type, exc, tb)
        if exc_type is None:
            step.finish()
            return
        step.discard()
        if self.limit == "auto" and self.keep_free < 1.0 and exc is not None and is_oom(exc):
            self.keep_free = min(1.0, self.keep_free + 0.25)
            logger.info("spill: the step ran out of memory with limit='auto'; the next step "
                        "keeps %.0f%% of the free memory for backward%s", self.keep_free * 100,
                        " (spills every saved tensor over the threshold)"
                        if self.keep_free >= 1.0 else "")

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return step  # type: ignore[return-value]


def spill(threshold: int | str = "1MiB", limit: int | str = "auto",
          to: str | os.PathLike[str] | None = None, *, prefetch: int = 2,
          max_pending: int | str = "auto", mmap_threshold: int | str | None = None) -> Spill:
    """Spill the activations a training step saves for backward to the next memory tier, and
    bring them back, prefetched, when backward needs them.

    Use it as a context manager around forward (and backward, if you like), or as a
    decorator on the step function. Inside, every tensor autograd saves whose storage is at
    least ``threshold`` bytes is copied out in the background once memory in use on its
    device exceeds ``limit``; its memory is freed as soon as the copy is done. In backward
    the copies come back in reverse save order, ``prefetch`` ahead of use. Gradients are
    bitwise those of the same step without spilling.

    Args:
        threshold: saved tensors smaller than this (bytes or a string like ``"1MiB"``) stay.
        limit: spill only while memory in use on the tensor's device exceeds this many bytes
            (on the CPU: the process's anonymous resident memory, what
            ``cpu_memory.set_cpu_memory_limit`` caps). ``"auto"``: spill once less than half
            of what was free at the step's first large save is left (the other half is kept
            for backward); after a step under the handle runs out of memory, the next keeps
            three quarters, then all of it. ``0``: spill everything over the threshold.
        to: the next tier. ``"host"``: pinned host memory (the default for an accelerator;
            for CPU tensors there is no host tier, they stay). A directory: an unlinked
            scratch file in it (the default for CPU tensors: the temporary directory),
            emptied when backward is done, and gone with the process whatever happens.
        prefetch: how many spilled tensors backward restores ahead of use.
        max_pending: how many bytes may wait to be copied out before forward waits;
            ``"auto"``: an eighth of the free host memory at the first spill, at most 128 MiB.
        mmap_threshold: glibc only, for a process under ``cpu_memory.set_cpu_memory_limit``
            (whose cap counts address space, not resident memory): from a step's first spill
            of a CPU tensor until the step ends, allocations of at least this many bytes
            (``"1MiB"`` works well) get mappings of their own, so memory that spilling frees
            leaves the address space too. It is glibc's process-wide ``M_MMAP_THRESHOLD``;
            after the step it is set to 32 MiB, not back to glibc's adaptive threshold (glibc
            cannot do that), and large allocations then cost page faults. ``None``, the
            default, changes no allocator setting: freed memory still goes back to the system
            (``malloc_trim``), which lowers resident memory but not address space.

    Returns:
        A ``Spill`` handle; its ``stats`` (a ``SpillStats``) say what moved and how long
        the step waited. ``adaptive.memory_stats()`` adds them up for the process.

    Raises:
        ValueError: a negative or unreadable ``threshold`` / ``limit``; ``to`` is not a
            directory this process can create a file in; ``mmap_threshold`` outside 1 byte
            to 32 MiB, or given where the C library is not glibc.
        TypeError: ``to`` is not a string, a path or None.
        OSError: (inside the step) the spill directory's disk is full; the message says
            where and what to do.
        RuntimeError: (in backward) a spilled tensor was changed in place after it was
            saved, as autograd reports it without spilling.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        >>> with adaptive.spill(threshold=0, limit=0) as handle:
        ...     model(torch.randn(32, 64)).sum().backward()
        >>> handle.stats.tensors_spilled, handle.stats.bytes_out, handle.stats.tensors_restored
        (2, 16384, 2)
    """
    return Spill(threshold, limit, to, prefetch=prefetch, max_pending=max_pending,
                 mmap_threshold=mmap_threshold)
