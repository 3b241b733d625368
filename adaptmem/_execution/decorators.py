"""The adaptive decorators: batch, range, chunked, and their execute / explicit forms."""

from __future__ import annotations

import functools
import inspect
import pickle
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

import torch

from .._common.callables import ModuleOf, is_lazy_function
from .._common.devices import resolve_device, whole_number
from .._common.errors import AdaptmemError
from .._common.oom import is_oom, shrinks_size
from .._common.reporting import report
from .accumulate import Accumulation, check_accumulate, refuse_accumulate
from .auto import AUTO, DEFAULT_MAX_BATCHSIZE, AutoStart, has_fakes
from .cache import BatchsizeCache, check_cache, record_for, resolve_cache, user_frame
from .keys import code_key, function_key, instance_of
from .lazy import iterated, retry_lazy
from .progress import Progress
from .ranks import Ranks, check_group, resolve_ranks, run_range_grouped, run_sized_grouped
from .replay import Replay, StepReplay, versions
from .retry import (
    explain_kept_size,
    is_lazy,
    log_moved,
    log_probe,
    relook_for,
    run_range,
    run_sized,
)
from .stats import Adaptation, CallStats, Watch

if TYPE_CHECKING:
    from typing_extensions import Never, Unpack

    from .decorated import BatchOptions, ChunkedOptions, RangeOptions

__all__ = ["CallForms", "DecorateAndRun", "batch", "range", "chunked", "execute", "explicit"]

P = ParamSpec("P")
R = TypeVar("R")

_clock = time.perf_counter  # bound once: read on every call whose size may fail
_LAZY_KINDS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)


def _check_size(value: Any, name: str, example: str) -> int:
    """``value`` as a plain int: any integer with ``__index__`` (NumPy's, torch's), not a
    bool."""
    if value is None:
        raise TypeError(f"{name} is required: write {example}")
    size = whole_number(value)
    if size is None:
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if size < 1:
        raise ValueError(f"{name} must be 1 or more, got {size}; write {example}")
    return size


def _check_call(name: str, kind: str, names: tuple[str, ...], limit: int | None,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call that passes what the decorator passes (``names``), or more positional
    arguments than ``limit``: ``args`` and ``kwargs`` are what is left after the bounds
    (range) or the tensor (chunked), and the error is in the caller's words for each kind."""
    given = [n for n in names if n in kwargs]
    if kind == "range":
        bounds = " and ".join(names) if len(names) == 2 else "start and end"
        if given:
            raise TypeError(
                f"{name}() got {given[0]}= as well as the range's {bounds} as its first "
                f"two positional arguments; give the bounds once: {name}(0, n, ...)"
                f"{f' or {name}({names[0]}=0, {names[1]}=n, ...)' if len(names) == 2 else ''}")
        if limit is not None and len(args) > limit:
            raise TypeError(
                f"{name}() takes the range's {bounds} and {limit} more positional "
                f"argument(s), but got {len(args)} more")
        return
    injected = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else (
        names[0] if names else "")
    call = f"{name}(tensor, ...)" if kind == "chunked" else f"{name}(...)"
    if given:
        raise TypeError(
            f"{name}() got {given[0]}= from the caller, but @adaptive.{kind} passes "
            f"{injected} itself: call {call} without it")
    if limit is not None and len(args) > limit:
        after, more = ("the tensor to chunk and ", " more") if kind == "chunked" else ("", "")
        raise TypeError(
            f"{name}() takes {after}{limit}{more} positional argument(s), but got "
            f"{len(args)}{more}; @adaptive.{kind} passes {injected} itself, so leave "
            f"{'them' if len(names) > 1 else 'it'} out of the call: {call}")


def _as_index(value: Any, name: str) -> int:
    """``value`` as an int (NumPy and torch integers too), else TypeError."""
    index = whole_number(value)
    if index is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return index


def _name_of(func: Any) -> str:
    """What logs, errors and ``stats`` call a decorated callable: its qualified name; for a
    ``functools.partial``, ``partial(<the function's name>)``; for an object, its class's
    name. Never a repr, which may print a whole model or a tensor's values (and cost as much
    at every call of ``explicit.*``)."""
    partials = 0
    while isinstance(func, functools.partial):
        func, partials = func.func, partials + 1
    name = getattr(func, "__qualname__", None)
    if not isinstance(name, str):
        try:
            name = getattr(inspect.unwrap(func), "__qualname__", None)
        except ValueError:  # a cycle of __wrapped__
            name = None
    if not isinstance(name, str):
        name = f"{type(func).__qualname__} object"
    return "partial(" * partials + name + ")" * partials


def _ran_here_before(record: Any) -> bool:
    """Whether ``record``'s call site knows sizes: its own, one predicted, or those of the
    call site under other free memory (then a call that starts elsewhere than the last one
    moved with free memory; one from a new call site just starts)."""
    site = record.site
    return (record.fits is not None or record.start is not None
            or (site is not None and len(site.records) > 1))


def _check_callable(func: Any, decorator: str, call_form: str = "") -> None:
    """Refuse a ``func`` that is not a function; ``call_form``: how a call form (``explicit``)
    is written, for which there is no decorating."""
    if not callable(func) and not isinstance(func, (staticmethod, classmethod)):
        if call_form:
            raise TypeError(
                f"{decorator} calls a function now: {decorator}({call_form}); got "
                f"{type(func).__name__} {func!r} as the function")
        raise TypeError(
            f"{decorator} decorates a function; got {type(func).__name__} {func!r}. "
            f"Write @{decorator}(...) above a def, or {decorator}(...)(function)"
        )


def _checked(result: Any, name: str, kind: str, starts_only: bool) -> Any:
    """The first real call's result, refused if it holds a fake tensor from a trace."""
    if has_fakes(result):
        if starts_only:
            raise AdaptmemError(
                f"{name} returned a fake tensor made while the traces that predict "
                f"its first size (for model=) ran: it keeps tensors between calls outside "
                f"its model (a cache in a closure or a global), which the traces filled "
                f"with fakes. Keep such a cache in the model (tensors a model keeps are "
                f"put back after the traces), or fill it before the first call, and "
                f"rebuild what it cached"
            )
        raise AdaptmemError(
            f"{name} returned a fake tensor made while its 'auto' traces ran: it "
            f"keeps tensors between calls (a cache, a lazy module), which the traces "
            f"filled with fakes. Give {kind}'s initial size a number instead of "
            f"'auto', and rebuild what it cached"
        )
    return result


_INJECTED = {1: "batch size", 2: "start and end", 3: "chunk, start and end"}
_FIRST = {1: "first positional parameter", 2: "first two positional parameters",
          3: "first three positional parameters"}


# The names a decorated function may give its injected parameters, by position: one found
# at another position is a function written for another convention (``def f(data,
# batchsize)``), which would get the size as its data and the data as its size.
_INJECTED_NAMES = {"batch": {"batchsize": 0, "batch_size": 0},
                   "range": {"start": 0, "end": 1},
                   "chunked": {"chunk": 0, "start": 1, "end": 2}}


def _misplaced(func: Callable[..., Any], kind: str, positional: list[str],
               takes_instance: bool, signature: inspect.Signature) -> str | None:
    """Why ``func`` cannot be called as it is written, when it names an injected parameter
    at another position among ``positional`` (its positional parameters without a default:
    one with a default is an option of its own, ``batch_size=32``): the batch size, or both
    start and end (a function may take a ``start`` of its own); None when it names none
    elsewhere, or the batch size's place holds one of its names already."""
    expected = _INJECTED_NAMES[kind]
    if kind == "batch" and positional[:1] and positional[0] in expected:
        return None
    if kind != "batch" and not {"start", "end"} <= set(positional):
        return None
    for name, at in expected.items():
        if name in positional and (where := positional.index(name)) != at:
            order = [n for n in expected if n != "batch_size"] if kind != "batch" else [name]
            rest = [n for n in positional if n not in order]
            instance = "self, " if takes_instance else ""
            return (
                f"@adaptive.{kind} passes the {_INJECTED[len(set(expected.values()))]} as its "
                f"{_FIRST[len(set(expected.values()))]}{' after the instance' * takes_instance}, "
                f"but {_name_of(func)}{signature} has {name!r} as parameter {where + 1}: "
                f"{positional[at]!r} would get the injected value and {name!r} a caller's "
                f"argument. Put {', '.join(order)} first: def {getattr(func, '__name__', 'f')}"
                f"({instance}{', '.join([*order, *rest])})")
    return None


def _call_shape(func: Callable[..., Any], kind: str, leading: int, takes_instance: bool,
                check: bool = True,
                ) -> tuple[tuple[str, ...], int | None, inspect.Signature | None, str | None]:
    """How ``func``, decorated with ``kind``, is called: the names of the parameters the
    decorator passes (the first ``leading`` after the instance), how many positional
    arguments a caller may pass (None when the function takes ``*args``), the signature a
    caller sees, and why a call without an instance would pass the injected values to the
    wrong parameters (``_misplaced``). Raises ``TypeError`` when any call would, method or
    not (``check``: false for a function in a class body, checked as a method once its class
    is made). Empty or None when the function has no readable signature."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return (), None, None, None
    params = list(signature.parameters.values())
    head, params = (params[:1], params[1:]) if takes_instance and params else ([], params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        names, limit = tuple(p.name for p in positional[:leading]), None
    elif len(positional) < leading:
        raise TypeError(
            f"{_name_of(func)} must take the injected "
            f"{_INJECTED[leading]} as its first parameter{'s' if leading > 1 else ''}"
            f"{' after the instance' if takes_instance else ''}; its signature is {signature}"
        )
    else:
        names, limit = tuple(p.name for p in positional[:leading]), len(positional) - leading
    misplaced = None
    if check:  # a plain function may be set on a class later, and called as a method
        names_given = [p.name for p in positional if p.default is p.empty]
        misplaced = _misplaced(func, kind, names_given, takes_instance, signature)
        if misplaced and (takes_instance or _misplaced(func, kind, names_given[1:], True,
                                                       signature)):
            raise TypeError(misplaced)
    # What the caller passes in place of the injected parameters: the batch size nothing,
    # range's start and end themselves, chunked's one tensor. What it gets back: batch's
    # result, the list of range's step results, chunked's tensor (whatever a step returns).
    returns = signature.return_annotation
    if kind == "batch":
        params = params[len(names[:1]):]
    elif kind == "range":
        returns = _list_of(returns)
    elif kind == "chunked":
        tensor = inspect.Parameter("tensor", inspect.Parameter.POSITIONAL_ONLY)
        head = [p.replace(kind=p.POSITIONAL_ONLY) for p in head]
        params = [tensor, *params[len(names):]]
        returns = torch.Tensor
    try:
        return names, limit, signature.replace(parameters=[*head, *params],
                                               return_annotation=returns), misplaced
    except ValueError:  # a parameter of its own named "tensor"
        return names, limit, None, misplaced


def _list_of(annotation: Any) -> Any:
    """``list[annotation]``, as the annotation was written (a string under ``from __future__
    import annotations``); ``list`` for none."""
    if annotation is inspect.Signature.empty:
        return list
    if isinstance(annotation, str):
        return f"list[{annotation}]"
    return list[annotation]  # type: ignore[valid-type]


class _Adaptive:
    """Shared state of a decorated function: its cache, sizes and argument checks."""

    kind = ""
    leading = 1
    _accumulation: Accumulation | None = None  # batch's accumulate=
    # range and chunked run their steps to completion; see [Note: lazy results] in lazy.py.
    accepts_lazy = False

    what = "step"

    def __init__(
        self, func: Any, initial: int, floor: int, cache: Any, context: Any,
        device: Any, group: Any = None, group_timeout: float = 1800.0,
        on_adapt: Callable[..., Any] | None = None, progress: bool = False,
        auto_ceiling: int | None = None,
    ) -> None:
        # Above @staticmethod / @classmethod: decorate the function, bind as they would.
        self._binding = "static" if isinstance(func, staticmethod) else (
            "class" if isinstance(func, classmethod) else "")
        if self._binding:
            func = func.__func__
        if not self.accepts_lazy and is_lazy_function(func):
            raise TypeError(
                f"adaptive.{self.kind} runs each step to completion and retries it while it "
                f"runs, so it cannot take {_name_of(func)!r}, a generator "
                f"or async function: a step that yields or awaits has done none of its work "
                f"when it returns. Write the step as a plain function (return a list instead "
                f"of yielding), or use @adaptive.batch, which retries generators and coroutines"
            )
        functools.update_wrapper(self, func)  # type: ignore[arg-type]
        self.__wrapped__ = func
        self._func = func
        self.replay_warned = False  # see [Note: arguments a retry passes again]
        self._key = function_key(func)  # see [Note: function keys] in keys.py
        self._instance = instance_of(func)  # see [Note: records per instance] in cache.py
        self.initial = initial
        self.floor = floor
        self.cache = cache
        try:
            hash(context)
        except TypeError:
            raise TypeError(
                f"context={context!r} cannot key the size cache: it must be hashable (a "
                f"str, a number, a tuple), not {type(context).__name__}") from None
        self.context = context
        self.device = None if device is None else resolve_device(device)
        self._name = _name_of(func)
        # Whether a settled call may try a size known to fail: see [Note: probing a failed
        # size] in cache.py (a generator's failure after its first item reaches the caller).
        self._probes = not (inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func))
        # A method called through its class gets its instance as the first argument: a
        # classmethod always, a function once found in a class (see [Note: methods]).
        self._self_first = False
        # The class body the decorator was applied in, if any (see [Note: methods]). Only a
        # namespace frame's locals are read: a function frame's would be snapshotted into a
        # dict the frame keeps, holding the caller's locals (models, tensors) alive.
        here = user_frame(sys._getframe(1))
        scope = (here.f_locals if here is not None
                 and not here.f_code.co_flags & inspect.CO_OPTIMIZED else {})
        self._class_body = scope.get("__qualname__") if "__module__" in scope else None
        self._read_call_shape(self._binding == "class")
        if inspect.iscoroutinefunction(func):
            _mark_coroutine_function(self)
        if group is not None and is_lazy_function(func):
            raise TypeError(
                f"adaptive.{self.kind}(group=...) runs every rank's attempt in step and needs "
                f"it to finish before the ranks compare outcomes; {self._name!r} is a "
                f"generator or async function. Decorate a plain function, or leave group out"
            )
        self.group = group
        self.group_timeout = group_timeout
        self.progress = progress
        # Counted on every call: see [Note: cheap counting] in stats.py.
        self.stats = CallStats(self.kind, self._name, self.what)
        self._watch = Watch(self.stats, on_adapt, self.device)
        report(self, f"{self.kind} {self._name}", self.stats)
        if auto_ceiling is not None and is_lazy_function(func):
            raise TypeError(
                f"an 'auto' initial size is predicted by tracing the function's work, but "
                f"{self._name!r} is a generator or async function, whose work happens after it "
                f"returns; give the initial size a number"
            )
        # An "auto" initial size is decided at the first call (see [Note: starting where it
        # fits] in auto.py); until then ``initial`` is the ceiling.
        size = "batchsize" if self.kind == "batch" else "step"  # the user's own words
        self._auto = (None if auto_ceiling is None else
                      AutoStart(self._name, floor, auto_ceiling, self.device,
                                asked=f"initial_{size}='auto'",
                                largest=f"max_{size}={auto_ceiling}"))
        self._deciding = self._auto is not None
        self._starts_only = False  # the prediction seeds the first record (predict_start)
        self._trace_guard: Callable[[], Any] | None = None

    def _read_call_shape(self, takes_instance: bool) -> None:
        """Read how callers call the function (see ``_call_shape``), given whether it takes
        an instance first."""
        self._self_first = takes_instance
        names, self._limit, signature, self._misplaced = _call_shape(
            self._func, self.kind, self.leading, takes_instance,
            check=takes_instance or self._class_body is None)
        self._leading_names = names
        self._injected = names[0] if names else ""
        if signature is None:
            self.__dict__.pop("__signature__", None)  # inspect follows __wrapped__
        else:
            self.__signature__ = signature

    def __set_name__(self, owner: type, name: str) -> None:
        # Defined in the class body (not a function made elsewhere that the class only
        # names, ``fn = infer``): a method. See [Note: methods].
        qualname = getattr(self._func, "__qualname__", "")
        if not self._binding and (self._class_body == owner.__qualname__
                                  or qualname.startswith(f"{owner.__qualname__}.")):
            self._read_call_shape(True)

    def _ranks(self) -> Ranks:
        ranks = resolve_ranks(self.group, self.group_timeout, self._name)
        self._watch.rank = ranks.rank
        return ranks

    def _progress(self, total: int, ranks: Ranks | None) -> Progress | None:
        """A progress display for this call, if asked for (and on group rank 0 only)."""
        if not self.progress or (ranks is not None and ranks.group_rank != 0):
            return None
        return Progress(self.stats, total, self.what)

    @property
    def prediction(self) -> Any:
        """For an ``"auto"`` initial size, or a first size predicted for ``model=``: the
        ``PeakPrediction`` made at the first call (bytes per item and fixed), or None (not
        decided yet, not predictable, not predicted)."""
        return None if self._auto is None else self._auto.prediction

    def predict_start(self, guard: Callable[[], Any] | None = None) -> bool:
        """Predict where the first call fits, as ``"auto"`` does, but keep the initial size
        the largest one tried: the prediction only tells the first call's size record where
        to start (see [Note: predicting the first size] in auto.py). For ``model=``. False
        when the function cannot be traced (a generator, a coroutine, an accumulating
        step); nothing changes for an ``"auto"`` function, which predicts anyway. ``guard``
        makes a context manager entered around the traces, which yields a list of what the
        traces left behind that it put back: anything in it drops the prediction."""
        if self._auto is None:
            if (is_lazy_function(self._func) or self._accumulation is not None
                    or self.initial <= self.floor):
                return False  # untraceable, or nothing to choose
            self._auto = AutoStart(self._name, self.floor, self.initial, self.device,
                                   asked=f"{self.kind}(model=...)",
                                   largest=f"the initial size, {self.initial}")
            self._starts_only = self._deciding = True
        self._auto.warm_up = True  # see [Note: a model's first forward under a pager]
        self._trace_guard = guard
        return True

    @property
    def probes(self) -> bool:
        """Whether a settled call may try a size known to fail (see [Note: probing a failed
        size] in cache.py): a failure bound that is only predicted or borrowed is given to
        work that probes, and it would be a ceiling for good to work that does not."""
        return self._probes

    def _decide(self, call: Callable[[int], Any], record_of: Callable[[], Any],
                items: int | None) -> bool:
        """Decide an "auto" initial size (or, after ``predict_start``, where the record
        ``record_of()`` returns starts: fetched after the traces, since the free memory it
        is filed under may have been read again meanwhile); True when this call is the first
        to use it. ``items``: the call's item count, where known (see ``AutoStart.decide``)."""
        if self._auto is not None:
            if self._trace_guard is None:
                decided = self._auto.decide(call, items)
            else:
                with self._trace_guard() as left:
                    decided = self._auto.decide(call, items)
                if left:
                    self._auto.forget(f"the traces made fake tensors that the function or its "
                                      f"model kept ({', '.join(left[:3])}); put back as they "
                                      f"were")
                    decided = self._auto.initial
            if decided is None:
                return False  # too few items to tell: this call runs from the ceiling
            if not self._starts_only:
                self.initial = decided
            elif self._auto.prediction is not None and decided < self.initial:
                failing = self._auto.failing() if self.probes else None
                record_of().start_at(decided, failing)
        self._deciding = False
        return True

    def _first(self, call: Callable[[int], Any], rerun: Callable[[], Any],
               record_of: Callable[[], Any], items: int | None = None) -> Any:
        """A call that traces first: decide, then run for real (``rerun``) and check what it
        returns. A call too small to tell, or one whose traces failed and which fails for
        real (not out of memory), leaves the decision to the next one. ``items``: how many
        items the call has, where the decorator knows."""
        decided = self._decide(call, record_of, items)
        self._deciding = False
        ok = False
        try:
            result = _checked(rerun(), self._name, self.kind, self._starts_only)
            ok = True
            return result
        except BaseException as exc:
            ok = is_oom(exc)  # it ran: see [Note: a trace that fails like its call]
            raise
        finally:
            if decided and self._auto is not None and not self._auto.ran(ok):
                decided = False  # a call that failed for real: the next one decides
            self._deciding = not decided

    def __reduce__(self) -> str:
        # Pickled by name, like the function it replaces (for multiprocessing and spawn).
        return self.__qualname__  # type: ignore[no-any-return,attr-defined]

    # [Note: methods] Whether a call through the class (``Model.infer(model, x)``) passes
    # the instance first is decided by where the function is defined, not by the name of
    # its first parameter (``this`` is as good as ``self``, and a plain function may call
    # its first parameter ``self``): a decorated function defined in a class body (the
    # decorator was applied there, or its qualified name starts with the class's, seen by
    # ``__set_name__``; a wrapper another decorator made without ``functools.wraps`` has a
    # name of its own) is a method. One
    # defined elsewhere that a class only names (``fn = infer``) stays a function for
    # direct calls and calls through the class; read through an instance it is bound to it,
    # as any function is. Nothing here changes when the function is read (``__get__``):
    # the decorated object is shared. Above ``@staticmethod`` it is not a method; above
    # ``@classmethod`` it always gets the class. Written under ``@staticmethod`` it is
    # rightly none (that decorator hides it); under ``@classmethod`` only Pythons before
    # 3.13 bind it (through ``__get__``), so the adaptive decorator goes above
    # ``@classmethod``.

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        binding = self._binding
        if binding == "class":
            return _BoundAdaptive(self, objtype if objtype is not None else type(obj))
        if binding == "static":
            return self
        if obj is None:
            return self  # through the class, a method gets its instance from the caller
        return _BoundAdaptive(self, obj)

    def call_from(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call with ``args`` as if from the frame ``caller``: for a wrapper that must not
        become every call's call site (the default cache keys sizes by call site)."""
        if self._self_first:
            return self._run(caller, args[1:], kwargs, args[:1])
        return self._run(caller, args, kwargs, self._unbound() if self._misplaced else ())

    def _run(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             bound: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def _unbound(self) -> tuple[()]:
        """A call without an instance of a function that names an injected parameter at
        another position (see ``_call_shape``): ``TypeError``. Called only then: the
        success path reads ``_misplaced`` and calls nothing."""
        raise TypeError(self._misplaced)

    def size_record(self, caller: Any, bound: tuple[Any, ...] = ()) -> Any:
        """The ``SizeRecord`` a call from the frame ``caller`` uses now (its cache, context,
        device, call site and instance, ``bound``)."""
        return self._record(caller, bound)[1]

    def _check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _check_call(self._name, self.kind, self._leading_names, self._limit, args, kwargs)

    def _steps(self, body: Callable[[int, int], Any], start: int, end: int, record: Any,
               cache: BatchsizeCache, ranks: Ranks | None,
               deliver: Callable[[int, int, Any], None] | None = None,
               probe: bool = False, relook: Callable[[], Any] | None = None) -> list[Any]:
        """Run ``body`` over ``[start, end)`` in steps: alone, or in step with ``ranks``
        (``relook``: see ``run_sized``)."""
        progress = self._progress(end - start, ranks)
        try:
            if ranks is not None:
                return run_range_grouped(
                    body, start, end, record, ranks, initial=self.initial, floor=self.floor,
                    name=self._name, device=self.device, cache=cache, watch=self._watch,
                    deliver=deliver, probe=probe, progress=progress)
            return run_range(body, start, end, record, initial=self.initial, floor=self.floor,
                             name=self._name, device=self.device, cache=cache,
                             deliver=deliver, probe=probe, watch=self._watch,
                             progress=progress, relook=relook)
        finally:
            if progress is not None:
                progress.close()

    def __repr__(self) -> str:
        return f"<adaptive.{self.kind} {self._name}>"

    def _record(self, caller: Any, bound: tuple[Any, ...] = ()) -> tuple[BatchsizeCache, Any]:
        cache = resolve_cache(self.cache)
        owner = bound[0] if bound and self._binding != "class" else self._instance
        return cache, record_for(cache, self._key, self.context, self.device, caller, owner)


class _Batch(_Adaptive):
    kind = "batch"
    what = "batchsize"

    accepts_lazy = True

    def __init__(self, func: Any, initial: int, floor: int, cache: Any, context: Any,
                 device: Any, accumulation: Accumulation | None = None,
                 **options: Any) -> None:
        if accumulation is not None:
            accumulation.refuse_lazy(func)
        self._accumulation = accumulation
        super().__init__(func, initial, floor, cache, context, device, **options)
        if self.group is not None:  # the success path of _run need not ask
            self._run = self._run_grouped  # type: ignore[method-assign]

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if self._self_first:  # Model.infer(model, x): the instance comes first
            return self._run(sys._getframe(1), args[1:], kwargs, args[:1])
        return self._run(sys._getframe(1), args, kwargs, self._unbound() if self._misplaced else ())

    def _run(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             bound: tuple[Any, ...]) -> Any:
        # The checks of _check_call, inlined: this is the success path.
        limit = self._limit
        if (limit is not None and len(args) > limit) or (kwargs and self._injected in kwargs):
            self._check_call(args, kwargs)
        cache = resolve_cache(self.cache)
        owner = bound[0] if bound and self._binding != "class" else self._instance
        record = (cache.record(self._key, self.context, self.device, caller) if owner is None
                  else record_for(cache, self._key, self.context, self.device, caller, owner))
        if self._deciding:
            return self._first_call(caller, args, kwargs, bound)
        # See [Note: a retried training step counts its gradients once].
        accumulation = self._accumulation
        func = self._func if accumulation is None else accumulation.guard(self._func)
        size = record.next_size(self.initial, self.floor, self._probes)
        stats = self.stats
        stats.calls += 1
        fits = record.fits
        started = None
        probing = fits is not None and size > fits
        if fits is None or probing:  # it may fail: time it (see [Note: cheap counting])
            if probing:
                log_probe(record, size, self._name, "batchsize", self._watch)
            started = _clock()
        if (not probing and size != stats.last_size and stats.last_size is not None
                and _ran_here_before(record)):  # not a new call site starting out
            log_moved(size, stats.last_size, self._name, "batchsize", self._watch)
        # The success path: one attempt, no closure, no gc, no probing.
        before = versions(args, kwargs)  # see [Note: arguments a retry passes again]
        try:
            result = func(*bound, size, *args, **kwargs)
        except Exception as exc:
            if not shrinks_size(exc):
                explain_kept_size(exc, self._name, "batchsize")
                raise
            failure = exc
        else:
            if is_lazy(result):
                return self._lazy(result, size, record, cache, bound, args, kwargs)
            if accumulation is not None and func.ran(size) < size:  # type: ignore[attr-defined]
                # See [Note: a batch shorter than its size]: like a range's last step, it
                # says nothing of sizes (nor of where the next call starts).
                record.after_short_success(func.ran(size))  # type: ignore[attr-defined]
                return result
            record.after_success(size)
            if size != stats.last_size:
                stats.saw(size)
            return result
        relook = relook_for(cache, lambda: self._record(caller, bound)[1])
        result, size = run_sized(
            Replay(self, self._name, args, kwargs, before).wrap(
                lambda s: func(*bound, s, *args, **kwargs), True), size, record,
            floor=self.floor,
            name=self._name, what="batchsize", device=self.device, cache=cache, failure=failure,
            watch=self._watch, started=started, relook=relook,
            ran=None if accumulation is None else func.ran,  # type: ignore[attr-defined]
        )
        if is_lazy(result):  # the record the retries moved to, if they did
            return self._lazy(result, size, record if relook is None else relook(), cache,
                              bound, args, kwargs)
        return result

    def _first_call(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    bound: tuple[Any, ...]) -> Any:
        func = self._func
        return self._first(lambda s: func(*bound, s, *args, **kwargs),
                           lambda: self._run(caller, args, kwargs, bound),
                           lambda: self._record(caller, bound)[1])

    def _lazy(self, result: Any, size: int, record: Any, cache: BatchsizeCache,
              bound: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # See [Note: lazy results] in lazy.py.
        if self._accumulation is not None:
            self._accumulation.refuse_lazy_result(result, self._name)
        if result.__class__ is not types.CoroutineType:
            self._probes = False  # see [Note: probing a failed size] in cache.py
        func, name = self._func, self._name
        if result.__class__ in _LAZY_KINDS:
            restart: Callable[[int], Any] = lambda s: func(*bound, s, *args, **kwargs)  # noqa: E731
        else:  # an iterator: handed over as a generator, and so is each retry's
            result = iterated(result, name)
            restart = lambda s: iterated(func(*bound, s, *args, **kwargs), name)  # noqa: E731
        return retry_lazy(result, size, restart, record, self.floor, name, self.device, cache,
                          self._watch)

    def _run_grouped(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     bound: tuple[Any, ...]) -> Any:
        # See [Note: ranks in step] in ranks.py.
        self._check_call(args, kwargs)
        ranks = self._ranks()
        cache, record = self._record(caller, bound)
        if self._deciding:
            return self._first_call(caller, args, kwargs, bound)
        # See [Note: a retried training step counts its gradients once].
        accumulation = self._accumulation
        func = self._func if accumulation is None else accumulation.guard(self._func)
        size = record.next_size(self.initial, self.floor, self._probes)
        log_probe(record, size, self._name, "batchsize", self._watch)
        self.stats.calls += 1
        replay = Replay(self, self._name, args, kwargs, versions(args, kwargs))
        result, _ = run_sized_grouped(
            replay.wrap(lambda s: func(*bound, s, *args, **kwargs), False), size, record, ranks,
            floor=self.floor,
            name=self._name, what="batchsize", device=self.device, cache=cache,
            watch=self._watch,
        )
        return result


class _Range(_Adaptive):
    kind = "range"
    leading = 2

    @property
    def probes(self) -> bool:
        return False  # a failed step's writes are redone: see [Note: probing a failed size]

    def __call__(self, /, *args: Any, **kwargs: Any) -> list[Any]:
        if self._self_first:
            return self._run(sys._getframe(1), args[1:], kwargs, args[:1])
        return self._run(sys._getframe(1), args, kwargs, self._unbound() if self._misplaced else ())

    def _run(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             bound: tuple[Any, ...]) -> list[Any]:
        if len(args) < 2:
            args, kwargs = self._bounds_from_keywords(args, kwargs)
        start, end, rest = _as_index(args[0], "start"), _as_index(args[1], "end"), args[2:]
        args = (start, end, *rest)
        if end < start:
            raise ValueError(f"end ({end}) is before start ({start}); the range is [start, end)")
        self._check_call(tuple(rest), kwargs)
        ranks = self._ranks() if self.group is not None else None
        cache, record = self._record(caller, bound)
        func = self._func
        # See [Note: arguments a retry passes again]
        step = StepReplay(Replay(self, self._name, rest, kwargs, None, first=3),
                          lambda s, e: func(*bound, s, e, *rest, **kwargs))
        if self._deciding and end > start:
            return self._first(  # type: ignore[no-any-return]
                lambda n: step(start, min(end, start + n)),
                lambda: self._run(caller, args, kwargs, bound),
                lambda: self._record(caller, bound)[1], end - start)
        return self._steps(step, start, end, record, cache, ranks,
                           relook=relook_for(cache, lambda: self._record(caller, bound)[1]))

    def _bounds_from_keywords(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``fill(start=0, end=n)`` (or ``fill(0, end=n)``): the range's bounds given by the
        names the function gives them, moved to the front of ``args``."""
        names, name = self._leading_names, self._name
        missing = names[len(args):]
        if len(names) < 2 or not all(label in kwargs for label in missing):
            by_name = f" or {name}({names[0]}=0, {names[1]}=n, ...)" if len(names) == 2 else ""
            raise TypeError(
                f"{name}() needs the range's start and end: call {name}(0, n, ...){by_name}; "
                f"got {len(args)} positional argument(s) and keywords {sorted(kwargs)}")
        kwargs = dict(kwargs)
        return (*args, *(kwargs.pop(name) for name in missing)), kwargs


class _Chunked(_Adaptive):
    kind = "chunked"
    leading = 3

    def __init__(self, func: Callable[..., Any], initial: int, floor: int, cache: Any,
                 context: Any, device: Any, dimension: int, output: str | None,
                 **options: Any) -> None:
        self.dimension = dimension
        self.output = output
        super().__init__(func, initial, floor, cache, context, device, **options)

    @property
    def probes(self) -> bool:
        return self.output is not None  # in place, a failed step's writes are redone

    def __call__(self, /, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._self_first:
            return self._run(sys._getframe(1), args[1:], kwargs, args[:1])
        return self._run(sys._getframe(1), args, kwargs, self._unbound() if self._misplaced else ())

    def _run(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             bound: tuple[Any, ...]) -> torch.Tensor:
        if not args:
            raise TypeError(
                f"{self._name}() takes the tensor to chunk as its first positional argument: "
                f"call {self._name}(tensor, ...); got no positional argument"
                f"{f' and keywords {sorted(kwargs)}' if kwargs else ''}")
        tensor, rest = args[0], args[1:]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self._name}() takes the tensor to chunk as its first argument, "
                            f"got {type(tensor).__name__}")
        dim = self.dimension
        if tensor.dim() == 0:
            raise ValueError(
                f"{self._name}() got a 0-dim tensor, which has no dimension to chunk along; "
                f"pass a tensor with at least one dimension (tensor.reshape(1), say)")
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(
                f"dimension={dim} is out of range for a tensor of shape {tuple(tensor.shape)}; "
                f"use -{tensor.dim()}..{tensor.dim() - 1}"
            )
        self._check_call(tuple(rest), kwargs)
        ranks = self._ranks() if self.group is not None else None
        cache, record = self._record(caller, bound)
        func = self._func

        # See [Note: arguments a retry passes again]
        step = StepReplay(
            Replay(self, self._name, rest, kwargs, None, first=2),
            lambda s, e: func(*bound, tensor.narrow(dim, s, e - s), s, e, *rest, **kwargs),
            tensor, self.output)

        length = tensor.shape[dim]
        if self._deciding and length:
            return self._first(lambda n: step(0, min(length, n)),  # type: ignore[no-any-return]
                               lambda: self._run(caller, args, kwargs, bound),
                               lambda: self._record(caller, bound)[1], length)
        relook = relook_for(cache, lambda: self._record(caller, bound)[1])
        if self.output is None:
            self._steps(step, 0, length, record, cache, ranks, relook=relook)
            return tensor
        writer = _ResultWriter(tensor, dim, self.output == "new", self._name)
        if length == 0 and writer.new:
            # As torch.cat([f(c) for c in x.split(n, dim)], dim) does: one call on the
            # empty chunk says what the output looks like.
            writer(0, 0, step(0, 0))
        self._steps(step, 0, length, record, cache, ranks, deliver=writer, probe=True,
                    relook=relook)
        if writer.new:
            assert writer.out is not None  # the empty case made one above
            return writer.out
        return tensor


class _ResultWriter:
    """Writes a successful step's result where it belongs (see ``chunked``'s ``output``)."""

    def __init__(self, tensor: torch.Tensor, dim: int, new: bool, name: str) -> None:
        self.tensor = tensor
        self.dim = dim
        self.new = new
        self.name = name
        self.out: torch.Tensor | None = None
        self.first = ""  # the first result's shape and span, for errors

    def __call__(self, start: int, end: int, result: Any) -> None:
        dim = self.dim
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"{self.name} returned {type(result).__name__} for [{start}, {end}); with "
                f"output={'new' if self.new else 'input'!r} a step returns its chunk's result "
                f"as a tensor (output=None lets the step write into its chunk instead)"
            )
        if not self.new:
            target = self.tensor.narrow(dim, start, end - start)
            if result.shape != target.shape:
                raise ValueError(
                    f"{self.name} returned shape {tuple(result.shape)} for a chunk of shape "
                    f"{tuple(target.shape)}; with output='input' the result replaces the "
                    f"chunk, so it must have the chunk's shape (output='new' allows others)"
                )
            if target.is_inference() and not torch.is_inference_mode_enabled():
                with torch.inference_mode():  # the step ran under it, the caller does not
                    target.copy_(result)
            else:
                target.copy_(result)
            return
        if not -result.dim() <= dim < result.dim() or result.shape[dim] != end - start:
            raise ValueError(
                f"{self.name} returned shape {tuple(result.shape)} for a chunk of "
                f"{end - start} along dimension {dim}; with output='new' each result keeps "
                f"its chunk's length along that dimension"
            )
        out = self.out
        at = dim % result.dim()
        if out is None:
            shape = list(result.shape)
            shape[at] = self.tensor.shape[dim]
            out = self.out = result.new_empty(shape)
            self.first = f"{tuple(result.shape)} for [{start}, {end})"
        elif [n for i, n in enumerate(result.shape) if i != at] != [
                n for i, n in enumerate(out.shape) if i != at] or result.dim() != out.dim():
            raise ValueError(
                f"{self.name} returned shape {tuple(result.shape)} for [{start}, {end}), "
                f"which does not match the first step's {self.first} outside "
                f"dimension {dim}; with output='new' every step's result has the same shape "
                f"apart from that dimension"
            )
        elif result.dtype != out.dtype or result.device != out.device:
            raise ValueError(
                f"{self.name} returned {result.dtype} on {result.device} for [{start}, {end}), "
                f"where the first step returned {out.dtype} on {out.device}; with "
                f"output='new' every step's result has the first one's dtype and device (the "
                f"output is made from it): convert the result in the step")
        out.narrow(dim, start, end - start).copy_(result)


class _BoundAdaptive:
    # A decorated method bound to its instance (or class): the size goes after it. Other
    # attributes (__name__, __wrapped__, prediction, ...) are the decorated function's, as
    # a bound method's are its function's; so is __doc__, hence no docstring here.

    __slots__ = ("_adaptive", "_obj")
    __module__ = ModuleOf(__name__, "_adaptive")  # the function's, as a bound method's

    def __init__(self, adaptive: _Adaptive, obj: Any) -> None:
        self._adaptive = adaptive
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        if name in _BoundAdaptive.__slots__:  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self._adaptive, name)

    @property  # type: ignore[misc]
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self._adaptive.__doc__

    @property
    def __self__(self) -> Any:
        """The instance (or class) bound, as a bound method's ``__self__``."""
        return self._obj

    @property
    def __func__(self) -> Any:
        """The decorated function, as a bound method's ``__func__``."""
        return self._adaptive

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The decorated method's signature without its instance, as callers see it."""
        signature = getattr(self._adaptive, "__signature__", None)
        if signature is None:
            return None  # the function has none that inspect can read
        params = list(signature.parameters.values())
        if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                         inspect.Parameter.POSITIONAL_OR_KEYWORD):
            params = params[1:]
        return signature.replace(parameters=params)

    def __repr__(self) -> str:
        return (f"<bound adaptive.{self._adaptive.kind} {self._adaptive._name} of "
                f"{self._obj!r}>")

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return self._adaptive._run(sys._getframe(1), args, kwargs, (self._obj,))  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as a bound method is: its instance (or class) and the name of the class
        # attribute that holds the decorated function (``run = adaptive.batch(...)(_impl)``
        # holds it as ``run``, not ``_impl``). Reading the attribute binds anew, so pickling
        # this object by name would fail.
        owner = self._obj if isinstance(self._obj, type) else type(self._obj)
        for klass in owner.__mro__:
            for name, value in list(vars(klass).items()):
                if value is self._adaptive and getattr(
                        getattr(self._obj, name, None), "_adaptive", None) is self._adaptive:
                    return getattr, (self._obj, name)
        raise pickle.PicklingError(
            f"cannot pickle {self!r}: no attribute of {owner.__qualname__} reads as this "
            f"decorated method, so it could not be found again when unpickled; set it on the "
            f"class under a name and pickle it as read from there")

    def call_from(self, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """As ``_Adaptive.call_from``, bound to the instance (or class)."""
        return self._adaptive._run(caller, args, kwargs, (self._obj,))

    def size_record(self, caller: Any) -> Any:
        return self._adaptive.size_record(caller, (self._obj,))

    @property
    def stats(self) -> CallStats:
        """The decorated function's statistics (shared by every instance)."""
        return self._adaptive.stats


def _mark_coroutine_function(adaptive: _Adaptive) -> None:
    """Let frameworks that ask (``inspect`` / ``asyncio.iscoroutinefunction``) see that the
    decorated ``async def`` still returns an awaitable."""
    mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+
    if mark is not None:
        mark(adaptive)
    import asyncio.coroutines

    marker = getattr(asyncio.coroutines, "_is_coroutine", None)  # older Pythons' marker
    if marker is not None:
        adaptive._is_coroutine = marker  # type: ignore[attr-defined]


def _factory(
    cls: type[_Adaptive], func: Any, initial: Any, floor: Any, cache: Any, context: Any,
    device: Any, names: tuple[str, str, str], extra: dict[str, Any], maximum: Any = None,
) -> Any:
    initial_name, floor_name, max_name = names
    example = f"@adaptive.{cls.kind}({initial_name}=512)"
    if isinstance(initial, str) and initial == AUTO:
        ceiling = DEFAULT_MAX_BATCHSIZE if maximum is None else _check_size(
            maximum, max_name, f'@adaptive.{cls.kind}({initial_name}="auto", {max_name}=4096)')
        initial, extra = ceiling, {**extra, "auto_ceiling": ceiling}
    elif maximum is not None and initial is None:
        raise TypeError(
            f"{max_name} caps {initial_name}='auto', and no {initial_name} was given. Write "
            f"{initial_name}='auto', {max_name}={maximum!r}, or give {initial_name} alone "
            f"(the largest size tried)")
    elif maximum is not None:
        raise TypeError(
            f"{max_name} caps {initial_name}='auto'; with {initial_name}={initial!r} the "
            f"initial size is already the largest tried. Drop {max_name}, or write "
            f"{initial_name}='auto', {max_name}={maximum!r}"
        )
    if func is not None and not callable(func):
        raise TypeError(
            f"adaptive.{cls.kind} takes its sizes as keywords: write {example}, "
            f"got {func!r} as the first argument"
        )
    if func is not None and initial is None:
        raise TypeError(f"adaptive.{cls.kind} needs {initial_name}: write {example}")
    if isinstance(initial, str):
        hint = (f"write {initial_name}={AUTO!r} (lower case)" if initial.lower() == AUTO
                else f"write {example}")
        raise TypeError(f"{initial_name} must be a positive int or {AUTO!r}, got str "
                        f"{initial!r}; {hint}")
    initial = _check_size(initial, initial_name, example)
    floor = _check_size(floor, floor_name, example)
    if floor > initial:
        largest = max_name if "auto_ceiling" in extra else initial_name  # what set it
        raise ValueError(
            f"{floor_name} ({floor}) is larger than {largest} ({initial}); "
            f"lower {floor_name} or raise {largest}"
        )
    if cache is not None:
        check_cache(cache, "cache")
    check_group(extra.get("group"), extra.get("group_timeout"), cls.kind)
    on_adapt = extra.get("on_adapt")
    if on_adapt is not None and not callable(on_adapt):
        raise TypeError(f"on_adapt must be a function taking one adaptive.Adaptation (or "
                        f"None), got {type(on_adapt).__name__} {on_adapt!r}")
    progress = extra.get("progress", False)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {type(progress).__name__} "
                        f"{progress!r}")

    def decorate(f: Callable[..., Any]) -> Any:
        _check_callable(f, f"adaptive.{cls.kind}")
        return cls(f, initial, floor, cache, context, device, **extra)

    return decorate(func) if func is not None else decorate


def batch(
    func: Callable[..., Any] | None = None,
    *,
    initial_batchsize: int | str | None = None,
    min_batchsize: int = 1,
    cache: Any = None,
    context: Any = None,
    device: Any = None,
    accumulate: Any = None,
    group: Any = None,
    group_timeout: float = 1800.0,
    on_adapt: Callable[[Adaptation], Any] | None = None,
    max_batchsize: int | None = None,
) -> Any:
    """Retry ``func`` with a smaller batch size when it runs out of memory.

    The decorated function takes the batch size as its first parameter (after ``self`` or
    ``cls`` for a method; above ``@staticmethod`` / ``@classmethod`` too); callers leave it
    out. Sizes that worked are remembered per call site and free memory (see ``cache``), and
    later calls probe upward in modest steps, backing off after a failure, settling within
    10% of the largest size that fits (see [Note: a quiet search] in cache.py).
    A settled size below a failed one tries the failed one again after 32 successful calls,
    then 64, 128, ... while it keeps failing, so memory that was short for a while is not
    held against later calls.

    Generators and ``async def`` functions are run where their work happens: a coroutine is
    awaited and retried whole; a generator (sync or async) is retried until it yields its
    first item, and an out-of-memory error after that is not retried (the items already
    yielded would come again) but raised as ``adaptmem.OutOfMemoryError``, the next call
    starting smaller. Any other iterator the function returns (``map``, ``filter``, an
    iterator class of one's own; not a file) is lazy the same way: it comes back as a
    generator of its items, retried like one. A size is recorded as fitting only once the
    work ran without running out of memory.

    Args:
        initial_batchsize: the first and largest size tried, or ``"auto"``: at the first
            call the function is traced twice on fake tensors (no memory, no kernels) to
            predict its bytes per item, and the largest size predicted to fit 80% of the
            memory free then becomes the initial size (see ``max_batchsize``). A function
            that cannot be traced (``.item()``, data-dependent shapes, custom kernels) is
            logged once and searched from ``max_batchsize``, and so is one that writes into a
            tensor that existed before the call. A first call whose traces fail and which
            then raises another error than out of memory (data of the wrong shape) decides
            nothing: the next call is traced again. The traces run the function's Python
            code up to five more times at its first call.
        min_batchsize: the smallest size tried before giving up (default 1).
        max_batchsize: with ``initial_batchsize="auto"`` only: the largest size it may
            choose (default 65536).
        cache: a cache class or instance (default: the one ``set_default_cache`` names at
            call time, ``StacktraceMemoryBatchsizeCache`` unless changed).
        context: any hashable; calls with different contexts learn sizes separately.
        device: the device whose free memory keys the cache and whose cache is emptied
            between attempts (default: the current accelerator, else the CPU).
        accumulate: for a training step that accumulates gradients over micro-batches of
            the size it is given (``adaptive.microbatches``): the model (or its parameters).
            Every ``.grad`` (and with a model, every buffer) is put back as it was when the
            call started whenever an attempt raises, so a retry counts no sample twice and
            the step's gradients do not depend on the size that fitted (see
            docs/spilling.md, "Gradient accumulation"). Not for generator or async functions.
        group: ``"world"`` or a ``torch.distributed`` process group: every rank of it uses
            the same batch size on every attempt (the smallest any rank proposes), and if
            any rank runs out of memory all retry smaller together. Every rank must call
            the function the same number of times. Sizes are exchanged over a gloo group
            of adaptmem's own on the CPU. Not for generator or async functions.
        group_timeout: seconds a rank waits for the others at an exchange before raising
            ``RankError`` (default 1800, torch's own default); it must exceed the largest
            difference in time between ranks' attempts.
        on_adapt: called with an ``adaptive.Adaptation`` whenever the size changes (a
            probe upward, a shrink, a size that fitted after a shrink, giving up). Its
            exceptions propagate out of the call (the size record stays consistent).

    Returns:
        The decorated function; calling it returns ``func``'s result. Its ``stats``
        attribute counts calls, attempts, failed attempts, time lost and sizes
        (``adaptive.CallStats``), also shown by ``adaptive.memory_stats()``.

    Raises:
        TypeError / ValueError: at decoration, for a missing or non-positive size,
            ``min_batchsize > initial_batchsize``, an ``accumulate`` that is no module or
            parameters, a ``group`` that is neither ``"world"`` nor a process group, a
            non-callable ``on_adapt``; at call, if the caller passes the batch size.
        RuntimeError: at the first call with ``group``, if torch.distributed is not
            initialised.
        adaptmem.adaptive.RankError: with ``group``, another rank raised (its rank, error
            type and message are named; the rank itself raises its own error), or a rank
            did not answer within ``group_timeout``.
        adaptmem.OutOfMemoryError: memory ran out at ``min_batchsize`` (or in a generator
            after its first item); it is also an instance of the original error's type
            (``torch.OutOfMemoryError``, ``MemoryError``, ...), so an outer decorated
            function shrinks its own size in turn.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> @adaptive.batch(initial_batchsize=64)
        ... def total(batchsize, data):
        ...     return sum(chunk.sum() for chunk in data.split(batchsize))
        >>> int(total(torch.ones(100)))
        100
    """
    accumulation = check_accumulate(accumulate, "adaptive.batch")
    if accumulation is not None and group is not None:
        # A rank whose attempt succeeded while another ran out drops its result, but its
        # gradients are already summed: not supported until the drop puts them back.
        raise ValueError(
            "adaptive.batch(accumulate=..., group=...) is not supported yet: a rank whose "
            "attempt succeeded while another ran out of memory would keep that attempt's "
            "gradients. Use accumulate= without group=, or group= without accumulate="
        )
    if accumulation is not None and initial_batchsize == AUTO:
        raise ValueError(
            "adaptive.batch(accumulate=..., initial_batchsize='auto') is not supported: the "
            "'auto' traces would run the step's backward on fake tensors. Give the "
            "micro-batch size a number"
        )
    return _factory(_Batch, func, initial_batchsize, min_batchsize, cache, context, device,
                    ("initial_batchsize", "min_batchsize", "max_batchsize"),
                    {"accumulation": accumulation, "group": group,
                     "group_timeout": group_timeout, "on_adapt": on_adapt}, max_batchsize)


def range(  # noqa: A001 - the public name mirrors the builtin it adapts
    func: Callable[..., Any] | None = None,
    *,
    initial_step: int | str | None = None,
    min_step: int = 1,
    cache: Any = None,
    context: Any = None,
    device: Any = None,
    accumulate: None = None,
    group: Any = None,
    group_timeout: float = 1800.0,
    on_adapt: Callable[[Adaptation], Any] | None = None,
    progress: bool = False,
    max_step: int | None = None,
) -> Any:
    """Call ``func(s, e, *args)`` over ``[start, end)`` in steps that shrink on OOM.

    The caller writes ``fill(start, end, *args)``. Steps are consecutive, cover the range
    exactly once and in order; a step that runs out of memory is retried at the same offset
    with a smaller step (finished steps are never redone). Returns the list of step results.
    Options as for ``batch`` (``initial_step``, also ``"auto"`` with ``max_step``,
    ``min_step``, ``group``, ``group_timeout``, ``on_adapt``). A step runs to completion
    inside the retry, so generator and async functions are refused at decoration, and a step
    that returns a generator or coroutine raises TypeError. With ``group``, the ranks agree on every step's size; each covers its
    own ``[start, end)`` (ranges may differ in length: a rank that is done waits for the
    others inside the call). ``progress=True`` shows items done, the step and the retries
    (a tqdm bar when tqdm is installed, else a line on the ``adaptmem`` logger every 10 s;
    with ``group``, on the group's rank 0 only). The decorated function has ``stats``.

    Example:
        >>> from adaptmem import adaptive
        >>> @adaptive.range(initial_step=4)
        ... def spans(start, end):
        ...     return (start, end)
        >>> spans(0, 10)
        [(0, 4), (4, 8), (8, 10)]
    """
    refuse_accumulate(accumulate, "range")
    return _factory(_Range, func, initial_step, min_step, cache, context, device,
                    ("initial_step", "min_step", "max_step"),
                    {"group": group, "group_timeout": group_timeout, "on_adapt": on_adapt,
                     "progress": progress}, max_step)


def chunked(
    func: Callable[..., Any] | None = None,
    *,
    initial_step: int | str | None = None,
    min_step: int = 1,
    dimension: int = 0,
    output: str | None = None,
    cache: Any = None,
    context: Any = None,
    device: Any = None,
    accumulate: None = None,
    group: Any = None,
    group_timeout: float = 1800.0,
    on_adapt: Callable[[Adaptation], Any] | None = None,
    progress: bool = False,
    max_step: int | None = None,
) -> Any:
    """Call ``func(chunk, start, end, *args)`` on slices of a tensor along ``dimension``.

    The caller writes ``work(tensor, *args)``; ``chunk`` is ``tensor.narrow(dimension, start,
    end - start)``, a view. Any dimension, negative too. Steps shrink on OOM as in ``range``:
    a step that runs out of memory is run again at the same offset with a smaller step.

    ``output`` says what the step does with its result, and so what a retry can repeat:

    - ``None`` (default): the step writes into ``chunk`` in place; returns ``tensor``.
      **A step that runs out of memory after writing part of its chunk is retried over the
      same elements, so a write that is not idempotent (``chunk += 1``, ``chunk.mul_(2)``)
      is applied twice there.** Compute into a temporary and write it last
      (``chunk.copy_(result)``), or use ``"input"``.
    - ``"input"``: the step returns its chunk's new values (a tensor of the chunk's shape)
      and leaves ``chunk`` alone; they are copied into ``tensor`` only once the step
      succeeded, so a retried step never writes twice. Returns ``tensor``.
    - ``"new"``: the step returns its result for the chunk (same length along
      ``dimension``, any other shape, dtype or device, the same for every step); results
      are written into a new tensor, only once their step succeeded. ``tensor`` is not
      written. Returns the new tensor, as ``torch.cat([f(c) for c in tensor.split(n,
      dimension)], dimension)`` would, without holding every result at once.

    ``group``, ``group_timeout``, ``on_adapt`` and ``progress`` as for ``range`` (the total
    is the tensor's length along ``dimension``); the decorated function has ``stats``.

    Raises:
        ValueError: at decoration, an ``output`` other than None, ``"input"``, ``"new"``;
            at call, a ``dimension`` out of range or a result of the wrong shape.
        TypeError: at decoration, a generator or async function (a step must do its work
            before it returns); at call, a first argument that is not a tensor, or with
            ``output`` set, a step that returns something other than a tensor.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> @adaptive.chunked(initial_step=3, dimension=-1)
        ... def double(chunk, start, end):
        ...     chunk.mul_(2)
        >>> double(torch.ones(2, 5)).sum().item()
        20.0
        >>> @adaptive.chunked(initial_step=3, output="new")
        ... def squares(chunk, start, end):
        ...     return chunk.pow(2)
        >>> squares(torch.arange(5.0)).tolist()
        [0.0, 1.0, 4.0, 9.0, 16.0]
    """
    refuse_accumulate(accumulate, "chunked")
    dim = whole_number(dimension)  # NumPy and torch integers too
    if dim is None:
        raise TypeError(f"dimension must be an int (negative counts from the end), "
                        f"got {type(dimension).__name__} {dimension!r}")
    if output is not None and output not in ("input", "new"):
        raise ValueError(
            f"output must be None (the step writes into its chunk), 'input' (the step "
            f"returns the chunk's new values) or 'new' (the step returns its result and a new "
            f"tensor collects them), got {output!r}"
        )
    return _factory(_Chunked, func, initial_step, min_step, cache, context, device,
                    ("initial_step", "min_step", "max_step"),
                    {"dimension": dim, "output": output, "group": group,
                     "group_timeout": group_timeout, "on_adapt": on_adapt,
                     "progress": progress}, max_step)


# [Note: "auto" in the decorate-and-run forms] ``execute.*`` and ``explicit.*`` decorate anew
# at every call, so an "auto" initial size would be predicted (the function traced) at every
# call. The decision (``AutoStart``: the size decided, or the calls counted so far while
# calls are too small to tell, or a failed trace waiting for its call's outcome) is kept per
# function (its key: a partial's function, a wrapper's wrapped one), call site and options,
# and a later call there goes on from it, as a decorated function does; the call site's size
# record carries what was learnt since. The function itself is never kept. Options that
# change nothing predicted (``on_adapt``, ``progress``) are not part of the key: a callback
# made per request (a partial naming the request) made every call trace again and kept a
# decision per request. At most ``_DECIDED_LIMIT`` decisions are kept, the oldest dropped.
_decided: dict[Any, AutoStart] = {}
_decided_lock = threading.Lock()
_DECIDED_LIMIT = 1024
_NOT_PREDICTED = frozenset({"on_adapt", "progress"})


def _run_now(decorator: Callable[..., Any], initial: Any, options: dict[str, Any],
             caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
             ) -> Callable[[Callable[..., Any]], Any]:
    def run(func: Callable[..., Any]) -> Any:
        decorated = decorator(func)
        key = None
        if (isinstance(initial, str) and initial == AUTO and "model" not in options
                and decorated._auto is not None):
            # Keys, not code objects, which compare by value (see [Note: function keys]).
            key = (decorated.kind, decorated._key, code_key(caller.f_code), caller.f_lineno,
                   tuple(sorted((k, repr(v)) for k, v in options.items()
                                if k not in _NOT_PREDICTED)))
            with _decided_lock:
                known = _decided.get(key)
                if known is None:
                    if len(_decided) >= _DECIDED_LIMIT:
                        del _decided[next(iter(_decided))]
                    _decided[key] = decorated._auto
            if known is not None:
                decorated._auto = known
                if known.initial is not None:
                    decorated.initial = known.initial
                    decorated._deciding = False
        return decorated._run(caller, args, {} if kwargs is None else kwargs, ())

    return run


def _refuse_positional_size(form: str, sizes: tuple[Any, ...], head: str = "") -> None:
    """toma's forms (``execute.batch(64)``) get the keyword to write instead."""
    if sizes:
        keyword = "initial_batchsize" if form == "batch" else "initial_step"
        if callable(sizes[0]):  # execute.batch(fn, 64): explicit's order
            raise TypeError(
                f"adaptive.execute.{form} decorates the function it runs: write adaptive."
                f"execute.{form}({head}{keyword}=64)(fn), or adaptive.explicit.{form}(fn, "
                f"...) to pass the function first; got {sizes[0]!r} as a positional argument")
        raise TypeError(
            f"adaptive.execute.{form} takes its size as a keyword: write adaptive.execute."
            f"{form}({head}{keyword}={sizes[0]!r})(fn), got {', '.join(map(repr, sizes))} as "
            f"positional argument(s)")


# [Note: the call forms' namespaces] ``adaptive.execute`` and ``adaptive.explicit`` are
# instances of classes of static methods, so a type checker knows their forms (a misspelled
# form is an error) and each form's own types. A form reads its caller's frame
# (``sys._getframe(1)``): it is the function itself, never a wrapper. ``*sizes`` is typed
# Never, so toma's positional size is a type error as it is a TypeError at run time; the
# options are typed (see [Note: typed decorators] in decorated.py).
class DecorateAndRun:
    """``adaptive.execute``: decorate a function and run it at once,
    ``execute.batch(initial_batchsize=128)(fn)``. Its forms can be patched on the instance
    (``monkeypatch.setattr(adaptive.execute, "batch", ...)``), as they could on a namespace."""

    @staticmethod
    def batch(*sizes: Never, initial_batchsize: int | Literal["auto"] | None = None,
              **options: Unpack[BatchOptions]) -> Callable[[Callable[[int], R]], R]:
        """Decorate and run at once: ``execute.batch(initial_batchsize=128)(fn)`` calls
        ``fn(batchsize)`` and returns its result."""
        _refuse_positional_size("batch", sizes)
        decorate = batch(initial_batchsize=initial_batchsize, **options)
        return _run_now(decorate, initial_batchsize, dict(options), sys._getframe(1), ())

    @staticmethod
    def range(start: int, end: int, *sizes: Never,
              initial_step: int | Literal["auto"] | None = None,
              **options: Unpack[RangeOptions],
              ) -> Callable[[Callable[[int, int], R]], list[R]]:
        """``execute.range(0, n, initial_step=64)(fn)`` runs ``fn(s, e)`` over ``[0, n)`` now."""
        if sizes:
            _refuse_positional_size("range", sizes, f"{start!r}, {end!r}, ")
        decorate = range(initial_step=initial_step, **options)
        return _run_now(decorate, initial_step, dict(options), sys._getframe(1), (start, end))

    @staticmethod
    def chunked(tensor: torch.Tensor, *sizes: Never,
                initial_step: int | Literal["auto"] | None = None,
                **options: Unpack[ChunkedOptions],
                ) -> Callable[[Callable[[torch.Tensor, int, int], object]], torch.Tensor]:
        """``execute.chunked(t, initial_step=64, dimension=1)(fn)`` runs ``fn(chunk, s, e)``
        now."""
        _refuse_positional_size("chunked", sizes, "tensor, ")
        decorate = chunked(initial_step=initial_step, **options)
        return _run_now(decorate, initial_step, dict(options), sys._getframe(1), (tensor,))

    def __repr__(self) -> str:
        return "adaptive.execute"


class CallForms:
    """``adaptive.explicit``: run a function adaptively in one call,
    ``explicit.batch(fn, 128, *args, **kwargs)``; the forms' own parameters are
    positional-only, so every keyword is the function's. Its forms can be patched on the
    instance, as they could on a namespace."""

    @staticmethod
    def batch(func: Callable[Concatenate[int, P], R],
              initial_batchsize: int | Literal["auto"], /,
              *args: P.args, **kwargs: P.kwargs) -> R:
        """``explicit.batch(fn, 128, *args, **kwargs)`` returns ``fn(batchsize, *args,
        **kwargs)``."""
        _check_callable(func, "adaptive.explicit.batch", "fn, initial_batchsize, *args, **kwargs")
        decorate = batch(initial_batchsize=initial_batchsize)
        return _run_now(  # type: ignore[no-any-return]
            decorate, initial_batchsize, {}, sys._getframe(1), args, kwargs)(func)

    @staticmethod
    def range(func: Callable[Concatenate[int, int, P], R], start: int, end: int,
              initial_step: int | Literal["auto"], /,
              *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``explicit.range(fn, 0, n, 64, *args)`` returns ``[fn(s, e, *args), ...]``."""
        _check_callable(func, "adaptive.explicit.range", "fn, start, end, initial_step, *args")
        decorate = range(initial_step=initial_step)
        return _run_now(  # type: ignore[no-any-return]
            decorate, initial_step, {}, sys._getframe(1), (start, end, *args), kwargs)(func)

    @staticmethod
    def chunked(func: Callable[..., object], tensor: torch.Tensor,
                initial_step: int | Literal["auto"], /, *args: Any, dimension: int = 0,
                output: Literal["input", "new"] | None = None,
                **kwargs: Any) -> torch.Tensor:
        """``explicit.chunked(fn, t, 64, *args, dimension=1)`` runs ``fn(chunk, s, e, *args)``
        (``output=`` as for ``chunked``)."""
        _check_callable(func, "adaptive.explicit.chunked", "fn, tensor, initial_step, *args")
        options: dict[str, Any] = {"dimension": dimension, "output": output}
        decorate = chunked(initial_step=initial_step, dimension=dimension, output=output)
        return _run_now(  # type: ignore[no-any-return]
            decorate, initial_step, options, sys._getframe(1), (tensor, *args), kwargs)(func)

    def __repr__(self) -> str:
        return "adaptive.explicit"


execute = DecorateAndRun()
explicit = CallForms()
for _space, _forms in (("execute", DecorateAndRun), ("explicit", CallForms)):
    for _name in ("batch", "range", "chunked"):  # the names Python's errors and help() show
        vars(_forms)[_name].__func__.__qualname__ = f"adaptive.{_space}.{_name}"
