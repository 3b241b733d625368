"""``@adaptive.batch(..., model=model)`` (and range, chunked): the decorators of adaptive
execution, also in charge of the models they run (see [Note: batch size and residency
together] in placed.py). Without ``model`` they are exactly those of ``_execution``."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from .._common.errors import OutOfMemoryError, Phase
from .._common.oom import drop_frames
from .._execution import decorators
from .placed import PlacedModels, check_models

__all__ = ["Dispatched", "batch", "range", "chunked"]


class Dispatched:
    """A decorated function whose decorator also places its models: call it as the plain
    decorated function; ``placement`` says where the models are, ``remove()`` gives them
    back as they were (the next call places them again)."""

    def __init__(self, inner: Any, placed: PlacedModels, context: Any) -> None:
        functools.update_wrapper(self, inner)
        self.inner = inner
        self.placed = placed
        self.user_context = context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(sys._getframe(1), self.inner, args, kwargs)

    def run(self, caller: Any, target: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        """Call ``target`` (the decorated function, or it bound to an instance) as if from
        ``caller``, placing the models first and giving residency back when compute runs
        out at the smallest size."""
        placed, inner = self.placed, self.inner
        first = not placed.placed
        while True:
            switching = placed.switching
            placed.ensure()
            inner.context = (self.user_context, placed.key())
            if switching and inner.stats.last_size is not None:
                _carry_size(inner.stats.last_size, target.size_record(caller))
            try:
                result = target.call_from(caller, args, kwargs)
            except OutOfMemoryError as exc:
                # Compute ran out at the smallest size: give residency back to activations.
                if exc.phase is not Phase.COMPUTE or not placed.give_back():
                    raise
                drop_frames(exc)
                inner.context = (self.user_context, placed.key())
                record = target.size_record(caller)
                if record.fits is None and record.fails is None:
                    # The smallest size failed with more resident: start there, not from the
                    # top (see [Note: batch size and residency together]).
                    record.after_failure(min(inner.initial, 2 * inner.floor), inner.floor)
                continue
            if first:
                placed.check_no_fakes()
            return result

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        bound = self.inner.__get__(obj, objtype)
        return self if bound is self.inner else _BoundDispatched(self, bound)

    def __reduce__(self) -> str:
        # Pickled by name, like the function it replaces (for multiprocessing and spawn).
        return self.__qualname__  # type: ignore[no-any-return,attr-defined]

    @property
    def placement(self) -> dict[str, Any]:
        """Device, weight and resident bytes per model, the engine (``"resident"``,
        ``"page"``, ``"chunk"``) and the figures it was chosen by, and how often they
        changed."""
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
        """Give the models back exactly as they were before the first call."""
        self.placed.remove()


def _carry_size(size: int, record: Any) -> None:
    """The engine changed at the same resident bytes, to one that takes no more device
    memory (see [Note: paging or chunking]): a call site that knows nothing yet under the
    new one starts from the size that last ran, instead of searching again from the
    initial size (the old one's record is no help: it is filed under the free memory the
    old engine left)."""
    if record.fits is None and record.fails is None:
        record.fits = size


class _BoundDispatched:
    """A ``Dispatched`` method bound as the plain decorator would bind it."""

    __slots__ = ("_dispatched", "_bound")

    def __init__(self, dispatched: Dispatched, bound: Any) -> None:
        self._dispatched = dispatched
        self._bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._dispatched.run(sys._getframe(1), self._bound, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dispatched, name)


def _dispatched(decorate: Callable[..., Any], name: str, func: Any, model: Any,
                options: dict[str, Any]) -> Any:
    if model is None:
        return decorate(func, **options)
    models = check_models(model, f"adaptive.{name}")
    context = options.pop("context", None)
    plain = decorate(None, **options)  # checks every other option now

    def wrap(f: Callable[..., Any]) -> Dispatched:
        inner = plain(f)
        device = inner.device
        return Dispatched(inner, PlacedModels(models, device, inner.__qualname__), context)

    return wrap(func) if func is not None else wrap


MODEL_DOC = """

    With ``model=`` (a module, or a sequence of modules, in eval mode) the decorator also
    places the models the function runs: at the first call each is paged onto ``device``
    with as many units resident as fit half the free memory (all of them when the model
    fits); an out-of-memory error in compute shrinks the size, one at the smallest size
    gives resident bytes back to activations and runs again, one while weights move makes
    the pager's units finer. A model left partly resident on an accelerator runs its second
    call chunked (``adaptive.chunk``, the rest computed on the host) and stays chunked when
    that host compute per forward costs less than moving the rest over the link, timed
    once. The decorated function then has ``.placement`` (its ``"engine"``: resident, page
    or chunk), ``.pagers`` and ``.remove()``. See [Note: batch size and residency together]
    in ``adaptmem/_dispatch/placed.py`` and [Note: paging or chunking] in ``engine.py``.
"""


def _with_model(plain: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Give a dispatching decorator ``plain``'s name, documentation and signature, plus
    the ``model`` keyword."""
    signature = inspect.signature(plain)
    parameters = [*signature.parameters.values(),
                  inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, default=None)]

    def adopt(dispatching: Callable[..., Any]) -> Any:
        functools.update_wrapper(dispatching, plain)
        dispatching.__module__ = __name__  # pickled by name from here, where it lives
        dispatching.__doc__ = (plain.__doc__ or "").rstrip() + MODEL_DOC
        dispatching.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=parameters)
        return dispatching

    return adopt


@_with_model(decorators.batch)
def batch(func: Callable[..., Any] | None = None, *, model: Any = None, **options: Any) -> Any:
    return _dispatched(decorators.batch, "batch", func, model, options)


@_with_model(decorators.range)
def range(func: Callable[..., Any] | None = None, *, model: Any = None,  # noqa: A001
          **options: Any) -> Any:
    return _dispatched(decorators.range, "range", func, model, options)


@_with_model(decorators.chunked)
def chunked(func: Callable[..., Any] | None = None, *, model: Any = None,
            **options: Any) -> Any:
    return _dispatched(decorators.chunked, "chunked", func, model, options)
