"""The storages of simulated tensors: what ``torch.UntypedStorage`` methods reaching for the
CUDA runtime do under the simulation, so that ``torch.load`` onto ``cuda`` works (it reads
the storage's ``data_ptr``), and so do storage reads (``cpu()``, safetensors'
``data_ptr``). See [Note: saving simulated tensors] in _tensors.py."""

from __future__ import annotations

from typing import Any

import torch

from ._tensors import Tensors
from ._torch_cuda import Patches

__all__ = ["install_storages"]


def install_storages(tensors: Tensors, patches: Patches) -> None:
    """Answer ``UntypedStorage.to``/``cuda`` (``torch.load``'s restore), ``data_ptr`` and
    ``cpu`` for simulated storages, for the length of the simulation."""
    storage_class = torch.UntypedStorage
    original_to = storage_class.to
    original_data_ptr = storage_class.data_ptr
    original_cpu = storage_class.cpu
    state = tensors.state

    def device_storage(host: Any, index: int) -> Any:
        """A copy of host storage ``host`` on ``cuda:index``: a simulated tensor's."""
        backing = torch.empty(0, dtype=torch.uint8).set_(host).clone()
        return tensors.adopt(backing, index).untyped_storage()

    def host(storage: Any) -> Any:
        return tensors.lookup_storage(storage)[0].untyped_storage()

    def to(self: Any, *, device: Any, non_blocking: bool = False) -> Any:
        target = device if isinstance(device, torch.device) else torch.device(device)
        if target.type == "cuda":
            index = state.device_index(target)
            if self.device.type != "cuda":
                return device_storage(self, index)
            if self.device.index == index:
                return self
            return device_storage(host(self), index)
        if self.device.type == "cuda" and target.type == "cpu":
            return cpu(self)
        return original_to(self, device=device, non_blocking=non_blocking)

    def cpu(self: Any) -> Any:
        if self.device.type == "cuda":
            return host(self).clone()
        return original_cpu(self)

    def data_ptr(self: Any) -> int:
        if self.device.type == "cuda":
            return int(host(self).data_ptr())
        return int(original_data_ptr(self))

    patches.set(storage_class, "to", to)
    patches.set(storage_class, "data_ptr", data_ptr)
    patches.set(storage_class, "cpu", cpu)
