from __future__ import annotations

import pytest
import torch
from torch import nn

from adaptmem import adaptive
from adaptmem._common.devices import memory_info, parse_size

GIB = 2**30


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, *, free: int, total: int, reserved: int,
               allocated: int, fraction: float) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device=None: fraction)


def test_cuda_free_memory_counts_the_allocators_cached_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, free=60 * GIB, total=80 * GIB, reserved=2 * GIB, allocated=GIB,
               fraction=1.0)
    assert memory_info(torch.device("cuda", 0)) == (61 * GIB, 80 * GIB)


def test_cuda_free_memory_stays_within_the_per_process_memory_fraction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A quarter of an 80 GiB card is 20 GiB, 2 GiB of it already reserved (1 GiB in use):
    # 18 GiB more can be reserved, plus the 1 GiB cached, though the card has 60 GiB free.
    _fake_cuda(monkeypatch, free=60 * GIB, total=80 * GIB, reserved=2 * GIB, allocated=GIB,
               fraction=0.25)
    assert memory_info(torch.device("cuda", 0)) == (19 * GIB, 80 * GIB)
    _fake_cuda(monkeypatch, free=60 * GIB, total=80 * GIB, reserved=30 * GIB, allocated=GIB,
               fraction=0.25)  # set below what is already reserved: only the cache is free
    assert memory_info(torch.device("cuda", 0)) == (29 * GIB, 80 * GIB)


@pytest.mark.gpu
def test_gpu_auto_paging_plans_within_a_memory_fraction() -> None:
    torch.manual_seed(0)
    # 32 x 4 MiB: with 128 MiB free the pager may take half for weights (see [Note:
    # headroom]), a working set of 8 MiB units and the rest resident
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(32)]).eval()
    x = torch.randn(4, 1024)
    expected = model(x)
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    allowed = torch.cuda.memory_reserved() + 128 * 2**20
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        free = memory_info(torch.device("cuda", torch.cuda.current_device()))[0]
        assert free <= 128 * 2**20 + 2 * 2**20  # allocator rounding
        with adaptive.page(model, "cuda") as pager:  # every size "auto"
            with torch.no_grad():
                out = model(x)
                out = model(x)
        placements = {u.placement for u in pager.plan.units}
        assert placements == {"resident", "paged"}  # some fit for good, the rest is paged
        assert pager.stats.peak_device_bytes <= 128 * 2**20
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("device", [None, "mps"])
def test_retries_empty_the_cache_of_an_mps_device_also_when_the_device_is_not_named(
    device: str | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # device=None (a function whose device is not known): every available accelerator's
    # cache is emptied between attempts, not CUDA's alone.
    from adaptmem import adaptive
    from adaptmem.testing import MemoryCeiling

    calls: list[str] = []
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: calls.append("mps"))
    ceiling = MemoryCeiling(4)

    @adaptive.batch(initial_batchsize=8, device=device, cache=adaptive.NoBatchsizeCache)
    def run(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    assert run() == 4
    assert calls == ["mps"]


@pytest.mark.parametrize("value", [2.5, 0.5, 1023.9, "2.5", "0.5B"])
def test_a_size_of_a_fraction_of_a_kib_is_refused_as_a_missing_unit(value: object) -> None:
    shown = str(value).removesuffix("B")
    with pytest.raises(ValueError, match=rf"capacity={value!r}: sizes are bytes.*'{shown}GiB'"):
        parse_size(value, "capacity")
    with pytest.raises(ValueError, match="sizes are bytes"):
        adaptive.plan(torch.nn.Linear(4, 4), devices={"cuda:0": value, "cpu": None})


def test_whole_and_computed_byte_counts_are_sizes() -> None:
    assert parse_size(2.0) == 2 and parse_size(2e9) == 2_000_000_000
    assert parse_size(0.8 * 3_000_000) == 2_400_000  # 0.8 * free, rounded down
    assert parse_size("2.5GiB") == int(2.5 * 2**30) and parse_size(0) == 0
    assert parse_size("0.5KiB") == 512 and parse_size("1500.5") == 1500
