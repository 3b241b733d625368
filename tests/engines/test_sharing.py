"""What two models share comes back: one engine holds a tensor at a time (a second placement
that would take a tensor another engine holds is refused before anything changes). Runs on
the simulated GPU where there is no real one."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import run_if
from torch import nn

from adaptmem import PlacementError, adaptive

pytestmark = [run_if(cuda=True)]

_IDS = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))


class _Seq2Seq(nn.Module):
    """T5's shape: an encoder and a decoder that share one embedding Parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(100, 16)
        self.encoder = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 16))
        self.decoder = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 16))
        self.encoder[0].weight = self.shared.weight
        self.decoder[0].weight = self.shared.weight
        self.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(ids) + self.decoder(ids)


PLACERS: dict[str, Callable[[nn.Module], Any]] = {
    "page": lambda m: adaptive.page(m, "cuda", unit_bytes=0, resident_bytes=0),
    "page, resident": lambda m: adaptive.page(m, "cuda"),
    "chunk": lambda m: adaptive.chunk(m, "cuda", capacity="1MiB", example_inputs=_IDS),
    "chunk, float16": lambda m: adaptive.chunk(m, "cuda", capacity="1MiB",
                                               dtype=torch.float16),
}


def _state(model: nn.Module) -> dict[str, tuple[int, torch.device, torch.dtype, torch.Tensor]]:
    return {n: (id(t), t.device, t.dtype, t.detach().cpu().clone())
            for n, t in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("first_part", ["encoder", "decoder"])
@pytest.mark.parametrize("second", ["page", "chunk"])
@pytest.mark.parametrize("first", list(PLACERS))
def test_placing_a_model_that_shares_a_tensor_with_a_placed_one_is_refused_until_removed(
    first: str, second: str, first_part: str
) -> None:
    model = _Seq2Seq()
    one = getattr(model, first_part)
    other = model.decoder if one is model.encoder else model.encoder
    before = _state(model)
    with torch.no_grad():
        expected_one, expected_other = one(_IDS), other(_IDS)
    handle = PLACERS[first](one)
    with torch.no_grad():
        placed_output = one(_IDS.cuda()).cpu()
    placed = _state(model)
    with pytest.raises(PlacementError, match=(
            r"tensor '0\.weight' of this model is also '0\.weight' of another model "
            r"\(Sequential\) that adaptive\.(page|chunk) holds.*one engine holds a tensor at a "
            r"time: place one module that contains both models.*common parent.*or call "
            r"\.remove\(\) on that (Pager|Chunker) first")):
        PLACERS[second](other)
    assert _state(model).keys() == placed.keys()
    for name, (ident, device, dtype, value) in _state(model).items():  # nothing changed
        assert (ident, device, dtype) == placed[name][:3] and torch.equal(value, placed[name][3])
    with torch.no_grad():
        assert torch.equal(one(_IDS.cuda()).cpu(), placed_output)
    handle.remove()
    # The fix the message names: the second one, placed once the first let go.
    with PLACERS[second](other), torch.no_grad():
        torch.testing.assert_close(other(_IDS.cuda()).cpu(), expected_other)
    with torch.no_grad():
        assert torch.equal(one(_IDS), expected_one)
    after = _state(model)
    for name, (ident, device, dtype, value) in before.items():  # all back, bitwise, on the CPU
        assert after[name][:3] == (ident, device, dtype) and torch.equal(after[name][3], value)
    assert model.encoder[0].weight is model.decoder[0].weight is model.shared.weight
    gc.collect()
    assert torch.cuda.memory_allocated() == 0


@pytest.mark.parametrize("engine", list(PLACERS))
def test_the_common_parent_of_two_models_sharing_a_tensor_is_placed_and_put_back(
    engine: str
) -> None:
    model = _Seq2Seq()
    before = _state(model)
    with torch.no_grad():
        expected = model(_IDS)
    with PLACERS[engine](model), torch.no_grad():
        torch.testing.assert_close(model(_IDS.cuda()).cpu(), expected, rtol=1e-2, atol=1e-2)
    after = _state(model)
    for name, (ident, device, dtype, value) in before.items():
        assert after[name][:3] == (ident, device, dtype) and torch.equal(after[name][3], value)
    gc.collect()
    assert torch.cuda.memory_allocated() == 0
