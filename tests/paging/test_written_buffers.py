"""Paged buffers that the forward writes are kept, also when the op that writes them does
not move their version counter (batch norm with batch statistics, the fused fake-quant op):
See [Note: buffers written without a version bump] in ``adaptmem/_paging/writeback.py``.

Tests marked ``gpu`` run on the real CUDA device when there is one, else on the simulated one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import REAL_CUDA
from torch import nn
from torch.nn import functional as F

from adaptmem import adaptive
from adaptmem._engines.transfer import SyncTransfer
from adaptmem._paging.writeback import COPY_BACK_BYTES


class AdaptiveBatchNorm(nn.BatchNorm1d):
    """Test-time adaptation: normalises with the batch's statistics and updates the running
    ones, also in eval mode. ``native_batch_norm`` writes them without a version bump."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            True, 0.1, self.eps)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "batch_norm":
        middle: list[nn.Module] = [AdaptiveBatchNorm(8)]
    elif kind == "batch_norm_twice":  # released and fetched again within one forward
        norm = AdaptiveBatchNorm(8)
        middle = [norm, nn.Linear(8, 8), norm]
    else:  # scale, zero point and the observer's min and max: written without a bump too
        middle = [torch.ao.quantization.FusedMovingAvgObsFakeQuantize()]
    return nn.Sequential(nn.Linear(8, 8), *middle, nn.Linear(8, 2)).eval()


KINDS = ["batch_norm", "batch_norm_twice", "fake_quant"]
MODES: dict[str, Callable[[], Any]] = {
    "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
    "grad": contextlib.nullcontext}


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    if REAL_CUDA:  # other kernels than the CPU's may be chosen: round-off may differ
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want)


def _paged_calls_keep_what_the_forward_wrote(kind: str, device: str, mode: str) -> None:
    model = _model(kind)
    reference = copy.deepcopy(model).to(device)
    # Inputs of growing scale: each call moves the statistics, and the fake quantizer's
    # output depends on the scale the calls before it left.
    xs = [torch.randn(6, 8) * (i + 1) for i in range(3)]
    with adaptive.page(model, device, unit_bytes=0, resident_bytes=0) as pager:
        assert all(u.placement == "paged" for u in pager.plan.units)
        for x in xs:
            with MODES[mode]():
                _check(model(x), reference(x.to(device)))
            for name, buffer in model.named_buffers():  # between calls: the host masters
                _check(buffer, reference.get_buffer(name))
    for name, buffer in model.named_buffers():  # and after remove()
        assert buffer.device.type == "cpu"
        _check(buffer, reference.get_buffer(name))
    fresh = _model(kind)  # not vacuous: the calls did change the buffers checked
    assert any(not torch.equal(b, fresh.get_buffer(n)) for n, b in model.named_buffers())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_buffers_written_without_a_version_bump_are_kept_on_the_cpu(kind: str, mode: str) -> None:
    _paged_calls_keep_what_the_forward_wrote(kind, "cpu", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])  # simulated: inference only
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_buffers_written_without_a_version_bump_are_kept(kind: str, mode: str) -> None:
    _paged_calls_keep_what_the_forward_wrote(kind, "cuda", mode)


class CountingTransfer(SyncTransfer):
    """Counts the copies back, by host master."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.back: Counter[int] = Counter()

    def copy_back(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        self.back[id(master)] += 1
        super().copy_back(master, copy)


class _Buffers(nn.Module):
    """A large constant buffer (a mask), a large one written in place (a cache), a small one
    only read."""

    def __init__(self) -> None:
        super().__init__()
        n = COPY_BACK_BYTES // 4 + 1  # float32: just over the size copied back always
        self.register_buffer("mask", torch.ones(n))
        self.register_buffer("cache", torch.zeros(n))
        self.register_buffer("small", torch.full((8,), 2.0))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[: x.shape[0]] += x.sum(1)
        return self.proj(x) * self.mask[:8] * self.small


def test_a_large_buffer_is_copied_back_only_when_its_version_moved(caplog: Any) -> None:
    # The rule that bounds the cost: small buffers are copied back after every use, large
    # ones (a causal mask, a rotary table) only when written in place (a KV cache).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Buffers()).eval()
    reference = copy.deepcopy(model)
    transfer = CountingTransfer(torch.device("cpu"))
    xs = [torch.randn(3, 8) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="adaptmem"), torch.no_grad():
        with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0,
                           _transfer=transfer) as pager:
            masters = {name: id(s.master) for name, s in pager._table.slots.items()}
            for x in xs:
                assert torch.equal(model(x), reference(x))
        back = {name: transfer.back[masters[name]] for name in ("1.mask", "1.cache", "1.small")}
    assert back == {"1.mask": 0, "1.cache": len(xs), "1.small": len(xs)}
    assert torch.equal(model[1].cache, reference[1].cache)
    assert "'1.cache' was written in place" in caplog.text
    assert "'1.small'" not in caplog.text and "'1.mask'" not in caplog.text


def test_a_trace_through_a_paged_model_copies_nothing_back_and_the_real_call_keeps_its_writes(
        ) -> None:
    # initial_batchsize="auto" traces the forward with fake copies of the paged weights (see
    # [Note: paging under a trace] in _paging/slots.py); copying one back into a master
    # broke the traces and left a buffer backed by meta memory.
    model = _model("batch_norm")
    reference = copy.deepcopy(model)
    data = torch.randn(64, 8)
    with adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0):

        @adaptive.batch(initial_batchsize="auto", max_batchsize=64, device="cpu")
        def run(batchsize: int) -> torch.Tensor:
            with torch.no_grad():
                return model(data[:batchsize])

        got = run()
        assert run.prediction is not None and len(got) == len(data)  # traced, then one call
    with torch.no_grad():
        assert torch.equal(got, reference(data))
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, reference.get_buffer(name))
