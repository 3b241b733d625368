"""Chunked placement: adaptmem chunk vs optimem.chunk vs all-CPU vs all-GPU (and page).

With CUDA: ResNet-101 at 512x512, batch 1..32, 25/50/75% of the weights resident on the GPU:
adaptmem chunk, optimem.chunk (its capacity is a parameter count; we give it the same share),
all on the CPU, all on the GPU, and adaptmem page at the same device memory when the pager
is there. Without CUDA: the dtype-boundary variant on the CPU (resident part bf16, the rest
fp32) against all-fp32 and all-bf16, which shows what boundary conversion costs; optimem.chunk
with device="cpu" measures its wrapper overhead only (it cannot change dtypes).

    python benchmarks/chunking.py                 # picks the variant the machine allows
    python benchmarks/chunking.py --cpu --image 64 --batches 1,4 --best --threads 1

Prints a Markdown table: median of --reps timed runs after one warm-up (--best: the
fastest run, for machines shared with other work).
"""

from __future__ import annotations

import argparse
import copy
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
from adaptmem._planner import module_sizes

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
        self._original = Splitter._convert

    def __enter__(self) -> ConversionClock:
        clock, original = self, self._original

        def convert(handle: Splitter, obj: Any, device: Any, dtype: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(handle, obj, device, dtype)
            finally:
                clock.seconds += time.perf_counter() - start

        Splitter._convert = convert  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        Splitter._convert = self._original  # type: ignore[method-assign]


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
                            lambda m=chunked: m(x), handle))  # noqa: B023
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--cpu", action="store_true", help="run the dtype-boundary variant")
    parser.add_argument("--image", type=int, default=None, help="default 512 GPU, 64 CPU")
    parser.add_argument("--batches", default=None, help="default 1,2,4,8,16,32 GPU; 1,4 CPU")
    parser.add_argument("--fractions", default="0.25,0.5,0.75")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--best", action="store_true", help="report the fastest run, not the median")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (one is steadier on a machine shared with other work)")
    parser.add_argument("--write", action="store_true",
                        help="record the GPU variant as 'Chunking on a GPU' in RESULTS.md")
    args = parser.parse_args()
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
