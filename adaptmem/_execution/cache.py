"""Batch-size caches: what size to try next, per function and context.

A cache maps a key to a ``SizeRecord``: the largest size known to fit and the smallest
known to fail. Which key a call gets is what distinguishes the caches:

- ``StacktraceMemoryBatchsizeCache`` (default): the call site (code objects and instruction
  offsets of the innermost frames) plus a bucket of the free memory on the device in use.
- ``GlobalBatchsizeCache``: one record per decorated function.
- ``NoBatchsizeCache``: nothing is remembered; every call starts from the initial size.

One cache instance can serve many functions: records are keyed by the function too (its key,
see [Note: function keys] in keys.py).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch

from .._common.devices import default_device, free_memory
from .._common.peak import fake_mode

__all__ = [
    "SizeRecord",
    "BatchsizeCache",
    "StacktraceMemoryBatchsizeCache",
    "GlobalBatchsizeCache",
    "NoBatchsizeCache",
    "set_default_cache",
    "get_default_cache",
    "shared_cache",
    "resolve_cache",
    "check_cache",
    "device_in_use",
    "user_frame",
    "record_for",
]

# Repeated calls stop probing once the size in use is within this fraction of the ceiling.
SETTLE_FRACTION = 0.9


# [Note: probing a failed size] A size that failed may fail no longer: the memory was taken
# for a while (another process, a spike) without the free-memory reading showing it, or the
# cache does not watch free memory at all. A settled record therefore tries its smallest
# failed size again after PROBE_AFTER successful calls, and after twice as many each time
# that probe fails, so a real ceiling costs one failed attempt per doubling of the number
# of calls (a quiet steady state) and a transient one is forgotten. A probe that fits clears
# the failure and the search climbs from there (see [Note: a quiet search]). Only work that
# a failed attempt leaves untouched is probed: a plain function or coroutine under
# ``batch``, and ``chunked`` with ``output=``. A generator that already yielded cannot be
# retried (the probe's failure would reach its consumer), and ``range`` and in-place
# ``chunked`` steps redo a failed step's writes, so those never probe a size known to fail;
# nor do they climb towards one: every size between what fits and what failed is untested
# at this free memory, and the climb's failure would reach the caller (a generator's
# error, an in-place write applied twice) as surely as the probe's. They run the largest
# size that fitted until free memory grows (a bucket with more memory than any where a
# size failed climbs again: see [Note: a quiet search]).
PROBE_AFTER = 32
PROBE_AFTER_MAX = 1 << 20

# [Note: a quiet search] Free memory differs from call to call (another tenant, an
# allocator that keeps or returns blocks), so a search that probes upward on every call
# pays an out-of-memory error on most of them. These rules keep it quiet:
# - Probe a modest step: a quarter of the way from the largest size that fits to the
#   smallest that failed (at least one item). Wherever the ceiling lies between them, such
#   a probe fits more often than the midpoint does, and one that fails wasted a smaller
#   attempt; the search still reaches SETTLE_FRACTION of the ceiling in a few calls (each
#   success closes a quarter of the gap, each failure three quarters). Without a known
#   failure (memory grew) the step is a quarter of the size that fits, half after a probe
#   that fitted, so a large climb takes a logarithmic number of calls.
# - Back off after a failure: an out-of-memory error at a call site that had a size that
#   fits makes the site's next probe wait 1 call, then 2, 4, ... while failures go on (a
#   probe that fits does not shorten it: under jitter probes fit by luck). The wait ends
#   early when free memory grows RESET_BUCKETS quarter-octaves past the failure's bucket:
#   one bucket up is within the noise of a reading, two is real growth.
# - Share between the free-memory buckets of a call site: a size that failed with more
#   free memory fails with less, one that fitted with less fits with more. A bucket's own
#   evidence wins over a neighbour's that contradicts it (the reading did not predict the
#   outcome there). A new bucket starts from that shared knowledge. With no size known to
#   fit below it, it takes the size that fits in the nearest bucket above: as it is from
#   less than an octave away (at least half the free memory: readings move that much with
#   what the process's own allocator keeps for the next call, as the demo's capped CPU
#   batch search showed, where a scaled guess started at 135 for a 192 that fitted and the
#   climb back ran into the next drift); from an octave or more away, scaled down by the
#   memory it lacks, and climbing towards that bucket's failure scaled down alike. That is a guess, not a size known to fit here: if it fails the search
#   halves from it (taken unscaled as a size that fits, a move to a bucket with a fifth of
#   the memory tried the size that fitted above, then a tenth less, and so on: four
#   failures, ending at half of what fits). A bucket with more memory
#   than one where a size failed climbs towards that size scaled up by the extra memory
#   (what a size that grows with free memory would allow), so jitter that flips between two
#   buckets does not cost each of them its own failures.
# - A size that fitted and now fails (memory shrank, most often by a little: the jitter
#   within one bucket) is retried a tenth smaller, or at what fitted with less free memory
#   if that is more, not halved: a halving would pin the call site far below what fits.
BUCKETS_PER_OCTAVE = 4
UNKNOWN_BUCKET = 0  # free memory that cannot be read: below every reading (1 MiB is 80)
FIRST_GROWTH = 0.25
MAX_GROWTH = 0.5
RESET_BUCKETS = 2
BACKOFF_MAX = 1 << 20


class CallSite:
    """What the free-memory buckets of one call site share: their records, by bucket, and
    when the next probe above a fitting size may run (see [Note: a quiet search])."""

    __slots__ = ("records", "wait", "backoff", "failed_bucket", "growth", "_lock")

    def __init__(self) -> None:
        self.records: dict[int, SizeRecord] = {}
        self.wait = 0  # calls left before the next probe
        self.backoff = 1  # the wait after the next failure
        self.failed_bucket: int | None = None  # bucket of the last failure that set a wait
        self.growth = FIRST_GROWTH  # step of a climb with no known failure, over the size
        self._lock = threading.Lock()

    def climb(self, fits: int, ceiling: int, bounded: bool, bucket: int) -> int:
        """The size to try above ``fits`` (below ``ceiling``), or ``fits`` while waiting."""
        if self.failed_bucket is not None and bucket >= self.failed_bucket + RESET_BUCKETS:
            self.wait, self.backoff, self.failed_bucket = 0, 1, None
        if self.wait > 0:
            self.wait -= 1  # racy without the lock: at worst one probe comes a call early
            return fits
        if bounded:
            step = (ceiling - fits) // 4
        else:
            step = min(int(fits * self.growth), (ceiling - 1) - fits)
        return fits + max(1, step)

    def failed(self, bucket: int) -> None:
        """A size failed where one was known to fit: wait before the next probe."""
        with self._lock:
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, BACKOFF_MAX)
            self.failed_bucket = bucket
            self.growth = FIRST_GROWTH

    def climbed(self) -> None:
        """A probe above the largest fitting size fitted."""
        self.growth = min(2 * self.growth, MAX_GROWTH)

    def share_failure(self, size: int, bucket: int) -> None:
        """``size`` failed in ``bucket``: it fails in buckets with less memory too."""
        for other, record in list(self.records.items()):
            if other < bucket:
                record.learn_fails(size)

    def scaled_failure(self, bucket: int) -> int | None:
        """The smallest failure of a bucket with less free memory, scaled by how much more
        this one has: where a size that grows with free memory would fail here."""
        scaled = [int(r.fails * 2 ** ((bucket - b) / BUCKETS_PER_OCTAVE))
                  for b, r in list(self.records.items()) if b < bucket and r.fails is not None]
        return min(scaled, default=None)

    def largest_fit_below(self, bucket: int, size: int) -> int | None:
        """The largest size under ``size`` that fitted with less free memory than ``bucket``."""
        fitted = [r.fits for b, r in list(self.records.items())
                  if b < bucket and r.fits is not None and r.fits < size]
        return max(fitted, default=None)

    def share_fit(self, size: int, bucket: int) -> None:
        """``size`` fitted in ``bucket``: it fits in buckets with more memory too."""
        for other, record in list(self.records.items()):
            if other > bucket:
                record.learn_fits(size)

    def seed(self, bucket: int) -> SizeRecord:
        """A record for a bucket not seen before, from what the others learned."""
        fits, start, fails = self.estimate(bucket)
        record = SizeRecord(fits, fails, site=self, bucket=bucket)
        record.start = start  # tried first, but not known to fit here
        self.records[bucket] = record
        return record

    def estimate(self, bucket: int) -> tuple[int | None, int | None, int | None]:
        """What a record for ``bucket`` starts from: (fits, a first size to try, fails),
        its own if it has one, else from what the other buckets learned."""
        own = self.records.get(bucket)
        if own is not None:
            return own.fits, own.start, own.fails
        below = [r.fits for b, r in self.records.items() if b < bucket and r.fits is not None]
        above = [r.fails for b, r in self.records.items() if b > bucket and r.fails is not None]
        fits = max(below, default=None)
        fails = min(above, default=None)
        start = None
        if fits is None:  # less memory than any bucket where a size fitted
            fits, start, fails = self.borrow(bucket, fails)
        if fits is not None and fails is not None and fits >= fails:
            fits = None  # the readings contradict each other: trust the failure
        return fits, start, fails

    def borrow(self, bucket: int, fails: int | None
               ) -> tuple[int | None, int | None, int | None]:
        """What ``bucket``, with less free memory than any bucket where a size fitted, takes
        from the nearest such bucket: (fits, a first size to try, fails). Less than an octave
        away its size fits here too. Further away, its size that fits and its smallest
        failure are scaled down by the memory this one lacks, a guess to try first and a
        bound (see [Note: a quiet search])."""
        known = [(b, r) for b, r in self.records.items() if b > bucket and r.fits is not None]
        if not known:
            return None, None, fails
        nearest, record = min(known)
        if nearest - bucket < BUCKETS_PER_OCTAVE:
            return record.fits, None, fails
        scale = 2 ** ((bucket - nearest) / BUCKETS_PER_OCTAVE)
        start = max(1, int(record.fits * scale))  # type: ignore[operator]
        if record.fails is not None:
            bound = max(start + 1, int(record.fails * scale))
            fails = bound if fails is None else min(fails, bound)
        if fails is not None and start >= fails:
            return None, None, fails  # what failed with more memory says less
        return None, start, fails


class SizeRecord:
    """What is known about sizes for one key: ``fits`` worked, ``fails`` ran out of memory.

    ``next_size`` climbs from ``fits`` towards ``fails`` in modest steps, backing off after
    failures, so repeated calls settle within 10% of the largest size that fits, and once
    settled probes ``fails`` again now and then (see [Note: a quiet search] and [Note:
    probing a failed size]). ``site`` is what the records of one call site share and
    ``bucket`` the free-memory bucket of this one (0 for caches that do not watch free
    memory). All methods are thread-safe.
    """

    __slots__ = ("fits", "fails", "start", "_lock", "successes", "patience", "site", "bucket")

    def __init__(self, fits: int | None = None, fails: int | None = None,
                 site: CallSite | None = None, bucket: int = 0) -> None:
        self.fits = fits
        self.fails = fails
        self.start: int | None = None  # a predicted first size (start_at)
        self._lock = threading.Lock()
        self.successes = 0  # successful calls since the last failure or probe
        self.patience = PROBE_AFTER  # successes before the next probe of ``fails``
        self.site = site  # created on first need: NoBatchsizeCache makes a record per call
        self.bucket = bucket

    def next_size(self, initial: int, floor: int = 1, probe: bool = True) -> int:
        """The size a new call should try first: never above ``initial``, never below
        ``floor``. ``probe=False`` for work a failed attempt would leave half-done: it never
        climbs above ``fits`` while a size is known to fail (see [Note: probing a failed
        size])."""
        # Read without the lock: a torn read between two writers only changes one probe.
        # ``start`` first: after_success sets ``fits`` before it clears ``start``.
        start, fits, fails = self.start, self.fits, self.fails
        if fits is None:
            if start is not None:
                return max(floor, min(initial, start))
            return initial if fails is None else max(floor, min(initial, fails // 2))
        if fails is not None and not probe:
            return max(floor, min(fits, initial))  # see [Note: probing a failed size]
        if fails is not None and fails <= initial:
            ceiling, bounded = fails, True
        else:
            if fits >= initial:
                return max(floor, initial)  # settled at the initial size: the success path
            ceiling, bounded = initial + 1, False
            if fits < SETTLE_FRACTION * initial and self.site is not None:
                # More memory than where something failed: climb towards the failure
                # scaled up, a guess a probe may pass later (see [Note: a quiet search]).
                guess = self.site.scaled_failure(self.bucket)
                if guess is not None and fits < guess <= initial:
                    ceiling, bounded = guess, True
        if fits >= ceiling - 1 or fits >= SETTLE_FRACTION * (ceiling - 1):
            if (probe and bounded and self.successes >= self.patience):
                self.successes = 0
                return max(floor, ceiling)  # see [Note: probing a failed size]
            return max(floor, min(fits, initial))
        return max(floor, self._own_site().climb(fits, ceiling, bounded, self.bucket))

    def hold(self, calls: int) -> None:
        """Let the next ``calls`` calls run at the size that fits, with no probe above it
        (the wait of [Note: a quiet search], set from outside)."""
        site = self._own_site()
        site.wait = max(site.wait, calls)

    def start_at(self, size: int, fails: int | None) -> None:
        """A prediction says ``size`` fits with a margin and ``fails`` (if given) does not
        fit at all: a record that knows nothing yet starts at ``size`` and climbs towards
        ``fails`` as if it had seen it fail (see [Note: predicting the first size] in
        auto.py). A failure at ``size`` halves as usual; a probe tests ``fails`` later."""
        with self._lock:
            if self.fits is None and self.fails is None:
                self.start = size
                self.fails = fails if fails is not None and fails > size else None

    def after_failure(self, size: int, floor: int) -> int:
        """Record that ``size`` ran out of memory; return the size to retry with."""
        with self._lock:
            if self.fails is not None and size >= self.fails:
                # A known failure confirmed (a probe): wait twice as long before the next.
                self.patience = min(2 * self.patience, PROBE_AFTER_MAX)
            knew_a_fit = self.fits is not None
            self.start = None  # a predicted start that failed: the search halves from here
            shrank = knew_a_fit and self.fits >= size  # type: ignore[operator]
            if self.fails is None or size < self.fails:
                self.fails = size
            if shrank:  # it fitted before; memory is tighter now
                self.fits = (self.site.largest_fit_below(self.bucket, size)
                             if self.site is not None else None)
            self.successes = 0
            fits, fails = self.fits, self.fails
        if knew_a_fit:
            self._own_site().failed(self.bucket)  # see [Note: a quiet search]
        if self.site is not None:
            self.site.share_failure(size, self.bucket)
        if shrank:  # likely by a little: a step down, not a halving
            return max(floor, min(size - 1, max(fits or 0, size * 9 // 10)))
        if fits is not None:
            return max(floor, fits)
        # Below the smallest size known to fail: another thread's failure, or a neighbour's.
        return max(floor, min(size, fails if fails is not None else size) // 2)

    def after_success(self, size: int) -> None:
        """Record that ``size`` ran to completion."""
        fits, fails = self.fits, self.fails
        if fits is not None and size <= fits and (fails is None or fails > size):
            # Nothing new: the settled path takes no lock (a lost count delays a probe).
            self.successes += 1
            return
        if fake_mode() is not None:
            return  # a run on fake tensors (another function's trace) proves nothing
        with self._lock:
            if self.fits is not None and size > self.fits:
                self._own_site().climbed()
            if self.fits is None or size > self.fits:
                self.fits = size
            self.start = None  # after ``fits``: see next_size
            if self.fails is not None and self.fails <= size:
                self.fails = None  # it fails no longer: probe promptly if it comes back
                self.patience = PROBE_AFTER
            self.successes += 1
        if self.site is not None:
            self.site.share_fit(size, self.bucket)

    def after_short_success(self, size: int) -> None:
        """Record that ``size`` ran to completion where a larger size was asked for and the
        work ended first (a range's last step): it shows a size fits only above the largest
        known to fit, so it never lowers where the next call starts. Counted either way."""
        fits = self.fits
        if fits is not None and size > fits:
            self.after_success(size)
        else:
            self.successes += 1  # racy as on the settled path: a lost count delays a probe

    def _own_site(self) -> CallSite:
        if self.site is None:
            self.site = CallSite()
        return self.site

    def learn_fails(self, size: int) -> None:
        """A neighbour with more free memory saw ``size`` fail (unless this record saw it fit)."""
        with self._lock:
            if (self.fits is None or self.fits < size) and (
                    self.fails is None or self.fails > size):
                self.fails = size

    def learn_fits(self, size: int) -> None:
        """A neighbour with less free memory saw ``size`` fit (unless this record saw it fail)."""
        with self._lock:
            if (self.fails is None or self.fails > size) and (
                    self.fits is None or self.fits < size):
                self.fits = size

    def __repr__(self) -> str:
        start = "" if self.start is None else f", start={self.start}"
        return f"SizeRecord(fits={self.fits}, fails={self.fails}{start})"


# [Note: records per instance] One decorated method serves every instance of its class, and
# instances may need very different sizes (one holds a small model, another a large one):
# sharing one record, they paid failed attempts as they alternated, and the one that fits
# more ran at the other's size. So a call through an instance (a method read through it, a
# bound method or a callable object given to a decorator) keeps records of its own, in the
# cache, in a mapping by the instance's id whose entry a weak reference to the instance
# drops when the instance is collected: records are not kept for instances that are gone,
# nor do they keep an instance alive. A new instance's first record at a key starts from
# the latest record another instance made there (its size that fits as a first size to
# try, its smallest failure as a bound), so instances made anew for every request neither
# search from the initial size again nor pile up records. Under the default cache, where
# no instance made a record at that key (free memory moved to another bucket since), it
# starts from what the latest instance called from that site learned in its buckets, as
# a bucket of its own would start (see [Note: a quiet search]): keyed by bucket alone, a
# new instance searched from the initial size again whenever free memory had moved a
# bucket since the last instance's call. An instance that cannot be
# weakly referenced (a class with __slots__ and no __weakref__), or a class (a
# classmethod), shares the records of calls made without an instance.


class Records(dict[Any, "SizeRecord"]):
    """Size records by key, of calls made without an instance or through one instance,
    with the call sites' shared state (``sites``: the default cache's ``CallSite``s)."""

    __slots__ = ("sites",)

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[Any, CallSite] = {}


class InstanceRecords:
    """The records of calls through each instance, and the latest record made at each key
    (see [Note: records per instance])."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[weakref.ref[Any], Records]] = {}
        self.latest: dict[Any, SizeRecord] = {}
        self.latest_sites: dict[Any, CallSite] = {}  # the default cache's, by call site

    def of(self, owner: Any, shared: Records, lock: Any) -> Records:
        """The records of calls through ``owner`` (``shared`` if it cannot be weakly
        referenced); ``lock`` guards a new entry."""
        entry = self.by_id.get(id(owner))
        if entry is not None and entry[0]() is owner:
            return entry[1]
        if not type(owner).__weakrefoffset__:
            return shared
        ident, by_id = id(owner), self.by_id

        def forget(ref: weakref.ref[Any]) -> None:  # the owner is being collected
            if by_id.get(ident, (None,))[0] is ref:
                by_id.pop(ident, None)

        with lock:
            entry = by_id.get(ident)
            if entry is not None and entry[0]() is owner:
                return entry[1]
            records = Records()
            by_id[ident] = (weakref.ref(owner, forget), records)
        return records

    def started(self, key: Any, record: SizeRecord) -> None:
        """``record`` was made at ``key`` for an instance: if it knows nothing, it starts
        from the latest record made there for another instance."""
        latest = self.latest.get(key)
        if latest is not None and record.fits is None and record.fails is None \
                and record.start is None:
            guess = latest.fits if latest.fits is not None else latest.start
            if guess is not None:
                record.start_at(guess, latest.fails)
        self.latest[key] = record

    def started_at_site(self, site: Any, own: CallSite, key: Any, record: SizeRecord) -> None:
        """``record`` was made at ``key`` (in call site ``site``, whose state for this
        instance is ``own``): if no instance made a record at ``key`` and it knows
        nothing, it starts from what the latest instance at ``site`` learned in its
        buckets. Called before ``started``."""
        other = self.latest_sites.get(site)
        self.latest_sites[site] = own
        if (other is None or other is own or key in self.latest or record.fits is not None
                or record.fails is not None or record.start is not None):
            return
        fits, start, fails = other.estimate(record.bucket)
        guess = fits if fits is not None else start
        if guess is not None:
            record.start_at(guess, fails)

    def count(self) -> int:
        return sum(len(records) for _, records in list(self.by_id.values()))

    def clear(self) -> None:
        self.by_id.clear()
        self.latest.clear()
        self.latest_sites.clear()


class BatchsizeCache:
    """Base class: override ``key`` to decide which calls share a record (a cache whose
    class does not is refused where it is given). Calls through an instance keep records
    of their own (see [Note: records per instance])."""

    def __init__(self) -> None:
        self._records = Records()
        self._instances = InstanceRecords()
        self._lock = threading.Lock()

    def key(self, function: Any, context: Any, device: torch.device | None, caller: Any) -> Any:
        """The key of the current call; ``caller`` is the frame that called the function."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say which calls share a size: override "
            f"key(self, function, context, device, caller) in it, or use "
            f"adaptive.StacktraceMemoryBatchsizeCache or adaptive.GlobalBatchsizeCache"
        )

    def record(
        self, function: Any, context: Any, device: torch.device | None, caller: Any = None,
        owner: Any = None,
    ) -> SizeRecord:
        """The record for the current call, created on first use; ``owner`` is the instance
        the call is made through, if any (see [Note: records per instance])."""
        key = self.key(function, context, device, caller)
        records = self._records if owner is None else self._records_of(owner)
        record = records.get(key)
        if record is None:
            record = self._add(key, records)
        return record

    def _records_of(self, owner: Any) -> Records:
        return self._instances.of(owner, self._records, self._lock)

    def _add(self, key: Any, records: Records) -> SizeRecord:
        with self._lock:
            record = records.get(key)
            if record is None:
                record = records[key] = self._seed(key, records)
                if records is not self._records:
                    self._instances.started(key, record)
        return record

    def _seed(self, key: Any, records: Records) -> SizeRecord:
        return SizeRecord()

    def clear(self) -> None:
        """Forget every size learned so far."""
        with self._lock:
            self._records.clear()
            self._records.sites.clear()
            self._instances.clear()

    def __len__(self) -> int:
        return len(self._records) + self._instances.count()


class GlobalBatchsizeCache(BatchsizeCache):
    """One record per decorated function (and ``context``, and instance for a call through
    one), wherever it is called from.

    It does not watch free memory: a size that once failed stays the ceiling until a probe
    of it (after 32, 64, 128, ... successful calls) fits again. Use the default cache where
    memory comes and goes between calls.
    """

    def key(self, function: Any, context: Any, device: torch.device | None, caller: Any) -> Any:
        return (function, context)


class NoBatchsizeCache(BatchsizeCache):
    """Remembers nothing: every call starts at the initial size and halves from there."""

    def record(
        self, function: Any, context: Any, device: torch.device | None, caller: Any = None,
        owner: Any = None,
    ) -> SizeRecord:
        return SizeRecord()

    def key(self, function: Any, context: Any, device: torch.device | None, caller: Any) -> Any:
        return None


class _FreeMemoryBuckets:
    """Free memory per device, bucketed in quarter-octaves and re-read at most every
    ``interval`` seconds, so the success path costs one clock read, not a driver call."""

    def __init__(self, interval: float = 0.5, per_octave: int = BUCKETS_PER_OCTAVE) -> None:
        self.interval = interval
        self.per_octave = per_octave
        self.cached: dict[Any, tuple[float, int]] = {}

    def bucket(self, device: torch.device | None) -> int:
        now = time.monotonic()
        hit = self.cached.get(device)
        if hit is not None and now - hit[0] < self.interval:
            return hit[1]
        try:
            free = free_memory(device if device is not None else default_device())
        except Exception:  # no reading (CPU memory unknown): the last one stands, else one
            bucket = hit[1] if hit is not None else UNKNOWN_BUCKET  # bucket for them all
        else:
            bucket = int(math.log2(max(free, 1 << 20)) * self.per_octave)
        self.cached[device] = (now, bucket)
        return bucket

    def invalidate(self) -> None:
        self.cached.clear()


# [Note: call sites] The default cache tells calls apart by the frames of the code that
# called the decorated function. adaptmem's own frames between them (an outer decorated
# function's first attempt calls its function from ``_run``, a retry from ``run_sized``,
# model= from ``Dispatched.run``) say nothing about where the call comes from, and would
# give an attempt and its retry different sizes: they are skipped. Only the caller's own
# frames count, the four innermost of them (so the levels of a recursion four deep or more
# share one record).
_OWN_FILES = os.path.dirname(os.path.dirname(__file__)) + os.sep  # adaptmem/


def user_frame(frame: Any) -> Any:
    """``frame``, or the nearest frame below it that is not adaptmem's own (None if none):
    see [Note: call sites]."""
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame = frame.f_back
    return frame


_cuda_devices: dict[int, torch.device] = {}
# (torch.cuda.is_available as it is now, its answer, the device count): asked once, not at
# every call (1 us of the 2 a call costs); asked again when the function is another one
# (a simulated device patches it).
_cuda_seen: tuple[Any, bool, int] = (None, False, 0)


def device_in_use() -> torch.device | None:
    """The device a call of a function decorated with ``device=None`` runs on: the current
    CUDA device when CUDA is available, else None (``default_device()``'s answer, which
    does not change while the process runs)."""
    global _cuda_seen
    available = torch.cuda.is_available
    if _cuda_seen[0] is not available:
        yes = available()
        _cuda_seen = (available, yes, torch.cuda.device_count() if yes else 0)
    if not _cuda_seen[1]:
        return None
    index = torch.cuda.current_device() if _cuda_seen[2] > 1 else 0
    device = _cuda_devices.get(index)
    if device is None:  # made once: a torch.device costs as much as the rest of a key
        device = _cuda_devices[index] = torch.device("cuda", index)
    return device


class StacktraceMemoryBatchsizeCache(BatchsizeCache):
    """Default: one record per call site and free-memory bucket.

    The call site is the code objects and instruction offsets of the four innermost frames
    of the caller's own code above the decorated function (``sys._getframe``; no
    ``inspect.stack``, no line numbers; see [Note: call sites]). Free memory is bucketed in
    quarter-octaves of the device in use (for a function decorated with ``device=None``, the
    current CUDA device at each call: each device learns its own sizes) and re-read at most
    every ``refresh_seconds``. The buckets of one call site share what they learn: a size
    that failed with more free memory is not tried with less, one that fitted with less is
    known to fit with more, and a failure makes the site's next probe wait (see [Note: a
    quiet search]). A bucket never seen before starts from that, so noise that flips a
    bucket does not restart the search; a bucket with more free memory climbs from there.
    """

    def __init__(self, refresh_seconds: float = 0.5) -> None:
        super().__init__()
        number = isinstance(refresh_seconds, (int, float)) and not isinstance(
            refresh_seconds, bool)
        if not number or not 0 <= refresh_seconds < float("inf"):
            raise (ValueError if number else TypeError)(
                f"refresh_seconds is how long a reading of free memory is reused, in "
                f"seconds: a finite number >= 0 (0 reads it at every call); got "
                f"{type(refresh_seconds).__name__} {refresh_seconds!r}")
        self._buckets = _FreeMemoryBuckets(refresh_seconds)
        # What the keys' ids name, kept alive: by id, since code objects compare by value
        # (see [Note: function keys] in keys.py).
        self._alive: dict[int, Any] = {}

    def key(self, function: Any, context: Any, device: torch.device | None, caller: Any) -> Any:
        f = user_frame(caller if caller is not None else sys._getframe(2))
        if device is None:
            device = device_in_use()
        # Ids, not code objects: hashing a code object hashes its contents on every call.
        # The code objects of every recorded site are kept alive, so an id is never reused.
        # Unrolled: this runs on every call, and a loop costs twice as much.
        b = f and user_frame(f.f_back)
        c = b and user_frame(b.f_back)
        d = c and user_frame(c.f_back)
        site = (
            id(function), context, device, id(f.f_code), f.f_lasti,
            b and id(b.f_code), b and b.f_lasti,
            c and id(c.f_code), c and c.f_lasti,
            d and id(d.f_code), d and d.f_lasti,
        )
        hit = self._buckets.cached.get(device)
        if hit is not None and time.monotonic() - hit[0] < self._buckets.interval:
            return site, hit[1]
        return site, self._buckets.bucket(device)

    def record(
        self, function: Any, context: Any, device: torch.device | None, caller: Any = None,
        owner: Any = None,
    ) -> SizeRecord:
        if caller is None:
            caller = sys._getframe(1)
        key = self.key(function, context, device, caller)
        records = self._records if owner is None else self._records_of(owner)
        record = records.get(key)
        if record is None:
            alive = self._alive
            alive[id(function)] = function
            frame = user_frame(caller)
            for _ in range(4):
                if frame is None:
                    break
                alive[id(frame.f_code)] = frame.f_code
                frame = user_frame(frame.f_back)
            record = self._add(key, records)
        return record

    def _seed(self, key: Any, records: Records) -> SizeRecord:
        site, bucket = key
        shared = records.sites.get(site)
        if shared is None:
            shared = records.sites[site] = CallSite()
        record = shared.seed(bucket)  # see [Note: a quiet search]
        if records is not self._records:  # see [Note: records per instance]
            self._instances.started_at_site(site, shared, key, record)
        return record

    def memory_changed(self) -> None:
        """Re-read free memory on the next call (called after an out-of-memory error)."""
        self._buckets.invalidate()


_default_lock = threading.Lock()
_default_cache: type[BatchsizeCache] | BatchsizeCache = StacktraceMemoryBatchsizeCache
_shared: dict[type[BatchsizeCache], BatchsizeCache] = {}


def check_cache(cache: Any, name: str) -> None:
    """Refuse ``cache`` (the argument called ``name``) unless it is a cache class or instance
    whose class says which calls share a size (overrides ``key`` or ``record``)."""
    cls: type = cache if isinstance(cache, type) else type(cache)
    if not issubclass(cls, BatchsizeCache):
        raise TypeError(
            f"{name} must be a BatchsizeCache subclass or instance, such as "
            f"adaptive.GlobalBatchsizeCache, got {cache!r}"
        )
    if cls.key is BatchsizeCache.key and cls.record is BatchsizeCache.record:
        if cls is BatchsizeCache:
            got = ("the abstract class adaptive.BatchsizeCache itself" if cache is cls
                   else "an instance of the abstract class adaptive.BatchsizeCache")
            raise TypeError(
                f"{name} must be a cache that says which calls share a size, got {got}, "
                f"whose key() is not implemented: pass one of its subclasses, such as "
                f"adaptive.GlobalBatchsizeCache or adaptive.StacktraceMemoryBatchsizeCache "
                f"(a class or an instance), or a subclass of your own that overrides key()"
            )
        got = (f"the class {cls.__qualname__}" if cache is cls
               else f"an instance of {cls.__qualname__}")
        raise TypeError(
            f"{name} must be a cache that says which calls share a size, got {got}, which "
            f"does not override BatchsizeCache.key(): override key(self, function, context, "
            f"device, caller) in {cls.__qualname__} to return what the calls that share a "
            f"size have in common"
        )


_takes_owner: dict[type, bool] = {}


def record_for(cache: BatchsizeCache, function: Any, context: Any,
               device: torch.device | None, caller: Any, owner: Any) -> SizeRecord:
    """``cache.record(...)`` for a call made through ``owner`` (an instance, or None): a
    cache of your own whose ``record`` takes no ``owner`` keeps one record for all."""
    if owner is not None:
        cls = type(cache)
        takes = _takes_owner.get(cls)
        if takes is None:
            takes = _takes_owner[cls] = "owner" in inspect.signature(cls.record).parameters
        if takes:
            return cache.record(function, context, device, caller, owner)
    return cache.record(function, context, device, caller)


def shared_cache(cls: type[BatchsizeCache]) -> BatchsizeCache:
    """The process-wide instance of ``cls`` used by functions that did not pick a cache."""
    cache = _shared.get(cls)
    if cache is None:
        with _default_lock:
            cache = _shared.setdefault(cls, cls())
    return cache


def resolve_cache(cache: Any) -> BatchsizeCache:
    """The cache instance a call uses: ``cache`` itself, a shared instance of a class, or
    (for None) the current default, looked up at call time."""
    if cache is None:
        cache = _default_cache
    if isinstance(cache, BatchsizeCache):
        return cache
    return shared_cache(cache)


def set_default_cache(cache: type[BatchsizeCache] | BatchsizeCache) -> None:
    """Make ``cache`` (a class or an instance) the cache of every function that did not pick
    one, including functions decorated before this call.

    Raises:
        TypeError: ``cache`` is not a BatchsizeCache class or instance, or its class does
            not override ``key`` (the abstract ``BatchsizeCache`` itself, for one).

    Example:
        >>> from adaptmem import adaptive
        >>> adaptive.set_default_cache(adaptive.GlobalBatchsizeCache)
        >>> adaptive.get_default_cache() is adaptive.GlobalBatchsizeCache
        True
        >>> adaptive.set_default_cache(adaptive.StacktraceMemoryBatchsizeCache)
    """
    global _default_cache
    check_cache(cache, "cache")
    with _default_lock:
        _default_cache = cache


def get_default_cache() -> type[BatchsizeCache] | BatchsizeCache:
    """The cache class (or instance) used by functions that did not pick one."""
    return _default_cache
