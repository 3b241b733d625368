"""A checkpoint written while a load reads it (a trainer saving over the same path truncates
it first): a LoadError or torn values, never bytes from other memory, never a crash
([Note: a file that shrinks during a load])."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from adaptmem import LoadError, adaptive

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]

# Run in a child process: memory corrupted by a copy from past the file's mapping crashes
# (SIGSEGV, "free(): invalid pointer") at some later point, which must fail this test only.
# Every UFFDIO_COPY's source and every MADV_DONTNEED is checked against the file mappings
# the load made, so that a copy from elsewhere fails the test even where it did not crash.
_TRUNCATED_DURING_LOAD = """
    import gc, os, sys
    import torch, safetensors.torch as st
    from torch import nn
    from adaptmem import LoadError, adaptive
    from adaptmem._loading import direct, loader, new_memory

    path = sys.argv[1]
    build = lambda: nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(6)])
    torch.manual_seed(0)
    net = build()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    (torch.save if path.endswith(".pt") else st.save_file)(state, path)
    open(path, "rb").read()  # warm: large tensors are filled from the page cache
    half = os.path.getsize(path) // 2

    when = None
    views = []  # (start, end) of every shared mapping of the file
    real_mmap = direct._mmap
    def recording_mmap(address, size, *rest):
        got = real_mmap(address, size, *rest)
        views.append((got, got + size))
        if when == "after mapping":  # the kernel then finds no pages past the new end
            os.truncate(path, half)
        return got
    direct._mmap = recording_mmap

    outside = []
    def inside(a, b):
        if b > a and not any(s <= a and b <= e for s, e in views):
            outside.append((a, b))
    real_copy, real_unmap = new_memory._copy, new_memory._unmap_source
    def copy(fd, start, end, delta, existing):
        inside(start + delta, end + delta)
        return real_copy(fd, start, end, delta, existing)
    def unmap(start, end):
        inside(*new_memory._whole_pages(start, end))
        return real_unmap(start, end)
    new_memory._copy, new_memory._unmap_source = copy, unmap

    real_open = loader.open_checkpoint
    def open_then_truncate(p, *rest):
        checkpoint = real_open(p, *rest)  # its header is whole
        if when == "before mapping":
            os.truncate(path, half)
        return checkpoint
    loader.open_checkpoint = open_then_truncate

    # A built model's tensors are read into, never filled from a mapping.
    for when, into in [("before mapping", "factory"), ("before mapping", "built"),
                       ("after mapping", "factory")]:
        model = build() if into == "built" else build
        try:
            adaptive.load(model, path, device="cpu")
            print("loaded", when, into)
        except LoadError as exc:
            assert "truncated" in str(exc), exc
            print("LoadError", when, into)
        (torch.save if path.endswith(".pt") else st.save_file)(state, path)
        open(path, "rb").read()
    assert not outside, f"copied from or unmapped memory outside the file's mapping: {outside}"
    garbage = [torch.randn(1000).tolist() for _ in range(200)]  # the heap still works
    gc.collect()
    print("clean")
"""


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_checkpoint_truncated_during_a_load_is_a_load_error_and_no_other_memory_is_touched(
    fmt: str, tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRUNCATED_DURING_LOAD),
         str(tmp_path / f"model.{fmt}")],
        capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    assert out.stdout.split("\n")[:-1] == [
        "LoadError before mapping factory", "LoadError before mapping built",
        "LoadError after mapping factory", "clean"]


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_copy_false_of_a_checkpoint_truncated_after_its_header_was_read_is_a_load_error(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adaptmem._loading import loader

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    path = tmp_path / f"model.{fmt}"
    state = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save(state, path) if fmt == "pt" else safetensors_torch.save_file(state, path)
    real_open = loader.open_checkpoint

    def open_then_truncate(p: Path, *rest: object) -> object:
        checkpoint = real_open(p, *rest)
        os.truncate(path, os.path.getsize(path) // 2)
        return checkpoint

    monkeypatch.setattr(loader, "open_checkpoint", open_then_truncate)
    with pytest.raises(LoadError, match="truncated"):
        adaptive.load(lambda: nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), path,
                      device="cpu", copy=False)


# [Note: a file replaced during a load]: an audit hook (which cannot be removed: it acts only
# while `_replace_at` is armed) renames a new checkpoint over the file just before the n-th
# open of its name, as a trainer's save (write a temporary file, os.replace) would land.
_replace_at: dict[str, object] = {}
_hooked: list[bool] = []


def _replace_before_open(event: str, args: tuple[object, ...]) -> None:
    if event != "open" or not _replace_at or not args or not isinstance(
            args[0], (str, bytes, os.PathLike)):
        return
    if os.fsdecode(args[0]) == _replace_at["path"]:
        _replace_at["opens"] = int(_replace_at["opens"]) + 1  # type: ignore[call-overload]
        if _replace_at["opens"] == _replace_at["when"]:
            os.replace(str(_replace_at["new"]), str(_replace_at["path"]))


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(2**20))
        self.v = nn.Parameter(torch.empty(2**20))


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    if path.suffix == ".pt":
        torch.save(state, path)
    else:
        safetensors_torch.save_file(state, path)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="cold files need posix_fadvise")
@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
@pytest.mark.parametrize("fmt", ["safetensors", "pt", "shards"])
def test_a_checkpoint_replaced_during_a_load_is_read_whole_from_one_file_or_refused(
    fmt: str, cold: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not _hooked:
        sys.addaudithook(_replace_before_open)
        _hooked.append(True)
    old = {"w": torch.full((2**20,), 1.0), "v": torch.full((2**20,), 1.0)}
    # The new file's tensors lie elsewhere: read at the old offsets, they are garbage.
    new = {"a": torch.full((1000,), 7.0), "w": torch.full((2**20,), 2.0),
           "v": torch.full((2**20,), 2.0)}
    suffix = ".pt" if fmt == "pt" else ".safetensors"
    if fmt == "shards":  # the second of two shards is replaced
        (tmp_path / "model-1.safetensors").unlink(missing_ok=True)
        safetensors_torch.save_file({"w": old["w"]}, tmp_path / "model-1.safetensors")
        old, new = {"v": old["v"]}, {"a": new["a"], "v": new["v"]}
    (tmp_path / "saving").mkdir()  # not in the checkpoint's directory: no shard of it
    path, fresh = tmp_path / f"model-2{suffix}", tmp_path / "saving" / f"new{suffix}"
    outcomes = set()
    for when in range(1, 8):
        _save(old, path)
        _save(new, fresh)
        if cold:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        _replace_at.update(path=str(path), new=fresh, opens=0, when=when)
        try:
            model = adaptive.load(_Two, tmp_path if fmt == "shards" else path, strict=False)
        except LoadError as exc:
            assert "replaced during the load" in str(exc), (when, exc)
            outcomes.add("refused")
            continue
        finally:
            opens = _replace_at["opens"]
            _replace_at.clear()
        replaced = (model.v,) if fmt == "shards" else (model.w, model.v)
        values = {float(x) for t in replaced for x in t.detach().unique()}
        assert values in ({1.0}, {2.0}), (when, sorted(values)[:5])  # never a mix, no garbage
        outcomes.add("old" if values == {1.0} else "new")
        if int(opens) < when:  # type: ignore[call-overload]
            break  # the load opened the file fewer times: no later open to replace it before
    assert {"old", "new"} <= outcomes, outcomes
