"""``model=`` on the CPU under a real memory cap (issue 14's CPU verification): the model's
masters are file-backed pages of its checkpoint (``adaptive.load(..., copy=False)``, left out
of the cap: see [Note: file mappings and the cap] in ``adaptmem/cpu_memory.py``); its resident
and paged copies on the "device" (the CPU itself) and the activations are what the cap
counts, so they compete as weights and a batch compete for a GPU. ``benchmarks/dispatch_cpu.py``
measures the same set-up's throughput."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="set_cpu_memory_limit needs Linux (RLIMIT_DATA)")

# Beyond what the child holds with its data. 16 MiB of weights (eight 2 MiB Linear layers)
# + 1024 items (32 KiB of activations each) do not fit; 16 MiB + 512 items do, and so do
# 1024 items next to 8 MiB resident or the fully paged model (a unit or two at a time), but
# not 2048 items (all of the data) even then. The outcomes asserted below were the same for
# caps from 40 to 46 MiB on the VM of 2026-11-25 (Linux 6.18.44-fc-v595); on that of
# 2026-11-26 (fc-v669) the child held more beside its data, caps of 43-46 MiB failed at the
# smallest batch even with the main loader of that day, 48 and 52 MiB sometimes, and 47,
# 49, 50 and 54 MiB passed every time. The failures at random were glibc's heap, not timing
# (see the child's first lines).
CAP_MIB = 49

# One child for every variant, run one after another (glibc's mmap threshold is fixed, so
# what one frees is unmapped and the cap reads it as free for the next).
CHILD = """
    import ctypes, json, logging, sys, torch
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, before any tensor
    libc.mallopt(-8, 1)  # M_ARENA_MAX
    # The heap may not grow (a page mapped where it ends): near the cap, glibc serves a
    # block that mmap is refused from the heap when the heap's free top makes up the
    # difference, and that block, once freed behind smaller ones, stays in the heap where
    # the cap counts it. It made the give_back case fail at random, busy machine or not.
    # Without the heap, glibc grows the arena in mappings of 1 MiB or more, which hold no
    # 16 MiB activation; with one arena, it does not retry in another (see
    # docs/limitations.md).
    libc.sbrk.restype = libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    end = libc.sbrk(0)
    guard = libc.mmap(end, 4096, 0, 0x22 | 0x100000, -1, 0)  # MAP_FIXED_NOREPLACE
    assert guard == end, ("no page could be mapped where the heap ends", ctypes.get_errno())
    from torch import nn
    from adaptmem import adaptive
    from adaptmem.cpu_memory import held_bytes, set_cpu_memory_limit

    torch.set_num_threads(1)  # thread stacks count toward the cap
    path, cap = sys.argv[1], int(sys.argv[2]) << 20
    logs = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    logging.getLogger("adaptmem").addHandler(Keep())
    logging.getLogger("adaptmem").setLevel(logging.INFO)

    def build():
        return nn.Sequential(*[m for _ in range(4) for m in
                               (nn.Linear(128, 4096), nn.ReLU(), nn.Linear(4096, 128))])

    data = torch.load(path + ".data", weights_only=True)
    want = torch.load(path + ".want", weights_only=True)
    metas = [adaptive.empty_model(build) for _ in range(4)]  # before the cap
    # model= traces on fake tensors, which imports torch's compiler on first use (78 MiB of
    # VmData on the development VM, more than the cap): a process capped after loading
    # imports it first. empty_model used to import it as a side effect.
    import torch._dynamo
    set_cpu_memory_limit((held_bytes() + cap) / 2**30)

    def run(model, batchsize):
        with torch.no_grad():
            return torch.cat([model(c) for c in data.split(batchsize)])

    def outcome(decorated, got, start):
        return {"failed": decorated.stats.failed_attempts, "size": decorated.stats.last_size,
                "equal": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5)),
                "logged": sum("ran out of memory at batchsize=" in m for m in logs[start:])}

    out = {}
    # The unadapted model, its weights in ordinary memory, at the large batch.
    plain = adaptive.load(metas.pop(), path, device="cpu").eval()
    try:
        run(plain, 1024)
        out["plain"] = "ran"
    except RuntimeError as exc:
        out["plain"] = "out of memory" if adaptive.is_oom(exc) else repr(exc)
    del plain
    # Batch search alone over the model fully paged.
    model = adaptive.load(metas.pop(), path, device="cpu", copy=False).eval()
    pager = adaptive.page(model, "cpu", resident_bytes=0)
    search = adaptive.batch(lambda batchsize: run(model, batchsize), initial_batchsize=2048)
    start = len(logs)
    out["search"] = outcome(search, search(), start)
    pager.remove()
    del model, pager
    # model=: placement and batch size together.
    model = adaptive.load(metas.pop(), path, device="cpu", copy=False).eval()
    placed = adaptive.batch(lambda batchsize: run(model, batchsize), initial_batchsize=2048,
                            model=model, device="cpu")
    start = len(logs)
    out["model"] = {**outcome(placed, placed(), start), "placement": placed.placement}
    placed.remove()
    del model, placed
    # model= with no batch below 1024 allowed: only giving residency back makes room.
    model = adaptive.load(metas.pop(), path, device="cpu", copy=False).eval()
    pinned = adaptive.batch(lambda batchsize: run(model, batchsize), initial_batchsize=1024,
                            min_batchsize=1024, model=model, device="cpu")
    start = len(logs)
    out["give_back"] = {**outcome(pinned, pinned(), start), "placement": pinned.placement}
    print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def under_the_cap(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("cpucap") / "model.pt"
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in
                            (nn.Linear(128, 4096), nn.ReLU(), nn.Linear(4096, 128))]).eval()
    torch.save(model.state_dict(), path)
    data = torch.randn(2048, 128)
    torch.save(data, f"{path}.data")
    with torch.no_grad():
        torch.save(model(data), f"{path}.want")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(path),
                             str(CAP_MIB)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def test_model_runs_under_a_cap_where_the_unpaged_model_at_the_large_batch_fails(
    under_the_cap: dict[str, Any],
) -> None:
    assert under_the_cap["plain"] == "out of memory"
    placed = under_the_cap["model"]
    assert placed["equal"]  # the outputs of the unadapted computation
    # The failed attempts are reported, one per out-of-memory error it logged.
    assert placed["failed"] == placed["logged"]
    assert placed["size"] < 1024
    p = placed["placement"]
    assert p["device"] == "cpu" and 0 < p["resident_bytes"][0] <= p["weight_bytes"][0]


def test_at_the_smallest_batch_model_gives_residency_back_until_it_fits(
    under_the_cap: dict[str, Any],
) -> None:
    pinned = under_the_cap["give_back"]
    assert pinned["equal"] and pinned["size"] == 1024
    p = pinned["placement"]
    assert p["residency_given_back"] >= 1
    assert p["resident_bytes"][0] < under_the_cap["model"]["placement"]["resident_bytes"][0]


def test_batch_search_over_the_fully_paged_model_also_completes(
    under_the_cap: dict[str, Any],
) -> None:
    search = under_the_cap["search"]
    assert search["equal"] and search["failed"] == search["logged"]
    assert search["failed"] >= 1  # all the data at once does not fit even fully paged


def test_model_pays_fewer_failed_attempts_than_batch_search_over_the_paged_model(
    under_the_cap: dict[str, Any],
) -> None:
    # model= predicts where its first call fits next to the weights it keeps resident
    # ([Note: predicting the first size]); the search over the paged model finds out by
    # running out of memory.
    assert under_the_cap["model"]["failed"] < under_the_cap["search"]["failed"]
