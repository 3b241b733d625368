"""Pinned host memory at the size asked for (see [Note: pinned memory at its size])."""

from __future__ import annotations

import gc
import os
import threading
import warnings

import pytest
import torch

from adaptmem._common.pinning import pinned_cache_kept, pinned_copy, pinned_empty, release_kept
from adaptmem.testing import simulated_cuda


def test_a_large_copy_is_pinned_at_its_size_in_its_layout() -> None:
    t = torch.randn(8, 64, 32, 32).contiguous(memory_format=torch.channels_last)  # 2 MiB
    with simulated_cuda() as sim:
        copy = pinned_copy(t)
        assert copy.is_pinned() and torch.equal(copy, t)
        assert copy.is_contiguous(memory_format=torch.channels_last)
        assert sim.pinned_bytes == t.numel() * 4  # not 4 MiB
        assert pinned_copy(copy) is copy  # pinned already
        del copy
        gc.collect()
        assert sim.pinned_bytes == 0


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated
def test_small_quantized_and_device_tensors_are_pinned_too() -> None:
    small = torch.randn(1000)
    quantized = torch.quantize_per_tensor(torch.randn(2**19), 0.1, 0, torch.qint8)  # 512 KiB
    big_quantized = torch.quantize_per_tensor(torch.randn(2**21), 0.1, 0, torch.qint8)
    with simulated_cuda() as sim:
        on_device = torch.randn(2**19, device="cuda")  # 2 MiB
        for t in (small, quantized, big_quantized, on_device):
            copy = pinned_copy(t)
            assert copy.is_cpu and copy.is_pinned(), t.dtype
            if t.is_quantized:
                assert copy.is_quantized and torch.equal(copy.int_repr(), t.int_repr())
            else:
                assert torch.equal(copy, t.cpu())
        del copy
        gc.collect()
        assert sim.pinned_bytes == 0


def test_kept_regions_are_reused_only_where_they_waste_less_than_rounding_up() -> None:
    with simulated_cuda() as sim:
        first = pinned_empty(8 * 2**20)
        address = first.data_ptr()
        with pinned_cache_kept():
            del first
            gc.collect()
        assert sim.pinned_bytes == 8 * 2**20  # kept, registered
        small = pinned_empty(3 * 2**20)  # 8 MiB for 3 would waste more than 4 MiB: new
        assert small.data_ptr() != address
        again = pinned_empty(5 * 2**20)  # fits, and wastes less than rounding to 8 MiB
        assert again.data_ptr() == address and again.numel() == 5 * 2**20
        assert sim.pinned_bytes == 11 * 2**20
        del small, again
        gc.collect()
        release_kept()
        assert sim.pinned_bytes == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_forgets_the_kept_regions() -> None:
    from adaptmem._common import pinning

    with simulated_cuda():
        buffer = pinned_empty(2**20)
        with pinned_cache_kept():
            del buffer
            gc.collect()
        assert len(pinning._kept) == 1
        held, forked = threading.Event(), threading.Event()

        def hold() -> None:  # another thread holds the kept list's lock across the fork
            with pinning._lock:
                held.set()
                forked.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(10)
        with warnings.catch_warnings():  # Python 3.12+: fork() of a multi-threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: no registration carried over, nothing to give back
            os._exit(0 if not pinning._kept and pinning._lock.acquire(timeout=5) else 1)
        forked.set()
        holder.join()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        release_kept()
        assert not pinning._kept


def test_retiring_a_region_waits_for_the_copies_still_reading_it() -> None:
    # torch's allocator held a freed pinned block until its copies completed; a region is
    # unregistered at once, so it waits for the device first (a paged model dropped with a
    # prefetch in flight). The simulation reports unregistering under a copy in flight.
    with simulated_cuda(bandwidth=0.01):  # 4 MiB at 10 MB/s: 0.4 s
        buffer = pinned_empty(4 * 2**20)
        on_device = buffer.to("cuda", non_blocking=True)
        del buffer
        gc.collect()
        assert on_device.numel() == 4 * 2**20


def test_the_cuda_runtime_torch_links_is_found_to_clear_a_failed_calls_error() -> None:
    # Outside a simulation: torch's own binding has no cudaGetLastError, so the runtime's is
    # looked up through libtorch_cuda (where this torch build has it).
    from adaptmem._common import pinning

    if not os.path.exists(os.path.join(os.path.dirname(torch.__file__), "lib",
                                       "libtorch_cuda.so")):
        pytest.skip("a torch build without CUDA: nothing is registered")
    runtime = pinning._find_libcudart()
    assert runtime is not None
    assert isinstance(runtime.cudaGetLastError(), int)  # clears; without a driver: 35
