"""Per-call time the decorators add on the success path, against a plain call and toma.

    python benchmarks/overhead.py [--write]

Target (issue 2): <= 5 microseconds per call for the default cache on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _report import header, markdown_table, write_section  # noqa: E402

from adaptmem import adaptive  # noqa: E402


def body(batchsize: int, x: int) -> int:
    return batchsize + x


def per_call(fn: Callable[[], object], calls: int, repeats: int = 7) -> float:
    """Median seconds per call over ``repeats`` timed loops of ``calls`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    native = per_call(lambda: body(32, 1), 200_000)
    rows = []
    variants: list[tuple[str, Callable[[], object], int]] = []
    for label, cache in (
        ("adaptmem, StacktraceMemoryBatchsizeCache (default)", None),
        ("adaptmem, GlobalBatchsizeCache", adaptive.GlobalBatchsizeCache),
        ("adaptmem, NoBatchsizeCache", adaptive.NoBatchsizeCache),
    ):
        decorated = adaptive.batch(initial_batchsize=32, cache=cache)(body)
        variants.append((label, lambda d=decorated: d(1), 100_000))
    try:
        from toma import toma

        decorated_toma = toma.batch(initial_batchsize=32)(body)
        variants.append(("toma 1.1, default cache", lambda: decorated_toma(1), 20))
    except ImportError:
        print("toma is not installed (pip install -e '.[bench]'); skipping it", file=sys.stderr)
    try:
        from accelerate.utils import find_executable_batch_size

        decorated_acc = find_executable_batch_size(starting_batch_size=32)(body)
        variants.append(("accelerate find_executable_batch_size", lambda: decorated_acc(1), 200))
    except ImportError:
        print("accelerate is not installed; skipping it", file=sys.stderr)

    for label, fn, calls in variants:
        fn()  # warm the cache
        added = per_call(fn, calls, repeats=5 if calls < 100 else 7) - native
        rows.append([label, f"{added * 1e6:,.2f}", f"{added / native:,.0f}x"])
    default_us = float(rows[0][1].replace(",", ""))
    table = markdown_table(["variant", "added per call (us)", "vs a native call"], rows)
    verdict = (
        f"Native call: {native * 1e9:.0f} ns. Target <= 5 us for the default cache: "
        f"{'met' if default_us <= 5 else 'NOT met'} ({default_us:.2f} us)."
    )
    for row in rows[3:]:
        other_us = float(row[1].replace(",", ""))
        verdict += f" {row[0]} adds {other_us / default_us:,.0f}x what adaptmem's default adds."
    print(table)
    print(verdict)
    if args.write:
        write_section(
            "Decorator overhead (success path)",
            header("python benchmarks/overhead.py --write") + "\n" + table + "\n" + verdict,
        )


if __name__ == "__main__":
    main()
