"""A load's new tensors: filled from the page cache without being zeroed first ([Note: filling
new memory from the page cache]), or faulted in ahead ([Note: faulting new memory ahead]).
Exact bytes at any alignment, pages that exist, a copy that stops midway, a system that
refuses, and nothing of the file left mapped or needed afterwards."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from models import OddOffsets
from torch import nn

from adaptmem import adaptive
from adaptmem._loading import new_memory
from adaptmem._loading.new_memory import NewMemory

safetensors_torch = pytest.importorskip("safetensors.torch")

_PAGE = mmap.PAGESIZE
ROOT = Path(__file__).resolve().parents[2]


def _system_fills() -> bool:
    memory = NewMemory()
    try:
        return memory.fill_later(torch.empty(0))
    finally:
        memory.close()


SYSTEM_FILLS = sys.platform.startswith("linux") and _system_fills()
FILLS = pytest.mark.skipif(
    not SYSTEM_FILLS,
    reason="this system gives no userfaultfd (not Linux 5.11+ on x86_64 or aarch64, or "
           "refused by seccomp): loads fault new memory in ahead instead, tested below")


def _source() -> OddOffsets:
    torch.manual_seed(0)
    source = OddOffsets()
    for p in source.parameters():
        p.data = (torch.randn(p.shape) * 100).to(p.dtype)
    return source


def _save(fmt: str, model: nn.Module, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"model.{fmt}"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if fmt == "pt":
        torch.save(state, path)
    else:
        safetensors_torch.save_file(state, path)
    path.read_bytes()  # in the page cache
    return path


def _assert_same(model: nn.Module, source: nn.Module) -> None:
    got, want = model.state_dict(), source.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _loads_here(loads: list[tuple[str, bool]]) -> list[list[int]]:
    """Load each ``(path, stop_at_half)`` into ``OddOffsets`` and check it bitwise; return the bytes
    each UFFDIO_COPY call copied, per load (with ``stop_at_half``, each copies half its
    pages and stops there, as a failing copy would). Every model is kept until the end, so
    that no load gets memory an earlier one freed."""
    real = new_memory._copy
    kept, out = [], []
    for path, stop_at_half in loads:
        copied: list[int] = []

        def copy(fd: int, start: int, end: int, delta: int, existing: list,
                 copied: list[int] = copied, stop_at_half: bool = stop_at_half) -> int:
            if stop_at_half:
                end = start + (end - start) // 2 // _PAGE * _PAGE
            stop = real(fd, start, end, delta, existing)
            copied.append(stop - start)
            return stop

        new_memory._copy = copy
        # Warm: this VM's proactive reclaim evicts file pages within a minute, and a loaded
        # machine can take that long between saving the file and loading it. Read through
        # a small buffer: memory freed here would be reused by the load, whose pages would
        # then exist already and not be filled.
        with open(path, "rb", buffering=0) as f:
            buffer = bytearray(1 << 16)
            while f.readinto(buffer):
                pass
        kept.append(adaptive.load(OddOffsets, path, device="cpu"))  # (not CUDA, where it is)
        out.append(copied)
    new_memory._copy = real
    source = _source()  # made afterwards: its temporaries, freed, would be reused by a load
    for model in kept:
        _assert_same(model, source)
    return out


@pytest.fixture(scope="module")
def fresh_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], list[int]]:
    """``_loads_here`` for both formats, whole and stopping halfway, in a new process, where
    users load: its memory is new, so no page of the tensors exists yet (in this one, a
    load may get memory the allocator reused, whose pages exist and are read instead)."""
    root = tmp_path_factory.mktemp("fresh")
    loads = [(str(_save(fmt, _source(), root / fmt)), stop)
             for fmt in ("pt", "safetensors") for stop in (False, True)]
    script = textwrap.dedent(f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("under_test", {__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print("COPIED", json.dumps(module._loads_here({loads!r})))
    """)
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # adaptmem, and tests' models
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=path))
    assert out.returncode == 0, out.stderr[-3000:]
    copied = json.loads(out.stdout.split("COPIED ", 1)[1])
    return {(fmt, stop): c for (fmt, stop), c in zip(
        [(f, st) for f in ("pt", "safetensors") for st in (False, True)], copied, strict=True)}


@FILLS
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_warm_load_fills_its_large_tensors_from_the_page_cache_exactly(
    fmt: str, fresh_loads: dict[tuple[str, bool], list[int]],
) -> None:
    copied = fresh_loads[(fmt, False)]  # and the model came out bitwise equal
    large = sum(getattr(_source(), k).nbytes for k in OddOffsets.LARGE)
    # All but each piece's partial first and last page, and the few pages of memory the
    # process freed while starting that the allocator hands out again.
    assert sum(copied) >= 0.95 * large, (sum(copied), large)


@FILLS
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_copy_that_stops_midway_leaves_the_rest_to_the_ordinary_read(
    fmt: str, fresh_loads: dict[tuple[str, bool], list[int]],
) -> None:
    # What is left must be unregistered first: a read into a registered page would fail
    # (the model is checked bitwise in the child).
    assert sum(fresh_loads[(fmt, True)]) > 0  # the copies ran, each stopping halfway


@FILLS
def test_pages_that_exist_are_left_to_the_caller_with_the_partial_ones(tmp_path: Path) -> None:
    from adaptmem._loading.direct import _mmap, _munmap

    data = bytes(torch.randint(0, 256, (40 * _PAGE,), dtype=torch.uint8).tolist())
    path = tmp_path / "bytes"
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapping = _mmap(None, len(data), mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    memory_of_a_tensor = mmap.mmap(-1, 36 * _PAGE)  # new: no page exists yet
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory_of_a_tensor)) + 100
    n = 30 * _PAGE
    first = -(-start // _PAGE) * _PAGE
    touched = [first + 3 * _PAGE, first + 17 * _PAGE]
    for page in touched:  # memory the allocator reused: the page exists
        ctypes.memset(page, 0xAB, 1)
    memory = NewMemory()
    try:
        left = memory.fill(start, mapping + 7, n)
    finally:
        memory.close()
        _munmap(mapping, len(data))
    spans = {(a + start, b + start) for a, b in left}
    assert (start, first) in spans  # the partial first page
    assert {(p, p + _PAGE) for p in touched} <= spans
    assert max(b for _, b in spans) == start + n  # the partial last page
    for a, b in spans:  # the caller's read
        ctypes.memmove(a, data[7 + (a - start): 7 + (b - start)], b - a)
    assert ctypes.string_at(start, n) == data[7: 7 + n], "a page was copied wrongly or not at all"


@FILLS
def test_pages_that_exist_are_read_in_runs_not_tried_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Memory the allocator reused has its pages: trying each with UFFDIO_COPY (EEXIST) and
    # reading it alone made a second load in a process 3-4x slower.
    from adaptmem._loading.direct import _mmap, _munmap

    data = bytes(range(256)) * (64 * _PAGE // 256)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapping = _mmap(None, len(data), mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    memory_of_a_tensor = mmap.mmap(-1, 64 * _PAGE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory_of_a_tensor))
    for page in [*range(10), *range(20, 64)]:  # all but pages 10-19 exist
        ctypes.memset(start + page * _PAGE, 1, 1)
    copies: list[tuple[int, int]] = []
    real = new_memory._copy
    monkeypatch.setattr(new_memory, "_copy", lambda fd, a, b, *rest: (
        copies.append(((a - start) // _PAGE, (b - start) // _PAGE)), real(fd, a, b, *rest))[1])
    memory = NewMemory()
    try:
        left = memory.fill(start, mapping, len(data))
    finally:
        memory.close()
        _munmap(mapping, len(data))
    assert copies == [(10, 20)]
    assert left == [(0, 10 * _PAGE), (20 * _PAGE, 64 * _PAGE)]
    assert ctypes.string_at(start + 10 * _PAGE, 10 * _PAGE) == data[10 * _PAGE: 20 * _PAGE]


@pytest.mark.parametrize("policy, variable, fills", [
    ("always [madvise] never", None, True), ("[always] madvise never", None, False),
    ("always [madvise] never", "1", False), ("always madvise [never]", "1", True)])
def test_where_new_memory_gets_huge_pages_nothing_is_filled(
    policy: str, variable: str | None, fills: bool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # UFFDIO_COPY maps 4 KiB pages: weights the system would keep in huge pages keep them.
    import builtins

    real_open = builtins.open

    def fake_open(name: object, *args: object, **kwargs: object) -> object:
        if name == "/sys/kernel/mm/transparent_hugepage/enabled":
            return real_open(settings, *args, **kwargs)  # type: ignore[call-overload]
        return real_open(name, *args, **kwargs)  # type: ignore[call-overload]

    settings = tmp_path / "enabled"
    settings.write_text(policy + "\n")
    monkeypatch.setattr(builtins, "open", fake_open)
    if variable is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", variable)
    assert new_memory._huge_pages_wanted() is not fills
    monkeypatch.setattr(new_memory, "_fills", new_memory._fills)  # restored afterwards
    memory = NewMemory()
    try:
        assert memory.fill_later(torch.empty(0)) is (fills and SYSTEM_FILLS)
    finally:
        memory.close()


def test_a_system_without_userfaultfd_loads_the_same_and_faults_in_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(*args: object) -> int:
        ctypes.set_errno(errno.EPERM)  # seccomp's answer in most containers
        return -1

    monkeypatch.setattr(new_memory, "_syscall", refused)
    monkeypatch.setattr(new_memory, "_fills", True)
    populated: list[int] = []
    real = new_memory.populate
    monkeypatch.setattr(new_memory, "populate",
                        lambda address, nbytes: (populated.append(nbytes), real(address, nbytes)))
    source = _source()
    path = _save("safetensors", source, tmp_path)
    _assert_same(adaptive.load(OddOffsets, path, device="cpu"), source)
    assert new_memory._fills is False  # asked once, then never again
    assert sum(populated) >= sum(getattr(source, k).nbytes for k in OddOffsets.LARGE)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 2**20), requires_grad=False)  # 32 MiB
        self.v = nn.Parameter(torch.empty(2, 2**20), requires_grad=False)


@FILLS
def test_a_warm_load_maps_none_of_its_file_for_long(tmp_path: Path) -> None:
    # The source pages the copy maps are unmapped step by step: the peak is the model and a
    # few steps, not the model twice.
    torch.manual_seed(0)
    source = Wide()
    for p in source.parameters():
        p.data.normal_()
    path = _save("safetensors", source, tmp_path)
    model = adaptive.empty_model(Wide)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    before = _status_kib("VmRSS")
    file_before = _status_kib("RssFile")
    adaptive.load(model, path, device="cpu")  # the host fill, even beside a GPU
    peak = (_status_kib("VmHWM") - before) * 1024
    model_bytes = sum(p.nbytes for p in source.parameters())
    assert peak <= model_bytes + 24 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    assert (_status_kib("RssFile") - file_before) * 1024 < 4 * 2**20
    _assert_same(model, source)


def test_a_copying_load_needs_its_file_no_more(tmp_path: Path) -> None:
    # Saving over the checkpoint truncates it first: weights still backed by the file (a
    # mapping, even a private one) would crash with SIGBUS. In a child process, so that a
    # crash fails this test only.
    script = textwrap.dedent(f"""
        import torch, safetensors.torch as st
        from torch import nn
        from adaptmem import adaptive
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 512))
        for save, name in ((torch.save, "model.pt"), (st.save_file, "model.safetensors")):
            path = {str(tmp_path)!r} + "/" + name
            save({{k: v.clone() for k, v in net.state_dict().items()}}, path)
            open(path, "rb").read()
            model = adaptive.load(adaptive.empty_model(  # (where CUDA is, it goes there)
                lambda: nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 512))), path,
                device="cpu")
            save({{k: torch.zeros(1) for k in net.state_dict()}}, path)  # truncates first
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), net.parameters()))
            print("same", name)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["same", "model.pt", "same", "model.safetensors"]
