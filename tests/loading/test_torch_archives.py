"""``torch.save`` archives laid out by another zip writer: a valid checkpoint that torch.load
reads right loads the same values ([Note: where a record's bytes lie])."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from adaptmem import LoadError, adaptive


def _net() -> nn.Module:
    # A small tensor and a large one (2 MiB: made for direct reads, filled from the cache).
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(512, 1024))


def _rezipped(source: Path, target: Path, order: str = "same",
              compression: int = zipfile.ZIP_STORED) -> Path:
    """``source``'s records written again by Python's zipfile: no alignment padding."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", compression) as zout:
        infos = zin.infolist()
        if order == "reversed":  # the tensor records in the opposite order
            data = [i for i in infos if "/data/" in i.filename]
            infos = [i for i in infos if i not in data] + data[::-1]
        for info in infos:
            zout.writestr(info.filename, zin.read(info.filename))
    return target


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("order", ["same", "reversed"])
def test_a_pt_archive_another_zip_writer_wrote_loads_the_values_torch_load_reads(
    order: str, copy: bool, tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    torch.save(_net().state_dict(), tmp_path / "torch.pt")
    path = _rezipped(tmp_path / "torch.pt", tmp_path / "other.pt", order)
    want = torch.load(path, weights_only=True)
    for model in (_net(), _net):  # in place, and a factory's new tensors
        got = adaptive.load(model, path, device="cpu", copy=copy).state_dict()
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_a_rezipped_training_checkpoint_finds_every_storage(tmp_path: Path) -> None:
    # Storages outside the state dict (an optimizer's) are numbered with the rest.
    torch.manual_seed(0)
    net = _net()
    state = {"optimizer": {"state": {0: {"exp_avg": torch.randn(300)}}},
             "model": net.state_dict(), "step": 3}
    torch.save(state, tmp_path / "torch.pt")
    path = _rezipped(tmp_path / "torch.pt", tmp_path / "other.pt", "reversed")
    got = adaptive.load(_net, path, device="cpu").state_dict()
    for key, value in net.state_dict().items():
        assert torch.equal(got[key], value), key


def test_a_pt_archive_with_compressed_tensors_is_refused(tmp_path: Path) -> None:
    torch.save(_net().state_dict(), tmp_path / "torch.pt")
    path = _rezipped(tmp_path / "torch.pt", tmp_path / "other.pt",
                     compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(LoadError, match="compressed"):
        adaptive.load(_net, path)


def test_an_archive_whose_records_do_not_match_its_storages_is_refused(tmp_path: Path) -> None:
    torch.save(_net().state_dict(), tmp_path / "torch.pt")
    path = tmp_path / "other.pt"
    with zipfile.ZipFile(tmp_path / "torch.pt") as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data/1"):
                data += b"\0" * 64  # a record larger than the storage the pickle names
            zout.writestr(info.filename, data)
    with pytest.raises(LoadError, match="cannot tell where its tensors lie"):
        adaptive.load(_net, path)


@pytest.mark.parametrize("content, expected", [
    (b"hello world\n", "begins with b'hello world"),
    (None, "it looks like a safetensors file: give it the .safetensors suffix"),
])
def test_a_file_that_is_no_checkpoint_says_what_was_expected(
    content: bytes | None, expected: str, tmp_path: Path,
) -> None:
    path = tmp_path / "weights.bin"
    if content is None:  # a safetensors file under a torch.save suffix
        safetensors_torch = pytest.importorskip("safetensors.torch")
        safetensors_torch.save_file(_net().state_dict(), path)
    else:
        path.write_bytes(content)
    with pytest.raises(LoadError) as info:
        adaptive.load(_net, path)
    message = str(info.value)
    assert "expected a torch.save file (a zip archive, or a pickle as torch.save wrote " \
           "before torch 1.6) or a .safetensors file" in message
    assert expected in message
