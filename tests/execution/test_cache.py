"""The batch-size search between calls: probe steps, back-off, free-memory buckets shared
(see [Note: a quiet search] in adaptmem/_execution/cache.py)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import run_if
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import memory_schedules

import adaptmem._execution.cache as cache_module
from adaptmem import OutOfMemoryError, adaptive
from adaptmem._execution.cache import CallSite, SizeRecord
from adaptmem.testing import MemoryCeiling

GIB = 2**30


def _bucket_bytes(bucket: int) -> int:
    """Free bytes that fall in quarter-octave ``bucket`` (its lower edge, rounded up)."""
    return int(2 ** (bucket / 4)) + 1


@pytest.fixture
def free(monkeypatch) -> dict[str, int]:
    """Free memory as the default cache reads it, set by the test."""
    reading = {"bytes": 8 * GIB}
    monkeypatch.setattr(cache_module, "free_memory", lambda device: reading["bytes"])
    return reading


def test_a_probe_goes_a_quarter_of_the_way_to_the_smallest_failure() -> None:
    assert SizeRecord(fits=100, fails=200).next_size(1000) == 125
    assert SizeRecord(fits=10, fails=13).next_size(1000) == 11  # at least one more item
    # No failure known (memory grew): a quarter more, then half more after each probe
    # that fits, never above the initial size.
    record = SizeRecord(fits=100)
    assert record.next_size(1000) == 125
    record.after_success(125)
    assert record.next_size(1000) == 187
    record.after_success(187)
    assert record.next_size(1000) == 280 and record.next_size(230) == 230


@settings(max_examples=200, deadline=None)
@given(fits=st.integers(1, 10_000), gap=st.integers(2, 10_000), more=st.integers(0, 30_000))
def test_a_probe_never_passes_a_quarter_of_the_gap(fits: int, gap: int, more: int) -> None:
    fails = fits + gap
    size = SizeRecord(fits=fits, fails=fails).next_size(fails + more)
    assert fits <= size <= fits + max(1, gap // 4)


def test_a_success_on_fake_tensors_teaches_a_record_nothing() -> None:
    # Another decorated function's trace runs this one on fake tensors: nothing fails
    # there, so a size it ran says nothing about memory.
    from torch._subclasses.fake_tensor import FakeTensorMode

    record = SizeRecord(fits=350, fails=384)
    with FakeTensorMode():
        record.after_success(384)
        record.after_success(1000)
    assert (record.fits, record.fails) == (350, 384)
    record.after_success(384)  # a real run at the failed size: it fits now
    assert (record.fits, record.fails) == (384, None)


def test_a_held_record_runs_the_size_that_fits_then_climbs_again() -> None:
    record = SizeRecord(fits=100, fails=200)
    record.hold(3)  # what model= does while it measures a placement at one size
    assert [record.next_size(1000) for _ in range(4)] == [100, 100, 100, 125]


def test_a_failed_probe_makes_the_next_one_wait_1_then_2_then_4_calls() -> None:
    record = SizeRecord(fits=1000, fails=100_000)
    sizes = []
    for _ in range(30):
        size = record.next_size(200_000)
        sizes.append(size)
        if size > 1000:
            record.after_failure(size, 1)  # every probe fails: the ceiling is 1000
        else:
            record.after_success(size)
    # A probe, 1 call at 1000, a probe, 2 calls, a probe, 4, 8 calls, a probe, and then
    # 1000 is within 10% of the smallest failure: settled.
    assert [i for i, s in enumerate(sizes) if s > 1000] == [0, 2, 5, 10, 19]
    assert sizes[19:] == [sizes[19]] + [1000] * 10


def test_the_wait_ends_when_free_memory_grows_past_the_failure() -> None:
    def call_after_a_failed_probe(bucket: int) -> int:
        site = CallSite()
        record = site.seed(100)
        record.fits, record.fails = 80, 200
        record.after_failure(record.next_size(1000), 1)  # a failed probe: a wait
        return site.seed(bucket).next_size(1000)

    # One quarter-octave more free memory is within the noise of one reading: it waits.
    assert call_after_a_failed_probe(101) == 80
    # Two or more is real growth: the next call probes at once.
    assert call_after_a_failed_probe(102) > 80


def test_a_failure_with_more_memory_is_shared_with_buckets_that_have_less() -> None:
    site = CallSite()
    low, high = site.seed(10), site.seed(14)
    low.after_success(50)
    assert high.fits == 50  # it fitted with less memory: it fits with more
    high.after_failure(80, 1)
    assert low.fails == 80  # it failed with more memory: it fails with less
    assert all(low.next_size(1000) < 80 for _ in range(20))
    # A bucket with still less memory, but at least half of it, knows what failed above
    # it and takes what fits there as it is (readings drift that much with what the
    # process's own allocator keeps).
    lower = site.seed(8)
    assert (lower.fits, lower.start, lower.fails) == (50, None, 80)
    # An octave or more below (the nearest bucket with a size that fits is now 8), what
    # fits is scaled down by the memory it lacks, a guess not known to fit, climbing
    # towards the failure scaled down alike: half of 50 and of 80.
    lowest = site.seed(4)
    assert (lowest.fits, lowest.start, lowest.fails) == (None, 25, 40)
    # A bucket in between knows what fitted below it and what failed above it.
    middle = site.seed(12)
    assert (middle.fits, middle.fails) == (50, 80)


def test_a_bucket_with_much_less_memory_starts_from_what_fits_above_scaled_down(
        free) -> None:
    # 1 MiB per item: 256 fit with 256 MiB free, 56 with 56 MiB. The bucket with 56 MiB
    # tried the 256 that fitted above, then 230, 115 and 57 (four failures) and settled at
    # 28, half of what fits.
    ceiling = MemoryCeiling(1)

    @adaptive.batch(initial_batchsize=512, cache=adaptive.StacktraceMemoryBatchsizeCache(0.0))
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    sizes = []
    for mib in [256] * 3 + [56] * 8:  # one call site
        if mib == 56 and free["bytes"] != 56 << 20:
            ceiling.reset()
        free["bytes"], ceiling.capacity = mib << 20, mib
        sizes.append(infer())
    assert sizes[2] == 256
    assert ceiling.attempts[0] <= 56 and len(ceiling.failures) <= 1
    assert sizes[-1] >= 50  # within 10% of what fits


def test_a_size_borrowed_from_a_bucket_with_more_memory_is_not_known_to_fit() -> None:
    site = CallSite()
    high = site.seed(40)
    high.after_success(100)
    high.after_failure(120, 1)
    low = site.seed(32)  # two octaves less memory: a quarter of each
    assert low.fits is None and low.next_size(1000) == 25 and low.fails == 30
    # It failed: the search halves, as from any first size, not a tenth smaller as for a
    # size that fitted here before.
    assert low.after_failure(25, 1) == 12 and low.fits is None


def test_a_bucket_keeps_its_own_evidence_over_a_neighbours() -> None:
    site = CallSite()
    low, high = site.seed(10), site.seed(14)
    low.after_success(60)
    high.after_failure(60, 1)  # the readings contradict each other
    assert low.fits == 60 and low.fails is None


@settings(max_examples=60, deadline=None)
@given(world=memory_schedules(), initial=st.integers(1, 2000))
def test_sizes_are_shared_across_buckets_in_both_directions(world, initial: int) -> None:
    """Where free memory predicts what fits, no call tries a size that already failed
    with as much free memory or more, nor starts below a size that fitted with as much
    free memory or less."""
    capacity, calls = world
    reading = {"bytes": 0}
    cache_module_free = cache_module.free_memory
    cache_module.free_memory = lambda device: reading["bytes"]
    try:
        cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0.0)
        ceiling = MemoryCeiling(1)

        @adaptive.batch(initial_batchsize=initial, cache=cache)
        def infer(batchsize: int) -> int:
            ceiling.require(batchsize)
            return batchsize

        failed: dict[int, int] = {}  # bucket -> smallest size failed there
        fitted: dict[int, int] = {}  # bucket -> largest size that fitted there
        for bucket in calls:
            reading["bytes"], ceiling.capacity = _bucket_bytes(bucket), capacity[bucket]
            ceiling.reset()
            infer()
            first = ceiling.attempts[0]
            worse = [s for b, s in failed.items() if b >= bucket]
            assert not worse or first < min(worse), (first, failed, bucket)
            better = [s for b, s in fitted.items() if b <= bucket]
            assert not better or first >= min(max(better), initial), (first, fitted, bucket)
            for size in ceiling.attempts:
                if size in ceiling.failures:
                    failed[bucket] = min(failed.get(bucket, size), size)
                else:
                    fitted[bucket] = max(fitted.get(bucket, size), size)
    finally:
        cache_module.free_memory = cache_module_free


@pytest.mark.parametrize("seed", range(6))
def test_a_jittering_tenant_costs_few_failures_once_settled(free, seed: int) -> None:
    """What fits follows free memory, which another tenant moves by +-12% of its 256 MiB
    before each call (batch_search.py --jittered with a pretend device)."""
    rng = random.Random(seed)
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0.0)
    ceiling = MemoryCeiling(1)

    @adaptive.batch(initial_batchsize=1024, cache=cache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    failures, ratios = 0, []
    for call in range(50):
        room = 2**29 - int(2**28 * (1 + rng.uniform(-0.12, 0.12)))
        free["bytes"], ceiling.capacity = room, room // 2**20
        ceiling.reset()
        used = infer()
        if call >= 5:
            failures += len(ceiling.failures)
            ratios.append(used / ceiling.capacity)
    assert failures <= 3
    assert sum(ratios) / len(ratios) >= 0.85


def test_a_predicted_start_runs_first_then_climbs_towards_the_predicted_failure() -> None:
    # What model= seeds from its trace ([Note: predicting the first size] in auto.py).
    record = SizeRecord()
    record.start_at(100, 140)
    assert record.next_size(1000) == 100  # not the initial size
    record.after_success(100)
    assert record.fits == 100 and record.fails == 140
    assert record.next_size(1000) == 110  # a quarter of the way, as after a real failure
    # A start that fails halves, as the search always does.
    wrong = SizeRecord()
    wrong.start_at(100, 140)
    assert wrong.after_failure(100, floor=1) == 50
    assert wrong.next_size(1000) == 50
    # A record that already knows something keeps it; a failure at or below the start is
    # no bound (the search climbs as with no failure known).
    known = SizeRecord(fits=30)
    known.start_at(100, 140)
    assert known.next_size(1000) == 37 and known.fails is None
    unbounded = SizeRecord()
    unbounded.start_at(100, 100)
    assert unbounded.next_size(1000) == 100 and unbounded.fails is None
    # Never above the initial size, never below the floor.
    high, low = SizeRecord(), SizeRecord()
    high.start_at(100, 140)
    low.start_at(3, 10)
    assert high.next_size(60) == 60 and low.next_size(1000, floor=5) == 5


def test_a_generator_never_climbs_towards_a_size_that_failed_at_the_same_free_memory(
        free) -> None:
    # A generator's failure after its first item reaches its consumer: a climb between what
    # fits and what failed would raise there as surely as a probe of the failed size.
    ceiling = MemoryCeiling(2)

    @adaptive.batch(initial_batchsize=4)
    def batches(batchsize: int):
        yield "first"
        ceiling.require(batchsize)
        yield "second"

    outcomes: list[object] = []
    for _ in range(6):
        try:
            outcomes.append(list(batches()))
        except OutOfMemoryError:
            outcomes.append("raised")
    assert outcomes == ["raised"] + [["first", "second"]] * 5
    assert ceiling.attempts == [4, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("kind", ["range", "chunked"])
def test_a_step_that_redoes_its_work_never_climbs_towards_a_size_that_failed(
        free, kind: str) -> None:
    # A range step, or an in-place chunked one, that runs out of memory is done again: a
    # climb that fails applies ``chunk += 1`` twice over the failed step's elements.
    ceiling = MemoryCeiling(5)

    @adaptive.range(initial_step=8)
    def fill(start: int, end: int, out: torch.Tensor) -> None:
        out[start:end] += 1
        ceiling.require(end - start)

    @adaptive.chunked(initial_step=8)
    def bump(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk += 1
        ceiling.require(end - start)

    wrong = []
    for _ in range(6):
        x = torch.zeros(40)
        if kind == "range":
            fill(0, 40, x)
        else:
            bump(x)
        wrong.append(int((x != 1).sum()))
    assert wrong == [8, 0, 0, 0, 0, 0]  # the first call's failed step, as documented
    assert ceiling.failures == [8]


def test_a_generator_climbs_again_when_free_memory_grows(free) -> None:
    ceiling = MemoryCeiling(2)

    @adaptive.batch(initial_batchsize=64, cache=adaptive.StacktraceMemoryBatchsizeCache(0.0))
    def batches(batchsize: int):
        ceiling.require(batchsize)  # before the first item: retried
        yield batchsize

    free["bytes"] = GIB
    assert [next(batches()) for _ in range(4)] == [2, 2, 2, 2]
    free["bytes"], ceiling.capacity = 4 * GIB, 8  # four times the memory: more fits
    sizes = [next(batches()) for _ in range(6)]
    assert sizes[0] > 2 and sizes == sorted(sizes) and 2 < sizes[-1] <= 8


@pytest.mark.parametrize("kind", ["range", "chunked"])
def test_a_range_shorter_than_its_step_leaves_later_calls_full_steps(kind: str) -> None:
    # A one-item range ran one item because the range ended, not because more did not fit:
    # the calls after it at the same site still run full steps.
    steps: list[int] = []

    @adaptive.range(initial_step=8)
    def fill(start: int, end: int) -> None:
        steps.append(end - start)

    @adaptive.chunked(initial_step=8)
    def scale(chunk: torch.Tensor, start: int, end: int) -> None:
        steps.append(end - start)

    for n in (1, 20, 20):
        steps.clear()
        if kind == "range":
            fill(0, n)
        else:
            scale(torch.ones(n))
    assert steps == [8, 8, 4]


def test_a_short_last_step_still_raises_what_is_known_to_fit() -> None:
    record = SizeRecord(fits=4, fails=16)
    record.after_short_success(2)  # below what fits: nothing learned, one success counted
    assert (record.fits, record.fails, record.successes) == (4, 16, 1)
    record.after_short_success(6)  # above it: 6 items ran, so 6 fit
    assert (record.fits, record.fails) == (6, 16)
    fresh = SizeRecord()
    fresh.after_short_success(1)
    assert fresh.next_size(64) == 64  # never "1 fits" for a record that knew nothing


@run_if(cuda=True, min_gpus=2)
@pytest.mark.simulated_cuda(devices=2, total_memory="256MiB")
def test_each_cuda_device_keeps_its_own_sizes_with_the_default_device() -> None:
    # device=None: the device in use is the current one at each call, so the larger device
    # is not pinned to what fits on the smaller one (one call site, a GPU each in turn).
    torch.cuda.set_per_process_memory_fraction(0.25, 1)  # cuda:1 has a quarter of the room
    try:
        @adaptive.batch(initial_batchsize=512)
        def work(batchsize: int) -> int:
            torch.empty(batchsize, 2**18, device="cuda")  # batchsize MiB on the current GPU
            return batchsize

        sizes: dict[int, list[int]] = {0: [], 1: []}
        for _ in range(6):
            for gpu in (0, 1):
                with torch.cuda.device(gpu):
                    sizes[gpu].append(work())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 1)
    assert all(size <= 64 for size in sizes[1])  # 64 MiB on cuda:1
    assert sizes[0][-3:] == [256, 256, 256]  # cuda:0 keeps its own, 4x larger, size


def test_callable_objects_decorated_anew_never_share_sizes() -> None:
    # explicit.batch decorates at every call; the key of a callable object must stay one
    # object per class, or a dead key's id is taken by another class's key.
    from adaptmem._execution.keys import function_key

    small, big = MemoryCeiling(4), MemoryCeiling(1000)

    class Small:
        def __call__(self, batchsize: int) -> int:
            small.require(batchsize)
            return batchsize

    class Big:
        def __call__(self, batchsize: int) -> int:
            big.require(batchsize)
            return batchsize

    got = []
    for _ in range(4):
        for fn in (Small(), Big()):
            got.append((type(fn).__name__, adaptive.explicit.batch(fn, 512)))
    assert [size for name, size in got if name == "Big"] == [512] * 4
    assert small.attempts.count(512) == 1  # Small learned once that 512 does not fit
    assert function_key(Small()) is function_key(Small())  # one key object per class


def test_a_retry_of_an_outer_function_shares_the_inner_call_site() -> None:
    # The inner call's site is the outer function's line, whether the outer runs its first
    # attempt or a retry (adaptmem's own frames in between do not count), so what the inner
    # learned in the first attempt holds in the retry.
    ceiling = MemoryCeiling(4)  # inner size * outer size must be 4 or less
    tries: list[tuple[int, int]] = []

    @adaptive.batch(initial_batchsize=64)
    def inner(batchsize: int, outer_size: int) -> int:
        tries.append((outer_size, batchsize))
        ceiling.require(batchsize * outer_size)
        return batchsize

    @adaptive.batch(initial_batchsize=8)
    def outer(batchsize: int) -> tuple[int, int]:
        return batchsize, inner(batchsize)

    assert outer() == (4, 1)
    assert [t for t in tries if t[0] == 4] == [(4, 1)]  # no search from 64 again


@pytest.mark.parametrize("kind", ["batch", "range"])
def test_a_failure_right_after_memory_was_taken_is_filed_under_what_was_free(
        free, kind: str) -> None:
    """Another tenant takes memory just before a call, within the time the cache reuses its
    reading of free memory: the failure belongs to the memory the call had, so once the
    memory is back the call runs its old size again at once, without a probe or a failure
    (see [Note: a failure filed where it happened])."""
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=3600.0)  # never stale
    ceiling = MemoryCeiling(100)
    sizes: list[int] = []

    if kind == "batch":
        @adaptive.batch(initial_batchsize=64, cache=cache)
        def work(batchsize: int) -> None:
            ceiling.require(batchsize)
            sizes.append(batchsize)

        def call() -> None:
            work()
    else:
        @adaptive.range(initial_step=64, cache=cache)
        def work(start: int, end: int) -> None:
            ceiling.require(end - start)
            sizes.append(end - start)

        def call() -> None:
            work(0, 512)

    # (free memory, capacity, whether the cache reads it anew): one call site for all.
    phases = [(8 * GIB, 100, True),   # 64 fits with 8 GiB free
              (GIB, 20, False),       # taken just now: the cache still reads 8 GiB
              (8 * GIB, 100, True),   # given back, read anew (as after refresh_seconds)
              (GIB, 20, True)]        # taken again, read anew: what fits there is known
    seen = []
    for free["bytes"], ceiling.capacity, read in phases:
        if read:
            cache.memory_changed()
        ceiling.reset()
        call()
        seen.append((ceiling.attempts[0], list(ceiling.failures), sizes[-1]))
    assert seen[0] == (64, [], 64)
    assert seen[1][1][0] == 64 and seen[1][2] <= 20
    assert seen[2] == (64, [], 64)  # not a probe up from what fitted with less
    assert seen[3][0] <= 20 and seen[3][1] == []


def test_a_failure_above_one_already_known_retries_below_the_known_one() -> None:
    # Threads whose first calls fail together: one has found 256 fails while another's
    # attempt at 1024 fails only now. Halving its own size (512) would fail again.
    record = SizeRecord(fits=None, fails=None)
    assert record.after_failure(256, floor=1) == 128
    assert record.after_failure(1024, floor=1) == 128
    assert record.fails == 256
