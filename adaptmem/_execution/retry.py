"""The one search loop that batch, range and chunked share."""

from __future__ import annotations

import io
import logging
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .._common.devices import default_device, format_bytes, free_memory
from .._common.errors import OutOfMemoryError, Phase, oom_error_for
from .._common.oom import drop_frames, free_caches, is_oom, oom_phase, shrinks_size
from .cache import BatchsizeCache, SizeRecord, StacktraceMemoryBatchsizeCache
from .progress import Progress
from .stats import Watch

__all__ = ["run_sized", "run_range", "shrink", "relook_for", "explain_kept_size", "log_probe",
           "log_moved", "logger", "LAZY_TYPES", "is_lazy"]

logger = logging.getLogger("adaptmem")

T = TypeVar("T")

# What a call returns before any of its work has run: no out-of-memory error can have struck
# yet, so such a result says nothing about the size (see lazy.py for how batch runs them).
LAZY_TYPES = frozenset({types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType})

# Whether each class of result seen is an iterator (see ``is_lazy``): a dict lookup on the
# success path, where ``isinstance(result, Iterator)`` costs six times as much.
_iterates: dict[type, bool] = {}


def is_lazy(result: Any) -> bool:
    """Whether ``result`` may not have done its work yet: a generator, coroutine or async
    generator, or any other iterator (``map``, ``filter``, ``zip``, a class of one's own),
    which does its work, if it has any, as it is read (see [Note: lazy results] in lazy.py).
    Files, iterators of their lines, are results of work done."""
    cls = result.__class__
    if cls in LAZY_TYPES:
        return True
    known = _iterates.get(cls)
    if known is None:
        if len(_iterates) > 1024:  # classes made at run time: keep none for good
            _iterates.clear()
        known = _iterates[cls] = issubclass(cls, Iterator) and not issubclass(cls, io.IOBase)
    return known


def _free_text(device: torch.device | None) -> str:
    try:
        dev = device if device is not None else default_device()
        return f"{format_bytes(free_memory(dev))} free on {dev}"
    except Exception:  # a probe must never hide the user's error
        return "free memory unknown"


def log_probe(record: SizeRecord, size: int, name: str, what: str,
              watch: Watch | None = None) -> None:
    """Log a call that tries a size above the largest known to fit (climbing back)."""
    fits = record.fits
    if fits is not None and size > fits:
        logger.info("%s: probing %s=%d (largest that fitted so far: %d)", name, what, size, fits)
        if watch is not None:
            watch.tell("probe", fits, size)


def log_moved(size: int, last: int, name: str, what: str, watch: Watch | None = None) -> None:
    """Log a call that starts at another size than the last call ran, with no failure or
    probe behind it: free memory moved to where that size is known (or predicted) to fit."""
    logger.info("%s: %s=%d, where the last call ran %d (free memory moved)", name, what,
                size, last)
    if watch is not None:
        watch.tell("moved", last, size)


def run_sized(
    attempt: Callable[[int], T],
    size: int,
    record: SizeRecord,
    *,
    floor: int,
    name: str,
    what: str,
    device: torch.device | None,
    cache: BatchsizeCache,
    failure: BaseException | None = None,
    watch: Watch | None = None,
    started: float | None = None,
    counts_size: bool = True,
    short: bool = False,
    relook: Callable[[], SizeRecord] | None = None,
    ran: Callable[[int], int] | None = None,
) -> tuple[T, int]:
    """Call ``attempt(size)``; on an out-of-memory error in compute, shrink and call again.

    Returns the result and the size that produced it. Non-OOM exceptions (and OOMs that a
    pager raised while moving weights) propagate untouched after one attempt; KeyboardInterrupt
    and SystemExit are never caught. Before each retry the failed attempt's frames are
    cleared, garbage is collected and device caches are emptied. An OOM at ``floor`` raises
    adaptmem's OutOfMemoryError, which is also an instance of the original error's type.
    ``failure`` is the OOM of a first attempt at ``size`` the caller already made, begun at
    ``time.perf_counter()`` ``started`` (None: not timed). ``watch`` counts attempts and
    reports adaptations (see [Note: cheap counting] in ``stats``); ``counts_size=False``
    leaves the size out of its sizes (``run_range`` counts its own). ``short``: ``size`` is
    less than was asked for because the work ends there (a range's last step), so a success
    at it before any failure says nothing about what fits (see
    ``SizeRecord.after_short_success``). ``relook`` returns the record the call would use
    now: after a failure, once caches are emptied and free memory is read again, the
    failure and what follows go to that record (see [Note: a failure filed where it
    happened]). ``ran`` maps the size an attempt was passed to the size it really ran, known
    after it (see [Note: a batch shorter than its size] in accumulate.py): the result,
    failure and returned size are that size's.
    """
    tried: list[int] = []
    first = size
    stats = watch.stats if watch is not None else None
    while True:
        if failure is None:
            if stats is not None:
                fits = record.fits
                started = time.perf_counter() if fits is None or size > fits or tried else None
            try:
                result = attempt(size)
            except Exception as exc:
                if not shrinks_size(exc):
                    explain_kept_size(exc, name, what)
                    raise
                failure = exc
            else:
                used = size if ran is None else ran(size)
                ran_short = used < size
                if ran_short:
                    size, short = used, True
                # A generator or coroutine has not run yet: its wrapper records the outcome.
                if not is_lazy(result):
                    if short and not tried:
                        record.after_short_success(size)
                    else:
                        record.after_success(size)
                if (stats is not None and counts_size and size != stats.last_size
                        and not ran_short):  # a short batch says nothing of sizes
                    stats.saw(size)
                if tried:
                    logger.info("%s: %s=%d fits (after %s ran out of memory)",
                                name, what, size, tried)
                    if watch is not None:
                        watch.tell("fits", first, size)
                return result, size
        if stats is not None:
            stats.failed(None if started is None else time.perf_counter() - started)
        if ran is not None:
            size = ran(size)
        # Out of the except block, so nothing keeps the failed attempt's frames alive.
        size = shrink(failure, size, tried, record, floor=floor, name=name, what=what,
                      device=device, cache=cache, watch=watch, relook=relook)
        if relook is not None:
            record = relook()
        if stats is not None:
            stats.retried()
        failure = None


def explain_kept_size(exc: BaseException, name: str, what: str) -> None:
    """A pager's out-of-memory error while moving weights passes through ``name`` without
    shrinking its ``what``: the message says so, once, and how to have both searched (not
    for an exception group, whose text is not its arguments)."""
    if (hasattr(exc, "exceptions") or oom_phase(exc) is not Phase.TRANSFER
            or getattr(exc, "beyond_device", False) or getattr(exc, "_kept_size_told", False)
            or not exc.args or not isinstance(exc.args[0], str) or not is_oom(exc)):
        return
    exc.args = (f"{exc.args[0]} This reached {name}, which does not shrink its {what} for a "
                f"pager's error while moving weights: give the decorator model=<the model> "
                f"instead of paging it yourself, and it searches the {what} and the weights "
                f"kept on the device together; or start from a smaller {what}.",
                *exc.args[1:])
    exc._kept_size_told = True  # type: ignore[attr-defined]


def relook_for(cache: BatchsizeCache,
               lookup: Callable[[], SizeRecord]) -> Callable[[], SizeRecord] | None:
    """``lookup`` where ``cache`` files sizes by free memory (see [Note: a failure filed
    where it happened]); None for other caches, whose record stays the call's record (a
    ``NoBatchsizeCache`` makes a new one at every lookup)."""
    return lookup if isinstance(cache, StacktraceMemoryBatchsizeCache) else None


# [Note: a failure filed where it happened] The default cache reads free memory at most
# every ``refresh_seconds`` (0.5 s), so a call made just after another tenant took memory
# looks its record up under the reading from before. Filed there, its failure would lower
# what is known to fit with more free memory than the call had: once the memory came back,
# that bucket would climb again only by probes. So after a failure, once the failed
# attempt's memory is let go and free memory is read again, the call looks its record up
# anew (``relook``; ``relook_for`` gives it): the failure, the retries and the size that
# fits go to the bucket of the memory the call really had. The batch and step searches do
# this; the ranks-in-step search and a generator's or coroutine's retries keep the record
# they started with.
def shrink(
    failure: BaseException,
    size: int,
    tried: list[int],
    record: SizeRecord,
    *,
    floor: int,
    name: str,
    what: str,
    device: torch.device | None,
    cache: BatchsizeCache,
    watch: Watch | None = None,
    relook: Callable[[], SizeRecord] | None = None,
) -> int:
    """After ``failure`` at ``size``: clear up and return the size to retry with, or raise
    adaptmem's OutOfMemoryError (chaining ``failure``) when ``size`` is already the floor.
    ``relook``: the failure goes to the record it returns once free memory was read again,
    not to ``record`` (see [Note: a failure filed where it happened])."""
    tried.append(size)
    if size <= floor:
        if watch is not None:
            watch.tell("gave_up", size, None)
        if oom_phase(failure) is Phase.TRANSFER:  # shrunk for a pager (model=): its words
            raise failure
        # No retry follows: keep the original traceback for whoever debugs this.
        lower = f"Lower min_{what} if smaller sizes make sense, or free" if floor > 1 else "Free"
        error = oom_error_for(failure)(
            f"{name} ran out of memory at the smallest {what}, {floor}; tried {what} "
            f"{', '.join(map(str, tried))} ({_free_text(device)}). {lower} memory (another "
            f"process, a smaller model, adaptive.page for the weights)."
        )
        error.phase = Phase.COMPUTE
        raise error from failure
    drop_frames(failure)
    free_caches(device)
    if isinstance(cache, StacktraceMemoryBatchsizeCache):
        cache.memory_changed()
    if relook is not None:
        record = relook()
    new_size = record.after_failure(size, floor)
    logger.info(
        "%s ran out of memory at %s=%d (%s); retrying with %s=%d",
        name, what, size, _free_text(device), what, new_size,
    )
    if watch is not None:
        watch.tell("shrink", size, new_size)
    return new_size


def run_range(
    body: Callable[[int, int], Any],
    start: int,
    end: int,
    record: SizeRecord,
    *,
    initial: int,
    floor: int,
    name: str,
    device: torch.device | None,
    cache: BatchsizeCache,
    deliver: Callable[[int, int, Any], None] | None = None,
    probe: bool = False,
    watch: Watch | None = None,
    progress: Progress | None = None,
    relook: Callable[[], SizeRecord] | None = None,
) -> list[Any]:
    """Call ``body(s, e)`` over consecutive steps covering ``[start, end)`` once, in order.

    A step that runs out of memory is retried at the same offset with a smaller step, so
    finished steps are never redone. The step that worked is kept for the rest of the call.
    Results are collected in the returned list, or handed to ``deliver(s, e, result)`` once
    their step has succeeded (then the list stays empty). ``probe``: see
    [Note: probing a failed size] in ``_cache``. ``watch`` counts steps and reports
    adaptations; ``progress`` shows the items done; ``relook``: see ``run_sized``.
    """
    results: list[Any] = []
    step = record.next_size(initial, floor, probe)
    log_probe(record, step, name, "step", watch)
    position = start
    if watch is not None:
        watch.stats.range_started()
    while position < end:
        if watch is not None:
            watch.stats.step_started()
        span = min(step, end - position)
        at = position

        def attempt(size: int, at: int = at) -> Any:
            return body(at, at + size)

        try:
            result, used = run_sized(
                attempt, span, record,
                floor=min(floor, span), name=name, what="step", device=device, cache=cache,
                watch=watch, counts_size=False, short=span < step, relook=relook,
            )
        except OutOfMemoryError as error:  # gave up: say where
            if at > start and error.args and isinstance(error.args[0], str):
                error.args = (f"{error.args[0]} It stopped at {at} of [{start}, {end}): the "
                              f"steps before it had run.", *error.args[1:])
            raise
        # A last step shorter than the step (what was left) says nothing about sizes.
        if watch is not None and (used < span or span == step):
            watch.stats.saw(used)
        if is_lazy(result):
            _refuse_lazy_step(result, name)
        if deliver is None:
            results.append(result)
        else:
            deliver(at, at + used, result)
        position += used
        if used < span:
            step = used
            if relook is not None:  # the record run_sized moved to, for the next steps
                record = relook()
        if progress is not None:
            progress.advance(used, step)
    return results


def _refuse_lazy_step(result: Any, name: str) -> None:
    if isinstance(result, (types.CoroutineType, types.GeneratorType)):
        result.close()  # no "never awaited" warning on top of this error
    raise TypeError(
        f"a step of {name} returned a {type(result).__name__}, an iterator or coroutine "
        f"whose work (if it has any) runs after the step returned: range and chunked retry "
        f"a step while it runs, so a step must do its work before it returns. Return a list "
        f"(list(...)) or a tensor instead, or use @adaptive.batch, which retries generators, "
        f"iterators and coroutines"
    )
