"""Paging or chunking a partly resident model, on a simulated GPU: which engine ``model=``
chooses, and how it compares with each engine fixed by hand.

    python benchmarks/engines.py [--quick] [--write] [--threads 1]

A stack of Linear layers (8 MiB) on a simulated device of 12 MiB keeps about 5 MiB of its
weights resident; the rest is either paged over the link every forward
(``adaptive.page(model, "cuda", resident_bytes=R)``) or computed on the host
(``adaptive.chunk(model, "cuda", capacity=R)``), with R = half the device. Per link and
batch size (one forward per call), three configurations run in a fresh simulated device
each, interleaved over rounds: the two fixed engines and
``@adaptive.batch(initial_batchsize=batch, model=model, device="cuda")``, which pages at
its first call, times a chunked second call and keeps the cheaper engine (see [Note: paging
or chunking] in ``adaptmem/_dispatch/engine.py``). Reported: items/s of the steady calls
(after the settling ones, where ``model=`` chooses), the ratio of ``model=`` to the better
fixed engine, the engine chosen and the figures it chose by.

A second table: the first call of ``model=`` over 2048 items with ``initial_batchsize=
"auto"`` against a search from 2048, the model partly resident either way: whether "auto"
predicted (``decorated.prediction``), where it started, and the failed attempts each paid.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _report import header, markdown_table, write_section  # noqa: E402
from dispatch import LAYERS, WIDTH, build  # noqa: E402 (the dispatch benchmark's model)
from torch import nn  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem.testing import simulated_cuda  # noqa: E402

TITLE = "Paging or chunking under model= (simulated GPU)"
DEVICE_MEMORY = 12 << 20
RESIDENT = DEVICE_MEMORY // 2  # the fixed engines' resident bytes, as model= starts
SETTLE = 3  # calls before the timed ones: model= pages, times chunking, chooses
MiB = 1 << 20


Started = tuple[Callable[[], torch.Tensor], Any, Callable[[], None]]


@dataclass
class Config:
    name: str
    start: Callable[[nn.Module, torch.Tensor], Started]
    times: list[float] = field(default_factory=list)
    chosen: list[str] = field(default_factory=list)
    figures: list[dict[str, Any]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def fixed_page(model: nn.Module, data: torch.Tensor) -> Started:
    pager = adaptive.page(model, "cuda", resident_bytes=RESIDENT)
    return lambda: model(data), None, pager.remove


def fixed_chunk(model: nn.Module, data: torch.Tensor) -> Started:
    chunker = adaptive.chunk(model, "cuda", capacity=RESIDENT)
    return lambda: model(data), None, chunker.remove


def dispatched(model: nn.Module, data: torch.Tensor) -> Started:
    # A cache of its own: the default one is shared by every function decorated here.
    @adaptive.batch(initial_batchsize=len(data), model=model, device="cuda",
                    cache=adaptive.StacktraceMemoryBatchsizeCache())
    def infer(batchsize: int) -> torch.Tensor:
        return torch.cat([model(c) for c in data.split(batchsize)])

    return infer, infer, infer.remove


def run_once(cfg: Config, base: nn.Module, data: torch.Tensor, reference: torch.Tensor,
             link: float, timed_calls: int) -> None:
    model = copy.deepcopy(base)
    with simulated_cuda(total_memory=DEVICE_MEMORY, bandwidth=link), torch.no_grad():
        call, decorated, remove = cfg.start(model, data)
        try:
            best = float("inf")
            for i in range(SETTLE + timed_calls):  # one loop: one call site for the cache
                t = time.perf_counter()
                result = call()
                torch.cuda.synchronize()
                if i >= SETTLE:
                    best = min(best, time.perf_counter() - t)
            cfg.times.append(best)
            torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-5)
            if decorated is not None:
                placement = decorated.placement
                cfg.chosen.append(placement["engine"])
                cfg.figures.append(placement["engine_choice"] or {})
                cfg.sizes.append(decorated.stats.last_size)
        finally:
            remove()


def measure(link: float, batch: int, rounds: int, timed_calls: int) -> list[Config]:
    base = build()
    torch.manual_seed(1)
    data = torch.randn(batch, WIDTH)
    with torch.no_grad():
        reference = base(data)
    cfgs = [Config("page, fixed", fixed_page), Config("chunk, fixed", fixed_chunk),
            Config("model=", dispatched)]
    for _ in range(rounds):
        for cfg in cfgs:
            run_once(cfg, base, data, reference, link, timed_calls)
    print(f"link {link:g} GB/s, batch {batch}: done, load {os.getloadavg()[0]:.1f}",
          file=sys.stderr)
    return cfgs


def rows_for(link: float, batch: int, cfgs: list[Config]) -> list[list[object]]:
    rates = {c.name: batch / min(c.times) for c in cfgs}
    better = max(rates["page, fixed"], rates["chunk, fixed"])
    d = cfgs[2]
    figures = d.figures[-1]
    chosen = ", ".join(sorted(set(d.chosen)))
    by = ("-" if not figures else
          f"page {1e3 * figures['page_seconds_per_forward']:.2f} ms vs host "
          f"{1e3 * figures['chunk_seconds_per_forward']:.2f} ms per forward "
          f"(link measured {figures['link_bytes_per_second'] / 1e9:.3g} GB/s)")
    faster = "page" if rates["page, fixed"] >= rates["chunk, fixed"] else "chunk"
    return [[f"{link:g}", batch, f"{rates['page, fixed']:,.0f}", f"{rates['chunk, fixed']:,.0f}",
             faster, f"{rates['model=']:,.0f}", f"{rates['model='] / better:.2f}",
             ", ".join(str(n) for n in sorted(set(d.sizes))), chosen, by]]


NOTE = (
    "SIMULATED: figures from `adaptmem.testing.simulated_cuda`, not a GPU. Compute runs on "
    "this machine's CPU for the device and the host alike (plus the simulation's cost per "
    "op on the device's side), so the host is not slower than the 'device' here as it is "
    "beside a real GPU; host<->device copies take bytes / the simulated link. Each "
    "configuration runs per round in a fresh simulated device: {settle} settling calls, "
    "then {timed} timed calls of one forward each, the fastest counting; items/s is the best "
    "round; rounds interleave the configurations. 'model= / better fixed' divides by the "
    "faster of the two fixed engines. The fixed engines keep {resident} MiB resident as "
    "asked (the units that fit in it: 5.0 MiB of Linear layers here), the rest paged or on "
    "the host. The choice compares the paged bytes over the measured link with the host's "
    "measured compute of the non-resident units, and leaves out the device's own compute of "
    "those units, assuming it small (true beside a GPU, where the host is one to two orders "
    "of magnitude slower): on this simulation the 'device' computes no faster than the host "
    "and pays the simulation's cost per op, so where the link is fast the chunked model is "
    "faster here although paging is chosen, as it would be, rightly, beside a real GPU. "
    "Where the link is slow, the choice is the faster engine here too. The host time is one "
    "timed forward on a machine shared with other work: close calls can go either way from "
    "round to round ('engine chosen' lists every round's).")


AUTO_ITEMS = 2048


def decorated(model: nn.Module, data: torch.Tensor, initial: int | str) -> Any:
    @adaptive.batch(initial_batchsize=initial, model=model, device="cuda",
                    cache=adaptive.StacktraceMemoryBatchsizeCache())
    def infer(batchsize: int) -> torch.Tensor:
        return torch.cat([model(c) for c in data.split(batchsize)])

    return infer


def first_calls(rounds: int) -> str:
    """``initial_batchsize="auto"`` against a search from ``AUTO_ITEMS``: the first call."""
    base = build()
    torch.manual_seed(2)
    data = torch.randn(AUTO_ITEMS, WIDTH)
    with torch.no_grad():
        reference = base(data)
    rows: list[list[object]] = []
    for initial in ("auto", AUTO_ITEMS):
        failed, starts, predicted, resident = [], [], [], []
        for _ in range(rounds):
            model = copy.deepcopy(base)
            with simulated_cuda(total_memory=DEVICE_MEMORY, bandwidth=20), torch.no_grad():

                infer = decorated(model, data, initial)
                try:
                    torch.testing.assert_close(infer(), reference, rtol=1e-4, atol=1e-5)
                    failed.append(infer.stats.failed_attempts)
                    starts.append(infer.initial)
                    predicted.append(infer.prediction is not None)
                    placement = infer.placement
                    resident.append(f"{placement['resident_bytes'][0] / MiB:.1f} of "
                                    f"{placement['weight_bytes'][0] / MiB:.1f} MiB")
                finally:
                    infer.remove()
        rows.append([f"'{initial}'" if isinstance(initial, str) else initial,
                     ", ".join(sorted(set(resident))),
                     "yes" if all(predicted) else "no" if not any(predicted) else "some rounds",
                     ", ".join(str(n) for n in sorted(set(starts))),
                     ", ".join(str(n) for n in failed)])
    return markdown_table(["initial_batchsize", "resident", "predicted from a trace",
                           "first size tried", "failed attempts, first call (per round)"],
                          rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, two links")
    parser.add_argument("--write", action="store_true",
                        help=f"update benchmarks/RESULTS.md ('{TITLE}')")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--links", type=float, nargs="+", default=[0.01, 0.05, 0.2, 20.0],
                        help="simulated link bandwidths in GB/s (default 0.01 0.05 0.2 20)")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 512],
                        help="items per call, one forward each (default 32 512)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    links = [args.links[0], args.links[-1]] if args.quick else args.links
    rounds, timed_calls = (1, 2) if args.quick else (3, 3)
    command = ("python benchmarks/engines.py " + " ".join(sys.argv[1:])).strip()
    load_start = os.getloadavg()[0]
    rows: list[list[object]] = []
    for link in links:
        for batch in args.batches:
            rows += rows_for(link, batch, measure(link, batch, rounds, timed_calls))
    auto = first_calls(rounds)
    load_end = os.getloadavg()[0]
    body = (header(command)
            + f"- Load average: {load_start:.1f} at start, {load_end:.1f} at end (2 cores "
            f"shared)\n- Device: SIMULATED (simulated_cuda, {DEVICE_MEMORY / MiB:.0f} MiB), "
            f"torch threads {torch.get_num_threads()}\n- Workload: {LAYERS} x (Linear({WIDTH}, "
            f"{WIDTH}) + ReLU), 8.0 MiB fp32 weights, one forward of the batch per call\n\n"
            + markdown_table(["link GB/s", "batch", "page, fixed (items/s)",
                              "chunk, fixed (items/s)", "faster fixed", "model= (items/s)",
                              "model= / better fixed", "model= batch size", "engine chosen",
                              "chosen by (last round)"], rows)
            + "\n\n" + NOTE.format(settle=SETTLE, timed=timed_calls,
                                   resident=RESIDENT // MiB)
            + f"\n\nThe first call of `model=` over {AUTO_ITEMS} items (simulated, 20 GB/s "
            f"link, {rounds} round(s)), `initial_batchsize='auto'` against a search from "
            f"{AUTO_ITEMS}:\n\n" + auto)
    print(f"## {TITLE}\n\n" + body)
    if args.write:
        write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
