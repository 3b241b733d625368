"""The saved-tensor hooks of one ``with spill():`` step: what to spill in forward, and
restoring it, prefetched in reverse save order, in backward.

[Note: what is spilled] The unit is a tensor's whole storage: a view saved for backward
keeps all of its storage alive, so only spilling the storage frees memory, and two views of
one storage (or one tensor saved twice) are copied out once and restored into one shared
storage again. Parameters stay, and so do views of a leaf (a tensor autograd did not make:
a parameter, frozen or not, a buffer, an input): something outside the graph holds their
storage, so a copy would free nothing (``nn.Linear`` saves ``weight.t()``). Tensors saved
while backward runs (recomputation by ``torch.utils.checkpoint``, double backward) stay
too: they are used at once. So do conj and neg views (their bit is not part of what a
restore rebuilds) and nested tensors. A whole tensor outside the graph (an input, a
parameter saved as it is) is spilled when large: the caller may hold it (then the copy
frees nothing), or it was made in the forward without gradients and only the graph holds it.

[Note: sharing an entry] A view saved while its storage already has an entry shares that
entry only when its bytes are the ones the entry copied: the same base tensor (so the same
version counter) at the same version. Otherwise it gets an entry of its own. Pieces of one
storage with counters of their own (``unsafe_chunk``'s, which GRU and LSTM cells fill one
after another) and a buffer refilled in place and saved again would otherwise be restored
with bytes copied before they were written. A ``detach()`` alias (``x * f(x).detach()``,
BYOL and SimSiam's stop-gradient) is a tensor of its own with no base, yet it shares its
original's version counter: a base-less tensor with the entry root's exact geometry (dtype,
offset, sizes, strides) over the same storage whose counter is the root's counts as the same
root. Whether the counter is the same is asked by moving one and reading the other (then
putting it back): ``.data`` makes the same geometry with a counter of its own, and a write
through it between the two saves must not be missed.

[Note: kept once, kept for good] A storage one save kept stays for every later save of it
in the step (a Tanh output saved by Tanh, then again by the next layer, with the limit
crossed in between): what holds the first save holds the storage, so copying it out for
the second would free nothing and only cost the copy. Keyed like entries, by device and
address, and weakly: once the storage is gone its address may serve another.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Any

import torch

from .._common.devices import format_bytes
from ._copies import Copier, Copies
from ._limits import Limits
from ._locks import HeldLock, when_free
from ._saved import Entry, EntryState, Kept, Packed, keep, share_version_counter
from ._settings import StepSettings
from ._stats import SpillStats, track_step

__all__ = ["Step"]

logger = logging.getLogger("adaptmem")

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_STORED = EntryState.STORED


def _in_backward() -> bool:
    return _graph_task_id is not None and _graph_task_id() != -1


def _same_root(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor, or aliases made by ``detach``: one geometry
    over one storage and one version counter (see [Note: sharing an entry])."""
    if a is b:
        return True
    return bool(a is not None and b._base is None and a._base is None
                and a.dtype == b.dtype and a.storage_offset() == b.storage_offset()
                and a.size() == b.size() and a.stride() == b.stride()
                and share_version_counter(a, b))


class Step:
    """The hooks and state of one ``with spill():`` block: which saved tensors are spilled
    (``Limits`` says when), their entries, and restoring them (``Copies`` moves the bytes)."""

    def __init__(self, settings: StepSettings, stats: SpillStats) -> None:
        self.settings = settings
        self.stats = stats
        # See [Note: releases deferred while a lock is held] in _locks.py.
        self.lock = HeldLock(threading.RLock())
        self.by_storage: weakref.WeakValueDictionary[Any, Entry] = weakref.WeakValueDictionary()
        self.by_seq: weakref.WeakValueDictionary[int, Entry] = weakref.WeakValueDictionary()
        # Storages a save kept while under the limit (see [Note: kept once, kept for good]).
        self.kept: weakref.WeakValueDictionary[Any, torch.UntypedStorage] = \
            weakref.WeakValueDictionary()
        self.seq = 0
        self.live = 0
        self.limits = Limits(settings, stats)
        self.copies = Copies(settings, stats, self.lock)
        self.error_raised = False
        self.exited = False
        track_step(self, stats)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks to enter for this step. Made here rather than kept: a step
        holding hooks bound to itself would be a cycle, and each step would wait for the
        garbage collector (forever under ``gc.disable()``) to let go of its state."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # -- forward: saving -------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        stats = self.stats
        stats.tensors_saved += 1
        if (_in_backward() or type(t) is not torch.Tensor or t.layout != torch.strided
                or t.is_nested or t.is_conj() or t.is_neg()):
            # A conj or neg view's bit is not part of what a restore rebuilds: it stays.
            return keep(t, stats)
        device = t.device  # asked once: each call makes a new torch.device
        if device.type == "meta" or (t.requires_grad and t.is_leaf):
            return keep(t, stats)
        base = t._base
        if base is not None and base.is_leaf:  # see [Note: what is spilled]
            return keep(t, stats)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or nbytes < self.settings.threshold:
            self.limits.count(device, nbytes)  # memory in use grows by it all the same
            return keep(t, stats)
        error = self.copies.error
        if error is not None:
            if not self.error_raised:
                self.error_raised = True
                raise error
            return keep(t, stats)
        key = (device, storage.data_ptr())
        root = t if base is None else base
        version = t._version
        with self.lock:
            entry = self.by_storage.get(key)
            if entry is not None and (
                    entry.storage_ref() is not storage  # the address was freed and reused
                    or entry.version != version
                    or not _same_root(entry.root_ref(), root)):  # [Note: sharing an entry]
                entry = None
        if entry is not None:
            stats.tensors_shared += 1
            return Packed(entry, t)
        if self.kept.get(key) is storage:  # see [Note: kept once, kept for good]
            return keep(t, stats)
        if not self.limits.over_limit(device, nbytes) or not self.copies.ready(device):
            self.kept[key] = storage
            return keep(t, stats)
        with self.lock:
            entry = Entry(self, self.seq, device, nbytes, storage, root, version)
            self.live += 1
            self.by_storage[key] = entry
            self.by_seq[self.seq] = entry
            self.seq += 1
        stats.tensors_spilled += 1
        stats.bytes_out += nbytes
        self.copies.copy_out(entry, storage, self.limits.max_pending())
        return Packed(entry, t)

    # -- backward: restoring ---------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, Kept):
            packed.check_version()
            return packed.alias
        if not isinstance(packed, Packed):
            return packed  # type: ignore[no-any-return]
        packed.check_version()
        entry = packed.entry
        storage = entry.step.restore(entry)
        with torch.no_grad():
            out = torch.empty(0, dtype=packed.dtype, device=entry.device)
            return out.set_(storage, packed.offset, packed.size, packed.stride)

    def restore(self, entry: Entry) -> torch.UntypedStorage:
        """``entry``'s storage, from memory, from its restored copy, or read back."""
        copies = self.copies
        with self.lock:
            if copies.discarded:
                raise RuntimeError(
                    "this saved tensor was spilled inside an adaptive.spill block that ended "
                    "with an exception, and its copy was discarded then; run the forward again"
                )
            if entry.state is not _STORED and entry.source is not None:
                if not entry.handed_back:  # not written yet: still in memory, no copy back
                    entry.handed_back = True
                    self.stats.tensors_restored += 1
                return entry.source.untyped_storage()
            restored = entry.restored
            if restored is None and entry.restored_ref is not None:
                restored = entry.restored_ref()
            if restored is not None:
                self._used(entry, restored)
                return restored
            future, entry.read = entry.read, None
            if future is None:
                future = copies.submit(Copier.READ, copies.read, entry)
            self._prefetch_before(entry.seq)
        ready = future.done()
        if not ready:
            start = time.perf_counter()
            concurrent.futures.wait([future])
            self.stats.seconds_waiting += time.perf_counter() - start
        data, done = future.result()
        copies.use(entry, data, done)
        storage = data.untyped_storage()
        with self.lock:
            entry.restored_ref = weakref.ref(storage)
            self._used(entry, storage)
        stats = self.stats
        stats.prefetch_hits += ready
        stats.prefetch_misses += not ready
        stats.tensors_restored += not entry.handed_back
        entry.handed_back = True
        stats.bytes_in += entry.nbytes
        self.limits.in_use(entry.device)
        return storage

    @staticmethod
    def _used(entry: Entry, restored: torch.UntypedStorage) -> None:
        """One saved tensor over ``entry`` was unpacked: its restored copy is held until each
        was, then only weakly. Unpacking again after that is a new backward pass through a
        retained graph, which holds it again: one read per storage per pass."""
        if entry.uses_left <= 0:
            entry.uses_left = entry.uses
        entry.uses_left -= 1
        entry.restored = restored if entry.uses_left > 0 else None

    def _prefetch_before(self, seq: int) -> None:
        """Start restoring the next entries backward will want: those saved just before."""
        depth = self.settings.prefetch
        ahead = 0
        s = seq - 1
        lowest = max(-1, seq - 1 - (4 * depth + 16))
        while ahead < depth and s > lowest:
            entry = self.by_seq.get(s)
            s -= 1
            if entry is None or entry.state is not _STORED:
                continue
            if entry.read is None:
                if entry.restored is not None or (
                        entry.restored_ref is not None and entry.restored_ref() is not None):
                    continue
                entry.read = self.copies.submit(Copier.READ, self.copies.read, entry)
            ahead += 1

    # -- lifetime --------------------------------------------------------------------------

    def release(self, offset: int, nbytes: int) -> None:
        """An entry died: nothing needs its bytes any more (``offset`` -1: it has no region
        of the scratch file). Now, or once this thread holds none of the step's locks (see
        [Note: releases deferred while a lock is held])."""
        when_free(self._release, offset, nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        with self.lock:
            self.live -= 1
            if self.live == 0:
                self.copies.idle(step_ended=self.exited)
            else:
                self.copies.free(offset, nbytes)

    def finish(self) -> None:
        """The block ended normally: the scratch file lives on while saved tensors need it.
        A copy out that failed unseen is a warning (the step kept those tensors)."""
        error = self.copies.end()
        with self.lock:
            self.exited = True
            if self.live == 0:
                self.copies.close()
        s = self.stats
        if self.seq:
            logger.info("spill: %d saved tensors (%s) copied out, %s copied back so far, "
                        "%.3f s waited", self.seq, format_bytes(s.bytes_out),
                        format_bytes(s.bytes_in), s.seconds_waiting)
        if error is not None and not self.error_raised:
            # Found only now: the tensors whose copy failed stayed in memory and the step is
            # right (its backward may be done, its gradients added), so it does not fail for
            # it; a copy that fails while a forward still saves raises there.
            self.error_raised = True
            logger.warning("%s. The tensors whose copy failed stayed in memory (the step is "
                           "right) instead of being spilled", error)

    def discard(self) -> None:
        """The block ended with an exception: drop every copy and the scratch file now."""
        self.copies.end()
        self.copies.discard()
        with self.lock:
            for seq in range(self.seq):
                entry = self.by_seq.get(seq)
                if entry is not None:
                    entry.source = entry.host = entry.read = entry.restored = None
            self.exited = True
            self.copies.close()
