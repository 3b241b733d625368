"""Shared fixtures and the one marker factory for hardware needs.

Tests marked ``gpu`` run on the real CUDA device when there is one, else on the simulated
one (``adaptmem.testing.simulated_cuda``, two devices of 16 GiB; a ``simulated_cuda`` marker
changes that), so none is skipped for lack of a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from adaptmem import cpu_memory
from adaptmem._execution.cache import StacktraceMemoryBatchsizeCache, resolve_cache
from adaptmem.testing import simulated_cuda
from adaptmem.testing_plugin import pytest_configure as _plugin_configure
from adaptmem.testing_plugin import simulated_cuda_device  # noqa: F401 - a fixture

REAL_CUDA = torch.cuda.is_available()
SIMULATED_DEVICES = 2


def fake_control_groups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, membership: str,
                        files: dict[str, str]) -> None:
    """A fake /sys/fs/cgroup holding ``files`` (path under it: text), and a fake
    /proc/self/cgroup reading ``membership``; the memory limit's groups are found again."""
    root = tmp_path / "cgroup"
    root.mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self_cgroup").write_text(membership)
    monkeypatch.setattr(cpu_memory, "_CGROUP_ROOT", str(root))
    monkeypatch.setattr(cpu_memory, "_PROC_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(cpu_memory, "_groups", None)  # found again, restored afterwards


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


def tensors_on_cuda() -> int:
    """``torch.cuda.memory_allocated()`` without cuBLAS's workspaces: on a real GPU the first
    matrix product on a stream takes one (32 MiB on an H200) that stays allocated, so a
    test that checks everything was given back counts what it allocated, not them."""
    if REAL_CUDA:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
    return torch.cuda.memory_allocated()


@contextlib.contextmanager
def host_registrations() -> Iterator[list[tuple[str, int, int]]]:
    """Within the block, each ``cudaHostRegister`` and ``cudaHostUnregister`` made through
    ``torch.cuda.cudart()`` (the real runtime, or the simulated one inside a simulation),
    listed as it is made: ``("register", current device, bytes)`` or ``("unregister",
    current device, 0)``. ``cudaGetLastError`` passes through where torch's binding has
    it. Enter it inside a simulation, and leave it before the simulation ends."""
    real = torch.cuda.cudart()
    calls: list[tuple[str, int, int]] = []

    def register(ptr: int, size: int, flags: int) -> object:
        calls.append(("register", torch.cuda.current_device(), size))
        return real.cudaHostRegister(ptr, size, flags)

    def unregister(ptr: int) -> object:
        calls.append(("unregister", torch.cuda.current_device(), 0))
        return real.cudaHostUnregister(ptr)

    counting = types.SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister,
                                     cudaGetLastError=getattr(real, "cudaGetLastError", None))
    original = torch.cuda.cudart
    torch.cuda.cudart = lambda: counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        torch.cuda.cudart = original  # type: ignore[assignment]


def hold_cached_blocks() -> list[torch.Tensor]:
    """On a real GPU, tensors that take every free block the caching allocator keeps that
    could serve an allocation of 2 MiB or more (its large pool), so that a test's next such
    allocation needs new device memory, which a memory fraction set just above
    ``memory_reserved()`` then refuses (hold the list until the test ends; call this before
    setting the test's fraction, which it resets to 1.0). Without them, what earlier tests
    of the same process left cached serves the allocation, and the fraction refuses
    nothing. The simulated device starts each test empty: nothing to hold there."""
    if not REAL_CUDA:
        return []
    held: list[torch.Tensor] = []
    torch.cuda.empty_cache()
    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total, index)
    try:  # no new memory under this fraction: each success takes a cached block
        size = 1 << 30
        while size > 1 << 20:  # 1 MiB and less come from the small pool
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                size //= 2
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    return held


def pytest_configure(config: pytest.Config) -> None:
    _plugin_configure(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``ADAPTMEM_FAILURE_LOG`` set (``benchmarks/on_gpu.sh`` sets it), each failure is
    appended to that file when it happens, traceback included: a run that a lease's time
    limit cuts short keeps what failed before, where pytest prints its tracebacks only at
    the end. Written by the one process that reports (xdist's controller, not its workers)."""
    path = os.environ.get("ADAPTMEM_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


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


@pytest.fixture(autouse=True)
def _no_pinned_memory_left_kept() -> Iterator[None]:
    """A test that leaves registered pinned memory kept for reuse (a ``model=`` function
    removed while timing a chunked call kept its pagers' memory for good) fails: the next
    test would be handed memory registered with a simulation that has ended."""
    from adaptmem._common import pinning

    yield
    if pinning._kept:
        left = len(pinning._kept)
        pinning.release_kept()
        pytest.fail(f"{left} region(s) of registered pinned memory were left kept for reuse")


@pytest.fixture(autouse=True)
def _fresh_free_memory_reading() -> None:
    """The default cache reads free memory anew at each test's first call. It keeps a reading
    for half a second, across tests too: the test before's (its patched free memory, or the
    simulated device's) put a test's first record in another bucket than its later ones, so
    what a test learned depended on which test ran just before it."""
    cache = resolve_cache(None)
    if isinstance(cache, StacktraceMemoryBatchsizeCache):
        cache.memory_changed()


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


@pytest.fixture
def larger_trace_sizes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call's prediction traces at 64 and 128 items instead of the library's 8 and
    16, for tests about what ``model=`` does with a prediction (places, pages, chunks,
    explores, gives back), not about which sizes it traces.

    Their functions loop over 1024-2048 items (``data.split(batchsize)``) through eight
    ``Linear(512, 512)`` layers, so traces at 8 and 16 items run 128 and 64 forwards on fake
    tensors: about 4,800 fake ops, 4-8 s on a 2-core VM, in each of about fifteen tests. At
    64 and 128 they run a few hundred and predict the same bytes for such a loop (checked in
    tests/dispatch/test_dispatch.py by the test marked ``default_trace_sizes``, which keeps
    the library's sizes; tests/execution/test_auto.py checks the sizes themselves)."""
    if request.node.get_closest_marker("default_trace_sizes") is None:
        from adaptmem._execution import auto

        monkeypatch.setattr(auto, "TRACE_SIZES", (64, 128))
