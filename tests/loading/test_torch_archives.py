"""``torch.save`` archives laid out by another zip writer: a valid checkpoint that torch.load
reads right loads the same values ([Note: where a record's bytes lie])."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

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


def test_a_file_that_is_no_checkpoint_says_what_was_expected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"hello world\n")
    with pytest.raises(LoadError) as info:
        adaptive.load(_net, path)
    message = str(info.value)
    assert "expected a torch.save file (a zip archive, or a pickle as torch.save wrote " \
           "before torch 1.6) or a .safetensors file" in message
    assert "begins with b'hello world" in message
    for name in ("weights.bin", "model.safetensors"):  # the second the usual one
        path = tmp_path / name
        path.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
        with pytest.raises(LoadError, match=r"is a Git LFS pointer, not the checkpoint it "
                                            r"stands for: fetch the file itself \(git lfs pull"):
            adaptive.load(_net, path)


@pytest.mark.parametrize(("saved_as", "name"), [
    ("safetensors", "weights.bin"), ("safetensors", "weights.SAFETENSORS"),
    ("safetensors", "weights"), ("torch", "weights.safetensors"), ("torch", "weights.PT"),
    ("legacy torch", "weights.safetensors"),
])
def test_a_checkpoint_is_read_as_what_its_bytes_are_whatever_its_name(
        saved_as: str, name: str, tmp_path: Path) -> None:
    # Renamed, or a suffix in capitals: the bytes say which format it is. (torch.load itself
    # reads a name ending in .safetensors as safetensors, whatever the file holds.)
    source = _net()
    path = tmp_path / name
    if saved_as == "safetensors":
        safetensors_torch = pytest.importorskip("safetensors.torch")
        safetensors_torch.save_file(source.state_dict(), path)
    else:
        torch.save(source.state_dict(), path,
                   _use_new_zipfile_serialization=saved_as == "torch")
    model, stats = adaptive.load(_net, path, return_stats=True)
    assert stats.format.startswith(saved_as.removeprefix("legacy "))
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value), key


def test_a_truncated_archive_says_so(tmp_path: Path) -> None:
    torch.save(_net().state_dict(), tmp_path / "net.pt")
    data = (tmp_path / "net.pt").read_bytes()
    for keep in (0.3, 0.99):
        (tmp_path / "cut.pt").write_bytes(data[: int(len(data) * keep)])
        with pytest.raises(LoadError, match=r"cut.pt' is truncated or corrupt: it begins as a "
                                            r"torch.save archive.*written or downloaded "
                                            r"completely\?"):
            adaptive.load(_net, tmp_path / "cut.pt")


class _Runs:
    """Runs a shell command when unpickled: what weights_only loading exists to stop."""

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("touch ran-on-load",))


def test_a_malicious_pickle_runs_nothing_and_names_what_it_would_call(tmp_path: Path,
                                                                      monkeypatch) -> None:
    import pickle

    monkeypatch.chdir(tmp_path)
    torch.save({"weight": torch.ones(2, 2), "x": _Runs()}, tmp_path / "evil.pt")
    with pytest.raises(LoadError, match=r"holds objects other than tensors and plain containers "
                                        r"\(.*GLOBAL (posix|os|nt).system"):
        adaptive.load(nn.Linear(2, 2, bias=False), tmp_path / "evil.pt")
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump({"x": _Runs()}, f)
    with pytest.raises(LoadError, match=r"evil.pkl' is not a checkpoint that torch.load\("
                                        r"weights_only=True\) can read.*pickle.dump") as info:
        adaptive.load(nn.Linear(2, 2, bias=False), tmp_path / "evil.pkl")
    assert "Please file an issue" not in str(info.value)
    assert not (tmp_path / "ran-on-load").exists()


class QuantizedConfig:
    """A user's config class whose name says "Quantized": no quantized tensor in sight."""


def test_a_class_named_quantized_is_refused_as_an_object_not_as_quantized_tensors(
        tmp_path: Path) -> None:
    # Any load failure with "Quantized" in it was taken for a quantized tensor on meta.
    torch.save({"state_dict": _net().state_dict(), "config": QuantizedConfig()},
               tmp_path / "run.pt")
    with pytest.raises(LoadError, match=r"holds objects other than tensors .*QuantizedConfig"):
        adaptive.load(_net, tmp_path / "run.pt")


def test_a_blocked_module_is_named_without_advice_to_allow_it(tmp_path: Path) -> None:
    # torch refuses a blocked module (os.system) whatever safe_globals allows: the advice to
    # allow it would fail when followed.
    import os

    torch.save({"state_dict": _net().state_dict(), "hook": os.system}, tmp_path / "run.pt")
    with pytest.raises(LoadError, match=r"GLOBAL \w+\.system whose module \w+ is blocked\): "
                                        r".*whatever torch\.serialization\.safe_globals "
                                        r"allows.*Save the state dict alone") as info:
        adaptive.load(_net, tmp_path / "run.pt")
    assert "allow those types" not in str(info.value)
    with torch.serialization.safe_globals([os.system]), pytest.raises(LoadError):
        adaptive.load(_net, tmp_path / "run.pt")  # as the message says


def test_objects_torch_load_refuses_name_the_type_and_safe_globals(tmp_path: Path) -> None:
    import argparse

    source = _net()
    torch.save({"state_dict": source.state_dict(), "args": argparse.Namespace(lr=0.1)},
               tmp_path / "run.pt")
    with pytest.raises(LoadError, match=r"holds objects other than tensors and plain containers "
                                        r"\(Unsupported global: GLOBAL argparse.Namespace.*"
                                        r"weights_only=True.*torch.serialization.safe_globals"):
        adaptive.load(_net, tmp_path / "run.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):  # the way it names
        model = adaptive.load(_net, tmp_path / "run.pt")
    for key, value in source.state_dict().items():  # (loaded onto CUDA where there is one)
        assert torch.equal(model.state_dict()[key].cpu(), value), key


# How torch.load worded its refusal of an argparse.Namespace, version by version (after
# torch's serialization.py, `_get_wo_message` and UNSAFE_MESSAGE); the last is a layout no
# version is known to use, with the reason on a line of its own and no "WeightsUnpickler
# error:" before it, as the next torch may put it.
_REFUSED_BY = {
    "2.1-2.3": (
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` "
        "will likely succeed, but it can result in arbitrary code execution.Do it only if you "
        "get the file from a trusted source. WeightsUnpickler error: Unsupported class "
        "argparse.Namespace"),
    "2.4": (
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` "
        "will likely succeed, but it can result in arbitrary code execution. Do it only if you "
        "got the file from a trusted source.\n Please file an issue with the following so "
        "that we can make `weights_only=True` compatible with your use case: WeightsUnpickler "
        "error: Unsupported global: GLOBAL argparse.Namespace was not an allowed global by "
        "default. Please use `torch.serialization.add_safe_globals([Namespace])` to allowlist "
        "this global if you trust this class/function.\n\nCheck the documentation of "
        "torch.load to learn more about types accepted by default with weights_only "
        "https://pytorch.org/docs/stable/generated/torch.load.html."),
    "2.5": (
        "Weights only load failed. This file can still be loaded, to do so you have two "
        "options \n\t(1) Re-running `torch.load` with `weights_only` set to `False` will "
        "likely succeed, but it can result in arbitrary code execution. Do it only if you got "
        "the file from a trusted source.\n\t(2) Alternatively, to load with "
        "`weights_only=True` please check the recommended steps in the following error "
        "message.\n\tWeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace "
        "was not an allowed global by default. Please use "
        "`torch.serialization.add_safe_globals([Namespace])` or the "
        "`torch.serialization.safe_globals([Namespace])` context manager to allowlist this "
        "global if you trust this class/function.\n\nCheck the documentation of torch.load "
        "to learn more about types accepted by default with weights_only "
        "https://pytorch.org/docs/stable/generated/torch.load.html."),
    "2.6-2.14": (
        "Weights only load failed. This file can still be loaded, to do so you have two "
        "options, \x1b[1mdo those steps only if you trust the source of the checkpoint\x1b[0m. "
        "\n\t(1) In PyTorch 2.6, we changed the default value of the `weights_only` argument "
        "in `torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` "
        "set to `False` will likely succeed, but it can result in arbitrary code execution. "
        "Do it only if you got the file from a trusted source.\n\t(2) Alternatively, to load "
        "with `weights_only=True` please check the recommended steps in the following error "
        "message.\n\tWeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace "
        "was not an allowed global by default. Please use "
        "`torch.serialization.add_safe_globals([argparse.Namespace])` or the "
        "`torch.serialization.safe_globals([argparse.Namespace])` context manager to "
        "allowlist this global if you trust this class/function.\n\nCheck the documentation "
        "of torch.load to learn more about types accepted by default with weights_only "
        "https://pytorch.org/docs/stable/generated/torch.load.html."),
    "no marker": (
        "Weights only load failed. This file can still be loaded, to do so you have two "
        "options.\n\t(1) Re-running `torch.load` with `weights_only` set to `False` will "
        "likely succeed. Do it only if you got the file from a trusted source.\n\t(2) "
        "Alternatively, allowlist the global named below.\n\nUnsupported global: GLOBAL "
        "argparse.Namespace was not an allowed global by default. Please use "
        "`torch.serialization.safe_globals([argparse.Namespace])`.\n\nCheck the "
        "documentation of torch.load to learn more."),
}


@pytest.mark.parametrize("version", list(_REFUSED_BY))
def test_the_type_torch_load_refuses_is_named_whatever_torch_wraps_it_in(
        version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError(_REFUSED_BY[version])

    torch.save(_net().state_dict(), tmp_path / "run.pt")
    monkeypatch.setattr(torch, "load", refuses)
    reason = ("Unsupported class argparse.Namespace" if version == "2.1-2.3" else
              "Unsupported global: GLOBAL argparse.Namespace was not an allowed global by "
              "default")
    with pytest.raises(LoadError) as info:
        adaptive.load(_net, tmp_path / "run.pt")
    assert (f"run.pt' holds objects other than tensors and plain containers ({reason}), and "
            f"adaptive.load reads checkpoints as torch.load(weights_only=True) does"
            ) in str(info.value)
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


def test_a_torch_without_safe_globals_is_told_what_it_has(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    # torch 2.4 has add_safe_globals but not the safe_globals context manager (2.5).
    monkeypatch.delattr(torch.serialization, "safe_globals")
    torch.save({"state_dict": _net().state_dict(), "args": argparse.Namespace(lr=0.1)},
               tmp_path / "run.pt")
    with pytest.raises(LoadError, match=r"If you trust the file, allow those types before the "
                                        r"load: torch\.serialization\.add_safe_globals\("):
        adaptive.load(_net, tmp_path / "run.pt")
