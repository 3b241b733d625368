"""A checkpoint of more files than the process may hold open ([Note: a directory of many
files]): it loads, and a file that cannot be opened fails the load before anything changes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from adaptmem import LoadError, adaptive

resource = pytest.importorskip("resource")

FILES = 300


def _build() -> nn.Module:
    return nn.ParameterDict({f"p{i}": nn.Parameter(torch.zeros(16)) for i in range(FILES)})


@pytest.fixture(scope="module")
def per_tensor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("per-tensor")
    for i in range(FILES):
        torch.save(torch.full((16,), float(i)), root / f"p{i}.pt")
    return root


@pytest.fixture
def few_descriptors() -> Iterator[int]:
    """The limit on open files lowered to what is open now plus 100: fewer than the files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 100
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _loaded_right(model: nn.Module) -> bool:
    return all(bool((model[f"p{i}"] == i).all()) for i in range(FILES))  # type: ignore[index]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("into", ["built", "factory", "copy=False"])
def test_a_directory_of_more_files_than_descriptors_loads(
    into: str, per_tensor: Path, few_descriptors: int,
) -> None:
    with torch.no_grad():
        if into == "built":
            model = adaptive.load(_build(), per_tensor)
        else:
            model, stats = adaptive.load(_build, per_tensor, device="cpu",
                                         copy=into != "copy=False", return_stats=True)
            if into == "copy=False":  # files up to a quarter of the limit mapped, the rest read
                assert 0 < stats.bytes_mapped and 0 < stats.bytes_read
    assert _loaded_right(model)
    # A copying load leaves no descriptor behind; a mapped file keeps its own.
    assert len(os.listdir("/proc/self/fd")) <= few_descriptors - 100 + (
        few_descriptors // 4 if into == "copy=False" else 0) + 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_load_short_of_descriptors_closes_its_files_and_goes_on(
    per_tensor: Path, few_descriptors: int,
) -> None:
    # Other code of the process holds most of what is left: the load's files are closed
    # and opened again as it goes, instead of failing halfway.
    held = [open(per_tensor / "p0.pt", "rb") for _ in range(90)]  # noqa: SIM115
    try:
        model = _build()
        adaptive.load(model, per_tensor)
    finally:
        for f in held:
            f.close()
    assert _loaded_right(model)


def test_a_file_that_cannot_be_opened_fails_the_load_before_anything_changes(
    per_tensor: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adaptmem._loading import loader

    directory = tmp_path / "copy"
    directory.mkdir()
    for f in per_tensor.iterdir():
        os.link(f, directory / f.name)
    real_open = loader.open_checkpoint

    def open_then_remove(path: Path, *rest: object) -> object:
        checkpoint = real_open(path, *rest)  # every header read
        (directory / f"p{FILES - 1}.pt").unlink()  # the last file read
        return checkpoint

    monkeypatch.setattr(loader, "open_checkpoint", open_then_remove)
    model = _build()
    with pytest.raises(LoadError, match=f"p{FILES - 1}.pt"):
        adaptive.load(model, directory)
    assert all(bool((p == 0).all()) for p in model.parameters()), "written before failing"
