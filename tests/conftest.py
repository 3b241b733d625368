"""Shared fixtures and the one marker factory for hardware needs.

Tests marked ``gpu`` run on the real CUDA device when there is one, else on the simulated
one (``adaptmem.testing.simulated_cuda``, two devices of 16 GiB; a ``simulated_cuda`` marker
changes that), so none is skipped for lack of a GPU.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest
import torch

from adaptmem.testing import simulated_cuda
from adaptmem.testing_plugin import pytest_configure as _plugin_configure
from adaptmem.testing_plugin import simulated_cuda_device  # noqa: F401 - a fixture

REAL_CUDA = torch.cuda.is_available()
SIMULATED_DEVICES = 2


def run_if(*, cuda: bool = False, min_gpus: int = 1) -> pytest.MarkDecorator:
    """Skip unless the hardware is there, saying why (one place for hardware needs). Without
    a real GPU, a CUDA test runs on the simulated device instead (marked ``gpu``)."""
    if cuda and not REAL_CUDA and min_gpus <= SIMULATED_DEVICES:
        return pytest.mark.gpu
    reasons = []
    if cuda and not REAL_CUDA:
        reasons.append(f"needs {min_gpus} CUDA devices; the simulation has {SIMULATED_DEVICES}")
    elif cuda and torch.cuda.device_count() < min_gpus:
        reasons.append(f"needs {min_gpus} CUDA devices, found {torch.cuda.device_count()}")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "hardware present")


def pytest_configure(config: pytest.Config) -> None:
    _plugin_configure(config)


@pytest.fixture(autouse=True)
def _gpu_on_the_simulation(request: pytest.FixtureRequest) -> Iterator[None]:
    if REAL_CUDA or request.node.get_closest_marker("gpu") is None:
        yield
        return
    marker = request.node.get_closest_marker("simulated_cuda")
    args, kwargs = (marker.args, marker.kwargs) if marker is not None else ((), {})
    # Positional options (devices, total_memory) as simulated_cuda takes them.
    options = {"devices": SIMULATED_DEVICES, "total_memory": "16GiB",
               **dict(zip(("devices", "total_memory", "bandwidth"), args, strict=False)),
               **kwargs}
    with simulated_cuda(**options):
        yield


@pytest.fixture
def adaptmem_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="adaptmem")
    return caplog


def pytest_collection_finish(session: pytest.Session) -> None:
    # Every out-of-memory retry runs a full garbage collection (free_caches), which walks
    # every object the process holds: here torch, hypothesis and every collected test, about
    # 100 ms a collection. What exists once collection is done lives until the run ends, so
    # it is moved out of the collector's reach (gc.freeze); objects the tests make are
    # collected as before. This took the retry-heavy tests' time down by about half.
    gc.collect()
    gc.freeze()
