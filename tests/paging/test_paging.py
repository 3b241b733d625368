from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import math
import re
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import REAL_CUDA, hold_cached_blocks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from models import (
    ZOO,
    CallsItself,
    HeadFirst,
    ReadsChildWeight,
    WithEmptyLayer,
    held_in_flight,
    held_in_own_code,
    small_vit,
)
from strategies import DIM, module_trees
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from adaptmem import adaptive
from adaptmem._common.errors import OutOfMemoryError, PlacementError
from adaptmem._engines.transfer import SyncTransfer
from adaptmem._paging.learner import is_metadata
from adaptmem._planning import Placement, module_sizes, paging_units
from adaptmem.testing import simulated_cuda


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """One intra-op thread: these are tiny forwards, and on a busy 2-core machine thread
    hand-offs cost far more than the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def zoo(name: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    model, args, kwargs = ZOO[name]()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    return model, args, kwargs, expected


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b)


# The pager's own moves of a master (copying it, pointing a weight at it); users' modes see
# them, and they are not compute.
_PAGER_MOVES = frozenset({"clone", "copy_", "to", "__set__", "__get__", "empty_like"})


class HostMasterProbe(TorchFunctionMode):
    """Records every op that receives a tensor whose storage is one of ``storages``, other
    than the pager's own moves."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.offenders: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not is_metadata(func) and getattr(func, "__name__", "") not in _PAGER_MOVES:
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                    self.offenders.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _storages(model: nn.Module) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


# Unit sizes as a fraction of each model: finest, fine, coarse.
ZOO_CASES = [(name, frac) for name in ZOO for frac in (0.0, 0.05, 0.3)]


@pytest.mark.parametrize(("name", "fraction"), ZOO_CASES)
def test_paged_zoo_model_gives_the_unpaged_output(name: str, fraction: float) -> None:
    model, args, kwargs, expected = zoo(name)
    unit_bytes = int(module_sizes(model).total_bytes * fraction)
    with adaptive.page(model, "cpu", unit_bytes=unit_bytes, resident_bytes=0) as pager:
        with torch.no_grad():
            first = model(*args, **kwargs)
            second = model(*args, **kwargs)  # the learned order, with prefetch
    assert _same(first, expected) and _same(second, expected)
    assert pager.stats.forwards == 2 and pager.stats.bytes_moved > 0
    assert "bytes_moved=" in str(pager.stats) and name in ZOO
    assert pager.stats.prefetch_hits > 0


@pytest.mark.parametrize("name", list(ZOO))
def test_no_compute_op_in_a_paged_forward_receives_a_host_master(name: str) -> None:
    model, args, kwargs, expected = zoo(name)
    probe = HostMasterProbe(_storages(model))  # on the CPU the masters are the originals
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0):
        with probe, torch.no_grad():
            first = model(*args, **kwargs)
            second = model(*args, **kwargs)
    assert probe.offenders == []
    assert _same(first, expected) and _same(second, expected)


def test_probe_catches_a_forward_on_host_masters() -> None:
    """The probe is not vacuous: an unpaged forward computes on the host tensors."""
    model = ReadsChildWeight().eval()
    probe = HostMasterProbe(_storages(model))
    with probe, torch.no_grad():
        model(torch.randn(2, 16))
    assert "linear" in probe.offenders


def test_weight_read_without_calling_its_module_is_learned_and_loaded() -> None:
    torch.manual_seed(0)
    model = ReadsChildWeight().eval()
    x = torch.randn(2, 16)
    expected = model(x)
    pager = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0)
    probe = HostMasterProbe(_storages(model) - {model.gate.untyped_storage().data_ptr()})
    with pager, probe, torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), expected)
        needs = {s.name for s in pager._needs.by_module[id(model)]}
    assert {"inner.weight", "inner.bias"} <= needs
    assert probe.offenders == []


class AsksWhereItsWeightsAre(nn.Module):
    """Builds a helper tensor where its first parameter lives (Hugging Face's
    ``self.device``), then asks a child's weight the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.linear = nn.Linear(16, 16)
        self.seen: list[torch.device] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        device = next(self.parameters()).device
        self.seen += [device, self.linear.weight.device]
        pos = torch.arange(ids.shape[1], device=device)
        return self.linear(self.emb(ids) + self.emb(pos))


@pytest.mark.gpu
def test_a_device_read_of_a_paged_weight_inside_a_forward_names_the_device() -> None:
    torch.manual_seed(0)
    model = AsksWhereItsWeightsAre().eval()
    ids = torch.randint(0, 10, (2, 5))
    with torch.no_grad():
        # Computed on the device itself: a GPU's kernels round differently from the CPU's.
        expected = copy.deepcopy(model).cuda()(ids.cuda()).cpu()
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0), torch.no_grad():
        outs = [model(ids) for _ in range(3)]  # learning, then the learned order
    assert all(out.device.type == "cpu" and torch.equal(out, expected) for out in outs)
    assert {d.type for d in model.seen} == {"cuda"}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=module_trees(), unit_bytes=st.integers(0, 3000), prefetch=st.integers(0, 3))
def test_random_module_trees_paged_at_random_unit_sizes_give_the_unpaged_output(
    tree: nn.Module, unit_bytes: int, prefetch: int
) -> None:
    x = torch.randn(2, DIM)
    with torch.no_grad():
        expected = tree(x)
        # Submodules called on their own, before the first forward and after it (an encoder
        # called by generate(), a layer inside a unit), against an unpaged copy.
        reference = dict(copy.deepcopy(tree).named_modules())
        alone = {}
        for name, module in tree.named_modules():
            try:
                alone[name] = (module, reference[name](x))
            except (RuntimeError, TypeError):  # not every part takes (batch, DIM) alone
                continue
    before = {k: v.clone() for k, v in tree.state_dict().items()}
    probe = HostMasterProbe(_storages(tree))
    with adaptive.page(tree, "cpu", unit_bytes=unit_bytes, resident_bytes=0,
                       prefetch=prefetch) as pager:
        with probe, torch.no_grad():
            for module, out in alone.values():
                assert torch.equal(module(x), out)
            assert torch.equal(tree(x), expected)
            assert torch.equal(tree(x), expected)
            for module, out in alone.values():
                assert torch.equal(module(x), out)
                assert pager._table.held == 0  # nothing left behind by the call
            assert torch.equal(tree(x), expected)
    assert probe.offenders == []
    after = tree.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- the model is the same model ---------------------------------------------------------------


class Mixed(nn.Module):
    """fp32, fp16 and int tensors, a channels_last conv, BatchNorm buffers, a tie."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.bn = nn.BatchNorm2d(8)
        self.low = nn.Linear(8, 8).half()
        self.head = nn.Linear(8, 8)
        self.alias = self.head  # one module under two names
        self.register_buffer("table", torch.arange(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean((2, 3))
        y = self.low(y.half()).float()
        return self.alias(y) + self.table


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_remove_restores_every_tensor_bitwise_with_device_and_dtype() -> None:
    torch.manual_seed(0)
    model = Mixed().eval()
    snapshot = {n: (t, _bytes_of(t), t.device, t.dtype, t.stride(), t.data_ptr())
                for n, t in [*model.named_parameters(), *model.named_buffers()]}
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    pager = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=256)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    pager.remove()
    pager.remove()  # a second call does nothing
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == snapshot.keys()
    for name, (obj, raw, device, dtype, stride, ptr) in snapshot.items():
        t = now[name]
        assert t is obj, name
        assert (t.device, t.dtype, t.stride(), _bytes_of(t)) == (device, dtype, stride, raw), name
        assert t.data_ptr() == ptr, name  # on the CPU the master is the original storage
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert torch.equal(model(x), expected)


@pytest.mark.gpu
def test_remove_lets_go_of_the_pinned_masters_and_a_dropped_pager_goes_at_once() -> None:
    # See [Note: a removed pager holds nothing]: users keep handles, and model= replaces its
    # pagers each time it gives residency back.
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).eval()
    pager = adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0)
    with torch.no_grad():
        model(torch.randn(2, 64))
    slots = pager._table.slots.values()
    assert len(slots) == 8 and all(s.master.is_pinned() for s in slots)
    # A unit's masters are views of one pinned buffer: the buffer must go, not the views.
    pinned = [weakref.ref(s.pack if s.pack is not None else s.master) for s in slots]
    del slots
    gc.disable()  # nothing may wait for the collector
    try:
        pager.remove()
        assert [p() for p in pinned] == [None] * 8  # while the handle lives
        assert model[0].weight.device.type == "cpu" and not model[0].weight.is_pinned()
        handle, weights = weakref.ref(pager), weakref.ref(model)
        del pager, model
        assert handle() is None and weights() is None
    finally:
        gc.enable()


def test_state_dict_keys_and_parameter_identity_unchanged_while_paged() -> None:
    model = Mixed().eval()
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    x = torch.randn(1, 3, 8, 8)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        model(x)
        assert list(model.state_dict()) == keys
        assert all(params[n] is p for n, p in model.named_parameters())
        assert model.alias.weight is model.head.weight


def test_tied_embedding_is_one_tensor_on_the_device_while_used() -> None:
    model, _, kwargs, expected = zoo("tiny_gpt")
    seen = []

    def check(module: nn.Module, args: Any) -> None:
        w = model.wte.weight
        seen.append((module.weight is w, w.untyped_storage().data_ptr()))

    pager = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0)
    handle = model.lm_head.register_forward_pre_hook(check)  # runs after the pager's hook
    master = pager._table.slots["wte.weight"].master.untyped_storage().data_ptr()
    try:
        with torch.no_grad():
            assert _same(model(**kwargs), expected)
    finally:
        handle.remove()
        pager.remove()
    assert seen and all(same and ptr != master for same, ptr in seen)
    assert "lm_head.weight" not in pager.load_targets()


def test_plan_lists_units_in_execution_order_with_placement() -> None:
    model = HeadFirst().eval()
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        registered = ["head", "body.0", "body.2"]
        assert [u.module for u in pager.plan.units] == registered
        with torch.no_grad():
            model(torch.randn(1, 32))
        assert [u.module for u in pager.plan.units] == ["body.0", "body.2", "head"]  # as run
        assert {u.placement for u in pager.plan.units} == {"paged"}
        assert "paged" in str(pager.plan)
        assert adaptive.Plan.from_dict(pager.plan.to_dict()).to_dict() == pager.plan.to_dict()


def test_resident_units_stay_on_the_device_and_only_the_rest_moves() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).eval()
    layer = 32 * 32 * 4 + 32 * 4
    x = torch.randn(2, 32)
    expected = model(x)
    with adaptive.page(model, "cpu", unit_bytes=layer, resident_bytes=2 * layer) as pager:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), expected)
        placements = [u.placement for u in pager.plan.units]
        assert placements.count("resident") == 2 and placements.count("paged") == 2
        # two paged layers per forward; nothing is fetched ahead of a forward
        assert pager.stats.bytes_moved == 3 * 2 * layer


def test_prefetch_makes_later_forwards_hit_and_zero_turns_it_off() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).eval()
    x = torch.randn(2, 16)
    for prefetch, hits in ((2, 5), (0, 0)):
        with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0,
                           prefetch=prefetch) as pager, torch.no_grad():
            model(x)
            pager.stats.reset()
            model(x)
            model(x)
        # every layer but the first of each forward was prefetched while its predecessor ran
        assert pager.stats.prefetch_hits == 2 * hits
        assert pager.stats.prefetch_misses == 2 * (6 - hits)


def test_weights_edited_between_forwards_are_used_by_the_next_forward() -> None:
    # Edits through .data bump no version counter, so no copy may be made ahead of a forward.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).eval()
    reference = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 16)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager, torch.no_grad():
        model(x)
        model(x)
        for edit in (lambda m: m[0].weight.data.zero_(), lambda m: m[1].bias.add_(1.0),
                     lambda m: m[0].weight.data.copy_(m[3].weight.data)):
            edit(model)
            edit(reference)
            assert torch.equal(model(x), reference(x))
    assert pager.stats.prefetch_hits > 0


class _Accumulates(nn.Module):
    """Keeps a running sum of its inputs in a buffer, written in place (as a KV cache is)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total += x.sum(0)
        return self.proj(x) + self.total


def test_a_buffer_written_in_place_by_the_forward_keeps_what_was_written(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Accumulates(), nn.Linear(8, 8), _Accumulates()).eval()
    reference = nn.Sequential(_Accumulates(), nn.Linear(8, 8), _Accumulates()).eval()
    reference.load_state_dict(model.state_dict())
    xs = [torch.randn(3, 8) for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="adaptmem"), torch.no_grad():
        with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0):
            for x in xs:
                assert torch.equal(model(x), reference(x))
        assert torch.equal(model[0].total, reference[0].total)  # kept after remove() too
        assert torch.equal(model[2].total, reference[2].total)
    assert "written in place" in caplog.text


def _data_given_between_calls_is_used_and_kept(device: str) -> None:
    # `param.data = new` (a loading idiom) between calls, on the device the weight has
    # between calls (the host when paged, the device when resident): the next forwards
    # use it and remove() keeps it. Data on another device is refused, saying so.
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    for resident in (0, 2**20):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
        reference = copy.deepcopy(model)
        new = torch.randn(4, 4)
        reference[2].weight.data = new.clone()
        with torch.no_grad():
            # Computed on the device itself: a GPU's kernels round differently from the CPU's.
            expected = reference.to(device)(x.to(device)).cpu()
            with adaptive.page(model, device, unit_bytes=0, resident_bytes=resident):
                model(x)
                at_rest = model[2].weight.device
                model[2].weight.data = new.clone().to(at_rest)
                for _ in range(3):
                    assert torch.equal(model(x).cpu(), expected), resident
                if at_rest.type != "cpu":
                    model[2].weight.data = new.clone()
                    with pytest.raises(PlacementError, match="through .data"):
                        model(x)
                    model[2].weight.data = new.clone().to(at_rest)
        assert model[2].weight.device.type == "cpu"
        assert torch.equal(model[2].weight.data, new), resident


def test_data_given_to_a_weight_between_calls_is_used_and_kept_after_remove() -> None:
    _data_given_between_calls_is_used_and_kept("cpu")


@pytest.mark.gpu
def test_gpu_data_given_to_a_weight_between_calls_is_used_and_kept_after_remove() -> None:
    _data_given_between_calls_is_used_and_kept("cuda")


@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_training_mode_set_after_placing_is_refused_at_the_next_call(engine: str) -> None:
    # A training forward would update BatchNorm's running statistics in copies the placed
    # model does not keep (the kernel bumps no version counter), so it does not run.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 4)
    if engine == "page":
        handle: Any = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0)
    else:
        handle = adaptive.chunk(model, "cpu", capacity="1KiB", example_inputs=(x,))
    model(x)
    model.train()
    with pytest.raises(PlacementError, match=r"training mode now .*model.eval\(\) again"):
        model(x)
    model[1].eval()
    with pytest.raises(PlacementError, match=r"3 module\(s\) are in training mode"):
        model(x)
    model.eval()
    model(x)
    handle.remove()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_list_the_caller_passes_is_the_list_the_forward_fills() -> None:
    class Collects(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, feats: list) -> torch.Tensor:
            h = self.a(x)
            feats.append(h)
            return self.b(h)

    model = Collects().eval()
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        feats: list[torch.Tensor] = []
        model(torch.randn(2, 4), feats)
        assert len(feats) == 1


def test_a_resident_weight_edited_through_data_keeps_the_edit_after_remove() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=2**20) as pager:
        assert {u.placement for u in pager.plan.units} == {"resident"}
        model[0].weight.data.fill_(0.5)
    assert torch.equal(model[0].weight, torch.full((8, 8), 0.5))


def test_hooks_registered_before_paging_that_read_weights_get_device_copies() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).eval()
    host = {id(p): p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []

    def reads_weight(module: nn.Module, args: Any) -> None:
        seen.append(module.weight.untyped_storage().data_ptr() != host[id(module.weight)])

    for layer in model:
        layer.register_forward_pre_hook(reads_weight)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))
    assert seen == [True] * 8


def test_weights_written_in_place_during_a_forward_are_never_served_stale() -> None:
    # A hook on one layer edits the next one, whose copy is already on its way.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).eval()
    reference = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).eval()
    reference.load_state_dict(model.state_dict())
    edit = {"on": False}
    for net in (model, reference):
        net[0].register_forward_hook(
            lambda m, a, out, nxt=net[1]: nxt.weight.mul_(2) if edit["on"] else None)
        net[2].register_forward_pre_hook(
            lambda m, a: m.bias.zero_() if edit["on"] else None)
    x = torch.randn(2, 8)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0, prefetch=2), \
            torch.no_grad():
        model(x)
        model(x)
        edit["on"] = True
        assert torch.equal(model(x), reference(x))
        edit["on"] = False
        assert torch.equal(model(x), reference(x))  # the edits were kept
    assert torch.equal(model[1].weight, reference[1].weight)
    assert torch.equal(model[2].bias, torch.zeros(8))


def test_a_submodule_called_on_its_own_leaves_no_copy_behind() -> None:
    # An encoder called directly (as generate() does) prefetches past its own end.
    torch.manual_seed(0)
    blocks = lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # noqa: E731
    model = nn.Sequential(blocks(), blocks()).eval()
    reference = nn.Sequential(blocks(), blocks()).eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 8)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager, torch.no_grad():
        model(x)
        model(x)
        assert torch.equal(model[0](x), reference[0](x))
        assert pager._table.held == 0  # nothing prefetched for the decoder stays
        for net in (model, reference):
            net[1][0].weight.data.zero_()
        assert torch.equal(model(x), reference(x))


def test_a_submodule_called_before_the_model_ever_ran_is_watched_and_then_learned() -> None:
    # An encoder called first (as generate() does), its attention reading out_proj.weight
    # without calling out_proj: those reads must get device copies from the first call on.
    torch.manual_seed(0)
    model = small_vit().eval()
    reference = small_vit().eval()
    reference.load_state_dict(model.state_dict())
    tokens = torch.randn(2, 17, 64)
    images = torch.randn(2, 3, 32, 32)
    probe = HostMasterProbe(_storages(model))
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        with probe, torch.no_grad():
            for _ in range(3):
                assert torch.equal(model.encoder(tokens), reference.encoder(tokens))
            calls = pager._learner.calls
            assert len(calls) < 2 * len(dict(model.named_modules()))  # not growing
            assert torch.equal(model(images), reference(images))  # learns from here
            hits = pager.stats.prefetch_hits
            assert torch.equal(model(images), reference(images))
            assert torch.equal(model.encoder(tokens), reference.encoder(tokens))
    assert probe.offenders == []
    assert pager.stats.prefetch_hits > hits


def test_a_module_inside_a_paged_unit_called_on_its_own_brings_in_its_weights() -> None:
    torch.manual_seed(0)
    model = small_vit().eval()
    reference = small_vit().eval()
    reference.load_state_dict(model.state_dict())
    layer = model.encoder.layers[1]
    unit = module_sizes(model).subtree_bytes["encoder.layers.encoder_layer_1"]
    images = torch.randn(2, 3, 32, 32)
    tokens = torch.randn(2, 17, 64)
    probe = HostMasterProbe(_storages(model))
    with adaptive.page(model, "cpu", unit_bytes=unit, resident_bytes=0) as pager:
        assert "encoder.layers.encoder_layer_1" in {u.module for u in pager.plan.units}
        with probe, torch.no_grad():
            assert torch.equal(model(images), reference(images))
            assert torch.equal(model(images), reference(images))
            for inner, ref in ((layer.self_attention, reference.encoder.layers[1].self_attention),
                               (layer.mlp[0], reference.encoder.layers[1].mlp[0])):
                for _ in range(2):
                    if isinstance(inner, nn.MultiheadAttention):
                        got, want = inner(tokens, tokens, tokens)[0], ref(tokens, tokens, tokens)[0]
                    else:
                        got, want = inner(tokens), ref(tokens)
                    assert torch.equal(got, want)
                    assert pager._table.held == 0  # released when the call ended
            assert torch.equal(model(images), reference(images))
    assert probe.offenders == []


class _Skips(nn.Module):
    """Calls a layer of a block directly on some inputs, past the block itself."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        return self.head(self.block[1](x) if skip else self.block(x))


def test_a_layer_of_a_unit_called_where_its_unit_is_not_running_brings_in_its_weights() -> None:
    torch.manual_seed(0)
    model, reference = _Skips().eval(), _Skips().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 8)
    unit = module_sizes(model).subtree_bytes["block"]
    probe = HostMasterProbe(_storages(model))
    with adaptive.page(model, "cpu", unit_bytes=unit, resident_bytes=0) as pager:
        with probe, torch.no_grad():
            for skip in (False, False, True, True, False):  # learned without the skip
                assert torch.equal(model(x, skip=skip), reference(x, skip=skip))
                assert pager._table.held == 0
    assert probe.offenders == []


class _Recursive(nn.Module):
    """Calls itself, then uses its own weights: a frame per call, or the outer one is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        if depth:
            x = self(x, depth - 1)
        return self.lin(x) @ self.w


def test_a_recursive_module_inside_a_unit_called_on_its_own_keeps_its_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(_Recursive(), nn.Linear(8, 8)), nn.Linear(8, 8)).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8)
    unit = module_sizes(model).subtree_bytes["0"]
    probe = HostMasterProbe(_storages(model))
    with adaptive.page(model, "cpu", unit_bytes=unit, resident_bytes=0) as pager:
        with probe, torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), reference(x))
                assert torch.equal(model[0][0](x), reference[0][0](x))
                assert pager._table.held == 0
    assert probe.offenders == []


def test_a_module_inside_a_unit_that_does_not_fit_on_its_own_splits_the_unit() -> None:
    torch.manual_seed(0)
    pair = lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))  # noqa: E731
    model = nn.Sequential(nn.Sequential(pair(), pair()), nn.Linear(16, 16)).eval()
    reference = copy.deepcopy(model)
    layer = 16 * 16 * 4 + 16 * 4
    x = torch.randn(2, 16)
    pager, double = page_out_of_room(model, math.inf, unit_bytes=4 * layer, resident_bytes=0)
    with pager, torch.no_grad():
        assert torch.equal(model(x), reference(x))  # learned with "0" as one unit
        double.limit = layer
        assert torch.equal(model[0][1](x), reference[0][1](x))  # inside "0", 2 layers
        assert pager.stats.refinements >= 2  # "0", then "0.1"
        assert torch.equal(model(x), reference(x))


class _BorrowsFromAPagedUnit(nn.Module):
    """``r`` (kept resident) ties one of its layers to a weight of ``p`` (paged)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 64), nn.Linear(64, 16))
        self.r = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.r[1].weight = self.p[0].weight

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        x = self.p(x)
        return self.r[1](x) if skip else self.r(x)


def test_a_layer_of_a_resident_unit_tied_to_a_paged_weight_brings_that_weight_in() -> None:
    torch.manual_seed(0)
    model = _BorrowsFromAPagedUnit().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16)
    sizes = module_sizes(model)
    probe = HostMasterProbe(_storages(model))
    with adaptive.page(model, "cpu", unit_bytes=sizes.subtree_bytes["p"],
                       resident_bytes=sizes.subtree_bytes["r"]) as pager:
        assert {(u.module, u.placement) for u in pager.plan.units} == {
            ("p", "paged"), ("r", "resident")}
        with probe, torch.no_grad():
            for skip in (False, False, True):
                assert torch.equal(model(x, skip=skip), reference(x, skip=skip))
            assert torch.equal(model.r[1](x), reference.r[1](x))
            assert pager._table.held == pager._table.resident_bytes
    assert probe.offenders == []


class _ReadsAnotherUnit(nn.Module):
    """Reads its own child's weight and, directly, a weight of a module in another unit."""

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)
        self._other = [other]  # not registered: a plain reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.child.weight) + F.linear(x, self._other[0].weight)


def test_a_module_inside_a_unit_that_also_reads_another_unit_brings_in_both_on_its_own() -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.b = nn.Linear(8, 8)
    model.a = nn.Sequential(nn.Linear(8, 8), _ReadsAnotherUnit(model.b))
    model.forward = lambda x: model.b(model.a(x))  # type: ignore[method-assign]
    model.eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected, expected_inner = model(x), model.a[1](x)
    probe = HostMasterProbe(_storages(model))
    unit = module_sizes(model).subtree_bytes["a"]
    with adaptive.page(model, "cpu", unit_bytes=unit, resident_bytes=0) as pager:
        with probe, torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), expected)
                assert torch.equal(model.a[1](x), expected_inner)
                assert pager._table.held == 0
    assert probe.offenders == []


def test_nested_inputs_and_keyword_arguments_reach_the_forward() -> None:
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, pair: tuple[torch.Tensor, list[torch.Tensor]], *,
                    extra: dict[str, torch.Tensor]) -> dict[str, Any]:
            x, rest = pair
            return {"out": self.a(x) + self.b(rest[0]) * extra["w"], "n": len(rest)}

    model = Nested().eval()
    x, y, w = torch.randn(2, 4), torch.randn(2, 4), torch.randn(4)
    expected = model((x, [y]), extra={"w": w})
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        out = model((x, [y]), extra={"w": w})
    assert torch.equal(out["out"], expected["out"]) and out["n"] == 1


def test_exception_in_forward_passes_through_and_releases_device_copies() -> None:
    boom = ValueError("boom")

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            if self.fail:
                raise boom
            return self.b(x)

    model = Fails().eval()
    x = torch.randn(1, 4)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        for _ in range(2):
            with pytest.raises(ValueError) as info:
                model(x)
            assert info.value is boom
            assert pager._table.held == 0 and not pager._stack
        model.fail = False
        with torch.no_grad():
            out = model(x)
    assert torch.equal(out, model.b(model.a(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("unit_bytes", [0, None])
def test_a_model_that_calls_itself_is_one_forward_with_outputs_on_the_input_device(
        unit_bytes: int | None) -> None:
    torch.manual_seed(0)
    model = CallsItself().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        # Computed on the device itself: a GPU's kernels round differently from the CPU's.
        expected = copy.deepcopy(model).cuda()(x.cuda()).cpu()
    with adaptive.page(model, "cuda", unit_bytes=unit_bytes, resident_bytes=0) as pager:
        with torch.no_grad():
            outs = [model(x) for _ in range(3)]
            assert all(out.device.type == "cpu" and torch.equal(out, expected) for out in outs)
            assert pager.stats.forwards == 3
            # A forward interrupted past its hooks leaves its frames behind; the next call
            # of the model is not taken for a call from inside it, and releases them.
            model.interrupt = True
            with pytest.raises(KeyboardInterrupt):
                model(x)
            assert pager._stack
            model.interrupt = False
            assert torch.equal(model(x), expected)
            assert not pager._stack and pager._table.held == 0



class _Passes(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        return func(*args, **(kwargs or {}))


def _modes() -> list[Any]:
    return torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize("caught", ["outside both", "between them"])
def test_a_watched_forward_interrupted_inside_callers_modes_leaves_none_of_them_on(
        caught: str, caplog: pytest.LogCaptureFixture) -> None:
    # See [Note: a watched forward cut short inside a mode]: the modes' exits pop the pager's
    # probe in place of one of them, which torch would otherwise keep on for good.
    torch.manual_seed(0)
    model = CallsItself().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    outer = _Passes()
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        model.interrupt = True  # in the first forward, the watched one
        if caught == "outside both":
            with pytest.raises(KeyboardInterrupt), outer, torch.device("cpu"):
                model(x)
            assert _modes() == [outer]  # popped the device's mode in place of its own
        else:
            with outer:
                with pytest.raises(KeyboardInterrupt), torch.device("cpu"):
                    model(x)
                assert [type(m).__name__ for m in _modes()] == ["_Passes", "DeviceContext"]
                model.interrupt = False
                with caplog.at_level(logging.WARNING, logger="adaptmem"):
                    assert torch.equal(model(x), expected)
                assert _modes() == [outer]  # still inside it, as the code is
        model.interrupt = False
        with caplog.at_level(logging.WARNING, logger="adaptmem"):
            assert torch.equal(model(x), expected)
        assert _modes() == []
    assert sum("cut short" in r.getMessage() for r in caplog.records) == 1


def test_forwards_after_the_learning_one_take_the_fused_attention_path_bitwise() -> None:
    # Only the watched (learning) forward runs under the pager's mode, which turns PyTorch's
    # fused attention path off; what docs/limitations.md says.
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        fused = model(x)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            unfused = model(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        first, *later = (model(x) for _ in range(3))
    assert torch.equal(first, unfused)
    assert all(torch.equal(y, fused) for y in later)


# -- granularity fallback ----------------------------------------------------------------------


def _blocks() -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
                            for _ in range(3)]).eval()
    x = torch.randn(2, 64)
    layer = 64 * 64 * 4 + 64 * 4
    return model, x, model(x).detach(), layer


def test_device_budget_smaller_than_the_units_forces_refinement(
    adaptmem_log: pytest.LogCaptureFixture,
) -> None:
    model, x, expected, layer = _blocks()
    budget = 3 * layer  # a block (2 layers) plus one prefetched layer, never the whole model
    with adaptive.page(model, "cpu", unit_bytes=None, resident_bytes=0,
                       device_budget=budget) as pager, torch.no_grad():
        assert [u.module for u in pager.plan.units] == [""]
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
    assert pager.stats.refinements > 0
    assert pager.stats.peak_device_bytes <= budget
    assert pager.plan.refinements and pager.plan.refinements[0]["unit"] == "<root>"
    assert len(pager.plan.units) > 1
    assert any("split into" in r.message and r.levelno == logging.INFO
               for r in adaptmem_log.records)


def test_a_budget_below_what_one_module_needs_is_refused_at_page_naming_the_smallest() -> None:
    model, x, expected, layer = _blocks()
    before = _record(model)
    with pytest.raises(ValueError, match=(
            rf"device_budget=.*\({layer // 2} bytes\) is less than module '0\.0' needs.*"
            rf"\({layer} bytes\).*largest tensor '0\.0\.weight' 16\.0 KiB.*"
            rf"device_budget={layer} or more")):
        adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0, device_budget=layer // 2)
    assert _untouched(model, before)
    with pytest.raises(ValueError, match=rf"device_budget={layer} or more"):
        adaptive.page(model, "cpu", device_budget=layer - 1)  # the defaults too
    assert _untouched(model, before)
    # The smallest budget named runs, with or without the defaults.
    for options in ({"unit_bytes": 0, "resident_bytes": 0}, {}):
        with adaptive.page(model, "cpu", device_budget=layer, **options) as pager, \
                torch.no_grad():
            assert torch.equal(model(x), expected)
        assert pager.stats.peak_device_bytes <= layer


def _pager_past_the_checks(model: nn.Module, **options: Any) -> adaptive.Pager:
    """A pager ``page()`` would refuse: what a model whose needs only its forward shows (a
    module reading weights another owns) meets at run time."""
    options = {"unit_bytes": None, "prefetch": 1, "resident_bytes": None,
               "device_budget": None, "pin_memory": False, "output_device": None, **options}
    return adaptive.Pager(model, torch.device("cpu"), **options)


def test_resident_units_that_leave_no_room_to_page_the_rest_are_refused() -> None:
    # page() took them, and every call then ran out of memory.
    model, x, expected, layer = _blocks()
    with pytest.raises(ValueError, match=rf"resident_bytes=.* would keep .*\(module '0\.2'\).*"
                                         rf"more than device_budget=.*resident_bytes under "
                                         rf"{layer} "):
        adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=layer,
                      device_budget=layer + layer // 2)
    assert torch.equal(model(x), expected)  # untouched
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=layer - 1,
                       device_budget=layer + layer // 2), torch.no_grad():
        assert torch.equal(model(x), expected)


def test_resident_units_that_fill_the_device_are_refused_naming_what_fits() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).eval()  # 32 MiB
    x = torch.ones(1, 1024)
    with simulated_cuda(devices=1, total_memory="32MiB"):
        with pytest.raises(ValueError, match=r"keep 28\.0 MiB .* needs 4\.0 MiB more .*\(module "
                                             r"'7'\).* all of the 32\.0 MiB .* cuda:0, .*"
                                             r"resident_bytes under (\d+) \(28\.0 MiB\)") as info:
            adaptive.page(model, "cuda", resident_bytes="31MiB")
        assert model[0].weight.device.type == "cpu"
        largest = int(re.search(r"under (\d+)", str(info.value))[1]) - 1  # type: ignore[index]
        with adaptive.page(model, "cuda", resident_bytes=largest) as pager, torch.no_grad():
            model(x)
            assert pager.stats.peak_device_bytes <= 28 * 2**20 + 8 * 2**12


def test_a_tensor_that_does_not_fit_beside_resident_units_raises_a_transfer_error() -> None:
    model, x, expected, layer = _blocks()
    pager = _pager_past_the_checks(model, unit_bytes=0, resident_bytes=layer,
                                   device_budget=layer + layer // 2)
    with pytest.raises(OutOfMemoryError, match=r"'0\.2'.*KiB.*device_budget") as info:
        model(x)
    assert info.value.phase == "transfer"
    pager.remove()
    assert torch.equal(model(x), expected)


class OutOfRoomTransfer(SyncTransfer):
    """A device with ``limit`` bytes: copies beyond it raise a real torch OOM."""

    def __init__(self, limit: float) -> None:
        super().__init__(torch.device("cpu"))
        self.pager: Any = None  # the pager it serves, once there is one
        self.limit = limit
        self.failures = 0

    def start(self, hosts: Any, runs: Any = ()) -> Any:
        need = sum(h.numel() * h.element_size() for h in hosts)
        held = 0 if self.pager is None else self.pager._table.held
        if held + need > self.limit:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (test double)")
        return super().start(hosts, runs)


def page_out_of_room(model: nn.Module, limit: float,
                     **options: Any) -> tuple[adaptive.Pager, OutOfRoomTransfer]:
    """``model`` paged to a CPU "device" that holds ``limit`` bytes of weights."""
    double = OutOfRoomTransfer(limit)
    pager = adaptive.page(model, "cpu", _transfer=double, **options)
    double.pager = pager
    return pager, double


class TakesALayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, shared: nn.Module) -> torch.Tensor:
        return self.b(shared(self.a(x)))


class OwnsABufferAroundAChild(nn.Module):
    """A module with a tensor of its own that it holds while its child runs (as BERT's
    embeddings hold ``position_ids`` around their embedding tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.arange(1024))  # 8 KiB
        self.emb = nn.Embedding(1024, 16)  # 64 KiB

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids + self.pos[: ids.shape[-1]] * 0)


def test_the_smallest_budget_counts_the_own_tensors_parents_hold_around_a_child() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OwnsABufferAroundAChild(), nn.Linear(16, 4)).eval()
    ids = torch.randint(0, 1024, (2, 5))
    with torch.no_grad():
        expected = model(ids)
    need = 1024 * 8 + 1024 * 16 * 4
    with pytest.raises(ValueError, match=rf"module '0.emb' needs .*\({need} bytes\) of "
                                         rf"weights, 8.0 KiB of it its parents' own tensors.*"
                                         rf"device_budget={need} or more"):
        adaptive.page(model, "cpu", device_budget=need - 1, resident_bytes=0)
    # The budget named works, with or without the defaults.
    for options in ({"unit_bytes": 0, "resident_bytes": 0}, {"resident_bytes": 0}):
        with adaptive.page(model, "cpu", device_budget=need, **options), torch.no_grad():
            assert torch.equal(model(ids), expected)
    # With a resident unit taking some of it, the transfer error says what the running
    # parent holds cannot be split by unit_bytes, and the budget it needs.
    with pytest.raises(ValueError, match=r"module '0.emb'\): .* more than device_budget"):
        adaptive.page(model, "cpu", device_budget=need, resident_bytes=300, unit_bytes=0)
    with _pager_past_the_checks(model, device_budget=need, resident_bytes=300,
                                unit_bytes=0), torch.no_grad():
        with pytest.raises(OutOfMemoryError) as info:
            model(ids)
    message = str(info.value)
    assert "running units hold '0' 8.0 KiB, their own tensors" in message
    assert f"needs device_budget={need}" in message and "unit_bytes below" not in message


class PassesASharedLayer(nn.Module):
    """Each block calls a layer of the parent's, passed in, between two of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(TakesALayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.shared)
        return x


def test_a_transfer_error_names_the_running_unit_holding_memory_and_the_unit_bytes_to_use(
        ) -> None:
    torch.manual_seed(0)
    model = PassesASharedLayer().eval()
    layer = module_sizes(model).subtree_bytes["shared"]  # 1088 bytes
    # Each block is a unit (2 layers); the shared layer does not fit beside the running one.
    with adaptive.page(model, "cpu", unit_bytes=2 * layer, resident_bytes=0,
                       device_budget=2 * layer + layer // 2), torch.no_grad():
        with pytest.raises(OutOfMemoryError) as info:
            model(torch.randn(2, 16))
    message = str(info.value)
    assert "running units hold 'blocks.0' 2.1 KiB" in message
    assert "unit_bytes below 2.1 KiB splits 'blocks.0'" in message
    with adaptive.page(model, "cpu", unit_bytes=layer, resident_bytes=0,
                       device_budget=2 * layer + layer // 2), torch.no_grad():
        model(torch.randn(2, 16))  # what the message says works


def test_transfer_oom_refines_the_unit_and_the_same_forward_continues() -> None:
    model, x, expected, layer = _blocks()
    pager, double = page_out_of_room(model, 3 * layer, unit_bytes=None, resident_bytes=0)
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    with pager, torch.no_grad():
        assert torch.equal(model(x), expected)
    handle.remove()
    assert calls == [1]  # nothing ran twice
    assert double.failures > 0 and pager.stats.refinements > 0
    assert pager.plan.refinements[0]["reason"] == "out of memory"


def test_transfer_oom_that_cannot_be_resolved_keeps_the_original_type_and_phase() -> None:
    model, x, expected, layer = _blocks()
    pager, _ = page_out_of_room(model, layer // 2, unit_bytes=None, resident_bytes=0)
    with pytest.raises(torch.OutOfMemoryError) as info:
        model(x)
    err = info.value
    assert isinstance(err, OutOfMemoryError) and err.phase == "transfer"
    assert not err.beyond_device  # the device could hold it, were other memory free
    assert isinstance(err.__cause__, torch.OutOfMemoryError)
    assert "0.0" in str(err)
    pager.remove()
    assert torch.equal(model(x), expected)


def test_auto_sizes_keep_resident_units_plus_the_working_set_within_the_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
                            for _ in range(8)]).eval()
    total = module_sizes(model).total_bytes
    budget = total // 2
    x = torch.randn(2, 32)
    expected = model(x)
    with adaptive.page(model, "cpu", device_budget=budget) as pager, torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), expected)
        units = pager.plan.units
        resident = sum(u.nbytes for u in units if u.placement == "resident")
        paged = [u.nbytes for u in units if u.placement == "paged"]
        assert resident > 0 and paged  # some of each
        assert resident + (pager.prefetch + 2) * max(paged) <= budget
        assert pager.stats.peak_device_bytes <= budget and pager.stats.refinements == 0


# -- bad input ---------------------------------------------------------------------------------


def _untouched(model: nn.Module, before: dict[str, tuple[torch.Tensor, int]]) -> bool:
    now = dict([*model.named_parameters(), *model.named_buffers()])
    return (not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
            and all(now[n] is t and t.data_ptr() == p for n, (t, p) in before.items()))


def _record(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (t, t.data_ptr()) for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"device": "tpu:0"}, ValueError, "device"),
        ({"device": "cuda:7" if torch.cuda.is_available() else "cuda"}, ValueError, "cuda"),
        ({"unit_bytes": -1}, ValueError, "unit_bytes"),
        ({"unit_bytes": "lots"}, ValueError, "unit_bytes='lots'"),
        ({"resident_bytes": "-2MiB"}, ValueError, "resident_bytes"),
        ({"device_budget": [1]}, TypeError, "device_budget"),
        ({"prefetch": -1}, ValueError, "prefetch"),
        ({"prefetch": 1.5}, TypeError, "prefetch"),
        ({"resident_bytes": "2MiB", "device_budget": "1MiB"}, ValueError, "resident_bytes"),
        ({"unit_bytes": float("inf")}, ValueError, "unit_bytes must be a finite"),
        ({"device_budget": "1e400"}, ValueError, "device_budget must be a finite"),
    ],
)
def test_bad_options_are_refused_and_the_model_is_untouched(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    before = _record(model)
    options = {"device": "cpu", **options}
    with pytest.raises(error, match=match):
        adaptive.page(model, **options)
    assert _untouched(model, before)


def test_a_model_in_training_mode_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout())
    model[0].eval()
    before = _record(model)
    with pytest.raises(PlacementError, match=r"training mode.*model\.eval\(\)"):
        adaptive.page(model, "cpu")
    assert _untouched(model, before)


def test_a_model_built_under_inference_mode_is_refused_with_the_way_out() -> None:
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    before = _record(model)
    with pytest.raises(PlacementError, match=r"inference tensor.*copy\.deepcopy\(model\)"):
        adaptive.page(model, "cpu")
    assert _untouched(model, before)
    copied = copy.deepcopy(model)  # the way out the error names
    x = torch.randn(2, 4)
    with adaptive.page(copied, "cpu", unit_bytes=0, resident_bytes=0), torch.inference_mode():
        assert torch.equal(copied(x), model(x)) and torch.equal(copied(x), model(x))


def test_sizes_take_numpy_numbers_and_round_fractions_of_a_byte_down() -> None:
    import numpy as np

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    layer = 4 * 4 * 4 + 4 * 4
    with adaptive.page(model, "cpu", unit_bytes=np.int64(layer), resident_bytes=np.float64(0),
                       device_budget=np.float64(40 * layer + 0.7)) as pager:  # 0.8 * free
        assert pager.plan.options["unit_bytes"] == layer
        assert pager.plan.options["resident_bytes"] == 0
        assert pager.plan.options["device_budget"] == 40 * layer
    # A fraction under 1 KiB is a unit left out ("0.5" meant as GiB), not half a byte.
    with pytest.raises(ValueError, match=r"resident_bytes=0.5: sizes are bytes"):
        adaptive.page(model, "cpu", resident_bytes=0.5)


def test_meta_parameters_are_refused_with_a_pointer_to_load() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4).eval()
    with pytest.raises(PlacementError, match=r"meta.*adaptive\.load"):
        adaptive.page(model, "cpu")
    assert not model._forward_pre_hooks


def test_paging_twice_or_a_part_of_a_paged_model_is_refused() -> None:
    inner = nn.Sequential(nn.Linear(4, 4)).eval()
    outer = nn.Sequential(inner, nn.Linear(4, 4)).eval()
    with adaptive.page(outer, "cpu", resident_bytes=0):
        with pytest.raises(PlacementError, match="this model is already paged"):
            adaptive.page(outer, "cpu")
        with pytest.raises(PlacementError, match="part of a paged model"):
            adaptive.page(inner, "cpu")
    with adaptive.page(inner, "cpu", resident_bytes=0):
        with pytest.raises(PlacementError, match="submodule of this model is already paged"):
            adaptive.page(outer, "cpu")
    with adaptive.page(outer, "cpu", resident_bytes=0):  # after remove() it may be paged again
        pass


def test_page_rejects_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        adaptive.page("resnet50")  # type: ignore[arg-type]


# -- the loading protocol ----------------------------------------------------------------------


def test_load_targets_fill_in_place_reaches_masters_and_resident_copies() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    layer = 8 * 8 * 4 + 8 * 4
    x = torch.randn(2, 8)
    pager = adaptive.page(model, "cpu", unit_bytes=layer, resident_bytes=layer)
    targets = pager.load_targets()
    assert list(targets) == list(module_sizes(model).tensors)
    assert [len(targets[n]) for n in ("0.weight", "1.weight")] == [2, 1]  # resident, paged
    with torch.no_grad():
        for i, (_, tensors) in enumerate(targets.items()):
            for t in tensors:
                t.fill_(0.01 * (i + 1))
        out = model(x)
    pager.remove()
    with torch.no_grad():
        assert torch.equal(out, model(x))  # the masters hold the loaded values
        assert torch.all(model[2].bias == 0.06)


# -- unseen paths, the transfer interface, any budget, inference_mode --------------------------


def test_a_path_the_first_forward_did_not_take_is_watched_and_learned(
    adaptmem_log: pytest.LogCaptureFixture,
) -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.common = nn.Linear(8, 8)
            self.rare = ReadsChildWeight(8)

        def forward(self, x: torch.Tensor, rare: bool = False) -> torch.Tensor:
            x = self.common(x)
            return self.rare(x) if rare else x

    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(2, 8)
    expected = model(x, rare=True)
    probe = HostMasterProbe(_storages(model) - {model.rare.gate.untyped_storage().data_ptr()})
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        with probe, torch.no_grad():
            model(x)  # learns without the rare branch
            assert torch.equal(model(x, rare=True), expected)  # watched by the probe
            assert torch.equal(model(x, rare=True), expected)  # relearned
            assert torch.equal(model(x, rare=True), expected)
            for rare in (False, True, False, True):  # both paths known: no more relearning
                model(x, rare=rare)
                learner = pager._learner
                assert not learner.learning and not learner.relearn and learner.probe is None
        assert {"rare.inner.weight", "rare.inner.bias"} <= {
            s.name for s in pager._needs.by_module[id(model.rare)]}
    assert probe.offenders == []
    assert sum("ran for the first time" in r.message for r in adaptmem_log.records) == 1


class DeferredTransfer(SyncTransfer):
    """Speaks the interface the way the CUDA stream transfer does: hits and misses of
    prefetched copies are only known later, from settle()."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.unsettled = 0
        self.demands = 0

    def wait(self, groups: Any, demand: bool) -> bool | None:
        assert isinstance(demand, bool) and groups
        for _ticket, copies in groups:
            assert all(isinstance(c, torch.Tensor) for c in copies)
        if demand:
            self.demands += 1
            return True
        self.unsettled += 1
        return None

    def settle(self, block: bool = True) -> tuple[int, int]:
        if not block:
            return 0, 0
        hits, self.unsettled = self.unsettled, 0
        return hits, 0


def test_pager_speaks_the_transfer_interface_with_deferred_hits() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)]).eval()
    layer = 16 * 16 * 4 + 16 * 4
    x = torch.randn(2, 16)
    expected = model(x)
    transfer = DeferredTransfer(torch.device("cpu"))
    with adaptive.page(model, "cpu", unit_bytes=layer, resident_bytes=layer,
                       _transfer=transfer) as pager:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), expected)
        stats = pager.stats  # settles
    assert stats.prefetch_misses == transfer.demands - 1  # minus making unit 0 resident
    assert stats.prefetch_hits > 0 and transfer.unsettled == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=module_trees(), share=st.floats(0.0, 1.2), prefetch=st.integers(0, 2))
def test_any_device_budget_gives_the_unpaged_output_within_budget_or_a_transfer_error(
    tree: nn.Module, share: float, prefetch: int
) -> None:
    sizes = module_sizes(tree)
    budget = max(1, int(sizes.total_bytes * share))  # 0 is refused at page()
    x = torch.randn(2, DIM)
    with torch.no_grad():
        expected = tree(x)
    before = {k: v.clone() for k, v in tree.state_dict().items()}
    # What one module needs at once: its own tensors (never split), beside the own tensors
    # of every ancestor, which hold theirs while it runs. Less is refused at page().
    def with_ancestors(module: str, names: set[str]) -> set[str]:
        while module:
            module = module.rpartition(".")[0]
            names |= set(sizes.own[module])
        return names

    smallest = max((sizes.bytes_of(with_ancestors(u.module, {*u.tensors, *u.borrowed}))
                    for u in paging_units(sizes, 0)), default=0)
    if budget < smallest:
        event("refused at page()")
        with pytest.raises(ValueError, match=rf"device_budget={smallest} or more"):
            adaptive.page(tree, "cpu", unit_bytes=None, resident_bytes=0, prefetch=prefetch,
                          device_budget=budget)
        assert not any(m._forward_pre_hooks for m in tree.modules())
        return
    with adaptive.page(tree, "cpu", unit_bytes=None, resident_bytes=0, prefetch=prefetch,
                       device_budget=budget) as pager, torch.no_grad():
        # The smallest budget page() takes always works, refining as it must.
        outputs = [tree(x), tree(x)]
        event("refined" if pager.stats.refinements else "fits as planned")
        assert all(torch.equal(out, expected) for out in outputs)
        assert pager.stats.peak_device_bytes <= budget
    after = tree.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(tree(x), expected)


def test_inference_mode_forwards_leave_a_model_usable_with_autograd_on() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).eval()
    x = torch.randn(2, 8)
    expected = model(x).detach()
    with torch.inference_mode():
        pager = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=300)
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)  # ends by prefetching the next forward's start
    assert torch.equal(model(x).detach(), expected)
    with torch.inference_mode():
        pager.remove()
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model(x).detach(), expected)


# -- with @adaptive.batch ----------------------------------------------------------------------


class FailsOverBatch(nn.Module):
    """Runs out of memory in compute when the batch is larger than ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body[0](x)
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (test double)")
        return self.body[2](self.body[1](y))


def test_batch_decorator_shrinks_for_compute_ooms_inside_a_paged_model() -> None:
    torch.manual_seed(0)
    model = FailsOverBatch(limit=4).eval()
    data = torch.randn(16, 8)
    expected = model.body(data)
    sizes = []

    @adaptive.batch(initial_batchsize=16, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> torch.Tensor:
        sizes.append(batchsize)
        return torch.cat([model(data[i:i + batchsize]) for i in range(0, 16, batchsize)])

    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        with torch.no_grad():
            out = infer()
        assert pager._table.held <= 2 * (8 * 8 * 4 + 8 * 4) and not pager._stack
    assert sizes[0] == 16 and sizes[-1] <= 4
    torch.testing.assert_close(out, expected)


def test_batch_decorator_does_not_shrink_for_a_transfer_oom_of_the_pager() -> None:
    model, x, expected, layer = _blocks()
    sizes = []

    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> torch.Tensor:
        sizes.append(batchsize)
        return model(x[:batchsize])

    pager, _ = page_out_of_room(model, layer // 2, unit_bytes=0, resident_bytes=0)
    with pager, pytest.raises(OutOfMemoryError) as info, torch.no_grad():
        infer()
    assert info.value.phase == "transfer" and isinstance(info.value, torch.OutOfMemoryError)
    assert sizes == [8]
    # It says why the batch stayed, and what searches both; with nothing resident, it does
    # not advise lowering resident_bytes.
    message = str(info.value)
    assert "reached " in message and "does not shrink its batchsize" in message
    assert "model=<the model>" in message and "resident_bytes" not in message
    assert message.count("does not shrink") == 1


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_outputs_come_back_on_the_input_device_and_masters_are_pinned() -> None:
    model, _, kwargs, expected = zoo("tiny_gpt")
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0) as pager:
        with torch.no_grad():
            out = model(**kwargs)
        assert all(s.master.is_pinned() for s in pager._table.slots.values())
    assert out["logits"].device.type == "cpu"
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_real_oom_under_a_memory_fraction_triggers_refinement() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))
                            for _ in range(8)]).eval()  # 8 x 32 MiB
    x = torch.randn(4, 2048)
    expected = model(x)
    free, total = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((used + 100 * 2**20) / total)
    try:
        with adaptive.page(model, "cuda", unit_bytes=None, resident_bytes=0) as pager:
            with torch.no_grad():
                out = model(x)
        assert pager.stats.refinements > 0
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.simulated_cuda(total_memory="16MiB")
def test_gpu_resident_bytes_above_what_the_device_holds_is_refused_at_page() -> None:
    # Accepted once, then every call ran out of memory until remove().
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(5)]).eval()  # 20 MiB
    before = _record(model)
    total = torch.cuda.get_device_properties(0).total_memory
    # The simulated device holds 16 MiB; a real one is made to, by a memory fraction.
    torch.cuda.set_per_process_memory_fraction(16 * 2**20 / total if REAL_CUDA else 1.0)
    try:
        with pytest.raises(ValueError, match=r"resident_bytes=1\.0 GiB would keep 20\.0 MiB "
                                             r"of weights on cuda:0, which this process can "
                                             r"hold 16\.0 MiB of at most"):
            adaptive.page(model, "cuda", resident_bytes="1GiB")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert _untouched(model, before)
    with adaptive.page(model, "cuda", resident_bytes="8MiB"), torch.no_grad():
        assert model(torch.randn(2, 1024)).shape == (2, 1024)
    small = nn.Linear(8, 8).eval()  # a model that fits: any resident_bytes keeps it all
    with adaptive.page(small, "cuda", resident_bytes="1GiB"), torch.no_grad():
        assert small(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.gpu
def test_gpu_a_layer_that_does_not_fit_says_the_device_ran_out_not_a_budget() -> None:
    # No device_budget was given: the error must not tell the user to raise one, and it
    # says that free memory counts cached blocks, which may not serve a block this size.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.Linear(2048, 8)).eval()  # 2 MiB layer
    cached = hold_cached_blocks()  # (a real GPU's, from earlier tests, would serve 2 MiB)
    used = torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    # 3 MiB more: a 2 MiB segment of small blocks (the inputs) leaves no room for 2 MiB.
    torch.cuda.set_per_process_memory_fraction((used + 3 * 2**20) / total)
    try:
        with adaptive.page(model, "cuda", resident_bytes=0), torch.no_grad():
            with pytest.raises(OutOfMemoryError) as info:
                model(torch.randn(2, 256))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del cached
        torch.cuda.empty_cache()
    message = str(info.value)
    assert info.value.phase == "transfer" and "module '0' needs 2.0 MiB" in message
    assert "the device ran out of memory for it" in message
    assert "by the allocator's count (cached blocks included" in message
    assert "device_budget" not in message and "expandable_segments" in message
    assert "resident_bytes" not in message  # nothing resident: nothing to lower


@pytest.mark.gpu
@pytest.mark.simulated_cuda(bandwidth=4)  # GB/s: 1 ms per 4 MiB copy
def test_gpu_prefetch_hides_transfers_when_compute_per_unit_is_longer() -> None:
    torch.manual_seed(0)
    # 4 MiB each; the first of each forward is fetched on demand (1 in 32 transfers)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(32)]).eval()
    # ~70 GFLOP per layer on a GPU (2 on the simulated one, computed by the CPU): well
    # above one 4 MiB copy either way
    x = torch.randn(32768 if REAL_CUDA else 1024, 1024)
    with torch.no_grad():
        expected = copy.deepcopy(model).cuda()(x.cuda()).cpu()
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0, prefetch=2) as pager:
        with torch.no_grad():
            model(x)
            pager.stats.reset()
            outs = [model(x) for _ in range(3)]
            torch.cuda.synchronize()
    stats = pager.stats
    assert stats.prefetch_misses < 0.1 * (stats.prefetch_hits + stats.prefetch_misses)
    for out in outs:  # computed on copies that had arrived, not on memory still being filled
        torch.testing.assert_close(out, expected)


@pytest.mark.gpu
def test_gpu_submodules_called_on_their_own_bring_in_their_weights() -> None:
    # An encoder called by generate() with device inputs, before and after the first
    # forward; a block's MLP inside a paged unit.
    torch.manual_seed(0)
    model = small_vit().eval()
    reference = copy.deepcopy(model).cuda()
    tokens = torch.randn(2, 17, 64, device="cuda")
    images = torch.randn(2, 3, 32, 32)
    unit = module_sizes(model).subtree_bytes["encoder.layers.encoder_layer_1"]
    with adaptive.page(model, "cuda", unit_bytes=unit, resident_bytes=0), torch.no_grad():
        for _ in ("before", "after"):
            for name in ("encoder", "encoder.layers.encoder_layer_1.mlp"):
                torch.testing.assert_close(model.get_submodule(name)(tokens),
                                           reference.get_submodule(name)(tokens))
            torch.testing.assert_close(model(images), reference(images.cuda()).cpu())


@pytest.mark.gpu
def test_gpu_a_model_already_on_cuda_is_paged_and_put_back_there_bitwise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)).cuda().eval()
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    x = torch.randn(4, 64, device="cuda")
    with torch.no_grad():
        expected = model(x)
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0) as pager:
        assert all(s.master.device.type == "cpu" for s in pager._table.slots.values())
        with torch.no_grad():
            assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == "cuda" and t.dtype == before[n].dtype
        assert torch.equal(t, before[n])


@pytest.mark.gpu
def test_gpu_a_buffer_written_in_place_keeps_what_was_written() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Accumulates(), nn.Linear(8, 8), _Accumulates()).eval()
    reference = copy.deepcopy(model).cuda()
    xs = [torch.randn(3, 8) for _ in range(4)]
    with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=0), torch.no_grad():
        for x in xs:
            torch.testing.assert_close(model(x), reference(x.cuda()).cpu())
    torch.testing.assert_close(model[0].total, reference[0].total.cpu())
    torch.testing.assert_close(model[2].total, reference[2].total.cpu())


class RecordingTransfer(SyncTransfer):
    """Logs which host tensors each copy starts, into a log the test shares."""

    def __init__(self, device: torch.device, log: list[tuple[str, Any]]) -> None:
        super().__init__(device)
        self.log = log

    def start(self, hosts: Any, runs: Any = ()) -> Any:
        self.log.append(("copy", [id(h) for h in hosts]))
        return super().start(hosts, runs)


def test_prefetch_depth_counts_large_units_so_a_tiny_one_between_does_not_idle_the_link() -> None:
    """prefetch=1 with LayerNorms (512 B) between Linears (16 KiB): while a Linear runs, the
    next Linear is already being copied, not only the LayerNorm before it ([Note: prefetch
    depth counts the units that matter])."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.LayerNorm(64), nn.Linear(64, 64))])
    model.eval()
    x = torch.randn(2, 64)
    log: list[tuple[str, Any]] = []
    linear = 64 * 64 * 4 + 64 * 4
    with adaptive.page(model, "cpu", unit_bytes=linear, resident_bytes=0, prefetch=1,
                       _transfer=RecordingTransfer(torch.device("cpu"), log)) as pager:
        masters = {id(s.master): s.name for s in pager._table.slots.values()}
        for i, m in enumerate(model):
            m.register_forward_pre_hook(lambda mod, args, i=i: log.append(("run", i)))
        with torch.no_grad():
            model(x)  # learns the order
            log.clear()
            assert torch.equal(model(x), nn.Sequential(*model)(x))
    started: set[str] = set()
    for kind, what in log:
        if kind == "copy":
            started |= {masters[h].split(".")[0] for h in what}
        elif what % 2 == 1 and what + 2 < len(model):  # a Linear with another one after it
            assert str(what + 2) in started, f"Linear {what} runs, Linear {what + 2} not on its way"


@pytest.mark.parametrize("resident_mib", [1.5, 5])
def test_resident_bytes_below_the_model_keeps_units_resident_even_with_room_to_spare(
        resident_mib: float) -> None:
    # With memory to spare the automatic units are coarse (the whole model is one): a share
    # smaller than that unit kept nothing resident. Units no larger than the share keep part.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 1024, bias=False), nn.ReLU(),
                          nn.Linear(1024, 512)).eval()  # 1, 2 and 2 MiB
    x = torch.randn(4, 512)
    resident = int(resident_mib * 2**20)
    with torch.no_grad():
        want = model(x)
        with adaptive.page(model, "cpu", resident_bytes=resident) as pager:
            got = model(x)
            held = sum(u.nbytes for u in pager.plan.units if u.placement == "resident")
    assert torch.equal(got, want)
    assert 0 < held <= resident


def test_a_share_no_unit_fits_in_keeps_the_coarse_units() -> None:
    # 4 MiB layers and a 2 MiB share: finer units would keep nothing resident either, and
    # page each forward in three transfers instead of one.
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(3)]).eval()
    with torch.no_grad(), adaptive.page(model, "cpu", resident_bytes=2 << 20) as pager:
        model(torch.randn(2, 1024))
        assert [u.placement for u in pager.plan.units] == ["paged"]


@pytest.mark.parametrize("held", [held_in_flight, held_in_own_code])
def test_a_second_thread_forward_is_refused_while_one_runs(held: Any) -> None:
    # A second thread's call was taken for a new outermost call: it released the running
    # forward's weights (on a GPU, kernels reading memory given to other copies) and could
    # leave weights on the device, refused at every later call. Then the refused call's
    # post-hook (torch runs it after the pre-hook raised) ended a forward waiting in the
    # model's own code: it popped its frame, took its inputs and let the model go, so the
    # next call ran beside it.
    import threading

    model, gate = held()
    started, go_on = gate.started, gate.go_on
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    results: list[torch.Tensor] = []
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        model(x)
        first = threading.Thread(target=lambda: results.append(model(x)))
        first.start()
        assert started.wait(10)
        for _ in range(2):
            with pytest.raises(PlacementError, match="another thread is running a forward"):
                model(x)
        go_on.set()
        first.join(10)
        torch.testing.assert_close(results[0], want, rtol=0, atol=0)
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)  # and from this thread


def test_threads_racing_for_a_paged_model_are_refused_and_never_break_the_running_one() -> None:
    # Two threads that both found the model free both ran: the refusal raised IndexError,
    # and the forward that ran had its weights released under it.
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)]).eval()
    x = torch.randn(8, 128)
    with torch.no_grad():
        want = model(x)
    outcomes: list[str] = []
    deadline = time.monotonic() + 2

    def worker() -> None:
        while time.monotonic() < deadline:
            try:
                with torch.no_grad():
                    got = model(x)
                outcomes.append("ok" if torch.equal(got, want) else "WRONG")
            except PlacementError as exc:  # never the running thread's own forward
                mine = f"(thread {threading.get_ident()})" in str(exc)
                outcomes.append(f"refused its own forward: {exc}" if mine else "refused")
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                outcomes.append(f"{type(exc).__name__}: {exc}")

    with adaptive.page(model, "cpu", resident_bytes=0, unit_bytes="70KiB"):
        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert set(outcomes) <= {"ok", "refused"}, sorted(set(outcomes) - {"ok", "refused"})[:3]
    assert outcomes.count("ok") > 10


def test_an_output_object_of_the_models_own_class_left_on_the_device_is_warned_of() -> None:
    # Outputs are moved back inside tuples, lists, dicts, namedtuples and dataclasses; a
    # class of the model's own stayed on the device with nothing said.
    class Output:
        def __init__(self, hidden: torch.Tensor) -> None:
            self.hidden = hidden

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Output:
            return Output(self.a(x))

    with simulated_cuda(devices=1), torch.no_grad():
        model = Net().eval()
        with adaptive.page(model, "cuda", resident_bytes=0):
            with pytest.warns(RuntimeWarning, match=r"returned an object of class Output, "
                                                    r"whose tensors \(hidden\) stay on "
                                                    r"cuda:0.*Make Output a dataclass"):
                out = model(torch.randn(2, 8))
            assert out.hidden.device.type == "cuda"  # as the warning says


def test_a_watched_forward_cut_short_in_a_thread_strands_no_live_probe() -> None:
    # See [Note: a probe stranded on another thread]: the first (watched) forward, cut short
    # in a worker, left the pager's probe on the worker's mode stack; the next call came from
    # the main thread, and the worker's every op went on through the pager for good.
    import threading

    class Cut(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:
                raise KeyboardInterrupt
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Cut(), nn.Linear(16, 16)).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    cut, go_on = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def worker() -> None:
        with contextlib.suppress(BaseException), torch.no_grad():
            model(torch.randn(3, 16))
        cut.set()
        go_on.wait(10)
        seen["reached"] = [getattr(m, "on_op", None) for m in
                           torch.overrides._get_current_function_mode_stack()]
        with torch.no_grad():
            seen["result"] = model(x)
        seen["after"] = len(torch.overrides._get_current_function_mode_stack())

    pager = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0)
    thread = threading.Thread(target=worker)
    thread.start()
    assert cut.wait(10)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    go_on.set()
    thread.join(10)
    assert all(getattr(on_op, "__self__", None) is not pager for on_op in seen["reached"])
    torch.testing.assert_close(seen["result"], want, rtol=0, atol=0)
    assert seen["after"] == 0  # the worker's next call took the stranded probe off
    pager.remove()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_forward_cut_short_in_an_idle_thread_does_not_lock_out_the_others(exc: type) -> None:
    # Torch's post-hooks do not run for a KeyboardInterrupt or SystemExit: the thread's frames
    # stay. A thread pool's worker lives on without calling again; another thread's call
    # finds that worker outside any forward and goes ahead.
    import threading

    class Cut(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:
                raise exc()
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16), Cut()),
                          nn.Linear(16, 16)).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    cut, release = threading.Event(), threading.Event()

    def pool_worker() -> None:
        with contextlib.suppress(BaseException), torch.no_grad():
            model(torch.randn(3, 16))
        cut.set()
        release.wait(10)  # alive, idle

    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0), torch.no_grad():
        model(x)
        worker = threading.Thread(target=pool_worker)
        worker.start()
        assert cut.wait(10)
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
        release.set()
        worker.join(10)


def test_remove_while_a_forward_runs_is_refused_in_any_thread() -> None:
    import threading

    model, gate = held_in_flight()
    started, go_on = gate.started, gate.go_on
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
    pager = adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0)
    results: list[torch.Tensor] = []
    with torch.no_grad():
        model(x)
        running = threading.Thread(target=lambda: results.append(model(x)))
        running.start()
        assert started.wait(10)
        with pytest.raises(PlacementError, match=r"remove\(\) while a forward of the paged "
                                                 r"model runs in thread"):
            pager.remove()
        go_on.set()
        running.join(10)
        torch.testing.assert_close(results[0], want, rtol=0, atol=0)
        hook = model[2].register_forward_hook(lambda *a: pager.remove())
        with pytest.raises(PlacementError, match="runs in this thread, inside the forward"):
            model(x)
        hook.remove()
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    pager.remove()
    assert adaptive.holder(model) is None


@pytest.mark.parametrize("engine", ["page", "chunk", "split", "model="])
def test_a_torchscript_submodule_is_refused_by_name_and_the_model_left_unheld(
        engine: str) -> None:
    # It takes no forward hooks: page failed inside the engine with an AttributeError,
    # chunk and split at the first call, and the model stayed held for good.
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model = nn.Sequential(nn.Linear(8, 8), scripted, nn.Linear(8, 8)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlacementError, match=r"submodule '1' is a RecursiveScriptModule"):
        if engine == "page":
            adaptive.page(model, "cpu")
        elif engine == "chunk":
            adaptive.chunk(model, "cpu")
        elif engine == "split":
            adaptive.split(model, {"cpu": None})
        else:
            adaptive.batch(initial_batchsize=2, model=model)(lambda batchsize: None)
    assert adaptive.holder(model) is None
    assert not any(m._forward_pre_hooks for m in model.modules() if not isinstance(
        m, torch.jit.ScriptModule))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model[1] = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    adaptive.page(model, "cpu").remove()  # unscripted, it pages


@pytest.mark.parametrize("where", ["page", "model=", "page, a compiled submodule"])
def test_a_compiled_model_is_refused_naming_the_module_inside(where: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    compiled = torch.compile(model, backend="eager")  # compiles nothing until called
    if where.endswith("submodule"):
        outer = nn.Sequential(compiled, nn.ReLU()).eval()
        with pytest.raises(PlacementError, match=r"submodule '0' is Sequential.*_orig_mod"):
            adaptive.page(outer, "cpu")
        assert not outer._forward_pre_hooks
        return
    with pytest.raises(PlacementError, match=r"compile'd module: model is Sequential.*_orig_mod"):
        if where == "page":
            adaptive.page(compiled, "cpu")
        else:
            adaptive.batch(initial_batchsize=2, model=compiled)(lambda batchsize: None)
    assert not model._forward_pre_hooks and not compiled._forward_pre_hooks  # nothing held


@contextlib.contextmanager
def _remove_cut_short(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, ...]]:
    """A model paged on the simulated device whose ``remove()`` a Ctrl-C cut short after three
    tensors: yields (model, its state before paging, the pager, the slots put back), inside
    the simulation."""
    from adaptmem._engines import hoststore

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    restore, restored = hoststore.Slot.restore, []

    def interrupted(slot: Any, *args: Any) -> None:
        if len(restored) == 3:
            raise KeyboardInterrupt  # a Ctrl-C halfway through
        restored.append(slot)
        restore(slot, *args)

    with simulated_cuda(devices=1, total_memory="64MiB"):
        pager = adaptive.page(model, "cuda", unit_bytes=0, resident_bytes="40KiB")
        with torch.no_grad():
            model(torch.randn(2, 64))
        monkeypatch.setattr(hoststore.Slot, "restore", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pager.remove()
        monkeypatch.setattr(hoststore.Slot, "restore", restore)
        yield model, before, pager, restored


def test_a_remove_interrupted_while_copying_back_is_finished_by_the_next(monkeypatch) -> None:
    with _remove_cut_short(monkeypatch) as (model, before, pager, restored):
        name = restored[0].name
        with torch.no_grad():
            model.state_dict()[name].add_(1)  # an edit to a tensor already back
        pager.remove()  # finishes the work, where it used to return at once
    assert adaptive.holder(model) is None
    assert not any(m._forward_pre_hooks for m in model.modules())
    after = model.state_dict()
    assert after[name].device.type == "cpu"
    assert torch.equal(after[name], before[name] + 1)  # the edit is kept, not copied over
    assert all(torch.equal(before[k], v) for k, v in after.items() if k != name)
    adaptive.page(model, "cpu").remove()  # and the model can be paged again


def test_a_remove_resumed_after_the_device_is_gone_finishes_from_the_host_copies(
        monkeypatch) -> None:
    # Ctrl-C halfway through remove(), then the simulation ends (the device is lost) before
    # remove() is called again: the rest comes back from the host copies, with a warning.
    with _remove_cut_short(monkeypatch) as (model, before, pager, _):
        pass
    with pytest.warns(RuntimeWarning, match="could not reach cuda:0.*host copies") as seen:
        pager.remove()
    assert seen[0].filename == __file__  # the caller's line
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert adaptive.holder(model) is None


def test_remove_after_the_device_is_gone_restores_from_the_host_copies() -> None:
    """The simulation ended before remove() (notebook cells run out of order), as a device
    with a sticky error would: it cannot be read, and remove() says so and puts the model
    back from its host masters."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_cuda(devices=1, total_memory="64MiB"):
        pager = adaptive.page(model, "cuda", resident_bytes="600KiB")
        assert {u.placement for u in pager.plan.units} == {"resident", "paged"}
        with torch.no_grad():
            model(torch.randn(2, 256))
    with pytest.warns(RuntimeWarning, match="could not reach cuda:0.*host copies"):
        pager.remove()
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert adaptive.holder(model) is None


def test_remove_restores_from_the_host_copies_when_the_device_answers_but_fails_a_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On a machine with a real GPU, its cuda:0 answered remove()'s synchronize after the
    # simulation had ended, and remove() then failed reading the simulated copies back.
    from adaptmem._paging import pager as pager_module

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_cuda(devices=1, total_memory="64MiB"):
        pager = adaptive.page(model, "cuda", resident_bytes="600KiB")
        with torch.no_grad():
            model(torch.randn(2, 256))
    monkeypatch.setattr(pager_module, "synchronize", lambda device: None)  # it answers
    with pytest.warns(RuntimeWarning, match="could not reach cuda:0 .*used after its") as seen:
        pager.remove()
    assert seen[0].filename == __file__  # the warning points at the caller's line
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert adaptive.holder(model) is None


def test_running_out_of_memory_in_remove_is_raised_and_the_next_remove_keeps_the_edits(
) -> None:
    # A full device is no lost device: remove() once warned that the edits to resident
    # weights were lost, and put the model back from its host copies.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).eval()
    with simulated_cuda(devices=1, total_memory="16MiB"):
        model.to("cuda")
        pager = adaptive.page(model, "cuda", resident_bytes="3MiB")
        with torch.no_grad():
            model(torch.randn(2, 512, device="cuda"))
            resident = [m for m in model if m.weight.device.type == "cuda"]
            for m in resident:
                m.weight.add_(1.0)  # edits, kept by remove()
        edited = [m.weight.detach().cpu().clone() for m in resident]
        filler = []
        with contextlib.suppress(torch.OutOfMemoryError):
            while True:
                filler.append(torch.empty(1 << 18, dtype=torch.uint8, device="cuda"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "could not reach" warning
            with pytest.raises(torch.OutOfMemoryError):
                pager.remove()
        del filler
        pager.remove()
        assert resident and all(torch.equal(m.weight.detach().cpu(), want)
                                for m, want in zip(resident, edited, strict=True))


def test_remove_gives_torchs_cached_pinned_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch keeps freed pinned blocks (rounded up to a power of two) page-locked for reuse:
    # the host copies of a removed pager went to that cache, not back to the system. (The
    # simulated device pins exactly and caches nothing; the call is what can be checked.)
    emptied: list[int] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(1))
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).eval()
    with simulated_cuda(devices=1, total_memory="64MiB"):
        pager = adaptive.page(model, "cuda", resident_bytes=0)
        assert not emptied
        pager.remove()
        assert emptied == [1]
        pager.remove()  # once only
        assert emptied == [1]


def test_remove_on_a_device_with_a_sticky_error_finishes_though_the_pinned_cache_cannot_empty(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Emptying torch's pinned cache frees blocks through the CUDA runtime, which fails on a
    # device with a sticky error: remove() raised then, where it warns and restores.
    from adaptmem._paging import pager as pager_module

    sticky = "CUDA error: an illegal memory access was encountered"

    def fails() -> None:
        raise RuntimeError(sticky)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_cuda(devices=1, total_memory="64MiB"):
        pager = adaptive.page(model, "cuda", resident_bytes=0)
        monkeypatch.setattr(pager_module, "synchronize", lambda device: fails())
        monkeypatch.setattr(torch._C, "_host_emptyCache", fails)
        with pytest.warns(RuntimeWarning, match="could not reach cuda:0 .*illegal memory"):
            pager.remove()
        assert adaptive.holder(model) is None
        monkeypatch.undo()
        pager.remove()  # done: nothing to finish
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_paged_model_runs_on_a_stream_of_the_callers_own() -> None:
    # Resident copies were ordered only before the stream current at page(): a forward under
    # `torch.cuda.stream(s)` (a server's own streams) read them before they had arrived.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).eval()  # 8 MiB
    x = torch.randn(4, 512)
    with torch.no_grad():
        want = model(x)
    with simulated_cuda(devices=1, total_memory="64MiB", bandwidth=1), torch.no_grad():
        with adaptive.page(model, "cuda", resident_bytes="4MiB") as pager:
            assert {u.placement for u in pager.plan.units} == {Placement.RESIDENT,
                                                               Placement.PAGED}
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                got = model(x.cuda())
            stream.synchronize()
            torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("resident_bytes", [0, "auto"])
def test_a_module_whose_tensors_are_all_empty_is_paged_with_the_rest(
    resident_bytes: int | str,
) -> None:
    # Planners now give such a module a 0-byte unit of its own; paging it must not change.
    x = torch.randn(4, 16)
    want = WithEmptyLayer().eval()(x)
    model = WithEmptyLayer().eval()
    with simulated_cuda(devices=1, total_memory="64MiB"):
        with adaptive.page(model, "cuda", unit_bytes=0, resident_bytes=resident_bytes) as p:
            with torch.no_grad():
                torch.testing.assert_close(model(x), want)
                torch.testing.assert_close(model(x), want)
            assert [u.module for u in p.plan.units] == ["a", "z"]
    assert model.z.weight.device.type == "cpu"
