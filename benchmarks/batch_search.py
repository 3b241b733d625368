"""How fast each batch-size search finds the largest size that fits, and what it costs.

    python benchmarks/batch_search.py [--write]

For memory ceilings from 3 to 5,000 items and initial sizes up to 8,192, a function that
fails above the ceiling (with CUDA's real out-of-memory error) is called 20 times from one
call site through adaptmem's ``adaptive.batch``, toma's ``toma.batch`` and accelerate's
``find_executable_batch_size``. Reported: failed attempts in all, and the size in use divided
by the best possible (min(ceiling, initial)) after 1, 5 and 20 calls.
Target (issue 2): adaptmem >= 0.9 of the ceiling within 20 calls, with fewer total failures
than accelerate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import header, markdown_table, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402
from adaptmem.testing import MemoryCeiling  # noqa: E402

CEILINGS = [3, 10, 37, 100, 255, 511, 1000, 2047, 5000]
INITIALS = [64, 512, 8192]
CALLS = 20
CHECKPOINTS = (1, 5, 20)


def make_adaptmem(initial: int, ceiling: MemoryCeiling) -> Callable[[], int]:
    @adaptive.batch(initial_batchsize=initial, cache=adaptive.StacktraceMemoryBatchsizeCache())
    def work(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    return work


def make_toma(initial: int, ceiling: MemoryCeiling) -> Callable[[], int]:
    from toma import toma

    @toma.batch(initial_batchsize=initial)
    def work(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    return work


def make_accelerate(initial: int, ceiling: MemoryCeiling) -> Callable[[], int]:
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=initial)
    def work(batch_size: int) -> int:
        ceiling.require(batch_size)
        return batch_size

    return work


METHODS = {"adaptmem": make_adaptmem, "toma": make_toma, "accelerate": make_accelerate}


def run(method: str, initial: int, capacity: int) -> tuple[list[float], int, float]:
    ceiling = MemoryCeiling(capacity)
    work = METHODS[method](initial, ceiling)
    best = min(capacity, initial)
    ratios = []
    start = time.perf_counter()
    for call in range(1, CALLS + 1):
        try:
            used = work()
        except RuntimeError:  # gave up (accelerate reaches 0 below some ceilings)
            used = 0
        if call in CHECKPOINTS:
            ratios.append(used / best)
    return ratios, len(ceiling.failures), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    available = []
    for method in METHODS:
        try:
            run(method, 4, 2)
            available.append(method)
        except ImportError:
            print(f"{method} is not installed (pip install -e '.[bench]'); skipped", file=sys.stderr)

    rows = []
    summary = {}
    for method in available:
        per_checkpoint: list[list[float]] = [[] for _ in CHECKPOINTS]
        failures = 0
        seconds = 0.0
        for initial in INITIALS:
            for capacity in CEILINGS:
                ratios, failed, took = run(method, initial, capacity)
                failures += failed
                seconds += took
                for i, r in enumerate(ratios):
                    per_checkpoint[i].append(r)
        cells = [f"{statistics.mean(v):.2f} (min {min(v):.2f})" for v in per_checkpoint]
        pairs = len(INITIALS) * len(CEILINGS)
        rows.append([method, *cells, failures, f"{seconds / (pairs * CALLS) * 1e3:.2f}"])
        summary[method] = (min(per_checkpoint[-1]), failures)
    table = markdown_table(
        ["method", "size/best after 1 call", "after 5", "after 20", "failed attempts (all)",
         "ms per call (incl. failures)"],
        rows,
    )
    notes = [
        f"{len(INITIALS) * len(CEILINGS)} (initial, ceiling) pairs: initial in {INITIALS}, "
        f"ceiling in {CEILINGS}; {CALLS} calls each from one call site. 'best' is "
        "min(ceiling, initial); cells are the mean over pairs with the worst pair in brackets.",
    ]
    if "adaptmem" in summary:
        worst, failures = summary["adaptmem"]
        met = worst >= 0.9 and ("accelerate" not in summary or failures < summary["accelerate"][1])
        notes.append(
            f"Target (>= 0.9 of the ceiling within 20 calls for every pair, fewer failures than "
            f"accelerate): {'met' if met else 'NOT met'}."
        )
    print(table)
    print("\n".join(notes))
    if args.write:
        write_section(
            "Batch-size search",
            header("python benchmarks/batch_search.py --write") + "\n" + table + "\n"
            + "\n".join(notes),
        )


if __name__ == "__main__":
    main()
