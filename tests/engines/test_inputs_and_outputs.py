"""What page, chunk and split do with a forward's inputs and outputs, for every engine:
dataclass outputs come back where the inputs came from, and one tensor passed twice stays
one tensor. Models run on the simulated GPU with their inputs on the CPU, so every engine
moves them."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from conftest import run_if
from torch import nn

from adaptmem import adaptive

ENGINES: dict[str, Callable[[nn.Module], Any]] = {
    "page": lambda m: adaptive.page(m, "cuda", unit_bytes=0, resident_bytes=0),
    "page, resident": lambda m: adaptive.page(m, "cuda"),
    "chunk": lambda m: adaptive.chunk(m, "cuda", capacity="1MiB"),
    "split": lambda m: adaptive.split(m, {"cuda:0": 600, "cuda:1": "1MiB"}),
}


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make().eval()


# -- dataclass outputs --------------------------------------------------------------------


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    built: ClassVar[int] = 0  # instances made, counted by __post_init__

    def __post_init__(self) -> None:
        type(self).built += 1


@dataclasses.dataclass(frozen=True)
class _Frozen:
    h: torch.Tensor


_Pair = collections.namedtuple("_Pair", "a b")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> _Frozen:
        return _Frozen(self.lin(x))


class _DataclassNet(nn.Module):
    """Children return a frozen dataclass, combined in a residual; the model returns a
    dataclass and a namedtuple."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = _Block(), _Block()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[_Output, Any]:
        h = self.b1(x).h
        h = h + self.b2(h).h
        return _Output(self.head(h), h), _Pair(h, h.sum())


@run_if(cuda=True)
@pytest.mark.parametrize("engine", [*ENGINES, "chunk, the first block alone"])
def test_dataclass_outputs_come_back_where_the_inputs_came_from(engine: str) -> None:
    x = torch.randn(3, 8)
    model = _seeded(_DataclassNet)
    place = ENGINES.get(engine) or (lambda m: adaptive.chunk(m, "cuda", capacity=300))
    with torch.no_grad():
        (expected, pair) = model(x)
        with place(model):
            model(x)  # chunk and split record their first forward on a copy
            _Output.built = 0
            out, placed_pair = model(x)
            built = _Output.built
    assert type(out) is _Output and built == 1  # copied, not built again
    for got, want in ((out.logits, expected.logits), (out.hidden, expected.hidden),
                      (placed_pair.a, pair.a), (placed_pair.b, pair.b)):
        assert got.device.type == "cpu"
        assert torch.equal(got, want)
    assert type(placed_pair) is _Pair


def test_dataclass_outputs_come_back_in_the_dtype_the_inputs_had() -> None:
    x = torch.randn(3, 8)
    model = _seeded(_DataclassNet)
    with torch.no_grad(), adaptive.chunk(model, "cpu", capacity="1MiB", dtype=torch.float64):
        out, pair = model(x)
    assert out.logits.dtype == out.hidden.dtype == pair.a.dtype == torch.float32


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ["page", "chunk"])
def test_a_model_output_of_transformers_still_comes_back(engine: str) -> None:
    modeling = pytest.importorskip("transformers.modeling_outputs")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Any:
            return modeling.BaseModelOutput(last_hidden_state=self.lin(x))

    model = _seeded(Net)
    x = torch.randn(3, 8)
    with torch.no_grad(), ENGINES[engine](model):
        out = model(x)
    assert isinstance(out, modeling.BaseModelOutput)
    assert out.last_hidden_state.device.type == "cpu"
    assert out["last_hidden_state"] is out.last_hidden_state


# -- aliased inputs -----------------------------------------------------------------------


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.attn(h, h, h, need_weights=False)[0]


@run_if(cuda=True, min_gpus=2)
def test_one_tensor_passed_three_times_across_a_boundary_stays_one_tensor() -> None:
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    model = _seeded(_SelfAttention)
    seen: list[bool] = []
    model.attn.register_forward_pre_hook(lambda m, a: seen.append(a[0] is a[1] is a[2]))
    with torch.no_grad():
        expected = model(x)
        with adaptive.split(model, device_map={"pre": "cuda:0", "attn": "cuda:1"}):
            out = model(x)
    assert seen and all(seen)  # the packed self-attention path, as unplaced
    assert torch.equal(out, expected)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor, *, c: list[torch.Tensor]) -> Any:
        return self.lin(a), a is b is c[0]


@run_if(cuda=True)
@pytest.mark.parametrize("engine", ENGINES)
def test_one_tensor_passed_twice_to_the_model_reaches_its_forward_once(engine: str) -> None:
    x = torch.randn(3, 8)
    model = _seeded(_Two)
    with torch.no_grad(), ENGINES[engine](model):
        out, same = model(x, x, c=[x])
    assert same
    assert out.device.type == "cpu"
