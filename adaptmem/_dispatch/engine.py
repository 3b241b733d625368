"""Which engine holds a partly resident model under ``model=``: the pager or the chunker.

[Note: paging or chunking] A model that does not fit whole keeps its first units resident
either way; the two engines differ in what they do with the rest, every forward. The pager
brings the non-resident weights over the link to the device and computes them there: it
costs ``paged bytes / link bandwidth`` per forward, whatever the batch size (prefetching
hides it only behind compute that is at least as long). The chunker leaves them on the host
and computes them there, moving activations instead of weights: it costs the host's compute
of those units, which grows with the batch. So the decorator measures both sides once, on
the calls themselves, and keeps the cheaper per forward:

- the link: a timed copy of a host buffer to the device (``link_bandwidth``; 1 MiB, grown
  until the copy takes a few milliseconds, then the fastest of three; no larger than a
  quarter of the free memory, though at least 64 KiB, and when no copy fits the engine in
  force stays), at the call that needs it;
- the host: the second call runs chunked with the same resident bytes, and ``HostClock``
  times the forwards of the units the chunker computes on the host (host compute is
  synchronous, so wall time between a unit's hooks is its compute); a model with nothing
  resident is computed there whole, and timed between its root's hooks.

Chunking is kept when its host seconds per forward are below the paged bytes over the
measured bandwidth, else the model is paged again from the third call on. A timed call
that completed no forward (it raised, or was interrupted) measured nothing: the next call
is timed instead, up to ``TIMING_TRIES`` calls in all, then paging is chosen. With several
models both sides are counted over what the timed call ran: each forward of a model would
page that model's bytes, and the host time is that of all the models' host units; per
forward means per batch (the forwards of the model that ran most), so a call running an
encoder and a decoder once per batch weighs one host pass of both against moving both. The device's own
compute of the non-resident units is not counted on either side: on an accelerator it is
small beside the host's, and leaving it out favours paging, the default. Neither are the
activations the chunker moves at its boundaries: for the batches in view they are small
beside the weights paging moves, but a very large batch through a model with many
boundaries would be misjudged that way. The choice is made once per decorated function (a
``remove()`` starts again); residency given back or taken again keeps the engine chosen.
The chunked call is a placement of its own in the size cache (the engine is part of the
key); it starts from the size that last ran paged, since chunking the same resident bytes
takes no more device memory than paging them, rather than from the initial size; paging
again after it starts from that size too, when its record is filed under other free memory.

The engine changes only where a call starts. A call whose compute ran out at the smallest
size gives residency back and runs again under the engine it started with: the residency
it settles on is one the smallest batch fits beside under that engine. Switching to the
timed chunked run inside that call instead would settle on a residency that fits chunked
(the chunker keeps whole units up to its capacity and stages no paged weights, so it holds
less on the device at the same resident bytes) and page it again at the next call, where
the smallest batch runs out and residency is given back once more. Nor is a switch a change
of memory to the explorer (see [Note: exploring residency] in explore.py): it forgets the
rates measured under the old engine, but not the residency given back in the epoch. Given
back under chunking, paging it needs more device memory still; given back under paging,
chunking it might fit, so the limit is cautious there: a possible gain forgone, never an
out-of-memory error.

A weight that paging can never hold (larger than the device or its memory fraction, or as
large with nothing beside it: the pager's error says ``beyond_device``) leaves no choice:
the models are chunked at once, the choice made for good, and the call runs again
(``PlacedModels.chunk_instead``). Measuring first would page again and fail every call
from the third on wherever the link is fast enough for paging to win.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._common.devices import free_memory, synchronize
from .._common.oom import free_caches, is_oom
from .._common.peak import fake_mode
from .._engines.base import HookSet

__all__ = ["Choice", "HostClock", "link_bandwidth"]

COPY_START = 1 << 20  # bytes of the first timed copy
COPY_MIN = 64 << 10  # ... when a quarter of the free memory is less
COPY_MAX = 64 << 20
COPY_LONG_ENOUGH = 0.003  # seconds a timed copy should take to be read
COPY_REPEATS = 3


def link_bandwidth(device: torch.device) -> float | None:
    """Bytes per second a host-to-device copy reaches, from timed copies (see [Note: paging
    or chunking]): a pinned host buffer where the device has streams, as the pager's
    masters are. Copies stay under a quarter of the free memory; None when even the
    smallest runs out of memory (the caller keeps what it has)."""
    limit = min(COPY_MAX, free_memory(device) // 4)
    nbytes = max(COPY_MIN, min(COPY_START, limit))
    best: float | None = None
    try:
        torch.ones(1024, dtype=torch.uint8).to(device)  # a first copy may set things up
        while True:
            host = torch.empty(nbytes, dtype=torch.uint8)
            if device.type != "cpu":
                try:
                    host = host.pin_memory()
                except RuntimeError:
                    pass  # pageable memory: the copy is what a pager without pinning sees
            seconds = _timed_copy(host, device)
            if seconds >= COPY_LONG_ENOUGH or 2 * nbytes > limit:
                # The fastest of three: a copy whose thread was preempted reads slow.
                seconds = min(seconds, *(_timed_copy(host, device)
                                         for _ in range(COPY_REPEATS - 1)))
                return nbytes / max(seconds, 1e-9)
            best = nbytes / max(seconds, 1e-9)
            nbytes *= 2
    except Exception as exc:
        if not is_oom(exc):
            raise
        free_caches(device)
        return best  # the last size that fitted, timed once; None if none did


def _timed_copy(host: torch.Tensor, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    copy = host.to(device, copy=True)
    synchronize(device)
    seconds = time.perf_counter() - started
    del copy
    return seconds


class HostClock:
    """Times the units that ``handles`` (Chunkers, one per model) compute on the host:
    ``seconds`` of host compute while ``counts[i]`` forwards of model ``i`` ran."""

    def __init__(self, models: Sequence[nn.Module], handles: Sequence[Any]) -> None:
        self.seconds = 0.0
        self.counts = [0 for _ in models]
        self._index = {id(m): i for i, m in enumerate(models)}
        self._depth = 0
        self._started = 0.0
        self._hooks = HookSet()
        self._units: set[nn.Module] = set()
        self._whole: set[nn.Module] = set()  # roots computed on the host whole
        for model, handle in zip(models, handles, strict=True):
            # Added after the chunker's own root hooks: they place the model at its first
            # forward, so the map of host units is known when this one runs.
            self._hooks.add(model,
                            model.register_forward_pre_hook(self._root_pre(model, handle)),
                            model.register_forward_hook(self._root_post, always_call=True))

    def _root_pre(self, model: nn.Module, handle: Any) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if handle.plan is None:
                return  # a forward recording the order before placing
            if model not in self._units:
                self._hook_units(model, handle)
            if model in self._whole:
                self._unit_pre(module, args)
        return hook

    def _hook_units(self, model: nn.Module, handle: Any) -> None:
        """Hook the units ``handle`` computes on the host; a model computed there whole
        (nothing resident) is timed between its own root hooks instead: the hooks added
        to it now would not run in the forward under way."""
        self._units.add(model)
        modules = dict(model.named_modules())
        for name, label in handle.device_map.items():
            unit = modules.get(name)
            if unit is None or _device_of(label).type != "cpu":
                continue
            if unit is model:
                self._whole.add(model)
                continue
            if unit not in self._hooks:
                self._hooks.add(unit, unit.register_forward_pre_hook(self._unit_pre),
                                unit.register_forward_hook(self._unit_post, always_call=True))

    # A forward on fake tensors (another decorated function's trace calling this one) is
    # neither counted nor timed: it computes nothing.

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if module in self._whole:
            self._unit_post(module, args, output)
        if fake_mode() is None:
            self.counts[self._index[id(module)]] += 1

    @property
    def forwards(self) -> int:
        """Forwards of the model that ran most: the batches timed."""
        return max(self.counts, default=0)

    def _unit_pre(self, module: nn.Module, args: Any) -> None:
        if fake_mode() is not None:
            return
        if self._depth == 0:
            self._started = time.perf_counter()
        self._depth += 1

    def _unit_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if fake_mode() is not None or self._depth == 0:
            return  # (0: an engine's hook before this one's pre hook raised)
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._started

    def remove(self) -> None:
        self._hooks.clear()


def _device_of(label: str) -> torch.device:
    return torch.device(label.split("@", 1)[0])


class Choice:
    """The figures an engine was chosen by, and the choice (see [Note: paging or
    chunking])."""

    def __init__(self, paged_bytes: Sequence[int], bandwidth: float, host_seconds: float,
                 counts: Sequence[int]) -> None:
        # Both sides of what the timed calls ran: each forward of a model pages that
        # model's bytes, and the host computed all the models' host units. "Per forward"
        # is per batch: the forwards of the model that ran most.
        self.paged_bytes = sum(paged_bytes)
        self.bandwidth = bandwidth
        self.forwards = max(counts, default=0)
        moved = sum(b * n for b, n in zip(paged_bytes, counts, strict=True))
        self.page_seconds = moved / bandwidth / self.forwards if self.forwards else 0.0
        self.chunk_seconds = host_seconds / self.forwards if self.forwards else float("inf")

    @property
    def engine(self) -> str:
        return "chunk" if self.chunk_seconds < self.page_seconds else "page"

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "paged_bytes": self.paged_bytes,
                "link_bytes_per_second": self.bandwidth,
                "page_seconds_per_forward": self.page_seconds,
                "chunk_seconds_per_forward": self.chunk_seconds,
                "forwards_timed": self.forwards}
