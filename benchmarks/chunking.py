"""Chunked placement: adaptmem chunk vs optimem.chunk vs all-CPU vs all-GPU (and page).

With CUDA: ResNet-101 at 512x512, batch 1..32, 25/50/75% of the weights resident on the GPU:
adaptmem chunk, optimem.chunk (its capacity is a parameter count; we give it the same share),
all on the CPU, all on the GPU, and adaptmem page at the same device memory when the pager
is there. Without CUDA: the dtype-boundary variant on the CPU (resident part bf16, the rest
fp32) against all-fp32 and all-bf16, which shows what boundary conversion costs; optimem.chunk
with device="cpu" measures its wrapper overhead only (it cannot change dtypes).

    python benchmarks/chunking.py                 # picks the variant the machine allows
    python benchmarks/chunking.py --cpu --image 64 --batches 1,4 --best --threads 1
    python benchmarks/chunking.py --simulated --threads 1 --write   # simulated GPU

--simulated runs on adaptmem.testing.simulated_cuda instead (any machine): chunk against page
at the same simulated device memory (ResNet-18, 128x128, batch 1 and 8 by default), with a
simulated link of --bandwidth GB/s; its figures are labelled simulated.

Prints a Markdown table: median of --reps timed runs after one warm-up (--best: the
fastest run, for machines shared with other work).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import header, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem._placement import Splitter
from adaptmem._placement.boundaries import BoundaryHooks
from adaptmem._planning import module_sizes

_BEST = False


def timed(fn: Callable[[], Any], reps: int, sync: Callable[[], None], best: bool = False
          ) -> float:
    with torch.no_grad():
        fn()
        sync()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
    # Best of N: on a shared machine the median measures the neighbours as much as the code.
    return min(times) if best or _BEST else statistics.median(times)


class ConversionClock:
    """Times adaptmem's boundary conversions (benchmark instrumentation only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = BoundaryHooks._convert

    def __enter__(self) -> ConversionClock:
        clock, original = self, self._original

        def convert(handle: BoundaryHooks, obj: Any, device: Any, dtype: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(handle, obj, device, dtype)
            finally:
                clock.seconds += time.perf_counter() - start

        BoundaryHooks._convert = convert  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        BoundaryHooks._convert = self._original  # type: ignore[method-assign]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).eval()


def row(config: str, batch: int, seconds: float, base: float | None, extra: str = "") -> str:
    vs = f"{seconds / base:.2f}x" if base else "1.00x"
    return f"| {config} | {batch} | {seconds * 1e3:.1f} | {vs} | {extra} |"


def cpu_variant(args: argparse.Namespace) -> list[str]:
    """Every configuration on its own copy of the model, timed round-robin so that a busy
    neighbour slows all of them alike; each keeps its fastest run (or median, see --best)."""
    import optimem

    lines = [
        "| configuration | batch | ms / forward | vs all-fp32 | boundary conversions per "
        "forward: count, MiB, ms (fastest) |",
        "|---|---|---|---|---|",
    ]
    model = build(args.model)
    total = module_sizes(model).total_bytes
    numel = sum(p.numel() for p in model.parameters())
    for batch in args.batches:
        x = torch.randn(batch, 3, args.image, args.image)
        configs: list[tuple[str, Callable[[], Any], Splitter | None]] = []
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        configs.append(("all fp32", lambda: model(x), None))  # noqa: B023
        configs.append(("all bf16", lambda: bf16(xb), None))  # noqa: B023
        hooked = copy.deepcopy(model)
        handle = adaptive.chunk(hooked, "cpu", capacity=0, example_inputs=x[:1])
        configs.append(("adaptmem hooks only (one placement, no conversion)",
                        lambda m=hooked: m(x), handle))  # noqa: B023
        for share in args.fractions:
            chunked = copy.deepcopy(model)
            handle = adaptive.chunk(chunked, "cpu", capacity=int(share * total / 2),
                                    dtype=torch.bfloat16, example_inputs=x[:1])
            configs.append((f"adaptmem chunk, {share:.0%} of weights resident in bf16",
                            lambda m=chunked, x=x: m(x), handle))
        for share in args.fractions:
            wrapped = copy.deepcopy(model)
            optimem.chunk(wrapped, device=torch.device("cpu"), max_capacity=share * numel)
            configs.append((f"optimem.chunk, {share:.0%} (device=cpu: its wrappers only, fp32)",
                            lambda m=wrapped: m(x), None))  # noqa: B023
        times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        convert: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        with torch.no_grad():
            for _name, fn, _ in configs:
                fn()  # warm-up
            for handle in [h for _, _, h in configs if h is not None]:
                handle.stats.reset()
            for _ in range(args.reps):
                for name, fn, _ in configs:
                    with ConversionClock() as clock:
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
                    convert[name].append(clock.seconds)
        pick = min if _BEST else statistics.median
        base = pick(times["all fp32"])
        for name, _, handle in configs:
            extra = ""
            if handle is not None:
                stats = handle.stats
                extra = (f"{stats.boundary_crossings / args.reps:.0f}, "
                         f"{stats.bytes_converted / args.reps / 2**20:.2f}, "
                         f"{min(convert[name]) * 1e3:.2f}")
                handle.remove()
            lines.append(row(name, batch, pick(times[name]), None if name == "all fp32" else base,
                             extra))
    return lines


def hook_cost(reps: int = 200) -> list[str]:
    """Per-call cost of adaptmem's boundary hooks where compute is negligible: 64 x
    Linear(16, 16), plain vs hooked (nothing to convert) vs hooked across 32 boundaries."""
    torch.manual_seed(0)
    layers = 64
    plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)]).eval()
    hooked, alternating = copy.deepcopy(plain), copy.deepcopy(plain)
    x = torch.randn(1, 16)
    one = adaptive.chunk(hooked, "cpu", capacity=0, example_inputs=x)
    # Every other layer in bf16: 64 boundaries, so each call converts its input.
    edited = {str(i): "cpu@bfloat16" if i % 2 == 0 else "cpu" for i in range(layers)}
    two = adaptive.split(alternating, device_map=edited, example_inputs=x)
    runs = {"plain": plain, "hooked, no conversion": hooked,
            "hooked, a dtype boundary at every layer": alternating}
    best = {name: float("inf") for name in runs}
    with torch.no_grad():
        for _ in range(reps):
            for name, m in runs.items():
                start = time.perf_counter()
                m(x)
                best[name] = min(best[name], time.perf_counter() - start)
    one.remove()
    two.remove()
    lines = ["| 64 x Linear(16,16), batch 1 | ms / forward (fastest of "
             f"{reps}) | overhead per layer call |", "|---|---|---|"]
    for name, seconds in best.items():
        per = (seconds - best["plain"]) / layers * 1e6
        lines.append(f"| {name} | {seconds * 1e3:.3f} | "
                     f"{'-' if name == 'plain' else f'{per:.1f} us'} |")
    return lines


def gpu_variant(args: argparse.Namespace) -> list[str]:
    try:
        import optimem
    except ImportError:  # pytorch-optimem is in the bench extra; its rows say it is missing
        optimem = None

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    lines = [
        "| configuration | batch | ms / forward | vs all-GPU | peak GPU MiB |",
        "|---|---|---|---|---|",
    ]
    total = module_sizes(build(args.model)).total_bytes

    def measure(label: str, model: nn.Module, x: torch.Tensor, base: float | None,
                batch: int) -> float:
        torch.cuda.reset_peak_memory_stats()
        seconds = timed(lambda: model(x), args.reps, sync)
        peak = torch.cuda.max_memory_allocated() / 2**20
        lines.append(row(label, batch, seconds, base, f"{peak:.0f}"))
        return seconds

    for batch in args.batches:
        x = torch.randn(batch, 3, args.image, args.image)
        model = build(args.model).to(dev)
        base = measure("all GPU", model, x.to(dev), None, batch)
        del model
        measure("all CPU", build(args.model), x, base, batch)
        for share in args.fractions:
            model = build(args.model)
            with adaptive.chunk(model, dev, capacity=int(share * total), example_inputs=x[:1]):
                measure(f"adaptmem chunk, {share:.0%} resident", model, x.to(dev), base, batch)
            del model
            model = build(args.model)
            numel = sum(p.numel() for p in model.parameters())
            try:
                if optimem is None:
                    raise ImportError("pytorch-optimem is not installed")
                optimem.chunk(model, device=dev, max_capacity=share * numel)
                measure(f"optimem.chunk, {share:.0%}", model, x, base, batch)
            except Exception as exc:  # noqa: BLE001 - record how the alternative fails
                lines.append(f"| optimem.chunk, {share:.0%} | {batch} | failed: "
                             f"{type(exc).__name__}: {str(exc)[:80]} | | |")
            del model
            page = getattr(adaptive, "page", None)
            if page is not None:
                model = build(args.model)
                try:
                    with page(model, dev, device_budget=int(share * total)):
                        measure(f"adaptmem page, {share:.0%} device budget", model, x.to(dev),
                                base, batch)
                except Exception as exc:  # noqa: BLE001 - the pager is built in parallel
                    lines.append(f"| adaptmem page, {share:.0%} | {batch} | failed: "
                                 f"{type(exc).__name__}: {exc} | | |")
                del model
            torch.cuda.empty_cache()
    return lines


SIM_TITLE = "Chunking on a simulated GPU"
SIM_NOTE = (
    "SIMULATED: these figures come from `adaptmem.testing.simulated_cuda`, not from a GPU. "
    "The simulated device computes on this machine's CPU, at the CPU's speed (plus the "
    "simulation's own cost of roughly 0.2-0.4 ms per op), so the part a chunk leaves on the "
    "CPU runs exactly as fast as the part on the 'GPU': what the simulation cannot show is "
    "the gap in kernel speed that decides chunk against page on real hardware, nor real bus "
    "behaviour. What it does show, in the same run and at the same device memory (chunk's "
    "`capacity` = page's `device_budget` = the share of the weights given): the bytes each "
    "moves per forward over the simulated link, the device memory each holds at its peak "
    "(its weights kept on the device plus what its forward adds; 'all CPU' holds none), "
    "and what its hooks and copies add to a forward. Every configuration runs on its own "
    "copy of the model, round-robin, fastest run kept (the machine is shared).")


def simulated_variant(args: argparse.Namespace) -> list[str]:
    """Chunk against page at the same simulated device memory, with all-GPU and all-CPU."""
    from adaptmem.testing import simulated_cuda

    lines = [
        "| configuration (simulated GPU) | batch | ms / forward | vs all-GPU | device MiB at peak "
        "| moved host<->device / forward MiB |",
        "|---|---|---|---|---|---|",
    ]
    model = build(args.model)
    total = module_sizes(model).total_bytes
    with simulated_cuda(total_memory="4GiB", bandwidth=args.bandwidth), torch.no_grad():
        dev = torch.device("cuda")
        for batch in args.batches:
            x_host = torch.randn(batch, 3, args.image, args.image)
            x = x_host.to(dev)
            configs: list[tuple[str, Callable[[], Any], Any]] = []
            held: dict[str, int] = {}  # device bytes each configuration keeps between calls

            def add(name: str, setup: Callable[[], tuple[Callable[[], Any], Any]],
                    configs: list[tuple[str, Callable[[], Any], Any]] = configs,
                    held: dict[str, int] = held) -> None:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                fn, handle = setup()
                fn()  # warm-up (the pager learns here)
                torch.cuda.synchronize()
                held[name] = torch.cuda.memory_allocated() - before
                configs.append((name, fn, handle))

            def resident(x: torch.Tensor = x) -> tuple[Callable[[], Any], Any]:
                m = copy.deepcopy(model).to(dev)
                return (lambda: m(x)), None

            def chunk(share: float, x: torch.Tensor = x) -> tuple[Callable[[], Any], Any]:
                m = copy.deepcopy(model)
                handle = adaptive.chunk(m, dev, capacity=int(share * total),
                                        example_inputs=x_host[:1])  # noqa: B023
                return (lambda: m(x)), handle

            def page(share: float, x: torch.Tensor = x) -> tuple[Callable[[], Any], Any]:
                m = copy.deepcopy(model)
                handle = adaptive.page(m, dev, device_budget=int(share * total))
                return (lambda: m(x)), handle

            add("all GPU", resident)
            add("all CPU", lambda x=x_host: ((lambda: model(x)), None))
            for share in args.fractions:
                add(f"adaptmem chunk, {share:.0%} of weights resident",
                    lambda share=share: chunk(share))
                add(f"adaptmem page, {share:.0%} device budget",
                    lambda share=share: page(share))
            peaks: dict[str, float] = {}
            moved: dict[str, str] = {}
            for name, fn, handle in configs:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if handle is not None:
                    handle.stats.reset()
                fn()
                torch.cuda.synchronize()
                # its own weights on the device, plus what its forward added at the peak
                peaks[name] = (held[name] + torch.cuda.max_memory_allocated() - before) / 2**20
                stats = handle.stats if handle is not None else None
                if stats is not None and hasattr(stats, "bytes_moved"):
                    moved[name] = f"{stats.bytes_moved / 2**20:.1f}"
                elif stats is not None:  # a chunk moves activations across its boundary
                    moved[name] = f"{stats.bytes_converted / 2**20:.2f} (activations)"
                else:
                    moved[name] = "0" if name == "all GPU" else "-"
            times: dict[str, float] = {name: float("inf") for name, _, _ in configs}
            for _ in range(args.reps):
                for name, fn, _ in configs:
                    start = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    times[name] = min(times[name], time.perf_counter() - start)
            base = times["all GPU"]
            for name, _, handle in configs:
                lines.append(f"| {name} | {batch} | {times[name] * 1e3:.1f} | "
                             f"{times[name] / base:.2f}x | {peaks[name]:.1f} | {moved[name]} |")
                if handle is not None:
                    handle.remove()
            del x
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="torchvision model (default resnet101; resnet18 with --simulated)")
    parser.add_argument("--cpu", action="store_true", help="run the dtype-boundary variant")
    parser.add_argument("--image", type=int, default=None, help="default 512 GPU, 64 CPU")
    parser.add_argument("--batches", default=None, help="default 1,2,4,8,16,32 GPU; 1,4 CPU")
    parser.add_argument("--fractions", default="0.25,0.5,0.75")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--best", action="store_true", help="report the fastest run, not the median")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (one is steadier on a machine shared with other work)")
    parser.add_argument("--write", action="store_true",
                        help="record the GPU variant as 'Chunking on a GPU' in RESULTS.md "
                             f"(with --simulated: '{SIM_TITLE}')")
    parser.add_argument("--simulated", "--simulated-only", dest="simulated", action="store_true",
                        help="only the simulated-GPU variant (adaptmem.testing.simulated_cuda): "
                             "chunk against page at the same simulated device memory")
    parser.add_argument("--bandwidth", type=float, default=25.0,
                        help="simulated host<->device link in GB/s (default 25)")
    args = parser.parse_args()
    if args.simulated:
        args.model = args.model or "resnet18"
        args.image = args.image or 128
        args.batches = [int(b) for b in (args.batches or "1,8").split(",")]
        args.fractions = [float(f) for f in args.fractions.split(",")]
        if args.threads:
            torch.set_num_threads(args.threads)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines = simulated_variant(args)
        title = (f"{args.model}, {args.image}x{args.image}, best of {args.reps} runs; SIMULATED "
                 f"GPU (simulated_cuda, link {args.bandwidth:g} GB/s) on "
                 f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                 f"threads, load average at start {load:.1f}, torch {torch.__version__}, "
                 f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
        print(title)
        print("\n".join(lines))
        if args.write:
            command = "python benchmarks/chunking.py " + " ".join(sys.argv[1:])
            write_section(SIM_TITLE, header(command.strip()) + "\n" + title + "\n\n"
                          + "\n".join(lines) + "\n\n" + SIM_NOTE)
        return
    args.model = args.model or "resnet101"
    gpu = torch.cuda.is_available() and not args.cpu
    if args.write and not gpu:
        parser.error("--write records the GPU variant, and no GPU is in use; the CPU figures "
                     "in RESULTS.md are kept with their notes by hand")
    args.image = args.image or (512 if gpu else 64)
    args.batches = [int(b) for b in (args.batches or ("1,2,4,8,16,32" if gpu else "1,4"))
                    .split(",")]
    args.fractions = [float(f) for f in args.fractions.split(",")]
    global _BEST
    _BEST = args.best
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = gpu_variant(args) if gpu else cpu_variant(args)
    lines += ["", *hook_cost()]
    device = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
    how = "best" if args.best else "median"
    title = (f"{args.model}, {args.image}x{args.image}, {how} of {args.reps} runs; {device}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(title)
    print("\n".join(lines))
    if args.write:
        command = "python benchmarks/chunking.py " + " ".join(sys.argv[1:])
        write_section("Chunking on a GPU", header(command.strip()) + "\n" + title + "\n\n"
                      + "\n".join(lines))


if __name__ == "__main__":
    main()
