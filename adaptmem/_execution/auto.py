"""``initial_batchsize="auto"``: start where the call is predicted to fit.

[Note: starting where it fits] A search from a large initial size pays one out-of-memory
error per halving before its first success; on a GPU each is a partial forward thrown away.
So at its first call an ``"auto"`` function is traced twice on fake tensors
(``FakeTensorMode``: shapes and dtypes only, no memory, no kernels; tensors the function
reaches through its arguments or closures are taken as fakes of themselves), at two batch
sizes, while the peak tracker counts the bytes each trace allocates. The two peaks fit
``fixed + per_item * batch`` (see [Note: predicting peak memory on meta] in
``_planning/peak.py``), and the largest batch whose predicted peak stays within 80% of the
memory free at that moment is traced in turn: a peak that is not linear in the batch (the
outputs a function gathers dominate at small sizes) shows there, and the line is drawn again
through the largest size known to fit and the one that did not, at most three times. Two sizes whose
traces allocate the same (the outputs gathered whole outweigh one batch's work there) or
that run too many ops are traced again at 8 and then 64 times those sizes. The
largest size whose own trace fits becomes the function's initial (and largest) size. What fake
tensors cannot see (allocator rounding, workspaces, kernels that allocate outside torch) is
what the margin is for; an out-of-memory error still has the last word and the usual search
takes over from there. A function that cannot run on fake tensors (``.item()``,
data-dependent shapes, custom kernels, tensors of a device the fake mode does not know) is
not predicted: that is logged once and the search starts at ``max_batchsize``.

[Note: a trace that fails like its call] A function that raises on fake tensors is either
one that cannot be traced (``.item()``, data-dependent shapes) or a call that is wrong (data
of the wrong shape), which raises for real too. The real call, made next at the largest
size, tells them apart: when it runs (or runs out of memory), the function cannot be
traced, which is logged once, and the search starts at the largest size for good; when it
raises another error, that error is the user's to fix and says nothing about the function,
so the decision is put off to the next call, which is traced again (``AutoStart.ran``).

[Note: sizes a call can fill] A call runs only the items it has: a trace asked for 16 items
of a call with 9 runs 9 (``x.split(16)`` is one chunk of 9, a range's step stops at its
end), so a line through the traces at 8 and "16" gives an eighth of the bytes an item needs,
and a check trace at the predicted size, capped the same way, passes. So only sizes the call
can fill are traced. ``range`` and ``chunked`` know their call's items (``end - start``, the
tensor's length along the dimension): a call with fewer items than the two sizes need is
too small to tell (``TooFewItems``, put off to the next call like a flat one), and a check
of a size above its items is kept under the item count it ran (it checks the line up to
there; above, the line's word stands). ``batch`` cannot know: its data is whatever the
function makes of its arguments. There the traces show it: a check trace that allocates
exactly what the trace at the larger size did, though memory grew between the two sizes,
ran out of data before that size (fake tensors allocate deterministically, and a call that
has no more items does the same work whatever size it is asked for), and puts the decision
off. A batch call whose data ends exactly at the larger size is put off too; one with more
items than both sizes is checked up to them, as above.

[Note: predicting the first size] ``model=`` (see [Note: batch size and residency together]
in ``_dispatch/placed.py``) makes the same prediction for a function with a numeric initial
size, after placing its models, with one difference: the initial size stays the largest one
tried. The prediction only seeds the first call's size record (``SizeRecord.start_at``): it
starts at the largest size predicted to fit within the margin, and climbs, as after a failure,
towards the smallest size predicted not to fit at all, which a probe tests later like any
failure. So the first search skips the out-of-memory errors the prediction foresees, and a
prediction that is too cautious costs a few climbing calls, not the batch size. A start that
fails halves as the search always does. The traces run the user's code: a model that fills
a cache on first use keeps fake tensors from them, so ``model=`` puts every parameter, buffer
or tensor attribute of its models that the traces left fake back as it was and drops the
prediction (``fakes_put_back`` in ``_dispatch/placed.py``; the same for ``"auto"`` with
``model=``). Work that never probes a failed size (``range``,
``chunked`` in place) gets no predicted failure: for it a bound would be a ceiling for good,
so it climbs from the start as from any size that fits.

[Note: counting the device's bytes only] The traces count only the storages made on the
function's device, because only those compete for the memory free there: a function that
gathers its results on the host (or whose model's engine hands outputs back there, as
``model=`` does) allocates host memory per batch that the device never sees. With a partly
resident model the pager's device copies of the paged units are made under the fake mode
too (fake tensors, no transfer), so the traces count them as the real call will; the
resident weights are on the device before the traces and are in the free memory already.
A function whose traces allocate nothing new on its device while its memory on another grows
with the size (host work on a machine with a GPU, where the device defaults to the
accelerator) never shows growth on its device: the first call says so with a warning naming
that other device and the ``device=`` to pass, and the search starts at the largest size,
instead of tracing again at three calls while the memory looks flat (``Elsewhere``). A
function that only fills memory that existed before (``dev[s:e].copy_(host[s:e])``) grows
nowhere and is put off as a flat one.

[Note: one fake per real tensor] The fake mode turns each real tensor an op reads (a weight,
the data) into a fake, and remembers the fake only while something holds it (torch's memo is
a weak-value dictionary). A weight's fake is dropped as soon as the op that read it returns,
so each forward of a traced loop converted every weight again: a fifth to a quarter of the
trace's time (benchmarks/trace_cost.py: 0.63 against 0.78 ms an op through eight
``Linear(512, 512)`` on a 2-core VM's CPU). A trace keeps the fakes its mode made until it
ends: one conversion per real tensor per trace.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._common.devices import default_device, format_bytes, free_memory
from .._common.forks import renew_after_fork
from .._common.peak import (
    NotPredictable,
    NotYet,
    PeakPrediction,
    PeakTracker,
    fake_mode,
    fit,
    is_fake,
)
from .retry import is_lazy

__all__ = ["AUTO", "DEFAULT_MAX_BATCHSIZE", "AutoStart", "has_fakes"]

logger = logging.getLogger("adaptmem")

AUTO = "auto"
DEFAULT_MAX_BATCHSIZE = 65536
TRACE_SIZES = (8, 16)
CHECKS = 3  # traces of a predicted size before settling on the largest one that fitted
MARGIN = 0.8
LAZY = frozenset({types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType})


OP_BUDGET = 4000  # ops one trace may run before it is retried at larger sizes
FLAT_CALLS = 3  # calls traced again while their memory does not grow with the size
LEVELS = 3  # sizes tried: TRACE_SIZES, then 8x, then 64x, while a trace runs too long


class TooLong(NotPredictable):
    """A trace ran more than ``OP_BUDGET`` ops."""


class Flat(NotPredictable):
    """The traced memory did not grow with the size: too few items to tell, so far."""


class TooFewItems(Flat):
    """The call has fewer items than the sizes traced: it runs only what it has, so a trace
    asked for more measures less than it was asked (see [Note: sizes a call can fill])."""


class Elsewhere(NotPredictable):
    """The traces allocated nothing new on the device the decorator watches while memory on
    another grew with the size: the watched memory is not what bounds the size (see
    [Note: counting the device's bytes only])."""


class TraceFailed(NotPredictable):
    """The function raised on fake tensors: it cannot be traced, or the call is wrong (see
    [Note: a trace that fails like its call])."""


class _Guard(TorchDispatchMode):
    """Sees every op of a trace before the fake mode does: counts them against the budget,
    and refuses a write into a real tensor (an in-place op whose tensors are all real runs
    for real even under the fake mode: a counter's ``add_``, BatchNorm's statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if self.ops > OP_BUDGET:
            raise TooLong(f"more than {OP_BUDGET} ops")
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor) and not is_fake(value):
                raise NotPredictable(
                    f"{func} writes into a tensor that existed before the call (a counter, "
                    f"a running statistic, an output buffer): tracing would change it")
        return func(*args, **kwargs)


_tracing = threading.local()  # .on: this thread runs a trace
_apply_lock = threading.Lock()


def _guard_module_changes() -> None:
    """Make ``nn.Module._apply`` (behind ``.to``, ``.double``, ``.cuda``, ...) refuse, in a
    thread that traces, to change any tensor of a module: under the fake mode the module's
    real parameters would become fakes for good. A call that changes nothing (a model moved
    where it already is) goes through. Installed at the first trace of the process."""
    original = torch.nn.Module._apply
    if getattr(original, "_adaptmem_guard", False):
        return
    with _apply_lock:
        original = torch.nn.Module._apply
        if getattr(original, "_adaptmem_guard", False):
            return

        def _apply(self: torch.nn.Module, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
            if not getattr(_tracing, "on", False):
                return original(self, fn, *args, **kwargs)

            def unchanged(t: torch.Tensor) -> torch.Tensor:
                out = fn(t)
                if out is not t:
                    raise NotPredictable(
                        f"it moves or casts a module ({type(self).__name__}: a "
                        f"{t.dtype} tensor on {t.device} would become {out.dtype} on "
                        f"{out.device}), which a trace on fake tensors must not do to the "
                        f"real module")
                return out

            return original(self, unchanged, *args, **kwargs)

        _apply._adaptmem_guard = True  # type: ignore[attr-defined]
        torch.nn.Module._apply = _apply  # type: ignore[method-assign]


def _trace(call: Callable[[int], Any], size: int, device: torch.device,
           elsewhere: dict[torch.device, int] | None = None) -> int:
    """Bytes ``call(size)`` allocates on ``device`` at its peak, run on fake tensors; its
    peak on each other device goes into ``elsewhere``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _guard_module_changes()
    tracker = PeakTracker(device)  # see [Note: counting the device's bytes only]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    kept = _keep_conversions(mode)
    outer = getattr(_tracing, "on", False)
    _tracing.on = True
    _quiet_fake_tensor_log(True)
    try:
        # No gradients: a backward would set real parameters' .grad to fakes (autograd
        # assigns a missing .grad without an op the guard could see); it fails instead.
        with torch.no_grad(), mode, tracker, _Guard():
            result = call(size)
            if is_lazy(result):  # none of its work done, or not where a trace sees it
                if result.__class__ in LAZY:
                    result.close()  # type: ignore[attr-defined]
                raise NotPredictable(f"the function returned a {type(result).__name__}, whose "
                                     f"work runs as it is read")
            del result
    except NotPredictable:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure on fake tensors: no prediction
        raise TraceFailed(f"{type(exc).__name__}: {exc}") from None
    finally:
        _quiet_fake_tensor_log(False)
        _tracing.on = outer
        kept.clear()
    if elsewhere is not None:
        elsewhere.update(tracker.elsewhere)
    return tracker.peak


# [Note: torch's log during a trace] When an op fails on fake tensors (a shape mismatch),
# torch logs the failure with its traceback at ERROR on its fake tensor logger before it
# raises. The trace turns the error into "no prediction", and the real call raises the
# user's own error: the traceback would only confuse. While a thread traces, a filter on
# that logger drops the records of that thread; other threads' records pass. The filter is
# there only while some thread traces.
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_quiet_lock = threading.Lock()
_quiet_traces = 0  # traces running, in all threads


def _not_tracing(record: logging.LogRecord) -> bool:
    return not getattr(_tracing, "on", False)


def _quiet_fake_tensor_log(on: bool) -> None:
    """Start (``on``) or end a trace's quiet on torch's fake tensor logger (see [Note:
    torch's log during a trace])."""
    global _quiet_traces
    with _quiet_lock:
        _quiet_traces += 1 if on else -1
        if on and _quiet_traces == 1:
            _FAKE_TENSOR_LOG.addFilter(_not_tracing)
        elif not on and _quiet_traces == 0:
            _FAKE_TENSOR_LOG.removeFilter(_not_tracing)


def _keep_conversions(mode: Any) -> dict[int, Any]:
    """Keep, for one trace, the fake each real tensor became (see [Note: one fake per real
    tensor]); returns what is kept, for the trace to clear."""
    converter = mode.fake_tensor_converter
    convert = converter.from_real_tensor
    kept: dict[int, Any] = {}

    def from_real_tensor(*args: Any, **kwargs: Any) -> Any:
        fake = convert(*args, **kwargs)
        kept[id(fake)] = fake
        return fake

    converter.from_real_tensor = from_real_tensor
    return kept


def _fit(call: Callable[[int], Any], small: int, large: int, device: torch.device
         ) -> tuple[dict[int, int], Any]:
    at_small: dict[torch.device, int] = {}
    at_large: dict[torch.device, int] = {}
    peaks = {small: _trace(call, small, device, at_small),
             large: _trace(call, large, device, at_large)}
    grew = {d: n - at_small.get(d, 0) for d, n in at_large.items() if n > at_small.get(d, 0)}
    if not peaks[small] and not peaks[large] and grew:
        # No call will show growth on this device, and memory elsewhere grows: say so now.
        where = max(grew, key=lambda d: grew[d])
        raise Elsewhere(
            f"it allocated nothing new on {device}, the device whose memory it watches, "
            f"while its memory on {where} grew with the size "
            f"({format_bytes(at_small.get(where, 0))} at {small} items, "
            f"{format_bytes(at_large[where])} at {large}): pass device={str(where)!r} to "
            f"size it by that memory")
    prediction = fit((small, large), (peaks[small], peaks[large]))
    if prediction.per_item_bytes <= 0:
        raise Flat(
            f"the memory did not grow from {small} to {large} items (a call with fewer "
            f"items than that, or one whose memory does not depend on the size)")
    return peaks, prediction


def has_fakes(result: Any) -> bool:
    """True when ``result`` holds a fake tensor: something the function kept from a trace."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    return any(isinstance(t, FakeTensor) for t in tree_leaves(result))


# [Note: a model's first forward under a pager] With ``model=`` the first call's traces
# run through models just paged, whose pagers learn what each forward touches by watching
# the first one, and prefetch the next unit only in the forwards after it. The first trace
# then held one paged unit's copy fewer than the others, and the difference, counted
# against the items the second trace added, read as memory per item: a range over a model
# of 1 MiB units traced at 8 and 16 items was predicted at 134 KiB per item instead of 6,
# and started at 36 items where 600 fit. So a ``model=`` prediction first traces the
# smaller size once and keeps nothing of it; a trace cut short for running too long
# (``TooLong``) did not finish learning, and the warm-up is made again at the larger sizes
# tried next.


def _renew(start: AutoStart) -> None:
    start._lock = threading.RLock()
    start._deciding = False  # the thread that was deciding is not in the child


class AutoStart:
    """The initial size of an ``"auto"`` function, decided at its first call (see
    [Note: starting where it fits]), or the first size of a ``model=`` function (see
    [Note: predicting the first size])."""

    def __init__(self, name: str, floor: int, ceiling: int, device: torch.device | None,
                 asked: str = "initial_batchsize='auto'", largest: str | None = None
                 ) -> None:
        self.name = name
        self.asked = asked  # what asked for the prediction, and the ceiling, for the log
        self.largest = largest or f"max_batchsize={ceiling}"
        self.floor = floor
        self.ceiling = ceiling
        self.device = device
        self.prediction: PeakPrediction | None = None
        self.free = 0  # bytes free on the device when the prediction was made
        self.initial: int | None = None
        # Trace once, unused, before the traces that measure: see [Note: a model's first
        # forward under a pager].
        self.warm_up = False
        self._flat = 0  # calls whose traces did not grow with the size
        self._early = 0  # calls whose traces reached a decorated function not ready yet
        # Why the traces failed, until the real call shows whether it runs (see [Note: a
        # trace that fails like its call]).
        self._failed: str | None = None
        # Reentrant: a recursive function's traces call it again on this thread.
        self._lock = threading.RLock()
        self._deciding = False
        renew_after_fork(self, _renew)  # See [Note: locks across a fork] (_common/forks.py)

    def decide(self, call: Callable[[int], Any], items: int | None = None) -> int | None:
        """The initial size: predicted once (thread-safe), then the same for every call.
        None while calls are too small to tell (the call runs from the ceiling). ``items``:
        how many items the call has, where the decorator knows (a range's length, a
        tensor's along the chunked dimension); None where it does not (batch). A call
        the prediction's own traces make (a recursive function) ends the prediction: the
        search starts at the ceiling."""
        with self._lock:
            if self.initial is None:
                if self._deciding:
                    raise NotPredictable("it calls itself while its traces run (recursion), "
                                         "so they cannot tell its own share")
                if fake_mode() is not None:  # another decorated function's trace calls it
                    raise NotYet("a decorated function it calls predicts its own first size "
                                 "at its own first real call, not inside this trace")
                self._deciding = True
                try:
                    self.initial = self._decide(call, items)
                finally:
                    self._deciding = False
            return self.initial

    def _search(self, call: Callable[[int], Any], free: int, device: torch.device,
                items: int | None) -> tuple[int, PeakPrediction]:
        """The largest size whose traced peak fits ``MARGIN * free``, and the last fit (see
        [Note: sizes a call can fill] for ``items``)."""
        budget = MARGIN * free
        scale = 1
        while True:  # a loop over the data runs (items / size) forwards: trace larger sizes
            large = min(TRACE_SIZES[1] * scale, self.ceiling)
            small = max(1, min(TRACE_SIZES[0] * scale, large // 2))
            if small >= large:
                raise NotPredictable(f"the largest size, {self.ceiling}, leaves no two sizes "
                                     f"to trace")
            if items is not None and items < large:
                raise TooFewItems(f"the call has {items} items, fewer than the {large} the "
                                  f"traces need")
            try:
                if self.warm_up:
                    _trace(call, small, device)  # see [Note: a model's first forward ...]
                    self.warm_up = False
                peaks, prediction = _fit(call, small, large, device)
                break
            except (TooLong, Flat):
                # Flat: what the call gathers (its outputs, kept whole) may outweigh what one
                # batch needs at small sizes; larger ones show the growth, if there is any.
                scale *= 8
                if scale >= 8**LEVELS or large >= self.ceiling:
                    raise
        candidate = self._clamp(prediction.largest(free, MARGIN))
        above = None  # a candidate above the call's items, checked up to them
        unchecked = None  # a candidate too long to trace (a loop over small batches)
        for _ in range(CHECKS):
            # The trace of a size the call cannot fill runs the call's items: it is kept
            # under that count, which is what it measured.
            size = candidate if items is None else min(candidate, items)
            if size not in peaks:
                try:
                    peaks[size] = _trace(call, size, device)
                except TooLong:
                    # Below the traced sizes, a loop over the data runs more forwards than a
                    # trace may hold: the line's word stands, unchecked (the search corrects
                    # it), rather than the smallest size for good.
                    unchecked = size
                    break
                if items is None and size != large and peaks[size] == peaks[large]:
                    raise TooFewItems(
                        f"the traces at {size} and {large} items allocated the same, though "
                        f"memory grew from {small} to {large}: the call's data seems to end "
                        f"before {large} items")
            elif size == candidate:
                break
            if peaks[size] <= budget:
                if size < candidate:
                    above = candidate  # the line's word above the items this call has
                break
            base = max((n for n, p in peaks.items() if p <= budget and n < size),
                       default=min(peaks))
            if base >= size:
                break
            prediction = fit((base, size), (peaks[base], peaks[size]))
            candidate = min(size - 1, self._clamp(prediction.largest(free, MARGIN)))
        fitting = [n for n, p in peaks.items() if p <= budget]
        return self._clamp(max([*fitting, above or unchecked or self.floor])), prediction

    def ran(self, ok: bool) -> bool:
        """The real call after a decision ended: ``ok`` unless it raised an error that is not
        out of memory. False when that puts the decision off to the next call (see [Note: a
        trace that fails like its call])."""
        with self._lock:
            why, self._failed = self._failed, None
            if why is None:
                return True
            if ok:
                logger.info("%s: %s could not trace the function on fake tensors (%s); the "
                            "search starts at %s", self.name, self.asked, why, self.largest)
                return True
            self.initial = None
            logger.info("%s: %s could not trace the function on fake tensors (%s), and the "
                        "call failed too: the next call is traced again", self.name,
                        self.asked, why)
            return False

    def forget(self, why: str) -> None:
        """Drop the prediction made (the traces did harm, see ``_Adaptive.predict_start``):
        the search starts at the largest size, as for a function that cannot be traced."""
        if self.prediction is not None:
            self.prediction = None
            logger.info("%s: %s dropped its prediction: %s; the search starts at %s",
                        self.name, self.asked, why, self.largest)
        if self.initial is not None:
            self.initial = self.ceiling

    def failing(self) -> int | None:
        """The smallest size predicted not to fit at all (no margin), or None without a
        prediction or above the largest size."""
        if self.prediction is None:
            return None
        size = self.prediction.largest(self.free, 1.0) + 1
        return size if size <= self.ceiling else None

    def _clamp(self, size: int) -> int:
        return max(self.floor, min(self.ceiling, size))

    def _decide(self, call: Callable[[int], Any], items: int | None) -> int | None:
        device = self.device if self.device is not None else default_device()
        try:
            free = free_memory(device)
        except Exception as exc:  # nothing to fit the traces into: search as without them
            logger.info("%s: %s cannot read the free memory on %s (%s); the search starts at "
                        "%s", self.name, self.asked, device, exc, self.largest)
            return self.ceiling
        try:
            start, prediction = self._search(call, free, device, items)
        except Flat as exc:
            self._flat += 1
            if self._flat < FLAT_CALLS:
                return None
            logger.info("%s: %s could not see memory grow with the size in %d calls (%s); the "
                        "search starts at %s",
                        self.name, self.asked, self._flat, exc, self.largest)
            return self.ceiling
        except NotYet as exc:
            self._early += 1
            if self._early < FLAT_CALLS:
                logger.info("%s: %s cannot trace the function yet (%s); this call starts "
                            "at %s, the next is traced again",
                            self.name, self.asked, exc, self.largest)
                return None
            logger.info("%s: %s could not trace the function on fake tensors in %d calls "
                        "(%s); the search starts at %s",
                        self.name, self.asked, self._early, exc, self.largest)
            return self.ceiling
        except Elsewhere as exc:
            logger.warning("%s: %s sees no memory of its own grow: %s; the search starts at %s",
                           self.name, self.asked, exc, self.largest)
            return self.ceiling
        except TraceFailed as exc:
            self._failed = str(exc)  # logged once the call shows it runs: see ran()
            return self.ceiling
        except NotPredictable as exc:
            logger.info("%s: %s could not trace the function on fake tensors (%s); the "
                        "search starts at %s",
                        self.name, self.asked, exc, self.largest)
            return self.ceiling
        self.prediction, self.free = prediction, free
        logger.info("%s: %s predicts %s per item + %s fixed; %s free on %s, so the search "
                    "starts at size %d",
                    self.name, self.asked, format_bytes(int(prediction.per_item_bytes)),
                    format_bytes(prediction.fixed_bytes), format_bytes(free), device, start)
        return start
