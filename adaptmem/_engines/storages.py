"""Where each of a model's tensors lay in its storage before placement, so that ``remove()``
puts tensors that shared a storage back into one.

[Note: storages rebuilt on restore]
A tensor moved to another device and back gets memory of its own. Views of one flat buffer
(a flat-parameter model, a weight and a bias sliced from one tensor) would come back as
separate tensors, and a write to one of them, or to the flat buffer the caller kept, would
no longer reach the others. Keeping each original alive while the model is placed would
hold a second host copy of every moved weight, the memory chunking and paging exist to
save. So at placement each tensor's storage (by weak reference only), offset, shape and
strides are recorded, and a tensor coming back to its original device and dtype is laid out
as it was: in its original storage when something else kept that alive (the caller's flat
tensor, a tensor of the model that did not move, an original kept for a dtype change), else
in one new storage of the original size per group of tensors that shared one, each at its
offset with its strides (a non-dense view keeps them). The bytes of a new storage that no
tensor of the model covered are zeros: nothing but the storage itself could reach them. A new
storage is pinned where the original was (a paging plan's `adaptive.load` pins the host
units), so that a model placed and removed copies to its device asynchronously as before.
Tensors of two models placed by two engines that share a storage (not a tensor: that is
refused, see [Note: one engine per tensor] in ``_common/claims.py``) are grouped by each
engine apart, so when both moved they come back in a storage each.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .._common.pinning import extent, pinned_empty

__all__ = ["StorageLayout"]


class _Storage:
    """One original storage: a weak reference to it (or to the one that replaced it), its
    size, device and whether it was pinned, whether one tensor fills it exactly (then new
    memory need not be zeroed), and a new one made since the last ``settle()``."""

    __slots__ = ("ref", "nbytes", "device", "pinned", "filled", "made")

    def __init__(self, storage: Any, nbytes: int, device: torch.device, pinned: bool) -> None:
        self.ref = _weak(storage)
        self.nbytes = nbytes
        self.device = device
        self.pinned = pinned
        self.filled = False
        # Held until settle(): a storage object that takes no weak reference, or whose
        # Python object is made anew at each untyped_storage() (a tensor subclass's, the
        # simulated device's), is still found by the group's other tensors.
        self.made: Any = None

    def current(self) -> Any:
        """The storage to lay tensors out in: the original while it lives, else a new one,
        which the other tensors of the group then share."""
        if self.made is not None:
            return self.made
        storage = self.ref() if self.ref is not None else None
        if storage is not None and storage.nbytes() >= self.nbytes:
            return storage
        storage = self._new().untyped_storage()
        self.ref, self.made = _weak(storage), storage
        return storage

    def _new(self) -> torch.Tensor:
        if self.pinned:
            try:
                new = pinned_empty(self.nbytes)  # see [Note: pinned memory at its size]
                return new if self.filled else new.zero_()
            except RuntimeError:  # pinned memory is a scarce resource; pageable works
                pass
        make = torch.empty if self.filled else torch.zeros
        return make(self.nbytes, dtype=torch.uint8, device=self.device)


class _Place(NamedTuple):
    storage: _Storage
    offset: int
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class StorageLayout:
    """Each tensor's place in its storage at placement (see [Note: storages rebuilt on
    restore]); ``home(name, shape)`` gives a tensor laid out there again, and ``settle()``
    ends a round of them."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._places: dict[str, _Place] = {}
        groups: dict[tuple[torch.device, int], _Storage] = {}
        members: dict[tuple[torch.device, int], list[str]] = {}
        for name, t in tensors.items():
            data = t.data
            if data.is_meta or data.layout != torch.strided or not data.numel():
                continue  # no storage worth keeping: moved as a plain copy
            try:
                storage = data.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a subclass without one
                continue
            key = (data.device, ptr)
            offset = int(data.storage_offset())
            # At least what the tensor reaches: a simulated device's storage reports less.
            nbytes = max(storage.nbytes(), (offset + _extent(data)) * data.element_size())
            group = groups.get(key)
            if group is None:
                pinned = data.device.type == "cpu" and data.is_pinned()
                group = groups[key] = _Storage(storage, nbytes, data.device, pinned)
            group.nbytes = max(group.nbytes, nbytes)
            members.setdefault(key, []).append(name)
            self._places[name] = _Place(group, offset, data.shape, data.stride(), data.dtype)
        for names in members.values():
            place = self._places[names[0]]
            t = tensors[names[0]].data
            place.storage.filled = (len(names) == 1 and place.offset == 0
                                    and _extent(t) == t.numel()
                                    and t.numel() * t.element_size() == place.storage.nbytes)

    def home(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        """A tensor laid out where ``name`` lay before placement, in the original storage when
        it is alive (its values are then that storage's), else in new memory shared with the
        other tensors of that storage; None when the layout was not recorded (meta, sparse,
        empty tensors) or was for another ``shape``."""
        place = self._places.get(name)
        if place is None or place.size != shape:
            return None
        storage = place.storage.current()
        return torch.empty(0, dtype=place.dtype, device=place.storage.device).set_(
            storage, place.offset, place.size, place.stride)


    def settle(self) -> None:
        """Drop the new storages ``home`` made (the tensors laid out in them hold them)."""
        for place in self._places.values():
            place.storage.made = None


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to the last one ``t`` reaches in its storage."""
    return extent(t.shape, t.stride()) if t.numel() else 0


def _weak(storage: Any) -> Any:
    try:
        return weakref.ref(storage)
    except TypeError:  # a storage that takes no weak references: always rebuilt
        return None
