"""A load's new tensors: filled from the page cache without being zeroed first ([Note: filling
new memory from the page cache]), or faulted in ahead ([Note: faulting new memory ahead]).
Exact bytes at any alignment, pages that exist, a copy that stops midway, a system that
refuses, and nothing of the file left mapped or needed afterwards."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from models import OddOffsets
from torch import nn

from adaptmem import LoadError, adaptive
from adaptmem._loading import new_memory
from adaptmem._loading.new_memory import NewMemory
from adaptmem.testing import simulated_cuda

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
        kept.append(adaptive.load(OddOffsets, path))
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
            model = adaptive.load(adaptive.empty_model(
                lambda: nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 512))), path)
            save({{k: torch.zeros(1) for k in net.state_dict()}}, path)  # truncates first
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), net.parameters()))
            print("same", name)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["same", "model.pt", "same", "model.safetensors"]


# -- reading before the plan ([Note: reading before the plan]) ------------------------------

@pytest.fixture
def early(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Reading before the plan on this machine too (it needs a core per reader thread): per
    load, the bytes ``read_early`` started, and whether each tensor it let go was freed at
    once."""
    from adaptmem._loading import checkpoints

    monkeypatch.setattr(checkpoints, "_USABLE_CORES", 64)
    seen: dict[str, list[Any]] = {"started": [], "freed": []}
    real_early, real_drop = checkpoints.Reader.read_early, checkpoints.Reader.drop_early

    def read_early(self: Any, entries: list, budget: int) -> int:
        seen["started"].append(real_early(self, entries, budget))
        return seen["started"][-1]

    def drop_early(self: Any) -> None:
        left = [weakref.ref(t) for t, _ in self._early.pending.values()]
        real_drop(self)
        seen["freed"].append([ref() is None for ref in left])

    monkeypatch.setattr(checkpoints.Reader, "read_early", read_early)
    monkeypatch.setattr(checkpoints.Reader, "drop_early", drop_early)
    return seen


def _evicted(path: Path) -> bool:
    """Drop ``path`` from the page cache; whether none of it is left there."""
    from adaptmem._common.libc import resident_pages
    from adaptmem._loading.direct import _mmap, _munmap

    size = path.stat().st_size
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # dirty pages cannot be evicted
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        address = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    try:
        return resident_pages(address, size) == bytes(-(-size // _PAGE))
    finally:
        _munmap(address, size)


def _load_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("adaptmem-load-io")]


@FILLS
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_factory_load_starts_filling_before_the_model_is_built(
    fmt: str, tmp_path: Path, early: dict[str, list[Any]],
) -> None:
    path = _save(fmt, _source(), tmp_path)
    started_at_build = []

    def build() -> OddOffsets:
        started_at_build.extend(early["started"])
        return OddOffsets()

    model = adaptive.load(build, path, device="cpu")
    # Up to the largest tensor's bytes, in file order: b (2 MiB) in the .pt file, where b
    # and d do not fit together; d (24 MiB) first in the .safetensors one.
    assert started_at_build == [model.b.nbytes if fmt == "pt" else model.d.nbytes]
    assert early["freed"] == [[]]  # the model took what was read early
    _assert_same(model, _source())
    assert not _load_threads()


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(8, 2**20), requires_grad=False)  # 32 MiB
        self.b = self.a


def _peak_of_a_fresh_load(path: Path, factory: str, early: bool) -> int:
    """VmHWM growth of ``adaptive.load(factory, path)`` in a new process, reading early or
    not. glibc there serves allocations up to 64 MiB from its heap, as it does up to 32 MiB
    once a process has freed a tensor that large, and keeps what is freed there."""
    script = textwrap.dedent(f"""
        import ctypes
        ctypes.CDLL(None).mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        import torch
        from adaptmem import adaptive
        from adaptmem._loading import checkpoints
        from test_new_memory import TiedPair, Wide
        if {early!r}:
            checkpoints._USABLE_CORES = 64
        def kib(field):
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        open({str(path)!r}, "rb").read()
        open("/proc/self/clear_refs", "w").write("5")
        before = kib("VmRSS")
        adaptive.load({factory}, {str(path)!r}, device="cpu")
        print("PEAK", kib("VmHWM") - before)
    """)
    paths = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=paths))
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split("PEAK ", 1)[1])


@FILLS
@pytest.mark.parametrize("case", ["tied", "float64"])
def test_what_the_model_does_not_take_is_freed_before_the_rest_is_made(
    case: str, tmp_path: Path, early: dict[str, list[Any]],
) -> None:
    # Read early and not taken: the file stores a tied pair twice and the model reads the
    # last copy (as load_state_dict does); a model in float64 takes no float32 tensor as it
    # is stored. Either way the tensor is freed, its pages given back, before the load
    # fills the model's own: reading early adds nothing to the peak.
    torch.manual_seed(0)
    source = TiedPair() if case == "tied" else Wide()
    for p in source.parameters():
        p.data.normal_()
    path = _save("safetensors", source, tmp_path)  # _save clones: a and b stored apart
    factory = "TiedPair" if case == "tied" else "lambda: Wide().double()"
    model = adaptive.load(eval(factory), path, device="cpu")
    first = source.a if case == "tied" else source.v  # the first in file order
    assert early["started"] == [first.nbytes] and early["freed"] == [[True]]
    assert case != "tied" or model.a is model.b
    _assert_same(model, source if case == "tied" else source.double())
    plain = _peak_of_a_fresh_load(path, factory, early=False)
    read_early = _peak_of_a_fresh_load(path, factory, early=True)
    assert read_early <= plain + first.nbytes // 2, (read_early / 2**20, plain / 2**20)


@FILLS
def test_a_load_that_fails_after_reading_early_leaves_no_reads_behind(
    tmp_path: Path, early: dict[str, list[Any]],
) -> None:
    path = _save("pt", _source(), tmp_path)

    class Bigger(OddOffsets):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Parameter(torch.empty(3))

    with pytest.raises(LoadError, match='Missing key.*"extra"'):
        adaptive.load(Bigger, path, device="cpu")

    def broken() -> nn.Module:
        raise RuntimeError("the factory failed")

    with pytest.raises(RuntimeError, match="the factory failed"):
        adaptive.load(broken, path, device="cpu")
    assert early["started"] == [_source().b.nbytes] * 2
    assert not _load_threads()


@FILLS
@pytest.mark.parametrize("case", ["built model", "copy=False", "dtype", "simulated GPU",
                                  "cold file"])
def test_loads_that_make_no_new_host_tensors_as_stored_read_nothing_early(
    case: str, tmp_path: Path, early: dict[str, list[Any]],
) -> None:
    # Each would read early what it then throws away: in place, mapped, converted, on a
    # device; a cold file is read from the disk once the plan wants it, never twice.
    path = _save("pt", _source(), tmp_path)
    kwargs: dict[str, Any] = {"device": "cpu"}
    model: Any = OddOffsets
    if case == "built model":
        model = OddOffsets()
    elif case == "copy=False":
        kwargs["copy"] = False
    elif case == "dtype":
        kwargs["dtype"] = torch.float64
    elif case == "simulated GPU":
        kwargs = {}
    elif not _evicted(path):
        pytest.skip(f"the page cache keeps {path}'s pages (tmpfs?)")
    with simulated_cuda() if case == "simulated GPU" else contextlib.nullcontext():
        loaded = adaptive.load(model, path, **kwargs)
        assert early["started"] in ([], [0])
        want = _source()
        if case == "dtype":
            want = want.double()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(
            loaded.state_dict().values(), want.state_dict().values(), strict=True))
