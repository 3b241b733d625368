"""Counting the memory a call allocates, on any device, meta and fake tensors included: the
tracker behind every prediction of peak memory (see [Note: predicting peak memory on meta]
in ``_planning/peak.py``)."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakTracker", "PeakPrediction", "NotPredictable", "NotYet", "fake_mode", "fit",
           "count_allocation", "register_allocations", "register_fakes", "is_fake"]


class NotPredictable(Exception):
    """The call could not be traced on the meta device; the message says why."""


class NotYet(NotPredictable):
    """The trace reached a decorated function that gets ready at its own first real call
    (places its models, predicts its own size): a later call can be traced."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)

# [Note: allocations a tensor subclass keeps apart from storages] A tensor subclass made with
# ``_make_wrapper_subclass`` (the simulated device's) has a storage of its own for every
# tensor, views included: a chunk of the data (``data.split(n)``) would look like new memory,
# counted at its storage's size up to its offset, so the more, smaller chunks a loop made the
# more a trace counted. Such a subclass says which allocation a tensor belongs to and how
# large it is (``register_allocations``), and the memory it makes where no dispatch mode
# sees it (a factory run with the modes off) it reports itself (``count_allocation``), as
# torch's ops report theirs by returning it.
_ALLOCATIONS: dict[type, Callable[[torch.Tensor], tuple[int, int] | None]] = {}
_active = threading.local()  # .trackers: the trackers entered on this thread, innermost last


def register_allocations(cls: type,
                         allocation: Callable[[torch.Tensor], tuple[int, int] | None]) -> None:
    """Tensors of ``cls`` belong to the allocation ``allocation(t)`` names, as (a key that
    tells it apart while it lives, its bytes), or to their storage where it returns None."""
    _ALLOCATIONS[cls] = allocation


# A tensor subclass that wraps other tensors (the simulated device's) holds a fake tensor
# under a trace, but is no FakeTensor itself: it says which of its tensors a trace made.
_FAKES: dict[type, Callable[[torch.Tensor], bool]] = {}


def register_fakes(cls: type, made_by_trace: Callable[[torch.Tensor], bool]) -> None:
    """Tensors of ``cls`` for which ``made_by_trace(t)`` is True are fake (made under a fake
    mode, holding no memory), though no ``FakeTensor``."""
    _FAKES[cls] = made_by_trace


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` was made by a trace on fake tensors (a FakeTensor, or a registered
    subclass's tensor that wraps one)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return True
    made_by_trace = _FAKES.get(type(t))
    return made_by_trace is not None and made_by_trace(t)


def count_allocation(t: torch.Tensor) -> None:
    """``t`` is new memory made where no dispatch mode sees it: every tracker entered on this
    thread counts it (while it lives), as if an op had returned it."""
    for tracker in getattr(_active, "trackers", ()):
        tracker.count(t)


def _allocation(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the memory ``t`` is part of (See [Note: allocations a tensor subclass
    keeps apart from storages])."""
    find = _ALLOCATIONS.get(type(t))
    if find is not None:
        found = find(t)
        if found is not None:
            return found
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


class _Account:
    """Live and peak bytes of the storages counted on one device: each storage once, while
    a tensor counted over it lives."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._owners: dict[int, int] = {}  # storage -> how many tracked tensors use it
        self._bytes: dict[int, int] = {}  # storage -> its bytes
        self._seen: set[int] = set()  # ids of the live tensors counted

    def take(self, t: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        """``t``, an op's output that is none of its inputs: new memory unless it is a view
        of a storage counted already or of one that existed before."""
        if id(t) in self._seen:
            return
        key, nbytes = _allocation(t)  # one per storage, shared by its views
        if key in self._owners:  # a view of a storage made while tracking
            self._hold(t, key, 0)
        elif not _existing(key, nbytes, inputs):  # new
            self._hold(t, key, nbytes)
        # else a view of (or in-place result in) memory that existed before: not counted

    def count(self, t: torch.Tensor) -> None:
        """Count ``t`` as new memory, a view of memory counted already as nothing more."""
        if id(t) in self._seen:
            return
        key, nbytes = _allocation(t)
        self._hold(t, key, 0 if key in self._owners else nbytes)

    def _hold(self, t: torch.Tensor, key: int, nbytes: int) -> None:
        self._seen.add(id(t))
        if key in self._owners:
            self._owners[key] += 1
        else:
            self._owners[key] = 1
            self._bytes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._drop, id(t), key)

    def _drop(self, tensor_id: int, key: int) -> None:
        self._seen.discard(tensor_id)
        left = self._owners.get(key, 0) - 1
        if left > 0:
            self._owners[key] = left
            return
        if self._owners.pop(key, None) is not None:
            self.live -= self._bytes.pop(key, 0)


def _existing(key: int, nbytes: int, inputs: list[torch.Tensor]) -> bool:
    """Whether storage ``key`` (of ``nbytes``) is one of the inputs', or (under a fake mode)
    that of the fake a real input of that size became: a view of a real tensor the traced
    call was given (a batch sliced from its data) is a view of that fake, not new memory."""
    if any(_allocation(i)[0] == key for i in inputs):
        return True
    mode = fake_mode()
    if mode is None:
        return False
    # Plain tensors only (a tensor subclass, the simulated device's, is its own business),
    # and only of the same size: converting is the costly part.
    return any(mode.from_tensor(i).untyped_storage()._cdata == key for i in inputs
               if i.__class__ in _PLAIN and i.untyped_storage().nbytes() == nbytes)


class PeakTracker(TorchDispatchMode):
    """Counts the bytes of the storages ops create while it is active and the highest total
    alive at once (``peak``); storages that existed before are not counted. Works on any
    device; on meta it is what a real run would allocate. Given a ``device``, only storages
    on that device count toward ``peak``; the peaks of other devices are kept apart in
    ``elsewhere`` (see [Note: counting the device's bytes only] in ``_execution/auto.py``)."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self._account = _Account()
        self._others: dict[torch.device, _Account] = {}  # given a device: the rest

    @property
    def live(self) -> int:
        return self._account.live

    @property
    def peak(self) -> int:
        return self._account.peak

    @property
    def elsewhere(self) -> dict[torch.device, int]:
        """Given a ``device``: the peak bytes of new storages on each other device."""
        return {d: a.peak for d, a in self._others.items() if a.peak}

    def __enter__(self) -> PeakTracker:
        entered = super().__enter__()
        trackers = getattr(_active, "trackers", None)
        if trackers is None:
            trackers = _active.trackers = []
        trackers.append(self)
        return entered

    def __exit__(self, *exc: Any) -> None:
        _active.trackers.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        known = {id(t) for t in inputs}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or id(t) in known:
                continue
            if self._counts(t.device):
                self._account.take(t, inputs)
            else:
                account = self._others.get(t.device)
                if account is None:
                    account = self._others[t.device] = _Account()
                account.take(t, inputs)
        return out

    def count(self, t: torch.Tensor) -> None:
        """Count ``t`` as new memory (See ``count_allocation``), a view of memory counted
        already as nothing more."""
        if self._counts(t.device):
            self._account.count(t)

    def _counts(self, device: torch.device) -> bool:
        wanted = self.device
        if wanted is None:
            return True
        return device.type == wanted.type and (wanted.index is None or device.index is None
                                               or device.index == wanted.index)


def fake_mode() -> Any:
    """The ``FakeTensorMode`` active now (a trace predicting peak memory), or None."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


@dataclass(frozen=True)
class PeakPrediction:
    """``peak(batch) = fixed_bytes + per_item_bytes * batch``, from traces at ``sizes``."""

    sizes: tuple[int, int]
    peaks: tuple[int, int]
    fixed_bytes: int
    per_item_bytes: float

    def peak(self, batch: int) -> int:
        """Predicted bytes the call allocates at ``batch`` items."""
        return int(self.fixed_bytes + self.per_item_bytes * batch)

    def largest(self, room: int, margin: float = 0.8) -> int:
        """The largest batch whose predicted peak stays within ``margin * room``: 0 when not
        even one item fits, ``2**31 - 1`` for a call whose memory does not grow with it."""
        usable = room * margin - self.fixed_bytes
        if usable < 0:
            return 0
        if self.per_item_bytes <= 0:
            return 2**31 - 1
        return min(2**31 - 1, math.floor(usable / self.per_item_bytes))

    def as_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "peaks": list(self.peaks),
                "fixed_bytes": self.fixed_bytes, "per_item_bytes": self.per_item_bytes}


def fit(sizes: tuple[int, int], peaks: tuple[int, int]) -> PeakPrediction:
    """The line through two (batch, peak) traces."""
    (small, large), (low, high) = sizes, peaks
    per_item = (high - low) / (large - small)
    fixed = max(0, int(low - per_item * small))
    return PeakPrediction((small, large), (low, high), fixed, per_item)

