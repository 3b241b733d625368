"""The slot table: every tensor's slot (``hoststore.Slot``), the bytes the slots hold on the
device, and the one way weights come in and go out.

Loading a tensor assigns ``tensor.data = copy``; releasing it assigns ``tensor.data =
master`` and drops the copy. Slots are reference-counted, so tied tensors and nested units
are on the device once. Parameters are never written back; a buffer the forward wrote in
place (a cache, BatchNorm's statistics) is, by ``writeback.WriteBack``: See [Note: buffers
written without a version bump] in ``writeback.py``.

[Note: the one fast path] In the steady state a module's weights were all prefetched
together (one ticket) while the module before it ran, and nothing wrote to them since (their
version counters): ``acquire`` checks exactly that and installs them, on a synchronous
transfer without calling ``wait``, since such a copy was done before ``start`` returned.
Everything else (a miss, a stale copy, a tensor a running module holds already, a fetch that
does not fit) takes ``bring_in``, which handles every case and is correct without the fast
path. ``release`` runs per unit too, so it does ``unload``'s work inline.

[Note: paging under a trace] An ``initial_batchsize="auto"`` trace (or ``model=``'s
prediction) runs the forward under ``FakeTensorMode``, so the copies a fetch makes are fake
tensors, which is what lets the trace count them without moving a byte. But assigning a fake
copy to a parameter's ``.data`` leaves a plain Parameter backed by meta storage, which the
fake mode then converts as a real meta tensor: every op mixing it with the fake input fails
("found at least two devices, cpu and meta"). So a fake copy is also registered with the
mode as the stand-in for its parameter (the fake mode's memo of real tensors it has
converted): when the forward reaches the parameter, the mode finds the copy, on the device
it was made for. The memo dies with the trace's mode. Real copies take none of this (one
type check per fetch; a simulated device's copies, of their own type, also take the look-up
of the fake mode, which finds none outside a trace).

[Note: version reads skip torch function modes]
Reading ``tensor._version`` is a Python getter that every active ``TorchFunctionMode``
sees (a simulated device's, a user's); the pager reads it for every tensor it fetches or
installs. It is metadata no mode has a reason to change, so those reads run with torch
function handling off (``_no_modes``), which saves each read the trip through every mode.
Only when a mode is on: entering it costs more than a read without modes, so whether one is
on is asked once per outermost call (``SlotTable.modes``, set by the pager; a mode entered
during a forward just sees the reads, as before). Everything else the pager does (copies,
``.data`` assignments) stays visible to modes.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from .._common.devices import synchronize
from .._common.errors import PlacementError
from .._common.headroom import weight_room
from .._common.oom import free_caches, is_oom
from .._common.peak import fake_mode
from .._engines.hoststore import (  # See [Note: slot states ...]
    HOST,
    LOADED,
    PENDING,
    Slot,
    packed_runs,
)
from .._engines.stats import PagingStats
from .._engines.storages import StorageLayout
from .._engines.transfer import Transfer
from .._planning import Placement, Unit
from .writeback import WriteBack

__all__ = ["NoRoom", "SlotTable", "modes_on", "room_for_weights"]

logger = logging.getLogger("adaptmem")
# See [Note: version reads skip torch function modes]
_no_modes = torch._C.DisableTorchFunction
modes_on = torch._C._is_torch_function_mode_enabled


def _stand_in(slots: Sequence[Slot], copies: Sequence[torch.Tensor]) -> None:
    """Register fake ``copies`` as their slots' tensors with the fake mode tracing now (see
    [Note: paging under a trace])."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = fake_mode()
    if mode is None:
        return
    for s, c in zip(slots, copies, strict=True):
        if isinstance(c, FakeTensor):
            mode.fake_tensor_converter.set_tensor_memo(s.tensor, c)


def _prefetched(needs: Sequence[Slot], ticket: Any) -> bool:
    """Every slot of ``needs`` has its copy on the way in ``ticket``, and nothing wrote to
    its tensor since that copy was made (data given between calls was adopted when the call
    began: ``SlotTable.adopt``)."""
    for s in needs:
        if s.state is not PENDING or s.ticket is not ticket or s.tensor._version != s.version:
            return False
    return True


def _pending(slots: Sequence[Slot], copies: Sequence[torch.Tensor], ticket: Any) -> int:
    """Mark ``slots`` as copied to ``copies`` in ``ticket``, as of their tensors' versions
    now; returns their bytes."""
    nbytes = 0
    for s, c in zip(slots, copies, strict=True):
        s.copy, s.ticket, s.state, s.version = c, ticket, PENDING, s.tensor._version
        nbytes += s.nbytes
    return nbytes


def room_for_weights(device: torch.device, budget: int | None) -> int:
    """The device bytes weights may take: ``budget``, else free memory minus the reserve
    every engine keeps back (see [Note: headroom] in ``_common/headroom.py``)."""
    if budget is not None:
        return budget
    return weight_room(device)[0]


class NoRoom(Exception):
    """A fetch did not fit (budget, or an OOM that survived one retry)."""

    def __init__(self, need: int, oom: BaseException | None = None) -> None:
        super().__init__(need)
        self.need = need
        self.oom = oom


class SlotTable:
    """The slots by canonical name, their transfer to the device, and the bytes they hold.

    Attributes:
        slots: ``{canonical name: Slot}``.
        by_id: the slot of each registered tensor, by ``id(tensor)``.
        held: device bytes held for weights now (resident and paged).
        resident_bytes: of those, the bytes of resident units.
    """

    def __init__(self, slots: dict[str, Slot], device: torch.device, transfer: Transfer,
                 budget: int | None, stats: PagingStats) -> None:
        self.slots = slots
        self.by_id = {id(s.tensor): s for s in slots.values()}
        self.device = device
        self.transfer = transfer
        self.synchronous = transfer.synchronous
        self.budget = budget
        self.stats = stats
        self.held = 0
        self.resident_bytes = 0
        self.packed = any(s.pack is not None for s in slots.values())
        self.back = WriteBack(transfer, list(slots.values()))
        self._layout = StorageLayout({n: s.tensor for n, s in slots.items()})  # as given
        # A torch function mode was on when the current call began: See [Note: version
        # reads skip torch function modes].
        self.modes = False

    def _written_since_copy(self, s: Slot) -> bool:
        """``s``'s tensor was written in place since its copy was made."""
        if self.modes:  # See [Note: version reads skip torch function modes]
            with _no_modes():
                return s.tensor._version != s.version
        return s.tensor._version != s.version

    def fits(self, need: int) -> bool:
        return self.budget is None or self.held + need <= self.budget

    def acquire(self, needs: Sequence[Slot]) -> None:
        """Load ``needs`` and hold a reference to each. Raises ``NoRoom``, holding nothing,
        when they do not fit. See [Note: the one fast path]."""
        first = needs[0]
        if first.state is PENDING:
            ticket = first.ticket
            if self.modes:  # See [Note: version reads skip torch function modes]
                with _no_modes():
                    current = _prefetched(needs, ticket)
            else:
                current = _prefetched(needs, ticket)
            if current:
                if self.synchronous:
                    self.stats.prefetch_hits += 1
                    for s in needs:
                        s.tensor.data = s.copy  # type: ignore[assignment]
                        s.state, s.ticket = LOADED, None
                        s.refs += 1
                else:
                    self._install(needs, self.transfer.wait(
                        ((ticket, [s.copy for s in needs]),), False))  # type: ignore[misc]
                    for s in needs:
                        s.refs += 1
                return
        missing = [s for s in needs if s.state is not LOADED]
        if missing:
            self.bring_in(missing, keep=needs)
        for s in needs:
            s.refs += 1

    def bring_in(self, missing: list[Slot], keep: Collection[Slot]) -> None:
        """Load ``missing`` (none of them loaded), waiting for copies on their way and
        fetching the rest. When the fetch does not fit, copies prefetched for others (not
        in ``keep``) are dropped, caches emptied and it is tried once more; then it raises
        ``NoRoom``."""
        for s in missing:
            # Written in place since its copy was made (by a hook, or by an earlier module's
            # forward): the copy is stale.
            if s.state is PENDING and s.tensor._version != s.version:
                self.unload(s)
        absent = [s for s in missing if s.state is HOST]
        need = sum(s.nbytes for s in absent)
        if absent:
            if not self.fits(need):
                self.drop_pending(keep)
                if not self.fits(need):
                    raise NoRoom(need)
            try:
                self.fetch(absent)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self.drop_pending(keep)
                free_caches(self.device)
                try:
                    self.fetch(absent)
                except Exception as again:
                    if not is_oom(again):
                        raise
                    free_caches(self.device)
                    raise NoRoom(need, again) from None
        ticket = missing[0].ticket
        if all(s.ticket is ticket for s in missing):  # the usual case: one prefetch or fetch
            groups = [(ticket, [s.copy for s in missing])]
        else:
            tickets: dict[int, list[Slot]] = {}
            for s in missing:
                tickets.setdefault(id(s.ticket), []).append(s)
            groups = [(g[0].ticket, [s.copy for s in g]) for g in tickets.values()]
        self._install(missing, self.transfer.wait(groups, demand=bool(absent)))  # type: ignore[arg-type]

    def adopt(self, names: Sequence[str]) -> None:
        """The tensors ``names`` were given other data between calls (found by the guard,
        of their dtype and device): a tensor at rest adopts it as its master's values
        (``_adopt``), a loaded (resident) one as its device copy."""
        slots = [self.slots[name] for name in names]
        self.back.before_read(slots)
        for s in slots:  # all or nothing
            new = s.tensor.data
            if new.shape != s.master.shape or new.dtype != s.master.dtype:
                raise PlacementError(
                    f"{s.name!r} was given data of shape {list(new.shape)} and {new.dtype} "
                    f"while placed, where it was {list(s.master.shape)} and {s.master.dtype}; "
                    f"remove() the placement, change the model, then place it again")
        for s in slots:
            if s.state is LOADED:
                s.follow_data()
            else:
                self._adopt(s)

    def _adopt(self, s: Slot) -> None:
        """``s``'s tensor (at rest) was given other data of its shape and dtype between
        calls: that data is the weight now, and a copy made from the old master is dropped.
        The master becomes the new data when the master was the tensor's own CPU data, else
        (a pinned or separate host copy, the pager's own) takes its values."""
        new = s.tensor.data
        if s.state is PENDING:
            self.unload(s)
        if s.original is not None:  # the master was the tensor's own data: not ours to write
            s.master = s.original = new if new.device.type == "cpu" else new.to("cpu")
        else:
            s.master.copy_(new)
        s.tensor.data = s.master

    def _install(self, slots: Sequence[Slot], waited: bool | None) -> None:
        """Point each slot's tensor at its device copy; count whether compute waited on it
        (a prefetch miss) or found it ready (a hit); None means neither applies."""
        if waited:
            self.stats.prefetch_misses += 1
        elif waited is not None:
            self.stats.prefetch_hits += 1
        for s in slots:
            s.tensor.data = s.copy  # type: ignore[assignment]
            s.state, s.ticket = LOADED, None

    def fetch(self, slots: Sequence[Slot], masters: Sequence[torch.Tensor] | None = None) -> None:
        """Start copying ``slots`` (all on the host) to the device (``masters``: theirs, when
        known)."""
        self.back.before_read(slots)
        copies, ticket = self._start(masters or [s.master for s in slots], slots)
        if copies and type(copies[0]) is not torch.Tensor:
            _stand_in(slots, copies)  # See [Note: paging under a trace]
        if self.modes:  # See [Note: version reads skip torch function modes]
            with _no_modes():
                nbytes = _pending(slots, copies, ticket)
        else:
            nbytes = _pending(slots, copies, ticket)
        self._add(nbytes)
        self.stats.transfers += 1
        self.stats.bytes_moved += nbytes

    def keep_resident(self, units: Sequence[Unit], allowance: int) -> list[Unit]:
        """Copy units to the device for good, in order, while their bytes fit in
        ``allowance``; the first that does not fit in memory ends it. Returns ``units``,
        each marked resident or paged. The host waits for the copies: a forward may run on
        any stream (a server's own), not only the one current now, which alone waits."""
        placed = []
        for unit in units:
            slots, used = [self.slots[n] for n in unit.tensors], self.resident_bytes
            resident = bool(slots) and used + sum(s.nbytes for s in slots) <= allowance
            if resident and not self._make_resident(slots, unit.name):
                resident, allowance = False, used
            placed.append(replace(unit, placement=Placement.RESIDENT if resident
                                  else Placement.PAGED))
        if self.resident_bytes:
            synchronize(self.device)
        return placed

    def _make_resident(self, slots: Sequence[Slot], unit: str) -> bool:
        """Copy ``slots`` (``unit``'s) to the device for good. Returns False, changing
        nothing, when they do not fit (an out-of-memory error)."""
        try:
            # Tensor by tensor: a resident weight lives on its own, so that a trace (which
            # counts a view of a weight as its storage's bytes, see [Note: packed
            # masters]) or a view kept by the caller never stands for a whole unit.
            copies, ticket = self._start([s.master for s in slots], ())
            self.transfer.wait([(ticket, copies)], demand=True)
        except Exception as exc:
            if not is_oom(exc):
                raise
            logger.info("adaptmem page: %s did not fit on %s while making it resident (%s); "
                        "it is paged instead", unit, self.device, exc)
            return False
        for s, c in zip(slots, copies, strict=True):
            s.copy, s.state, s.resident, s.tensor.data = c, LOADED, True, c
        nbytes = sum(s.nbytes for s in slots)
        self._add(nbytes)
        self.resident_bytes += nbytes
        return True

    def _start(self, hosts: Sequence[torch.Tensor], slots: Sequence[Slot]
               ) -> tuple[list[torch.Tensor], Any]:
        """Start copying ``hosts`` (the masters of ``slots``; none: tensor by tensor): runs
        of packed masters in one copy each (see [Note: packed masters] in
        ``hoststore.py``), but under a trace, which copies nothing (see [Note: paging under
        a trace])."""
        runs = packed_runs(slots) if slots and self.packed and fake_mode() is None else ()
        if torch.is_inference_mode_enabled():
            # A copy made under inference_mode is an inference tensor, which a forward with
            # autograd on could not use; resident copies outlive the mode they were made in.
            with torch.inference_mode(False):
                return self.transfer.start(hosts, runs)
        return self.transfer.start(hosts, runs)

    def _add(self, nbytes: int) -> None:
        self.held += nbytes
        if self.held > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = self.held

    def release(self, slots: Sequence[Slot]) -> None:
        """Drop a reference to each of ``slots``; those no longer held go back to the host."""
        freed = 0
        for s in slots:
            s.refs -= 1
            if s.refs == 0 and not s.resident:  # unload, inline: see [Note: the one fast path]
                if s.buffer:  # See [Note: buffers written without a version bump]
                    self.back.keep(s, self._written_since_copy(s))
                s.tensor.data = s.master
                s.copy = None
                s.state = HOST
                freed += s.nbytes
        self.held -= freed

    def unload(self, s: Slot) -> None:
        """Forget ``s``'s device copy (loaded or on its way)."""
        if s.state is LOADED:
            s.tensor.data = s.master
        s.copy, s.ticket, s.state = None, None, HOST
        self.held -= s.nbytes

    def drop_pending(self, keep: Collection[Slot] = ()) -> None:
        """Forget every copy on its way, but those of ``keep``."""
        kept = {id(s) for s in keep}
        for s in self.slots.values():
            if s.state is PENDING and id(s) not in kept:
                self.unload(s)

    def end_call(self) -> None:
        """The outermost call into the model ended: drop copies prefetched for modules it
        did not reach, so none is left to serve weights edited before the next call, and
        let the buffers copied back arrive."""
        if self.held != self.resident_bytes:
            self.drop_pending()
        self.back.finish()

    def settle(self, block: bool) -> None:
        """Count the prefetch hits and misses the transfer has decided since last time."""
        hits, misses = self.transfer.settle(block)
        self.stats.prefetch_hits += hits
        self.stats.prefetch_misses += misses

    def restore(self, from_device: bool = True) -> None:
        """Every tensor back on its original device and dtype; nothing held on the device
        (``from_device=False``: the device cannot be read, and the host masters are kept as
        they are)."""
        try:
            for s in self.slots.values():
                s.restore(self._layout, from_device)
        finally:
            self._layout.settle()
        self.held = 0

    def forget(self) -> None:
        """Let go of every slot, after ``restore``: see [Note: a removed pager holds nothing]
        in pager.py."""
        self.slots, self.by_id = {}, {}
        self.back = WriteBack(self.transfer, [])
        self._layout = StorageLayout({})

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """``{canonical name: [host master, device copy if resident]}``; see
        ``Pager.load_targets``."""
        self.settle(block=True)
        self.back.finish()
        self.drop_pending()
        out = {}
        for name, s in self.slots.items():
            targets = [s.master]
            if s.resident and s.copy is not None:
                targets.append(s.copy)
            out[name] = targets
        return out
