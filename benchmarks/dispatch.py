"""Batch size and placement together, on a simulated GPU: how ``model=`` compares.

    python benchmarks/dispatch.py [--quick] [--write] [--threads 1]

A stack of Linear layers whose weights plus a large batch do not fit a simulated device
(``adaptmem.testing.simulated_cuda(total_memory=..., bandwidth=...)``) runs one inference
function over a fixed dataset, ``torch.cat([model(c) for c in data.split(batchsize)])``
under ``no_grad``, configured four ways:

(a) a grid of hand-tuned fixed configurations, batch size x resident bytes
    (``adaptive.page(model, "cuda", resident_bytes=R)`` and a plain loop; a configuration
    that runs out of memory is recorded as such); the best cell is the reference;
(b) batch search alone with the model fully paged: ``adaptive.page(model, "cuda",
    resident_bytes=0)`` and ``@adaptive.batch(initial_batchsize=large)``;
(c) ``@adaptive.batch(initial_batchsize=large, model=model, device="cuda")``, and with
    ``--auto`` the same with ``initial_batchsize="auto"``.

Each configuration runs afresh in its own simulated device per round (the same memory for
all), a few calls to settle, then timed steady-state calls; rounds are interleaved so load
from other processes hits every configuration alike. Reported: items/s (best round), the
ratio to the best grid cell, failed attempts of the settling and the timed calls
(``decorated.stats``), and for (c) the placement it chose (``decorated.placement``). Links (``--links``, GB/s):
0.05 and 0.2, where weight transfers dominate, and 20, where compute dominates.
Target (issue 14): (c) >= 0.9 of the best hand-tuned throughput, with fewer failed
attempts than (b).
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
from torch import nn  # noqa: E402

from adaptmem import OutOfMemoryError, adaptive  # noqa: E402
from adaptmem.testing import simulated_cuda  # noqa: E402

TITLE = "Batch size and placement together (simulated GPU)"
WIDTH = 512
LAYERS = 8
ITEMS = 2048
DEVICE_MEMORY = 12 << 20  # weights 8 MiB: they fit, but not with a large batch
LARGE = 2048  # the initial size of the searches: all items at once, which does not fit
BATCHES = [128, 256, 512, 1024]
SETTLE = 24  # calls before the timed ones (the searches learn and model= explores there)
SETTLE_AUTO = 4  # for 'auto', whose prediction counts host outputs (see the note below)
MiB = 1 << 20


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers).eval()


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, OutOfMemoryError))


Started = tuple[Callable[[], torch.Tensor], Any, Callable[[], None]]


@dataclass
class Config:
    """One configuration: ``start(model, data)`` sets it up inside the simulated device and
    returns the call to time, the decorated function (None for a fixed one) and what gives
    the model back."""

    group: str
    name: str
    start: Callable[[nn.Module, torch.Tensor], Started]
    times: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    sizes: list[str] = field(default_factory=list)
    placement: list[str] = field(default_factory=list)
    steady_failed: list[int] = field(default_factory=list)
    paged: list[int] = field(default_factory=list)  # weight bytes left paged, (c)
    traced: list[bool] = field(default_factory=list)  # 'auto' predicted from a trace, (c)
    engines: list[str] = field(default_factory=list)  # the engine it ended on, (c)
    settle: int = SETTLE
    error: str | None = None


def fixed(batchsize: int, resident: int) -> Callable[..., Any]:
    def start(model: nn.Module, data: torch.Tensor) -> Started:
        pager = adaptive.page(model, "cuda", resident_bytes=resident)

        def call() -> torch.Tensor:
            return torch.cat([model(c) for c in data.split(batchsize)])

        return call, None, pager.remove

    return start


def batch_search_paged(initial: int) -> Callable[..., Any]:
    def start(model: nn.Module, data: torch.Tensor) -> Started:
        pager = adaptive.page(model, "cuda", resident_bytes=0)

        @adaptive.batch(initial_batchsize=initial, cache=adaptive.StacktraceMemoryBatchsizeCache())
        def infer(batchsize: int) -> torch.Tensor:
            return torch.cat([model(c) for c in data.split(batchsize)])

        return infer, infer, pager.remove

    return start


def dispatched(initial: int | str) -> Callable[..., Any]:
    def start(model: nn.Module, data: torch.Tensor) -> Started:
        @adaptive.batch(initial_batchsize=initial, model=model, device="cuda",
                        cache=adaptive.StacktraceMemoryBatchsizeCache())
        def infer(batchsize: int) -> torch.Tensor:
            return torch.cat([model(c) for c in data.split(batchsize)])

        return infer, infer, infer.remove

    return start


def configs(weights: int, auto: bool) -> list[Config]:
    out = []
    residents = [0, weights // 2, weights]
    for b in BATCHES:
        for r in residents:
            out.append(Config("(a) fixed", f"batch {b}, resident {r / MiB:.1f} MiB",
                              fixed(b, r)))
    out.append(Config("(b) batch search, fully paged", f"initial {LARGE}",
                      batch_search_paged(LARGE)))
    out.append(Config("(c) model=", f"initial {LARGE}", dispatched(LARGE)))
    if auto:
        out.append(Config("(c) model=", "initial 'auto'", dispatched("auto"),
                          settle=SETTLE_AUTO))
    return out


def run_once(cfg: Config, base: nn.Module, data: torch.Tensor, reference: torch.Tensor,
             link: float, timed_calls: int) -> None:
    """One round of one configuration, in a fresh simulated device."""
    model = copy.deepcopy(base)
    with simulated_cuda(total_memory=DEVICE_MEMORY, bandwidth=link), torch.no_grad():
        call, decorated, remove = cfg.start(model, data)
        try:
            # One loop, one call site: the searches' cache tells call sites apart by their
            # stack, so settling calls made from another line would not teach the timed ones.
            settle = cfg.settle if decorated is not None else 1
            best = float("inf")
            for i in range(settle + timed_calls):
                if i == settle and decorated is not None:
                    s = decorated.stats
                    cfg.failed.append(s.failed_attempts)
                    cfg.attempts.append(s.attempts)
                    if hasattr(decorated, "placement"):
                        p = decorated.placement
                        cfg.paged.append(p["weight_bytes"][0] - p["resident_bytes"][0])
                        cfg.traced.append(decorated.prediction is not None)
                        cfg.engines.append(p["engine"])
                        cfg.placement.append(
                            f"{p['engine']}, {p['resident_bytes'][0] / MiB:.1f} of "
                            f"{p['weight_bytes'][0] / MiB:.1f} MiB resident, given back "
                            f"{p['residency_given_back']}x, explored "
                            f"{p['residency_explored']}x")
                torch.cuda.synchronize()
                t = time.perf_counter()
                result = call()
                torch.cuda.synchronize()
                if i >= settle:
                    best = min(best, time.perf_counter() - t)
            cfg.times.append(best)
            # Whatever the configuration, the outputs are those of the unplaced model.
            torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-5)
            if decorated is not None:
                cfg.sizes.append(str(decorated.stats.last_size))
                cfg.steady_failed.append(decorated.stats.failed_attempts - cfg.failed[-1])
        except Exception as exc:
            if not is_oom(exc):
                raise
            cfg.error = "out of memory"
        finally:
            remove()


def measure(link: float, rounds: int, timed_calls: int, auto: bool
            ) -> tuple[list[Config], int]:
    base = build()
    weights = weight_bytes(base)
    torch.manual_seed(1)
    data = torch.randn(ITEMS, WIDTH)
    with torch.no_grad():
        reference = base(data)
    cfgs = configs(weights, auto)
    for r in range(rounds):
        for cfg in cfgs:
            if cfg.error is None:
                run_once(cfg, base, data, reference, link, timed_calls)
        print(f"link {link:g} GB/s: round {r + 1}/{rounds} done, load "
              f"{os.getloadavg()[0]:.1f}", file=sys.stderr)
    return cfgs, weights


def _spread(values: list[int]) -> str:
    """One count, or the range over rounds when they differ."""
    if not values:
        return "-"
    return str(values[0]) if len(set(values)) == 1 else f"{min(values)}-{max(values)}"


def table(link: float, cfgs: list[Config], timed_calls: int) -> tuple[str, list[str]]:
    grid = [c for c in cfgs if c.group.startswith("(a)") and c.error is None]
    best_grid = max(grid, key=lambda c: ITEMS / min(c.times))
    best_rate = ITEMS / min(best_grid.times)
    rows: list[list[object]] = []
    notes = []
    for c in cfgs:
        if c.error is not None:
            rows.append([c.group, c.name, c.error, "-", "-", "-", "-", "-"])
            continue
        rate = ITEMS / min(c.times)
        mark = " (best)" if c is best_grid else ""
        failed, steady = (_spread(c.failed), _spread(c.steady_failed))
        sizes = "-" if not c.sizes else ", ".join(sorted(set(c.sizes), key=int))
        placement = "; ".join(sorted(set(c.placement))) or "-"
        rows.append([c.group, c.name + mark, f"{rate:,.0f}", f"{rate / best_rate:.2f}",
                     failed, steady, sizes, placement])
    b = next(c for c in cfgs if c.group.startswith("(b)"))
    for c in cfgs:
        if not c.group.startswith("(c)") or c.error is not None:
            continue
        ratio = ITEMS / min(c.times) / best_rate
        total = [f + t for f, t in zip(c.failed, c.steady_failed, strict=True)]
        b_total = [f + t for f, t in zip(b.failed, b.steady_failed, strict=True)]
        fewer = b.error is None and max(total) < min(b_total)
        no_more = b.error is None and max(total) <= min(b_total)
        met = ratio >= 0.9 and fewer
        batches = -(-ITEMS // int(c.sizes[-1]))
        moved = max(c.paged) * batches
        notes.append(f"{link:g} GB/s, (c) {c.name}: {ratio:.2f} of the best grid cell "
                     f"({best_grid.name}), failed attempts {_spread(total)} over all "
                     f"{c.settle + timed_calls} calls against {_spread(b_total)} for (b) over "
                     f"{b.settle + timed_calls}: "
                     f"{'fewer' if fewer else 'no more' if no_more else 'MORE'}; target "
                     f"(>= 0.9 and fewer) {'met' if met else 'NOT met'}. It leaves "
                     f"{max(c.paged) / MiB:.1f} MiB of weights off the device"
                     + (f", paged: {moved / MiB:.1f} MiB moved per call ({batches} "
                        f"batches), {moved / (link * 1e9) * 1e3:.0f} ms at this link"
                        if "chunk" not in c.engines else
                        f" ({'in every round' if set(c.engines) == {'chunk'} else 'in some rounds'}"
                        f" chunked: computed on the host, activations cross the link)")
                     + ("" if c.name != "initial 'auto'" else
                        "; 'auto' predicted from a trace" if all(c.traced) else
                        "; 'auto' could not trace the function (prediction None) and "
                        "searched from max_batchsize") + ".")
    text = markdown_table(
        ["configuration", "setting", "items/s", "vs best grid cell",
         "failed attempts (settling calls)", "failed attempts (timed calls)",
         "batch size in use", "placement chosen"],
        rows)
    return f"### Link {link:g} GB/s (simulated)\n\n" + text, notes


NOTE = (
    "SIMULATED: figures from `adaptmem.testing.simulated_cuda`, not a GPU. Compute runs on "
    "this machine's CPU (plus the simulation's cost per op); host<->device copies take bytes "
    "/ the simulated link. Each configuration runs, per round, in a fresh simulated device of "
    "the same size: {settle} calls to settle (the searches learn and `model=` explores "
    "there), then {timed} timed calls over the whole dataset (outputs "
    "checked against the unplaced model on the CPU) of which the fastest counts; items/s is "
    "the best round. Failed attempts come from `decorated.stats`, counted over the settling "
    "and the timed calls; the verdict compares their sum with (b)'s over the same number of "
    "calls. Rounds interleave all configurations of a link, so machine load hits them alike. "
    "'batch size in use' is `stats.last_size` after the timed calls. '(a) fixed' pages the "
    "model with `adaptive.page(model, 'cuda', resident_bytes=R)` (inputs moved to the device, "
    "outputs back, as with `model=`) and loops at a fixed batch size; a cell that runs out of "
    "memory is marked so. '(b)' is the plain decorator over a fully paged model; '(c)' is "
    "`model=`, which at its first call pages the model with min(weights, half the free "
    "memory) resident and starts at the size a trace of the function predicts fits next to "
    "them ([Note: predicting the first size]), then measures items per second and tries "
    "twice (else half) the resident bytes, keeping what is faster ([Note: exploring "
    "residency]).{auto_note}")

AUTO_NOTE = (
    " (c) with `initial_batchsize='auto'` runs only with `--auto`: with `model=` its trace "
    "counts the outputs the pager brings back to the host as device memory (the fixed bytes "
    "of its prediction include the whole output), so it starts near batch size 1, and at "
    "slow links each of its calls takes minutes; it is given {settle_auto} settling calls.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, one link")
    parser.add_argument("--write", action="store_true",
                        help=f"update benchmarks/RESULTS.md ('{TITLE}')")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--links", type=float, nargs="+", default=[0.05, 0.2, 20.0],
                        help="simulated link bandwidths in GB/s (default 0.05 0.2 20)")
    parser.add_argument("--auto", action="store_true",
                        help="also run initial_batchsize='auto' with model= (slow: see the "
                             "note in RESULTS.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    links = args.links[:1] if args.quick else args.links
    rounds, timed_calls = (1, 2) if args.quick else (3, 3)
    command = ("python benchmarks/dispatch.py " + " ".join(sys.argv[1:])).strip()
    load_start = os.getloadavg()[0]
    parts = []
    findings = []
    weights = 0
    for link in links:
        cfgs, weights = measure(link, rounds, timed_calls, args.auto)
        text, notes = table(link, cfgs, timed_calls)
        parts.append(text)
        findings += notes
    load_end = os.getloadavg()[0]
    auto_note = (AUTO_NOTE.format(settle_auto=SETTLE_AUTO) if args.auto else
                 " (c) with `initial_batchsize='auto'` was not run this time (`--auto`).")
    body = (header(command)
            + f"- Load average: {load_start:.1f} at start, {load_end:.1f} at end (2 cores "
            f"shared)\n- Device: SIMULATED (simulated_cuda, {DEVICE_MEMORY / MiB:.0f} MiB, "
            f"links {', '.join(f'{b:g} GB/s' for b in links)}), torch threads "
            f"{torch.get_num_threads()}\n- Workload: {LAYERS} x (Linear({WIDTH}, {WIDTH}) + "
            f"ReLU), {weights / MiB:.1f} MiB fp32 weights, {ITEMS} items of {WIDTH} floats "
            f"per call; searches start at {LARGE}\n\n"
            + "\n\n".join(parts) + "\n\n" + "\n".join(f"- {n}" for n in findings) + "\n\n"
            + NOTE.format(settle=SETTLE, timed=timed_calls, auto_note=auto_note))
    print(f"## {TITLE}\n\n" + body)
    if args.write:
        write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
