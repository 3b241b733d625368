"""``group=``: every rank of a process group runs the same sizes, and stops together.

[Note: ranks in step] Under data parallelism every rank calls the decorated function the
same number of times, and a rank that picked another size (or retried while the others went
on) would desynchronise the job's collectives. So a grouped call exchanges twice per
attempt: before it, the ranks agree on the size (the minimum of what each record proposes);
after it, on the outcome (each rank's status and size). Any rank out of memory: every record
learns that size failed, and all retry smaller, together. A plain call drops its result and
runs again; a ``range`` / ``chunked`` step that worked on this rank is kept (delivered, and
the rank moves on past it: its body never runs twice over the same items), and only the
next step is smaller.
Any rank raising something else: it still takes part in the outcome exchange, then re-raises
its own error, while the others raise ``RankError`` naming it, its error's type and message.
An error after the outcome exchange (``chunked(output=...)`` refusing a result of the wrong
shape) reaches the others at the next size exchange, where its rank proposes ``ABORT``.
The exchanges go over a gloo group on the CPU, made once per group and timeout over the same
ranks, so they cannot run out of device memory and do not queue behind the job's NCCL work;
a rank that died or stopped calling surfaces as ``RankError`` after ``group_timeout``
seconds (sooner when its connection closes), never as a hang. ``range`` and ``chunked``
agree on each step; a rank whose range is done keeps answering (idle) until all are.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from .._common.errors import OutOfMemoryError, Phase, RankError
from .._common.oom import drop_frames, free_caches, shrinks_size
from .cache import BatchsizeCache, SizeRecord, StacktraceMemoryBatchsizeCache
from .progress import Progress
from .retry import is_lazy, log_probe, shrink
from .stats import Watch

__all__ = ["Ranks", "check_group", "resolve_ranks", "run_sized_grouped", "run_range_grouped"]

logger = logging.getLogger("adaptmem")

T = TypeVar("T")

# Outcomes of one attempt on one rank, as exchanged.
OK, OOM, GAVE_UP, ERROR = 0, 1, 2, 3
IDLE_STEP = 1 << 62  # what a rank whose range is done proposes: larger than any step
ABORT = -1  # what a rank proposes after an error past the outcome exchange: smaller than any


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def check_group(group: Any, group_timeout: Any, kind: str) -> None:
    """At decoration: ``group`` is None, ``"world"`` or a process group; the timeout is
    positive."""
    if group is None:
        return
    example = f'@adaptive.{kind}(..., group="world")'
    if not torch.distributed.is_available():
        raise RuntimeError(
            f"group={group!r} needs torch.distributed, which this build of torch lacks; "
            f"leave group out, or install a torch with distributed support"
        )
    if isinstance(group, str):
        if group != "world":
            raise ValueError(f'group must be "world" or a torch.distributed process group, '
                             f"got {group!r}; write {example}")
    elif not isinstance(group, _dist().ProcessGroup):
        raise TypeError(
            f'group must be "world" or a torch.distributed process group (from '
            f"torch.distributed.new_group), got {type(group).__name__} {group!r}; "
            f"write {example}"
        )
    if isinstance(group_timeout, bool) or not isinstance(group_timeout, (int, float)) or not (
            group_timeout > 0):
        raise ValueError(f"group_timeout must be a positive number of seconds, got "
                         f"{group_timeout!r}")


class Ranks:
    """The CPU group a grouped call exchanges over, and this process's place in it."""

    def __init__(self, source: Any, members: list[int], group: Any, timeout: float) -> None:
        self.source = source  # kept so the cache key (its id) is never reused
        self.members = members  # global ranks, by group rank
        self.group = group
        self.timeout = timeout
        dist = _dist()
        self.rank = dist.get_rank()
        self.group_rank = members.index(self.rank)

    def _run(self, name: str, stage: str, collective: Callable[[], Any]) -> None:
        try:
            collective()
        except Exception as exc:
            raise RankError(
                f"{name} on rank {self.rank}: the ranks {self.members} did not all answer the "
                f"{stage} exchange ({type(exc).__name__}: {exc}). A rank died, hung for more "
                f"than group_timeout={self.timeout:g} s, or stopped calling {name}; every "
                f"rank must call it the same number of times"
            ) from exc

    def agree(self, size: int, name: str) -> int:
        """The smallest ``size`` any rank proposes."""
        dist = _dist()
        proposal = torch.tensor([size], dtype=torch.int64)
        self._run(name, "size", lambda: dist.all_reduce(
            proposal, op=dist.ReduceOp.MIN, group=self.group))
        return int(proposal.item())

    def outcomes(self, status: int, size: int, name: str) -> list[tuple[int, int]]:
        """Every rank's (status, size) of the attempt just made, by group rank."""
        dist = _dist()
        # One all_reduce of a vector where each rank fills its own slots: cheaper over gloo
        # than an all_gather into a list of tensors.
        n = len(self.members)
        every = torch.zeros(2 * n, dtype=torch.int64)
        every[self.group_rank] = status
        every[n + self.group_rank] = size
        self._run(name, "outcome", lambda: dist.all_reduce(every, group=self.group))
        values = every.tolist()
        return list(zip(values[:n], values[n:], strict=True))

    def errors(self, error: BaseException | None, name: str) -> list[tuple[str, str] | None]:
        """Every rank's error as (type name, message), None for ranks without one."""
        dist = _dist()
        every: list[Any] = [None] * len(self.members)
        mine = None if error is None else (type(error).__name__, str(error))
        self._run(name, "error", lambda: dist.all_gather_object(every, mine, group=self.group))
        return every


_lock = threading.Lock()
_made: dict[tuple[Any, float], Ranks] = {}


def resolve_ranks(group: Any, timeout: float, name: str) -> Ranks:
    """The gloo ``Ranks`` over the same processes as ``group``, made on first use."""
    key = ("world" if isinstance(group, str) else id(group), float(timeout))
    made = _made.get(key)
    if made is not None:
        return made
    dist = _dist()
    if not dist.is_initialized():
        raise RuntimeError(
            f"{name} has group={group!r}, but torch.distributed is not initialised in this "
            f"process: call torch.distributed.init_process_group(...) before the first call "
            f"(any backend; adaptmem exchanges sizes over a gloo group of its own)"
        )
    source = dist.group.WORLD if isinstance(group, str) else group
    members = list(dist.get_process_group_ranks(source))
    if dist.get_rank() not in members:
        raise ValueError(
            f"{name} has group={group!r}, whose ranks {members} do not include this process "
            f"(rank {dist.get_rank()}); call it only on the group's ranks, or pass the "
            f"group this rank belongs to"
        )
    with _lock:
        made = _made.get(key)
        if made is None:
            # Only the members take part (use_local_synchronization), as only they call.
            # Making it waits for every member's first call: a rank that died or is late
            # says so as later exchanges do.
            try:
                cpu = dist.new_group(members, timeout=timedelta(seconds=timeout),
                                     backend="gloo", use_local_synchronization=True)
            except Exception as exc:
                raise RankError(
                    f"{name} on rank {dist.get_rank()}: the ranks {members} did not all make "
                    f"their first grouped call within group_timeout={timeout:g} s "
                    f"({type(exc).__name__}: {exc}). A rank died, is late, or does not call "
                    f"{name}; every rank must call it the same number of times"
                ) from exc
            made = _made[key] = Ranks(source, members, cpu, float(timeout))
    return made


def _attempt(attempt: Callable[[int], Any], size: int, floor: int
             ) -> tuple[int, Any, BaseException | None, float]:
    """Run one attempt: (status, result, the exception, seconds it took)."""
    started = time.perf_counter()
    try:
        result = attempt(size)
    except Exception as exc:
        status = (GAVE_UP if size <= floor else OOM) if shrinks_size(exc) else ERROR
        return status, None, exc, time.perf_counter() - started
    if is_lazy(result):
        # No "never awaited" warning on top of this error (an iterator of the user's own
        # is left alone: its close may do more).
        if isinstance(result, (types.GeneratorType, types.CoroutineType)):
            result.close()
        error = TypeError(f"returned a {type(result).__name__}, whose work (if it has any) "
                          f"runs as it is read; under group= the function must do its work "
                          f"before it returns: return a list")
        return ERROR, None, error, time.perf_counter() - started
    return OK, result, None, time.perf_counter() - started


def _carried(problem: BaseException | None) -> BaseException:
    """The exception a failed status carries (every status but OK has one)."""
    if problem is None:
        raise RuntimeError("internal error: a failed attempt without its exception")
    return problem


def _raise_together(ranks: Ranks, problem: BaseException | None, name: str) -> None:
    """Every rank raises: the ranks that hold an error re-raise it, the others raise a
    RankError naming the first of them."""
    described = ranks.errors(problem, name)
    if problem is not None:
        raise problem
    bad = next(i for i, d in enumerate(described) if d is not None)
    kind, text = described[bad] or ("an error", "")
    raise RankError(
        f"{name}: rank {ranks.members[bad]} raised {kind}: {text}. Every rank of the group "
        f"stops with it (they run the same sizes together); rank {ranks.members[bad]} "
        f"raised the original, with its traceback",
        ranks.members[bad], kind, text,
    )


def _settle(outcomes: list[tuple[int, int]], status: int, problem: BaseException | None,
            size: int, tried: list[int], record: SizeRecord, ranks: Ranks, *, floor: int,
            name: str, what: str, device: torch.device | None, cache: BatchsizeCache,
            watch: Watch) -> int:
    """After an attempt that failed on some rank: raise, or learn and return the next size.
    See [Note: ranks in step]."""
    statuses = [s for s, _ in outcomes]
    if ERROR in statuses:
        _raise_together(ranks, problem if status == ERROR else None, name)
    failed = next(i for i, s in enumerate(statuses) if s in (OOM, GAVE_UP))
    failed_rank = ranks.members[failed]
    if GAVE_UP in statuses:
        if status == GAVE_UP:
            shrink(_carried(problem), size, tried, record, floor=floor, name=name, what=what,
                   device=device, cache=cache, watch=watch)  # raises
        if problem is not None:
            drop_frames(problem)
        watch.tell("gave_up", size, None, failed_rank)
        quitter = ranks.members[statuses.index(GAVE_UP)]
        error = OutOfMemoryError(
            f"{name}: rank {quitter} ran out of memory at its smallest {what}, "
            f"{outcomes[statuses.index(GAVE_UP)][1]}; every rank of the group stops with it "
            f"(they run the same sizes together). "
            f"{f'Lower min_{what}, or free' if floor > 1 else 'Free'} memory on rank {quitter}"
        )
        error.phase = Phase.COMPUTE
        raise error
    if status == OOM:
        return shrink(_carried(problem), size, tried, record, floor=floor, name=name, what=what,
                      device=device, cache=cache, watch=watch)
    # This rank's attempt worked, another's ran out: learn the same, retry with them.
    failed_size = min(s for st, s in outcomes if st == OOM)
    tried.append(size)
    free_caches(device)
    if isinstance(cache, StacktraceMemoryBatchsizeCache):
        cache.memory_changed()
    new_size = record.after_failure(failed_size, floor)
    logger.info("%s: rank %d ran out of memory at %s=%d; every rank retries with %s=%d "
                "at most", name, failed_rank, what, failed_size, what, new_size)
    watch.tell("shrink", size, new_size, failed_rank)
    return new_size


def run_sized_grouped(
    attempt: Callable[[int], T], size: int, record: SizeRecord, ranks: Ranks, *, floor: int,
    name: str, what: str, device: torch.device | None, cache: BatchsizeCache, watch: Watch,
) -> tuple[T, int]:
    """``run_sized`` with every rank of ``ranks`` in step; see [Note: ranks in step]."""
    stats = watch.stats
    tried: list[int] = []
    first: int | None = None
    while True:
        size = ranks.agree(size, name)
        if first is None:
            first = size
        status, result, problem, seconds = _attempt(attempt, size, floor)
        outcomes = ranks.outcomes(status, size, name)
        if all(s == OK for s, _ in outcomes):
            record.after_success(size)
            if size != stats.last_size:
                stats.saw(size)
            if tried:
                logger.info("%s: %s=%d fits on every rank (after %s)", name, what, size, tried)
                watch.tell("fits", first, size)
            return result, size
        del result
        if status != ERROR:
            stats.failed(seconds)
        size = _settle(outcomes, status, problem, size, tried, record, ranks, floor=floor,
                       name=name, what=what, device=device, cache=cache, watch=watch)
        del problem
        stats.retried()


def _keep(results: list[Any], deliver: Callable[[int, int, Any], None] | None, at: int,
          span: int, result: Any) -> Exception | None:
    """Collect a step that worked on this rank, or deliver it; the error ``deliver`` raised,
    if it did (the other ranks hear of it at the next exchange)."""
    if deliver is None:
        results.append(result)
        return None
    try:
        deliver(at, at + span, result)
    except Exception as exc:
        return exc
    return None


def run_range_grouped(
    body: Callable[[int, int], Any], start: int, end: int, record: SizeRecord, ranks: Ranks, *,
    initial: int, floor: int, name: str, device: torch.device | None, cache: BatchsizeCache,
    watch: Watch, deliver: Callable[[int, int, Any], None] | None = None, probe: bool = False,
    progress: Progress | None = None,
) -> list[Any]:
    """``run_range`` with every rank of ``ranks`` in step: one agreed step size at a time,
    each rank over its own ``[start, end)``; see [Note: ranks in step]."""
    stats = watch.stats
    results: list[Any] = []
    step = record.next_size(initial, floor, probe)
    log_probe(record, step, name, "step", watch)
    stats.range_started()
    position = start
    tried: list[int] = []
    late: BaseException | None = None  # raised by deliver, after the outcome exchange
    while True:
        agreed = ranks.agree(
            ABORT if late is not None else step if position < end else IDLE_STEP, name)
        if agreed == ABORT:
            _raise_together(ranks, late, name)
        if agreed == IDLE_STEP:
            return results
        at = position
        if at < end:
            span = min(agreed, end - at)
            stats.step_started()
            def attempt(size: int, at: int = at) -> Any:
                return body(at, at + size)

            status, result, problem, seconds = _attempt(attempt, span, min(floor, span))
        else:  # done here: answer for the others
            span, status, result, problem, seconds = 0, OK, None, None, 0.0
        outcomes = ranks.outcomes(status, span, name)
        if all(s == OK for s, _ in outcomes):
            if at < end:
                if span == agreed:  # not a last step shorter than the others
                    record.after_success(span)
                    stats.saw(span)
                else:  # the range ended: see SizeRecord.after_short_success
                    record.after_short_success(span)
                late = _keep(results, deliver, at, span, result)
                if late is not None:  # the others hear of it at the next exchange
                    continue
                position += span
                if progress is not None:
                    progress.advance(span, agreed)
            if tried:
                watch.tell("fits", tried[0], agreed)
                tried = []
            step = agreed
            continue
        if status == OK and at < end:
            # Another rank ran out of memory; this one's step is done: keep it, never run
            # the body over the same items again (see [Note: ranks in step]).
            late = _keep(results, deliver, at, span, result)
            if late is None:
                position += span
                if progress is not None:
                    progress.advance(span, agreed)
        del result
        if status not in (ERROR, OK) and at < end:
            stats.failed(seconds)
        step = _settle(outcomes, status, problem, span or agreed, tried, record, ranks,
                       floor=min(floor, span) if span else floor, name=name, what="step",
                       device=device, cache=cache, watch=watch)
        del problem
        stats.retries += 1
