"""What page, chunk and split do with a forward's inputs and outputs, for every engine: one
tensor passed twice stays one tensor. Models run on the simulated GPU with their inputs on
the CPU, so every engine moves them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
