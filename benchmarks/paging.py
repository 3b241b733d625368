"""Paging benchmark: adaptmem.page against fully resident, optimem.page and accelerate.

    python benchmarks/paging.py            # measure and print
    python benchmarks/paging.py --write    # ... and replace "## Paging" in RESULTS.md
    python benchmarks/paging.py --simulated-only --threads 1 --write   # simulated GPU only

On a CPU-only machine it measures the pager's own cost: hook overhead per unit on a model
of many tiny layers (target <= 20 us), and a paged ResNet-101 forward against the
unpaged one, with optimem and accelerate's ``cpu_offload`` on the same models. There the
others copy nothing (``.to("cpu")`` of a CPU tensor is a no-op) while adaptmem makes real
copies, so the comparison is of bookkeeping, not of bus use. With CUDA it also runs the
GPU workloads of issue 3: ResNet-101 at 512x512 (batches 1 to 64) and a GPT-2-XL-shaped
fp16 transformer, under a memory fraction that holds 25% of the weights, against the bound
max(resident compute, paged bytes / pinned bandwidth), adaptmem's pager as it is and with
each tensor copied on its own (as before packed masters) in the same run.

``--simulated`` adds (``--simulated-only``: runs only) the same comparison on a simulated
GPU, ``adaptmem.testing.simulated_cuda(bandwidth=...)``, on any machine: a small GPT and
ResNet-18, adaptmem (prefetch=1 and 0) against optimem.page and accelerate.cpu_offload,
over a link faster than compute (``--bandwidth``, 25 GB/s) and one slower
(``--slow-bandwidth``). Its figures go to "Paging on a simulated GPU", labelled simulated.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import RESULTS, header, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem._engines.transfer import SyncTransfer  # noqa: E402

# -- helpers -----------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], *, rounds: int, per_round: int, sync: Callable[[], None]) -> float:
    """Median seconds per call over ``rounds`` rounds of ``per_round`` calls."""
    fn()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        sync()
        times.append((time.perf_counter() - start) / per_round)
    return statistics.median(times)


def _nosync() -> None:
    return None


class Engine:
    """One way of running a model: set up on a fresh copy, forward, tear down."""

    def __init__(self, name: str, setup: Callable[[nn.Module], Any]) -> None:
        self.name = name
        self.setup = setup


def _adaptmem(device: str, **options: Any) -> Callable[[nn.Module], Any]:
    def setup(model: nn.Module) -> Any:
        return adaptive.page(model, device, **options)

    return setup


class _AliasTransfer(SyncTransfer):
    """A stand-in for the pager's CPU transfer that hands back the masters themselves
    (``detach()``: a new tensor object, no copy). Timing the pager with it leaves its hooks
    and bookkeeping alone, so the gap to the real run is what the copies cost."""

    def start(self, hosts: Any, runs: Any = ()) -> tuple[list[torch.Tensor], None]:
        return [h.detach() for h in hosts], None


def _adaptmem_without_copies(**options: Any) -> Callable[[nn.Module], Any]:
    def setup(model: nn.Module) -> Any:
        # benchmark only: see _AliasTransfer
        return adaptive.page(model, "cpu", _transfer=_AliasTransfer(torch.device("cpu")),
                             **options)

    return setup


def _optimem(device: str) -> Callable[[nn.Module], Any]:
    def setup(model: nn.Module) -> Any:
        import optimem

        optimem.page(model, torch.device(device))
        return None

    return setup


def _accelerate(device: str) -> Callable[[nn.Module], Any]:
    def setup(model: nn.Module) -> Any:
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=torch.device(device))
        return None

    return setup


def _available(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# -- CPU: the pager's own cost -----------------------------------------------------------------


def timed_together(calls: dict[str, Callable[[], Any]], *, rounds: int, per_round: int,
                   sync: Callable[[], None]) -> dict[str, float]:
    """Best seconds per call for each entry, rounds interleaved so that load from other
    processes hits every mode alike (the minimum is the least disturbed round)."""
    for fn in calls.values():
        fn()
    sync()
    best = {name: math.inf for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / per_round)
    return best


def _rivals() -> list[Engine]:
    engines = []
    if _available("optimem"):
        engines.append(Engine("optimem.page", _optimem("cpu")))
    if _available("accelerate"):
        engines.append(Engine("accelerate cpu_offload", _accelerate("cpu")))
    return engines


def _compare(workload: str, base: nn.Module, x: Any, engines: list[Engine], *,
             rounds: int, per_round: int, hooks_reference: bool) -> list[dict[str, Any]]:
    calls: dict[str, Callable[[], Any]] = {"unpaged": lambda: base(x)}
    units: dict[str, int] = {}
    pagers = []
    if hooks_reference:
        # The floor for any hook-based pager: an empty pre/post hook pair on every leaf.
        hooked = copy.deepcopy(base)
        for m in hooked.modules():
            if not list(m.children()):
                m.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
                m.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True,
                                        always_call=True)
        calls["empty hooks (reference)"] = lambda: hooked(x)
        units["empty hooks (reference)"] = sum(1 for m in base.modules()
                                               if not list(m.children()))
    for engine in engines:
        model = copy.deepcopy(base)
        handle = engine.setup(model)
        if handle is not None:
            pagers.append(handle)
            model(x)  # the first forward learns; time the steady state
            units[engine.name] = len(handle.plan.units)
        else:  # optimem and accelerate work per leaf module holding weights
            units[engine.name] = sum(1 for m in base.modules() if not list(m.children())
                                     and any(True for _ in m.parameters(recurse=False)))
        calls[engine.name] = lambda m=model: m(x)
    best = timed_together(calls, rounds=rounds, per_round=per_round, sync=_nosync)
    for pager in pagers:
        pager.remove()
    plain = best["unpaged"]
    return [{"workload": workload, "mode": name, "time": t, "vs_unpaged": t / plain,
             "per_unit_us": (t - plain) / units[name] * 1e6 if name in units else math.nan}
            for name, t in best.items()]


def cpu_rows(quick: bool) -> list[dict[str, Any]]:
    import torchvision

    torch.manual_seed(0)
    layers = 64
    tiny = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)]).eval()
    rows = []
    with torch.no_grad():
        engines = [Engine("adaptmem page", _adaptmem("cpu", unit_bytes=0, resident_bytes=0)),
                   Engine("adaptmem page, copies skipped", _adaptmem_without_copies(
                       unit_bytes=0, resident_bytes=0)),
                   *_rivals()]
        rows += _compare(f"{layers} x Linear(16,16), batch 1", tiny, torch.randn(1, 16),
                         engines, rounds=5 if quick else 15, per_round=10 if quick else 20,
                         hooks_reference=True)
        torch.manual_seed(0)
        resnet = torchvision.models.resnet101(weights=None).eval()
        engines = [Engine("adaptmem page", _adaptmem("cpu", unit_bytes="16MiB",
                                                     resident_bytes=0)), *_rivals()]
        rows += _compare("ResNet-101 224x224, batch 1", resnet, torch.randn(1, 3, 224, 224),
                         engines, rounds=2 if quick else 10, per_round=1, hooks_reference=False)
    return rows


def cpu_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | mode | time / forward | vs unpaged | overhead / unit (copies incl.) |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        unit = "-" if r["mode"] == "unpaged" or math.isnan(r["per_unit_us"]) \
            else f"{r['per_unit_us']:.1f} us"
        lines.append(f"| {r['workload']} | {r['mode']} | {r['time'] * 1e3:.3f} ms | "
                     f"{r['vs_unpaged']:.2f}x | {unit} |")
    return "\n".join(lines)


# -- GPU: the bus-bound workloads ----------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-XL shaped by default: 48 layers, width 1600, 25 heads, tied lm_head."""

    def __init__(self, layers: int = 48, dim: int = 1600, heads: int = 25,
                 vocab: int = 50257, ctx: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.h = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))[None]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def pinned_bandwidth(device: torch.device) -> float:
    """Host-to-device bytes per second from pinned memory (256 MiB copies)."""
    host = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    t = timed(lambda: dev.copy_(host, non_blocking=True), rounds=5, per_round=4,
              sync=lambda: torch.cuda.synchronize(device))
    return host.numel() / t


def _unpacked(model: nn.Module, device: torch.device, **options: Any) -> Any:
    """adaptive.page as it was before packed masters: each tensor pinned, and copied, on its
    own (see [Note: packed masters] in adaptmem/_engines/hoststore.py)."""
    from adaptmem._paging import pager

    packs = pager._pack_groups
    pager._pack_groups = lambda units: []  # type: ignore[assignment]
    try:
        return adaptive.page(model, device, **options)
    finally:
        pager._pack_groups = packs


def gpu_rows(quick: bool, batches: tuple[int, ...] = (1, 4, 16, 64),
             rivals: tuple[str, ...] = ("optimem", "accelerate")) -> list[dict[str, Any]]:
    import torchvision

    device = torch.device("cuda", torch.cuda.current_device())  # fraction calls want an index
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    bandwidth = pinned_bandwidth(device)
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    resnet = torchvision.models.resnet101(weights=None).eval()
    with torch.device("meta"):
        gpt = GPT().half().eval()
    gpt = gpt.to_empty(device="cpu")
    gpt.lm_head.weight = gpt.wte.weight  # to_empty gives each a tensor of its own
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0, 0.02)
    workloads: list[tuple[str, nn.Module, Callable[[], torch.Tensor]]] = []
    for batch in (1, 4) if quick else batches:
        workloads.append((f"ResNet-101 512x512, batch {batch}", resnet,
                          lambda b=batch: torch.randn(b, 3, 512, 512)))
    workloads.append(("GPT-2-XL shape fp16, 1x1024 tokens", gpt,
                      lambda: torch.randint(0, 50257, (1, 1024))))
    engines = [Engine("adaptmem page", None),  # type: ignore[arg-type]
               Engine("adaptmem page, tensor by tensor", None)]  # type: ignore[arg-type]
    if "optimem" in rivals:
        engines.append(Engine("optimem.page", _optimem("cuda")))
    if "accelerate" in rivals:
        engines.append(Engine("accelerate cpu_offload", _accelerate("cuda")))
    rounds, per_round = (3, 1) if quick else (5, 2)
    for name, base, make_input in workloads:
        weights = sum(t.numel() * t.element_size()
                      for t in {id(t): t for t in [*base.parameters(), *base.buffers()]}.values())
        x = make_input().to(device)
        with torch.no_grad():
            resident = copy.deepcopy(base).to(device)
            torch.cuda.reset_peak_memory_stats(device)
            t_res = timed(lambda m=resident, x=x: m(x), rounds=rounds, per_round=per_round,
                          sync=sync)
            peak_res = torch.cuda.max_memory_allocated(device)
            del resident
            torch.cuda.empty_cache()
        activations = max(0, peak_res - weights)
        cap = weights // 4  # the device holds 25% of the weights, plus activation room
        bound = max(t_res, weights / bandwidth)  # resident_bytes=0: every byte is paged
        rows.append({"workload": name, "mode": "fully resident", "time": t_res,
                     "peak": peak_res, "gbps": float("nan"), "bound": bound})
        total = torch.cuda.mem_get_info(device)[1]
        for engine in engines:
            model = copy.deepcopy(base)
            handle = None
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, (torch.cuda.memory_allocated(device) + cap + activations * 1.2
                          + 256 * 2**20) / total), device)
            try:
                if engine.name == "adaptmem page":
                    handle = adaptive.page(model, device, resident_bytes=0, device_budget=cap)
                elif engine.name == "adaptmem page, tensor by tensor":
                    handle = _unpacked(model, device, resident_bytes=0, device_budget=cap)
                else:
                    handle = engine.setup(model)
                torch.cuda.reset_peak_memory_stats(device)
                with torch.no_grad():
                    t = timed(lambda m=model, x=x: m(x), rounds=rounds, per_round=per_round,
                              sync=sync)
                moved = handle.stats.bytes_moved / max(1, handle.stats.forwards) \
                    if handle is not None else weights
                rows.append({"workload": name, "mode": engine.name, "time": t,
                             "peak": torch.cuda.max_memory_allocated(device),
                             "gbps": moved / t / 1e9, "bound": bound})
            except Exception as exc:  # a rival that cannot run this workload is a result too
                rows.append({"workload": name, "mode": engine.name, "time": float("nan"),
                             "peak": float("nan"), "gbps": float("nan"), "bound": bound,
                             "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
            finally:
                if handle is not None:  # pinned masters and hooks go, even after a failure
                    handle.remove()
                torch.cuda.set_per_process_memory_fraction(1.0, device)
                del model, handle
                torch.cuda.empty_cache()
    for r in rows:
        r["bandwidth"] = bandwidth
    return rows


def gpu_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | mode | time / forward | vs bound | peak device | effective H2D |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['mode']} | failed: {r['error']} | | | |")
            continue
        gbps = "-" if math.isnan(r["gbps"]) else f"{r['gbps']:.1f} GB/s"
        lines.append(f"| {r['workload']} | {r['mode']} | {r['time'] * 1e3:.1f} ms | "
                     f"{r['time'] / r['bound']:.2f}x | {r['peak'] / 2**30:.2f} GiB | {gbps} |")
    if rows:
        lines.append(f"\nPinned host-to-device bandwidth: {rows[0]['bandwidth'] / 1e9:.1f} GB/s; "
                     "bound = max(fully resident time, weight bytes / that bandwidth).")
    return "\n".join(lines)


# -- simulated GPU: adaptmem.testing.simulated_cuda ---------------------------------------------


SIM_TITLE = "Paging on a simulated GPU"


def _small_gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(layers=6, dim=256, heads=4, vocab=4096, ctx=128).eval()


def _small_resnet() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


def simulated_rows(quick: bool, links: list[float]) -> list[dict[str, Any]]:
    """Every engine under one ``simulated_cuda(bandwidth=link)`` per link: compute runs at
    this CPU's speed, host<->device copies take bytes / link (asynchronous ones complete
    that long after they were issued, synchronous ones hold the host)."""
    from adaptmem.testing import simulated_cuda

    workloads: list[tuple[str, Callable[[], nn.Module], Callable[[], torch.Tensor]]] = [
        ("GPT (6 layers, width 256, vocab 4096), 4x128 tokens", _small_gpt,
         lambda: torch.randint(0, 4096, (4, 128))),
        ("ResNet-18 128x128, batch 8", _small_resnet, lambda: torch.randn(8, 3, 128, 128)),
    ]
    rounds = 2 if quick else 6
    rows: list[dict[str, Any]] = []
    for name, build, make_input in workloads:
        base = build()
        weights = sum(t.numel() * t.element_size()
                      for t in {id(t): t for t in [*base.parameters(), *base.buffers()]}.values())
        x_host = make_input()
        for link in links:
            with simulated_cuda(total_memory="4GiB", bandwidth=link) as sim, torch.no_grad():
                sync = torch.cuda.synchronize
                x = x_host.to("cuda")
                models: dict[str, nn.Module] = {"fully resident": copy.deepcopy(base).to("cuda")}
                pagers: dict[str, Any] = {}
                for prefetch in (1, 0):
                    model = copy.deepcopy(base)
                    mode = f"adaptmem page, prefetch={prefetch}"
                    pagers[mode] = adaptive.page(model, "cuda", resident_bytes=0,
                                                 device_budget=weights // 4, prefetch=prefetch)
                    model(x)  # the first forward learns; time the steady state
                    models[mode] = model
                failed: dict[str, str] = {}
                for engine in _rivals_on("cuda"):
                    model = copy.deepcopy(base)
                    try:
                        engine.setup(model)
                        for _ in range(2):  # a rival must run more than one forward
                            model(x)
                        models[engine.name] = model
                    except Exception as exc:  # a rival that cannot run this is a result too
                        failed[engine.name] = f"{type(exc).__name__}: {str(exc)[:70]}"
                peaks = {}
                for mode, model in models.items():
                    model(x)
                    sync()
                    torch.cuda.reset_peak_memory_stats()
                    model(x)
                    sync()
                    peaks[mode] = torch.cuda.max_memory_allocated()
                for pager in pagers.values():
                    pager.stats.reset()
                # Per call: wall time, the host thread's CPU time, and the host's time on
                # copies (the simulation's memcpy, waits for copies not yet complete); the
                # fastest call of each mode is the one broken down (see _breakdown).
                calls: dict[str, list[tuple[float, float, float, float]]] = {
                    mode: [] for mode in models}

                def call(mode: str, m: nn.Module, x: torch.Tensor = x, sim: Any = sim,
                         calls: dict[str, list[Any]] = calls,
                         sync: Callable[[], None] = sync) -> None:
                    before, wall, cpu = sim.copy_stats, time.perf_counter(), time.thread_time()
                    m(x)
                    sync()
                    after = sim.copy_stats
                    calls[mode].append((time.perf_counter() - wall, time.thread_time() - cpu,
                                        after["copy_seconds"] - before["copy_seconds"],
                                        after["wait_seconds"] - before["wait_seconds"]))

                best = timed_together({mode: (lambda mode=mode, m=m: call(mode, m))
                                       for mode, m in models.items()},
                                      rounds=rounds, per_round=1, sync=sync)
                resident = best["fully resident"]
                for mode, t in best.items():
                    def host(c: tuple[float, float, float, float]) -> float:
                        return c[1] + c[3]

                    fastest = min(calls[mode], key=host)
                    row: dict[str, Any] = {"workload": name, "link": link, "mode": mode,
                                           "time": t, "peak": peaks[mode],
                                           "weights": weights, "resident": resident,
                                           "fastest": fastest,
                                           "resident_fastest": min(calls["fully resident"],
                                                                   key=host)}
                    pager = pagers.get(mode)
                    if pager is not None:
                        s = pager.stats
                        row.update(moved=s.bytes_moved / max(1, s.forwards),
                                   transfers=s.transfers, waited=s.prefetch_misses,
                                   units=len(pager.plan.units))
                    elif mode != "fully resident":
                        row["moved"] = weights  # what they move at least
                    row["bound"] = max(resident, row.get("moved", 0) / (link * 1e9))
                    # The same forwards on the host thread's own clock: its CPU time plus
                    # the time it was blocked on copies (see SIM_NOTE).
                    row["host"] = min(c[1] + c[3] for c in calls[mode])
                    row["host_bound"] = max(min(c[1] + c[3] for c in calls["fully resident"]),
                                            row.get("moved", 0) / (link * 1e9))
                    rows.append(row)
                rows += [{"workload": name, "link": link, "mode": mode, "error": error}
                         for mode, error in failed.items()]
                for pager in pagers.values():
                    pager.remove()
                del models, pagers, x
    return rows


def _rivals_on(device: str) -> list[Engine]:
    engines = []
    if _available("optimem"):
        engines.append(Engine("optimem.page", _optimem(device)))
    if _available("accelerate"):
        engines.append(Engine("accelerate cpu_offload", _accelerate(device)))
    return engines


def simulated_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload (simulated GPU) | link (simulated) | mode | time / forward | "
             "vs bound | host CPU + blocked / forward | vs bound (same clock) | peak device | "
             "moved / forward | transfers waited on |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['link']:g} GB/s | {r['mode']} | "
                         f"failed: {r['error']} | | | | | | |")
            continue
        moved = f"{r['moved'] / 2**20:.1f} MiB" if "moved" in r else "-"
        waited = f"{r['waited']} of {r['transfers']}" if "transfers" in r else "-"
        lines.append(f"| {r['workload']} | {r['link']:g} GB/s | {r['mode']} | "
                     f"{r['time'] * 1e3:.1f} ms | {r['time'] / r['bound']:.2f}x | "
                     f"{r['host'] * 1e3:.1f} ms | {r['host'] / r['host_bound']:.2f}x | "
                     f"{r['peak'] / 2**20:.1f} MiB | {moved} | {waited} |")
    return "\n".join(lines)


def simulated_findings(rows: list[dict[str, Any]], fast: float) -> str:
    """The issue's criterion and the prefetch counts, read off the rows."""
    out = []
    for r in rows:
        if r["mode"] != "adaptmem page, prefetch=1":
            continue
        ratio = r["time"] / r["bound"]
        if r["link"] == fast:
            copy_s = r["moved"] / (r["link"] * 1e9)
            out.append(
                f"- {r['workload']}, {r['link']:g} GB/s (copies {copy_s * 1e3:.1f} ms per forward "
                f"against {r['resident'] * 1e3:.0f} ms of resident compute: a link faster than "
                f"compute): paged forward / max(resident compute, paged bytes / link) = "
                f"**{ratio:.2f}x** (criterion <= 1.15x: {'met' if ratio <= 1.15 else 'not met'}); "
                f"on the host thread's clock (CPU + blocked), "
                f"**{r['host'] / r['host_bound']:.2f}x**.")
            out.append("  " + _breakdown(r))
        else:
            out.append(f"- {r['workload']}, {r['link']:g} GB/s (slow link): paged forward / "
                       f"bound = {ratio:.2f}x.")
            out.append("  " + _breakdown(r))
        zero = next(z for z in rows if z["workload"] == r["workload"]
                    and z["link"] == r["link"] and z["mode"] == "adaptmem page, prefetch=0")
        out.append(f"  Transfers waited on (by the pager's events): prefetch=1 {r['waited']} of "
                   f"{r['transfers']} ({r['waited'] / max(1, r['transfers']):.0%}), prefetch=0 "
                   f"{zero['waited']} of {zero['transfers']}.")
    return "\n".join(out)


def _breakdown(r: dict[str, Any]) -> str:
    """Where the paged forward's time beyond the resident one went, on the host's clock."""
    _, cpu, copying, waiting = r["fastest"]
    resident = r["resident_fastest"][1] + r["resident_fastest"][3]
    hooks = cpu - r["resident_fastest"][1] - copying
    overlapped = (resident + waiting) / r["host_bound"]
    return (f"On the host's clock the paged forward took {(cpu + waiting) * 1e3:.1f} ms against "
            f"{resident * 1e3:.1f} ms resident: {copying * 1e3:.1f} ms moving the copies' bytes "
            f"(the simulation's memcpy; a GPU's copy engine spends no host time), "
            f"{hooks * 1e3:.1f} ms ({hooks / r['units'] * 1e6:.0f} us per unit) in the pager's "
            f"hooks with the simulation's cost of the ops they issue (two per tensor, events, "
            f"record_stream), {waiting * 1e3:.1f} ms blocked on copies not yet complete (the "
            f"schedule). Not the criterion, a reading of it: with the hooks' host work run "
            f"ahead of compute, as a host runs ahead of a GPU, the forward would take "
            f"resident + blocked = {overlapped:.2f}x the bound.")


def sim_op_cost() -> tuple[float, float]:
    """Seconds per ``a + b`` of 64x64 floats: on the simulated device, and on the CPU."""
    from adaptmem.testing import simulated_cuda

    def per_op(a: torch.Tensor) -> float:
        best = math.inf
        for _ in range(5):
            start = time.thread_time()
            for _ in range(400):
                a + a
            best = min(best, (time.thread_time() - start) / 400)
        return best

    host = torch.randn(64, 64)
    with simulated_cuda(), torch.no_grad():
        simulated = per_op(host.to("cuda"))
    return simulated, per_op(host)


SIM_NOTE = (
    "SIMULATED: every figure here comes from `adaptmem.testing.simulated_cuda`, not from a "
    "GPU. Compute runs on this machine's CPU (plus the simulation's own cost per op, given "
    "above, paid by every mode alike, the fully resident one included), so 'kernel' times "
    "are CPU times; host<->device copies take bytes / the simulated link bandwidth "
    "(asynchronous ones complete that long after they were issued while the host goes on; "
    "synchronous ones hold the host). "
    "What the simulation cannot show: GPU kernel speed, real bus behaviour (PCIe "
    "latency, contention between copy directions, pageable vs pinned rates). What it shows: "
    "how each engine schedules copies against compute, and how much device memory it "
    "holds. bound = max(fully resident time in the same run, bytes moved per forward / "
    "link). 'host CPU + blocked' times the same forwards on the host thread's own clock: its "
    "CPU time plus the time it slept waiting for copies. Nothing else runs in a simulated "
    "forward, so on an idle machine the two clocks agree; on a shared one, other processes "
    "stretch wall time (by the load average, here) but hardly the thread's CPU time, so that "
    "column is the load-independent reading of a fast link; on a slow one it comes out "
    "short (the link's time is wall time, and load stretches compute against it), so "
    "read slow links on the wall clock. for optimem and accelerate the bytes moved are taken as the weight bytes (what "
    "they move at least). adaptmem pages with `resident_bytes=0, device_budget=` a quarter "
    "of the weights. Times are the best of interleaved rounds (all modes of one link and "
    "workload take turns, so load from other processes hits them alike). 'transfers waited "
    "on' counts the prefetch misses the pager decided from its events: a transfer compute "
    "reached before the copy had completed. A 'failed' row is the rival's own error under the "
    "simulation, kept as a result; whether a real GPU fails the same way is not known here.")


# -- report --------------------------------------------------------------------------------------


CPU_NOTE = (
    "Overhead / unit = (paged - unpaged time per forward) / units. adaptmem makes real copies "
    "even on the CPU (two tiny ones per unit in the first workload, 16 MiB units in the "
    "second); optimem and accelerate move nothing there, because `.to('cpu')` of a CPU tensor "
    "is a no-op; their units are the leaf modules with weights. 'copies skipped' is the same "
    "pager handed the masters instead of copies: its hooks and bookkeeping alone, the figure "
    "the <= 20 us per-unit target is about; the gap to 'adaptmem page' is what the copies "
    "cost. 'empty hooks' is the floor any hook-based pager pays on this machine. Times are "
    "the best of interleaved rounds.")
GPU_PENDING = (
    "Pending: no GPU has run this yet. On a GPU the script measures ResNet-101 at 512x512 "
    "(batches 1-64) and a GPT-2-XL-shaped fp16 transformer against max(resident compute, "
    "paged bytes / pinned bandwidth), with optimem.page and accelerate.cpu_offload in the same "
    "run, and records them here with `--write`.")
GPU_TITLE = "Paging on a GPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and batches")
    parser.add_argument("--write", action="store_true",
                        help="update benchmarks/RESULTS.md ('Paging' for the CPU part, "
                             "'Paging on a GPU' for the GPU part)")
    parser.add_argument("--gpu-only", action="store_true",
                        help="skip the CPU part (its figures belong to the machine that "
                             "develops the pager, not to the GPU host)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--simulated", action="store_true",
                        help="also run the simulated-GPU part (adaptmem.testing.simulated_cuda; "
                             f"'{SIM_TITLE}' in RESULTS.md)")
    parser.add_argument("--simulated-only", action="store_true",
                        help="run only the simulated-GPU part")
    parser.add_argument("--bandwidth", type=float, default=25.0,
                        help="simulated link in GB/s, faster than compute (default 25)")
    parser.add_argument("--slow-bandwidth", type=float, default=0.05,
                        help="a second simulated link in GB/s, slower than compute "
                             "(default 0.05; 0 skips it)")
    parser.add_argument("--batches", default="1,4,16,64",
                        help="ResNet-101 batch sizes on a GPU (default 1,4,16,64)")
    parser.add_argument("--rivals", default="optimem,accelerate",
                        help="rivals on a GPU, comma-separated (default optimem,accelerate)")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if args.gpu_only and not gpu:
        parser.error("--gpu-only needs CUDA, and none is available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = ("python benchmarks/paging.py " + " ".join(sys.argv[1:])).strip()
    load = f"load average at start {os.getloadavg()[0]:.1f}\n" \
        if hasattr(os, "getloadavg") else ""
    if args.simulated or args.simulated_only:
        links = [args.bandwidth] + ([args.slow_bandwidth] if args.slow_bandwidth else [])
        rows = simulated_rows(args.quick, links)
        simulated_op, cpu_op = sim_op_cost()
        body = (header(command) + f"- {load}- Device: SIMULATED (simulated_cuda, links "
                + ", ".join(f"{b:g} GB/s" for b in links) + f"), torch threads "
                f"{torch.get_num_threads()}\n- The simulation's own cost per op, this run: "
                f"`a + b` on 64x64 floats takes {simulated_op * 1e6:.1f} us of host time on "
                f"the simulated device, {cpu_op * 1e6:.1f} us on the CPU\n\n"
                + simulated_table(rows) + "\n\n"
                + simulated_findings(rows, args.bandwidth) + "\n\n" + SIM_NOTE)
        print(f"## {SIM_TITLE}\n\n" + body)
        if args.write:
            write_section(SIM_TITLE, body)
        if args.simulated_only:
            return 0
    if not args.gpu_only:
        cpu = (header(command) + f"- {load}\n### CPU: the pager's own cost\n\n"
               + cpu_table(cpu_rows(args.quick)) + "\n\n" + CPU_NOTE
               + f"\n\nGPU figures: section '{GPU_TITLE}'.")
        print("## Paging\n\n" + cpu)
        if args.write:
            write_section("Paging", cpu)
    if gpu:
        body = (header(command) + "\nUnder a memory fraction holding 25% of the weights.\n\n"
                + gpu_table(gpu_rows(args.quick, tuple(int(b) for b in args.batches.split(",")),
                                     tuple(args.rivals.split(",")))))
        print(f"## {GPU_TITLE}\n\n" + body)
        if args.write:
            write_section(GPU_TITLE, body)
    elif args.write and f"## {GPU_TITLE}\n" not in (
            RESULTS.read_text() if RESULTS.exists() else ""):
        write_section(GPU_TITLE, GPU_PENDING)  # a CPU run never replaces GPU figures
    return 0


if __name__ == "__main__":
    sys.exit(main())
