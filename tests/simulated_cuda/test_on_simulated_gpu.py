"""CUDA paths of adaptmem, and of code we did not write, checked on the GPU every test run
has (the simulated one, see conftest.py; the real one where present)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import run_if
from torch import nn

from adaptmem import adaptive
from adaptmem._planning import module_sizes
from adaptmem.testing import SimulatedCuda, StreamRaceError


def _linears(n: int = 6, dim: int = 64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(n)]).eval()
    x = torch.randn(4, dim)
    with torch.no_grad():
        return model, x, model(x)


@pytest.mark.gpu
@pytest.mark.simulated_cuda(bandwidth=4)
def test_gpu_without_prefetch_every_transfer_is_waited_on() -> None:
    # Counted by the pager's events (copy finished before compute reached it, or not).
    model, x, expected = _linears(8, 256)
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0, prefetch=0) as pager:
        with torch.no_grad():
            model(x)
            pager.stats.reset()
            out = model(x)
        stats = pager.stats
    assert stats.transfers == 8 and stats.prefetch_hits == 0
    assert stats.prefetch_misses == stats.transfers
    torch.testing.assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True], ids=["from-cpu", "already-on-cuda"])
def test_gpu_paged_forward_under_inference_mode_matches_resident(on_device: bool) -> None:
    # `adaptmem demo`'s path: loaded onto the device, then paged, run in inference_mode.
    model, x, expected = _linears()
    if on_device:
        model.cuda()
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0,
                       device_budget=module_sizes(model).total_bytes // 3) as pager:
        with torch.inference_mode():
            for _ in range(2):
                torch.testing.assert_close(model(x.cuda()).cpu(), expected)
        assert pager.stats.transfers > 0
    assert all(p.device.type == ("cuda" if on_device else "cpu") for p in model.parameters())


class _Cached(nn.Module):
    """A layer whose forward writes its output into a slice of a buffer (a KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.cache[: x.shape[0]] = out
        return out


def _cached() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Two cached layers, an input, and the caches a forward on the CPU leaves."""
    torch.manual_seed(0)
    model = nn.Sequential(_Cached(), _Cached()).eval()
    x = torch.randn(3, 16)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference(x)
    return model, x, torch.stack([m.cache for m in reference])


@pytest.mark.gpu
def test_gpu_a_paged_model_keeps_what_its_forward_wrote_into_a_buffer_slice() -> None:
    model, x, expected = _cached()
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0), torch.no_grad():
        model(x)
    caches = torch.stack([m.cache for m in model])
    assert caches.device.type == "cpu" and caches.abs().sum() > 0
    torch.testing.assert_close(caches, expected)


@pytest.mark.gpu
def test_gpu_a_chunked_model_in_float16_keeps_what_its_forward_wrote_into_a_buffer_slice(
) -> None:
    model, x, expected = _cached()
    with adaptive.chunk(model, "cuda", capacity="1MiB", dtype=torch.float16), torch.no_grad():
        model(x.cuda())
    caches = torch.stack([m.cache for m in model])
    assert caches.dtype == torch.float32 and caches.abs().sum() > 0
    torch.testing.assert_close(caches, expected, atol=1e-2, rtol=1e-2)


@run_if(cuda=True, min_gpus=2)  # the simulation has two; a one-GPU machine skips it
def test_gpu_split_over_two_cuda_devices_and_the_cpu_matches() -> None:
    model, x, expected = _linears()
    part = module_sizes(model).total_bytes // 3
    with adaptive.split(model, {"cuda:0": part, "cuda:1": part, "cpu": None},
                        example_inputs=(x,)) as splitter:
        assert set(splitter.device_map.values()) == {"cuda:0", "cuda:1", "cpu"}
        with torch.no_grad():
            out = model(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, expected)


@pytest.mark.gpu
def test_gpu_paged_weights_leave_no_device_memory_behind() -> None:
    model, x, expected = _linears()
    # What CUDA libraries keep for good through the caching allocator, made at their first
    # use on a stream, is made before the base by the same layers on the current stream,
    # where the pager runs them: on an H200, 33 MiB appeared at the first paged session of
    # a process (most likely cuBLAS's workspace) and failed this test.
    with torch.no_grad():
        warm = model.cuda()(x.cuda())
    model.cpu()
    del warm
    gc.collect()  # on a real GPU, earlier tests' garbage must not go in the middle of this one
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0) as pager:
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(model(x), expected)
        assert pager.stats.peak_device_bytes > 0
    gc.collect()
    torch.cuda.synchronize()
    # Nothing left behind. On an H200 another test's 99 KiB went during this one once, so
    # less than the base counts as nothing left too.
    assert torch.cuda.memory_allocated() <= base
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.gpu
def test_gpu_load_into_a_paged_model_reaches_its_pinned_masters_and_resident_copies(
        tmp_path: pytest.TempPathFactory) -> None:
    source, x, expected = _linears()
    path = f"{tmp_path}/model.pt"
    torch.save(source.state_dict(), path)
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=40_000) as pager:
        placements = {u.placement for u in pager.plan.units}
        assert placements == {"resident", "paged"}
        with torch.no_grad():
            model(x)  # learn, then load between forwards
            adaptive.load(model, path)
            torch.testing.assert_close(model(x), expected)


def test_a_pager_whose_compute_stream_skipped_its_waits_is_caught(
        simulated_cuda_device: SimulatedCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    # The race detector watches adaptmem's own stream code: without the compute stream's
    # wait on each copy's event, the first read of a copied weight raises.
    from adaptmem._simcuda._streams import SimStream

    model, x, _ = _linears()
    monkeypatch.setattr(SimStream, "wait_event", lambda self, event: None)
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0):
        with torch.no_grad(), pytest.raises(StreamRaceError, match="before its copy completed"):
            model(x)
        torch.cuda.synchronize()


# Code we did not write runs unchanged on the simulated device.

@pytest.mark.simulated_cuda(devices=2)
def test_accelerate_cpu_offload_and_dispatch_model_run_on_the_simulation(
        simulated_cuda_device: SimulatedCuda) -> None:
    accelerate = pytest.importorskip("accelerate")
    model, x, expected = _linears()
    with torch.no_grad():
        offloaded = accelerate.cpu_offload(copy.deepcopy(model),
                                           execution_device=torch.device("cuda", 0))
        device_map = {"0": 0, "1": 0, "2": 1, "3": 1, "4": "cpu", "5": "cpu"}
        dispatched = accelerate.dispatch_model(copy.deepcopy(model), device_map=device_map)
        # Offloaded weights are re-made as parameters on every forward: several must work.
        for _ in range(3):
            torch.testing.assert_close(offloaded(x.cuda()).cpu(), expected)
            torch.testing.assert_close(dispatched(x.cuda()).cpu(), expected)


@pytest.mark.simulated_cuda(devices=2)
def test_optimem_page_runs_on_the_simulation(simulated_cuda_device: SimulatedCuda) -> None:
    optimem = pytest.importorskip("optimem")
    model, x, expected = _linears()
    with torch.no_grad():
        optimem.page(model, "cuda")
        torch.testing.assert_close(model(x.cuda()).cpu(), expected)
