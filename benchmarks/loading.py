"""Time to a ready model: adaptive.load against the meta + mmap + assign recipe, next to what
the source allows (page-cache copy bandwidth, cold sequential disk read).

    python benchmarks/loading.py                          # GPT-2 small and large, warm and cold
    python benchmarks/loading.py --models small --rounds 5
    python benchmarks/loading.py --all-methods            # + baselines, accelerate, per-tensor
    python benchmarks/loading.py --models tiny --rounds 1 # a seconds-long smoke run
    python benchmarks/loading.py --page-probe 0.5,3       # 4 KiB vs huge pages, fresh memory
    python benchmarks/loading.py --first-build-probe --rounds 5  # empty_model's first call
    python benchmarks/loading.py --cache warm --threads 4,16   # the loader's pool: 4 vs 16
    python benchmarks/loading.py --limits first           # bandwidth limits in round 1 only

Each model (transformers' GPT2LMHeadModel from a config when installed, else an equivalent
built here; random weights, fp32) is saved as ``.pt`` and ``.safetensors``. Then, for each
round, for the page cache warm and cold (the file evicted with ``posix_fadvise(DONTNEED)``
first), every method runs in a fresh process, each round starting one method later than the
last, and reports:

- build s: building the model on meta (the recipe and the other baselines);
- load s: reading the checkpoint into it; adaptmem's rows pass the factory to
  ``adaptive.load``, which builds the model too (``adaptive.empty_model``), so their load s
  covers building and their build s is 0;
- touch s: reading every distinct weight once (``tensor.sum()``), so that methods that map
  the file and read lazily pay for their reads too;
- total s: build + load + touch, the time to a ready model (interpreter start and imports,
  the same for every method, are not counted);
- peak GiB: highest RSS (``VmHWM``) during build + load, minus RSS before building.

Measured in the same run, per round: the page-cache copy bandwidth (the warm file read with
``preadv`` into memory that already exists: what copying from the cache costs), the same
copy into new memory in a fresh process (one thread; with a thread per core faulting the
memory in ahead of the reads; and with a thread per core filling it without zeroing it
first, UFFDIO_COPY, where the system allows: the faster is the floor of a copying load
here), and the cold
sequential read bandwidth of the disk (the file evicted, then read front to back in 16 MiB
reads, once with the kernel's read-ahead alone and once asking for the next 64 MiB ahead as
adaptive.load does; the faster counts). Each turns into a floor time for the file: ``bytes / bandwidth``.

Ratios are taken within a round (both figures from the same minutes of a shared machine),
then summarised over rounds as median [min-max].
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

SHAPES = {  # GPT-2 sizes: width, layers, heads
    "tiny": (256, 4, 4),
    "small": (768, 12, 12),
    "large": (1280, 36, 20),
    "xl": (1600, 48, 25),
}
VOCAB, POSITIONS = 50257, 1024
RECIPE = "recipe: meta + torch.load(mmap) + assign (.pt)"
CORE_METHODS = [  # name, checkpoint file
    (RECIPE, "pt"),
    ("adaptmem (.pt)", "pt"),
    ("adaptmem (.safetensors)", "safetensors"),
    ("adaptmem copy=False (.pt)", "pt"),
    ("adaptmem copy=False (.safetensors)", "safetensors"),
]
MORE_METHODS = [
    ("baseline: to(device) + load_state_dict(torch.load)", "pt"),
    ("param-by-param copy", "pt"),
    ("per-tensor files, meta + assign", "dir"),
    ("accelerate load_checkpoint_in_model + dispatch (.pt)", "pt"),
    ("accelerate load_checkpoint_in_model + dispatch (.safetensors)", "safetensors"),
    ("adaptmem (per-tensor files)", "dir"),
]


# -- the model ------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class _GPT2(nn.Module):
    """Parameter-for-parameter a GPT-2 of this shape, for machines without transformers."""

    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(POSITIONS, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.wte.weight


def factory(model: str) -> Callable[[], nn.Module]:
    width, layers, heads = SHAPES[model]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return lambda: _GPT2(width, layers, heads)
    config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, vocab_size=VOCAB,
                        n_positions=POSITIONS)
    return lambda: GPT2LMHeadModel(config)


# -- one method, in its own process ---------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:  # VmHWM from here on (Linux); otherwise it also covers start-up
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _build_and_load(method: str, build: Callable[[], nn.Module], work: Path,
                    device: torch.device) -> tuple[nn.Module, float]:
    """Run ``method``; return the model and the seconds spent building it."""
    pt, st, per = work / "model.pt", work / "model.safetensors", work / "per-tensor"
    t0 = time.perf_counter()
    if method.startswith("baseline"):
        model = build().to(device)
        built = time.perf_counter() - t0
        model.load_state_dict(torch.load(pt, weights_only=True))
        return model, built
    if method.startswith("param-by-param"):
        model = build().to(device)
        built = time.perf_counter() - t0
        state = torch.load(pt, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                tensor.copy_(state.pop(name))
        return model, built
    if method == RECIPE:
        with torch.device("meta"):
            model = build()
        built = time.perf_counter() - t0
        model.load_state_dict(torch.load(pt, mmap=True, weights_only=True), assign=True)
        return model.to(device), built
    if method.startswith("per-tensor files, meta"):
        with torch.device("meta"):
            model = build()
        built = time.perf_counter() - t0
        for f in sorted(per.iterdir()):
            tensor = torch.load(f, map_location=device, weights_only=True)
            model.load_state_dict({f.stem: tensor}, strict=False, assign=True)
        return model, built
    if method.startswith("accelerate"):
        from accelerate import dispatch_model, init_empty_weights, load_checkpoint_in_model

        with init_empty_weights():
            model = build()
        model.tie_weights()  # init_empty_weights re-wraps the tied parameter, untying it
        built = time.perf_counter() - t0
        path = st if "safetensors" in method else pt
        # accelerate wants a GPU index; torch.device("cuda") has none until it is resolved
        index = torch.cuda.current_device() if device.index is None else device.index
        device_map = {"": index if device.type == "cuda" else str(device)}
        # load_checkpoint_and_dispatch, with the re-tie accelerate's docs ask for in between
        # (a safetensors file stores a tied weight once).
        load_checkpoint_in_model(model, str(path), device_map=device_map)
        model.tie_weights()
        return dispatch_model(model, device_map=device_map), built
    if method.startswith("adaptmem"):
        from adaptmem import adaptive

        # The factory, as users load: the load builds the model (empty_model) itself, so
        # its build s is 0.
        path = per if "per-tensor" in method else st if "safetensors" in method else pt
        return adaptive.load(build, path, device=device, copy="copy=False" not in method), 0.0
    raise SystemExit(f"unknown method {method!r}")


def _threads_of(method: str) -> int | None:
    """N of a method named "..., N threads" (``--threads``), else None."""
    head, sep, tail = method.rpartition(", ")
    return int(tail.split()[0]) if sep and tail.endswith(" threads") else None


def _with_threads(methods: list[tuple[str, str]], counts: list[int]) -> list[tuple[str, str]]:
    """Every copying adaptmem method once per thread count of ``counts``."""
    out = []
    for name, kind in methods:
        if name.startswith("adaptmem") and "copy=False" not in name:
            out.extend((f"{name}, {n} threads", kind) for n in counts)
        else:
            out.append((name, kind))
    return out


def _touch(model: nn.Module) -> None:
    """Read every distinct weight once."""
    seen: set[int] = set()
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        float(t.sum()) if t.is_floating_point() else int(t.sum())


def worker(method: str, model_name: str, work: Path, device_name: str) -> None:
    # One torch thread for every method: on a shared, busy 2-core machine, OpenMP threads
    # waiting for a core make each op's time erratic (a 4 MB sum taking 20 ms).
    torch.set_num_threads(1)
    device = torch.device(device_name)
    build = factory(model_name)
    if method.startswith("adaptmem"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import adaptmem  # noqa: F401  (imported at the top of a user's script, like torch)

        threads = _threads_of(method)
        if threads:  # --threads: the loader's worker count, for comparing counts in one run
            from adaptmem._loading import checkpoints

            checkpoints._WORKERS = threads
    if device.type == "cuda":
        torch.cuda.init()
    gc.collect()
    start = _status_kib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        model, built = _build_and_load(method, build, work, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    loaded = time.perf_counter()
    peak = _status_kib("VmHWM")
    after = _status_kib("VmRSS")
    with torch.no_grad():
        _touch(model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    touched = time.perf_counter()
    used = _status_kib("VmRSS")
    sums = {k: float(v.double().sum()) for k, v in model.state_dict().items()}
    expected = json.loads((work / "sums.json").read_text())
    bad = [k for k, v in expected.items()
           if abs(sums.get(k, float("nan")) - v) > 1e-6 * (1 + abs(v))]
    result = {
        "method": method, "build_s": built, "load_s": loaded - t0 - built,
        "touch_s": touched - loaded, "total_s": touched - t0,
        "peak_above_start": peak - start, "after_load": after - start, "after_use": used - start,
        "device_peak": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "wrong_tensors": bad[:5],
    }
    print("RESULT " + json.dumps(result))


# -- what the source allows -----------------------------------------------------------------

def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _read_all(path: Path, buf: bytearray, ahead: int = 0) -> int:
    """Read ``path`` front to back in len(buf) reads into ``buf``; return the bytes read.
    With ``ahead``, each read first advises the next ``ahead`` bytes WILLNEED."""
    total = 0
    view = memoryview(buf)
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            offset = 0
            while True:
                if ahead:
                    os.posix_fadvise(fd, offset + len(buf), ahead, os.POSIX_FADV_WILLNEED)
                n = os.preadv(fd, [view], offset)
                if not n:
                    break
                offset += n
            total += offset
        finally:
            os.close(fd)
    return total


def _evict(path: Path) -> None:
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident(path: Path) -> float:
    """Fraction of ``path``'s pages in the page cache (mincore; maps, reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = resident = 0
    for f in _files(path):
        size = f.stat().st_size
        if size == 0:
            continue
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            with warnings.catch_warnings():  # a read-only buffer: torch warns, reads nothing
                warnings.simplefilter("ignore")
                view = torch.frombuffer(mm, dtype=torch.uint8)
            libc.mincore(ctypes.c_void_p(view.data_ptr()), ctypes.c_size_t(size), vec)
            del view
            resident += sum(v & 1 for v in vec)
            total += pages
    return resident / max(total, 1)


def bandwidths(path: Path) -> dict[str, float]:
    """Page-cache copy and cold sequential read bandwidth for ``path``, in bytes/s; and
    the page-cache copy into new memory in a fresh process."""
    buf = bytearray(16 * 2**20)  # touched once below: memory that already exists
    _read_all(path, buf)
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = _read_all(path, buf)
        warm.append(n / (time.perf_counter() - t0))
    fresh = subprocess.run([sys.executable, __file__, "--fresh-memory-probe", str(path)],
                           capture_output=True, text=True, check=True)
    faulted = subprocess.run([sys.executable, __file__, "--fresh-memory-probe", str(path),
                            "--probe-pages", "ahead"], capture_output=True, text=True, check=True)
    filled = subprocess.run([sys.executable, __file__, "--fresh-memory-probe", str(path),
                             "--probe-pages", "fill"], capture_output=True, text=True)
    # The disk's sequential read: the faster of a plain front-to-back read (the kernel's
    # read-ahead alone) and one that asks for the next 64 MiB ahead, as adaptive.load does.
    colds = []
    for ahead in (0, 64 * 2**20):
        _evict(path)
        left = _resident(path)
        t0 = time.perf_counter()
        n = _read_all(path, buf, ahead)
        colds.append(n / (time.perf_counter() - t0))
    cold = max(colds)
    return {"page_cache_bytes_s": max(warm), "disk_bytes_s": cold, "resident_after_evict": left,
            "fresh_memory_bytes_s": float(fresh.stdout.split()[-1]),
            "fresh_ahead_bytes_s": float(faulted.stdout.split()[-1]),
            # 0 where the system gives no userfaultfd
            "fresh_fill_bytes_s": float(filled.stdout.split()[-1]) if filled.returncode == 0
            else 0.0}


PAGE_MODES = {  # how new memory is made before the warm file is read into it
    "4 KiB pages (torch.empty)": "4k",
    "huge pages (mmap + MADV_HUGEPAGE)": "thp",
    "pre-faulted (mmap + MADV_POPULATE_WRITE)": "populate",
    "huge + pre-faulted": "thp+populate",
    "faulted ahead by every core (MADV_POPULATE_WRITE per 16 MiB)": "ahead",
    "filled without zeroing by every core (UFFDIO_COPY per 16 MiB)": "fill",
}
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23  # Linux values; Python 3.11 names neither


def _floor_bandwidth(limits: dict[str, float], cache: str) -> float:
    if cache == "cold":
        return limits["disk_bytes_s"]
    return max(limits["fresh_ahead_bytes_s"], limits.get("fresh_fill_bytes_s", 0.0))


def fresh_memory_probe(path: Path, mode: str = "4k", size: int | None = None) -> None:
    """In this fresh process: read ``size`` bytes of the (cached) file into one new buffer,
    the least any copying load pays here (the kernel zeroes and maps every new page). With
    ``mode`` other than 4k the buffer is an anonymous mapping, 2 MiB aligned, advised to use
    transparent huge pages and/or pre-faulted in one call before the read. With ``ahead``,
    a thread per core faults the buffer in 16 MiB at a time while this one reads each piece
    once its faults are done, as adaptive.load does where it cannot fill; with ``fill``, the
    buffer is filled from the cache without being zeroed first (UFFDIO_COPY), as
    adaptive.load does where the system allows."""
    size = size or path.stat().st_size
    if mode == "fill":  # imported before timing, as a loading script imports adaptmem first
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import adaptmem._loading.new_memory  # noqa: F401
    t0 = time.perf_counter()
    if mode in ("ahead", "fill"):
        read = _read_faulted_ahead if mode == "ahead" else _read_filled
        read(path, torch.empty(size, dtype=torch.uint8))
        print(size / (time.perf_counter() - t0))
        return
    if mode == "4k":
        t = torch.empty(size, dtype=torch.uint8)
        addr = t.data_ptr()
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        align = 2 * 2**20
        region = mmap.mmap(-1, size + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        addr = -(-base // align) * align
        for flag, advice in (("thp", _MADV_HUGEPAGE), ("populate", _MADV_POPULATE_WRITE)):
            if flag in mode.split("+") and libc.madvise(addr, size, advice) != 0:
                raise SystemExit(f"madvise({advice}) failed: errno {ctypes.get_errno()}")
    view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
    fd = os.open(path, os.O_RDONLY)
    done = 0
    while done < size:
        done += os.preadv(fd, [view[done:]], done)
    print(size / (time.perf_counter() - t0))


def _read_faulted_ahead(path: Path, dest: torch.Tensor) -> None:
    from concurrent.futures import ThreadPoolExecutor

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size, piece, page = dest.numel(), 16 * 2**20, mmap.PAGESIZE
    base = dest.data_ptr()
    view = memoryview((ctypes.c_char * size).from_address(base)).cast("B")

    def fault(a: int, b: int) -> None:
        start, end = -(-(base + a) // page) * page, (base + b) // page * page
        if end > start and libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
            raise SystemExit(f"madvise(MADV_POPULATE_WRITE) failed: errno {ctypes.get_errno()}")

    fd = os.open(path, os.O_RDONLY)
    pieces = [(a, min(size, a + piece)) for a in range(0, size, piece)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        faults = [pool.submit(fault, a, b) for a, b in pieces]
        for (a, b), done in zip(pieces, faults, strict=True):
            done.result()
            while a < b:
                a += os.preadv(fd, [view[a:b]], a)
    os.close(fd)


def _read_filled(path: Path, dest: torch.Tensor) -> None:
    """``dest`` filled from the cached file without zeroing it first (UFFDIO_COPY, through
    adaptive.load's own NewMemory), a thread per core, 16 MiB at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from adaptmem._loading.new_memory import NewMemory  # imported before timing

    size, piece = dest.numel(), 16 * 2**20
    base = dest.data_ptr()
    view = memoryview((ctypes.c_char * size).from_address(base)).cast("B")
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # a read-only buffer: torch warns, reads nothing
        warnings.simplefilter("ignore")
        source = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    memory = NewMemory()
    if not memory.fill_later(dest):
        raise SystemExit("this system gives no userfaultfd")

    def fill(a: int, b: int) -> None:
        for x, y in memory.fill(base + a, source + a, b - a):  # partial and existing pages
            while x < y:
                x += os.preadv(fd, [view[a + x: a + y]], a + x)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda ab: fill(*ab), [(a, min(size, a + piece)) for a in range(0, size, piece)]))
    memory.close()
    os.close(fd)


_FIRST_BUILD = """
import sys, time, torch
from torch import nn
from adaptmem import adaptive
start = time.perf_counter()
if sys.argv[1] == "with the compiler import":
    import torch._dynamo  # what a dispatch mode's first call imported, until it opted out
adaptive.empty_model(lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)]))
print(time.perf_counter() - start)
"""


def first_build_probe(rounds: int) -> None:
    """The first ``empty_model`` of a fresh process (a plain torch model, 24 x
    Linear(2048, 2048)), as it is and with ``import torch._dynamo`` inside the timed window:
    what the loader's dispatch mode cost on its first call before it opted out of torch's
    compile-skipping wrapper. Interleaved, ``rounds`` pairs."""
    here = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    times: dict[str, list[float]] = {"as it is": [], "with the compiler import": []}
    for _ in range(rounds):
        for how in times:
            out = subprocess.run([sys.executable, "-c", _FIRST_BUILD, how], env=env,
                                 capture_output=True, text=True, check=True).stdout
            times[how].append(float(out.split()[-1]))
    for how, ts in times.items():
        print(f"| first empty_model, {how} | {statistics.median(ts):.3f} s "
              f"[{min(ts):.3f}-{max(ts):.3f}] |")


def page_probe(sizes: list[float], rounds: int, workdir: str | None) -> None:
    """Fresh-process copies of a cached file into new memory made each way of PAGE_MODES."""
    work = Path(tempfile.mkdtemp(prefix="adaptmem-pages-", dir=workdir))
    try:
        path = work / "data.bin"
        biggest = int(max(sizes) * 2**30)
        with open(path, "wb") as f:
            for _ in range(-(-biggest // 2**26)):
                f.write(os.urandom(2**26))
        _read_all(path, bytearray(16 * 2**20))
        got: dict[tuple[float, str], list[float]] = {}
        for _ in range(rounds):
            for gib in sizes:
                for mode in PAGE_MODES.values():
                    out = subprocess.run(
                        [sys.executable, __file__, "--fresh-memory-probe", str(path),
                         "--probe-pages", mode, "--probe-bytes", str(int(gib * 2**30))],
                        capture_output=True, text=True, check=True)
                    got.setdefault((gib, mode), []).append(float(out.stdout.split()[-1]))
        print(f"\nnew memory in a fresh process, filled from the page cache, {rounds} round(s): "
              f"GB/s and speed against 4 KiB pages in the same round, median [min-max]\n")
        print("| size | " + " | ".join(PAGE_MODES) + " |")
        print("|---|" + "---:|" * len(PAGE_MODES))
        for gib in sizes:
            base = got[(gib, "4k")]
            cells = [f"{_spread([x / 1e9 for x in got[(gib, m)]])} GB/s "
                     f"({_spread([x / b for x, b in zip(got[(gib, m)], base, strict=True)])}x)"
                     for m in PAGE_MODES.values()]
            print(f"| {gib:g} GiB | " + " | ".join(cells) + " |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the driver -----------------------------------------------------------------------------

def _prepare(model: str, work: Path, more: bool) -> dict[str, object]:
    print(f"building {model} with random weights ...", flush=True)
    torch.manual_seed(0)
    source = factory(model)().eval()
    state = source.state_dict()
    n_params = sum(p.numel() for p in source.parameters())
    model_bytes = sum(p.nbytes for p in source.parameters()) + sum(
        b.nbytes for b in source.buffers())
    largest = max(t.nbytes for t in state.values())
    (work / "sums.json").write_text(json.dumps(
        {k: float(v.double().sum()) for k, v in state.items()}))
    torch.save(state, work / "model.pt")
    from safetensors.torch import save_file

    # As save_pretrained does: a tied tensor is stored once, under its first name.
    seen: set[int] = set()
    unique = {}
    for k, v in state.items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            unique[k] = v.contiguous()
    save_file(unique, str(work / "model.safetensors"), metadata={"format": "pt"})
    del unique
    if more:
        (work / "per-tensor").mkdir()
        for k, v in state.items():
            torch.save(v.clone(), work / "per-tensor" / f"{k}.pt")
    del source, state
    gc.collect()
    os.sync()  # dirty pages cannot be evicted
    return {"params": n_params, "model_bytes": model_bytes, "largest": largest,
            "pt_bytes": (work / "model.pt").stat().st_size,
            "st_bytes": (work / "model.safetensors").stat().st_size}


def _run_method(method: str, model: str, work: Path, device: str,
                timeout: float) -> dict[str, object]:
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", method, "--models", model,
             "--workdir", str(work), "--device", device],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"method": method, "failed": f"over {timeout} s"}
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"method": method, "failed": tail[:160]}
    return json.loads(line[7:])  # type: ignore[no-any-return]


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,large",
                    help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--cache", default="warm,cold", help="warm, cold or both")
    ap.add_argument("--rounds", type=int, default=3, help="repeats of every method")
    ap.add_argument("--all-methods", action="store_true",
                    help="also the slow baselines, accelerate and per-tensor files")
    ap.add_argument("--only", default=None, help="run methods whose name contains this "
                    "(the recipe always runs: ratios need it)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (deleted afterwards)")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds one method may take before it is recorded as failed")
    ap.add_argument("--against", default=None, metavar="PATH",
                    help="instead of the table: the adaptmem methods of this checkout against "
                    "those of another checkout at PATH, in fresh processes, alternating which "
                    "runs first, --rounds pairs per cell (back to back: new memory is reused); "
                    "with --threads, once per count of reader threads")
    ap.add_argument("--limits", default="every", choices=["every", "first", "none"],
                    help="when to measure the bandwidth limits (each in fresh processes): "
                    "every round (default), the first round only, or never (load / floor "
                    "is then left out; for short runs on a machine slow to start processes)")
    ap.add_argument("--threads", default=None, metavar="N,...",
                    help="run each copying adaptmem method once per count of worker threads "
                    "the loader reads and fills with (default: the loader's own choice)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--page-probe", default=None, metavar="GIB,...",
                    help="instead of loading: copy a cached file of each size (GiB) into new "
                    "memory made with 4 KiB pages, huge pages and/or pre-faulted, each in a "
                    "fresh process, --rounds times")
    ap.add_argument("--first-build-probe", action="store_true",
                    help="instead of loading: the first empty_model of a fresh process, with "
                    "and without importing torch's compiler in it, --rounds pairs")
    ap.add_argument("--fresh-memory-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-pages", default="4k", help=argparse.SUPPRESS)
    ap.add_argument("--probe-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fresh_memory_probe:
        fresh_memory_probe(Path(args.fresh_memory_probe), args.probe_pages, args.probe_bytes)
        return
    if args.first_build_probe:
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; Linux "
              f"{platform.release()}; torch {torch.__version__}; command: python "
              f"benchmarks/loading.py {' '.join(sys.argv[1:])}", flush=True)
        first_build_probe(args.rounds)
        return
    if args.page_probe:
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; Linux "
              f"{platform.release()}; command: python benchmarks/loading.py "
              f"{' '.join(sys.argv[1:])}", flush=True)
        page_probe([float(x) for x in args.page_probe.split(",")], args.rounds, args.workdir)
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.worker:
        worker(args.worker, args.models, Path(args.workdir), device)
        return

    if args.against:
        against(Path(args.against), args, device)
        return
    methods = CORE_METHODS + (MORE_METHODS if args.all_methods else [])
    if args.only:
        methods = [m for m in methods if args.only in m[0] or m[0] == RECIPE]
    if args.threads:
        methods = _with_threads(methods, [int(n) for n in args.threads.split(",")])
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: "
          f"{platform.machine()}, {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
          f"Linux {platform.release()}, torch {torch.__version__}; device {device}; command: "
          f"python benchmarks/loading.py {' '.join(sys.argv[1:])}", flush=True)
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        work = Path(tempfile.mkdtemp(prefix="adaptmem-bench-", dir=args.workdir))
        try:
            info = _prepare(model, work, args.all_methods)
            files = {"pt": work / "model.pt", "safetensors": work / "model.safetensors",
                     "dir": work / "per-tensor"}
            rows: dict[tuple[str, str], list[dict[str, object]]] = {}
            # The limits of the files the methods read, every round or the first only.
            probed = sorted({"pt" if k == "dir" else k for _, k in methods})
            limits: dict[str, list[dict[str, float]]] = {k: [] for k in probed}
            for rnd in range(args.rounds):
                if args.limits == "every" or (args.limits == "first" and rnd == 0):
                    for kind in probed:
                        limits[kind].append(bandwidths(files[kind]))
                # Each round starts one method later: on a virtual disk whose host caches
                # what was read recently, the first cold read after a pause pays more, and
                # that must not always be the same method's.
                order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
                for cache in caches:
                    for method, kind in order:
                        if cache == "cold":
                            _evict(files[kind])
                        else:
                            _read_all(files[kind], bytearray(16 * 2**20))
                        r = _run_method(method, model, work, device, args.timeout)
                        r["round"] = rnd
                        rows.setdefault((cache, method), []).append(r)
                        state = r.get("failed") or f"total {r['total_s']:.2f}s"
                        print(f"  round {rnd + 1} {cache:4s} {method}: {state}", flush=True)
            _report(model, info, methods, caches, rows, limits)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def against(other: Path, args: argparse.Namespace, device: str) -> None:
    """Total s to a ready model, this checkout's copying loads against ``other``'s."""
    here = Path(__file__).resolve().parents[1]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; this checkout {here} "
          f"against {other}; command: python benchmarks/loading.py {' '.join(sys.argv[1:])}")
    counts = [int(n) for n in args.threads.split(",")] if args.threads else [None]
    print("\n| model | file | cache | threads | other s | this s | this / other |\n"
          "|---|---|---|---:|---:|---:|---:|")
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        work = Path(tempfile.mkdtemp(prefix="adaptmem-bench-", dir=args.workdir))
        try:
            _prepare(model, work, False)
            for cache in [c.strip() for c in args.cache.split(",") if c.strip()]:
                for kind, count in ((k, n) for k in ("pt", "safetensors") for n in counts):
                    path, method = work / f"model.{kind}", f"adaptmem (.{kind})"
                    if count is not None:  # the loader's pool, as --threads sets it
                        method += f", {count} threads"
                    got: dict[Path, list[float]] = {here: [], other: []}
                    for rnd in range(args.rounds):
                        for tree in (here, other) if rnd % 2 == 0 else (other, here):
                            _evict(path) if cache == "cold" else _read_all(
                                path, bytearray(16 * 2**20))
                            out = subprocess.run(
                                [sys.executable, str(tree / "benchmarks" / "loading.py"),
                                 "--worker", method, "--models", model, "--workdir", str(work),
                                 "--device", device], capture_output=True, text=True,
                                timeout=args.timeout, check=True).stdout
                            r = json.loads(out.split("RESULT ", 1)[1])
                            if r["wrong_tensors"]:
                                raise SystemExit(f"{tree}: wrong values in {r['wrong_tensors']}")
                            got[tree].append(float(r["total_s"]))
                    ratio = [a / b for a, b in zip(got[here], got[other], strict=True)]
                    print(f"| {model} | .{kind} | {cache} | {count or 'default'} | "
                          f"{_spread(got[other])} | "
                          f"{_spread(got[here])} | {_spread(ratio)} |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _report(model: str, info: dict[str, object], methods: list[tuple[str, str]],
            caches: list[str], rows: dict[tuple[str, str], list[dict[str, object]]],
            limits: dict[str, list[dict[str, float]]]) -> None:
    gib = 2**30
    print()
    print(f"### {model}: {int(info['params']) / 1e6:.0f}M parameters, "  # type: ignore[call-overload]
          f"{int(info['model_bytes']) / gib:.2f} GiB fp32, largest tensor "  # type: ignore[call-overload]
          f"{int(info['largest']) / 2**20:.0f} MiB; .pt {int(info['pt_bytes']) / gib:.2f} GiB, "  # type: ignore[call-overload]
          f".safetensors {int(info['st_bytes']) / gib:.2f} GiB")  # type: ignore[call-overload]
    for kind, key in (("pt", "pt_bytes"), ("safetensors", "st_bytes")):
        if not limits.get(kind):
            continue
        size = int(info[key])  # type: ignore[call-overload]
        warm = [x["page_cache_bytes_s"] for x in limits[kind]]
        cold = [x["disk_bytes_s"] for x in limits[kind]]
        left = max(x["resident_after_evict"] for x in limits[kind])
        fresh = [x["fresh_memory_bytes_s"] for x in limits[kind]]
        ahead = [x["fresh_ahead_bytes_s"] for x in limits[kind]]
        filled = [x["fresh_fill_bytes_s"] for x in limits[kind] if x["fresh_fill_bytes_s"]]
        fill_text = (f"; filled without zeroing by every core {_spread([f / 1e9 for f in filled])}"
                     f" GB/s (floor {_spread([size / f for f in filled], '{:.3f}')} s)"
                     if filled else "; no userfaultfd here, so no fill without zeroing")
        print(f"- .{kind}: page-cache copy {_spread([w / 1e9 for w in warm])} GB/s "
              f"(floor {_spread([size / w for w in warm], '{:.3f}')} s); the same into new "
              f"memory in a fresh process {_spread([f / 1e9 for f in fresh])} GB/s (floor "
              f"{_spread([size / f for f in fresh], '{:.3f}')} s), and with every core "
              f"faulting it in ahead of the reads {_spread([f / 1e9 for f in ahead])} GB/s "
              f"(floor {_spread([size / f for f in ahead], '{:.3f}')} s){fill_text}; "
              f"cold sequential read "
              f"{_spread([c / 1e9 for c in cold])} GB/s (floor "
              f"{_spread([size / c for c in cold], '{:.3f}')} s); "
              f"{left:.0%} of the file cached after eviction")
    for cache in caches:
        print()
        print(f"{model}, {cache} page cache, {len(next(iter(rows.values())))} round(s): "
              f"median [min-max]")
        print()
        print("| method | build s | load s | touch s | total s | total / recipe | "
              "load / floor | peak GiB | after use GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for method, kind in methods:
            runs = [r for r in rows[(cache, method)] if "failed" not in r]
            if not runs:
                print(f"| {method} | failed: {rows[(cache, method)][0]['failed']} |||||||")
                continue
            recipe = {r["round"]: r for r in rows[(cache, RECIPE)] if "failed" not in r}
            size = int(info["pt_bytes" if kind == "pt" else "st_bytes"])  # type: ignore[call-overload]
            ratio = [float(r["total_s"]) / float(recipe[r["round"]]["total_s"])  # type: ignore[arg-type,index]
                     for r in runs if r["round"] in recipe]
            # load s against the round's floor for this file: the cold sequential read when
            # cold; when warm, the fastest way to new memory measured here (the page-cache
            # copy into new memory of a fresh process, faulted in ahead or filled).
            # (the latest round's limits when they were measured in the first round only)
            lim = limits.get(kind if kind != "dir" else "pt", [])
            disk = [float(r["load_s"]) / (size / _floor_bandwidth(  # type: ignore[arg-type]
                lim[min(int(r["round"]), len(lim) - 1)], cache))  # type: ignore[call-overload]
                for r in runs] if lim else []
            wrong = any(r["wrong_tensors"] for r in runs)
            print(f"| {method}{' (WRONG VALUES)' if wrong else ''} | "
                  + " | ".join(_spread([float(r[k]) for r in runs])  # type: ignore[arg-type]
                               for k in ("build_s", "load_s", "touch_s", "total_s"))
                  + f" | {_spread(ratio)} | {_spread(disk)} | "
                  + _spread([float(r["peak_above_start"]) / gib for r in runs]) + " | "  # type: ignore[arg-type]
                  + _spread([float(r["after_use"]) / gib for r in runs]) + " |")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
