"""The engines together: one engine per model, and loading into a real Pager or Chunker."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adaptmem import PlacementError, adaptive


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)),
        nn.Linear(64, 8),
    ).eval()


def test_a_chunked_model_cannot_be_paged_and_a_paged_one_cannot_be_chunked() -> None:
    model = _model(0)
    with adaptive.chunk(model, "cpu", capacity=10_000, dtype=torch.bfloat16,
                        example_inputs=(torch.randn(1, 32),)):
        with pytest.raises(PlacementError, match="already placed by adaptive.chunk;"):
            adaptive.page(model, "cpu")
        with pytest.raises(PlacementError, match="part of a placed model"):
            adaptive.page(model[2], "cpu")
    assert not model._forward_pre_hooks
    with adaptive.page(model, "cpu", resident_bytes=0):
        with pytest.raises(PlacementError, match="already paged by adaptive.page"):
            adaptive.chunk(model, "cpu", capacity=10_000)
        with pytest.raises(PlacementError, match="part of a paged model"):
            adaptive.split(model[2], {"cpu": None})
    assert not model._forward_pre_hooks


def test_load_into_a_real_pager_gives_the_checkpoint_model(tmp_path) -> None:
    source = _model(1)
    path = tmp_path / "model.pt"
    torch.save(source.state_dict(), path)
    x = torch.randn(4, 32)
    model = _model(2)  # other weights
    pager = adaptive.page(model, "cpu", resident_bytes=0, unit_bytes=20_000)
    adaptive.load(model, path, device=pager)
    assert torch.equal(model(x), source(x))
    pager.remove()
    for (name, got), want in zip(model.state_dict().items(), source.state_dict().values(),
                                 strict=True):
        assert torch.equal(got, want), name


def test_load_into_a_real_chunker_fills_placed_copies_and_originals(tmp_path) -> None:
    source = _model(3)
    path = tmp_path / "model.safetensors"
    from safetensors.torch import save_file

    save_file(source.state_dict(), str(path))
    x = torch.randn(4, 32)
    model = _model(4)
    chunker = adaptive.chunk(model, "cpu", capacity=10_000, dtype=torch.bfloat16,
                             example_inputs=(x,))
    adaptive.load(model, path, device=chunker)
    got, want = model(x), source(x)
    assert torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want) < 5e-2
    chunker.remove()
    assert torch.equal(model(x), want)  # the kept fp32 originals were loaded too


def test_weights_changed_between_forwards_are_never_served_from_a_stale_prefetch(tmp_path) -> None:
    source = _model(5)
    path = tmp_path / "model.pt"
    torch.save(source.state_dict(), path)
    x = torch.randn(4, 32)
    model = _model(6)
    with adaptive.page(model, "cpu", resident_bytes=0, unit_bytes=20_000) as pager:
        model(x)
        model(x)  # the next forward's first units are prefetched now
        adaptive.load(model, path, device=pager)
        assert torch.equal(model(x), source(x))
        with torch.no_grad():
            model[0].weight.zero_()  # an in-place edit through the parameter itself
            source[0].weight.zero_()
        assert torch.equal(model(x), source(x))


def test_a_model_dispatched_by_accelerate_is_refused_by_every_engine() -> None:
    model = _model(7)
    model[0]._hf_hook = object()  # what accelerate's dispatch leaves on a module
    for engine in (lambda: adaptive.page(model, "cpu"), lambda: adaptive.chunk(model, "cpu")):
        with pytest.raises(PlacementError, match="remove_hook_from_module"):
            engine()
    assert not model._forward_pre_hooks
