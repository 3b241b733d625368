"""What every placement engine is: the handle ``adaptive.page``, ``chunk`` and ``split`` return.

An engine holds a model: it claims the model's modules and tensors (no other engine may
place them until it lets go, see ``_common/claims.py``), registers forward hooks on them, keeps
statistics, and undoes all of it in ``remove()``, which leaving a ``with`` block calls. While
it holds the model, the model is neither copied nor converted (see [Note: a placed model is
neither copied nor converted] in ``guard.py``).

``LoadTargets`` is the protocol ``adaptive.load(model, checkpoint, device=handle)`` uses to
write a checkpoint into a placed model in place: every engine implements it, and so may a
user's own handle.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._common.claims import claim, release
from .guard import NotCopyable, PlacementGuard

__all__ = ["Engine", "HookSet", "LoadTargets", "RootHook"]

_E = TypeVar("_E", bound="Engine")


@runtime_checkable
class LoadTargets(Protocol):
    """Where ``adaptive.load`` copies each checkpoint value when given a placement handle.

    ``load_targets()`` maps a canonical tensor name (a key of ``module_sizes(model).tensors``:
    the first ``named_modules()`` path plus the attribute; tied aliases are not listed) to the
    existing tensors the value is copied into in place, e.g. a host master and a device copy.
    Targets may be on any device, of any dtype and of any shape with the model tensor's number
    of elements; each is filled with ``copy_``. A name left out (or mapped to ``[]``) falls
    back to the model's own tensor. It is called once per load, before any read, outside a
    forward; the tensors stay valid until the handle re-places the model or is removed.
    """

    def load_targets(self) -> dict[str, list[torch.Tensor]]: ...


class HookSet:
    """The forward hooks an engine registered, by module; removed one module at a time or
    all together."""

    __slots__ = ("_by_module",)

    def __init__(self) -> None:
        self._by_module: dict[int, tuple[RemovableHandle, ...]] = {}

    def add(self, module: nn.Module, *handles: RemovableHandle) -> None:
        """Record ``handles`` as ``module``'s hooks (replacing none: call ``remove`` first)."""
        if id(module) in self._by_module:
            raise RuntimeError(f"{type(module).__name__} already has this engine's hooks")
        self._by_module[id(module)] = handles

    def __contains__(self, module: nn.Module) -> bool:
        return id(module) in self._by_module

    def __len__(self) -> int:
        return len(self._by_module)

    def remove(self, module: nn.Module) -> None:
        """Remove ``module``'s hooks, if it has any."""
        for h in self._by_module.pop(id(module), ()):
            h.remove()

    def clear(self) -> None:
        """Remove every hook."""
        for handles in self._by_module.values():
            for h in handles:
                h.remove()
        self._by_module.clear()


class RootHook:
    """One of an engine's hooks on the model itself, which hands the engine the model as the
    module called. ``copy.copy(model)`` makes a module that shares the model's parameters,
    children and hook dicts: calling it runs these hooks with the copy, and the model is what
    runs. ``torch.jit.script`` compiles hooks, and reading this one's ``__globals__`` (which
    it does first) raises the refusal: see [Note: no capture of a placed model] in
    ``guard.py``. ``func`` is the engine's method (as for a ``partial``, which the recorder
    reads to tell the engine's hooks)."""

    __slots__ = ("func", "root")

    def __init__(self, func: Callable[..., Any], root: nn.Module) -> None:
        self.func, self.root = func, root

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        return self.func(self.root, *args)

    @property
    def __name__(self) -> str:
        return f"adaptmem_{getattr(self.func, '__name__', 'hook')}"

    @property
    def __globals__(self) -> dict[str, Any]:
        engine = getattr(self.func, "__self__", None)
        if isinstance(engine, Engine):
            _forget_script_types(self.root)
            engine._guard.refuse_capture("torch.jit.script")
        raise AttributeError("__globals__")


def _forget_script_types(model: nn.Module) -> None:
    """Drop the types ``torch.jit.script`` stored for ``model``'s module classes before it
    reached the refusal: they hold the modules' hooks, and so the engine and the model, for
    the life of the process. The store is a cache of types shared between scripted modules
    of one class; a later script builds them again."""
    store = getattr(getattr(torch.jit, "_recursive", None), "concrete_type_store", None)
    types = getattr(store, "type_store", None)
    if isinstance(types, dict):
        for module in model.modules():
            types.pop(type(module), None)


class Engine(NotCopyable, abc.ABC):
    """A placement handle: holds a model's modules from ``_hold`` until ``remove()``.

    Subclasses implement ``remove()`` (hooks off, every tensor back as it was, then
    ``_let_go()``), ``load_targets()`` (see ``LoadTargets``), and expose ``stats`` (a ``Stats``).
    """

    model: nn.Module
    _guard: PlacementGuard  # set by each subclass when it places the model

    def check_unchanged(self) -> None:
        """Raise the ``PlacementError`` the model's next call would raise when its tensors
        were replaced or converted since placement (see [Note: a placed model is neither
        copied nor converted] in guard.py): for code about to place the model again, which
        would drop the change (``remove()`` registers the original objects)."""
        self._guard.check()

    def speak_as(self, engine: str, handle: str) -> None:
        """The refusals of the model's calls name ``engine`` as what holds it and
        ``handle`` as what to ``remove()`` (an engine a decorated function made: the
        user never saw it)."""
        self._guard.rename(engine, handle)

    def _hold(self, modules: Iterable[nn.Module], tensors: Mapping[str, torch.Tensor]) -> None:
        """Claim ``modules`` and ``tensors`` (by canonical name) for this engine; see [Note:
        one engine per tensor] in ``_common/claims.py``."""
        self._held = tuple(modules)
        self._held_tensors = tuple(tensors.values())
        claim(self._held, self, tensors)

    @property
    def held_model(self) -> nn.Module | None:
        """The model this engine holds (the root of what it claimed), None once removed."""
        held = getattr(self, "_held", ())
        return held[0] if held else None

    def _let_go(self) -> None:
        """Release what ``_hold`` claimed (safe to call twice)."""
        release(getattr(self, "_held", ()), self, getattr(self, "_held_tensors", ()))
        self._held = self._held_tensors = ()

    @abc.abstractmethod
    def remove(self) -> None:
        """Remove the hooks and put every tensor back where it was. Safe to call twice."""

    @abc.abstractmethod
    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """See ``LoadTargets``."""

    def __enter__(self: _E) -> _E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
