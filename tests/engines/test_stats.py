"""Engine statistics are plain values: they pickle (returned from a worker process),
deep-copy and go through ``dataclasses.asdict``, keeping every figure."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from adaptmem import adaptive

_X = torch.randn(2, 8)

ENGINES: dict[str, Callable[[nn.Module], Any]] = {
    "page": lambda m: adaptive.page(m, "cpu", unit_bytes=0, resident_bytes=0),
    "chunk": lambda m: adaptive.chunk(m, "cpu", capacity=400, dtype=torch.bfloat16),
    "split": lambda m: adaptive.split(m, {"cpu": None}),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("copier", ["pickle", "deepcopy", "asdict"])
def test_engine_stats_pickle_deep_copy_and_go_through_asdict_keeping_their_figures(
        engine: str, copier: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    with ENGINES[engine](model) as handle, torch.no_grad():
        model(_X)
        model(_X)
        stats = handle.stats
        figures = stats.as_dict()
        assert figures["forwards"] == 2
        if copier == "asdict":
            assert dataclasses.asdict(stats) == figures
            return
        copied = (pickle.loads(pickle.dumps(stats)) if copier == "pickle"
                  else copy.deepcopy(stats))
        assert type(copied) is type(stats) and copied == stats
        assert copied.as_dict() == figures
        copied.forwards += 1  # a copy counts apart from the original
        assert stats.forwards == 2
        assert str(copied).startswith(type(stats).__name__)
