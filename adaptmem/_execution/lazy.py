"""Generators and coroutines under ``@adaptive.batch``.

[Note: lazy results] Calling a generator or ``async def`` function runs none of its body, so
the call itself cannot run out of memory and says nothing about the size. The batch decorator
hands such a result to a wrapper of the same kind, which runs the retry loop where the work
really happens:

- a coroutine is awaited whole, and retried whole, like a plain function;
- a generator (sync or async) is retried until it has produced its first item. After that a
  retry would yield the items already produced a second time, so an out-of-memory error from
  a later item is not retried: it is recorded (the next call starts smaller) and raised as
  adaptmem's OutOfMemoryError, still an instance of the original type.

A size is recorded as fitting only when the work ran without running out of memory: when the
coroutine returned, or the generator finished or was closed by its consumer.

Any other iterator a call returns (``map(model, batches)``, ``filter``, ``zip``, an iterator
class of one's own) is lazy the same way: ``map(model, batches)`` is
``(model(b) for b in batches)`` by another name. It is handed over as a generator that yields
its items (``iterated``), retried until its first item like one; its other attributes are
not passed on. Recording it as fitting at once would record a size that ran none of its work,
and its out-of-memory errors would reach the caller raw, never retried.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from typing import Any

import torch

from .._common.errors import Phase, oom_error_for
from .._common.oom import owned_engines, shrinks_size
from .cache import BatchsizeCache, SizeRecord
from .retry import logger, shrink
from .stats import Watch

__all__ = ["retry_lazy", "retry_generator", "retry_async_generator", "retry_coroutine",
           "named_as", "iterated"]


class _Run:
    """What a lazy run needs to retry: how to start again at a size, and where to record."""

    __slots__ = ("restart", "record", "floor", "name", "device", "cache", "tried", "watch",
                 "first", "owned")

    def __init__(self, restart: Callable[[int], Any], record: SizeRecord, floor: int,
                 name: str, device: torch.device | None, cache: BatchsizeCache,
                 watch: Watch | None = None, first: int = 0) -> None:
        self.restart = restart
        self.record = record
        self.floor = floor
        self.name = name
        self.device = device
        self.cache = cache
        self.tried: list[int] = []
        self.watch = watch
        self.first = first
        # Made inside the call, run after it: the pagers of a decorator with ``model=``
        # whose transfer errors shrink the batch are that decorator's, as placed when an
        # error comes (a later call may have placed its models anew meanwhile).
        self.owned = owned_engines()

    def shrinks(self, exc: BaseException) -> bool:
        """Whether a smaller batch can help ``exc`` (``shrinks_size`` as in the call)."""
        return shrinks_size(exc, self.owned)

    def shrink(self, failure: BaseException, size: int) -> int:
        watch = self.watch
        if watch is not None:
            watch.stats.failed(None)  # a lazy attempt's time is not measured
        size = shrink(failure, size, self.tried, self.record, floor=self.floor, name=self.name,
                      what="batchsize", device=self.device, cache=self.cache, watch=watch)
        if watch is not None:
            watch.stats.retried()
        return size

    def succeeded(self, size: int) -> None:
        self.record.after_success(size)
        watch = self.watch
        if watch is not None and size != watch.stats.last_size:
            watch.stats.saw(size)
        if self.tried:
            logger.info("%s: batchsize=%d fits (after %s ran out of memory)",
                        self.name, size, self.tried)
            if watch is not None:
                watch.tell("fits", self.first, size)

    def failed_after_items(self, failure: BaseException, size: int, items: int) -> BaseException:
        """The error to raise for an OOM after ``items`` items were produced at ``size``."""
        if self.watch is not None:
            self.watch.stats.failed(None)
        smaller = self.record.after_failure(size, self.floor)
        logger.info("%s ran out of memory at batchsize=%d after %d item(s); not retried, the "
                    "next call starts at batchsize=%d", self.name, size, items, smaller)
        error = oom_error_for(failure)(
            f"{self.name} ran out of memory at batchsize={size} after yielding {items} "
            f"item(s). A generator is retried only before its first item (a retry would "
            f"yield those items again); the next call starts at batchsize={smaller}. To "
            f"retry every batch, decorate a function that handles one batch and call it "
            f"from the generator."
        )
        error.phase = Phase.COMPUTE
        return error


def retry_generator(gen: Generator[Any, Any, Any], size: int, run: _Run
                    ) -> Generator[Any, Any, Any]:
    """Yield what ``gen`` yields; see [Note: lazy results]."""
    while True:
        try:
            item = next(gen)
        except StopIteration as stop:
            run.succeeded(size)
            return stop.value
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            failure = exc
        else:
            break
        # Out of the except block: the failed generator and its frames are dropped.
        del gen
        size = run.shrink(failure, size)
        del failure
        try:
            gen = run.restart(size)
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            gen = _raising(exc)
    items = 1
    while True:
        try:
            sent = yield item
        except GeneratorExit:
            gen.close()
            run.succeeded(size)  # the consumer stopped; nothing ran out of memory
            raise
        except BaseException as thrown:  # passed on, as `yield from` does
            try:
                item = gen.throw(thrown)
            except StopIteration as stop:
                run.succeeded(size)
                return stop.value
            items += 1
            continue
        try:
            item = gen.send(sent)
        except StopIteration as stop:
            run.succeeded(size)
            return stop.value
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            raise run.failed_after_items(exc, size, items) from exc
        items += 1


def _raising(exc: BaseException) -> Generator[Any, Any, Any]:
    # A restart that failed before returning its generator fails at the first item instead,
    # so the loop above handles both in one place.
    raise exc
    yield  # pragma: no cover - makes this a generator


async def retry_async_generator(agen: AsyncGenerator[Any, Any], size: int, run: _Run
                                ) -> AsyncGenerator[Any, Any]:
    """Yield what ``agen`` yields; see [Note: lazy results]."""
    while True:
        try:
            item = await agen.__anext__()
        except StopAsyncIteration:
            run.succeeded(size)
            return
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            failure = exc
        else:
            break
        del agen
        size = run.shrink(failure, size)
        del failure
        try:
            agen = run.restart(size)
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            agen = _araising(exc)
    items = 1
    while True:
        try:
            sent = yield item
        except GeneratorExit:
            await agen.aclose()
            run.succeeded(size)
            raise
        except BaseException as thrown:
            try:
                item = await agen.athrow(thrown)
            except StopAsyncIteration:
                run.succeeded(size)
                return
            items += 1
            continue
        try:
            item = await agen.asend(sent)
        except StopAsyncIteration:
            run.succeeded(size)
            return
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            raise run.failed_after_items(exc, size, items) from exc
        items += 1


async def _araising(exc: BaseException) -> AsyncGenerator[Any, Any]:
    raise exc
    yield  # pragma: no cover - makes this an async generator


async def retry_coroutine(coro: Coroutine[Any, Any, Any], size: int, run: _Run) -> Any:
    """Await ``coro``; on an out-of-memory error, await the function again, smaller."""
    while True:
        try:
            result = await coro
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            failure = exc
        else:
            run.succeeded(size)
            return result
        del coro
        size = run.shrink(failure, size)
        del failure
        try:
            coro = run.restart(size)
        except Exception as exc:
            if not run.shrinks(exc):
                raise
            coro = _coraising(exc)


async def _coraising(exc: BaseException) -> Any:
    raise exc


def retry_lazy(result: Any, size: int, restart: Callable[[int], Any], record: SizeRecord,
               floor: int, name: str, device: torch.device | None, cache: BatchsizeCache,
               watch: Watch | None = None) -> Any:
    """The wrapper of ``result``'s kind (a generator, async generator or coroutine), named as
    ``result`` (its repr, and Python's "never awaited" warning, name the user's function)."""
    run = _Run(restart, record, floor, name, device, cache, watch, size)
    if isinstance(result, Generator):
        wrapper: Any = retry_generator(result, size, run)
    elif isinstance(result, AsyncGenerator):
        wrapper = retry_async_generator(result, size, run)
    else:
        wrapper = retry_coroutine(result, size, run)
    return named_as(wrapper, result)


def iterated(result: Any, name: str) -> Any:
    """``result`` as a generator: itself if it is one, else one that yields its items (an
    iterator a function returned, see [Note: lazy results]), named ``name``."""
    if isinstance(result, Generator):
        return result
    items: Any = _items(result)
    items.__name__, items.__qualname__ = name.rpartition(".")[2], name
    return items


def _items(iterable: Any) -> Generator[Any, Any, Any]:
    return (yield from iterable)


def named_as(wrapper: Any, result: Any) -> Any:
    """``wrapper`` (a generator or coroutine object) with ``result``'s name and qualified
    name."""
    wrapper.__name__, wrapper.__qualname__ = result.__name__, result.__qualname__
    return wrapper
