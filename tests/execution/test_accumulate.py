"""``@adaptive.batch(accumulate=...)``: a training step that runs out of memory in backward
retries with smaller micro-batches, and its gradients are those of the full batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from adaptmem import OutOfMemoryError, adaptive
from adaptmem.testing import MemoryCeiling, make_oom

N = 12  # samples in the batch


class _Gate(torch.autograd.Function):
    """Identity in forward; in backward, asks ``fault`` for the micro-batch's size."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fault: Callable[[int], None]) -> torch.Tensor:
        ctx.fault = fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fault(grad.shape[0])
        return grad, None


class Gate(nn.Module):
    """Where backward runs out of memory: after the later layers' gradients were added."""

    def __init__(self) -> None:
        super().__init__()
        self.fault: Callable[[int], None] = lambda n: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Gate.apply(x, self.fault)


def _model(norm: str = "layer") -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 16), Gate(), nn.Tanh()]
    if norm == "batch":
        layers.append(nn.BatchNorm1d(16))
    else:
        layers.append(nn.LayerNorm(16))
    layers += [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    model = nn.Sequential(*layers).double()
    model.unused = nn.Parameter(torch.ones(2, dtype=torch.float64))  # never gets a gradient
    return model


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, 6, generator=g, dtype=torch.float64),
            torch.randn(N, 3, generator=g, dtype=torch.float64))


def _loop(model: nn.Module, batchsize: int, x: torch.Tensor, y: torch.Tensor) -> None:
    for xb, yb, weight in adaptive.microbatches(batchsize, x, y):
        (F.mse_loss(model(xb), yb) * weight).backward()


def _step(model: nn.Module, **options: Any) -> Any:
    @adaptive.batch(initial_batchsize=N, accumulate=model, cache=adaptive.NoBatchsizeCache,
                    **options)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        _loop(model, batchsize, x, y)
        return batchsize

    return train_step


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _state(model: nn.Module) -> dict[str, Any]:
    return {**_grads(model), **{n: b.clone() for n, b in model.named_buffers()}}


def _assert_bitwise(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert torch.equal(got[name], want[name]), name


def _plain(size: int, norm: str = "layer", before: Callable[[nn.Module], None] | None = None,
           ) -> dict[str, Any]:
    """What the step leaves with no ceiling, run at ``size`` from the start."""
    model = _model(norm)
    if before is not None:
        before(model)
    _loop(model, size, *_data())
    return _state(model)


@pytest.mark.parametrize("capacity", [1, 3, 7])
def test_a_step_that_runs_out_in_backward_keeps_the_full_batchs_gradients(
        capacity: int) -> None:
    model = _model()
    ceiling = MemoryCeiling(capacity)
    model[1].fault = ceiling.require
    used = _step(model)(*_data())

    assert ceiling.failures  # the full batch really failed in backward, part way
    assert used <= capacity
    # The same micro-batches from the start, with nothing failing: bitwise.
    _assert_bitwise(_state(model), _plain(used))
    # The full batch in one piece: the same up to summation order.
    full = _plain(N)
    for name, grad in _grads(model).items():
        if grad is None:
            assert full[name] is None
        else:
            torch.testing.assert_close(grad, full[name], rtol=1e-12, atol=1e-12)
    assert model.unused.grad is None


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(0, N), fail_at=st.integers(1, 6), min_batchsize=st.integers(1, 4),
       earlier=st.booleans(), norm=st.sampled_from(["layer", "batch"]))
def test_any_ceiling_and_any_failure_leave_the_state_of_some_run_without_failures(
        capacity: int, fail_at: int, min_batchsize: int, earlier: bool, norm: str) -> None:
    # Backward runs out above ``capacity`` samples and, once, on its ``fail_at``-th run. After
    # the call, gradients and buffers are bitwise those of the same micro-batches run with
    # nothing failing, or, when the call raised, those from before it.
    model = _model(norm)
    if earlier:
        _earlier_step(model)
    start = _state(model)
    ceiling = MemoryCeiling(capacity)
    once = _fail_once_at(fail_at)

    def fault(n: int) -> None:
        once(n)
        ceiling.require(n)

    model[1].fault = fault
    floor = max(min_batchsize, 2) if norm == "batch" else min_batchsize  # BatchNorm needs 2
    try:
        used = _step(model, min_batchsize=floor)(*_data())
    except OutOfMemoryError:
        _assert_bitwise(_state(model), start)
        return
    _assert_bitwise(_state(model), _plain(used, norm, _earlier_step if earlier else None))


def _fail_once_at(call: int) -> Callable[[int], None]:
    """A backward that runs out of memory on its ``call``-th run only."""
    calls = [0]

    def fault(n: int) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise make_oom("cuda", n)

    return fault


def test_micro_batches_that_finished_before_the_failure_are_not_counted_twice() -> None:
    # Micro-batches of 5: the first finishes its backward, the second runs out of memory.
    model = _model()
    model[1].fault = _fail_once_at(2)

    @adaptive.batch(initial_batchsize=5, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        _loop(model, batchsize, x, y)
        return batchsize

    assert train_step(*_data()) == 2
    _assert_bitwise(_state(model), _plain(2))


def _sized_step(capacity: int, cache: Any, split: Callable[..., None] = _loop,
                ) -> tuple[nn.Module, MemoryCeiling, list[int], Any]:
    """A step from 64 over a model whose backward holds ``capacity`` samples: the model, its
    ceiling, the sizes the step was passed, and the step (``split`` runs the batch)."""
    model = _model()
    ceiling = MemoryCeiling(capacity)
    model[1].fault = ceiling.require
    seen: list[int] = []

    @adaptive.batch(initial_batchsize=64, accumulate=model, cache=cache())
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        seen.append(batchsize)
        split(model, batchsize, x, y)
        return batchsize

    return model, ceiling, seen, train_step


@pytest.mark.parametrize("cache", [adaptive.NoBatchsizeCache, adaptive.GlobalBatchsizeCache])
def test_a_batch_shorter_than_the_size_is_retried_from_its_length(cache: Any) -> None:
    # 12 samples under a size of 64: the first attempt runs all 12 in one micro-batch. The
    # retry halves from 12, not from 64: 32 and 16 would run the same single micro-batch of
    # 12 again, and fail again.
    model, ceiling, seen, train_step = _sized_step(3, cache)
    assert train_step(*_data()) == 3
    assert seen == [64, 6, 3]
    assert ceiling.failures == [12, 6]
    _assert_bitwise(_state(model), _plain(3))
    assert train_step.stats.largest_size == 3  # what ran, not the 64 passed


def test_a_short_batch_that_fits_does_not_claim_its_size_fits() -> None:
    # 12 samples at a size of 64 fit; the next call's 40 samples at 64 do not. Had the first
    # call been filed as "64 fits", the second would have stepped down from 64 by tenths
    # (memory taken as tighter than before), failing at 57, 51, ... in turn.
    _, ceiling, seen, train_step = _sized_step(20, adaptive.GlobalBatchsizeCache)
    train_step(*_data())
    g = torch.Generator().manual_seed(3)
    train_step(torch.randn(40, 6, generator=g, dtype=torch.float64),
               torch.randn(40, 3, generator=g, dtype=torch.float64))
    assert seen == [64, 64, 20]
    assert ceiling.failures == [40]


def _split_by_hand(model: nn.Module, batchsize: int, x: torch.Tensor, y: torch.Tensor) -> None:
    for xb, yb in zip(x.split(batchsize), y.split(batchsize), strict=True):
        (F.mse_loss(model(xb), yb) * len(xb) / len(x)).backward()


def test_a_step_that_splits_its_batch_itself_is_taken_at_the_size_passed() -> None:
    # Without microbatches the decorator cannot know the batch's length: the size passed is
    # the size run, as before.
    _, _, seen, train_step = _sized_step(3, adaptive.NoBatchsizeCache, _split_by_hand)
    train_step(*_data())
    assert seen == [64, 32, 16, 8, 4, 2]


def test_without_accumulate_the_failed_attempt_counts_twice() -> None:
    # The control: the same step without accumulate= is wrong, so the tests above can fail.
    model = _model()
    model[1].fault = _fail_once_at(2)

    @adaptive.batch(initial_batchsize=5, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> None:
        _loop(model, batchsize, x, y)

    train_step(*_data())
    want = _plain(2)
    assert not torch.allclose(model[-1].weight.grad, want["6.weight"])  # type: ignore[arg-type]


def _earlier_step(model: nn.Module) -> None:
    x, y = _data(seed=7)
    (F.mse_loss(model(x), y)).backward()


@pytest.mark.parametrize("capacity", [2, 5])
def test_gradients_accumulated_before_the_call_are_restored_bitwise(capacity: int) -> None:
    model = _model()
    _earlier_step(model)
    grads = {n: p.grad for n, p in model.named_parameters()}
    ceiling = MemoryCeiling(capacity)
    model[1].fault = ceiling.require
    used = _step(model)(*_data())

    assert ceiling.failures
    _assert_bitwise(_state(model), _plain(used, before=_earlier_step))
    for name, p in model.named_parameters():
        assert p.grad is grads[name], name  # the caller's tensors, not copies


def test_running_statistics_move_only_with_the_attempt_that_succeeded() -> None:
    model = _model("batch")
    ceiling = MemoryCeiling(4)
    model[1].fault = ceiling.require
    used = _step(model)(*_data())

    assert ceiling.failures == [N, 6]
    assert used == 3
    # One update per micro-batch that succeeded, none from the failed attempts' forwards.
    assert int(model[3].num_batches_tracked) == N // used
    _assert_bitwise(_state(model), _plain(used, norm="batch"))


def test_a_step_that_fails_at_the_smallest_size_leaves_grads_and_buffers_as_they_were(
        ) -> None:
    model = _model("batch")
    _earlier_step(model)
    before = _state(model)
    model[1].fault = MemoryCeiling(0).require
    with pytest.raises(OutOfMemoryError):
        _step(model, min_batchsize=2)(*_data())
    _assert_bitwise(_state(model), before)


def test_any_error_leaves_the_gradients_as_they_were_and_passes_through_untouched() -> None:
    model = _model()
    _earlier_step(model)
    before = _state(model)
    error = ValueError("a bug in the step")

    @adaptive.batch(initial_batchsize=4, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> None:
        for i, (xb, yb, weight) in enumerate(adaptive.microbatches(batchsize, x, y)):
            if i == 2:  # after two finished backwards
                raise error
            (F.mse_loss(model(xb), yb) * weight).backward()

    with pytest.raises(ValueError) as raised:
        train_step(*_data())
    assert raised.value is error
    _assert_bitwise(_state(model), before)


class _Counter(nn.Module):
    """Counts forwards by assigning a new tensor, as some modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + x.shape[0]
        return x


def test_a_buffer_that_forward_replaces_is_put_back_too() -> None:
    model = _model()
    model.append(_Counter())
    seen = model[-1].seen
    model[1].fault = MemoryCeiling(3).require
    used = _step(model)(*_data())
    assert used == 3
    assert int(model[-1].seen) == N  # the failed attempts at 12 and 6 counted nothing
    assert seen is not model[-1].seen and int(seen) == 0


def test_parameters_given_as_a_list_are_guarded_and_others_are_not() -> None:
    model = _model()
    ceiling = MemoryCeiling(3)
    model[1].fault = ceiling.require
    last = model[-1]

    @adaptive.batch(initial_batchsize=N, accumulate=list(last.parameters()),
                    cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        _loop(model, batchsize, x, y)
        return batchsize

    used = train_step(*_data())
    want = _plain(used)
    assert torch.equal(last.weight.grad, want["6.weight"])  # type: ignore[arg-type]
    # Not guarded: the middle layer's gradient counts the failed attempts too.
    assert not torch.allclose(model[4].weight.grad, want["4.weight"])  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["model", "parameters"])
def test_a_part_unfrozen_after_decoration_is_put_back_too(how: str) -> None:
    # Gradual unfreezing: which parameters require gradients is read at each call, not
    # when the decorator was applied (the frozen part's gradients counted the failed
    # attempts twice).
    model = _model()
    ceiling = MemoryCeiling(3)
    model[1].fault = ceiling.require
    model[4].requires_grad_(False)  # frozen at first, even all of them for a list
    watched = model if how == "model" else [*model[4].parameters()]

    @adaptive.batch(initial_batchsize=N, accumulate=watched, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        _loop(model, batchsize, x, y)
        return batchsize

    model[4].requires_grad_(True)
    used = train_step(*_data())
    assert used == 3
    assert torch.equal(model[4].weight.grad, _plain(used)["4.weight"])  # type: ignore[arg-type]


def test_a_lazy_module_made_by_a_failed_attempt_starts_fresh_for_the_retry() -> None:
    # nn.LazyBatchNorm1d makes its buffers at its first forward: nothing to copy before
    # the first call (which crashed), and the statistics a failed attempt wrote are reset.
    def lazy_model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), Gate(), nn.LazyBatchNorm1d(),
                             nn.Linear(16, 3)).double()

    model = lazy_model()
    ceiling = MemoryCeiling(3)
    model[1].fault = ceiling.require
    used = _step(model)(*_data())
    assert used == 3 and ceiling.failures
    reference = lazy_model()
    _loop(reference, used, *_data())
    _assert_bitwise(_state(model), _state(reference))


def test_a_method_decorated_with_accumulate_binds_its_instance() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.model = _model()

        def step(self, batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
            _loop(self.model, batchsize, x, y)
            return batchsize

    trainer = Trainer()
    ceiling = MemoryCeiling(5)
    trainer.model[1].fault = ceiling.require
    step = adaptive.batch(initial_batchsize=N, accumulate=trainer.model,
                          cache=adaptive.NoBatchsizeCache)(trainer.step)
    used = step(*_data())
    assert ceiling.failures and used <= 5
    _assert_bitwise(_state(trainer.model), _plain(used))


def test_an_inputs_gradient_counts_each_sample_once_too() -> None:
    # A step that wants its input's gradient (adversarial training, saliency): micro-batches
    # of 5, the first finishes its backward (adding to x.grad), the second runs out of
    # memory. The failed attempt's contribution is undone like the parameters'.
    model = _model()
    model[1].fault = _fail_once_at(2)

    @adaptive.batch(initial_batchsize=5, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        _loop(model, batchsize, x, y)
        return batchsize

    x, y = _data()
    x.requires_grad_()
    assert train_step(x, y) == 2
    plain_x = x.detach().clone().requires_grad_()
    _loop(_model(), 2, plain_x, y)
    assert torch.equal(x.grad, plain_x.grad)


def test_the_searchs_failures_leave_an_auto_spill_handle_as_it_was(tmp_path: Path) -> None:
    # limit="auto" keeps more free after a step runs out of memory. The batch search's own
    # failures (12 and 6 fail, 3 fits) must not leave it spilling everything for good.
    model = _model()
    ceiling = MemoryCeiling(3)
    model[1].fault = ceiling.require
    handle = adaptive.spill(threshold=0, to=tmp_path)  # limit="auto"
    step = _spilled_step(model, handle)
    assert step(*_data()) == 3
    assert ceiling.failures == [12, 6]
    assert handle.keep_free == 0.5
    _assert_bitwise(_state(model), _plain(3))
    # Failing at the smallest size is a step that does not fit: it keeps the escalation.
    ceiling.capacity = 0
    with pytest.raises(OutOfMemoryError):
        _spilled_step(model, handle)(*_data())
    assert handle.keep_free == 1.0


def _spilled_step(model: nn.Module, handle: Any) -> Any:
    @adaptive.batch(initial_batchsize=N, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        for xb, yb, weight in adaptive.microbatches(batchsize, x, y):
            with handle:
                (F.mse_loss(model(xb), yb) * weight).backward()
        return batchsize

    return train_step


@pytest.mark.parametrize("capacity", [3, 6])
def test_accumulation_composes_with_spilling(capacity: int, tmp_path: Path) -> None:
    model = _model()
    ceiling = MemoryCeiling(capacity)
    model[1].fault = ceiling.require

    @adaptive.batch(initial_batchsize=N, accumulate=model, cache=adaptive.NoBatchsizeCache)
    def train_step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> int:
        with adaptive.spill(threshold=0, limit=0, to=tmp_path) as handle:
            _loop(model, batchsize, x, y)
        assert handle.stats.tensors_spilled > 0
        return batchsize

    used = train_step(*_data())
    assert ceiling.failures
    _assert_bitwise(_state(model), _plain(used))
    assert list(tmp_path.iterdir()) == []  # the failed attempts left no scratch file


def test_microbatches_split_every_tensor_and_weigh_each_piece() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    pieces = list(adaptive.microbatches(2, x, y))
    assert [w for *_, w in pieces] == [0.4, 0.4, 0.2]
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)
    assert torch.equal(torch.cat([p[1] for p in pieces]), y)
    along = list(adaptive.microbatches(3, x.t(), dim=-1))
    assert [tuple(p[0].shape) for p in along] == [(2, 3), (2, 2)]
    batch = {"input_ids": x, "labels": y, "return_dict": True}
    dicts = list(adaptive.microbatches(2, batch))
    assert [sorted(d) for d, _ in dicts] == [["input_ids", "labels", "return_dict"]] * 3
    assert torch.equal(torch.cat([d["labels"] for d, _ in dicts]), y)
    assert all(d["return_dict"] is True for d, _ in dicts)
    assert [w for _, w in dicts] == [0.4, 0.4, 0.2]


def test_microbatches_slices_nested_dicts_and_refuses_lists_that_may_be_per_sample() -> None:
    batch = {"x": {"ids": torch.arange(4), "mask": torch.ones(4)}, "y": torch.arange(4),
             "sizes": [3, 5], "name": "run"}
    pieces = list(adaptive.microbatches(3, batch))
    assert [(b["x"]["ids"].tolist(), b["y"].tolist(), w) for b, w in pieces] == [
        ([0, 1, 2], [0, 1, 2], 0.75), ([3], [3], 0.25)]
    assert all(b["sizes"] == [3, 5] and b["name"] == "run" for b, _ in pieces)  # shared
    for key, value in (("labels", [{"boxes": torch.ones(1, 4)}] * 4),  # one per sample
                       ("captions", ["a", "b", "c", "d"]),
                       ("past", (torch.ones(4, 2), torch.ones(4, 2)))):
        with pytest.raises(TypeError, match=rf"argument 1\['{key}'\] is a .*cannot tell apart"):
            adaptive.microbatches(2, {"x": torch.arange(4), key: value})
    with pytest.raises(ValueError, match=r"1\['x'\]\['ids'\]: 4, argument 1\['y'\]: 3"):
        adaptive.microbatches(2, {"x": {"ids": torch.arange(4)}, "y": torch.arange(3)})


@pytest.mark.parametrize("args, error, words", [
    ((0, torch.ones(3)), ValueError, "1 or more"),
    ((2.0, torch.ones(3)), TypeError, "an int"),
    ((2,), TypeError, "one or more tensors"),
    ((2, [1, 2]), TypeError, "argument 1 is list"),
    ((2, torch.ones(0, 3), torch.ones(0)), ValueError, "empty batch .length 0 along dim=0"),
    ((2, {"mask": None}), TypeError, "argument 1 is a dict that holds none"),
    ((2, torch.ones(3), torch.ones(4)), ValueError, "argument 1: 3, argument 2: 4"),
    ((2, {"ids": torch.ones(3), "y": torch.ones(2)}), ValueError,
     r"argument 1\['ids'\]: 3, argument 1\['y'\]: 2"),
])
def test_microbatches_refuses_bad_input(args: tuple[Any, ...], error: type,
                                        words: str) -> None:
    with pytest.raises(error, match=words):
        adaptive.microbatches(*args)


def _params() -> Iterator[torch.Tensor]:
    yield from ()


@pytest.mark.parametrize("value, error, words", [
    ("model", TypeError, "takes the model being trained"),
    (3, TypeError, "got int 3"),
    ({"w": torch.ones(2)}, TypeError, "got dict"),
    ([torch.ones(2, requires_grad=True), "w"], TypeError, "got str 'w' as item 1 of the list"),
    (_params(), ValueError, "empty collection"),
])
def test_accumulate_refuses_what_is_no_model_or_parameters(value: Any, error: type,
                                                           words: str) -> None:
    with pytest.raises(error, match=words):
        adaptive.batch(initial_batchsize=4, accumulate=value)


def test_accumulate_refuses_generator_and_async_steps() -> None:
    def gen(batchsize: int) -> Iterator[int]:
        yield batchsize

    async def coro(batchsize: int) -> int:
        return batchsize

    for func in (gen, coro):
        with pytest.raises(TypeError, match="generator or async function"):
            adaptive.batch(initial_batchsize=4, accumulate=nn.Linear(2, 2))(func)


def test_accumulate_says_a_step_returning_microbatches_must_iterate_them() -> None:
    # A plain step that returned adaptive.microbatches(...) was told it "is a generator or
    # async function" and to be written as a plain function, which it was.
    model = nn.Linear(4, 2)

    @adaptive.batch(initial_batchsize=4, accumulate=model)
    def step(batchsize: int, x: torch.Tensor) -> Any:
        return adaptive.microbatches(batchsize, x)

    with pytest.raises(TypeError, match=r"step' returned a generator .* iterating microbatches "
                                        r"inside it"):
        step(torch.ones(8, 4))


@pytest.mark.parametrize("decorator", [adaptive.range, adaptive.chunked])
def test_range_and_chunked_refuse_accumulate(decorator: Any) -> None:
    with pytest.raises(TypeError, match="does not take accumulate=.*@adaptive.batch"):
        decorator(initial_step=4, accumulate=nn.Linear(2, 2))


def test_under_a_real_cpu_cap_the_step_retries_smaller_and_keeps_the_gradients(
        tmp_path: Path) -> None:
    # The full batch's backward needs more than the cap allows: the allocator really fails.
    code = """
        import sys, torch
        import torch.nn.functional as F
        from adaptmem import adaptive
        from adaptmem._spilling._stats import in_use_bytes
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                          torch.nn.Tanh()) for _ in range(24)])
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4096, 256, generator=g), torch.randn(4096, 256, generator=g)
        adaptive.cpu_memory.set_cpu_memory_limit(
            (in_use_bytes(torch.device("cpu")) + 48 * 2**20) / 2**30)

        @adaptive.batch(initial_batchsize=4096, accumulate=model,
                        cache=adaptive.NoBatchsizeCache)
        def train_step(batchsize, x, y):
            for xb, yb, weight in adaptive.microbatches(batchsize, x, y):
                (F.mse_loss(model(xb), yb) * weight).backward()
            return batchsize

        print("USED", train_step(x, y))
        torch.save({n: p.grad for n, p in model.named_parameters()}, sys.argv[1])
    """
    out = tmp_path / "grads.pt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(out)],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    used = int(result.stdout.split("USED")[1].split()[0])
    assert used < 4096  # the full batch did not fit under the cap
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(24)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4096, 256, generator=g), torch.randn(4096, 256, generator=g)
    F.mse_loss(model(x), y).backward()
    grads = torch.load(out)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_accumulate_skips_frozen_parameters_and_refuses_group_and_auto() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)  # fine-tuning the head only
    adaptive.batch(initial_batchsize=4, accumulate=model.parameters())  # accepted
    with pytest.raises(ValueError, match="not supported yet"):
        adaptive.batch(initial_batchsize=4, accumulate=model, group="world")
    with pytest.raises(ValueError, match="'auto'"):
        adaptive.batch(initial_batchsize="auto", accumulate=model)


def test_an_interrupted_step_leaves_the_gradients_as_they_were() -> None:
    model = torch.nn.Linear(2, 1)
    calls = []

    @adaptive.batch(initial_batchsize=4, accumulate=model)
    def step(batchsize: int, x: torch.Tensor) -> None:
        for xb, weight in adaptive.microbatches(batchsize, x):
            (model(xb).sum() * weight).backward()
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt  # Ctrl-C after one micro-batch's backward

    with pytest.raises(KeyboardInterrupt):
        step(torch.ones(8, 2))
    assert model.weight.grad is None  # the partial sum is gone: a rerun counts nothing twice


def test_a_generator_step_is_refused_through_staticmethod_or_a_hiding_wrapper() -> None:
    # Retries of a generator step run after the call, out of the guard's reach: the
    # failed attempts' gradients would count again.
    model = nn.Linear(3, 1)
    with pytest.raises(TypeError, match="Trainer.step.*generator or async"):
        class Trainer:
            @adaptive.batch(initial_batchsize=8, accumulate=model)
            @staticmethod
            def step(batchsize: int, x: torch.Tensor) -> Iterator[int]:
                yield batchsize

    def generator_step(batchsize: int, x: torch.Tensor) -> Iterator[int]:
        for xb, w in adaptive.microbatches(batchsize, x):
            (model(xb).sum() * w).backward()
            yield batchsize

    def hiding(*args: Any) -> Any:  # a wrapper without functools.wraps hides what it calls
        return generator_step(*args)

    step = adaptive.batch(hiding, initial_batchsize=8, accumulate=model)
    with pytest.raises(TypeError, match="generator or async"):
        step(torch.randn(8, 3))
    assert model.weight.grad is None  # none of its work ran


@pytest.mark.parametrize("dim", [True, 1.0, "0"])
def test_microbatches_refuses_a_dim_that_is_not_an_int(dim: Any) -> None:
    with pytest.raises(TypeError, match="dim= as an int"):
        adaptive.microbatches(2, torch.randn(6, 4), dim=dim)


def test_microbatches_takes_a_numpy_dim() -> None:
    np = pytest.importorskip("numpy")
    pieces = list(adaptive.microbatches(2, torch.randn(3, 4), dim=np.int64(1)))
    assert [p[0].shape for p in pieces] == [(3, 2), (3, 2)]


def test_an_epochs_short_last_batch_is_not_reported_as_free_memory_moving() -> None:
    model = nn.Linear(4, 1)
    events: list[adaptive.Adaptation] = []

    @adaptive.batch(initial_batchsize=8, accumulate=model, on_adapt=events.append)
    def step(batchsize: int, x: torch.Tensor, y: torch.Tensor) -> None:
        for xb, yb, w in adaptive.microbatches(batchsize, x, y):
            (F.mse_loss(model(xb), yb) * w).backward()

    for n in (32, 32, 5, 32, 32):  # an epoch's last batch has 5 samples
        step(torch.randn(n, 4), torch.randn(n, 1))
    assert events == []
    assert step.stats.smallest_size == step.stats.largest_size == 8
