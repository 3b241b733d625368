"""Shared fixtures and the one marker factory for hardware needs."""

from __future__ import annotations

import logging

import pytest
import torch


def run_if(*, cuda: bool = False, min_gpus: int = 1) -> pytest.MarkDecorator:
    """Skip unless the hardware is there, saying why (one place for hardware needs)."""
    reasons = []
    if cuda and not torch.cuda.is_available():
        reasons.append("needs CUDA; none is available on this machine")
    elif cuda and torch.cuda.device_count() < min_gpus:
        reasons.append(f"needs {min_gpus} CUDA devices, found {torch.cuda.device_count()}")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "hardware present")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="gpu test: needs CUDA; none is available on this machine")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture
def adaptmem_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="adaptmem")
    return caplog
