"""``adaptive.memory_stats()`` shows every live source of statistics without being told."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adaptmem import adaptive
from adaptmem._common.reporting import report


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _sections(prefix: str) -> list[str]:
    return [name for name in adaptive.memory_stats() if name.split()[0].startswith(prefix)]


def test_a_pager_a_chunker_and_a_load_appear_while_they_live(tmp_path: Path) -> None:
    gc.collect()  # sources other tests left are numbered first: see what is new
    before = {p: _sections(p) for p in ("pager", "chunker", "load")}
    checkpoint = tmp_path / "weights.pt"
    torch.save(_model().state_dict(), checkpoint)

    paged = _model()
    pager = adaptive.page(paged, "cpu", resident_bytes=0)
    paged(torch.randn(2, 16))
    chunked = _model()
    chunker = adaptive.chunk(chunked, "cpu", capacity="1KiB", dtype=torch.bfloat16)
    chunked(torch.randn(2, 16))
    loaded = adaptive.load(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)),
                           checkpoint)

    stats = adaptive.memory_stats()  # nothing passed
    new = {p: [n for n in _sections(p) if n not in before[p]] for p in before}
    [paged_at], [chunked_at], [loaded_at] = new["pager"], new["chunker"], new["load"]
    assert paged_at.endswith(" (Sequential)") and chunked_at.endswith(" (Sequential)")
    assert loaded_at.startswith("load") and loaded_at.endswith(" (weights.pt)")
    assert stats[paged_at] == pager.stats.as_dict()
    assert stats[paged_at]["forwards"] == 1
    assert stats[chunked_at] == chunker.stats.as_dict()
    assert stats[loaded_at]["tensors"] == 4
    # The section shows the live counters: a later forward counts in a later snapshot.
    paged(torch.randn(2, 16))
    assert adaptive.memory_stats()[paged_at]["forwards"] == 2

    text = str(stats)
    assert f"  {paged_at}:\n" in text and "    forwards" in text
    assert f"  {loaded_at}:\n" in text and "bytes_read" in text and "KiB" in text
    assert "      cpu                  1.3 KiB" in text  # the load's 1360 bytes by device

    pager.remove()
    chunker.remove()
    del pager, chunker, loaded, paged, chunked
    gc.collect()
    after = adaptive.memory_stats()
    assert {p: _sections(p) for p in ("pager", "chunker", "load")} == before
    assert not any(n in after for names in new.values() for n in names)


def test_sources_of_the_same_kind_are_numbered_and_any_as_dict_source_is_shown() -> None:
    gc.collect()
    first, second = _model(), _model()
    with adaptive.page(first, "cpu", resident_bytes=0) as a, \
            adaptive.page(second, "cpu", resident_bytes=0) as b:
        names = [n for n in adaptive.memory_stats() if n.startswith("pager")]
        stats = adaptive.memory_stats()
        assert names[-1].startswith("pager#") and names[-1].endswith(" (Sequential)")
        assert stats[names[-2]] == a.stats.as_dict() and stats[names[-1]] == b.stats.as_dict()

    class Figures:
        def as_dict(self) -> dict[str, Any]:
            return {"attempts": 3, "sizes": [64, 32, 16], "seconds_lost": 0.25}

    class Owner:
        pass

    owner, figures = Owner(), Figures()
    report(owner, "batch train_step", figures)
    stats = adaptive.memory_stats()
    assert stats["batch train_step"] == figures.as_dict()
    assert "    seconds_lost           0.250" in str(stats)
    del owner
    gc.collect()
    assert "batch train_step" not in adaptive.memory_stats()


def test_a_spill_handle_is_shown_once_passed_or_not(tmp_path: Path) -> None:
    handle = adaptive.spill(threshold=0, limit=0, to=tmp_path)
    with handle:
        x = torch.randn(32, 32, requires_grad=True)
        torch.tanh(torch.tanh(x)).sum().backward()
    plain = [n for n in adaptive.memory_stats() if n.startswith("spill handle")]
    passed = adaptive.memory_stats(handle)
    assert [n for n in passed if n.startswith("spill handle")] == plain
    assert any(passed[n] == handle.stats.as_dict() for n in plain)
    assert handle.stats.tensors_spilled > 0


def test_decorated_functions_never_called_are_left_out() -> None:
    @adaptive.batch(initial_batchsize=4)
    def idle(batchsize: int) -> int:
        return batchsize

    @adaptive.batch(initial_batchsize=4)
    def busy(batchsize: int) -> int:
        return batchsize

    busy()
    names = list(adaptive.memory_stats())
    assert f"batch {busy.__qualname__}" in names
    assert f"batch {idle.__qualname__}" not in names
