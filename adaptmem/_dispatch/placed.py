"""The models a decorated function runs, placed by the decorator that runs them.

[Note: batch size and residency together] With ``model=``, a decorator holds the model's
placement as well as the batch size, because both take the same device memory: resident
weights leave less room for activations, and paging every unit moves the whole model per
batch. At the first call each model is paged onto the device (``adaptive.page``, which also
moves inputs and brings outputs back) with as many units resident as fit in half the memory
free then, in execution order; all of them when the model fits, which is an ordinary
resident model. Then, before that call runs, the function is traced on fake tensors at that
placement and its first size is predicted to fit next to the resident weights (see [Note:
predicting the first size] in ``_execution/auto.py``), so the first search skips the
failures the prediction foresees; a function that cannot be traced searches from its
initial size. From then on an out-of-memory error is routed by where it struck: while a
weight moved, the pager splits its units (its own rule); in compute, the batch shrinks (the
search's rule); and when compute runs out of memory at the smallest batch, residency is
given back to activations: the bytes held resident halve (the model holding most first) and
the call runs again, down to nothing resident (see [Note: held, not asked]). A weight that one of these pagers cannot split
further and that does not fit beside the batch's activations shrinks the batch as compute
does (``transfer_errors_shrink`` in ``_common/oom.py``, by the pager's identity on its
error): the decorator holds both, and the activations are what left it no room; at the
smallest batch, residency is given back, and then the pager's error ends the call. Another
pager's error passes through (our residency frees nothing it lacks). Generator and async
functions run their bodies after the call returns: their retry wrappers keep the scope's
way of finding the decorator's pagers (``owned_engines``), asked when an error comes, so a
transfer error shrinks their batch too. An async function's call is awaited by a wrapper
that gives residency back where the awaited work ran out at the smallest size
(``Dispatched._awaited``); a generator's is not (its items may have been used). Memory
given back is taken again, doubling, when free memory has grown by a quarter since it was
given, checked every ``RESTORE_EVERY`` calls. What fits is only where it starts: it then measures
items per second and moves residency to what runs fastest (see [Note: exploring residency] in
explore.py). The placement is part of the cache key (the decorator's ``context``), so a
call site returns to the batch size it learned for the placement in force. A model that
does not fit whole may be chunked instead of paged (its non-resident units computed on the
host): which engine is measured on the first calls, see [Note: paging or chunking] in
engine.py; give-back, take-back and exploring then move the chosen engine's resident bytes.

[Note: held, not asked] The residency each model is given is a share of bytes; its engine
keeps whole units resident within it, in execution order, so it may hold less: with an 8
MiB share, a 1 MiB unit and then a 6 MiB one, 7 MiB; with 3.5 MiB, only the first. Giving
residency back halves what is held (halving the share from 8 to 4 and to 2 MiB would hold
the same 1 MiB each time, and each call would fail again), what ran out is remembered as
the bytes held (a share that holds as much is no better: exploring does not try it in the
same epoch), and ``placement["resident_bytes"]`` reports what is held, beside the share
asked (``resident_asked``). The share stays the placement's name elsewhere (the size cache's
key, what exploring measures and doubles or halves).

[Note: a decorated function that is collected] A decorated function dropped without
``remove()`` (a notebook cell run again defines it anew) would leave its models placed for
good, and the new definition could not place them. So when it is collected its models are
given back, as ``remove()`` does, unless one of them is in a forward right then (the
collection may run inside any allocation, on any thread: the models' root hooks count the
forwards running). Then they are given back at the next attempt to place one of them
(another decorated function's first call, ``adaptive.page``, ...). A decorated function
still alive that holds a model is named, with how to free it, in the error of anything
else that tries to place it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from .._common.claims import check_placeable, held_for, refuse_compiled
from .._common.devices import default_device, format_bytes, free_memory, resolve_device
from .._common.errors import PlacementError
from .._common.pinning import pinned_cache_kept, release_kept
from .._common.tree import calls_in_progress
from .._engines.base import HookSet
from .._paging.api import Pager, page_as_asked
from .._placement.api import chunk
from .._placement.splitter import Chunker
from .._planning import Placement, module_sizes
from .engine import Choice, HostClock, link_bandwidth

__all__ = ["PAGE", "PlacedModels", "PlacementChanges", "check_models", "fakes_put_back"]

logger = logging.getLogger("adaptmem")

WEIGHT_SHARE = 0.5  # of free memory given to resident weights at the first call
RESTORE_EVERY = 16  # calls between checks whether memory given back can be taken again
RESTORE_GROWTH = 1.25  # free memory must have grown this much since it was given back
TIMING_TRIES = 3  # chunked calls timed, while none completes a forward, before choosing


@dataclass
class PlacementChanges:
    """What the decorator did to its models' placement."""

    placements: int = 0
    residency_given_back: int = 0
    residency_taken_again: int = 0
    engine_switches: int = 0
    residency_explored: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"placements": self.placements,
                "residency_given_back": self.residency_given_back,
                "residency_taken_again": self.residency_taken_again,
                "engine_switches": self.engine_switches,
                "residency_explored": self.residency_explored}


# Which decorated function holds a model, while it does.
_holders: weakref.WeakKeyDictionary[nn.Module, PlacedModels] = weakref.WeakKeyDictionary()


def check_models(model: Any, decorator: str) -> tuple[nn.Module, ...]:
    """The models given as ``model=`` (one module, a sequence of them or an
    ``nn.ModuleList``, which has no forward of its own: a list of models), checked now."""
    many = isinstance(model, (Sequence, nn.ModuleList)) and not isinstance(model, str)
    models = tuple(model) if many else (model,)
    if not models:
        raise ValueError(f"{decorator}(model=...) got an empty sequence; pass the model(s) "
                         f"the function runs, or leave model out")
    for m in models:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{decorator}(model=...) takes torch.nn.Module(s), got "
                            f"{type(m).__name__} {m!r}")
        # Held for another decorated function: checked at the first call, which it may
        # not outlive (a notebook cell defining the function again).
        check_placeable(m, f"{decorator}(model=...)", owned_ok=True)
        refuse_compiled(m, f"{decorator}(model=...)")  # it may page the model
        lazy = [n for n, p in m.named_parameters() if isinstance(p, UninitializedParameter)]
        if lazy:
            raise PlacementError(
                f"{decorator}(model=...) got a model with uninitialised (lazy) parameters "
                f"({lazy[0]!r} first); run it once on an example input first"
            )
    if len({id(m) for m in models}) != len(models):
        raise ValueError(f"{decorator}(model=...) lists the same model twice")
    _refuse_overlap(models, decorator)
    return models


def _refuse_overlap(models: tuple[nn.Module, ...], decorator: str) -> None:
    """Two models that share a module, or a tensor (a weight tied across them: an encoder's
    embedding reused by a separate decoder's head), would each be placed by an engine of
    its own, and one engine holds a tensor at a time (each adopts the data the other gives
    it, and a chunked one refuses it): refused now, naming what they share. Tensors tied
    within one model are placed once by its engine."""
    owner: dict[int, tuple[int, str]] = {}
    for i, m in enumerate(models):
        for path, sub in m.named_modules(remove_duplicate=True):
            seen = owner.get(id(sub))
            if seen is None:
                owner[id(sub)] = (i, path)
                continue
            j, other = seen
            if path == "":
                what = (f"model {i} ({type(sub).__name__}) is part of model {j} "
                        f"({type(models[j]).__name__}), as {other!r}")
            elif other == "":
                what = (f"model {j} ({type(sub).__name__}) is part of model {i} "
                        f"({type(m).__name__}), as {path!r}")
            else:
                what = (f"models {j} and {i} share the module {type(sub).__name__} "
                        f"({other!r} in model {j}, {path!r} in model {i})")
            raise ValueError(
                f"{decorator}(model=...) got models that overlap: {what}. Each module is "
                f"placed by one model's engine: list only the outer model, or models that "
                f"share no module")
    tensors: dict[int, tuple[int, str]] = {}
    for i, m in enumerate(models):
        for name, t in [*m.named_parameters(remove_duplicate=False),
                        *m.named_buffers(remove_duplicate=False)]:
            j, other = tensors.setdefault(id(t), (i, name))
            if j != i:
                raise ValueError(
                    f"{decorator}(model=...) got models that share a tensor: {other!r} of "
                    f"model {j} ({type(models[j]).__name__}) is {name!r} of model {i} "
                    f"({type(m).__name__}). Each tensor is placed by one model's engine: "
                    f"pass one module whose forward runs both (its engine places the tied "
                    f"tensor once), or give each model its own copy of the tensor")


def _held(handle: Pager | Chunker, asked: int) -> int:
    if isinstance(handle, Pager):
        return sum(u.nbytes for u in handle.plan.units if u.placement == Placement.RESIDENT)
    plan = handle.plan
    if plan is None:
        return asked
    return sum(n for label, n in plan.options["placed_bytes"].items()
               if not label.startswith("cpu"))


PAGE, CHUNK = "page", "chunk"
# Where the choice between them stands: to be measured at the next call, being measured
# (the call runs chunked under a HostClock), made.
PENDING, TIMING, MADE = "pending", "timing", "made"


def _in_forward(models: Sequence[nn.Module]) -> bool:
    """Whether any thread is inside a call of one of ``models`` now. The count the root
    hooks keep misses a forward a ``KeyboardInterrupt`` ended (torch runs always-call hooks
    for an ``Exception`` only), so a count above 0 is checked against the threads' stacks."""
    return any(calls_in_progress(top, models, stop_at=1)
               for top in sys._current_frames().values())


def _how_to_free(name: str) -> str:
    """Whom models are held for (the decorated function ``name``) and how to free them."""
    return (f"it is held for the decorated function {name} (model=...): call "
            f"{name.rsplit('.', 1)[-1]}.remove() first, or drop every reference to that "
            f"function (its models are given back when the garbage collector takes it: "
            f"gc.collect())")


def _still_free(placed: PlacedModels) -> None:
    """Refuse to place ``placed``'s models where another decorated function holds one (and
    still runs it), or where one can no longer be placed."""
    for i, model in enumerate(placed.models):
        holder = _holders.get(model)
        if holder is not None and holder is not placed and not holder.release_if_abandoned():
            raise PlacementError(
                f"model {i} ({type(model).__name__}) is placed by another decorated "
                f"function; {holder.fix()}, or let one decorated function run it")
    _still_placeable(placed.models, placed.name)


def _still_placeable(models: tuple[nn.Module, ...], name: str) -> None:
    """Refuse models changed since decoration (``model.train()``) in the user's terms (not
    the engine's: ``adaptive.page`` is not what the user called)."""
    for model in models:
        check_placeable(model, f"the decorated function {name} (model=)", owned_ok=True)


class PlacedModels:
    """Pagers or chunkers for the models of one decorated function and their resident
    bytes (see [Note: batch size and residency together])."""

    def __init__(self, models: tuple[nn.Module, ...], device: torch.device | None,
                 name: str) -> None:
        self.models = models
        self.device = device
        self.name = name
        self.handles: list[Pager | Chunker] = []
        self.engine = PAGE
        self.choice: Choice | None = None
        self._choosing: str | None = None
        self._clock: HostClock | None = None
        self._paged_bytes: list[int] = []  # what paging moved per forward of each model
        self._untimed = 0  # timed calls that completed no forward, in a row
        self.weights = [module_sizes(m).total_bytes for m in models]
        self.resident = [0 for _ in models]
        self.changes = PlacementChanges()
        self._given_back_at: int | None = None  # free memory when residency was last given
        self._calls = 0
        # See [Note: a decorated function that is collected].
        self.abandoned = False
        self._running = 0  # forwards of the models running now, on any thread
        self._busy = threading.Lock()
        self._counting = HookSet()

    @property
    def placed(self) -> bool:
        return bool(self.handles)

    @property
    def pagers(self) -> list[Pager]:
        return [h for h in self.handles if isinstance(h, Pager)]

    @property
    def may_switch(self) -> bool:
        """Whether the next ``ensure`` may change the engine (the choice is pending)."""
        return self._choosing in (PENDING, TIMING)

    def key(self) -> tuple[Any, ...]:
        """What the cache tells placements apart by: the engine and the resident bytes of
        each model."""
        return (self.engine, *self.resident)

    def ensure(self, again: bool = False) -> None:
        """Place the models at the first call (paged); at the next two, choose between
        paging and chunking (see [Note: paging or chunking]); later, take back residency
        when memory grew. ``again``: the same call runs again after giving residency back,
        which keeps the engine it started with (see [Note: paging or chunking])."""
        if not self.handles:
            self.device = resolve_device(self.device or default_device())
            budget = int(WEIGHT_SHARE * free_memory(self.device))
            resident = []
            for weights in self.weights:
                resident.append(min(weights, budget))
                budget -= resident[-1]
            self._place(resident)
            if self._choosing is None and self.device.type != "cpu" and resident != self.weights:
                self._choosing = PENDING  # a model is partly resident: chunk it, maybe
            return
        if again:
            return
        if self._choosing == PENDING:
            self._time_chunking()
            return
        if self._choosing == TIMING:
            self._choose()
            if self._choosing == MADE:
                release_kept()  # chunking, timed, stays: the pagers' memory is not needed
        if self._given_back_at is not None:
            self._calls += 1
            if self._calls >= RESTORE_EVERY:
                self._calls = 0
                self._maybe_restore()

    def held(self) -> list[int]:
        """The bytes each model's engine keeps on the device between forwards: its resident
        units when paged, its device part when chunked (the residency asked until a chunked
        model's first forward places it). At most the residency asked, and less when a unit
        is larger than what is left of it (see [Note: held, not asked])."""
        if not self.handles:
            return [0 for _ in self.models]
        return [_held(h, asked) for h, asked in zip(self.handles, self.resident, strict=True)]

    def give_back(self) -> bool:
        """Halve the bytes held resident by the model holding most (so that something
        moves); False when none holds any."""
        held = self.held()
        if not any(held):
            return False
        i = max(range(len(held)), key=lambda k: held[k])
        resident = list(self.resident)
        resident[i] = held[i] // 2
        if resident[i] < 1 << 20:
            resident[i] = 0  # a sliver of residency helps nobody
        old = held[i]
        self._place(resident)
        self.changes.residency_given_back += 1
        self._given_back_at = free_memory(self.device) if self.device is not None else None
        logger.info("%s ran out of memory at its smallest size; model %d keeps %s of its %s "
                    "resident (was %s), the rest is %s", self.name, i,
                    format_bytes(self.held()[i]), format_bytes(self.weights[i]), format_bytes(old),
                    "computed on the host" if self.engine == CHUNK else "paged")
        return True

    def move(self, resident: list[int]) -> None:
        """Place the models with ``resident`` bytes resident each, to compare items per
        second (see [Note: exploring residency] in explore.py)."""
        self._place(resident)
        self.changes.residency_explored += 1

    def _maybe_restore(self) -> None:
        if self.device is None or self._given_back_at is None:
            return
        free = free_memory(self.device)
        if free < RESTORE_GROWTH * self._given_back_at:
            return
        resident = [min(w, max(2 * r, 1 << 20)) for w, r in zip(self.weights, self.resident, strict=True)]
        if resident == self.resident:
            self._given_back_at = None
            return
        self._place(resident)
        self.changes.residency_taken_again += 1
        self._given_back_at = None if resident == self.weights else free
        logger.info("%s: free memory grew to %s; resident bytes taken again: %s", self.name,
                    format_bytes(free), ", ".join(format_bytes(r) for r in resident))

    def _time_chunking(self) -> None:
        """Run the next call chunked, with the resident bytes paging had, timing the host."""
        self._paged_bytes = [sum(u.nbytes for u in p.plan.units
                                 if u.placement == Placement.PAGED) for p in self.pagers]
        self._choosing = TIMING
        self.engine = CHUNK
        self._place(list(self.resident))
        self.changes.engine_switches += 1

    def _choose(self) -> None:
        """Keep chunking or page again, by what the chunked call measured."""
        clock, self._clock = self._clock, None
        if clock is None or self.device is None:
            self._choosing = MADE  # nothing was timed: keep the engine in force
            return
        clock.remove()
        if clock.forwards == 0 and self._untimed < TIMING_TRIES - 1:
            # The timed call ran no forward to its end (it raised, a KeyboardInterrupt
            # stopped it, or it ran no model): time the next one instead of choosing by
            # nothing (0 s paged against infinite host time: paging, whatever the link).
            self._untimed += 1
            self._clock = HostClock(self.models, self.handles)
            return
        self._untimed = 0
        paged = self._paged_bytes
        bandwidth = link_bandwidth(self.device)
        if bandwidth is None:  # no copy fitted to time: keep the engine in force
            logger.info("%s: the link could not be timed (out of device memory); keeping "
                        "the model chunked", self.name)
            self._choosing = MADE
            return
        self.choice = Choice(paged, bandwidth, clock.seconds, clock.counts)
        self._choosing = MADE
        logger.info("%s: %s of weights not resident would cross the link at %.3g GB/s in %.3g "
                    "ms per forward, or be computed on the host in %.3g ms (%d forwards "
                    "timed): %s", self.name, format_bytes(self.choice.paged_bytes),
                    self.choice.bandwidth / 1e9, 1e3 * self.choice.page_seconds,
                    1e3 * self.choice.chunk_seconds, clock.forwards,
                    "chunked" if self.choice.engine == CHUNK else "paged")
        if self.choice.engine == PAGE:
            self.engine = PAGE
            self._place(list(self.resident))
            self.changes.engine_switches += 1

    def chunk_instead(self, reason: str) -> None:
        """Paging cannot hold a weight at all (``reason``, the pager's error): chunk the
        models from now on, their resident bytes as they were, the host computing what the
        device cannot hold (see [Note: paging or chunking] in engine.py)."""
        if self._clock is not None:
            self._clock.remove()
            self._clock = None
        self.engine, self.choice, self._choosing = CHUNK, None, MADE
        self._place(list(self.resident))
        self.changes.engine_switches += 1
        logger.info("%s: paging cannot hold a weight on %s (%s); the models are chunked "
                    "from now on, the host computing what the device cannot hold, and the "
                    "call runs again", self.name, self.device, reason)

    def fix(self) -> str:
        """Whom the models are held for and how to free them (``claims.Owner``)."""
        return _how_to_free(self.name)

    def abandon(self) -> None:
        """The decorated function was collected: give the models back now if that is safe,
        else at the next attempt to place one (see [Note: a decorated function that is
        collected])."""
        self.abandoned = True
        held = self.placed  # after remove(), nothing to give back and nothing to say
        if self.release_if_abandoned() and held:
            logger.info("%s was collected without remove(): its models were given back",
                        self.name)

    def release_if_abandoned(self) -> bool:
        """Give the models back when the decorated function was collected and none of them
        is in a forward now (``claims.Owner``); True when they were given back."""
        if not self.abandoned or not self._busy.acquire(blocking=False):
            return False
        try:
            if self._running and _in_forward(self.models):
                return False
            self._running = 0  # a forward interrupted past its hooks counted none down
            self.remove()
            return True
        finally:
            self._busy.release()

    def _count_pre(self, module: nn.Module, args: Any) -> None:
        with self._busy:
            self._running += 1

    def _count_post(self, module: nn.Module, args: Any, output: Any) -> None:
        with self._busy:
            self._running -= 1

    def _place(self, resident: list[int]) -> None:
        # Placing again registers the original objects: weights loaded with assign=True (or a
        # conversion) since the last call would be dropped, and the call would run the old
        # ones. Refused as the engine refuses that call, nothing moved.
        for handle in self.handles:
            handle.check_unchanged()
        with pinned_cache_kept():  # the new pagers pin the same sizes again
            self.remove(forget_choice=False)
        try:
            _still_free(self)
            self._place_anew(resident)
        finally:  # what the new pagers did not take of the old ones' memory, unless the
            if self.engine != CHUNK or self._choosing != TIMING or not self.handles:  # pagers
                release_kept()  # come back soon
        self.resident = resident
        self.changes.placements += 1

    def _place_anew(self, resident: list[int]) -> None:
        try:
            for model, nbytes in zip(self.models, resident, strict=True):
                if self.engine == CHUNK:
                    self.handles.append(chunk(model, self.device, capacity=nbytes))
                else:
                    self.handles.append(page_as_asked(model, self.device, resident_bytes=nbytes))
                held_for(self.handles[-1], self)
                self.handles[-1].speak_as(f"the decorated function {self.name} (model=)",
                                          self.name.rsplit(".", 1)[-1])
                _holders[model] = self
                # First and last of the root's hooks: around the engine's own.
                self._counting.add(
                    model, model.register_forward_pre_hook(self._count_pre, prepend=True),
                    model.register_forward_hook(self._count_post, always_call=True))
            if self._choosing == TIMING:
                self._clock = HostClock(self.models, self.handles)
        except BaseException:
            self.remove()  # all or nothing: the models as they were
            raise

    def remove(self, forget_choice: bool = True) -> None:
        """Give every model back as it was (see ``Pager.remove``, ``Chunker.remove``); the
        engine is chosen again after the next placement."""
        if self._clock is not None:
            self._clock.remove()
            self._clock = None
        self._counting.clear()
        while self.handles:
            self.handles.pop().remove()
        for model in self.models:
            if _holders.get(model) is self:
                del _holders[model]
        self.resident = [0 for _ in self.models]
        if forget_choice:  # for good: also the pagers' memory kept through a timed call
            self.engine, self.choice, self._choosing, self._untimed = PAGE, None, None, 0
            release_kept()

    def check_no_fakes(self) -> None:
        """Refuse models that an 'auto' trace left holding fake tensors (a lazy module or a
        cache filled during the trace): they would compute garbage from now on."""
        from torch._subclasses.fake_tensor import FakeTensor

        for i, model in enumerate(self.models):
            names = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                     if isinstance(t, FakeTensor)]
            if names:
                raise PlacementError(
                    f"model {i} holds fake tensors after the 'auto' traces of {self.name} "
                    f"({names[0]!r} first): it made tensors during its forward. Give the "
                    f"initial size a number instead of 'auto', and rebuild the model"
                )

    def as_dict(self) -> dict[str, Any]:
        all_resident = self.placed and self.resident == self.weights and self.engine == PAGE
        return {"device": str(self.device), "weight_bytes": list(self.weights),
                "resident_bytes": self.held(), "resident_asked": list(self.resident),
                "engine": "resident" if all_resident else self.engine,
                "engine_choice": None if self.choice is None else self.choice.as_dict(),
                **self.changes.as_dict()}


# What every nn.Module keeps in its __dict__ (its parameters, buffers, hooks): walked by
# fakes_put_back through the tables themselves, not as attributes.
_MODULE_STATE = frozenset(nn.Module().__dict__)


def _refill(container: Any, items: Any) -> None:
    """Put ``items`` back into the list or dict ``container``, in place."""
    if isinstance(container, list):
        container[:] = items
    else:
        container.clear()
        container.update(items)


@contextlib.contextmanager
def fakes_put_back(models: Sequence[nn.Module]) -> Iterator[list[str]]:
    """Around the traces that predict a first size (see [Note: predicting the first size] in
    ``_execution/auto.py``): a tensor a module made during them (a cache filled on first
    use, a lazy buffer) is fake, and would poison every later call. Each such parameter,
    buffer or attribute (a tensor, or a list, tuple or dict holding one: torchvision's
    anchor generators keep a list of anchors, made anew by each forward) is put back as it
    was before (removed if it was not there; a list or dict filled in place gets its items
    back), and its name is added to the list yielded, so the caller can drop the
    prediction."""
    def tables(m: nn.Module) -> tuple[dict[str, Any], ...]:
        return m._parameters, m._buffers, m.__dict__

    before = {id(m): tuple(dict(t) for t in tables(m)) for model in models
              for m in model.modules()}
    # The items of the lists and dicts a module keeps (not nn.Module's own tables), for
    # those filled in place, empty ones included (a cache filled on first use).
    items = {id(v): (v, list(v) if isinstance(v, list) else dict(v))
             for model in models for m in model.modules() for k, v in m.__dict__.items()
             if isinstance(v, (list, dict)) and k not in _MODULE_STATE}
    left: list[str] = []
    try:
        yield left
    finally:
        from torch._subclasses.fake_tensor import FakeTensor

        def fake(value: Any) -> bool:  # in nested lists, tuples and dicts, cycles too
            stack, seen = [value], set()
            while stack:
                v = stack.pop()
                if isinstance(v, FakeTensor):
                    return True
                if isinstance(v, (list, tuple, dict)) and id(v) not in seen:
                    seen.add(id(v))
                    stack.extend(v.values() if isinstance(v, dict) else v)
            return False

        for i, model in enumerate(models):
            for path, m in model.named_modules():
                old = before.get(id(m), ({}, {}, {}))
                for table, was in zip(tables(m), old, strict=True):
                    for name, value in list(table.items()):
                        if (table is m.__dict__ and name in _MODULE_STATE) or not (
                                isinstance(value, (torch.Tensor, list, tuple, dict))
                                and fake(value)):
                            continue
                        if name in was:
                            table[name] = was[name]
                        else:
                            del table[name]
                        now = table.get(name)
                        kept = items.get(id(now))
                        if kept is not None and kept[0] is now:  # filled in place
                            _refill(*kept)
                        left.append(f"model {i}: {path + '.' if path else ''}{name}")
