"""What two models, or two tensors, share stays shared and comes back: one engine holds a
tensor at a time (a second placement that would take a tensor another engine holds is
refused before anything changes), and ``remove()`` puts tensors that were views of one
storage back into one storage, at their offsets and with their strides. Runs on the
simulated GPU where there is no real one."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import REAL_CUDA, run_if, tensors_on_cuda
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
    allocated = tensors_on_cuda()  # (a real GPU's process may hold some already)
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
    assert tensors_on_cuda() == allocated


@pytest.mark.parametrize("engine", list(PLACERS))
def test_the_common_parent_of_two_models_sharing_a_tensor_is_placed_and_put_back(
    engine: str
) -> None:
    allocated = tensors_on_cuda()  # (a real GPU's process may hold some already)
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
    assert tensors_on_cuda() == allocated


def _flat_model(device: str = "cpu") -> tuple[torch.Tensor, nn.Module]:
    """A model whose weights are views of one flat tensor (flat-parameter style), one of
    them not dense (every other element)."""
    flat = torch.arange(160, dtype=torch.float32, device=device) / 160
    first, second = nn.Linear(8, 8), nn.Linear(8, 4)
    first.weight = nn.Parameter(flat[:64].view(8, 8))
    first.bias = nn.Parameter(flat[64:72])
    second.weight = nn.Parameter(flat[72:136].view(4, 16)[:, ::2])
    second.bias = nn.Parameter(flat[140:144])
    return flat, nn.Sequential(first, nn.ReLU(), second).eval()


def _layout(model: nn.Module) -> list[tuple[str, int, tuple[int, ...], torch.device]]:
    return [(n, t.storage_offset(), t.stride(), t.device) for n, t in model.named_parameters()]


def _storages(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in model.parameters()}


LAYOUT_PLACERS: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "chunk": lambda m, x: adaptive.chunk(m, "cuda", capacity="1MiB", example_inputs=x),
    "chunk, one layer": lambda m, x: adaptive.chunk(m, "cuda", capacity=300,
                                                    example_inputs=x),
    "chunk, float16": lambda m, x: adaptive.chunk(m, "cuda", capacity="1MiB",
                                                  dtype=torch.float16, example_inputs=x),
    # The first layer moved, the second converted (its original kept, and so the storage).
    "split, second part bfloat16": lambda m, x: adaptive.split(
        m, {"cuda:0": 300, "cuda:0@bfloat16": None}, example_inputs=x),
    "page": lambda m, x: adaptive.page(m, "cuda", unit_bytes=0, resident_bytes=0),
    "page, resident": lambda m, x: adaptive.page(m, "cuda"),
}


@pytest.mark.parametrize("caller_keeps_the_flat_tensor", [True, False])
@pytest.mark.parametrize("engine", list(LAYOUT_PLACERS))
def test_remove_puts_views_of_one_storage_back_into_one_storage(
    engine: str, caller_keeps_the_flat_tensor: bool
) -> None:
    allocated = tensors_on_cuda()  # (a real GPU's process may hold some already)
    flat, model = _flat_model()
    layout, storage = _layout(model), flat.untyped_storage().data_ptr()
    values = {n: t.detach().clone() for n, t in model.named_parameters()}
    if not caller_keeps_the_flat_tensor:
        del flat
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with LAYOUT_PLACERS[engine](model, x), torch.no_grad():
        torch.testing.assert_close(model(x.cuda()).cpu(), expected, rtol=1e-2, atol=1e-2)
    assert _layout(model) == layout  # offsets, strides (a non-dense view too), the CPU
    assert len(_storages(model)) == 1
    for name, t in model.named_parameters():
        assert torch.equal(t.detach(), values[name]), name
    if caller_keeps_the_flat_tensor:  # the caller's flat tensor is the storage again
        assert _storages(model) == {storage}
        with torch.no_grad():
            flat.fill_(1.0)
        assert all(bool((t == 1).all()) for t in model.parameters())
    else:  # one new storage, of the original size
        assert model[0].weight.untyped_storage().nbytes() == 160 * 4
    gc.collect()
    assert tensors_on_cuda() == allocated


def test_a_device_map_edit_back_to_the_original_device_lays_tensors_out_as_they_were() -> None:
    flat, model = _flat_model()
    layout = _layout(model)
    x = torch.randn(2, 8)
    splitter = adaptive.split(model, {"cuda:0": None, "cpu": None}, device_map={"": "cuda:0"})
    with torch.no_grad():
        model(x)
    splitter.device_map = {"": "cpu"}  # back where everything came from, while placed
    assert _layout(model) == layout and _storages(model) == {flat.untyped_storage().data_ptr()}
    splitter.remove()
    assert _layout(model) == layout and _storages(model) == {flat.untyped_storage().data_ptr()}


@pytest.mark.parametrize("caller_keeps_the_flat_tensor", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        not REAL_CUDA, reason="a simulated storage is a new Python object at every call, so "
                              "one only the caller keeps is not found again (limitations.md)"))])
@pytest.mark.parametrize("engine", ["chunk", "page"])
def test_views_of_one_gpu_storage_come_back_into_one_when_placed_on_the_cpu(
    engine: str, caller_keeps_the_flat_tensor: bool
) -> None:
    flat, model = _flat_model("cuda")
    storage = flat.untyped_storage().data_ptr()
    if not caller_keeps_the_flat_tensor:
        del flat
    layout = _layout(model)
    values = {n: t.detach().cpu().clone() for n, t in model.named_parameters()}
    x = torch.randn(2, 8, device="cuda")
    handle = (adaptive.split(model, {"cpu": None}, example_inputs=x) if engine == "chunk"
              else adaptive.page(model, "cpu", unit_bytes=0, resident_bytes=0))
    with handle, torch.no_grad():
        model(x)
        assert model[0].weight.device.type == "cpu" or engine == "page"
    assert _layout(model) == layout and len(_storages(model)) == 1
    for name, t in model.named_parameters():
        assert torch.equal(t.detach().cpu(), values[name]), name
    if caller_keeps_the_flat_tensor:
        assert _storages(model) == {storage}
        with torch.no_grad():
            flat.fill_(1.0)
        assert all(bool((t == 1).all()) for t in model.parameters())
