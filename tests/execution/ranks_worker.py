"""One rank of the ``group=`` tests: ``python ranks_worker.py RANK WORLD INIT_FILE OUT``.

tests/execution/test_ranks.py starts one process per rank; each runs every scenario below
in turn over one gloo group and writes what it saw to ``OUT.RANK.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from adaptmem import adaptive
from adaptmem._execution import progress
from adaptmem.testing import MemoryCeiling

CEILINGS = [64, 16, 40, 24]  # rank r fits CEILINGS[r] items


def ceilings(rank: int, seen: dict[str, Any]) -> None:
    """Ranks with different memory: they must try the same sizes and end the same."""
    ceiling = MemoryCeiling(CEILINGS[rank])
    events: list[list[Any]] = []

    @adaptive.batch(initial_batchsize=64, group="world", cache=adaptive.GlobalBatchsizeCache,
                    on_adapt=lambda e: events.append([e.kind, e.old_size, e.new_size, e.rank,
                                                      e.failed_rank]))
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    seen["ceilings"] = {
        "results": [infer() for _ in range(3)],
        "attempts": list(ceiling.attempts),
        "failures": list(ceiling.failures),
        "events": events,
        "stats": infer.stats.as_dict(),
    }


def ranges(rank: int, seen: dict[str, Any]) -> None:
    """Ranges of different lengths: the ranks agree on every step, each covers its own."""
    ceiling = MemoryCeiling(CEILINGS[rank])
    spans: list[list[int]] = []

    @adaptive.range(initial_step=64, group="world", cache=adaptive.NoBatchsizeCache)
    def fill(start: int, end: int) -> int:
        ceiling.require(end - start)
        spans.append([start, end])
        return end - start

    end = 100 + 37 * rank
    seen["ranges"] = {"end": end, "results": fill(0, end), "spans": spans,
                      "attempts": list(ceiling.attempts)}


def chunks(rank: int, seen: dict[str, Any]) -> None:
    """chunked(output="new") over tensors of different lengths, with progress on rank 0."""
    ceiling = MemoryCeiling(CEILINGS[rank])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("adaptmem")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    progress.load_tqdm = lambda: None  # the logger's lines are what this test reads

    @adaptive.chunked(initial_step=64, output="new", group="world", progress=True,
                      cache=adaptive.NoBatchsizeCache)
    def double(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        ceiling.require(end - start)
        return chunk * 2

    data = torch.arange(50.0 + 30 * rank)
    out = double(data)
    logger.removeHandler(handler)
    seen["chunks"] = {"right": bool(torch.equal(out, data * 2)),
                      "attempts": list(ceiling.attempts),
                      "progress": [line for line in lines if "items" in line]}


def late(rank: int, seen: dict[str, Any]) -> None:
    """Rank 1 returns a result of the wrong shape: chunked refuses it after the outcome
    exchange, and the other ranks hear of it at the next one."""

    @adaptive.chunked(initial_step=4, output="new", group="world")
    def halve(chunk: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return chunk[:1] if rank == 1 and start >= 4 else chunk / 2

    try:
        halve(torch.ones(12))
    except adaptive.RankError as exc:
        seen["late"] = {"type": "RankError", "rank": exc.rank, "error_type": exc.error_type}
    except ValueError as exc:
        seen["late"] = {"type": "ValueError", "message": str(exc)}
    else:
        seen["late"] = {"type": None}


def subgroup(rank: int, seen: dict[str, Any]) -> None:
    """A group of ranks 1 and 2 only: they agree between themselves, the others never call."""
    sub = dist.new_group([1, 2])  # every rank creates it, as torch asks
    if rank not in (1, 2):
        seen["subgroup"] = None
        return
    ceiling = MemoryCeiling(CEILINGS[rank])

    @adaptive.batch(initial_batchsize=64, group=sub, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int) -> int:
        ceiling.require(batchsize)
        return batchsize

    seen["subgroup"] = {"result": infer(), "attempts": list(ceiling.attempts)}


def raises(rank: int, world: int, seen: dict[str, Any]) -> None:
    """The last rank raises a ValueError: every rank gets a clear error naming it."""

    corrupt = [rank == world - 1]

    @adaptive.batch(initial_batchsize=8, group="world")
    def step(batchsize: int) -> int:
        if corrupt[0]:
            raise ValueError("shard 7 is corrupt")
        return batchsize

    started = time.monotonic()
    try:
        step()
    except adaptive.RankError as exc:
        seen["raises"] = {"type": "RankError", "message": str(exc), "rank": exc.rank,
                          "error_type": exc.error_type, "error_message": exc.error_message}
    except ValueError as exc:
        seen["raises"] = {"type": "ValueError", "message": str(exc)}
    else:
        seen["raises"] = {"type": None}
    seen["raises"]["seconds"] = time.monotonic() - started
    # The group still works afterwards: every rank took part in every exchange.
    corrupt[0] = False
    seen["raises"]["after"] = step()


def dies(rank: int, seen: dict[str, Any], out: str) -> None:
    """Rank 1 leaves after one call; rank 0's next call raises RankError, no hang."""

    @adaptive.batch(initial_batchsize=8, group="world", group_timeout=5)
    def step(batchsize: int) -> int:
        return batchsize

    step()
    if rank == 1:
        seen["dies"] = {"left": True}
        _write(seen, out, rank)
        os._exit(0)
    started = time.monotonic()
    try:
        step()
    except adaptive.RankError as exc:
        seen["dies"] = {"type": "RankError", "message": str(exc), "rank": exc.rank}
    else:
        seen["dies"] = {"type": None}
    seen["dies"]["seconds"] = time.monotonic() - started

    # A function whose first call makes a group of its own (another group_timeout): the
    # rank that left never makes it; once a bare "Wait timeout" from torch.
    @adaptive.batch(initial_batchsize=8, group="world", group_timeout=3)
    def first(batchsize: int) -> int:
        return batchsize

    try:
        first()
    except adaptive.RankError as exc:
        seen["dies"]["first"] = {"type": "RankError", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to show
        seen["dies"]["first"] = {"type": type(exc).__name__, "message": str(exc)}


def placed(rank: int, seen: dict[str, Any]) -> None:
    """model= with group=: a batch runs; when rank 0 runs out at the smallest size, every
    rank raises together (no rank gives residency back and runs again on its own)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(8, 64)

    @adaptive.batch(initial_batchsize=4, model=model, device="cpu", group="world")
    def infer(batchsize: int, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model(c) for c in x.split(batchsize)])

    with torch.no_grad():
        ran = bool(torch.allclose(infer(x), model(x)))
    infer.remove()  # the model is one decorated function's at a time
    ceiling = MemoryCeiling(1 << 20)

    @adaptive.range(initial_step=4, model=model, device="cpu", group="world")
    def steps(start: int, end: int, x: torch.Tensor) -> int:
        ceiling.require(end - start)
        return end - start

    steps(0, 8, x)  # places the model
    if rank == 0:
        ceiling.capacity = 0  # rank 0 runs out at every size from here
    calls = len(ceiling.attempts)
    try:
        steps(0, 8, x)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - what each rank got is the point
        raised = "OutOfMemoryError" if isinstance(exc, adaptive.OutOfMemoryError) else repr(exc)
    seen["placed"] = {"ran": ran, "raised": raised,
                      "attempts": ceiling.attempts[calls:]}
    steps.remove()


def _write(seen: dict[str, Any], out: str, rank: int) -> None:
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(seen, f)


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    scenarios = sys.argv[5].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    seen: dict[str, Any] = {}
    if "ceilings" in scenarios:
        ceilings(rank, seen)
    if "ranges" in scenarios:
        ranges(rank, seen)
    if "chunks" in scenarios:
        chunks(rank, seen)
    if "late" in scenarios:
        late(rank, seen)
    if "subgroup" in scenarios:
        subgroup(rank, seen)
    if "raises" in scenarios:
        raises(rank, world, seen)
    if "placed" in scenarios:
        placed(rank, seen)
    if "dies" in scenarios:
        dies(rank, seen, out)
        _write(seen, out, rank)
        os._exit(0)  # the group is broken: nothing to tear down
    _write(seen, out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
