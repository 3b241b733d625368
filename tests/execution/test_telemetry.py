"""What a decorated function tells its user: ``.stats``, ``on_adapt`` and ``progress=True``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import hold_cached_blocks

from adaptmem import adaptive
from adaptmem._common.reporting import live_reports
from adaptmem._execution import progress as progress_module
from adaptmem.testing import MemoryCeiling


def test_stats_count_calls_attempts_failures_and_sizes() -> None:
    ceiling = MemoryCeiling(20)

    @adaptive.batch(initial_batchsize=64, cache=adaptive.GlobalBatchsizeCache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    assert infer() == 16  # 64, 32 fail
    stats = infer.stats
    assert (stats.calls, stats.attempts, stats.failed_attempts, stats.retries) == (1, 3, 2, 2)
    assert stats.seconds_lost > 0 and stats.untimed_failures == 0
    assert (stats.last_size, stats.smallest_size, stats.largest_size) == (16, 16, 16)
    for _ in range(5):
        infer()  # climbs by bisection: 24 fails, 20 fits, then settles
    assert stats.calls == 6
    assert stats.largest_size == 20 and stats.last_size == 20
    assert stats.attempts == stats.calls + stats.retries
    text = str(stats)
    assert text.startswith("batch ") and "6 calls" in text and "batchsize last 20" in text
    assert stats.as_dict()["failed_attempts"] == stats.failed_attempts
    stats.reset()
    assert stats.as_dict()["calls"] == 0 and stats.last_size is None


def test_a_decorated_method_shows_its_stats_through_an_instance() -> None:
    class Model:
        @adaptive.batch(initial_batchsize=4)
        def infer(self, batchsize: int) -> int:
            return batchsize

    model = Model()
    model.infer()
    assert model.infer.stats is Model.infer.stats and model.infer.stats.calls == 1


def test_a_failure_at_a_size_that_fitted_before_is_counted_untimed() -> None:
    ceiling = MemoryCeiling(64)

    @adaptive.batch(initial_batchsize=32, cache=adaptive.GlobalBatchsizeCache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    infer()
    ceiling.capacity = 8  # memory got tighter at a settled size
    assert infer() <= 8
    stats = infer.stats
    # Only the first failure, at the size that had fitted, was not timed.
    assert stats.failed_attempts >= 2 and stats.untimed_failures == 1
    assert stats.attempts == stats.failed_attempts + 2


def test_range_stats_count_every_step() -> None:
    ceiling = MemoryCeiling(4)

    @adaptive.range(initial_step=8, cache=adaptive.NoBatchsizeCache)
    def fill(start: int, end: int) -> int:
        ceiling.require(end - start)
        return end - start

    assert fill(0, 10) == [4, 4, 2]
    stats = fill.stats
    assert (stats.calls, stats.attempts, stats.failed_attempts, stats.retries) == (1, 4, 1, 1)
    assert (stats.smallest_size, stats.largest_size) == (4, 4)  # not the 2 left at the end
    fill(0, 0)  # an empty range makes no attempt
    assert (stats.calls, stats.attempts) == (2, 4)


def test_a_generator_counts_its_failed_attempts_and_reports_them() -> None:
    ceiling = MemoryCeiling(8)
    events: list[adaptive.Adaptation] = []

    @adaptive.batch(initial_batchsize=32, cache=adaptive.GlobalBatchsizeCache,
                    on_adapt=events.append)
    def stream(batchsize: int) -> Any:
        ceiling.require(batchsize)
        yield batchsize

    assert list(stream()) == [8]
    stats = stream.stats
    assert (stats.calls, stats.attempts, stats.failed_attempts, stats.retries) == (1, 3, 2, 2)
    assert stats.last_size == 8
    assert [e.kind for e in events] == ["shrink", "shrink", "fits"]


def test_stats_are_registered_for_memory_stats() -> None:
    @adaptive.chunked(initial_step=4)
    def double(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk.mul_(2)

    double(torch.ones(6))
    sections = {section: stats for section, stats in live_reports()}
    name = f"chunked {double.__qualname__}"
    assert sections[name] is double.stats
    assert sections[name].as_dict()["calls"] == 1
    # Passed to memory_stats as an engine: taken (shown once), not refused.
    assert adaptive.memory_stats(double)[name]["calls"] == 1


def test_on_adapt_reports_shrink_fits_probe_and_gave_up() -> None:
    ceiling = MemoryCeiling(20)
    events: list[adaptive.Adaptation] = []

    @adaptive.batch(initial_batchsize=64, cache=adaptive.GlobalBatchsizeCache,
                    on_adapt=events.append)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    infer()
    assert [(e.kind, e.old_size, e.new_size) for e in events] == [
        ("shrink", 64, 32), ("shrink", 32, 16), ("fits", 64, 16)]
    assert all(e.function == infer.__qualname__ and e.rank is None for e in events)
    assert all(e.free_bytes is None or e.free_bytes >= 0 for e in events)
    events.clear()
    infer()
    assert events[0].kind == "probe" and events[0].old_size == 16 and events[0].new_size > 16
    ceiling.capacity = 0
    events.clear()
    with pytest.raises(adaptive.OutOfMemoryError):
        infer()
    assert events[-1].kind == "gave_up" and events[-1].old_size == 1
    assert events[-1].new_size is None


@pytest.mark.gpu
def test_a_call_that_starts_at_another_size_as_free_memory_moves_is_reported() -> None:
    # Free memory fell (another tensor held), then grew back: the calls started at another
    # size each time with no failure and no probe, and nothing said so.
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0)
    weights = torch.randn(64, 4096, device="cuda")
    data = torch.randn(4000, 64, device="cuda")
    # On a real GPU, cuBLAS takes its workspace (32 MiB on an H200) at the first product, and
    # earlier tests leave blocks cached: both before the fraction, 64 MiB above them.
    (data[:1] @ weights).sum().item()
    cached = hold_cached_blocks()
    torch.cuda.set_per_process_memory_fraction(
        (torch.cuda.memory_reserved() + 64 * 2**20)
        / torch.cuda.get_device_properties(0).total_memory)
    events: list[adaptive.Adaptation] = []
    try:
        @adaptive.batch(initial_batchsize=1500, on_adapt=events.append, cache=cache)
        def run(batchsize: int, x: torch.Tensor) -> torch.Tensor:
            return sum((c @ weights).relu().sum() for c in x.split(batchsize))

        held = None
        for step in ("first", "held", "back"):  # one call site: calls from one line
            if step == "held":
                held = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
            elif step == "back":
                del held  # back where 1500 fitted
                events.clear()
            run(data)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del cached
    assert [e.kind for e in events] == ["moved"] and events[0].new_size == 1500
    assert events[0].old_size < 1500


def test_an_on_adapt_error_propagates_and_the_next_call_goes_on() -> None:
    ceiling = MemoryCeiling(16)
    fail = [True]

    def monitor(event: adaptive.Adaptation) -> None:
        if fail[0]:
            raise ConnectionError("monitoring is down")

    @adaptive.batch(initial_batchsize=64, cache=adaptive.GlobalBatchsizeCache,
                    on_adapt=monitor)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    with pytest.raises(ConnectionError, match="monitoring is down") as info:
        infer()
    assert any("on_adapt" in note for note in getattr(info.value, "__notes__", []))
    fail[0] = False
    assert infer() == 16  # the record learned 64 failed before the callback raised


def test_bad_on_adapt_and_progress_are_refused_at_decoration() -> None:
    with pytest.raises(TypeError, match="on_adapt"):
        adaptive.batch(initial_batchsize=8, on_adapt="print")
    with pytest.raises(TypeError, match="progress"):
        adaptive.range(initial_step=8, progress="yes")


def test_progress_shows_items_step_and_retries_with_tqdm(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    ceiling = MemoryCeiling(4)

    @adaptive.range(initial_step=8, cache=adaptive.NoBatchsizeCache, progress=True)
    def fill(start: int, end: int) -> None:
        ceiling.require(end - start)

    fill(0, 10)
    err = capsys.readouterr().err
    assert "10/10" in err and "step=4, retries=1" in err
    assert "fill" in err


def test_progress_goes_to_the_logger_without_tqdm(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress_module, "load_tqdm", lambda: None)
    ceiling = MemoryCeiling(3)

    @adaptive.chunked(initial_step=4, cache=adaptive.NoBatchsizeCache, progress=True)
    def double(chunk: torch.Tensor, start: int, end: int) -> None:
        ceiling.require(end - start)
        chunk.mul_(2)

    with caplog.at_level(logging.INFO, logger="adaptmem"):
        assert double(torch.ones(7)).sum().item() == 14
    lines = [r.getMessage() for r in caplog.records if "items" in r.getMessage()]
    # Rate-limited: nothing between steps within LOG_EVERY seconds, one line at the end.
    assert lines == [f"{double.__qualname__}: 7/7 items (100%), step=2, 1 retries"]
    assert capsys.readouterr().err == ""  # the library printed nothing itself


def test_progress_logs_again_after_log_every(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(progress_module, "load_tqdm", lambda: None)
    monkeypatch.setattr(progress_module, "LOG_EVERY", 0.0)

    @adaptive.range(initial_step=2, progress=True)
    def fill(start: int, end: int) -> Any:
        return None

    with caplog.at_level(logging.INFO, logger="adaptmem"):
        fill(0, 6)
    lines = [r.getMessage() for r in caplog.records if "items" in r.getMessage()]
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["2/6", "4/6", "6/6"]


def test_a_new_call_site_starting_from_the_initial_size_is_not_called_free_memory_moving(
        caplog: pytest.LogCaptureFixture) -> None:
    events: list[adaptive.Adaptation] = []
    ceiling = MemoryCeiling(16)

    @adaptive.batch(initial_batchsize=64, on_adapt=events.append)
    def run(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    assert run() == 16  # one call site: it searched down from 64
    events.clear()
    with caplog.at_level(logging.INFO, logger="adaptmem"):
        assert run() == 16  # another: it starts at 64 again, knowing nothing
    assert "moved" not in [e.kind for e in events]
    assert not any("free memory moved" in r.getMessage() for r in caplog.records)
