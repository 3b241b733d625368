"""Packed masters on an accelerator: each paged unit's pinned masters are views of one buffer,
so a unit goes to the device in one copy (see [Note: packed masters] in hoststore.py).

Tests marked ``gpu`` run on the real CUDA device when there is one, else on the simulated
one; those taking ``simulated_cuda_device`` count the copies the simulation saw.
"""

from __future__ import annotations

import copy
import gc
import io
import threading
import types

import pytest
import torch
from conftest import REAL_CUDA, host_registrations
from torch import nn

from adaptmem import adaptive
from adaptmem._planning import module_sizes
from adaptmem.testing import SimulatedCuda, simulated_cuda


def _block(width: int) -> nn.Module:
    # Float weights, float and int64 buffers (num_batches_tracked), a channels_last weight.
    block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
                          nn.ReLU(), nn.Conv2d(width, width, 1, bias=False),
                          nn.BatchNorm2d(width), nn.ReLU())
    block[0].weight.data = block[0].weight.data.contiguous(memory_format=torch.channels_last)
    return block


def _net(blocks: int = 4, width: int = 16) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[_block(width) for _ in range(blocks)]).eval()
    for m in model.modules():  # running statistics other than the defaults
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.num_batches_tracked.fill_(7)
    return model, torch.randn(2, width, 8, 8)


def _expected(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).cuda()(x.cuda()).cpu()  # the same kernels as paged


def _unit_bytes(model: nn.Module) -> int:
    return module_sizes(model).subtree_bytes["0"]


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    if REAL_CUDA:  # kernels may be chosen by a weight's alignment: round-off may differ
        torch.testing.assert_close(out, expected)
    else:
        assert torch.equal(out, expected)


def test_a_paged_unit_is_one_copy_and_gives_the_unpaged_output(
        simulated_cuda_device: SimulatedCuda) -> None:
    model, x = _net()
    expected = _expected(model, x)
    tensors = len(module_sizes(model).tensors)
    with adaptive.page(model, "cuda", unit_bytes=_unit_bytes(model), resident_bytes=0,
                       prefetch=1) as pager, torch.no_grad():
        assert len(pager.plan.units) == 4
        model(x)  # learns the order
        before = simulated_cuda_device.copy_stats["copies"]
        for _ in range(3):
            _check(model(x).cpu(), expected)
        per_forward = (simulated_cuda_device.copy_stats["copies"] - before) / 3
    # One copy per unit and dtype (float32, and int64 for num_batches_tracked), and the
    # input's, where tensor by tensor it was one per tensor; the buffers (a few KiB each)
    # are copied back to the host after each use, and those copies count too.
    copied_back = sum(1 for _ in model.buffers())
    assert per_forward - copied_back <= 2 * 4 + 1 < tensors


@pytest.mark.gpu
def test_gpu_a_units_masters_share_one_pinned_buffer_per_dtype_and_keep_their_layout() -> None:
    model, x = _net()
    with adaptive.page(model, "cuda", unit_bytes=_unit_bytes(model), resident_bytes=0):
        for block in model:
            tensors = [*block.parameters(), *block.buffers()]
            assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
            for dtype in (torch.float32, torch.int64):  # num_batches_tracked: a pack of its own
                same = [t for t in tensors if t.dtype == dtype]
                assert len({t.untyped_storage().data_ptr() for t in same}) == 1
                start = same[0].untyped_storage().data_ptr()
                assert all((t.data_ptr() - start) % 256 == 0 for t in same)  # each aligned
        weight = model[0][0].weight
        assert weight.is_contiguous(memory_format=torch.channels_last)
        assert model[0][1].num_batches_tracked.dtype == torch.int64
        assert model[0][1].num_batches_tracked.item() == 7
        # torch.save refuses a storage viewed as two dtypes: the state dict saves as it is.
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
    for name, t in model.state_dict().items():
        assert torch.equal(saved[name], t), name


@pytest.mark.gpu
def test_gpu_packed_units_run_paged_prefetched_resident_and_come_back_bitwise() -> None:
    model, x = _net()
    reference = copy.deepcopy(model)
    expected = _expected(model, x)
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    unit = _unit_bytes(model)
    with adaptive.page(model, "cuda", unit_bytes=unit, resident_bytes=unit,
                       prefetch=2) as pager, torch.no_grad():
        assert {u.placement for u in pager.plan.units} == {"resident", "paged"}
        for _ in range(4):
            _check(model(x.cuda()).cpu(), expected)
        # Inside a forward a weight (a view of its unit's block) keeps its own layout.
        seen = {}

        def look(module: nn.Module, args: object) -> None:
            seen["weight"] = module[0].weight.data
            seen["count"] = module[1].num_batches_tracked.data

        handle = model[2].register_forward_pre_hook(look)
        model(x)
        handle.remove()
        assert seen["weight"].device.type == "cuda"
        assert seen["weight"].is_contiguous(memory_format=torch.channels_last)
        assert seen["count"].item() == 7
    after = dict([*model.named_parameters(), *model.named_buffers()])
    for name, t in before.items():  # bitwise, on their own memory again, layout kept
        assert after[name].device.type == "cpu" and torch.equal(after[name], t), name
    storages = [t.untyped_storage().data_ptr() for t in after.values()]
    assert len(set(storages)) == len(storages)
    assert model[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 reference.state_dict().values(), strict=True))


@pytest.mark.gpu
def test_gpu_edits_between_calls_reach_packed_masters_and_the_next_forward() -> None:
    # In place and through .data, between calls; then remove() keeps them.
    model, x = _net()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference[1][0].weight.mul_(2)
        reference[3][3].weight.data = torch.randn_like(reference[3][3].weight)
    expected = _expected(reference, x)
    with adaptive.page(model, "cuda", unit_bytes=_unit_bytes(model), resident_bytes=0), \
            torch.no_grad():
        model(x)
        model[1][0].weight.mul_(2)
        model[3][3].weight.data = reference[3][3].weight.data.clone()
        for _ in range(2):
            _check(model(x).cpu(), expected)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_a_tied_weight_is_not_packed_with_its_unit() -> None:
    # A weight another unit borrows stays on its own: a block outliving its unit would hold
    # the whole unit's bytes on the device.
    torch.manual_seed(0)
    embed = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(nn.Sequential(embed, nn.LayerNorm(32)), nn.Linear(32, 32),
                          head).eval()
    x = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        expected = copy.deepcopy(model).cuda()(x.cuda()).cpu()
    unit = module_sizes(model).subtree_bytes["0"]
    with adaptive.page(model, "cuda", unit_bytes=unit, resident_bytes=0), torch.no_grad():
        norm = {t.untyped_storage().data_ptr() for t in model[0][1].parameters()}
        assert len(norm) == 1  # the rest of the unit is packed
        assert embed.weight.untyped_storage().data_ptr() not in norm
        for _ in range(2):
            _check(model(x).cpu(), expected)


@pytest.mark.gpu
@pytest.mark.simulated_cuda(total_memory="40MiB")
def test_a_trace_through_resident_units_does_not_count_a_unit_per_weight() -> None:
    # Under the trace an op on a resident weight gives a fake view with a storage of its
    # own, counted at that storage's bytes: had the weight been a view of its unit's
    # block, a whole unit (here the whole model) would have counted as fixed memory.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(),
                                          nn.Linear(1024, 256)) for _ in range(4)]).eval()
    weights = module_sizes(model).total_bytes  # 8 MiB
    data = torch.randn(256, 256)
    with adaptive.page(model, "cuda") as pager:  # it fits: resident

        @adaptive.batch(initial_batchsize="auto", device="cuda")
        def run(batchsize: int, data: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return torch.cat([model(c.cuda()).cpu() for c in data.split(batchsize)])

        run(data)
        prediction = run.prediction
        resident = {u.placement for u in pager.plan.units}
    assert resident == {"resident"}
    assert prediction is not None and prediction.fixed_bytes < weights // 8


_LAYER = 544 * 545 * 4  # bytes of a Linear(544, 544): one unit each


def _over_a_power_of_two() -> tuple[nn.Module, torch.Tensor]:
    # Units of 1.13 MiB (544 x 545 float32): torch's host allocator pins each in 2 MiB. The
    # middle one has one tensor (a unit of one tensor is pinned on its own, not packed).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(544, 544), nn.Linear(544, 544, bias=False),
                          nn.Linear(544, 544)).eval()
    return model, torch.randn(3, 544)  # the simulation runs the CPU's kernels: equal


def test_a_paged_models_pinned_masters_take_its_bytes_not_a_power_of_two_each() -> None:
    # Pinned through torch's allocator, each pack took the next power of two (1.13 MiB ->
    # 2 MiB, about 1.8x the weights), pinned memory the host cannot swap or reclaim.
    model, x = _over_a_power_of_two()
    with torch.no_grad():
        expected = model(x)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with simulated_cuda(devices=1, total_memory="64MiB") as sim, torch.no_grad():
        with adaptive.page(model, "cuda", unit_bytes=_LAYER, resident_bytes=0) as pager:
            assert len(pager.plan.units) == 3
            assert all(p.is_pinned() for p in model.parameters())
            assert weights <= sim.pinned_bytes <= weights + 3 * 4096  # a page a unit at most
            for _ in range(2):
                assert torch.equal(model(x.cuda()).cpu(), expected)
        gc.collect()
        assert sim.pinned_bytes == 0  # unregistered, unmapped
    assert torch.equal(model(x), expected)


def test_pinned_masters_come_from_torchs_allocator_where_registering_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _over_a_power_of_two()
    with torch.no_grad():
        expected = model(x)
    with simulated_cuda(devices=1, total_memory="64MiB") as sim, torch.no_grad():
        pending = [0]  # the runtime keeps a failed call's error for the thread

        def register(ptr: int, size: int, flags: int) -> int:
            pending[0] = 2  # cudaErrorMemoryAllocation
            return 2

        def last_error() -> int:
            error, pending[0] = pending[0], 0
            return error

        refused = types.SimpleNamespace(cudaHostRegister=register,
                                        cudaHostUnregister=lambda ptr: 713,
                                        cudaGetLastError=last_error)
        with monkeypatch.context() as patches:
            patches.setattr(torch.cuda, "cudart", lambda: refused)
            with adaptive.page(model, "cuda", unit_bytes=_LAYER, resident_bytes=0):
                # Cleared: left pending, torch's next kernel launch would raise it.
                assert pending == [0]
                assert all(p.is_pinned() for p in model.parameters())
                assert sim.pinned_bytes == 3 * 2 * 2**20  # rounded, as before
                assert torch.equal(model(x.cuda()).cpu(), expected)
    assert torch.equal(model(x), expected)


def test_a_state_dict_kept_past_remove_keeps_its_pinned_memory_until_it_goes() -> None:
    # While placed, state_dict() holds views of the packs: the memory under them must stay
    # mapped after remove() for as long as they live, and be given back after.
    model, _ = _over_a_power_of_two()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_cuda(devices=1, total_memory="64MiB") as sim:
        pager = adaptive.page(model, "cuda", unit_bytes=_LAYER, resident_bytes=0)
        views = model.state_dict()
        pager.remove()
        gc.collect()
        assert sim.pinned_bytes > 0
        assert all(torch.equal(views[k], v) for k, v in before.items())
        del views
        gc.collect()
        assert sim.pinned_bytes == 0


def test_placing_again_reuses_the_pinned_memory_the_last_placement_let_go() -> None:
    # model= removes its pagers only to page the same model again (pinned_cache_kept): the
    # registered memory is kept for the new pagers, not unregistered and registered again
    # (seconds a GiB on a GPU); what they leave is given back by release_kept().
    from adaptmem._common.pinning import pinned_cache_kept, release_kept

    model, x = _over_a_power_of_two()
    with torch.no_grad():
        expected = model(x)
    with simulated_cuda(devices=1, total_memory="64MiB") as sim, torch.no_grad():
        with host_registrations() as calls:
            pager = adaptive.page(model, "cuda", unit_bytes=_LAYER, resident_bytes=0)
            held = sim.pinned_bytes
            assert [c[0] for c in calls] == ["register"] * 3
            with pinned_cache_kept():
                pager.remove()
            assert sim.pinned_bytes == held  # kept registered
            pager = adaptive.page(model, "cuda", unit_bytes=_LAYER, resident_bytes=0)
            assert len(calls) == 3 and sim.pinned_bytes == held
            assert torch.equal(model(x.cuda()).cpu(), expected)
            with pinned_cache_kept():
                pager.remove()
            release_kept()
            assert sim.pinned_bytes == 0 and len(calls) == 6
    assert torch.equal(model(x), expected)


@pytest.mark.gpu
def test_gpu_masters_are_registered_at_their_size_and_give_the_unpaged_output() -> None:
    # The real runtime on a GPU (cudaHostRegister, then non_blocking copies from that
    # memory on the pager's side stream); the simulated one elsewhere.
    model, x = _over_a_power_of_two()
    expected = _expected(model, x)
    with host_registrations() as calls, torch.no_grad():
        with adaptive.page(model, "cuda", unit_bytes=_LAYER, resident_bytes=0, prefetch=1):
            assert [(c[0], c[2] < 2**21) for c in calls] == [("register", True)] * 3
            assert all(p.is_pinned() for p in model.parameters())
            for _ in range(3):
                _check(model(x.cuda()).cpu(), expected)
        gc.collect()
        assert [c[0] for c in calls] == ["register"] * 3 + ["unregister"] * 3
    torch.testing.assert_close(model(x), expected.cpu())


def test_pinned_masters_are_registered_with_the_pagers_device_current() -> None:
    # The runtime registers with the thread's current device, making it a context if it had
    # none (hundreds of MiB on that GPU): a model paged to cuda:1 from a thread at cuda:0
    # registers, and unregisters, with cuda:1 current.
    model, x = _over_a_power_of_two()
    with torch.no_grad():
        expected = model(x)
    with simulated_cuda(devices=2, total_memory="64MiB"), torch.no_grad():
        with host_registrations() as calls:
            with adaptive.page(model, "cuda:1", unit_bytes=_LAYER, resident_bytes=0):
                assert torch.cuda.current_device() == 0
                assert torch.equal(model(x.to("cuda:1")).cpu(), expected)
            gc.collect()
        assert [c[:2] for c in calls] == [("register", 1)] * 3 + [("unregister", 1)] * 3


def test_a_region_retired_while_another_thread_holds_the_kept_list_does_not_wait() -> None:
    # The garbage collector retires regions wherever it runs, inside the code that holds the
    # kept list too (choosing a region to reuse allocates): retiring must not take its lock.
    from adaptmem._common import pinning

    with simulated_cuda() as sim:
        buffer = pinning.pinned_empty(2**20)
        assert sim.pinned_bytes == 2**20
        held, done = threading.Event(), threading.Event()

        def hold() -> None:
            with pinning._lock:
                held.set()
                done.wait(60)  # longer than the retiring thread is given

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(10)
        buffers = [buffer]
        del buffer
        retired = threading.Thread(target=_drop_in_kept_block, args=(buffers,))
        retired.start()
        retired.join(5)
        stuck = retired.is_alive()
        done.set()
        holder.join()
        retired.join()
        assert not stuck
        pinning.release_kept()
        assert sim.pinned_bytes == 0


def _drop_in_kept_block(tensors: list[torch.Tensor]) -> None:
    from adaptmem._common.pinning import pinned_cache_kept

    with pinned_cache_kept():
        tensors.clear()
        gc.collect()
