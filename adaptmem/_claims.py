"""Which engine holds which module: a model is paged, chunked or split by one handle at a time."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from ._errors import PlacementError

__all__ = ["claim", "release", "holder", "refuse_if_held"]

_CLAIMS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def claim(modules: Iterable[nn.Module], handle: Any) -> None:
    """Mark every module of a model as held by ``handle``."""
    for m in modules:
        _CLAIMS[m] = handle


def release(modules: Iterable[nn.Module], handle: Any) -> None:
    """Drop ``handle``'s marks (and only its own)."""
    for m in modules:
        if _CLAIMS.get(m) is handle:
            del _CLAIMS[m]


def holder(model: nn.Module) -> Any:
    """The handle holding ``model`` or any module inside it, or None."""
    for m in model.modules():
        handle = _CLAIMS.get(m)
        if handle is not None:
            return handle
    return None


def refuse_if_held(model: nn.Module) -> None:
    """Raise PlacementError if a Pager, Chunker or Splitter already holds part of ``model``."""
    handle = holder(model)
    if handle is None:
        return
    paged = type(handle).__name__ == "Pager"
    kind, by = ("paged", "adaptive.page") if paged else ("placed", "adaptive.chunk/split")
    held_model = getattr(handle, "model", None) or getattr(handle, "_model", None)
    if held_model is model:
        what = f"this model is already {kind} by {by}"
    elif held_model is not None and any(m is model for m in held_model.modules()):
        what = f"this model is part of a {kind} model (already {kind} by {by})"
    else:
        what = f"a submodule of this model is already {kind} by {by}"
    raise PlacementError(
        f"{what}; call .remove() on that {type(handle).__name__} first "
        f"(one engine holds a model at a time)"
    )
