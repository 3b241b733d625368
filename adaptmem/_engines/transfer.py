"""How the pager copies host masters to a device: one small interface, two implementations.

The pager's scheduling code (what to fetch, when to wait, when to release) is the same on
every device; only these classes differ. ``StreamTransfer`` copies on a side stream and hands
back an event; ``SyncTransfer`` copies on the calling thread, so a CPU run exercises the same
scheduling synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._common.devices import stream_module

__all__ = ["Run", "Transfer", "SyncTransfer", "StreamTransfer", "transfer_for"]

# (indices, pack, start, end): the hosts at ``indices``, in that order, lie back to back in
# bytes [start, end) of pack.
Run = tuple[tuple[int, ...], torch.Tensor, int, int]


class Transfer:
    """Copies host tensors to ``device``.

    ``start`` begins copies and returns them with a ticket; ``runs`` (``hoststore.
    packed_runs``) name host tensors that lie back to back in one pinned buffer, which a
    transfer may copy in one piece (see [Note: packed masters] in ``hoststore.py``).
    ``wait`` makes compute wait for some tickets' copies and marks the copies as used by
    compute; it returns whether compute had to wait (always for a ``demand`` fetch, started
    just now), or None when that is only known later, from ``settle()``, which returns the
    ``(hits, misses)`` decided since its last call (``block=False``: only those known
    without waiting). ``synchronous``: every copy is complete when ``start`` returns, so a
    prefetched copy is always a hit and the pager need not call ``wait`` for it.
    ``copy_back`` copies a device copy into its host master (a buffer the forward may have
    written); a master so written holds its values once ``finish`` returns.
    """

    synchronous = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, hosts: Sequence[torch.Tensor], runs: Sequence[Run] = ()
              ) -> tuple[list[torch.Tensor], Any]:
        raise NotImplementedError

    def wait(self, groups: Sequence[tuple[Any, Sequence[torch.Tensor]]],
             demand: bool) -> bool | None:
        raise NotImplementedError

    def settle(self, block: bool = True) -> tuple[int, int]:
        return 0, 0

    def copy_back(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        master.copy_(copy)

    def finish(self) -> None:
        pass


class SyncTransfer(Transfer):
    """Copies on the caller's thread; every ticket is ready at once."""

    synchronous = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._on_cpu = device.type == "cpu"  # read per copy; torch.device attributes are slow

    def start(self, hosts: Sequence[torch.Tensor], runs: Sequence[Run] = ()
              ) -> tuple[list[torch.Tensor], Any]:
        # Tensor by tensor (packs are made for streams only). Both keep the master's strides
        # (channels_last stays channels_last); on the CPU clone gives a distinct tensor, so
        # the paging path is real there too.
        if self._on_cpu:
            return [h.clone() for h in hosts], None
        return [h.to(self.device, copy=True) for h in hosts], None

    def wait(self, groups: Sequence[tuple[Any, Sequence[torch.Tensor]]],
             demand: bool) -> bool | None:
        return demand  # a prefetched copy finished before start() returned


class StreamTransfer(Transfer):
    """Copies on a side stream (``non_blocking`` from pinned masters), one event per batch.

    Whether compute waited is decided on the GPU's clock, not the host's (the host runs far
    ahead): an event recorded on the compute stream where it would wait is compared with
    the copy's event once both have completed.
    """

    def __init__(self, device: torch.device, module: Any = None) -> None:
        super().__init__(device)
        # torch.cuda, or another accelerator's module with the same stream API
        self.module = module if module is not None else stream_module(device)
        self.stream = self.module.Stream(device)
        self._unsettled: list[tuple[list[Any], Any]] = []
        self._copying_back = False

    def start(self, hosts: Sequence[torch.Tensor], runs: Sequence[Run] = ()
              ) -> tuple[list[torch.Tensor], Any]:
        device = self.device
        with self.module.stream(self.stream):
            copies = _run_copies(hosts, runs, device)
            for k, c in enumerate(copies):  # those in no run: tensor by tensor
                if c is None:
                    h = hosts[k]
                    copies[k] = torch.empty_like(h, device=device).copy_(h, non_blocking=True)
            event = self.module.Event(enable_timing=True)
            event.record(self.stream)
        return copies, event  # type: ignore[return-value]

    def wait(self, groups: Sequence[tuple[Any, Sequence[torch.Tensor]]],
             demand: bool) -> bool | None:
        compute = self.module.current_stream(self.device)
        arrival = self.module.Event(enable_timing=True)
        if not demand:
            arrival.record(compute)
        for ticket, copies in groups:
            compute.wait_event(ticket)
            # Allocated on the side stream, used on the compute stream: without this the
            # allocator could hand the memory to the next copy while compute still reads it.
            # The views of one packed block record it once (a unit's packs, one per dtype,
            # interleave: a BatchNorm's int64 counter between float weights).
            recorded: list[torch.Tensor] = []
            for c in copies:
                base = c._base
                if base is None:
                    c.record_stream(compute)
                elif not any(base is r for r in recorded):
                    base.record_stream(compute)
                    recorded.append(base)
        if demand:
            return True
        self._unsettled.append(([t for t, _ in groups], arrival))
        return None

    def settle(self, block: bool = True) -> tuple[int, int]:
        if block and self._unsettled:
            self.module.synchronize(self.device)
        hits = misses = 0
        keep = []
        for tickets, arrival in self._unsettled:
            if not block and not (arrival.query() and all(t.query() for t in tickets)):
                keep.append((tickets, arrival))
                continue
            # elapsed_time(a, b) < 0: the copy ended after compute reached the wait.
            if all(t.elapsed_time(arrival) >= 0 for t in tickets):
                hits += 1
            else:
                misses += 1
        self._unsettled = keep
        return hits, misses

    def copy_back(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        # Queued on the compute stream, after the work that wrote the copy; a synchronous
        # copy would make the host wait for every such module (see [Note: buffers written
        # without a version bump] in _paging/writeback.py). The allocator keeps the copy's
        # memory until the compute stream is past this (``wait`` recorded it there).
        master.copy_(copy, non_blocking=True)
        self._copying_back = True

    def finish(self) -> None:
        if self._copying_back:
            self.module.synchronize(self.device)
            self._copying_back = False


def _run_copies(hosts: Sequence[torch.Tensor], runs: Sequence[Run],
                device: torch.device) -> list[torch.Tensor | None]:
    """Copies of the hosts in ``runs``, each run in one block on ``device`` and one copy, as
    views with the hosts' shapes and strides; None for the others."""
    copies: list[torch.Tensor | None] = [None] * len(hosts)
    for indices, pack, start, end in runs:
        block = torch.empty(end - start, dtype=torch.uint8, device=device)
        block.copy_(pack[start:end], non_blocking=True)
        typed: dict[torch.dtype, torch.Tensor] = {}
        for k in indices:
            h = hosts[k]
            view = typed.get(h.dtype)
            if view is None:
                view = typed[h.dtype] = block.view(h.dtype)
            # A host view's offset counts elements of its dtype from the pack's start.
            copies[k] = view.as_strided(h.shape, h.stride(),
                                        h.storage_offset() - start // h.element_size())
    return copies


def transfer_for(device: torch.device) -> Transfer:
    """The transfer a device supports: streams where it has them (CUDA, ROCm, XPU),
    synchronous copies elsewhere."""
    module = stream_module(device)
    if module is not None:
        return StreamTransfer(device, module)
    return SyncTransfer(device)
