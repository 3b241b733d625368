"""What autograd holds for a saved tensor inside ``spill``: a spilled storage's entry and
the views over it, or a tensor that stays.

[Note: version check] Autograd does not check the version counter of a tensor whose saving
a hook took over, so spilling does: each saved tensor keeps a storage-less alias that
shares its version counter (``detach`` shares it; ``set_`` then drops the storage), and a
restore that finds the counter moved raises autograd's own error.

[Note: kept tensors] A tensor that stays must not be handed back to autograd as it is:
a saved output holds its own grad_fn, and a node that holds it through a hook's Python
object is a cycle across C++ that Python's gc cannot see, so a graph that backward never
frees (an interrupted step) would leak. A detached alias shares the storage and version
counter without the grad_fn, and gets the same version check as a spilled tensor.
"""

from __future__ import annotations

import concurrent.futures
import enum
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ._stats import SpillStats

__all__ = ["Entry", "EntryState", "Kept", "KeptLeaf", "Packed", "keep", "share_version_counter"]

_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def share_version_counter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have one version counter (``detach`` shares it, ``.data`` and
    ``set_`` do not): move ``b``'s, read ``a``'s, put it back. False where torch cannot set
    a counter. Call it where nothing else can write either tensor meanwhile."""
    version = b._version
    if _set_version is None or a._version != version:
        return False
    _set_version((b,), (version + 1,))
    shared = a._version == version + 1
    _set_version((b,), (version,))
    return shared


class EntryState(enum.Enum):
    """Where a spilled storage's bytes are."""

    PENDING = "pending"  # the copy out is under way
    STORED = "stored"  # in the next tier
    KEPT = "kept"  # the copy out failed: still in memory


class Owner(Protocol):
    """The step an entry belongs to."""

    def release(self, offset: int, nbytes: int) -> None: ...

    def restore(self, entry: Entry) -> torch.UntypedStorage: ...


class Entry:
    """One spilled storage: where its bytes are, and its restored copy while one lives."""

    __slots__ = ("step", "seq", "device", "nbytes", "state", "source", "host", "offset",
                 "event", "storage_ref", "restored", "restored_ref", "read", "uses", "uses_left",
                 "handed_back", "root_ref", "version", "__weakref__")

    def __init__(self, step: Owner, seq: int, device: torch.device, nbytes: int,
                 storage: torch.UntypedStorage, root: torch.Tensor, version: int) -> None:
        self.step = step
        self.seq = seq
        self.device = device
        self.nbytes = nbytes
        self.state = EntryState.PENDING
        self.source: torch.Tensor | None = None  # the original bytes until written (CPU)
        self.host: torch.Tensor | None = None  # the host copy (accelerators)
        self.offset = -1  # in the scratch file
        self.event: Any = None  # marks the device-to-host copy done
        self.storage_ref = weakref.ref(storage)
        # See [Note: sharing an entry]: the tensor (a view's base) whose version counter
        # covers the bytes copied, and its version then.
        self.root_ref = weakref.ref(root)
        self.version = version
        # The restored copy is held until every saved tensor over it was unpacked once
        # (backward's last use of it), then only weakly (for a retain_graph second pass).
        self.restored: torch.UntypedStorage | None = None
        self.restored_ref: Callable[[], torch.UntypedStorage | None] | None = None
        self.uses = 0  # saved tensors over this entry
        self.uses_left = 0  # of them, not yet unpacked in this backward pass
        self.handed_back = False  # counted in tensors_restored
        self.read: concurrent.futures.Future[Any] | None = None  # a restore under way

    def __del__(self) -> None:
        try:
            self.step.release(self.offset, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to tidy
            pass


class Packed:
    """What autograd holds for a spilled saved tensor: its entry, its view geometry, and an
    alias that shares its version counter (see [Note: version check])."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "alias", "version", "maker")

    def __init__(self, entry: Entry, t: torch.Tensor) -> None:
        self.entry = entry
        entry.uses += 1
        entry.uses_left += 1
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        version = t._version
        with torch.no_grad():
            alias = t.detach()
            alias.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
        if _set_version is not None:
            _set_version((alias,), (version,))  # set_ counted as a write; undo that
        else:
            version = alias._version
        self.alias = alias
        self.version = version
        self.maker = _maker(t)

    def check_version(self) -> None:
        now = self.alias._version
        if now != self.version:
            size = list(self.alias.size() if isinstance(self, Kept) else self.size)
            what = f"[{self.alias.type()} {size}]" + self.maker
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: {what} is at version {now}; expected version "
                f"{self.version} instead. Hint: the tensor was saved inside adaptive.spill and "
                f"changed in place afterwards; clone it before the in-place operation."
            )


class Kept(Packed):
    """A saved tensor that stays: a detached alias of it (see [Note: kept tensors])."""

    __slots__ = ()

    def __init__(self, t: torch.Tensor) -> None:  # noqa: D107 - no entry, no geometry
        self.alias = t.detach()
        self.version = t._version
        self.maker = _maker(t)


class KeptLeaf(Kept):
    """A saved tensor outside the graph (a leaf, an input, a parameter) that stays: the
    tensor itself, which double backward needs, with its version, checked on unpacking
    (autograd checks none for a tensor a hook saved; see [Note: version check])."""

    __slots__ = ()

    def __init__(self, t: torch.Tensor) -> None:  # noqa: D107
        self.alias = t
        self.version = t._version
        self.maker = ""


def _maker(t: torch.Tensor) -> str:
    # A string, never the node itself: holding grad_fn would make the cycle that
    # [Note: kept tensors] is about.
    fn = t.grad_fn
    return "" if fn is None else f", which is output {t.output_nr} of {type(fn).__name__},"


def keep(t: torch.Tensor, stats: SpillStats) -> Any:
    """What autograd holds for ``t`` when it stays where it is."""
    stats.tensors_kept += 1
    if t.grad_fn is None:  # a leaf or a tensor outside autograd: no cycle to make
        try:
            return KeptLeaf(t)
        except RuntimeError:  # no version counter (an inference tensor): nothing to check
            return t
    return Kept(t)
