"""The host store: each distinct tensor's host master, the one copy that is never written.

A ``Slot`` holds the registered Parameter or buffer object (its identity never changes),
its master in host memory, and while the tensor is needed on the device, the device copy
(``state``: on the host only, a copy on its way, or loaded into ``tensor.data``).
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from .._common.devices import stream_module
from .._planning import ModuleSizes

__all__ = ["HOST", "LOADED", "PENDING", "Slot", "SlotState", "make_slots"]


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
                 "version", "state", "refs", "resident", "buffer")

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
        self.version = 0  # the tensor's version counter when its device copy was made
        self.refs = 0
        self.resident = False
        # Buffers may be written by the forward (a cache); parameters are only read.
        self.buffer = buffer

    def follow_data(self) -> None:
        """A loaded tensor given other data of its shape and dtype on the device
        (``tensor.data = new``, a resident weight swapped) keeps it: it is the copy now."""
        if self.state is LOADED and self.copy is not None:
            data = self.tensor.data
            if (data.data_ptr() != self.copy.data_ptr() and data.shape == self.copy.shape
                    and data.dtype == self.copy.dtype and data.device == self.copy.device):
                self.copy = data

    def restore(self) -> None:
        """Put the data back on its original device and dtype, bitwise, and forget any
        device copy. A loaded device copy is the live data (a resident weight edited in
        place, through ``.data`` too, or given other data, which the pager adopted), so it
        is copied into the master first."""
        if self.state is LOADED and self.copy is not None:
            self.master.copy_(self.copy)
        if self.original is not None:
            self.tensor.data = self.original
        else:
            self.tensor.data = torch.empty_like(self.master, device=self.origin).copy_(self.master)
        self.copy = self.ticket = None
        self.state = HOST


def make_slots(modules: dict[str, nn.Module], sizes: ModuleSizes, device: torch.device,
               pin_memory: bool) -> dict[str, Slot]:
    """A slot per distinct tensor of the model (canonical names, ties once), with its host
    master: the tensor's own data when it is on the CPU and need not be pinned, else a
    (pinned) CPU copy. Nothing of the model is changed."""
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
    slots = {}
    for name, t in tensors.items():
        data = t.data
        master: torch.Tensor = data
        original: torch.Tensor | None = data
        if data.device.type != "cpu":
            master, original = data.to("cpu"), None
        if pin:
            try:
                master = master.pin_memory()
                original = None
            except RuntimeError:  # pinned memory is a scarce resource; pageable works
                pass
        slots[name] = Slot(name, t, master, original, data.device, name in buffers)
    return slots
