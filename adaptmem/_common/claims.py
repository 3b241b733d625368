"""Which engine holds which module (one handle per model at a time), and the checks every
engine makes before it touches a model."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from .errors import PlacementError

__all__ = ["Owner", "claim", "release", "holder", "holders", "held_for", "owner_of",
           "refuse_if_held", "check_placeable"]

_CLAIMS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


class Owner(Protocol):
    """What a handle was made for, when not for the user directly (a decorated function
    with ``model=``): it names itself in errors and may give its models back."""

    def fix(self) -> str:
        """Whom the handle works for and how to free the model, for an error message."""

    def release_if_abandoned(self) -> bool:
        """Give the models back now when their owner is gone; True when it did."""


_OWNERS: weakref.WeakKeyDictionary[Any, Owner] = weakref.WeakKeyDictionary()


def held_for(handle: Any, owner: Owner) -> None:
    """Record that ``handle`` holds its model for ``owner``."""
    _OWNERS[handle] = owner


def owner_of(handle: Any) -> Owner | None:
    """What ``handle`` holds its model for (a decorated function), or None: the user's."""
    return _OWNERS.get(handle)


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


def holders(model: nn.Module) -> list[Any]:
    """Every handle holding ``model`` or a module inside it, each once, in module order."""
    found: dict[int, Any] = {}
    for m in model.modules():
        handle = _CLAIMS.get(m)
        if handle is not None:
            found.setdefault(id(handle), handle)
    return list(found.values())


def refuse_if_held(model: nn.Module, owned_ok: bool = False) -> None:
    """Raise PlacementError if a Pager, Chunker or Splitter already holds part of ``model``
    (one held for a decorated function that was collected is given back first). With
    ``owned_ok``, one held for a decorated function still alive passes: a decorator checks
    again at its first call, when a function it replaces may have been collected."""
    handle = holder(model)
    if handle is None:
        return
    owner = _OWNERS.get(handle)
    if owner is not None and owned_ok:
        return
    if owner is not None and owner.release_if_abandoned():
        handle = holder(model)
        if handle is None:
            return
        owner = _OWNERS.get(handle)
    kind = getattr(handle, "held_as", "placed")  # engines say what they hold a model as
    by = getattr(handle, "made_by", type(handle).__name__)
    held_model = getattr(handle, "model", None) or getattr(handle, "_model", None)
    if held_model is model:
        what = f"this model is already {kind} by {by}"
    elif held_model is not None and any(m is model for m in held_model.modules()):
        what = f"this model is part of a {kind} model (already {kind} by {by})"
    else:
        what = f"a submodule of this model is already {kind} by {by}"
    fix = (f"call .remove() on that {type(handle).__name__} first" if owner is None
           else owner.fix())
    raise PlacementError(f"{what}; {fix} (one engine holds a model at a time)")


def refuse_training(engine: str, modules: Iterable[tuple[str, nn.Module]], fix: str,
                    when: str = "") -> None:
    """Raise ``PlacementError`` if any of ``modules`` (name, module) is in training mode
    (``when``: " now", say): ``engine`` is for inference."""
    training = [n or "<root>" for n, m in modules if m.training]
    if training:
        raise PlacementError(
            f"{engine} is for inference, but {len(training)} module(s) are in training "
            f"mode{when} (first: {training[0]!r}); {fix}"
        )


def check_placeable(model: Any, engine: str, allow_meta: bool = False,
                    owned_ok: bool = False) -> None:
    """Refuse, before anything changes, a model ``engine`` (``"adaptive.page"``, ...) cannot
    take: not a module, in training mode, weights on meta, inference tensors, or already
    held by adaptmem or dispatched by accelerate (``owned_ok``: see ``refuse_if_held``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_training(engine, model.named_modules(), "call model.eval() first")
    if not allow_meta:
        meta = [n for n, t in _named_tensors(model) if t.is_meta]
        if meta:
            raise PlacementError(
                f"model has {len(meta)} tensor(s) on the meta device (first: {meta[0]!r}), so "
                f"there are no weights for {engine}; load them first with "
                f"adaptive.load(model, checkpoint)"
            )
    untracked = [n for n, t in _named_tensors(model) if not _tracks_versions(t)]
    if untracked:
        raise PlacementError(
            f"model has {len(untracked)} inference tensor(s) (first: {untracked[0]!r}): it "
            f"was built or loaded under torch.inference_mode(), and {engine} needs the "
            f"version counters that inference tensors lack. Build or load it outside "
            f"inference_mode (running it inside is fine), or take a plain copy outside it: "
            f"model = copy.deepcopy(model)"
        )
    refuse_if_held(model, owned_ok)
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        raise PlacementError(
            "model is already dispatched by accelerate (it has _hf_hook hooks); call "
            "accelerate.hooks.remove_hook_from_module(model, recurse=True) first"
        )


def _tracks_versions(t: torch.Tensor) -> bool:
    # An inference tensor has no version counter, even after its .data was replaced.
    try:
        t._version  # noqa: B018
    except RuntimeError:
        return False
    return True


def _named_tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
