"""Which engine holds which module and which tensor (one handle per model, and per tensor, at
a time), and the checks every engine makes before it touches a model.

[Note: one engine per tensor]
An engine records each tensor's state before placement as the one to put back (a host
master, the original device and dtype) and swaps its ``.data``. A tensor two engines hold
(one embedding shared by an encoder and a decoder placed separately, T5's shape) would be
recorded by the second engine as the first one placed it: after both ``remove()`` calls it
stayed on the device, and a chunked one refused its next call, blaming a conversion. So
tensors are claimed as modules are, by identity, and a placement that would take a tensor
another engine holds is refused before anything changes, naming the tensor, the other
model and the way out: place a module containing both (its engine places the shared tensor
once), or remove the first.

[Note: a dropped model is freed]
The tables hold handles weakly. A handle is kept alive by the model it holds (the hooks it
registered on the model's modules refer to it), so ``adaptive.page(model, ...)`` written as
a statement keeps the model paged, and ``holder(model)`` finds the handle, for as long as
the model lives. Once the user drops both, the model and its handle only refer to each
other and the garbage collector frees them, with the device copies and the pinned host
copies. Held strongly here, they lived as long as the process: a service that reloads its
model by dropping the old one filled its device with old versions. A dead handle's tensor
claims are dropped when it dies.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from .errors import PlacementError

__all__ = ["Owner", "claim", "release", "holder", "holders", "held_for", "owner_of",
           "refuse_if_held", "check_placeable", "refuse_compiled", "public_holder",
           "LOST_HANDLE"]

# module -> a weak reference to the handle holding it: See [Note: a dropped model is freed].
_CLAIMS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()
# id(tensor) -> (weak reference to the handle, the tensor's name in the handle's model): See
# [Note: one engine per tensor]. Not a weak reference to the tensor, which would stop
# torch.utils.swap_tensors (how a meta tensor is materialised in place); a claiming handle
# holds its tensors, so while it lives their ids are theirs, and a dead one's entries are
# stale.
_TENSOR_CLAIMS: dict[int, tuple[weakref.ref[Any], str]] = {}


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


def claim(modules: Iterable[nn.Module], handle: Any,
          tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Mark every module of a model, and its ``tensors`` (by name), as held by ``handle``,
    which keeps the tensors alive until it calls ``release``."""
    named = dict(tensors or {})
    ids = [id(t) for t in named.values()]

    def forget(ref: weakref.ref[Any]) -> None:  # the handle died without release()
        for key in ids:
            if _TENSOR_CLAIMS.get(key, (None,))[0] is ref:
                del _TENSOR_CLAIMS[key]

    ref = weakref.ref(handle, forget)
    for m in modules:
        _CLAIMS[m] = ref
    for name, t in named.items():
        _TENSOR_CLAIMS[id(t)] = (ref, name)


def release(modules: Iterable[nn.Module], handle: Any,
            tensors: Iterable[torch.Tensor] = ()) -> None:
    """Drop ``handle``'s marks (and only its own)."""
    for m in modules:
        if _claimant(m) is handle:
            del _CLAIMS[m]
    for t in tensors:
        held = _TENSOR_CLAIMS.get(id(t))
        if held is not None and (held[0]() is handle or held[0]() is None):
            del _TENSOR_CLAIMS[id(t)]


def holder(model: nn.Module) -> Any:
    """The handle holding ``model`` or any module inside it, or None."""
    for m in model.modules():
        handle = _claimant(m)
        if handle is not None:
            return handle
    return None


def _claimant(module: nn.Module) -> Any:
    """The live handle holding ``module`` itself, or None."""
    ref = _CLAIMS.get(module)
    return None if ref is None else ref()


def public_holder(model: nn.Module) -> Any:
    """The ``Pager``, ``Chunker`` or ``Splitter`` holding ``model`` or a module inside it,
    or None: for a handle dropped by ``adaptive.page(model, ...)`` written as a bare
    statement (pytorch-optimem's habit), so that it can still be removed.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        PlacementError: the model is held for a function decorated with ``model=``, whose
            own ``remove()`` gives it back.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
        >>> adaptive.page(net, "cpu")  # the handle is not kept
        Pager(device='cpu', units=1, paged=0 B, resident=80 B)
        >>> adaptive.holder(net).remove()
        >>> adaptive.holder(net) is None
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"adaptive.holder takes a torch.nn.Module, got {type(model).__name__}")
    handle = holder(model)
    owner = None if handle is None else _OWNERS.get(handle)
    if owner is not None and owner.release_if_abandoned():  # its function was collected
        return holder(model)
    if owner is not None:  # its remove() would pull the model from under the function
        raise PlacementError(f"adaptive.holder: the model's engine is not yours to remove: "
                             f"{owner.fix()}")
    return handle


LOST_HANDLE = "adaptive.holder(model) returns it if you no longer have it"


def holders(model: nn.Module) -> list[Any]:
    """Every handle holding ``model`` or a module inside it, each once, in module order."""
    found: dict[int, Any] = {}
    for m in model.modules():
        handle = _claimant(m)
        if handle is not None:
            found.setdefault(id(handle), handle)
    return list(found.values())


def _tensor_holder(model: nn.Module) -> tuple[Any, str, str] | None:
    """``(handle, name in model, name in the handle's model)`` for the first tensor of
    ``model`` another engine holds (See [Note: one engine per tensor]), or None."""
    for name, t in _named_tensors(model, remove_duplicate=False):
        held = _TENSOR_CLAIMS.get(id(t))
        if held is None:
            continue
        handle = held[0]()
        if handle is None:  # collected without remove(): the id may be another tensor's
            del _TENSOR_CLAIMS[id(t)]
            continue
        return handle, name, held[1]
    return None


def refuse_if_held(model: nn.Module, owned_ok: bool = False) -> None:
    """Raise PlacementError if a Pager, Chunker or Splitter already holds part of ``model``,
    or a tensor of it (one held for a decorated function that was collected is given back
    first). With ``owned_ok``, one held for a decorated function still alive passes: a
    decorator checks again at its first call, when a function it replaces may have been
    collected."""
    handle = holder(model)
    shared = None if handle is not None else _tensor_holder(model)
    if shared is not None:
        handle = shared[0]
    if handle is None:
        return
    owner = _OWNERS.get(handle)
    if owner is not None and owned_ok:
        return
    if owner is not None and owner.release_if_abandoned():
        refuse_if_held(model, owned_ok)  # it let go: whatever else holds a part is refused
        return
    kind = getattr(handle, "held_as", "placed")  # engines say what they hold a model as
    by = getattr(handle, "made_by", type(handle).__name__)
    held_model = getattr(handle, "model", None) or getattr(handle, "_model", None)
    fix = (f"call .remove() on that {type(handle).__name__} first ({LOST_HANDLE})"
           if owner is None else owner.fix())
    if shared is not None:
        _, name, theirs = shared
        raise PlacementError(
            f"tensor {name!r} of this model is also {theirs!r} of another model "
            f"({type(held_model).__name__}) that {by} holds, and one engine holds a tensor "
            f"at a time: place one module that contains both models instead (their common "
            f"parent; its engine places the shared tensor once), or {fix}")
    if held_model is model:
        what = f"this model is already {kind} by {by}"
    elif held_model is not None and any(m is model for m in held_model.modules()):
        what = f"this model is part of a {kind} model (already {kind} by {by})"
    else:
        what = f"a submodule of this model is already {kind} by {by}"
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


def refuse_compiled(model: nn.Module, engine: str) -> None:
    """Refuse a ``torch.compile`` wrapper for an engine that swaps weights between calls
    (``page``): the compiled code holds on to the tensors it was traced with."""
    for name, m in model.named_modules():
        inner = getattr(m, "_orig_mod", None)
        if type(m).__name__ != "OptimizedModule" or not isinstance(inner, nn.Module):
            continue
        where = "model" if not name else f"the model's submodule {name!r}"
        raise PlacementError(
            f"{engine} got a torch.compile'd module: {where} is {type(inner).__name__} inside "
            f"torch's OptimizedModule. The pager swaps weights in and out at every call, which "
            f"compiled code does not follow. Page the module it wraps (its _orig_mod) and "
            f"call that module, or torch.compile it again after paging: the compiled object "
            f"you have keeps running its graph without the pager (unpaged, weights where they "
            f"were); adaptive.chunk and adaptive.split, which keep a placement fixed, take "
            f"compiled modules")


def refuse_scripted(model: nn.Module, engine: str) -> None:
    """Refuse a TorchScript module anywhere in ``model``: it takes no forward hooks, and
    its compiled code reads its tensors without going through Python."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = "the model" if not name else f"the model's submodule {name!r}"
            raise PlacementError(
                f"{engine} got a TorchScript module: {where} is a {type(m).__name__} "
                f"(torch.jit.script or trace). adaptmem places a model through forward hooks "
                f"on its modules and by swapping their tensors, which TorchScript modules do "
                f"not take. Use the module it was scripted from in its place")


def check_placeable(model: Any, engine: str, allow_meta: bool = False,
                    owned_ok: bool = False) -> None:
    """Refuse, before anything changes, a model ``engine`` (``"adaptive.page"``, ...) cannot
    take: not a module, in training mode, weights on meta, inference tensors, or already
    held by adaptmem or dispatched by accelerate (``owned_ok``: see ``refuse_if_held``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_training(engine, model.named_modules(), "call model.eval() first")
    refuse_scripted(model, engine)
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


def _named_tensors(model: nn.Module, remove_duplicate: bool = True
                   ) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=remove_duplicate)
    yield from model.named_buffers(remove_duplicate=remove_duplicate)
