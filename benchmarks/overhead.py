"""Per-call time the decorators add on the success path, against a plain call and toma.

    python benchmarks/overhead.py [--write]
    python benchmarks/overhead.py --against ../old-checkout [--rounds 3] [--write]

``--against`` times adaptmem's own variants in child processes, alternating between this
tree and another checkout of adaptmem (the code before a change), so both are measured in
the same run under the same load; rivals are left out of that mode.

Target (issue 2): <= 5 microseconds per call for the default cache on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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


CACHES = (
    ("adaptmem, StacktraceMemoryBatchsizeCache (default)", "StacktraceMemoryBatchsizeCache"),
    ("adaptmem, GlobalBatchsizeCache", "GlobalBatchsizeCache"),
    ("adaptmem, NoBatchsizeCache", "NoBatchsizeCache"),
)


def adaptmem_variants() -> list[tuple[str, Callable[[], object], int]]:
    variants: list[tuple[str, Callable[[], object], int]] = []
    for label, cache in CACHES:
        decorated = adaptive.batch(initial_batchsize=32, cache=getattr(adaptive, cache))(body)
        variants.append((label, lambda d=decorated: d(1), 100_000))
    return variants


def child() -> None:
    """Print {label: added microseconds} for adaptmem's variants, as imported here."""
    torch.set_num_threads(1)
    native = per_call(lambda: body(32, 1), 200_000)
    out = {}
    for label, fn, calls in adaptmem_variants():
        fn()
        out[label] = (per_call(fn, calls) - native) * 1e6
    print(json.dumps(out))


def against(other: Path, rounds: int, write: bool) -> None:
    trees = {"this tree": Path(__file__).resolve().parents[1], "against": other.resolve()}
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree))
            result = subprocess.run(
                [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "import overhead; overhead.child()", str(Path(__file__).parent)],
                env=env, cwd=tree, capture_output=True, text=True, check=True)
            for label, us in json.loads(result.stdout.strip().splitlines()[-1]).items():
                samples[name].setdefault(label, []).append(us)
    rows = [[label] + [f"{statistics.median(samples[t][label]):.2f} "
                       f"({min(samples[t][label]):.2f}-{max(samples[t][label]):.2f})"
                       for t in trees]
            + [f"{min(samples['this tree'][label]) / min(samples['against'][label]):.2f}x"]
            for label, _ in CACHES]
    table = markdown_table(["variant", "this tree: us per call, median (range)",
                            f"{other}: us per call", "ratio of the fastest rounds"], rows)
    note = (f"{rounds} alternating rounds, each a fresh process per tree; 'against' is "
            f"another checkout of adaptmem timed in the same run. The ratio compares each tree's "
            f"fastest round: load from other processes only ever adds time.")
    print(table)
    print(note)
    if write:
        write_section("Decorator overhead: before and after a change",
                      header(f"python benchmarks/overhead.py --against {other} --rounds "
                             f"{rounds} --write") + "\n" + table + "\n" + note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--against", type=Path, default=None,
                        help="another adaptmem checkout to time in the same run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (--against)")
    args = parser.parse_args()
    if args.against is not None:
        against(args.against, args.rounds, args.write)
        return
    torch.set_num_threads(1)

    native = per_call(lambda: body(32, 1), 200_000)
    rows = []
    variants = adaptmem_variants()
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
