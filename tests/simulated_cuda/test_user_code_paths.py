"""Common user code on the simulated CUDA device answers as it does on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adaptmem.testing import SimulatedCudaError, simulated_cuda


def test_module_to_with_a_device_keyword_moves_the_module() -> None:
    # Module.to parses its arguments with torch._C._nn._parse_to, whose ``device=`` made it
    # look like a factory: the module stayed on the host, in silence.
    with simulated_cuda():
        model = nn.Linear(8, 8).to(device="cuda", dtype=torch.bfloat16)
        assert model.weight.device == torch.device("cuda", 0)
        assert model.weight.dtype == torch.bfloat16
        assert nn.Linear(2, 2).to(device="cuda").bias.is_cuda
        assert torch._C._nn._parse_to(device="cuda")[0] == torch.device("cuda")
        with torch.no_grad():
            assert model(torch.ones(2, 8, device="cuda", dtype=torch.bfloat16)).is_cuda


def test_device_properties_have_every_field_torch_gives() -> None:
    with simulated_cuda(devices=2, total_memory="8GiB"):
        props = torch.cuda.get_device_properties(1)
        for field in torch._C._CudaDeviceProperties.__annotations__:
            assert hasattr(props, field), field
        assert props.warp_size == 32 and props.total_memory == 8 * 1024**3
        assert torch.cuda.get_device_capability(1) == (props.major, props.minor)
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.get_device_capability(2)


def test_cuda_graphs_are_refused_by_name_and_nothing_is_capturing() -> None:
    # Without the simulation's answers they reached the CUDA runtime: "CUDA driver
    # version is insufficient".
    with simulated_cuda():
        assert torch.cuda.is_current_stream_capturing() is False
        assert torch.cuda.graphs.is_current_stream_capturing() is False
        with pytest.raises(SimulatedCudaError, match="CUDA graphs are not simulated"):
            torch.cuda.CUDAGraph()
        with pytest.raises(SimulatedCudaError, match="make_graphed_callables"):
            torch.cuda.make_graphed_callables(nn.Linear(2, 2).cuda(),
                                              (torch.ones(1, 2, device="cuda"),))
        with pytest.raises(SimulatedCudaError, match="graph_pool_handle"):
            torch.cuda.graph_pool_handle()
        assert torch.cuda.Stream.priority_range() == (0, -3)
        assert torch.cuda.Stream(priority=-3).priority == -3


def test_accumulated_memory_stats_reset_and_read_nested() -> None:
    with simulated_cuda(total_memory="64MiB"):
        kept = torch.empty(1024, device="cuda")
        for _ in range(3):
            kept = torch.empty(1024, device="cuda")  # made before the one before is freed
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**30, device="cuda")
        stats = torch.cuda.memory_stats()
        assert stats["allocation.all.allocated"] == 4 and stats["num_ooms"] == 1
        nested = torch.cuda.memory_stats_as_nested_dict()
        assert nested["allocation"]["all"] == {"current": 1, "peak": 2, "allocated": 4,
                                               "freed": 3}
        torch.cuda.reset_accumulated_memory_stats()
        torch.cuda.reset_peak_memory_stats()
        stats = torch.cuda.memory_stats()
        assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 0
        assert stats["allocation.all.current"] == stats["allocation.all.peak"] == 1
        assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated() > 0
        assert stats["num_ooms"] == 0
        del kept
        assert torch.cuda.memory_stats()["allocation.all.current"] == 0


def test_pinning_under_inference_mode_as_a_dataloader_does() -> None:
    # Under inference_mode, Tensor.pin_memory reaches the dispatch mode undecomposed, and
    # its CPU kernel asked the CUDA runtime ("Found no NVIDIA driver").
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(8, 3), torch.arange(8))
    with simulated_cuda(), torch.inference_mode():
        host = torch.randn(4)
        pinned = host.pin_memory()
        assert pinned.is_pinned() and not host.is_pinned()
        assert pinned.pin_memory() is pinned
        assert torch.equal(pinned, host)
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            torch.ones(2, device="cuda").pin_memory()
        for x, _ in DataLoader(data, batch_size=4, pin_memory=True):
            assert x.is_pinned()
            assert x.to("cuda", non_blocking=True).is_cuda


def test_data_parallel_on_one_device_runs_and_on_two_is_refused_by_name() -> None:
    from torch.nn.parallel import _functions, comm

    torch.manual_seed(0)
    linear = nn.Linear(4, 4).eval()
    x = torch.randn(6, 4)
    with torch.no_grad():
        expected = linear(x)
    before = (torch._C._scatter, torch._C._gather, _functions._get_stream)
    with simulated_cuda(devices=2, total_memory="64MiB"):
        with torch.accelerator.device_index(1):
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 0
        one = nn.DataParallel(linear, device_ids=[0])
        with torch.no_grad():
            out = one(x)  # the input scattered from the host, as on a GPU
        assert out.device == torch.device("cuda", 0)
        assert torch.equal(out.cpu(), expected)
        two = nn.DataParallel(nn.Linear(4, 4).cuda(), device_ids=[0, 1])
        with pytest.raises(SimulatedCudaError, match="DataParallel over 2 devices"):
            two(x)
        # One row over two devices is one replica, in the caller's thread, as on GPUs.
        with torch.no_grad():
            single = nn.DataParallel(linear, device_ids=[0, 1])(x[:1])
        assert torch.equal(single.cpu(), expected[:1])
        # with autograd on too: torch's replicate would ask the driver (the process ended)
        assert nn.DataParallel(linear, device_ids=[0, 1])(x[:1]).shape == (1, 4)
        chunks = comm.scatter(torch.randn(5, 4), [0, 1, 1, 0])  # as torch: 3 chunks of 2, 2, 1
        assert [c.shape[0] for c in chunks] == [2, 2, 1]
        assert [c.device.index for c in chunks] == [0, 1, 1]
    assert (torch._C._scatter, torch._C._gather, _functions._get_stream) == before
    assert _functions._streams is None  # no simulated stream kept past the block
