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
