from __future__ import annotations

import gc
import itertools
import logging
import re
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import adaptmem._execution.retry as retry_module
from adaptmem import OutOfMemoryError, adaptive
from adaptmem.testing import MemoryCeiling, make_oom


def test_batch_injects_the_size_and_returns_the_result() -> None:
    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int, x: int, *, scale: int = 1) -> tuple[int, int]:
        return batchsize, x * scale

    assert infer(3, scale=2) == (16, 6)
    assert infer.__name__ == "infer"


def test_batch_halves_on_oom_and_never_goes_below_the_floor() -> None:
    ceiling = MemoryCeiling(100)

    @adaptive.batch(initial_batchsize=512, min_batchsize=64, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    assert infer() == 64
    assert ceiling.failures == [512, 256, 128]


def test_repeated_calls_settle_within_ten_percent_of_the_ceiling() -> None:
    ceiling = MemoryCeiling(511)  # toma settles at 256 here, forever

    @adaptive.batch(initial_batchsize=8192, cache=adaptive.GlobalBatchsizeCache())
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    sizes = [infer() for _ in range(20)]
    assert all(s <= 511 for s in sizes)
    assert sizes[-1] >= 0.9 * 511
    assert len(set(sizes[-5:])) == 1  # settled: no more probing


def test_sizes_never_exceed_the_initial_size() -> None:
    @adaptive.batch(initial_batchsize=100, cache=adaptive.GlobalBatchsizeCache())
    def infer(batchsize: int) -> int:
        return batchsize

    assert {infer() for _ in range(10)} == {100}


def test_memory_that_frees_up_lets_calls_climb_again() -> None:
    ceiling = MemoryCeiling(100)
    cache = adaptive.GlobalBatchsizeCache()

    @adaptive.batch(initial_batchsize=1024, cache=cache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    for _ in range(15):
        low = infer()
    assert 90 <= low <= 100
    ceiling.capacity = 1024
    cache.record(infer._key, None, None).fails = None  # what a new memory bucket does
    for _ in range(15):
        high = infer()
    assert high >= 0.9 * 1024


def test_oom_at_the_smallest_size_keeps_the_original_type_and_chains_it() -> None:
    @adaptive.batch(initial_batchsize=8, min_batchsize=2, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> None:
        raise make_oom("cuda")

    with pytest.raises(torch.OutOfMemoryError) as info:
        infer()
    error = info.value
    assert isinstance(error, OutOfMemoryError)
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    assert "8, 4, 2" in str(error) and "free" in str(error) and "min_batchsize" in str(error)


def test_python_memory_error_at_the_floor_stays_a_memory_error() -> None:
    @adaptive.batch(initial_batchsize=2, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> None:
        raise MemoryError()

    with pytest.raises(MemoryError) as info:
        infer()
    assert isinstance(info.value, OutOfMemoryError)


@pytest.mark.parametrize("exc_type", [ValueError, KeyboardInterrupt, SystemExit])
def test_non_oom_exceptions_pass_through_untouched_after_one_attempt(exc_type: type) -> None:
    raised = exc_type("boom")
    calls = []

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> None:
        calls.append(batchsize)
        raise raised

    with pytest.raises(exc_type) as info:
        infer()
    assert info.value is raised
    assert calls == [8]


def test_a_transfer_oom_from_a_pager_does_not_shrink_the_batch() -> None:
    transfer = OutOfMemoryError("weights do not fit")
    transfer.phase = "transfer"
    calls = []

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> None:
        calls.append(batchsize)
        raise transfer

    with pytest.raises(OutOfMemoryError) as info:
        infer()
    assert info.value is transfer and calls == [8]


@pytest.mark.parametrize("held_by", ["a local", "a closure's default"])
def test_objects_of_a_failed_attempt_are_gone_before_the_retry(held_by: str) -> None:
    refs: list[weakref.ref] = []
    alive_at_retry = []

    class Activation:
        pass

    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> int:
        alive_at_retry.extend(r() is not None for r in refs)
        activation = Activation()
        refs.append(weakref.ref(activation))

        def inner(held: Activation = activation) -> None:  # a frame of its own holds it
            raise make_oom("cuda")

        if batchsize > 1:
            if held_by == "a local":
                del inner
                raise make_oom("cuda")
            inner()
        return batchsize

    assert infer() == 1
    assert alive_at_retry == [False, False, False]  # 3 earlier objects, each dead at its retry


@pytest.mark.parametrize("unreadable", ["psutil", "everything"])
def test_decorators_work_where_free_cpu_memory_cannot_be_read(
        monkeypatch: pytest.MonkeyPatch, unreadable: str) -> None:
    import psutil

    import adaptmem.cpu_memory

    def refused(*args: Any) -> Any:
        raise PermissionError(13, "Permission denied", "/proc/meminfo")

    # psutil alone (no /proc/meminfo), or every reading adaptmem could take.
    monkeypatch.setattr(psutil, "virtual_memory", refused)
    if unreadable == "everything":
        monkeypatch.setattr(adaptmem.cpu_memory, "cpu_memory_info", refused)
    ceiling = MemoryCeiling(100)

    @adaptive.batch(initial_batchsize=256, device="cpu",
                    cache=adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0.0))
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    @adaptive.batch(initial_batchsize="auto", max_batchsize=64, device="cpu")
    def total(batchsize: int, data: torch.Tensor) -> float:
        return float(sum(chunk.sum() for chunk in data.split(batchsize)))

    assert [infer(), infer()] == [64, 64]  # halved to what fits, then remembered
    assert total(torch.ones(1000)) == 1000.0


def test_success_path_runs_no_gc_and_reads_free_memory_at_most_once(monkeypatch) -> None:
    collects = []
    probes = []
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append(a) or 0)
    import adaptmem._execution.cache as cache_module

    real = cache_module.free_memory
    monkeypatch.setattr(cache_module, "free_memory", lambda d: probes.append(d) or real(d))

    @adaptive.batch(initial_batchsize=32)
    def infer(batchsize: int) -> int:
        return batchsize

    for _ in range(1000):
        infer()
    assert collects == []
    assert len(probes) <= 2  # re-read at most every half second


def test_the_default_cache_applies_to_functions_decorated_earlier() -> None:
    ceiling = MemoryCeiling(10)

    @adaptive.batch(initial_batchsize=64)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    before = adaptive.get_default_cache()
    try:
        adaptive.set_default_cache(adaptive.NoBatchsizeCache)
        infer()
        infer()
        assert ceiling.failures == [64, 32, 16] * 2  # nothing remembered
        adaptive.set_default_cache(adaptive.GlobalBatchsizeCache)
        ceiling.reset()
        infer()
        infer()
        # The second call starts from what the first learned, not from 64 again.
        assert ceiling.failures[:3] == [64, 32, 16] and 64 not in ceiling.failures[3:]
    finally:
        adaptive.set_default_cache(before)
    with pytest.raises(TypeError, match="BatchsizeCache"):
        adaptive.set_default_cache(dict)  # type: ignore[arg-type]


class _NoKeyCache(adaptive.BatchsizeCache):
    """A user's cache that forgot to override key()."""


@pytest.mark.parametrize(("cache", "got", "fix"), [
    (adaptive.BatchsizeCache, "got the abstract class adaptive.BatchsizeCache itself",
     "such as adaptive.GlobalBatchsizeCache"),
    (adaptive.BatchsizeCache(), "got an instance of the abstract class",
     "such as adaptive.GlobalBatchsizeCache"),
    (_NoKeyCache, "got the class", "override key(self, function, context, device, caller)"),
    (_NoKeyCache(), "got an instance", "override key(self, function, context, device, caller)"),
], ids=["base class", "base instance", "subclass", "subclass instance"])
def test_a_cache_that_does_not_override_key_is_refused_where_it_is_given(
        cache: Any, got: str, fix: str) -> None:
    before = adaptive.get_default_cache()
    with pytest.raises(TypeError, match=r"says which calls share a size.*key\(\)") as error:
        adaptive.set_default_cache(cache)
    assert got in str(error.value) and fix in str(error.value)
    assert adaptive.get_default_cache() is before  # nothing half-applied
    with pytest.raises(TypeError, match=r"says which calls share a size.*key\(\)"):
        adaptive.batch(initial_batchsize=8, cache=cache)
    with pytest.raises(NotImplementedError, match=r"override key\(self"):
        adaptive.BatchsizeCache().key(None, None, None, None)


def test_call_sites_learn_sizes_separately_with_the_stacktrace_cache() -> None:
    cache = adaptive.StacktraceMemoryBatchsizeCache()
    limits = {"small": 8, "large": 64}

    @adaptive.batch(initial_batchsize=64, cache=cache)
    def infer(batchsize: int, which: str) -> int:
        if batchsize > limits[which]:
            raise make_oom("cuda")
        return batchsize

    small = [infer("small") for _ in range(3)]
    large = [infer("large") for _ in range(3)]
    assert small[-1] == 8 and large == [64, 64, 64]


def test_a_new_memory_bucket_starts_from_its_nearest_neighbour(monkeypatch) -> None:
    import adaptmem._execution.cache as cache_module

    free = {"bytes": 0}
    monkeypatch.setattr(cache_module, "free_memory", lambda d: free["bytes"])
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0.0)
    ceiling = MemoryCeiling(300)

    @adaptive.batch(initial_batchsize=1024, cache=cache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    def call(free_bytes: int, capacity: int) -> tuple[int, list[int]]:
        free["bytes"], ceiling.capacity = free_bytes, capacity
        ceiling.reset()
        return infer(), list(ceiling.failures)

    gib = 2**30
    # One call site throughout; only free memory and the real ceiling change.
    schedule = [(8 * gib, 300)] * 10 + [(int(7.6 * gib), 300)] + [(32 * gib, 1024)] * 12
    runs = [call(free_bytes, capacity) for free_bytes, capacity in schedule]
    settled = runs[9][0]
    assert settled >= 270
    assert runs[10] == (settled, [])  # noise flipped the bucket: no restart from 1024
    assert runs[11][0] > settled and runs[-1][0] >= 0.9 * 1024  # more memory: climbs again


def test_bad_arguments_fail_at_the_call_that_received_them() -> None:
    def f(batchsize: int) -> int:
        return batchsize

    with pytest.raises(TypeError, match="initial_batchsize"):
        adaptive.batch(f)
    with pytest.raises(TypeError, match="initial_batchsize"):
        adaptive.batch()(f)
    with pytest.raises(TypeError, match=r"context=\['a'\] cannot key .* hashable"):
        adaptive.batch(initial_batchsize=4, context=["a"])(f)
    with pytest.raises(ValueError, match="initial_batchsize"):
        adaptive.batch(initial_batchsize=0)
    with pytest.raises(ValueError, match="initial_batchsize"):
        adaptive.batch(initial_batchsize=-4)
    with pytest.raises(TypeError, match="initial_batchsize"):
        adaptive.batch(initial_batchsize=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initial_batchsize"):
        adaptive.batch(initial_batchsize=True)
    with pytest.raises(ValueError, match="min_batchsize"):
        adaptive.batch(initial_batchsize=4, min_batchsize=8)
    with pytest.raises(TypeError, match="decorates a function"):
        adaptive.batch(initial_batchsize=4)(42)
    with pytest.raises(TypeError, match="keywords"):
        adaptive.batch(512)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache"):
        adaptive.batch(initial_batchsize=4, cache="global")


def test_a_caller_passing_the_injected_batch_size_gets_a_type_error() -> None:
    @adaptive.batch(initial_batchsize=4)
    def infer(batchsize: int, data: list) -> int:
        return batchsize

    with pytest.raises(TypeError, match="batchsize"):
        infer(32, [1])
    with pytest.raises(TypeError, match="batchsize="):
        infer([1], batchsize=32)


def test_methods_get_the_size_after_self() -> None:
    class Model:
        scale = 3

        @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
        def infer(self, batchsize: int, x: int) -> int:
            return self.scale * batchsize + x

    assert Model().infer(1) == 13


def test_eight_threads_share_sizes_and_all_get_correct_results() -> None:
    ceiling = MemoryCeiling(100)
    cache = adaptive.GlobalBatchsizeCache()

    @adaptive.batch(initial_batchsize=1024, cache=cache)
    def total(batchsize: int, data: torch.Tensor) -> float:
        out = 0.0
        for i in range(0, len(data), batchsize):
            ceiling.require(batchsize)
            out += float(data[i : i + batchsize].sum())
        return out

    data = torch.arange(1000, dtype=torch.float64)
    results: list[float] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(10):
                results.append(total(data))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [float(data.sum())] * 80
    record = cache.record(total._key, None, None)
    assert record.fits is not None and 90 <= record.fits <= 100


def test_every_adaptation_is_logged_with_sizes_and_free_memory(adaptmem_log) -> None:
    ceiling = MemoryCeiling(20)

    @adaptive.batch(initial_batchsize=64, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    infer()
    messages = [r.getMessage() for r in adaptmem_log.records if r.name == "adaptmem"]
    assert any("batchsize=64" in m and "batchsize=32" in m and "free" in m for m in messages)
    assert any("batchsize=16 fits" in m for m in messages)


def test_range_resumes_at_the_failed_offset() -> None:
    calls = []

    @adaptive.range(initial_step=8, cache=adaptive.NoBatchsizeCache)
    def fill(start: int, end: int, out: list) -> int:
        calls.append((start, end))
        if end - start > 3 and start >= 8:
            raise make_oom("cuda")
        out.extend(range(start, end))
        return end - start

    out: list[int] = []
    sizes = fill(0, 20, out)
    assert out == list(range(20))
    # (0, 8) is not redone; 8 fitted before, so the retry takes a tenth off, not half.
    assert calls[:3] == [(0, 8), (8, 16), (8, 15)]
    assert sum(sizes) == 20


def test_chunked_works_on_any_dimension_and_returns_the_tensor() -> None:
    t = torch.zeros(3, 10, 4)

    @adaptive.chunked(initial_step=4, dimension=-2, cache=adaptive.NoBatchsizeCache)
    def mark(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk += torch.arange(start, end).view(1, -1, 1)

    out = mark(t)
    assert out is t
    assert torch.equal(t[0, :, 0], torch.arange(10.0))
    with pytest.raises(ValueError, match="dimension=-2"):
        mark(torch.zeros(5))


def test_range_and_chunked_reject_bad_input_clearly() -> None:
    fill = adaptive.range(initial_step=4)(lambda s, e: None)
    with pytest.raises(ValueError, match="before start"):
        fill(5, 2)
    with pytest.raises(TypeError, match="start"):
        fill(0.5, 2)
    with pytest.raises(TypeError, match="tensor"):
        adaptive.chunked(initial_step=4)(lambda c, s, e: None)([1, 2])
    with pytest.raises(TypeError, match="dimension"):
        adaptive.chunked(initial_step=4, dimension="0")  # type: ignore[arg-type]


def test_execute_and_explicit_forms_run_at_once() -> None:
    ceiling = MemoryCeiling(10)

    def sized(batchsize: int, offset: int = 0) -> int:
        ceiling.require(batchsize)
        return batchsize + offset

    assert adaptive.execute.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)(
        sized) == 8
    assert adaptive.explicit.batch(sized, 16, 100) == 108
    assert adaptive.execute.range(0, 5, initial_step=2)(lambda s, e: (s, e)) == [
        (0, 2), (2, 4), (4, 5)]
    assert adaptive.explicit.range(lambda s, e, k: e * k, 0, 4, 2, 10) == [20, 40]
    t = torch.zeros(2, 6)
    adaptive.execute.chunked(t, initial_step=4, dimension=1)(lambda c, s, e: c.fill_(1))
    assert t.sum() == 12
    adaptive.explicit.chunked(lambda c, s, e, v: c.fill_(v), t, 5, 2.0, dimension=0)
    assert t.sum() == 24


@settings(max_examples=30, deadline=None)
@given(ceiling=st.integers(1, 5000), initial=st.integers(1, 8192))
def test_batch_fits_and_reaches_ninety_percent_of_any_ceiling(ceiling: int, initial: int) -> None:
    memory = MemoryCeiling(ceiling)

    @adaptive.batch(initial_batchsize=initial, cache=adaptive.GlobalBatchsizeCache())
    def total(batchsize: int, n: int) -> tuple[int, int]:
        memory.require(batchsize)
        return sum(range(n)), batchsize

    for _ in range(20):
        result, used = total(100)
        assert result == 4950 and used <= ceiling
    assert used >= 0.9 * min(ceiling, initial)


@settings(max_examples=40, deadline=None)
@given(
    ceiling=st.integers(1, 300),
    step=st.integers(1, 400),
    start=st.integers(0, 50),
    length=st.integers(0, 500),
)
def test_range_covers_every_index_once_in_order(ceiling, step, start, length) -> None:
    memory = MemoryCeiling(ceiling)
    seen: list[int] = []

    @adaptive.range(initial_step=step, cache=adaptive.NoBatchsizeCache)
    def visit(s: int, e: int) -> int:
        memory.require(e - s)
        seen.extend(range(s, e))
        return e - s

    sizes = visit(start, start + length)
    assert seen == list(range(start, start + length))
    assert sum(sizes) == length and all(0 < s <= ceiling for s in sizes)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    data=st.data(),
    ceiling=st.integers(1, 12),
    step=st.integers(1, 16),
)
def test_chunked_covers_every_index_once_for_any_dimension(shape, data, ceiling, step) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    memory = MemoryCeiling(ceiling)
    t = torch.zeros(shape)

    @adaptive.chunked(initial_step=step, dimension=dim, cache=adaptive.NoBatchsizeCache)
    def count(chunk: torch.Tensor, s: int, e: int) -> None:
        memory.require(e - s)
        chunk += 1

    count(t)
    assert torch.equal(t, torch.ones(shape))


def test_retry_frees_caches_between_attempts(monkeypatch) -> None:
    freed = []
    monkeypatch.setattr(retry_module, "free_caches", lambda device: freed.append(device))
    ceiling = MemoryCeiling(2)

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    assert infer() == 2 and len(freed) == 2


def test_later_calls_never_go_below_the_floor() -> None:
    calls: list[int] = []

    @adaptive.batch(initial_batchsize=9, min_batchsize=8, cache=adaptive.GlobalBatchsizeCache())
    def infer(batchsize: int) -> int:
        calls.append(batchsize)
        if batchsize > 7:
            raise make_oom("cuda")
        return batchsize

    for _ in range(2):
        with pytest.raises(OutOfMemoryError):
            infer()
    assert min(calls) == 8


@adaptive.batch(initial_batchsize=4)
def picklable(batchsize: int) -> int:
    return batchsize


class Picklable:
    scale = 3

    @adaptive.batch(initial_batchsize=4)
    @classmethod
    def total(cls, batchsize: int, items: list[int]) -> int:
        return cls.scale * sum(items[:batchsize]) + batchsize

    @adaptive.batch(initial_batchsize=4)
    def sum(self, batchsize: int, items: list[int]) -> int:
        return sum(items[:batchsize]) + batchsize

    def _impl(self, batchsize: int, items: list[int]) -> int:
        return sum(items[:batchsize]) + batchsize

    run = adaptive.batch(initial_batchsize=4)(_impl)


def test_decorated_functions_pickle_by_name() -> None:
    import pickle

    assert pickle.loads(pickle.dumps(picklable)) is picklable
    # bound methods pickle as bound methods do: the instance (or class) and the name; a
    # decorated classmethod used to fail ("not the same object as Picklable.total")
    total = pickle.loads(pickle.dumps(Picklable.total))
    assert total(list(range(10))) == 3 * 6 + 4  # the class, then the size
    method = pickle.loads(pickle.dumps(Picklable().sum))
    assert method(list(range(10))) == 6 + 4 and isinstance(method.__self__, Picklable)
    # under the name that holds it, not its function's: pickling Picklable().run as
    # "_impl" gave back the plain function, which ran without sizing
    run = pickle.loads(pickle.dumps(Picklable().run))
    assert run(list(range(10))) == 6 + 4 and run.__name__ == "_impl"


@pytest.mark.gpu
def test_a_real_cuda_oom_adapts_and_memory_returns_to_baseline() -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    # Make the card look like 1 GiB: 4 MiB per item, so about 200 items fit.
    index = torch.cuda.current_device()  # torch's fraction calls want an index
    torch.cuda.set_per_process_memory_fraction(
        (torch.cuda.memory_reserved(device) + 2**30) / total, index)
    try:
        @adaptive.batch(initial_batchsize=4096, device=device,
                        cache=adaptive.GlobalBatchsizeCache())
        def fill(batchsize: int) -> int:
            block = torch.ones(batchsize, 2**20, device=device)  # 4 MiB per item
            return int(block.sum().item()) // 2**20

        sizes = [fill() for _ in range(8)]
        assert sizes[0] < 4096 and all(s <= 256 for s in sizes)
        assert sizes[-1] >= 100  # 1 GiB holds about 250 items; the search got near that
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(device) == baseline


@pytest.mark.parametrize("kind", ["cpu", "mps", "cublas", "cuda-driver", "cuda-runtime", "cuda"])
def test_an_outer_batch_adapts_when_an_inner_one_gives_up(kind: str) -> None:
    # Memory the outer batch holds leaves the inner function room only when it is small.
    inner_calls: list[tuple[int, int]] = []

    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    def inner(batchsize: int, held: int) -> int:
        inner_calls.append((held, batchsize))
        if held + 40 * batchsize > 100:
            raise make_oom(kind)
        return held

    @adaptive.batch(initial_batchsize=64, cache=adaptive.NoBatchsizeCache)
    def outer(batchsize: int) -> int:
        return inner(batchsize)

    assert outer() == 32  # 64 + 40 > 100 even at the inner floor: the outer halves once
    assert (64, 1) in inner_calls and inner_calls[-1] == (32, 1)


def test_nested_batches_adapt_under_a_real_cpu_memory_cap() -> None:
    import subprocess
    import sys
    import textwrap

    code = """
        import logging, sys, torch
        from adaptmem import adaptive
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        adaptive.cpu_memory.set_cpu_memory_limit(1.5)
        room = adaptive.cpu_memory.get_available_cpu_memory()
        # An item takes a tenth of the room: an outer batch of 8 holds 0.8 of it, and the
        # inner function needs 4 times an item's bytes per item (0.4 of the room at 1 item).
        per_item = int(0.1 * room) // 4
        data = torch.arange(16, dtype=torch.float64)

        @adaptive.batch(initial_batchsize=4)
        def inner(batchsize, held):
            out = 0.0
            for i in range(0, len(held), batchsize):
                scratch = held[i:i + batchsize].repeat_interleave(4, dim=0)
                out += float(scratch[:, 0].sum()) / 4
                del scratch
            return out

        @adaptive.batch(initial_batchsize=8)
        def outer(batchsize, data):
            out = 0.0
            for chunk in data.split(batchsize):
                held = chunk.float().view(-1, 1).expand(-1, per_item).contiguous()
                out += inner(held)
                del held
            return out

        print("RESULT", outer(data), float(data.sum()))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    got, want = next(line for line in lines if line.startswith("RESULT")).split()[1:]
    assert float(got) == float(want)
    assert any("outer ran out of memory at batchsize=8" in line for line in lines), (
        result.stdout)


class _Model:
    scale = 3

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    @staticmethod
    def static(batchsize: int, x: int) -> int:
        _Model.ceiling.require(batchsize)
        return batchsize + x

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    @classmethod
    def klass(cls, batchsize: int, x: int) -> int:
        _Model.ceiling.require(batchsize)
        return cls.scale * batchsize + x

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def method(self, batchsize: int, x: int) -> int:
        _Model.ceiling.require(batchsize)
        return self.scale * batchsize + x

    ceiling = MemoryCeiling(2)


class _Sub(_Model):
    scale = 5


def test_batch_above_staticmethod_and_classmethod_works_through_instances_and_classes() -> None:
    model, sub = _Model(), _Sub()
    assert model.static(1) == _Model.static(1) == sub.static(1) == 3
    assert model.klass(1) == _Model.klass(1) == 7
    assert sub.klass(1) == _Sub.klass(1) == 11  # bound to the class it is called through
    assert model.method(1) == _Model.method(model, 1) == 7
    assert _Model.method(sub, 1) == 11
    assert set(_Model.ceiling.failures) == {8, 4}  # every form adapted
    with pytest.raises(TypeError, match="batchsize"):
        model.static(4, 1)  # the caller passing the injected size is still caught
    with pytest.raises(TypeError, match="batchsize"):
        _Model.klass(4, 1)


def test_range_and_chunked_above_staticmethod_work_too() -> None:
    class Steps:
        @adaptive.range(initial_step=4, cache=adaptive.NoBatchsizeCache)
        @staticmethod
        def spans(start: int, end: int) -> tuple[int, int]:
            return start, end

        @adaptive.chunked(initial_step=2, cache=adaptive.NoBatchsizeCache)
        @classmethod
        def fill(cls, chunk: torch.Tensor, start: int, end: int) -> None:
            chunk.fill_(7)

    assert Steps().spans(0, 6) == Steps.spans(0, 6) == [(0, 4), (4, 6)]
    assert Steps.fill(torch.zeros(5)).tolist() == [7.0] * 5


def test_a_generator_is_retried_before_its_first_item_and_recorded_only_once_it_fits() -> None:
    ceiling = MemoryCeiling(10)
    cache = adaptive.GlobalBatchsizeCache()

    @adaptive.batch(initial_batchsize=64, cache=cache)
    def batches(batchsize: int, n: int):
        for start in range(0, n, batchsize):
            ceiling.require(batchsize)
            yield list(range(start, min(start + batchsize, n)))

    items = batches(25)
    assert ceiling.attempts == []  # like any generator, nothing runs before iteration
    out = list(items)
    assert [x for b in out for x in b] == list(range(25))  # every item once, in order
    assert ceiling.failures == [64, 32, 16] and [len(b) for b in out] == [8, 8, 8, 1]
    record = cache.record(batches._key, None, None)
    assert (record.fits, record.fails) == (8, 16)  # never "64 fits"
    ceiling.reset()
    # The next call starts from what fitted, and stays there: a generator never climbs
    # towards a size that failed (see [Note: probing a failed size]).
    assert next(batches(25)) == list(range(8)) and ceiling.failures == []


def test_a_generator_out_of_memory_after_yielding_is_not_retried_or_recorded_as_fitting() -> None:
    cache = adaptive.GlobalBatchsizeCache()

    @adaptive.batch(initial_batchsize=8, cache=cache)
    def batches(batchsize: int):
        for i in range(4):
            if i >= 2 and batchsize > 4:
                raise make_oom("cpu")
            yield i

    seen = []
    with pytest.raises(RuntimeError) as info:
        for item in batches():
            seen.append(item)
    assert seen == [0, 1]  # a retry would have yielded 0 and 1 again
    error = info.value
    assert isinstance(error, OutOfMemoryError) and isinstance(error.__cause__, RuntimeError)
    assert "after yielding 2 item(s)" in str(error) and "batchsize=4" in str(error)
    record = cache.record(batches._key, None, None)
    assert record.fits is None and record.fails == 8
    assert list(batches()) == [0, 1, 2, 3]  # the next call starts smaller and fits
    assert record.fits == 4


def test_a_generator_keeps_send_throw_and_its_return_value() -> None:
    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    def echo(batchsize: int):
        total = 0
        while True:
            try:
                got = yield total
            except KeyError:
                got = 100
            if got is None:
                return total
            total += got

    gen = echo()
    assert next(gen) == 0 and gen.send(2) == 2 and gen.throw(KeyError()) == 102
    with pytest.raises(StopIteration) as stop:
        gen.send(None)
    assert stop.value.value == 102


def test_an_async_function_is_awaited_and_retried_whole() -> None:
    import asyncio
    import inspect

    ceiling = MemoryCeiling(10, kind="mps")
    cache = adaptive.GlobalBatchsizeCache()

    @adaptive.batch(initial_batchsize=64, cache=cache)
    async def infer(batchsize: int, x: int) -> int:
        await asyncio.sleep(0)
        ceiling.require(batchsize)
        return batchsize + x

    assert inspect.iscoroutinefunction(infer) or asyncio.iscoroutinefunction(infer)
    pending = infer(100)
    assert ceiling.attempts == []
    assert asyncio.run(pending) == 108
    assert ceiling.failures == [64, 32, 16]
    record = cache.record(infer._key, None, None)
    assert (record.fits, record.fails) == (8, 16)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11+")
def test_out_of_memory_in_a_task_group_is_retried_and_another_error_is_not() -> None:
    # A TaskGroup raises its tasks' errors as an ExceptionGroup: one holding nothing but
    # out-of-memory errors is one; one holding another error passes through at once.
    import asyncio

    ceiling = MemoryCeiling(4)
    sizes: list[int] = []

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    async def infer(batchsize: int, x: torch.Tensor) -> torch.Tensor:
        sizes.append(batchsize)

        async def one(chunk: torch.Tensor) -> torch.Tensor:
            await asyncio.sleep(0)
            ceiling.require(len(chunk))
            return chunk * 2

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(c)) for c in x.split(batchsize)]
        return torch.cat([t.result() for t in tasks])

    assert torch.equal(asyncio.run(infer(torch.arange(10.0))), torch.arange(10.0) * 2)
    assert sizes == [16, 8, 4]

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    async def broken(batchsize: int) -> None:
        sizes.append(batchsize)

        async def fails() -> None:
            raise ValueError("not memory")

        async with asyncio.TaskGroup() as group:
            group.create_task(fails())

    sizes.clear()
    with pytest.raises(ExceptionGroup) as info:  # noqa: F821 - Python 3.11+
        asyncio.run(broken())
    assert sizes == [16] and isinstance(info.value.exceptions[0], ValueError)

    never = MemoryCeiling(0.5)

    @adaptive.batch(initial_batchsize=2, cache=adaptive.NoBatchsizeCache)
    async def too_big(batchsize: int) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(asyncio.to_thread(never.require, batchsize))

    with pytest.raises(OutOfMemoryError, match="at the smallest batchsize, 1") as gave_up:
        asyncio.run(too_big())
    assert isinstance(gave_up.value.__cause__, ExceptionGroup)  # noqa: F821


def test_lazy_results_are_named_as_the_decorated_function() -> None:
    # Their repr, and so Python's warning for a coroutine dropped without being awaited
    # (which prints the coroutine's __qualname__), name the user's function, not adaptmem's
    # retry wrappers.
    import asyncio

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    async def infer(batchsize: int) -> int:
        return batchsize

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def numbers(batchsize: int):
        yield batchsize

    gen = numbers()
    assert gen.__qualname__.endswith("<locals>.numbers") and "retry" not in repr(gen)
    assert list(gen) == [8]
    pending = infer()
    assert pending.__qualname__.endswith("<locals>.infer") and "retry" not in repr(pending)
    assert asyncio.run(pending) == 8


def test_an_async_generator_is_retried_before_its_first_item() -> None:
    import asyncio

    ceiling = MemoryCeiling(3)

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    async def batches(batchsize: int, n: int):
        for start in range(0, n, batchsize):
            await asyncio.sleep(0)
            ceiling.require(batchsize)
            yield list(range(start, min(start + batchsize, n)))

    async def collect() -> list[list[int]]:
        return [b async for b in batches(7)]

    assert asyncio.run(collect()) == [[0, 1], [2, 3], [4, 5], [6]]
    assert ceiling.failures == [16, 8, 4]


def test_range_and_chunked_refuse_generators_and_coroutines_clearly() -> None:
    def gen_step(start: int, end: int):
        yield start

    async def async_step(start: int, end: int) -> None:
        pass

    for decorate in (adaptive.range(initial_step=4), adaptive.chunked(initial_step=4)):
        for step in (gen_step, async_step):
            with pytest.raises(TypeError, match="plain function"):
                decorate(step)
    # A plain function that hands back a generator is caught at its first step.
    lazy = adaptive.range(initial_step=4)(lambda s, e: (i for i in range(s, e)))
    with pytest.raises(TypeError, match="do its work before it returns"):
        lazy(0, 8)


def test_a_transient_low_ceiling_does_not_pin_the_default_cache(monkeypatch) -> None:
    import adaptmem._execution.cache as cache_module

    monkeypatch.setattr(cache_module, "free_memory", lambda d: 8 * 2**30)  # never changes
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0.0)
    ceiling = MemoryCeiling(1)

    @adaptive.batch(initial_batchsize=512, cache=cache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    sizes, failed = [], []
    for capacity in [1] + [1000] * 200:  # one call site; memory was short for one call
        ceiling.capacity = capacity
        ceiling.reset()
        sizes.append(infer())
        failed.append(list(ceiling.failures))
    assert sizes[0] == 1
    # Climbed back by probing (within 10% of the initial size, as any search settles),
    # with nothing failing on the way.
    assert sizes[-1] >= 0.9 * 512
    assert failed[1:] == [[]] * 200
    assert next(i for i, s in enumerate(sizes) if s >= 0.9 * 512) < 80


def test_a_real_ceiling_is_probed_rarely(monkeypatch) -> None:
    import adaptmem._execution.cache as cache_module

    monkeypatch.setattr(cache_module, "free_memory", lambda d: 8 * 2**30)
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0.0)
    ceiling = MemoryCeiling(100)

    @adaptive.batch(initial_batchsize=512, cache=cache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    sizes = [infer() for _ in range(4000)]
    assert all(s <= 100 for s in sizes) and sizes[-1] >= 90
    settled = sizes.index(sizes[-1])
    later = [i for i, s in enumerate(ceiling.attempts) if s > 100 and i > settled + 10]
    # Each failed probe doubles the wait: 32, 64, 128, ... calls, so a handful in 4000 calls.
    assert 1 <= len(later) <= 7


def test_work_a_failed_attempt_leaves_half_done_never_probes_a_failed_size() -> None:
    """A settled in-place chunked step, range step or generator is not retried at a size
    known to fail: the probe would write twice, or raise after items were yielded."""
    ceiling = MemoryCeiling(8)

    @adaptive.chunked(initial_step=16, cache=adaptive.GlobalBatchsizeCache)
    def add_one(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk += 1
        ceiling.require(end - start)  # runs out of memory after the write

    @adaptive.range(initial_step=16, cache=adaptive.GlobalBatchsizeCache)
    def fill(start: int, end: int, out: list[int]) -> None:
        out.extend(range(start, end))
        ceiling.require(end - start)

    @adaptive.batch(initial_batchsize=16, cache=adaptive.GlobalBatchsizeCache)
    def stream(batchsize: int, n: int):
        for i in range(0, n, batchsize):
            if i > 0:  # memory runs out on a later batch, after an item was yielded
                ceiling.require(batchsize)
            yield list(range(i, min(n, i + batchsize)))

    wrong_chunks, wrong_ranges, raised = [], [], []
    for call in range(300):
        if add_one(torch.zeros(64)).max() > 1:
            wrong_chunks.append(call)
        out: list[int] = []
        fill(0, 64, out)
        if out != list(range(64)):
            wrong_ranges.append(call)
        try:
            assert [x for b in stream(64) for x in b] == list(range(64))
        except torch.OutOfMemoryError:
            raised.append(call)
    # Only while the search converges (16, 12, 10, 9 all fail before 8 fits), never later.
    assert max(wrong_chunks + wrong_ranges + raised) < 5, (wrong_chunks, wrong_ranges, raised)


def test_chunked_default_applies_a_retried_in_place_write_twice_as_documented() -> None:
    memory = MemoryCeiling(3)

    @adaptive.chunked(initial_step=8, cache=adaptive.NoBatchsizeCache)
    def add_one(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk += 1
        memory.require(end - start)  # runs out of memory after the write

    t = add_one(torch.zeros(8))
    assert t.tolist()[:3] == [3.0, 3.0, 3.0]  # 8, then 4 failed over these, then 2 fitted


@pytest.mark.parametrize("output", ["input", "new"])
def test_chunked_output_writes_a_step_result_only_once_it_succeeded(output: str) -> None:
    memory = MemoryCeiling(3)

    @adaptive.chunked(initial_step=8, output=output, cache=adaptive.NoBatchsizeCache)
    def add_one(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        result = chunk + 1
        memory.require(end - start)  # runs out of memory after computing the result
        return result

    t = torch.zeros(8)
    out = add_one(t)
    assert out.tolist() == [1.0] * 8 and memory.failures == [8, 4]
    if output == "input":
        assert out is t
    else:
        assert out is not t and t.tolist() == [0.0] * 8


def test_chunked_output_new_collects_any_result_shape_and_dtype_like_torch_cat() -> None:
    memory = MemoryCeiling(5)
    x = torch.randn(3, 13, 4)

    @adaptive.chunked(initial_step=16, dimension=1, output="new",
                      cache=adaptive.NoBatchsizeCache)
    def summarise(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        memory.require(end - start)
        return chunk.sum(-1, keepdim=True).repeat(1, 1, 2).double()

    out = summarise(x)
    want = torch.cat([c.sum(-1, keepdim=True).repeat(1, 1, 2).double()
                      for c in x.split(4, 1)], 1)
    assert out.dtype == torch.float64 and out.shape == (3, 13, 2)
    assert torch.equal(out, want)
    empty = summarise(torch.zeros(3, 0, 4))
    assert empty.shape == (3, 0, 2)  # one call on the empty chunk, as torch.cat would see


@pytest.mark.parametrize("output", ["input", "new"])
def test_chunked_refuses_a_failed_step_that_wrote_into_its_chunk(output: str) -> None:
    # With output="input" or "new" the step returns its values; one that wrote into its
    # chunk and then ran out of memory was run again on the written values: 8, 4 and 2
    # where 2 was right, with nothing said.
    ceiling = MemoryCeiling(3)

    @adaptive.chunked(initial_step=8, output=output, cache=adaptive.NoBatchsizeCache)
    def scale(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        chunk.mul_(2)
        ceiling.require(end - start)
        return chunk

    x = torch.ones(10)
    with pytest.raises(ValueError, match=r"wrote into its chunk in place .* \(the input's "
                                         r"\[0, 8\) holds what it wrote.*chunk \* 2"):
        scale(x)
    assert x[8:].tolist() == [1.0, 1.0]  # nothing past the failed step was touched
    ceiling = MemoryCeiling(3)

    @adaptive.chunked(initial_step=8, output=output, cache=adaptive.NoBatchsizeCache)
    def scale_out_of_place(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        ceiling.require(end - start)
        return chunk * 2

    assert scale_out_of_place(torch.ones(10)).tolist() == [2.0] * 10


def test_chunked_in_place_logs_a_failed_step_that_wrote_into_its_chunk(
        caplog: pytest.LogCaptureFixture) -> None:
    ceiling = MemoryCeiling(3)

    @adaptive.chunked(initial_step=8, cache=adaptive.NoBatchsizeCache)
    def scale(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk.mul_(2)
        ceiling.require(end - start)

    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        scale(torch.ones(10))
    assert "scale wrote into its chunk in a step that ran out of memory" in caplog.text


def test_chunked_output_input_writes_an_inference_tensor_back_outside_inference_mode(
) -> None:
    # The decorator's own write-back ran outside the step's inference_mode and raised
    # torch's "Inplace update to inference tensor outside InferenceMode".
    layer = nn.Linear(16, 16).eval()

    @adaptive.chunked(initial_step=32, output="input")
    @torch.inference_mode()
    def embed(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return layer(chunk)

    with torch.inference_mode():
        features = torch.randn(100, 16)
        want = layer(features)
    torch.testing.assert_close(embed(features), want, rtol=0, atol=0)


def test_chunked_output_rejects_bad_options_and_results_clearly() -> None:
    with pytest.raises(ValueError, match="output must be"):
        adaptive.chunked(initial_step=4, output="copy")
    same = adaptive.chunked(initial_step=4, output="input")(lambda c, s, e: c[:1] * 2)
    with pytest.raises(ValueError, match="chunk's shape"):
        same(torch.zeros(8, 2))
    nothing = adaptive.chunked(initial_step=4, output="new")(lambda c, s, e: None)
    with pytest.raises(TypeError, match="returns its chunk's result"):
        nothing(torch.zeros(8))
    ragged = adaptive.chunked(initial_step=4, output="new")(lambda c, s, e: c.repeat(1, s + 1))
    with pytest.raises(ValueError, match=r"\(4, 10\) for \[4, 8\), which does not match "
                                         r"the first step's \(4, 2\) for \[0, 4\)"):
        ragged(torch.zeros(8, 2))
    # A later step of another dtype is refused, not cast into the first step's.
    mixed = adaptive.chunked(initial_step=4, output="new")(
        lambda c, s, e: c.long() if s == 0 else c * 0.5)
    with pytest.raises(ValueError, match=r"returned torch.float32 .* first step returned "
                                         r"torch.int64"):
        mixed(torch.ones(8))


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    data=st.data(),
    ceiling=st.integers(1, 9),
    step=st.integers(1, 12),
)
def test_chunked_output_modes_equal_the_unchunked_result_for_any_ceiling(
        shape, data, ceiling, step) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    memory = MemoryCeiling(ceiling)
    x = torch.randn(shape)

    def step_fn(chunk: torch.Tensor, s: int, e: int) -> torch.Tensor:
        result = chunk * 2 + 1
        memory.require(e - s)
        return result

    for output in ("input", "new"):
        t = x.clone()
        out = adaptive.chunked(initial_step=step, dimension=dim, output=output,
                               cache=adaptive.NoBatchsizeCache)(step_fn)(t)
        assert torch.equal(out, x * 2 + 1)


def test_objects_of_a_failed_generator_or_coroutine_attempt_are_gone_before_the_retry() -> None:
    import asyncio

    class Activation:
        pass

    refs: list[weakref.ref] = []
    alive_at_retry: list[bool] = []

    def attempt(batchsize: int) -> None:
        alive_at_retry.extend(r() is not None for r in refs)
        activation = Activation()
        refs.append(weakref.ref(activation))
        if batchsize > 1:
            raise make_oom("cpu")

    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    def items(batchsize: int):
        attempt(batchsize)
        yield batchsize

    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    async def infer(batchsize: int) -> int:
        attempt(batchsize)
        return batchsize

    assert list(items()) == [1]
    assert alive_at_retry == [False, False, False]  # 3 earlier objects, each dead at its retry
    refs.clear()
    alive_at_retry.clear()
    assert asyncio.run(infer()) == 1
    assert alive_at_retry == [False, False, False]


def test_a_retry_inside_an_except_block_leaves_the_handled_exception_its_traceback() -> None:
    # A failed attempt's frames are dropped (they hold its tensors), but the walk down the
    # exception chain stops at the exception the caller is handling: its traceback stays
    # for logging.exception and a bare raise.
    import sys
    import traceback

    ceiling = MemoryCeiling(4)

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def fallback(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    def fast_path() -> None:
        raise ValueError("fast path failed")

    try:
        fast_path()
    except ValueError as handled:
        assert fallback() == 4 and ceiling.failures == [8]
        assert handled.__traceback__ is not None and sys.exc_info()[2] is not None
        names = [f.name for f in traceback.extract_tb(handled.__traceback__)]
        assert names[-1] == "fast_path"


def test_a_failed_attempt_leaves_no_frame_that_holds_its_tensors() -> None:
    # The attempt's own chain (an error the function handled, then an OOM) is dropped.
    ceiling = MemoryCeiling(4)
    kept: list[weakref.ref] = []

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def step(batchsize: int) -> int:
        big = torch.zeros(batchsize, 1024)
        kept.append(weakref.ref(big))
        try:
            raise KeyError("inner")
        except KeyError:
            ceiling.require(batchsize)
        return batchsize

    assert step() == 4
    gc.collect()
    assert kept[0]() is None, "the failed attempt's tensor is still alive"


def _raised_from_the_original(layer: Callable[[int], None],
                              error: type[torch.OutOfMemoryError]) -> Callable[[int], int]:
    """A forward that runs ``layer`` and, when it runs out of memory, handles another error
    and raises ``error`` from the original: linked through __cause__ alone."""
    def forward(batchsize: int) -> int:
        try:
            layer(batchsize)
            return batchsize
        except torch.OutOfMemoryError as oom:
            saved = oom
        try:
            raise ValueError("cleanup failed")
        except ValueError:
            raise error("layer ran out") from saved

    return forward


def test_an_oom_raised_from_the_original_frees_the_original_attempts_memory() -> None:
    # An OOM re-raised ``from`` the original while another error is handled links the
    # original through __cause__ alone (its __context__ is the other error): its frames, and
    # the first attempt's tensors in them, are gone before the retry, though the first
    # failure itself is kept for the whole retry loop.
    class LayerOOM(torch.OutOfMemoryError):
        pass

    ceiling = MemoryCeiling(4)
    refs: list[weakref.ref] = []
    alive_at_retry: list[bool] = []

    def layer(batchsize: int) -> None:
        alive_at_retry.extend(r() is not None for r in refs)
        activation = torch.zeros(batchsize, 1024)
        refs.append(weakref.ref(activation))
        ceiling.require(batchsize)

    forward = adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)(
        _raised_from_the_original(layer, LayerOOM))
    assert forward() == 4
    assert alive_at_retry == [False, False, False]  # at 8: 16's; at 4: 16's and 8's


def test_a_simulated_device_retry_fits_once_an_oom_chained_by_cause_is_dropped() -> None:
    from adaptmem.testing import simulated_cuda

    mib = 1 << 20

    class LayerOOM(torch.OutOfMemoryError):
        pass

    def layer(batchsize: int) -> None:
        activation = torch.empty(batchsize * 10 * mib // 4, device="cuda")  # noqa: F841
        more = torch.empty(batchsize * 10 * mib // 4, device="cuda")  # noqa: F841

    forward = _raised_from_the_original(layer, LayerOOM)
    with simulated_cuda(total_memory="100MiB"):
        # 8 needs 160 MiB; 4 needs 80 MiB, which fits once 8's first 80 MiB are gone.
        assert adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)(forward)() == 4


@pytest.mark.parametrize("form", ["partial", "callable object"])
def test_the_size_cache_does_not_keep_a_decorated_callable_and_its_model_alive(
    form: str,
) -> None:
    # The cache keys a callable by its code; a partial or an object holding a model is not
    # kept once the caller drops it.
    import functools

    class Scorer:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def __call__(self, batchsize: int, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.model(c) for c in x.split(batchsize)])

    def score(batchsize: int, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([model(c) for c in x.split(batchsize)])

    alive = []
    for _ in range(3):
        model = torch.nn.Linear(4, 4)
        alive.append(weakref.ref(model))
        fn: Any = (functools.partial(score, model=model) if form == "partial"
                   else Scorer(model))
        decorated = adaptive.batch(initial_batchsize=8)(fn)
        decorated(x=torch.ones(16, 4))
        del model, fn, decorated
    gc.collect()
    assert [ref() for ref in alive] == [None, None, None]


def test_a_range_that_gives_up_partway_says_where_it_stopped() -> None:
    ceilings = iter([8] * 5 + [2] * 100)  # fits 8 for five steps, then less than min_step

    @adaptive.range(initial_step=8, min_step=4, cache=adaptive.NoBatchsizeCache)
    def fill(start: int, end: int) -> None:
        if end - start > next(ceilings):
            raise make_oom("cpu")

    with pytest.raises(OutOfMemoryError, match=r"smallest step, 4.*It stopped at 40 of "
                                               r"\[0, 100\): the steps before it had run"):
        fill(0, 100)


def test_callable_objects_of_different_classes_keep_sizes_apart() -> None:
    # Every nn.Module shares one __call__: the key is the class with its __call__'s code.
    from adaptmem._execution.keys import function_key

    a, b, c = torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(3, 3)
    assert function_key(a) != function_key(b)
    assert function_key(a) == function_key(c)  # one class: one record, like closures


@pytest.mark.parametrize("capacity", ["100", None, True])
def test_a_memory_ceiling_refuses_a_capacity_that_is_not_a_number(capacity: object) -> None:
    with pytest.raises(TypeError, match="capacity must be a number of units"):
        MemoryCeiling(capacity)  # type: ignore[arg-type]


def test_a_retry_refuses_an_iterator_the_failed_attempt_consumed() -> None:
    ceiling = MemoryCeiling(4)

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def total(batchsize: int, items: Any) -> int:
        out, buf = 0, []
        for x in items:
            buf.append(x)
            if len(buf) == batchsize:
                ceiling.require(batchsize)
                out, buf = out + sum(buf), []
        return out + sum(buf)

    assert total(list(range(20))) == 190
    with pytest.raises(TypeError, match="argument 1 is an iterator.*Pass a list"):
        total(x for x in range(20))


def test_a_retry_refuses_an_iterator_held_inside_an_argument() -> None:
    # Only the arguments themselves were looked at: an iterator in a dict, a list or an
    # object's attribute was retried partly consumed, and 4 or 7 items of 20 came back.
    class Sources:
        def __init__(self, stream: Any) -> None:
            self.stream = stream
            self._cursor = iter(())  # the object's own state: not what the function reads
            self.ids = itertools.count()  # a counter: nothing a retry would miss

    def first_stream(sources: Any) -> Any:
        if isinstance(sources, dict):
            return sources["stream"]
        return sources[0] if isinstance(sources, list) else sources.stream

    ceiling = MemoryCeiling(4)

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    def consume(batchsize: int, sources: Any) -> list[int]:
        got, buf = [], []
        for v in first_stream(sources):
            buf.append(v)
            if len(buf) == batchsize:
                ceiling.require(batchsize)
                got, buf = got + buf, []
        ceiling.require(len(buf))
        return got + buf

    for wrap, where in [(lambda g: {"stream": g}, r"argument 1\['stream'\]"),
                        (lambda g: [g], r"argument 1\[0\]"), (Sources, "argument 1.stream")]:
        with pytest.raises(TypeError, match=f"its {where} is an iterator.*Pass a list"):
            consume(wrap(x for x in range(20)))
        assert consume(wrap(list(range(20)))) == list(range(20))


def test_a_range_or_chunked_step_run_again_refuses_an_iterator_its_failed_attempt_consumed(
) -> None:
    # Steps share the arguments after the bounds: one that succeeds may consume an iterator
    # (each step takes the next items), but a failed step's retry would miss what it took.
    ceiling = MemoryCeiling(4)

    @adaptive.range(initial_step=8, cache=adaptive.NoBatchsizeCache)
    def take(start: int, end: int, items: Any) -> list[int]:
        got = [next(items) for _ in range(end - start)]
        ceiling.require(end - start)
        return got

    @adaptive.chunked(initial_step=8, output="new", cache=adaptive.NoBatchsizeCache)
    def add(chunk: torch.Tensor, start: int, end: int, items: Any) -> torch.Tensor:
        got = torch.tensor([float(next(items)) for _ in range(end - start)])
        ceiling.require(end - start)
        return chunk + got

    # A list passes (each step indexes it itself in real code; here it is never read).
    with pytest.raises(TypeError, match=r"take ran out of memory and must be called again on "
                                        r"\[0, 4\), but its argument 3 is an iterator"):
        take(0, 10, iter(range(100)))
    with pytest.raises(TypeError, match=r"add ran out of memory .* on \[0, 4\), but its "
                                        r"argument 2 is an iterator.*Pass a list"):
        add(torch.zeros(10), iter(range(100)))
    # Steps that all fit may consume it as they go: no retry, nothing refused.
    @adaptive.range(initial_step=4, cache=adaptive.NoBatchsizeCache)
    def take_in_fours(start: int, end: int, items: Any) -> list[int]:
        got = [next(items) for _ in range(end - start)]
        ceiling.require(end - start)
        return got

    assert take_in_fours(0, 10, iter(range(100))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("kind", ["range", "chunked"])
def test_a_range_or_chunked_retry_after_an_argument_changed_in_place_is_logged(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    ceiling = MemoryCeiling(4)
    if kind == "range":
        @adaptive.range(initial_step=8, cache=adaptive.NoBatchsizeCache)
        def run(start: int, end: int, x: torch.Tensor, out: torch.Tensor) -> None:
            x.div_(2)
            ceiling.require(end - start)
            out[start:end] = x[start:end]

        call = lambda: run(0, 8, torch.ones(8), torch.zeros(8))  # noqa: E731
    else:
        @adaptive.chunked(initial_step=8, output="new", cache=adaptive.NoBatchsizeCache)
        def run(chunk: torch.Tensor, start: int, end: int, x: torch.Tensor) -> torch.Tensor:
            x.div_(2)
            ceiling.require(end - start)
            return chunk + x[start:end]

        call = lambda: run(torch.zeros(8), torch.ones(8))  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        call()
        call()
    warned = [r.getMessage() for r in caplog.records if "in place" in r.getMessage()]
    position = "argument 3" if kind == "range" else "argument 2"
    assert len(warned) == 1 and position in warned[0] and "retry on [0, 4)" in warned[0]


def test_a_range_filling_an_output_after_its_work_warns_of_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    ceiling = MemoryCeiling(4)

    @adaptive.range(initial_step=8, cache=adaptive.NoBatchsizeCache)
    def fill(start: int, end: int, x: torch.Tensor, out: torch.Tensor) -> None:
        y = x[start:end] * 2
        ceiling.require(end - start)
        out[start:end] = y  # written only once the step's work fitted

    out = torch.zeros(10)
    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        fill(0, 10, torch.arange(10.0), out)
    assert torch.equal(out, torch.arange(10.0) * 2)
    assert not [r for r in caplog.records if "in place" in r.getMessage()]


def test_a_retry_after_an_argument_changed_in_place_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    ceiling = MemoryCeiling(4)

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def normalised_sum(batchsize: int, x: torch.Tensor) -> torch.Tensor:
        x.div_(2)
        return sum(ceiling.require(len(c)) or c.sum() for c in x.split(batchsize))

    with caplog.at_level(logging.WARNING, logger="adaptmem"):
        normalised_sum(torch.ones(8))
        normalised_sum(torch.ones(8))
    warned = [r.getMessage() for r in caplog.records if "in place" in r.getMessage()]
    assert len(warned) == 1 and "argument 1" in warned[0] and "clone" in warned[0]


def test_a_retry_passes_a_file_argument_on() -> None:
    # Files are iterators too, but one given to write into is not consumed by an attempt.
    import io

    ceiling = MemoryCeiling(16)

    @adaptive.batch(initial_batchsize=64, cache=adaptive.NoBatchsizeCache)
    def process(batchsize: int, data: torch.Tensor, log: io.StringIO) -> torch.Tensor:
        log.write(f"trying {batchsize}\n")
        ceiling.require(batchsize)
        return data * 2

    log = io.StringIO()
    assert torch.equal(process(torch.ones(4), log), torch.full((4,), 2.0))
    assert log.getvalue().split("\n")[:3] == ["trying 64", "trying 32", "trying 16"]


def test_a_partial_is_named_by_its_function_never_by_the_repr_of_its_arguments(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A partial has no __qualname__: its repr (a whole model, a tensor's values) went into
    # every log line, error and stats name, and explicit.* built it at every call.
    import functools

    class Model:
        reprs = 0

        def __repr__(self) -> str:
            Model.reprs += 1
            return "Model(" + "layer, " * 10_000 + ")"

    ceiling = MemoryCeiling(2)

    def score(batchsize: int, model: Model) -> int:
        ceiling.require(batchsize)
        return batchsize

    fn = functools.partial(score, model=Model())
    name = f"partial({score.__qualname__})"
    decorated = adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)(fn)
    with caplog.at_level(logging.INFO, logger="adaptmem"):
        assert decorated() == 2
        assert adaptive.explicit.batch(fn, 4) == 2
    assert decorated.stats.name == name
    assert all(r.getMessage().startswith(name) for r in caplog.records), caplog.text
    with pytest.raises(OutOfMemoryError, match=r"^partial\(.*score\) ran out of memory"):
        adaptive.batch(initial_batchsize=8, min_batchsize=8)(fn)()
    assert Model.reprs == 0


class _Chunks:
    """An iterator class of one's own, doing its work as it is read."""

    def __init__(self, work: Any, chunks: list[list[int]]) -> None:
        self.work, self.chunks = work, iter(chunks)

    def __iter__(self) -> _Chunks:
        return self

    def __next__(self) -> int:
        return self.work(next(self.chunks))


@pytest.mark.parametrize("form", ["map", "filter", "own class"])
def test_a_returned_iterator_is_retried_until_its_first_item_like_a_generator(
    form: str,
) -> None:
    # map(work, chunks) is (work(c) for c in chunks) by another name: it was recorded as
    # fitting at once, and its out-of-memory error reached the caller raw, never retried.
    ceiling = MemoryCeiling(4)

    def work(chunk: list[int]) -> int:
        ceiling.require(len(chunk))
        return len(chunk)

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    def sizes(batchsize: int, data: list[int]) -> Any:
        chunks = [data[i:i + batchsize] for i in range(0, len(data), batchsize)]
        if form == "map":
            return map(work, chunks)
        if form == "filter":
            return filter(None, map(work, chunks))
        return _Chunks(work, chunks)

    assert list(sizes(list(range(18)))) == [4, 4, 4, 4, 2]
    assert ceiling.failures == [16, 8]
    assert sizes.stats.failed_attempts == 2


def test_a_returned_file_is_the_result_itself_not_work_to_retry() -> None:
    import io

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    def report(batchsize: int) -> io.StringIO:
        return io.StringIO(f"{batchsize}\n")

    out = report()
    assert isinstance(out, io.StringIO) and out.read() == "16\n"


def test_a_range_step_that_returns_an_iterator_is_refused() -> None:
    @adaptive.range(initial_step=4, cache=adaptive.NoBatchsizeCache)
    def fill(start: int, end: int) -> Any:
        return map(float, range(start, end))

    with pytest.raises(TypeError, match=r"returned a map.*Return a list"):
        fill(0, 8)


def test_toma_style_positional_sizes_in_the_execute_forms_say_which_keyword_to_write() -> None:
    for call, written in [
            (lambda: adaptive.execute.batch(64), "adaptive.execute.batch(initial_batchsize=64)"),
            (lambda: adaptive.execute.range(0, 100, 64),
             "adaptive.execute.range(0, 100, initial_step=64)"),
            (lambda: adaptive.execute.chunked(torch.ones(10), 64),
             "adaptive.execute.chunked(tensor, initial_step=64)"),
            (lambda: adaptive.execute.batch(print, 64),  # explicit's order
             "adaptive.explicit.batch(fn, ...) to pass the function first")]:
        with pytest.raises(TypeError, match=re.escape(written)):
            call()


@pytest.mark.parametrize("kind", ["batch", "range", "chunked", "batch, model="])
def test_a_keyword_named_self_reaches_the_function(kind: str) -> None:
    """toma's and accelerate's wrappers pass ``**kwargs`` on whatever their names."""
    got = []
    if kind.startswith("batch"):
        options = {"model": nn.Linear(2, 2).eval()} if "model" in kind else {}

        @adaptive.batch(initial_batchsize=4, **options)
        def work(batchsize: int, self: Any = None) -> None:
            got.append(self)

        work(self="x")
    elif kind == "range":
        adaptive.range(initial_step=4)(lambda start, end, self=None: got.append(self))(
            0, 8, self="x")
    else:
        adaptive.chunked(initial_step=4)(lambda c, s, e, self=None: got.append(self))(
            torch.zeros(8), self="x")
    assert got and set(got) == {"x"}


def test_the_call_forms_can_be_patched_in_a_users_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    # as they could while they were namespaces: a user's test stubs a form out
    monkeypatch.setattr(adaptive.execute, "batch", lambda **options: lambda fn: fn(2))
    assert adaptive.execute.batch(initial_batchsize=64)(lambda size: size * 10) == 20
    monkeypatch.undo()
    assert adaptive.execute.batch(initial_batchsize=64)(lambda size: size * 10) == 640
