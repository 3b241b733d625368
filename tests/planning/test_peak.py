"""Predicting activation memory per item on the meta device (``_planning/peak.py``): what
``adaptive.plan`` and ``adaptmem plan`` report, and what a batch size can start from."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from models import TinyGPT, tiny_gpt_inputs
from torch import nn

from adaptmem import adaptive
from adaptmem._common.peak import NotPredictable, PeakTracker
from adaptmem._planning import predict_model, predict_per_item
from adaptmem.cli import main


def _real_peak(fn: object, *args: object) -> int:
    """The same count on real CPU tensors: the bytes the call really allocates at its peak."""
    tracker = PeakTracker()
    with torch.no_grad(), tracker:
        out = fn(*args)  # type: ignore[operator]
        del out
    return tracker.peak


@pytest.mark.parametrize("batch", [8, 24])
def test_prediction_from_two_small_batches_matches_a_real_larger_batch(batch: int) -> None:
    model = torchvision.models.resnet18().eval()
    data = torch.randn(32, 3, 64, 64)

    def infer(b: int, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x[:b])

    predicted = predict_per_item(infer, model, data)
    real = _real_peak(infer, batch, model, data)
    assert predicted.per_item_bytes > 100_000  # 64 x 32 x 32 floats for the first conv alone
    assert abs(predicted.peak(batch) - real) <= 0.02 * real


def test_a_transformer_with_keyword_inputs_is_predicted_per_item() -> None:
    model = TinyGPT().eval()
    p = predict_model(model, (), tiny_gpt_inputs())
    eight = {k: v[:1].expand(8, -1).contiguous() for k, v in tiny_gpt_inputs().items()}
    real = _real_peak(lambda: model(**eight))
    assert abs(p.peak(8) - real) <= 0.05 * real


def test_nothing_the_caller_passed_changes_and_nothing_is_allocated() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).eval()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    before = {n: (t.data_ptr(), t.clone()) for n, t in model.state_dict().items()}
    data = torch.randn(16, 64)

    def infer(b: int, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        assert x.is_meta and next(m.parameters()).is_meta  # the traced call sees meta copies
        return m(x[:b])

    predict_per_item(infer, model, data)
    after = model.state_dict()
    assert all(after[n].data_ptr() == ptr and torch.equal(after[n], v)
               for n, (ptr, v) in before.items())
    assert not data.is_meta and len(calls) == 2  # the user's own hooks ran on the copies


def test_a_call_that_needs_values_is_not_predictable_and_says_why() -> None:
    def infer(b: int, x: torch.Tensor) -> torch.Tensor:
        return x[: int(x.sum().item()) % b + 1]

    with pytest.raises(NotPredictable, match="item"):
        predict_per_item(infer, torch.ones(4))


def test_largest_batch_stays_within_the_margin() -> None:
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 10)).eval()
    p = predict_model(model, (torch.randn(4, 128),), {})
    room = 10 * 2**20
    n = p.largest(room)
    assert p.peak(n) <= 0.8 * room < p.peak(n + 1)
    assert p.largest(p.fixed_bytes // 2) == 0  # not even the fixed part fits


def test_plan_and_the_cli_report_activations_and_the_largest_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = torchvision.models.resnet18().eval()
    planned = adaptive.plan(model, devices={"cuda:0": "100MiB", "cpu": None},
                            example_inputs=torch.randn(1, 3, 64, 64))
    act = planned.options["activations"]
    assert act["predicted"] and act["per_item_bytes"] > 0 and act["largest_batch"] > 1
    assert "per item" in str(planned) and "largest batch" in str(planned)
    assert main(["plan", "resnet18", "--image-size", "64", "--mode", "split", "--device",
                 "cuda:0=100MiB", "--device", "cpu", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["options"]["activations"]
    assert cli == act


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activations_are_predicted_in_the_dtype_of_the_first_device(
    dtype: torch.dtype, capsys: pytest.CaptureFixture[str],
) -> None:
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    full = adaptive.plan(model, devices={"cuda:0": "100MiB", "cpu": None}, example_inputs=x)
    half = adaptive.plan(model, devices={"cuda:0": "100MiB", "cpu": None}, example_inputs=x,
                         dtype=dtype)
    per_item = full.options["activations"]["per_item_bytes"]
    # About half (max pooling's int64 indices keep their size); it used to be all of it.
    assert 0.4 * per_item < half.options["activations"]["per_item_bytes"] < 0.6 * per_item
    assert half.options["activations"]["largest_batch"] > full.options["activations"][
        "largest_batch"]
    name = str(dtype).removeprefix("torch.")
    assert main(["plan", "resnet18", "--image-size", "64", "--mode", "split", "--device",
                 f"cuda:0@{name}=100MiB", "--device", "cpu", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["options"]["activations"]
    assert cli == half.options["activations"]


def test_plan_says_when_a_model_cannot_be_predicted() -> None:
    class NeedsValues(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.abs().max())

    planned = adaptive.plan(NeedsValues(), devices={"cpu": None},
                            example_inputs=torch.randn(2, 3))
    assert planned.options["activations"]["predicted"] is False
    assert "not predicted" in str(planned)
