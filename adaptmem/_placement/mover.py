"""Moving a model's tensors between placements, and putting them back bitwise.

Placement swaps tensor storage only (``param.data = ...``): parameter identity, ``state_dict``
keys and module classes never change. Where a unit's dtype differs from a tensor's own, the
original is kept for ``remove()``, in host memory (see [Note: originals kept in host
memory]); see [Note: writes to a converted copy]. Where only the
device changes, it is not, and a tensor coming back is laid out in its storage as it was;
see [Note: storages rebuilt on restore] in ``_engines/storages.py``.

[Note: writes to a converted copy] A placed tensor may be written by the forward (a step
counter, a running statistic) or by the user between calls (``p.data.fill_(0.5)``,
``p.data = new``, an optimizer step). When it is a converted copy, the write is carried into
the kept original before the next move or ``remove()``, so the model keeps it as an
unconverted tensor would (in the original dtype, so rounded by the trip through the placed
one). Writes through ``.data`` move no version counter, so a write is found by comparing:
the placed copy against the original converted as it was at placement, bit by bit, and only
the elements that differ are written back (the others keep their unrounded values). That
costs one conversion and one copy to the original's device per converted tensor, at each
re-placement and at ``remove()``, which moves every unconverted tensor back anyway. The
loader (``load_targets``) writes both the placed copy and the original, so its writes
compare equal and are not carried twice.

[Note: originals kept in host memory] The original a dtype change replaced is kept in host
memory, also when it lived on an accelerator (a model moved to the GPU, then placed there in
float16): kept on the device it would hold the model twice, in both dtypes, there, beyond
what the plan counts, and a model that fits once converted would not fit. ``remove()``
brings it back to its device, laid out as it was (see [Note: storages rebuilt on
restore]), so the device must then have room for the original again. Its trip to the host
costs one copy per converted tensor at placement.

[Note: no placement inside a trace] Under a ``FakeTensorMode`` (the traces that predict a
decorated function's memory, see ``_execution/auto.py``) a copy of a weight is a fake
tensor, and a placement made there would leave fakes (or meta tensors) in the model in
place of its weights: every later forward computes garbage, and ``remove()`` has nothing
to put back. So no tensor is moved while a fake mode is active: a Chunker or Splitter not
placed yet ends the trace at its first forward with ``NotYet`` (the real call places it,
a later call is traced again), and a re-placement asked for there is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .._common.errors import PlacementError
from .._common.peak import fake_mode
from .._engines.storages import StorageLayout
from .._planning import Target, Unit

__all__ = ["PlacedTensors", "set_data"]


class PlacedTensors:
    """A model's tensors (by canonical name) and where each one is placed: the label of its
    target, and the original a dtype change replaced, kept for ``restore_all()``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], targets: Mapping[str, Target]
                 ) -> None:
        self.tensors = dict(tensors)
        self.original = {n: (t.device, t.dtype) for n, t in self.tensors.items()}
        self._layout = StorageLayout(self.tensors)
        self._targets = targets
        self._kept: dict[str, torch.Tensor] = {}  # originals a lossy dtype change replaced
        self._where: dict[str, str] = {}  # tensor -> label, for tensors that were moved

    def apply(self, units: Sequence[Unit]) -> None:
        """Move every tensor whose label changed; on any failure put back what moved."""
        if fake_mode() is not None:  # See [Note: no placement inside a trace]
            raise PlacementError(
                "a model's weights cannot be placed while a FakeTensorMode is active: the "
                "copies would be fake tensors standing in for real weights; place (or "
                "re-place) the model outside the trace")
        wanted = {t: u.placement for u in units for t in u.tensors}
        before = dict(self._where)
        moved: list[str] = []
        try:
            with torch.no_grad():
                for name, label in wanted.items():
                    if self._where.get(name) != label:
                        moved.append(name)
                        self._move(name, self._targets[label])
                        self._where[name] = label
        except BaseException:
            with torch.no_grad():
                for name in moved:
                    if name in before:
                        self._move(name, self._targets[before[name]])
                        self._where[name] = before[name]
                    else:
                        self._restore(name)
                        self._where.pop(name, None)
            raise
        finally:
            self._layout.settle()

    def restore_all(self) -> None:
        """Every moved tensor back, bitwise, on its original device and dtype."""
        try:
            with torch.no_grad():
                for name in list(self._where):
                    self._restore(name)
                    del self._where[name]
        finally:
            self._layout.settle()

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """See ``Splitter.load_targets``."""
        out: dict[str, list[torch.Tensor]] = {}
        for name, t in self.tensors.items():
            targets = [t.data]
            kept = self._kept.get(name)
            if kept is not None and not kept.is_meta:
                targets.append(kept)
            out[name] = targets
        return out

    def _move(self, name: str, target: Target) -> None:
        t = self.tensors[name]
        self._sync_back(name)
        device, dtype = self.original[name]
        want = target.dtype if target.dtype is not None and t.is_floating_point() else dtype
        source = self._kept.get(name, t.data)
        if source.is_meta and not t.data.is_meta:
            source = t.data  # materialised from meta earlier: its values live only here
        if source.device == target.device and source.dtype == want:
            placed = source
        elif source.is_meta:
            placed = torch.empty_like(source, device=target.device, dtype=want)
        else:  # back where it came from (a device_map edit): laid out as it was
            home = (self._layout.home(name, source.shape)
                    if (target.device, want) == (device, dtype) else None)
            placed = (home.copy_(source) if home is not None
                      else source.to(device=target.device, dtype=want, copy=True))
        if want != dtype or source.is_meta:
            if name not in self._kept:  # See [Note: originals kept in host memory]
                self._kept[name] = (source if source.is_meta or source.device.type == "cpu"
                                    else source.to("cpu"))
        else:
            self._kept.pop(name, None)
        set_data(t, placed)

    def _sync_back(self, name: str) -> None:
        """Carry writes to the placed copy into the kept original: see [Note: writes to a
        converted copy]."""
        kept = self._kept.get(name)
        placed = self.tensors[name].data
        if kept is None or kept.is_meta or placed.is_meta or placed.shape != kept.shape:
            return
        placed = placed.to(kept.device)
        changed = _bits(placed) != _bits(kept.to(placed.dtype))
        if changed.any():
            kept[changed] = placed[changed].to(kept.dtype)

    def _restore(self, name: str) -> None:
        t = self.tensors[name]
        self._sync_back(name)
        kept = self._kept.pop(name, None)
        if kept is not None:
            set_data(t, kept)
        device, dtype = self.original[name]
        if t.device != device or t.dtype != dtype:
            home = None if t.is_meta else self._layout.home(name, t.shape)
            set_data(t, home.copy_(t.data) if home is not None
                     else t.data.to(device=device, dtype=dtype))
        grad = t.grad
        if grad is not None and (grad.dtype != t.dtype or grad.device != t.device):
            t.grad = grad.to(device=t.device, dtype=t.dtype)  # a backward ran while placed


_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, so that equal means bitwise equal
    (NaN included)."""
    return t.view(_INTEGERS[t.element_size()]) if t.element_size() in _INTEGERS else t


def set_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """Point ``t`` (a registered parameter or buffer) at ``data``, keeping its identity."""
    if t.is_meta == data.is_meta:
        t.data = data
        return
    # set_data cannot cross between meta and real tensors; swapping contents can, and the
    # Python object (and so every reference to the parameter) stays the same.
    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    torch.utils.swap_tensors(t, new)
