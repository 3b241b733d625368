"""Sparse and nested tensors in a ``torch.save`` file: refused naming their key, or passed
over outside the state dict, on every torch ([Note: tensors that are not dense])."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from adaptmem import LoadError, adaptive

# torch's own notes on making the test's tensors (once a process, so in whichever test runs
# first), not about loading them.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse (CSR|BSR) tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype"),
]


def _as_torch_2_11(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.load as torch 2.11 runs it: sparse invariants checked only where asked (they are
    not by default), so a sparse tensor on meta comes back instead of failing the load."""
    def unchecked(weights_only: bool = False) -> None:
        torch._utils._sparse_tensors_to_validate.clear()  # as the original's `finally` does

    monkeypatch.setattr(torch._utils, "_validate_loaded_sparse_tensors", unchecked)


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)


NOT_DENSE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "coo": (lambda: torch.eye(3).to_sparse(), r"has layout torch\.sparse_coo"),
    "csr": (lambda: torch.eye(3).to_sparse_csr(), r"has layout torch\.sparse_csr"),
    "bsr": (lambda: torch.eye(4).to_sparse_bsr((2, 2)), r"has layout torch\.sparse_bsr"),
    "nested": (_nested, "is a nested tensor"),
}


@pytest.mark.parametrize("torch_version", ["this", "2.11"])
@pytest.mark.parametrize("archive", ["zip", "legacy"])
@pytest.mark.parametrize("kind", list(NOT_DENSE))
def test_a_tensor_that_is_not_dense_is_refused_naming_its_key(
    kind: str, archive: str, torch_version: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make, layout = NOT_DENSE[kind]
    if torch_version == "2.11":
        _as_torch_2_11(monkeypatch)
    torch.save({"bias": torch.zeros(3), "weight": make()}, tmp_path / "s.pt",
               _use_new_zipfile_serialization=archive == "zip")
    with pytest.raises(LoadError, match=rf"s\.pt' is not a readable checkpoint for adaptive\."
                                        rf"load: its tensor 'weight' {layout}, and "
                                        rf"adaptive\.load reads dense tensors only.*torch\.load"):
        adaptive.load(lambda: nn.Linear(3, 3), tmp_path / "s.pt")


@pytest.mark.parametrize("torch_version", ["this", "2.11"])
def test_a_sparse_tensor_beside_the_state_dict_is_passed_over(
    torch_version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A training checkpoint: the model's state dict beside an embedding's sparse gradient.
    if torch_version == "2.11":
        _as_torch_2_11(monkeypatch)
    torch.manual_seed(0)
    source = nn.Linear(3, 3)
    torch.save({"model": source.state_dict(), "grad": torch.eye(3).to_sparse()},
               tmp_path / "run.pt")
    check = torch._utils._validate_loaded_sparse_tensors
    model, stats = adaptive.load(lambda: nn.Linear(3, 3), tmp_path / "run.pt", device="cpu",
                                 return_stats=True)
    assert torch.equal(model.weight, source.weight)
    assert torch.equal(model.bias, source.bias)
    # Read on meta, not mapped whole through torch.load(mmap=True) (which a CPU memory cap
    # counts), and torch's own check of sparse tensors is as it was for other loads.
    assert stats.format == "torch"
    assert torch._utils._validate_loaded_sparse_tensors is check


@pytest.mark.parametrize("torch_version", ["this", "2.11"])
def test_a_rezipped_checkpoint_with_a_sparse_tensor_beside_the_state_dict_loads(
        torch_version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A zip tool that rewrites the archive: the loader then counts every storage of the
    # pickle against the archive's records, the sparse tensor's index and values among them.
    if torch_version == "2.11":
        _as_torch_2_11(monkeypatch)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(512, 1024))
    torch.save({"model": source.state_dict(), "grad": torch.eye(3).to_sparse()},
               tmp_path / "run.pt")
    with zipfile.ZipFile(tmp_path / "run.pt") as saved, \
            zipfile.ZipFile(tmp_path / "rezipped.pt", "w") as rezipped:
        for info in saved.infolist():
            rezipped.writestr(info.filename, saved.read(info.filename))
    model = adaptive.load(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(512, 1024)),
                          tmp_path / "rezipped.pt", device="cpu")
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")  # torch.load's
def test_the_refusal_of_a_sparse_tensor_says_how_to_save_it_dense(tmp_path: Path) -> None:
    torch.save({"weight": torch.eye(3).to_sparse(), "bias": torch.zeros(3)}, tmp_path / "s.pt")
    with pytest.raises(LoadError) as info:
        adaptive.load(lambda: nn.Linear(3, 3), tmp_path / "s.pt")
    fix = str(info.value).split("save it again with that tensor dense: ", 1)[1]
    # The advice, run as written, gives a file that loads.
    state = eval(fix, {"torch": torch, "path": tmp_path / "s.pt"})  # noqa: S307
    torch.save(state, tmp_path / "dense.pt")
    model = adaptive.load(lambda: nn.Linear(3, 3), tmp_path / "dense.pt", device="cpu")
    assert torch.equal(model.weight, torch.eye(3))


def test_loads_on_meta_that_overlap_keep_torchs_sparse_check_replaced_until_the_last_ends(
        ) -> None:
    # Loads in two threads overlap: the first to end put torch's own check back while the
    # second was still loading on meta, where that check fails on a sparse tensor.
    from adaptmem._loading import checkpoints

    torchs = torch._utils._validate_loaded_sparse_tensors
    first, second = checkpoints._meta_sparse_unchecked(), checkpoints._meta_sparse_unchecked()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not nested: the first started ends first
    assert torch._utils._validate_loaded_sparse_tensors is not torchs
    second.__exit__(None, None, None)
    assert torch._utils._validate_loaded_sparse_tensors is torchs
