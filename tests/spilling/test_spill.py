"""adaptive.spill: saved activations go to disk and come back bitwise, prefetched."""

from __future__ import annotations

import copy
import errno
import gc
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from adaptmem import adaptive
from adaptmem._engines.stats import PagingStats
from adaptmem._spilling import HostLink, Spill, _copies, _tiers


def _fds_into(directory: Path, settle: float = 10.0) -> list[str]:
    """Descriptors still open on files in ``directory``. The last one closes in whichever
    thread drops the last copy (a writer or reader thread may finish just after the step),
    so wait up to ``settle`` seconds for them to go."""
    deadline = time.monotonic() + settle
    while True:
        out = _open_fds_into(directory)
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.01)


def _open_fds_into(directory: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


def _step(model: nn.Module, inputs: Callable[[], tuple[Any, ...]],
          loss: Callable[[Any], torch.Tensor], ctx: AbstractContextManager[Any],
          autocast: bool = False, backward_inside: bool = True) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    args = inputs()
    with ctx:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = loss(model(*args))
        if backward_inside:
            value.backward()
    if not backward_inside:
        value.backward()
    return value.detach(), {n: p.grad for n, p in model.named_parameters()}


class _Shared(nn.Module):
    """One block used three times, and a weight tied between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.inp = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(3):
            x = self.block(x) + x
        return self.out(x)


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i % 2 == 0:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = block(x)
        return x


class _PackedLSTM(nn.Module):
    """A packed, bidirectional recurrence: its cells fill ``unsafe_chunk`` pieces in place."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, [5, 3, 2, 1], enforce_sorted=True)
        return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0])[0]


class _Spectral(nn.Module):
    """Saves a conj view (and a neg view, through .imag of one) of complex tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.fft.fft(x) * self.w
        return (c.conj() * self.w).real + c.conj().imag * 2


def _zoo() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]],
                               Callable[[Any], torch.Tensor]]]:
    def mean(out: Any) -> torch.Tensor:
        return out.float().pow(2).mean()

    def resnet() -> nn.Module:
        import torchvision

        return torchvision.models.resnet18(num_classes=10)

    def encoder() -> nn.Module:
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def gpt2() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
        return GPT2LMHeadModel(config)

    ids = lambda: (torch.randint(0, 128, (2, 16)),)  # noqa: E731
    return {
        "resnet18": (resnet, lambda: (torch.randn(2, 3, 16, 16),), mean),
        "transformer-encoder": (encoder, lambda: (torch.randn(2, 16, 64),), mean),
        "gpt2": (gpt2, ids, lambda out: out.logits.float().logsumexp(-1).mean()),
        "checkpointed": (lambda: _Checkpointed(False), lambda: (torch.randn(8, 64),), mean),
        "checkpointed-reentrant": (lambda: _Checkpointed(True),
                                   lambda: (torch.randn(8, 64, requires_grad=True),), mean),
        "shared-submodules": (_Shared, lambda: (torch.randn(8, 64),), mean),
        "gru": (lambda: nn.GRU(16, 32), lambda: (torch.randn(5, 4, 16),),
                lambda out: mean(out[0])),
        "lstm-packed": (_PackedLSTM, lambda: (torch.randn(5, 4, 16),), mean),
        "complex-conj": (_Spectral, lambda: (torch.randn(8, 64),), mean),
    }


_CASES = [(name, False) for name in _zoo()] + [
    (name, True) for name in ("transformer-encoder", "gpt2", "shared-submodules")]


@pytest.mark.parametrize("name, autocast", _CASES,
                         ids=[f"{n}-{'autocast-bf16' if a else 'fp32'}" for n, a in _CASES])
def test_gradients_with_spilling_are_bitwise_those_without(name: str, autocast: bool,
                                                           tmp_path: Path) -> None:
    build, inputs, loss = _zoo()[name]
    torch.manual_seed(0)
    model = build().train()
    reference = copy.deepcopy(model)
    want_loss, want = _step(reference, inputs, loss, nullcontext(), autocast)
    handle = adaptive.spill(threshold=0, limit=0, to=tmp_path)
    # Backward outside the block for half the cases: the scratch file outlives the block.
    got_loss, got = _step(model, inputs, loss, handle, autocast, backward_inside=not autocast)
    assert handle.stats.tensors_spilled > 0 and handle.stats.tensors_restored > 0
    if not autocast:
        assert torch.equal(got_loss, want_loss)
        for key, grad in want.items():
            assert grad is not None and torch.equal(got[key], grad), key
    else:
        # oneDNN's bfloat16 convolutions were seen (once in three runs, ResNet-18) to differ
        # in the last bits between two identical steps inside pytest: allclose, at bf16's
        # precision, as the zoo promises where ops are not deterministic.
        torch.testing.assert_close(got_loss, want_loss, rtol=1.6e-2, atol=1e-5)
        for key, grad in want.items():
            assert grad is not None
            torch.testing.assert_close(got[key], grad, rtol=1.6e-2, atol=1e-5, msg=key)
    del got  # the graph is gone: nothing is left in the spill directory
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


def _exp_chain(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    for _ in range(n):
        x = (x * 1.01).exp().log1p()
    return x


def test_prefetch_restores_in_reverse_save_order_ahead_of_use(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    reads: list[int] = []
    real_read = _tiers.DiskFile.read

    def recording_read(self: _tiers.DiskFile, offset: int, nbytes: int, pin: bool
                       ) -> torch.Tensor:
        reads.append(offset)
        return real_read(self, offset, nbytes, pin)

    monkeypatch.setattr(_tiers.DiskFile, "read", recording_read)
    written: list[int] = []
    real_write = _copies.Copies.write

    def counting_write(self: Any, entry: Any) -> None:
        real_write(self, entry)
        written.append(entry.nbytes)

    monkeypatch.setattr(_copies.Copies, "write", counting_write)
    x = torch.randn(256, 1024, requires_grad=True)
    with adaptive.spill(threshold="64KiB", limit=0, to=tmp_path, prefetch=2) as handle:
        y = _exp_chain(x, 8).sum()
        # Every copy out done before backward (a loaded machine may lag), so what comes
        # back is read from the file, in the order the prefetcher chose.
        deadline = time.monotonic() + 30
        while len(written) < handle.stats.tensors_spilled and time.monotonic() < deadline:
            time.sleep(0.005)
        y.backward()
    assert handle.stats.tensors_restored == handle.stats.tensors_spilled >= 8
    assert len(reads) == handle.stats.tensors_spilled  # all were on disk
    assert reads == sorted(reads, reverse=True)  # the last saved comes back first
    # Whether a read finished before backward reached it (a prefetch hit) depends on the
    # machine's load; benchmarks/spill.py measures that, not this test.


def test_a_storage_saved_twice_or_through_views_is_spilled_once(tmp_path: Path) -> None:
    x = torch.randn(512, 512, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.exp()  # saves y
        z = y * y  # saves y twice more
        return z.sum() + y[:, :256].sin().sum() + y.t().cos().sum()  # two views of y

    f(x).backward()
    want = x.grad.clone()
    x.grad = None
    with adaptive.spill(threshold="1KiB", limit=0, to=tmp_path) as handle:
        f(x).backward()
    y_bytes = 512 * 512 * 4
    assert handle.stats.tensors_spilled == 1 and handle.stats.tensors_shared == 4
    assert handle.stats.bytes_out == y_bytes and handle.stats.tensors_restored == 1
    assert handle.stats.bytes_in in (0, y_bytes)  # 0: backward came before the copy out
    assert torch.equal(x.grad, want)


def test_a_storage_kept_for_one_save_is_kept_for_later_saves_across_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first save holds the storage: copying it out for a later save would free nothing.
    from adaptmem._spilling import _limits

    in_use = [0]
    monkeypatch.setattr(_limits, "in_use_bytes", lambda device: in_use[0])
    x = torch.randn(256, 256, requires_grad=True)

    def f(between: Callable[[], None]) -> torch.Tensor:
        a = x.exp()  # saves its output a
        between()
        return a.sin().exp().sum()  # sin saves a again; exp saves a new storage

    f(lambda: None).backward()
    want, x.grad = x.grad, None
    with adaptive.spill(threshold=0, limit=100, to=tmp_path) as handle:
        f(lambda: in_use.__setitem__(0, 1 << 30)).backward()  # the limit crossed between
    assert handle.stats.tensors_kept == 2 and handle.stats.tensors_spilled == 1
    assert handle.stats.bytes_out == 256 * 256 * 4 and torch.equal(x.grad, want)


def test_a_detached_alias_shares_its_originals_copy(tmp_path: Path) -> None:
    # Stop-gradient (x * f(x).detach(), BYOL, SimSiam): the alias has no base but shares
    # the original's storage and version counter, so one copy serves both, and a save of
    # the original after the alias still finds it.
    x = torch.randn(512, 512, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()  # saves h
        return (h * h.detach()).sum() + h.sin().sum()  # saves the alias, then h again

    f(x).backward()
    want, x.grad = x.grad, None
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        f(x).backward()
    assert torch.equal(x.grad, want)
    assert handle.stats.tensors_spilled == 1 and handle.stats.tensors_shared == 2
    assert handle.stats.bytes_out == 512 * 512 * 4


def test_a_data_alias_written_between_two_saves_is_not_taken_for_a_detached_one(
        tmp_path: Path) -> None:
    # ``.data`` has the geometry of a detach alias but a version counter of its own: a
    # write through it after its original was saved must reach the second save.
    def grads(spilled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        a = torch.randn(256, 256, requires_grad=True)
        w = torch.randn(256, 256, requires_grad=True)
        block = adaptive.spill(threshold="1KiB", limit=0, to=tmp_path) if spilled else \
            nullcontext()
        with block:
            x = a * 2
            x.add_(1)  # x at version 1
            s = torch.sin(x)  # saves x
            y = x.data  # own counter, at version 0
            y.mul_(3)  # now at version 1 too
            z = w * y  # saves y
        (z.sum() + 0 * s.sum()).backward()
        assert w.grad is not None
        return w.grad

    assert torch.equal(grads(True), grads(False))


@pytest.mark.parametrize("threshold", [0, "1GiB"], ids=["spilled", "kept"])
def test_a_saved_tensor_changed_in_place_raises_autograds_error(threshold: int | str,
                                                                tmp_path: Path) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    y = x.exp()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        y = x.exp()
        out = y.sum() * 1
        y.add_(1)
        out.backward()
    with adaptive.spill(threshold=threshold, limit=0, to=tmp_path) as handle:
        y = x.exp()
        out = y.sum() * 1
    y.add_(1)
    assert handle.stats.tensors_spilled == (1 if threshold == 0 else 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as spilled:
        out.backward()
    assert type(spilled.value) is type(plain.value)
    assert "is at version 1; expected version 0" in str(spilled.value)


def test_only_the_innermost_of_spill_and_allow_mutation_on_saved_tensors_saves(
        tmp_path: Path) -> None:
    # The limitation docs/limitations.md states: saved-tensor hooks do not compose.
    allow_mutation = torch.autograd.graph.allow_mutation_on_saved_tensors
    x = torch.randn(64, 64, requires_grad=True)

    def f() -> torch.Tensor:
        y = x.exp()
        z = y.sin()  # saves y
        y.mul_(2)  # which torch's context allows
        return (z + y).sum()

    with allow_mutation():
        f().backward()
    want, x.grad = x.grad, None
    with allow_mutation(), adaptive.spill(threshold=0, limit=0, to=tmp_path):
        with pytest.raises(RuntimeError, match="inplace operation.*inside adaptive.spill"):
            f().backward()
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle, allow_mutation():
        f().backward()
    assert torch.equal(x.grad, want) and handle.stats.tensors_saved == 0


@pytest.mark.parametrize("what", ["parameter", "input"])
@pytest.mark.parametrize("threshold", [0, "1GiB"], ids=["spilled", "kept"])
def test_a_tensor_outside_the_graph_changed_in_place_after_saving_raises(
    what: str, threshold: int | str, tmp_path: Path,
) -> None:
    # Saved as it is (no grad_fn): autograd checks no version for a tensor a hook saved, so
    # spill does, as torch alone would raise (an optimizer step between a forward and its
    # backward, say).
    w = nn.Parameter(torch.randn(512, 512))
    x = torch.randn(512, 512, requires_grad=what == "parameter")  # else w is not saved
    with adaptive.spill(threshold=threshold, limit=0, to=tmp_path):
        out = (x * w).sum()
    with torch.no_grad():
        (w if what == "parameter" else x).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_buffer_refilled_in_place_and_saved_again_restores_each_fill(
    tmp_path: Path,
) -> None:
    # Two saves of one storage at different versions are two copies, not one shared.
    w1 = nn.Parameter(torch.ones(512, 512))
    w2 = nn.Parameter(torch.ones(512, 512))
    buffer = torch.empty(512, 512)
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        buffer.fill_(2)
        first = (buffer * w1).sum()  # saves buffer at version 1
        buffer.fill_(3)
        second = (buffer * w2).sum()  # saves it again at version 2
    second.backward()
    assert torch.equal(w2.grad, torch.full((512, 512), 3.0))
    assert handle.stats.tensors_shared == 0
    del first


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_nested_tensors_stay(tmp_path: Path) -> None:
    layer = nn.Linear(64, 64)
    nested = torch.nested.nested_tensor([torch.randn(300, 64), torch.randn(200, 64)])
    with adaptive.spill(threshold=0, limit=0, to=tmp_path):
        layer(nested * 2).relu().to_padded_tensor(0).sum().backward()
    assert layer.weight.grad is not None


def test_small_tensors_parameters_and_tensors_under_the_limit_stay(tmp_path: Path) -> None:
    big = nn.Linear(1024, 1024)  # a 4 MiB weight, saved for the input's gradient
    x = torch.randn(4, 1024, requires_grad=True)
    with adaptive.spill(threshold="1MiB", limit=0, to=tmp_path) as handle:
        big(x * 1).relu().sum().backward()  # activations of 16 KiB
    assert handle.stats.tensors_spilled == 0 and handle.stats.tensors_kept == 3
    with adaptive.spill(threshold=0, limit="1TiB", to=tmp_path) as handle:
        big(x * 1).relu().sum().backward()
    assert handle.stats.tensors_spilled == 0 and handle.stats.tensors_kept == 3
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        big(x * 1).relu().sum().backward()
    assert handle.stats.tensors_spilled == 2  # the input and the relu output, not the weight
    assert handle.stats.tensors_kept == 1


def test_views_of_frozen_parameters_and_buffers_stay_since_copying_them_frees_nothing(
        tmp_path: Path) -> None:
    class Masked(nn.Module):  # a frozen base layer and a large buffer, as in fine-tuning
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(1024, 1024).requires_grad_(False)
            self.register_buffer("scale", torch.rand(2048, 1024))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.base(x) * self.scale[: x.shape[0]]).exp()

    model = Masked()
    x = torch.randn(512, 1024, requires_grad=True)  # 2 MiB activations
    with adaptive.spill(threshold="1MiB", limit=0, to=tmp_path) as handle:
        model(x).sum().backward()
    # base.weight.t() and a slice of the buffer stay; the input stays (a leaf that requires
    # grad), the exp output is the one activation the step made and copies out.
    assert handle.stats.tensors_spilled == 1
    assert handle.stats.bytes_out == 512 * 1024 * 4
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_limit_auto_spills_nothing_while_memory_is_plentiful(tmp_path: Path) -> None:
    with adaptive.spill(threshold=0, to=tmp_path) as handle:
        _exp_chain(torch.randn(64, 64, requires_grad=True)).sum().backward()
    assert handle.stats.tensors_saved > 0 and handle.stats.tensors_spilled == 0


def test_limit_auto_spills_every_large_saved_tensor_after_two_steps_ran_out_of_memory(
        tmp_path: Path) -> None:
    handle = adaptive.spill(threshold="64KiB", to=tmp_path)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError), handle:
            raise torch.OutOfMemoryError("CUDA out of memory.")
    assert handle.keep_free == 1.0
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    with handle:
        y = x
        for _ in range(8):
            y = y.exp().tanh()  # 16 saved storages of 256 KiB
        y.sum().backward()
    # All of them, the first too: none is left to how memory in use moved meanwhile.
    assert handle.stats.tensors_spilled == 16 and handle.stats.tensors_kept == 0


def test_the_decorator_spills_each_call_and_the_handle_counts_them(tmp_path: Path) -> None:
    handle = adaptive.spill(threshold=0, limit=0, to=tmp_path)

    @handle
    def train_step(x: torch.Tensor) -> float:
        loss = _exp_chain(x).sum()
        loss.backward()
        return float(loss.detach())

    x = torch.randn(64, 64, requires_grad=True)
    train_step(x)
    train_step(x)
    assert train_step.__name__ == "train_step"
    assert handle.stats.steps == 2
    assert handle.stats.tensors_spilled == handle.stats.tensors_restored > 0
    assert handle.stats.bytes_out >= handle.stats.bytes_in


def test_the_decorator_refuses_generator_and_async_steps_whose_forward_runs_later() -> None:
    handle = adaptive.spill(threshold=0, limit=0)

    def generator_step(x: torch.Tensor) -> Any:
        yield _exp_chain(x).sum()

    async def async_step(x: torch.Tensor) -> Any:
        return _exp_chain(x).sum()

    for step in (generator_step, async_step):
        with pytest.raises(TypeError, match=f"{step.__name__}.*generator or async.*with handle"):
            handle(step)
    assert handle.stats.steps == 0


def test_the_decorator_above_staticmethod_or_classmethod_binds_as_they_do(
        tmp_path: Path) -> None:
    handle = adaptive.spill(threshold=0, limit=0, to=tmp_path)

    class Trainer:
        @handle
        @staticmethod
        def step(x: torch.Tensor) -> torch.Tensor:
            loss = _exp_chain(x).sum()
            loss.backward()
            return loss

        @handle
        @classmethod
        def class_step(cls, x: torch.Tensor) -> type:
            Trainer.step.__wrapped__(x)  # the undecorated function: one step, not nested
            return cls

    x = torch.randn(64, 64, requires_grad=True)
    Trainer().step(x)  # through an instance: no instance passed
    Trainer.step(x)
    assert Trainer().class_step(x) is Trainer and Trainer.class_step(x) is Trainer
    assert Trainer.step.__name__ == "step" and handle.stats.steps == 4
    assert handle.stats.tensors_spilled == handle.stats.tensors_restored == 4 * 6
    with pytest.raises(TypeError, match="gen.*generator or async"):
        def gen(x: torch.Tensor) -> Any:
            yield x

        handle(staticmethod(gen))


def test_the_decorator_refuses_a_callable_object_whose_call_is_a_generator() -> None:
    handle = adaptive.spill(threshold=0, limit=0)

    class GeneratorStep:
        def __call__(self, x: torch.Tensor) -> Any:
            yield _exp_chain(x).sum()

    class AsyncStep:
        async def __call__(self, x: torch.Tensor) -> Any:
            return _exp_chain(x).sum()

    for step in (GeneratorStep(), AsyncStep()):
        name = f"{type(step).__name__}.__call__"
        with pytest.raises(TypeError, match=f"{name}.*generator or async.*with handle"):
            handle(step)
    assert handle.stats.steps == 0


def test_the_decorator_without_parentheses_or_on_a_non_function_is_refused_saying_how() -> None:
    with pytest.raises(TypeError, match=r"write @adaptive.spill\(\) .*got 'step' as threshold"):
        @adaptive.spill  # type: ignore[arg-type]
        def step(x: torch.Tensor) -> torch.Tensor:
            return x

    handle = adaptive.spill()
    with pytest.raises(TypeError, match=r"decorates a function .*got int 5"):
        handle(5)  # type: ignore[type-var]
    assert handle.stats.steps == 0


def test_numpy_counts_and_any_case_auto_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    handle = adaptive.spill(prefetch=np.int64(4), max_pending=" AUTO ")
    assert handle.prefetch == 4 and type(handle.prefetch) is int
    assert handle.max_pending == "auto"
    with pytest.raises(ValueError, match="max_pending='auto'"):
        adaptive.spill(max_pending="lots")


def test_a_step_leaves_no_cycle_for_the_garbage_collector(tmp_path: Path) -> None:
    # Training loops often run with gc disabled or frozen: each step's state must go when
    # its last saved tensor does, by reference counting alone.
    from adaptmem._spilling._hooks import Step

    handle = adaptive.spill(threshold=0, limit=0, to=tmp_path)
    x = torch.randn(64, 64, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            with handle:
                _exp_chain(x).sum().backward()
        # This handle's steps only: another test may keep a graph (and its step) alive. The
        # copy thread may still hold the last step for a moment after backward returns
        # (seen once in 30 runs on a loaded VM); a cycle would keep it for good.
        deadline = time.monotonic() + 5
        while (alive := sum(type(o) is Step and o.stats is handle.stats
                            for o in gc.get_objects())) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gc.enable()
    assert alive == 0
    assert handle.stats.steps == 20 and handle.stats.tensors_spilled > 0


def test_a_scratch_file_reuses_the_space_of_graphs_already_freed(tmp_path: Path) -> None:
    # One graph kept alive for the whole block (a loss kept for later) must not make the
    # file grow by every step that ran since.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
    sizes = []
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        kept = model(torch.randn(256, 256)).sum()
        for _ in range(8):
            model(torch.randn(256, 256)).sum().backward()
            fds = [int(p.name) for p in Path("/proc/self/fd").iterdir()
                   if os.path.realpath(p).startswith(str(tmp_path))]
            sizes.append(max(os.fstat(fd).st_size for fd in fds))
    per_step = handle.stats.bytes_out / 9
    # Room for the kept graph, the graph running and the one before it (with page rounding),
    # however many ran: a graph's regions are freed when the copy thread lets go of its
    # entries, which can be a moment after its backward returned (seen in a CI run: the file
    # grew to 3 graphs' worth and stayed there). Without reuse it holds all 9 graphs.
    assert sizes[-1] <= 3.5 * per_step, (sizes, per_step)
    assert len(set(sizes[2:])) <= 2, sizes  # grew once more at most, from the third graph on
    del kept


def test_spill_statistics_count_a_backward_after_the_handle_is_gone() -> None:
    # The docs allow the block around forward only; backward then runs after an unnamed
    # handle was collected, and the process totals must still count what it read back.
    before = adaptive.memory_stats()["spill"]
    x = torch.randn(512, 512, requires_grad=True)
    with adaptive.spill(threshold=0, limit=0):
        loss = _exp_chain(x, 2).sum()
    gc.collect()
    loss.backward()
    del loss
    gc.collect()
    after = adaptive.memory_stats()["spill"]
    spilled = after["tensors_spilled"] - before["tensors_spilled"]
    assert spilled > 0
    assert after["tensors_restored"] - before["tensors_restored"] == spilled
    # A storage whose copy out had not landed when backward asked for it comes back from
    # memory, unread (docs of SpillStats.bytes_in): on a busy machine, fewer bytes in.
    bytes_out = after["bytes_out"] - before["bytes_out"]
    assert bytes_out > 0 and 0 <= after["bytes_in"] - before["bytes_in"] <= bytes_out


@pytest.mark.gpu
def test_the_host_tier_stays_on_the_host_when_cuda_is_the_default_device() -> None:
    # Autograd does not run on the simulated device, so the tier's mover is driven directly.
    src = torch.full((4 << 20,), 7, dtype=torch.uint8, device="cuda")  # a saved activation
    mover = _tiers.Mover(torch.device("cuda"))
    torch.set_default_device("cuda")
    try:
        before = torch.cuda.memory_allocated()
        host, done = mover.to_host(src)
        grew = torch.cuda.memory_allocated() - before
    finally:
        torch.set_default_device(None)
    done.synchronize()
    assert host.device.type == "cpu" and grew == 0
    assert bool((host == 7).all())


def test_the_default_tier_for_cpu_tensors_is_a_file_in_the_temporary_directory() -> None:
    with adaptive.spill(threshold=0, limit=0) as handle:
        _exp_chain(torch.randn(64, 64, requires_grad=True)).sum().backward()
    assert handle.stats.tensors_spilled > 0
    with adaptive.spill(threshold=0, limit=0, to="host") as handle:  # no host tier for CPU
        _exp_chain(torch.randn(64, 64, requires_grad=True)).sum().backward()
    assert handle.stats.tensors_spilled == 0


def test_a_directory_in_memory_is_known_and_never_the_default_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from adaptmem._spilling import _tiers

    # Which file system holds a directory: the longest mount point above it.
    disk, ram = tmp_path / "disk", tmp_path / "disk" / "shm"
    ram.mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        f"30 22 0:5 / {disk} rw - ext4 /dev/sdb1 rw\n"
        f"31 30 0:6 / {ram} rw,nosuid - tmpfs tmpfs rw,size=1024k\n"
        # mountinfo writes a space as \040; other characters (here non-ASCII) as they are
        f"32 30 0:7 / {disk}/RAM\\040ö rw - ramfs none rw\n")
    (disk / "RAM ö").mkdir()
    assert _tiers.in_memory(str(disk / "RAM ö"), str(mountinfo)) == "ramfs"
    assert _tiers.in_memory(str(ram), str(mountinfo)) == "tmpfs"
    assert _tiers.in_memory(str(ram / "deeper"), str(mountinfo)) == "tmpfs"
    assert _tiers.in_memory(str(disk), str(mountinfo)) is None
    assert _tiers.in_memory(str(disk) + "-other", str(mountinfo)) is None  # not a prefix
    # A temporary directory in memory is not the default: /var/tmp is, when on a disk.
    from adaptmem._spilling import _spill

    def in_memory(directory: str, *rest: str) -> str | None:
        return "tmpfs" if directory == str(ram) else None

    monkeypatch.setattr(_tiers, "in_memory", in_memory)
    monkeypatch.setattr(_spill, "in_memory", in_memory)
    monkeypatch.setattr(_tiers.tempfile, "gettempdir", lambda: str(ram))
    with caplog.at_level(logging.INFO, logger="adaptmem"):
        chosen = _tiers.default_directory()
    if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK):
        assert chosen == "/var/tmp" and "spilling to /var/tmp instead" in caplog.text
    else:
        assert chosen == str(ram) and "spilled tensors free nothing" in caplog.text
    # One passed as to= is taken, with a warning.
    with pytest.warns(UserWarning, match=r"is on tmpfs, which keeps its files in memory: "
                                         r"tensors spilled there free no memory"):
        adaptive.spill(to=ram)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"threshold": -1}, ValueError, "threshold"),
    ({"threshold": "1 parsec"}, ValueError, "threshold"),
    ({"limit": -5}, ValueError, "limit"),
    ({"limit": "lots"}, ValueError, "'auto'"),
    ({"to": 3}, TypeError, "directory"),
    ({"to": "/nonexistent/spill"}, ValueError, "does not exist"),
    ({"to": ""}, ValueError, "names no directory"),
    ({"to": "/proc"}, ValueError, "cannot create a scratch file"),
    ({"prefetch": -1}, ValueError, "prefetch"),
    ({"mmap_threshold": 0}, ValueError, "mmap_threshold"),
    ({"mmap_threshold": "64MiB"}, ValueError, "mmap_threshold"),
    ({"mmap_threshold": "big"}, ValueError, "mmap_threshold"),
])
def test_bad_arguments_are_refused_at_the_call(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        adaptive.spill(**kwargs)


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        adaptive.spill(to=path)


@pytest.mark.parametrize(("code", "why"), [
    (errno.ENOSPC, "the disk is full"),
    (errno.EFBIG, "the file reached the largest size allowed"),  # once "the disk is full"
    (errno.EDQUOT, "the disk quota is used up"),
])
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(
        code: int, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(_tiers.os, "pwrite", full)
    x = torch.randn(128, 128, requires_grad=True)
    with pytest.raises(OSError, match=why) as caught:
        # One copy out at a time: the forward's next save sees the first write's failure.
        with adaptive.spill(threshold=0, limit=0, to=tmp_path, max_pending=1):
            _exp_chain(x, 20).sum().backward()
    assert caught.value.errno == code and str(tmp_path) in str(caught.value)
    # The scratch file is gone while the caller still holds the error (its frames once
    # held a spilled tensor, and the file with it).
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


@pytest.mark.parametrize("device", ["cpu", "stand-in accelerator"])
def test_a_spill_directory_removed_after_the_handle_was_made_is_a_clear_error_before_spilling(
        device: str, tmp_path: Path) -> None:
    directory = tmp_path / "spill"
    directory.mkdir()
    link = _CpuLink() if device != "cpu" else None
    handle = Spill(threshold=0, limit=0, to=directory, link=link)
    directory.rmdir()
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(FileNotFoundError, match=(
            f"adaptive.spill cannot make its scratch file: to={re.escape(repr(str(directory)))} "
            f"does not exist: "
            f"pass an existing directory.*or to='host'")), handle:
        _exp_chain(x).sum().backward()
    assert handle.stats.tensors_spilled == handle.stats.bytes_out == 0
    directory.mkdir()  # put back: the handle spills again
    with handle:
        _exp_chain(x).sum().backward()
    assert handle.stats.tensors_spilled == handle.stats.tensors_restored == 6


def test_a_disk_that_fills_after_the_step_is_logged_and_the_step_is_right(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adaptmem_log: Any) -> None:
    # Writes run behind the step: a disk that fills once the block has ended cannot raise
    # in it. The step kept those tensors in memory (its gradients are right); a warning says
    # the disk is full.
    ended = threading.Event()

    def full_once_the_block_ended(fd: int, data: Any, offset: int) -> int:
        ended.wait(30)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_tiers.os, "pwrite", full_once_the_block_ended)
    x = torch.randn(128, 128, requires_grad=True)
    _exp_chain(x, 20).sum().backward()
    expected, x.grad = x.grad, None
    with adaptive.spill(threshold=0, limit=0, to=tmp_path):
        _exp_chain(x, 20).sum().backward()
    ended.set()
    assert torch.equal(x.grad, expected)
    deadline = time.monotonic() + 10
    while not any("disk is full" in r.getMessage() for r in adaptmem_log.records):
        assert time.monotonic() < deadline, "no warning about the full disk"
        time.sleep(0.01)
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


def test_a_disk_that_fills_after_the_forward_warns_and_the_step_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adaptmem_log: Any) -> None:
    # The block's forward saved everything before a write failed; the backward ran inside the
    # block with the tensors kept in memory. The step is right and its gradients are added:
    # raising at the block's end would make a caller retry it (counting them twice) or, under
    # accumulate=, throw them away.
    forward_done = threading.Event()

    def full_after_the_forward(fd: int, data: Any, offset: int) -> int:
        forward_done.wait(30)
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(_tiers.os, "pwrite", full_after_the_forward)
    x = torch.randn(128, 128, requires_grad=True)
    _exp_chain(x, 20).sum().backward()
    expected, x.grad = x.grad, None
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        loss = _exp_chain(x, 20).sum()
        forward_done.set()
        loss.backward()
        copies = handle._local.steps[-1][0].copies
        deadline = time.monotonic() + 10
        while copies.futures and time.monotonic() < deadline:
            time.sleep(0.01)  # every write failed while the block runs
    assert torch.equal(x.grad, expected)
    assert any("largest size allowed" in r.getMessage() and "the step is right" in r.getMessage()
               for r in adaptmem_log.records)
    assert handle.stats.tensors_spilled > 0
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


class _Interrupt(nn.Module):
    def __init__(self, where: str, exc: type[BaseException]) -> None:
        super().__init__()
        self.where, self.exc = where, exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            raise self.exc("interrupted in forward")
        if self.where == "backward":
            x.register_hook(lambda _: (_ for _ in ()).throw(self.exc("interrupted in backward")))
        return x


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_an_interrupted_step_leaves_no_scratch_file(where: str, exc: type[BaseException],
                                                    tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), _Interrupt(where, exc),
                          nn.Linear(256, 256), nn.Tanh())
    handle = adaptive.spill(threshold=0, limit=0, to=tmp_path)
    with pytest.raises(exc, match="interrupted"):
        with handle:
            model(torch.randn(512, 64)).sum().backward()
    assert handle.stats.tensors_spilled > 0
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []
    with handle:  # the handle still works for the next step
        model[:2](torch.randn(512, 64)).sum().backward()
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


def test_backward_after_an_interrupted_block_says_the_copies_were_discarded(
        tmp_path: Path) -> None:
    x = torch.randn(128, 128, requires_grad=True)
    with pytest.raises(ValueError, match="late"):
        with adaptive.spill(threshold=0, limit=0, to=tmp_path):
            loss = _exp_chain(x).sum()
            raise ValueError("too late")
    with pytest.raises(RuntimeError, match="discarded"):
        loss.backward()


def test_memory_stats_gathers_spill_devices_and_engines(tmp_path: Path) -> None:
    before = adaptive.memory_stats()["spill"]["bytes_out"]
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        _exp_chain(torch.randn(64, 64, requires_grad=True)).sum().backward()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    with adaptive.page(model, "cpu", resident_bytes=0) as pager:
        model(torch.randn(2, 8))
    stats = adaptive.memory_stats(pager, handle, pager.stats)  # each shown once
    assert stats["spill"]["bytes_out"] - before == handle.stats.bytes_out > 0
    [paged] = [n for n in stats if stats[n] == pager.stats.as_dict()]
    assert stats[paged]["forwards"] == 1 and stats[paged]["transfers"] > 0
    # Once besides the process-wide "spill" total (which equals it when run alone).
    assert sum(stats[n] == handle.stats.as_dict() for n in stats if n != "spill") == 1
    assert stats["devices"]["cpu"]["in_use_bytes"] > 0
    text = str(stats)
    assert "bytes_out" in text and "KiB" in text and f"{paged}:" in text
    assert stats.as_dict()[paged] == pager.stats.as_dict()
    # A Stats object no live source owns still gets a section of its own.
    assert adaptive.memory_stats(PagingStats(forwards=7))["pagingstats"]["forwards"] == 7
    with pytest.raises(TypeError, match="memory_stats takes"):
        adaptive.memory_stats(object())


def test_a_step_that_runs_out_of_memory_fits_under_the_cap_when_spilled() -> None:
    # The spilled step runs first: a plain step that ran out leaves glibc's heap at the cap.
    code = """
        import threading, time, torch
        from adaptmem import adaptive
        from adaptmem._spilling._stats import in_use_bytes
        torch.set_num_threads(1)

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(512))

            def forward(self, x):
                return torch.tanh(x * self.w)

        model = torch.nn.Sequential(*[Layer() for _ in range(32)])
        x = torch.randn(2048, 512)  # 4 MiB per activation, 128 MiB saved in all
        peak, done = [0], False

        def sample():
            while not done:
                peak[0] = max(peak[0], in_use_bytes(torch.device("cpu")))
                time.sleep(0.001)

        cap = in_use_bytes(torch.device("cpu")) + 88 * 2**20
        adaptive.cpu_memory.set_cpu_memory_limit(cap / 2**30)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with adaptive.spill(mmap_threshold="1MiB") as handle:
            model(x).sum().backward()
        done = True
        sampler.join()
        print("SPILLED", handle.stats.bytes_out, peak[0], cap)
        print("GRAD", float(model[0].w.grad.abs().sum()) > 0)
        model.zero_grad(set_to_none=True)
        try:
            model(x).sum().backward()
            print("PLAIN FITS")
        except RuntimeError as exc:
            print("PLAIN OOM", adaptive.is_oom(exc))
    """
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr
    assert "PLAIN OOM True" in result.stdout, result.stdout
    spilled, peak, cap = map(int, result.stdout.split("SPILLED")[1].split()[:3])
    assert spilled >= 32 * 2**20
    assert peak < cap
    assert "GRAD True" in result.stdout


_MALLOC_PROBE = """
    import ctypes, os, sys, threading, time, torch
    from adaptmem import adaptive

    def held_bytes():  # anonymous resident memory
        with open("/proc/self/statm") as f:
            size, resident, shared = map(int, f.read().split()[:3])
        return (resident - shared) * os.sysconf("SC_PAGE_SIZE")

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            ).split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_on_its_own(nbytes):
        # In a new thread's arena, with no freed blocks to reuse, glibc maps a block of its
        # own exactly when its mmap threshold is at most nbytes.
        out = []

        def probe():
            before = libc.mallinfo2().hblkhd
            p = libc.malloc(nbytes)
            out.append(libc.mallinfo2().hblkhd - before >= nbytes)
            libc.free(p)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return out[0]

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh())
                                  for _ in range(16)])
    x = torch.randn(2048, 512)  # 4 MiB activations, 2 saved per layer
    peak, done = [0], [False]

    def sample():
        while not done[0]:
            peak[0] = max(peak[0], held_bytes())
            time.sleep(0.0005)

    start = held_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if sys.argv[1] == "spill":  # copies waiting to be written bounded, as on a slow disk
        with adaptive.spill(limit=0, max_pending="16MiB"):
            model(x).sum().backward()
    else:
        model(x).sum().backward()
    done[0] = True
    sampler.join()
    print("PEAK", peak[0] - start, "MAPPED", mapped_on_its_own(24 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION")
                    is None, reason="reads glibc's malloc statistics")
def test_spilling_frees_resident_memory_and_leaves_the_allocator_as_it_was() -> None:
    def run(how: str) -> tuple[int, bool]:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(_MALLOC_PROBE), how],
                                capture_output=True, text=True, timeout=180, env=env)
        assert result.returncode == 0, result.stderr
        words = result.stdout.split()
        return int(words[words.index("PEAK") + 1]), words[words.index("MAPPED") + 1] == "True"

    plain_peak, plain_mapped = run("plain")
    spilled_peak, spilled_mapped = run("spill")
    # glibc's adaptive mmap threshold is where the plain step left it: spilling changed no
    # allocator setting for the rest of the process.
    assert spilled_mapped == plain_mapped
    assert plain_peak > 100 * 2**20  # 32 saved activations of 4 MiB
    assert spilled_peak < 0.6 * plain_peak  # what spilling freed went back to the system


def test_an_interrupted_step_frees_the_activations_it_kept(tmp_path: Path) -> None:
    # A kept saved output handed back to autograd as-is would form a cycle through C++
    # (node -> saved tensor -> its grad_fn node) that gc cannot collect.
    kept: list[Any] = []
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(ValueError, match="stop"):
        with adaptive.spill(threshold="1GiB", limit=0, to=tmp_path) as handle:
            y = x.exp()  # exp saves its output: kept (under the threshold)
            kept.append(weakref.ref(y.untyped_storage()))
            del y
            raise ValueError("stop")
    assert handle.stats.tensors_kept >= 1
    gc.collect()
    assert kept[0]() is None


def test_the_train_example_runs_a_step_without_and_with_spilling(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from adaptmem.cli import main

    code = main(["example", "train", "--model", "resnet18", "--image-size", "16", "--batch", "2",
                 "--limit", "0", "--threshold", "64KiB", "--to", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "step without spilling: done" in out and "step with adaptive.spill: done" in out
    assert "adaptmem memory statistics" in out and "bytes_out" in out
    assert list(tmp_path.iterdir()) == []


def test_the_train_example_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from adaptmem.cli import main

    with pytest.raises(SystemExit) as info:
        main(["example", "train", "--threshold", "-1"])
    assert info.value.code == 2  # a usage error, in one line, as the other commands give
    err = capsys.readouterr().err
    assert err.startswith("adaptmem example train: error: ") and "threshold" in err
    assert err.count("\n") == 1


class _Done:
    """Stands in for a device event: the copies of _CpuMover are done at once."""

    def synchronize(self) -> None:
        pass


class _CpuMover:
    """The Mover protocol with CPU copies, to drive the accelerator bookkeeping (pinned
    host tier, host-then-disk, prefetch) without a device. Streams are not exercised."""

    used = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_host(self, src: torch.Tensor) -> tuple[torch.Tensor, _Done]:
        return src.clone(), _Done()

    def to_device(self, host: torch.Tensor, after: Any = None) -> tuple[torch.Tensor, _Done]:
        return host.clone(), _Done()

    def use(self, restored: torch.Tensor, done: _Done) -> None:
        type(self).used += 1


class _CpuLink(HostLink):
    """CPU tensors taken through host memory as an accelerator's are, by ``_CpuMover``."""

    def through_host(self, device: torch.device) -> bool:
        return True

    def mover(self, device: torch.device) -> _CpuMover:
        return _CpuMover(device)


@pytest.mark.parametrize("to", ["host", None, "dir"])
def test_the_accelerator_path_keeps_gradients_with_a_stand_in_device(
        to: str | None, tmp_path: Path) -> None:
    _CpuMover.used = 0
    x = torch.randn(256, 256, requires_grad=True)
    _exp_chain(x).sum().backward()
    want, x.grad = x.grad, None
    handle = Spill(threshold=0, limit=0, to=tmp_path if to == "dir" else to, link=_CpuLink())
    with handle:
        loss = _exp_chain(x).sum()
        if to == "dir":
            _until_written(handle)
        loss.backward()
    assert torch.equal(x.grad, want)
    assert handle.stats.tensors_spilled == handle.stats.tensors_restored == 6
    assert _CpuMover.used == handle.stats.bytes_in // (256 * 256 * 4) == 6
    # Host memory is the default next tier for an accelerator; a directory adds the disk.
    assert (handle.stats.seconds_writing > 0) == (to == "dir")
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


class _SlowLink(HostLink):
    """A stand-in device whose copies to host memory take ``seconds`` each and land only
    when waited for; it counts the copies under way (started, not landed) at each start.
    On a GPU each of them holds its source's device memory."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.under_way = self.most_under_way = 0

    def through_host(self, device: torch.device) -> bool:
        return True

    def mover(self, device: torch.device) -> Any:
        link = self

        class Landing:
            def __init__(self) -> None:
                self.at = time.monotonic() + link.seconds
                self.landed = False

            def synchronize(self) -> None:
                time.sleep(max(0.0, self.at - time.monotonic()))
                with link.lock:
                    link.under_way -= not self.landed
                    self.landed = True

        class SlowMover:
            def to_host(self, src: torch.Tensor) -> tuple[torch.Tensor, Landing]:
                with link.lock:
                    link.under_way += 1
                    link.most_under_way = max(link.most_under_way, link.under_way)
                return src.clone(), Landing()

            def to_device(self, host: torch.Tensor, after: Any = None) -> tuple[Any, None]:
                if after is not None:
                    after.synchronize()
                return host.clone(), None

            def use(self, restored: torch.Tensor, done: Any) -> None:
                pass

        return SlowMover()


@pytest.mark.parametrize("to", ["host", "dir"])
def test_max_pending_bounds_the_copies_under_way_on_the_host_tier_as_on_disk(
        to: str, tmp_path: Path) -> None:
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB per saved storage

    def forward() -> torch.Tensor:
        y = x
        for _ in range(6):
            y = y.exp().tanh()  # 12 saved storages
        return y.sum()

    forward().backward()
    want, x.grad = x.grad, None
    link = _SlowLink(seconds=0.02)
    handle = Spill(threshold=0, limit=0, to=tmp_path if to == "dir" else to,
                   max_pending="256KiB", link=link)
    with handle:
        forward().backward()
    assert handle.stats.tensors_spilled == 12 and torch.equal(x.grad, want)
    # Room for one copy: forward waited for the one before before it went on (the one just
    # started and the one waited for are under way together).
    assert link.most_under_way <= 2 and handle.stats.seconds_waiting > 0


def _until_written(handle: Any) -> None:
    """Wait (10 s at most) until a copy to the disk has landed. They run in the background:
    on a busy machine a backward took tensors back from memory before any was written, so
    nothing was read (bytes_in 0) or timed writing (seconds_writing 0.0)."""
    deadline = time.monotonic() + 10
    while not handle.stats.seconds_writing and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_retained_graph_restores_again_for_a_second_backward(tmp_path: Path) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    loss = _exp_chain(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    want, x.grad = x.grad, None
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        loss = _exp_chain(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.equal(x.grad, want)
    assert handle.stats.tensors_restored == handle.stats.tensors_spilled == 6
    del loss
    assert list(tmp_path.iterdir()) == [] and _fds_into(tmp_path) == []


def test_each_backward_through_a_retained_graph_reads_a_storage_once(tmp_path: Path) -> None:
    # Views of one storage share one restored copy in every pass, not only the first.
    x = torch.randn(256, 256, requires_grad=True)
    with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
        a = x.exp()
        loss = sum((a[i:] * a[:256 - i]).sum() for i in range(1, 9))
    assert handle.stats.tensors_spilled == 1 and handle.stats.tensors_shared == 16
    _until_written(handle)
    reads = []
    for n in range(3):
        before = handle.stats.bytes_in
        loss.backward(retain_graph=n < 2)
        reads.append(handle.stats.bytes_in - before)
    assert reads[1:] == [256 * 256 * 4] * 2, reads



def test_memory_in_use_is_read_only_when_a_decision_could_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reading memory in use costs (on a GPU it made a 7 ms step take 15-26 ms with nothing to
    # spill), so a step far from its limit reads it once, not at every saved tensor.
    from adaptmem._spilling import _limits

    reads: list[int] = []
    read = _limits.in_use_bytes
    monkeypatch.setattr(_limits, "in_use_bytes", lambda d: reads.append(1) or read(d))
    monkeypatch.setattr(_limits, "_REUSE_SECONDS", 60.0)  # the bytes rule alone, first
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)])
    x = torch.randn(1024, 512)  # 2 MiB per saved activation
    with adaptive.spill(limit="1TiB", to=tmp_path) as far:
        model(x).sum().backward()
    assert far.stats.tensors_spilled == 0 and len(reads) == 1
    # A reading stands for a while only: at 0 s every large saved tensor reads again.
    monkeypatch.setattr(_limits, "_REUSE_SECONDS", 0.0)
    reads.clear()
    with adaptive.spill(limit="1TiB", to=tmp_path):
        model(x).sum().backward()
    assert len(reads) >= 8
    monkeypatch.setattr(_limits, "_REUSE_SECONDS", 60.0)
    reads.clear()
    with adaptive.spill(limit=0, to=tmp_path) as spilling:  # far above: every one spilled
        loss = model(x).sum()
        pack_reads = len(reads)  # before backward: restores read too
        loss.backward()
    assert spilling.stats.tensors_spilled >= 8
    assert pack_reads <= 3, pack_reads


# -- a real GPU: the CUDA tier's streams and pinned copies under autograd ---------------------
# The simulated device runs no autograd, so these run only where a real GPU is: there, on a
# lent machine, `bash benchmarks/on_gpu.sh tests` or `lease` runs them (pytest -m gpu).

_REAL_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a real GPU: autograd does not run on the "
                                      "simulated device (benchmarks/on_gpu.sh runs these)")


def _gpu_step(model: nn.Module, x: torch.Tensor, spill: Any = None
              ) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One training step on the GPU; the loss, the gradients, and the device memory that
    forward left allocated for backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with spill if spill is not None else nullcontext():
        loss = model(x).pow(2).mean()
        torch.cuda.synchronize()
        time.sleep(0.2)  # copies out finish on their stream; their memory goes as they do
        held = torch.cuda.memory_allocated() - before
        loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], held


@pytest.mark.gpu
@_REAL_GPU
@pytest.mark.parametrize("to", ["host", "dir"])
def test_gpu_spilled_step_gives_bitwise_gradients_and_holds_less_device_memory(
        to: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU())
                            for _ in range(8)]).cuda()
    x = torch.randn(4096, 1024, device="cuda")  # 16 MiB per saved activation, 16 of them
    loss0, grads0, held0 = _gpu_step(model, x)
    handle = adaptive.spill(limit=0, to="host" if to == "host" else tmp_path)
    loss1, grads1, held1 = _gpu_step(model, x, handle)
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(a, b) for a, b in zip(grads1, grads0, strict=True))
    assert handle.stats.tensors_spilled >= 15
    assert handle.stats.tensors_restored == handle.stats.tensors_spilled
    assert held1 < 0.5 * held0, (held1, held0)


@pytest.mark.parametrize("held", ["file", "step"])
def test_a_collection_while_a_spill_lock_is_held_does_not_deadlock(held: str,
                                                                   tmp_path: Path) -> None:
    # A graph reachable only through a reference cycle is freed by a garbage collection,
    # which can run inside any allocation: here, while the thread holds the scratch file's
    # lock (its free list is searched under it) or the step's. Its spilled entries give
    # their regions back then; that used to wait on the lock its own thread held, for good.
    w = torch.randn(64, 64, requires_grad=True)
    handle = adaptive.spill(threshold=0, limit=0, to=str(tmp_path))
    finished = threading.Event()
    freed: list[int] = []

    def step() -> None:
        with handle:
            inner = handle._local.steps[-1][0]
            cycle: list[Any] = []
            cycle.append(cycle)
            cycle.append(torch.tanh(torch.randn(8, 64) @ w).exp())  # its saved tensors spill
            live = inner.live
            deadline = time.monotonic() + 10
            while inner.copies.futures and time.monotonic() < deadline:
                time.sleep(0.01)  # written: the writer holds them no more, only the cycle
            time.sleep(0.05)
            del cycle
            lock = inner.copies.disk._lock if held == "file" else inner.lock
            with lock:
                gc.collect()  # the cycle's entries die here
            freed.append(live - inner.live)  # their releases ran once the lock was let go
            (torch.tanh(torch.randn(8, 64) @ w).exp().sum()).backward()
        finished.set()

    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    worker.join(60)
    assert finished.is_set(), "the step hung"
    assert freed[0] >= 2  # tanh's output and exp's, given back
    assert w.grad is not None


def test_a_spill_lock_whose_wait_was_interrupted_still_runs_deferred_releases() -> None:
    # A Ctrl-C while waiting for the lock left the thread counted as holding it: every
    # later release of a spilled entry queued for good (scratch files never closed).
    from adaptmem._spilling._locks import HeldLock, when_free

    class Interrupted:
        def acquire(self, *args: Any) -> bool:
            raise KeyboardInterrupt

        def release(self) -> None:
            raise AssertionError("never taken")

    with pytest.raises(KeyboardInterrupt), HeldLock(Interrupted()):
        pass
    ran: list[int] = []
    when_free(ran.append, 1)
    assert ran == [1]  # at once: this thread holds no spill lock
    with HeldLock(threading.Lock()):
        when_free(ran.append, 2)
        assert ran == [1]  # deferred while held
    assert ran == [1, 2]
