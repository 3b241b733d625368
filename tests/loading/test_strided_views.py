"""A checkpoint entry that is a small view of a large storage ([Note: a small view of a large
storage]): the exact elements, with staging memory of the tensor and one chunk, not the
view's whole span."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from adaptmem.cpu_memory import _status_kib  # the one reader of /proc/self/status (bytes)


class _One(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(shape), requires_grad=False)


def _views() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = torch.randn(64, 48, 40)
    return {
        "every 7th": big.view(-1)[3::7],
        "corner": big[5:9, 10:13, ::9],
        "transposed corner": big[20:30, ::5, 1:3].permute(2, 0, 1),
        "expanded": big[1, 2, 3:6].view(3, 1).expand(3, 5),
        "rows far apart": big[::21, 7],
    }


@pytest.mark.parametrize("chunk", [40, 4096, None])
@pytest.mark.parametrize("name", list(_views()))
def test_strided_views_of_a_large_storage_load_their_exact_elements(
    name: str, chunk: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adaptmem import adaptive
    from adaptmem._loading import checkpoints

    if chunk is not None:  # gathered in many small blocks, split along several dimensions
        monkeypatch.setattr(checkpoints, "_CHUNK", chunk)
    view = _views()[name]
    torch.save({"a": view}, tmp_path / "view.pt")
    for into, dtype in (("factory", None), ("built", None), ("factory", torch.float64)):
        model = (_One(tuple(view.shape)) if into == "built"
                 else lambda: _One(tuple(view.shape)))  # noqa: B023 - used at once
        got = adaptive.load(model, tmp_path / "view.pt", device="cpu", dtype=dtype)
        assert torch.equal(got.a, view.to(got.a.dtype)), (into, dtype)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc VmHWM")
def test_a_small_view_of_a_large_storage_stages_its_elements_not_its_span(
    tmp_path: Path,
) -> None:
    from adaptmem import adaptive

    view = torch.randn(12_000_000)[::1000]  # torch.save stores the whole 46 MiB storage
    torch.save({"a": view}, tmp_path / "strided.pt")
    (tmp_path / "strided.pt").read_bytes()  # in the page cache, out of this process
    model = _One((12_000,))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    before = _status_kib("VmRSS")
    adaptive.load(model, tmp_path / "strided.pt")
    peak = _status_kib("VmHWM") - before  # bytes
    assert torch.equal(model.a, view)
    # One staging chunk (16 MiB) and the tensor, not the 46 MiB it spans.
    assert peak < 24 * 2**20, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_gpu_a_strided_view_gathered_in_pieces_reaches_the_device_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Gathered through a pinned staging buffer, then copied to the device.
    from adaptmem import adaptive
    from adaptmem._loading import checkpoints

    monkeypatch.setattr(checkpoints, "_CHUNK", 4096)
    view = _views()["transposed corner"]
    torch.save({"a": view}, tmp_path / "view.pt")
    for dtype in (None, torch.float16):
        got = adaptive.load(lambda: _One(tuple(view.shape)), tmp_path / "view.pt",
                            device="cuda", dtype=dtype)
        assert got.a.device.type == "cuda"
        assert torch.equal(got.a.cpu(), view.to(got.a.dtype))
