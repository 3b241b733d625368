"""``@adaptive.batch(..., model=model)`` (and range, chunked): the decorators of adaptive
execution, also in charge of the models they run (see [Note: batch size and residency
together] in placed.py). Without ``model`` they are exactly those of ``_execution``."""

from __future__ import annotations

import functools
import gc
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar, overload

import torch

from .._common.callables import ModuleOf
from .._common.devices import free_memory
from .._common.errors import OutOfMemoryError, Phase
from .._common.forks import renew_after_fork
from .._common.oom import drop_frames, is_oom, raised_by, transfer_errors_shrink
from .._common.peak import NotYet, fake_mode
from .._execution import decorators
from .._execution.cache import StacktraceMemoryBatchsizeCache, resolve_cache, user_frame
from .._execution.decorated import (
    BatchDecorator,
    BatchOptions,
    ChunkedDecorator,
    ChunkedOptions,
    Decorated,
    RangeDecorator,
    RangeOptions,
)
from .._execution.lazy import named_as
from .._execution.retry import LAZY_TYPES
from .decorated import (
    PlacingBatchDecorator,
    PlacingChunkedDecorator,
    PlacingDecorated,
    PlacingRangeDecorator,
)
from .explore import Explorer
from .placed import PAGE, PlacedModels, check_models, fakes_put_back

if TYPE_CHECKING:
    from typing import TypeAlias

    from typing_extensions import Unpack

    # What model= takes: a module, or a sequence (or nn.ModuleList) of modules.
    Models: TypeAlias = torch.nn.Module | Sequence[torch.nn.Module]

__all__ = ["Dispatched", "batch", "range", "chunked"]

P = ParamSpec("P")
R = TypeVar("R")
_F = TypeVar("_F", bound=Callable[..., Any])


# [Note: called inside another decorator's trace]
# A function decorated with model= can be called by another decorated function whose first
# call traces it on fake tensors to predict a size (``initial_batchsize="auto"``, or its own
# model=). Placing models there would pin memory and copy weights under the fake mode, and
# leave fake tensors in the models (the inner model then had "tensors on the meta device"
# at its first real call, and the call failed). So inside a trace a decorated function
# neither places nor moves its models: before its first real call it ends the trace with
# ``NotYet`` (that call of the outer function runs from its initial size, placing the inner
# models, and its next call is traced again), and once placed it runs as placed, its
# pagers making fake copies as they do under any trace. Whatever it learns from real calls
# (sizes that fit, the host time that chooses paging or chunking, its own first size) is
# not learned from fake ones: see ``SizeRecord.after_success``, ``HostClock`` and
# ``AutoStart.decide``.


class _CallSite:
    """What the size cache reads of a call's frames (code object, instruction offset and line
    of the four innermost outside adaptmem: see [Note: call sites] in cache.py), without the
    frames. A coroutine runs after its call returned; holding the caller's frame until then
    would hold that frame's locals (tensors) too, and re-reading it then would see it paused
    elsewhere, a call site of its own."""

    __slots__ = ("f_code", "f_lasti", "f_lineno", "f_back")

    def __init__(self, frame: Any, depth: int = 4) -> None:
        frame = user_frame(frame)
        self.f_code = frame.f_code
        self.f_lasti = frame.f_lasti
        self.f_lineno = frame.f_lineno
        back = user_frame(frame.f_back)
        self.f_back = _CallSite(back, depth - 1) if back is not None and depth > 1 else None


# [Note: calls from several threads] A paged model runs one forward at a time (its pager
# refuses a second thread's), the first call places the models, and later calls may give
# residency back, explore it, or switch to chunking: all state of one decorated function.
# Calls from several threads (a web server's workers) therefore run one at a time, under a
# lock per decorated function, held for the synchronous part of a call (placing, the
# function, giving back, measuring). Two threads making the first call used to place the
# models twice (one failing with "already paged by adaptive.page", or leaving the counting
# hooks of the loser on the model). A generator's or coroutine's work runs after the call
# returns, outside the lock, as before.
class Dispatched:
    """A decorated function whose decorator also places its models: call it as the plain
    decorated function; ``placement`` says where the models are, ``remove()`` gives them
    back as they were (the next call places them again)."""

    def __init__(self, inner: Any, placed: PlacedModels, context: Any) -> None:
        functools.update_wrapper(self, inner)
        self.__wrapped__ = inner.__wrapped__  # the user's function, as without model=
        vars(self).pop("_run", None)  # a grouped batch's own bound _run came along with it
        self.inner, self.placed, self.user_context = inner, placed, context
        self.explorer = Explorer(placed.models[0], placed.weights, placed.name)
        # A generator's or coroutine's work runs after the call returns, where no call can be
        # timed: one that returned one is not explored ([Note: exploring residency]).
        self.lazy = False
        # The size that last ran paged and the smallest known to fail there, to carry over.
        self.paged_size: int | None = None
        self.paged_fails: int | None = None
        # See [Note: a decorated function that is collected] in placed.py.
        weakref.finalize(self, _collected, placed, self.explorer).atexit = False
        self.one_at_a_time = threading.RLock()  # See [Note: calls from several threads]
        renew_after_fork(self, _new_lock)  # See [Note: locks across a fork] (_common/forks)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return self.run(sys._getframe(1), self.inner, args, kwargs)

    def run(self, caller: Any, target: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], again: bool = False) -> Any:
        """Call ``target`` (the decorated function, or it bound to an instance) as if from
        ``caller``, placing the models first and giving residency back when compute runs
        out at the smallest size (``again``: this call runs again after that)."""
        with self.one_at_a_time:
            return self._run(caller, target, args, kwargs, again)

    def _run(self, caller: Any, target: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any], again: bool) -> Any:
        placed, inner, explorer = self.placed, self.inner, self.explorer
        if fake_mode() is not None:  # See [Note: called inside another decorator's trace]
            if not placed.placed:
                raise NotYet(
                    f"{placed.name} (model=) was called for the first time inside the "
                    f"trace: its models are placed at its first real call")
            return target.call_from(caller, args, kwargs)
        first = not placed.placed
        while True:
            engine = placed.engine
            if engine == PAGE and placed.may_switch and not again:
                # The record paging used, before the switch changes the free memory it is
                # filed under (see [Note: paging or chunking]).
                self.paged_fails = target.size_record(caller).fails
            placed.ensure(again)
            inner.context = (self.user_context, placed.key())
            if first and not again:
                self._record(caller, target, moved=True)  # its weights took memory
            if placed.engine != engine:  # see [Note: paging or chunking]
                explorer.switched(placed.changes.placements)
                if engine == PAGE:
                    self.paged_size = inner.stats.last_size
                if self.paged_size is not None:
                    _carry_size(self.paged_size, self.paged_fails if inner.probes else None,
                                target.size_record(caller))
            watching = explorer.watching and not self.lazy  # [Note: exploring residency]
            if watching:
                failed, mark = inner.stats.failed_attempts, explorer.mark()
            try:
                with transfer_errors_shrink(lambda: placed.handles):
                    result = target.call_from(caller, args, kwargs)
            except OutOfMemoryError as exc:
                recover = self._recovery(exc, caller, target)
                if recover is None:
                    raise
                # The failed attempt's memory goes before giving back: free memory is read
                # then, and what it held is not held by anything now.
                drop_frames(exc)
                del exc
                recover()
                _runs_again(self.inner.stats)
                again = True
                continue
            if first:
                placed.check_no_fakes()
            if result.__class__ is CoroutineType:
                result = named_as(self._awaited(result, _CallSite(caller), target, args,
                                                kwargs), result)
            if watching and result.__class__ in LAZY_TYPES:  # its work is not done yet
                self.lazy = True
                explorer.stop()  # its item counter
                watching = False
            if watching:
                self._measured(caller, target, mark, inner.stats.failed_attempts == failed)
            else:
                explorer.tick(placed.changes.placements)
            return result

    def _recovery(self, exc: OutOfMemoryError, caller: Any, target: Any
                  ) -> Callable[[], None] | None:
        """What makes room before the call runs again after ``exc``: chunking the models for
        good where paging can never hold a weight, giving residency back where that can
        help; None where neither can (``exc`` propagates), or under ``group=`` (the ranks
        would have to agree). Run it once the failed attempt's frames are dropped."""
        reason = "" if self.inner.group is not None else self._chunks_instead(exc)
        if reason:
            return functools.partial(self._chunk_instead, reason)
        if self.inner.group is None and self._gives_back(exc):
            return functools.partial(self._give_back, caller, target)
        return None

    def _gives_back(self, exc: OutOfMemoryError) -> bool:
        """Whether giving residency back can help ``exc``, memory that ran out at the smallest
        size, in compute or while one of our pagers moved a weight (which shrinks the batch
        here too). Another pager's weight gains nothing from ours, nor weights larger than the
        device."""
        return any(self.placed.held()) and not (exc.phase is Phase.TRANSFER and (
            exc.beyond_device or not raised_by(exc, self.placed.handles)))

    def _chunks_instead(self, exc: OutOfMemoryError) -> str:
        """What ``exc`` says when one of our pagers can never hold a weight (beyond the
        device or its memory fraction) on an accelerator, where chunking computes it on the
        host (see [Note: paging or chunking]); "" otherwise."""
        placed = self.placed
        if (exc.phase is Phase.TRANSFER and exc.beyond_device and placed.engine == PAGE
                and placed.device is not None and placed.device.type != "cpu"
                and raised_by(exc, placed.handles)):
            return str(exc).split("\n", 1)[0]
        return ""

    def _chunk_instead(self, reason: str) -> None:
        """Chunk the models for good (the failed attempt is gone: collected here)."""
        gc.collect()
        self.inner.stats.failed_attempts += 1  # the paged attempt ran out of memory
        self.placed.chunk_instead(reason)
        self.explorer.switched(self.placed.changes.placements)

    def _give_back(self, caller: Any, target: Any) -> None:
        """Give residency back to activations (the failed attempt is gone: collected here)."""
        placed, explorer, inner = self.placed, self.explorer, self.inner
        # What ran out is what was held: a residency asked that holds as much (units larger
        # than the difference) is no better (see [Note: held, not asked]).
        held = tuple(placed.held())
        gc.collect()
        placed.give_back()
        explorer.gave_back(held)
        explorer.moved(placed.changes.placements)
        record = self._record(caller, target, moved=True)
        if record.fits is None and record.fails is None:
            # The smallest size failed with more resident: start there, not from the top
            # (see [Note: batch size and residency together]).
            record.after_failure(min(inner.initial, 2 * inner.floor), inner.floor)

    async def _awaited(self, coroutine: Coroutine[Any, Any, Any], caller: Any, target: Any,
                       args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Await a coroutine function's call; where it runs out of memory at the smallest
        size, give residency back and await the call again, as ``run`` does for a plain
        function (the call had returned before its work began). ``caller`` is the call's
        ``_CallSite``: the same call site, and so the same size record, as the call's."""
        try:
            return await coroutine
        except OutOfMemoryError as exc:
            recover = self._recovery(exc, caller, target)
            if recover is None:
                raise
            drop_frames(exc)
        del coroutine
        recover()
        _runs_again(self.inner.stats)
        # Awaited the same way: a further failure gives back again, down to nothing.
        return await self.run(caller, target, args, kwargs, again=True)

    def _record(self, caller: Any, target: Any, moved: bool = False) -> Any:
        """The size record of the placement in force, for a call from ``caller``; after the
        placement ``moved``, in the free-memory bucket it leaves, not the one read before."""
        self.inner.context = (self.user_context, self.placed.key())
        if moved:
            cache = resolve_cache(self.inner.cache)
            if isinstance(cache, StacktraceMemoryBatchsizeCache):
                cache.memory_changed()
        return target.size_record(caller)

    def _measured(self, caller: Any, target: Any, mark: tuple[float, int],
                  clean: bool) -> None:
        """Tell the explorer how a call went; move the models where it says, and tell the
        new placement's size record what is known (see [Note: exploring residency])."""
        placed, explorer, inner = self.placed, self.explorer, self.inner
        size = inner.stats.last_size or 0
        device = placed.device
        record = target.size_record(caller)
        fails = record.fails
        move = explorer.observe(
            mark, tuple(placed.resident), placed.changes.placements, size, clean,
            lambda: free_memory(device) if device is not None else 0)
        if move is not None and size:
            self._move(caller, target, move, size, fails)
        if explorer.watching:
            self._record(caller, target).hold(1)  # measured at one size: no probe yet

    def _move(self, caller: Any, target: Any, move: tuple[tuple[int, ...], int], size: int,
              fails: int | None) -> None:
        placed, explorer, inner = self.placed, self.explorer, self.inner
        resident, direction = move
        before = list(placed.resident)
        try:
            placed.move(list(resident))
        except Exception as exc:
            if not is_oom(exc):
                raise
            # The weights themselves did not fit: back where they were, never that again.
            explorer.gave_back(resident)
            try:
                placed.move(before)
            except Exception as again:
                if not is_oom(again):
                    raise
                # Nothing placed now (all or nothing): the next call places afresh.
            explorer.moved(placed.changes.placements)
            return
        explorer.moved(placed.changes.placements)
        record = self._record(caller, target, moved=True)
        if record.fits is not None or record.fails is not None:
            return  # measured here before: it knows better
        prediction = inner.prediction
        if direction > 0 and prediction is not None and placed.device is not None:
            # Less room: start where the first call's prediction says the size fits next to
            # the added weights (never above the size in use), and climb towards where it
            # says nothing fits, or what failed with more room, whichever is smaller (only
            # what failed for work that never probes: see SizeRecord.start_at).
            free = free_memory(placed.device)
            start = max(inner.floor, min(size, prediction.largest(free)))
            bound = fails
            if inner.probes:
                failing = prediction.largest(free, 1.0) + 1
                bound = failing if fails is None else min(failing, fails)
            if bound is not None and bound <= start:  # a prediction below the floor
                bound = fails if fails is not None and fails > start else None
            record.start_at(start, bound)
        elif direction > 0:
            # Less room: what failed with more fails here; start below it.
            record.after_failure(max(fails or 2 * size, inner.floor), inner.floor)
        else:
            # More room: the size in use fits. Work that probes climbs towards what failed
            # with less room, not an unbounded guess that costs a failure; a probe tests
            # that bound later (for work that never probes it would be a ceiling for good).
            record.after_success(size)
            if fails is not None and fails > size and inner.probes:
                record.fails = fails

    def __set_name__(self, owner: type, name: str) -> None:
        self.inner.__set_name__(owner, name)  # see [Note: methods] in decorators.py

    def __repr__(self) -> str:
        return _with_models(repr(self.inner), self.placed)

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The signature callers see (read now: a method learns it is one late)."""
        return getattr(self.inner, "__signature__", None)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        bound = self.inner.__get__(obj, objtype)
        return self if bound is self.inner else _BoundDispatched(self, bound)

    def __reduce__(self) -> str:
        # Pickled by name, like the function it replaces (for multiprocessing and spawn).
        return self.__qualname__  # type: ignore[no-any-return,attr-defined]

    @property
    def placement(self) -> dict[str, Any]:
        """Device, weight bytes and resident bytes (held on the device, ``resident_bytes``,
        and the share asked of the engine, ``resident_asked``) per model, the engine
        (``"resident"``, ``"page"``, ``"chunk"``) and the figures it was chosen by, and how
        often they changed."""
        return self.placed.as_dict()

    @property
    def pagers(self) -> list[Any]:
        """The ``Pager`` of each model (empty before the first call, after ``remove`` and
        while the models are chunked)."""
        return list(self.placed.pagers)

    @property
    def stats(self) -> Any:
        """The decorated function's ``CallStats`` (attempts, failed attempts, sizes)."""
        return self.inner.stats

    @property
    def prediction(self) -> Any:
        return self.inner.prediction

    @property
    def initial(self) -> Any:
        return self.inner.initial

    def remove(self) -> None:
        """Give the models back as they were before the first call (once calls return)."""
        with self.one_at_a_time:
            self.explorer.stop()
            self.explorer.forget()
            self.paged_size = self.paged_fails = None
            self.placed.remove()


def _new_lock(dispatched: Dispatched) -> None:
    dispatched.one_at_a_time = threading.RLock()


def _collected(placed: PlacedModels, explorer: Explorer) -> None:
    """A decorated function was collected: its item counter off, its models given back
    (see [Note: a decorated function that is collected] in placed.py)."""
    explorer.stop()
    placed.abandon()


def _runs_again(stats: Any) -> None:
    """The user's call is made again after giving residency back: one call still, its next
    attempt a retry (the decorated function counts a call at each run)."""
    stats.calls -= 1
    stats.retried()


def _carry_size(size: int, fails: int | None, record: Any) -> None:
    """The engine changed at the same resident bytes (see [Note: paging or chunking]): a
    call site that knows nothing yet under the new one starts from the size that last ran
    paged, instead of searching again from the initial size (the record it learned that
    in is no help: it is filed under the free memory the engine in force then left), and
    climbs towards the smallest size that failed (or was predicted to) paged: chunked, the
    device holds less per item, so that bound errs low and a probe tests it later, where
    an unbounded climb would pay a failure to find the top."""
    if record.fits is None and record.fails is None:
        record.fits = size
        if fails is not None and fails > size:
            record.fails = fails


def _with_models(described: str, placed: PlacedModels) -> str:
    """``described``, the repr of the plain decorated function, naming the models' classes."""
    names = [type(model).__name__ for model in placed.models]
    shown = names[0] if len(names) == 1 else f"[{', '.join(names)}]"
    return f"{described[:-1]} (model={shown})>"


class _BoundDispatched:
    """A ``Dispatched`` method bound as the plain decorator would bind it."""

    __slots__ = ("_dispatched", "_bound")
    __module__ = ModuleOf(__name__, "_dispatched")  # the function's, as a bound method's

    def __init__(self, dispatched: Dispatched, bound: Any) -> None:
        self._dispatched = dispatched
        self._bound = bound

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return self._dispatched.run(sys._getframe(1), self._bound, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dispatched, name)

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The bound method's signature, without its instance."""
        return getattr(self._bound, "__signature__", None)

    def __repr__(self) -> str:
        return _with_models(repr(self._bound), self._dispatched.placed)


def _dispatched(decorate: Callable[..., Any], name: str, func: Any, model: Any,
                options: dict[str, Any]) -> Any:
    if model is None:
        return decorate(func, **options)
    models = check_models(model, f"adaptive.{name}")
    context = options.pop("context", None)
    plain = decorate(None, **options)  # checks every other option now

    def wrap(f: Callable[..., Any]) -> Dispatched:
        inner = plain(f)
        placed = PlacedModels(models, inner.device, inner.__qualname__)
        # See [Note: predicting the first size].
        inner.predict_start(lambda: fakes_put_back(placed.models))
        return Dispatched(inner, placed, context)

    return wrap(func) if func is not None else wrap


MODEL_DOC = """

    With ``model=`` (a module, or a sequence or ``nn.ModuleList`` of modules that share no
    submodule and no tensor, in eval mode) the decorator also
    places the models the function runs: at the first call each is paged onto ``device``
    with as many units resident as fit half the free memory (all of them when the model
    fits), and the function is traced on fake tensors (as for ``"auto"``) to start at the
    size predicted to fit next to them, climbing from there towards the initial size (a
    function that cannot be traced searches from the initial size, as without ``model``;
    a tensor the models made during the traces, such as a cache filled on first use, is put
    back as it was and the prediction dropped);
    an out-of-memory error in compute shrinks the size, one at the smallest size
    gives resident bytes back to activations and runs again, one while weights move makes
    the pager's units finer; a weight the device can never hold chunks the models at once,
    for good, and runs again. A model left partly resident on an accelerator runs its second
    call chunked (``adaptive.chunk``, the rest computed on the host) and stays chunked when
    that host compute per forward costs less than moving the rest over the link, timed
    once. Then it measures items per second at the placement in force, tries twice (else
    half) the resident bytes, and keeps whichever runs faster; it does so again every 1024
    calls and after memory changed, never with a residency it had to give back. Generator
    and async functions, whose work runs after the call returns, shrink as others do; an
    ``async def`` coroutine function gives residency back when it is awaited, a generator
    (or async generator) does not; neither explores it. The decorated function then has
    ``.placement`` (its ``"engine"``: resident, page or chunk), ``.pagers`` and
    ``.remove()`` (done for it when it is collected). See [Note: batch size and residency together] in
    ``adaptmem/_dispatch/placed.py``, [Note: paging or chunking] in ``engine.py`` and
    [Note: exploring residency] in ``explore.py``.
"""


def _with_model(plain: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give a dispatching decorator ``plain``'s name, documentation and signature, plus
    the ``model`` keyword."""
    signature = inspect.signature(plain)
    parameters = [*signature.parameters.values(),
                  inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, default=None)]

    def adopt(dispatching: _F) -> _F:
        functools.update_wrapper(dispatching, plain)
        dispatching.__module__ = __name__  # pickled by name from here, where it lives
        dispatching.__doc__ = (plain.__doc__ or "").rstrip() + MODEL_DOC
        dispatching.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=parameters)
        return dispatching

    return adopt


# The typed forms (see [Note: typed decorators] in _execution/decorated.py): decorator or
# function given, with or without model=.
@overload
def batch(func: None = None, /, *, initial_batchsize: int | Literal["auto"],
          model: None = None, **options: Unpack[BatchOptions]) -> BatchDecorator: ...
@overload
def batch(func: None = None, /, *, initial_batchsize: int | Literal["auto"], model: Models,
          **options: Unpack[BatchOptions]) -> PlacingBatchDecorator: ...
@overload
def batch(func: Callable[Concatenate[int, P], R], /, *,
          initial_batchsize: int | Literal["auto"], model: None = None,
          **options: Unpack[BatchOptions]) -> Decorated[P, R]: ...
@overload
def batch(func: Callable[Concatenate[int, P], R], /, *,
          initial_batchsize: int | Literal["auto"], model: Models,
          **options: Unpack[BatchOptions]) -> PlacingDecorated[P, R]: ...
@_with_model(decorators.batch)
def batch(func: Callable[..., Any] | None = None, *, model: Any = None, **options: Any) -> Any:
    return _dispatched(decorators.batch, "batch", func, model, options)


@overload
def range(func: None = None, /, *, initial_step: int | Literal["auto"],  # noqa: A001
          model: None = None, **options: Unpack[RangeOptions]) -> RangeDecorator: ...
@overload
def range(func: None = None, /, *, initial_step: int | Literal["auto"],  # noqa: A001
          model: Models, **options: Unpack[RangeOptions]) -> PlacingRangeDecorator: ...
@overload
def range(func: Callable[Concatenate[int, int, P], R], /, *,  # noqa: A001
          initial_step: int | Literal["auto"], model: None = None,
          **options: Unpack[RangeOptions]) -> Decorated[Concatenate[int, int, P], list[R]]: ...
@overload
def range(func: Callable[Concatenate[int, int, P], R], /, *,  # noqa: A001
          initial_step: int | Literal["auto"], model: Models,
          **options: Unpack[RangeOptions],
          ) -> PlacingDecorated[Concatenate[int, int, P], list[R]]: ...
@_with_model(decorators.range)
def range(func: Callable[..., Any] | None = None, *, model: Any = None,  # noqa: A001
          **options: Any) -> Any:
    return _dispatched(decorators.range, "range", func, model, options)


@overload
def chunked(func: None = None, /, *, initial_step: int | Literal["auto"],
            model: None = None, **options: Unpack[ChunkedOptions]) -> ChunkedDecorator: ...
@overload
def chunked(func: None = None, /, *, initial_step: int | Literal["auto"], model: Models,
            **options: Unpack[ChunkedOptions]) -> PlacingChunkedDecorator: ...
@overload
def chunked(func: Callable[Concatenate[torch.Tensor, int, int, P], object], /, *,
            initial_step: int | Literal["auto"], model: None = None,
            **options: Unpack[ChunkedOptions],
            ) -> Decorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
@overload
def chunked(func: Callable[Concatenate[torch.Tensor, int, int, P], object], /, *,
            initial_step: int | Literal["auto"], model: Models,
            **options: Unpack[ChunkedOptions],
            ) -> PlacingDecorated[Concatenate[torch.Tensor, P], torch.Tensor]: ...
@_with_model(decorators.chunked)
def chunked(func: Callable[..., Any] | None = None, *, model: Any = None,
            **options: Any) -> Any:
    return _dispatched(decorators.chunked, "chunked", func, model, options)
