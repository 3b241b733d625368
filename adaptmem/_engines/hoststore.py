"""The host store: each distinct tensor's host master, the one copy that is never written.

A ``Slot`` holds the registered Parameter or buffer object (its identity never changes),
its master in host memory, and while the tensor is needed on the device, the device copy
(``state``: on the host only, a copy on its way, or loaded into ``tensor.data``).

[Note: packed masters]
A paged model with many small tensors (ResNet-101: 626 tensors in 47 units, a convolution's
weights 16 KiB to 9 MiB) paid for every tensor's copy on its own: an allocation, a copy
launched on the side stream and a ``record_stream``. On an H200 its forward took 3.1x its
bound at batch 1, about 38 us of host time per copy, where GPT-2-XL, whose units hold a few
large tensors, ran at 1.16x. So where masters are pinned for an accelerator, the masters of
each unit are made as views of one pinned buffer (a "pack"), back to back in slot order,
each starting at a multiple of PACK_ALIGN bytes (what ``cudaMalloc`` guarantees, so that no
kernel sees a less aligned weight than it would alone). A unit's tensors of another dtype
(a BatchNorm's ``num_batches_tracked``) get a pack of their own: ``torch.save`` refuses one
storage viewed as two dtypes, and ``state_dict()`` of a paged model holds views of the
packs. A fetch then copies each run of slots that lie back to back in one pack with one
allocation and one copy, and hands out views of that block (``packed_runs``; the transfer
does the rest). Resident units are copied tensor by tensor, once: a trace predicting peak
memory counts a view of a weight already on the device as its storage's bytes (its input
was real, and the fake view has a storage of its own), and that storage must be the weight,
not its unit. The padding is at most PACK_ALIGN - 1 bytes a tensor, less than the 512 bytes
a block of the caching allocator is rounded to. Tensors another unit borrows (ties), and
units of one tensor, are not packed: a block lives while any of its views does, so a tensor
held longer than its unit would keep its whole block on the device. For the same reason a
view of a paged weight or buffer that outlives the forward (part of an output the caller
keeps, or saved for a backward) holds its unit's whole block, outside the pager's count of
bytes held: clone what is kept (resident weights are on their own). The masters of a unit
of one dtype share one storage while the model is placed (``state_dict()`` then holds views
of it); ``remove()`` lays every tensor out in its storage as before placement (see [Note:
storages rebuilt on restore] in ``storages.py``). Building the packs copies each tensor
once, straight into pinned memory, where pinning tensor by tensor made a pageable CPU copy
first for tensors on a device. On CUDA a pack is pinned at its size, not at the power of two
torch's host allocator rounds to (see [Note: pinned memory at its size] in
``_common/pinning.py``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._common.devices import stream_module
from .._common.pinning import extent, pinned_copy, pinned_empty
from .._planning import ModuleSizes
from .storages import StorageLayout
from .transfer import Run

__all__ = ["HOST", "LOADED", "PACK_ALIGN", "PENDING", "Slot", "SlotState", "make_slots",
           "packed_runs"]

logger = logging.getLogger("adaptmem")

PACK_ALIGN = 256  # bytes; see [Note: packed masters]


class SlotState(enum.Enum):
    """Where a slot's tensor is. Compare with ``is`` against the module names below."""

    HOST = "host"  # only the host master
    PENDING = "pending"  # a device copy on its way
    LOADED = "loaded"  # the device copy is ``tensor.data``


# [Note: slot states on the hot path] Reading a member off an Enum class costs about 0.1 us
# (``EnumType`` attribute lookup), several times a global's; the pager compares states per
# tensor in every hook, so it uses these module names, and ``is``.
HOST, PENDING, LOADED = SlotState.HOST, SlotState.PENDING, SlotState.LOADED


class Slot:
    """One distinct tensor: the registered object, its host master, its device copy."""

    __slots__ = ("name", "tensor", "master", "original", "origin", "nbytes", "copy", "ticket",
                 "version", "state", "refs", "resident", "buffer", "copy_back", "pack",
                 "offset", "end", "restored")

    def __init__(self, name: str, tensor: torch.Tensor, master: torch.Tensor,
                 original: torch.Tensor | None, origin: torch.device,
                 buffer: bool = False) -> None:
        self.name = name
        self.tensor = tensor
        self.master = master
        self.original = original  # the data to put back, when the master is not a copy
        self.origin = origin
        self.nbytes = master.numel() * master.element_size()
        self.copy: torch.Tensor | None = None
        self.ticket: Any = None
        self.state: SlotState = HOST
        # The tensor's version counter when its device copy was made. Some ops write without
        # moving it (see [Note: buffers written without a version bump] in _paging/writeback.py).
        self.version = 0
        self.refs = 0
        self.resident = False
        # Buffers may be written by the forward (a cache); parameters are only read.
        self.buffer = buffer
        # Copied back to the master after every use, whether its version moved or not (the
        # pager decides which: a small buffer).
        self.copy_back = False
        # The pinned buffer the master is a view of, and the master's bytes in it, up to
        # where the next one may start (see [Note: packed masters]).
        self.pack: torch.Tensor | None = None
        self.offset = self.end = 0
        self.restored = False  # put back by restore(): see restore

    def follow_data(self) -> None:
        """A loaded tensor given other data of its shape and dtype on the device
        (``tensor.data = new``, a resident weight swapped) keeps it: it is the copy now."""
        if self.state is LOADED and self.copy is not None:
            data = self.tensor.data
            if (data.data_ptr() != self.copy.data_ptr() and data.shape == self.copy.shape
                    and data.dtype == self.copy.dtype and data.device == self.copy.device):
                self.copy = data

    def restore(self, layout: StorageLayout, from_device: bool = True) -> None:
        """Put the data back on its original device and dtype, bitwise, laid out in its
        storage as it was (see [Note: storages rebuilt on restore] in ``storages.py``), and
        forget any device copy. A loaded device copy is the live data (a resident weight
        edited in place, through ``.data`` too, or given other data, which the pager
        adopted), so it is copied into the master first, unless ``from_device`` is False
        (the device can no longer be read). Once done it does nothing (a ``remove()``
        interrupted and called again): the tensor is the model's own again."""
        if self.restored:
            return
        if from_device and self.state is LOADED and self.copy is not None:
            self.master.copy_(self.copy)
        if self.original is not None:
            self.tensor.data = self.original
        else:
            home = layout.home(self.name, self.master.shape)
            if home is None:
                home = torch.empty_like(self.master, device=self.origin)
            self.tensor.data = home.copy_(self.master)
        self.copy = self.ticket = None
        self.state = HOST
        self.restored = True


def make_slots(modules: dict[str, nn.Module], sizes: ModuleSizes, device: torch.device,
               pin_memory: bool, groups: Sequence[Sequence[str]] = ()) -> dict[str, Slot]:
    """A slot per distinct tensor of the model (canonical names, ties once), with its host
    master: the tensor's own data when it is on the CPU and need not be pinned, else a
    (pinned) CPU copy. Where masters are pinned, those of each of ``groups`` (the tensors a
    unit owns) are views of one pinned buffer (see [Note: packed masters]). Nothing of the
    model is changed."""
    pin = pin_memory and stream_module(device) is not None  # pinned: async copies
    tensors = {}
    buffers = set()
    for mod_name, module in modules.items():
        for registry in (module._parameters, module._buffers):
            for attr, t in registry.items():
                full = f"{mod_name}.{attr}" if mod_name else attr
                if t is not None and full in sizes.tensors:
                    tensors[full] = t
                    if registry is module._buffers:
                        buffers.add(full)
    packed = _packs(tensors, groups, device) if pin else {}
    slots = {}
    for name, t in tensors.items():
        data = t.data
        if name in packed:
            view, pack, offset, end = packed[name]
            s = slots[name] = Slot(name, t, view, None, data.device, name in buffers)
            s.pack, s.offset, s.end = pack, offset, end
            continue
        master: torch.Tensor = data
        original: torch.Tensor | None = data
        if pin:
            try:
                master, original = pinned_copy(data, device), None
            except RuntimeError:  # pinned memory is a scarce resource; pageable works
                pass
        if master.device.type != "cpu":
            master, original = data.to("cpu"), None
        slots[name] = Slot(name, t, master, original, data.device, name in buffers)
    return slots


def _packs(tensors: dict[str, torch.Tensor], groups: Sequence[Sequence[str]],
           device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``{name: (master, pack, offset, end)}`` for the tensors of ``groups`` packed into one
    pinned buffer per group and dtype for ``device``, in ``tensors``' order, their values
    copied in (see [Note: packed masters]). A group whose buffer cannot be pinned is left out."""
    rank = {n: i for i, n in enumerate(tensors)}
    by_dtype: dict[tuple[int, torch.dtype], list[str]] = {}  # one pack per dtype of a group
    for i, group in enumerate(groups):
        for n in group:
            if n in tensors and tensors[n].numel():
                by_dtype.setdefault((i, tensors[n].dtype), []).append(n)
    out = {}
    for same in by_dtype.values():
        names = sorted(same, key=rank.__getitem__)
        if len(names) < 2:
            continue
        layout = []
        total = 0
        for n in names:
            data = tensors[n].data
            # The strides a copy keeps (empty_like's: a dense layout such as channels_last
            # stays, anything else becomes contiguous), on the meta device: no memory.
            stride = torch.empty_like(data, device="meta").stride()
            end = total + extent(data.shape, stride) * data.element_size()
            aligned = -(-end // PACK_ALIGN) * PACK_ALIGN  # where the next one may start
            layout.append((n, data, stride, total, end, aligned))
            total = aligned
        try:
            pack = pinned_empty(total, device)  # see [Note: pinned memory at its size]
        except RuntimeError as exc:  # pinned memory is a scarce resource; pageable works
            logger.debug("adaptmem page: %d bytes of pinned memory refused (%s); the group's "
                         "tensors are pinned one by one", total, exc)
            continue
        for n, data, stride, offset, end, aligned in layout:
            view = pack[offset:end].view(data.dtype).as_strided(data.shape, stride)
            view.copy_(data)
            out[n] = (view, pack, offset, aligned)
    return out


def packed_runs(slots: Sequence[Slot]) -> list[Run]:
    """``(indices, pack, start, end)`` for each run of two or more of ``slots`` whose masters
    lie back to back in one pack, bytes ``[start, end)`` of it: one copy each (see [Note:
    packed masters]). A unit's packs interleave in slot order (a BatchNorm's int64 counter
    between float tensors), so a run's slots need not be neighbours in ``slots``."""
    runs: list[Run] = []
    # The run being extended in each pack: [indices, pack, start, end], by id(pack).
    growing: dict[int, list[Any]] = {}
    for k, s in enumerate(slots):
        pack = s.pack
        if pack is None:
            continue
        run = growing.get(id(pack))
        if run is not None and run[3] == s.offset:
            run[0].append(k)
            run[3] = s.end
            continue
        if run is not None and len(run[0]) > 1:
            runs.append((tuple(run[0]), pack, run[2], run[3]))
        growing[id(pack)] = [[k], pack, s.offset, s.end]
    for indices, pack, start, end in growing.values():
        if len(indices) > 1:
            runs.append((tuple(indices), pack, start, end))
    return runs
