"""What ``group=`` costs per call, against the same decorator alone and the by-hand minimum.

    python benchmarks/ranks.py [--ranks 2] [--write]

Starts ``--ranks`` processes on this machine over gloo (CPU). Each times, in interleaved
rounds, a trivial decorated function called (a) without a group, (b) with
``group="world"`` (two gloo exchanges per call: the size, then the outcome), and (c) the
workaround users write by hand today (lm-evaluation-harness style): one all_reduce of the
minimum batch size over the world group before a plain call, which agrees on the size but
not on the outcome. The work is trivial, so the figures are the exchange's cost alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CALLS = 200
ROUNDS = 7


def _per_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - start) / CALLS


def rank_main(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from adaptmem import adaptive

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))

    def body(batchsize: int) -> int:
        return batchsize

    alone = adaptive.batch(initial_batchsize=32)(body)
    grouped = adaptive.batch(initial_batchsize=32, group="world")(body)

    def by_hand() -> int:
        size = torch.tensor([32])
        dist.all_reduce(size, op=dist.ReduceOp.MIN)
        return body(int(size.item()))

    grouped()  # makes adaptmem's gloo group once, outside the timing
    samples: dict[str, list[float]] = {"alone": [], "grouped": [], "by_hand": []}
    for _ in range(ROUNDS):
        samples["alone"].append(_per_call(alone))
        samples["grouped"].append(_per_call(grouped))
        samples["by_hand"].append(_per_call(by_hand))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({k: statistics.median(v) for k, v in samples.items()}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.init, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--ranks", str(args.ranks),
                                   "--rank", str(r), "--init", f"{tmp}/init",
                                   "--out", f"{tmp}/out"], env=env)
                 for r in range(args.ranks)]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"a rank failed (exit {proc.returncode})")
        figures = [json.loads(Path(f"{tmp}/out.{r}.json").read_text())
                   for r in range(args.ranks)]

    from _report import header, markdown_table, write_section

    def us(key: str) -> float:
        return 1e6 * max(f[key] for f in figures)  # the slowest rank sets the pace

    rows = [
        ["adaptmem, no group", f"{us('alone'):,.1f}", "1.00x"],
        ['adaptmem, group="world" (size and outcome agreed)', f"{us('grouped'):,.1f}",
         f"{us('grouped') / us('alone'):,.1f}x"],
        ["by hand: all_reduce(MIN) of the size, then a plain call (size only)",
         f"{us('by_hand'):,.1f}", f"{us('by_hand') / us('alone'):,.1f}x"],
    ]
    table = markdown_table(["per call, trivial work", "us (slowest rank)", "vs no group"],
                           rows)
    load = os.getloadavg()[0]
    note = (f"{args.ranks} gloo ranks on one host, {CALLS} calls x {ROUNDS} interleaved "
            f"rounds, median per rank; load average {load:.1f} at the end. group= exchanges "
            f"twice per attempt (the size, then the outcome): "
            f"{us('grouped') / us('by_hand'):.1f}x the by-hand minimum, which agrees on the "
            f"size only and leaves the other ranks waiting when one runs out of memory. "
            f"Against real work (a forward of milliseconds to seconds per batch) this is the "
            f"cost of keeping ranks in step.")
    print(table + "\n" + note)
    if args.write:
        command = f"python benchmarks/ranks.py --ranks {args.ranks} --write"
        write_section("Many ranks (group=)", header(command) + "\n" + table + "\n" + note)


if __name__ == "__main__":
    main()
