"""Walking a model's tensors and a call's nested arguments, the one way every lever does it.

[Note: canonical tensor names]
A tensor registered under several names (tied weights: ``lm_head.weight`` is
``embed.weight``; one module registered under two paths) is one tensor: it is counted,
placed, paged and loaded once, under its *canonical* name, the first name
``model.named_modules()`` order gives it (module path, then parameters before buffers, in
registration order). The other names are its aliases. The planner's sizes, the recorder,
the engines' guards and host stores, and the loader all name tensors this way, so their
names agree.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence
from operator import is_not
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "Registration",
    "registrations",
    "canonical_tensors",
    "join_name",
    "dataclass_fields",
    "map_tensors",
    "tensors_in",
    "first_tensor_device",
    "calls_in_progress",
]


def join_name(prefix: str, name: str) -> str:
    """``"encoder.layer"`` + ``"weight"`` -> ``"encoder.layer.weight"``; the root has no prefix."""
    return f"{prefix}.{name}" if prefix else name


class Registration(NamedTuple):
    """One name under which a parameter or buffer is registered."""

    name: str  # full dotted name of this registration
    canonical: str  # the tensor's canonical name (== name for its first registration)
    module_name: str
    module: nn.Module
    kind: str  # "parameter" or "buffer"
    attr: str
    tensor: torch.Tensor

    @property
    def registry(self) -> dict[str, Any]:
        """The module's dict that holds this registration (``_parameters`` or ``_buffers``)."""
        return self.module._parameters if self.kind == "parameter" else self.module._buffers


def registrations(model: nn.Module) -> Iterator[Registration]:
    """Every parameter and buffer registration of ``model`` (None entries skipped), in
    ``named_modules()`` order, each with its tensor's canonical name; see [Note: canonical
    tensor names]."""
    first: dict[int, str] = {}
    for mod_name, module in model.named_modules():
        for kind, registry in (("parameter", module._parameters), ("buffer", module._buffers)):
            for attr, t in registry.items():
                if t is None:
                    continue
                name = join_name(mod_name, attr)
                canonical = first.setdefault(id(t), name)
                yield Registration(name, canonical, mod_name, module, kind, attr, t)


def canonical_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer under its canonical name."""
    return {r.name: r.tensor for r in registrations(model) if r.name == r.canonical}


# Nested call arguments and outputs: tuples (namedtuples too), lists, dicts and dataclass
# instances, walked by hand rather than with pytree because these run at every hooked call.
#
# [Note: aliased arguments]
# One tensor passed twice (``attn(h, h, h)``) is one tensor to the callee:
# ``nn.MultiheadAttention`` takes its packed self-attention path only when ``query is key is
# value``. So a walk maps each distinct tensor once and hands every place it appears the same
# result (``memo``); a list or dict met twice is likewise copied once. Views of one tensor
# passed separately are mapped separately: rebuilding them as views would mean moving their
# whole base, which may be far larger than the views.


def dataclass_fields(obj: Any) -> tuple[dataclasses.Field[Any], ...] | None:
    """The fields of a dataclass instance (None for anything else, a dataclass type too).
    ``_map`` asks only the type's attribute: it meets every leaf of every hooked call."""
    if hasattr(type(obj), "__dataclass_fields__"):
        return dataclasses.fields(obj)
    return None


def map_tensors(obj: Any, fn: Any, memo: dict[int, tuple[Any, Any]] | None = None,
                containers: list[Any] | None = None) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, dicts, namedtuples and dataclass
    instances; other values come back as they were (the same object when nothing inside
    changed). A dataclass instance that changes is copied without calling ``__init__``
    (frozen ones too); a dict whose type cannot be built from a dict becomes a dict.

    Each distinct tensor (and container) is mapped once: See [Note: aliased arguments].
    ``memo`` collects ``id(original) -> (original, replacement)`` for every tensor and
    container replaced. With ``containers``, every list, dict and dataclass instance met is
    appended as ``(original, passed on, its items as passed on, its original items)``, for
    ``MovedInputs`` to find what a forward put into them.
    """
    return _map(obj, fn, {} if memo is None else memo, containers)


def _map(obj: Any, fn: Any, memo: dict[int, tuple[Any, Any]], seen: list[Any] | None) -> Any:
    if isinstance(obj, torch.Tensor):
        done = memo.get(id(obj)) if memo else None
        if done is not None:
            return done[1]
        out = fn(obj)
        if out is not obj:
            memo[id(obj)] = (obj, out)
        return out
    if isinstance(obj, tuple):
        items = [_map(x, fn, memo, seen) for x in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, (list, dict)) or hasattr(type(obj), "__dataclass_fields__"):
        done = memo.get(id(obj))
        return done[1] if done is not None else _map_container(obj, fn, memo, seen)
    return obj


def _map_container(obj: Any, fn: Any, memo: dict[int, tuple[Any, Any]],
                   seen: list[Any] | None) -> Any:
    """A list, dict or dataclass instance mapped: the same object when nothing inside
    changed (a forward may fill it), else a copy."""
    if isinstance(obj, list):
        before: Any = tuple(obj)
        after: Any = tuple([_map(x, fn, memo, seen) for x in before])
        changed = any(map(is_not, after, before))
        out: Any = list(after) if changed else obj
    elif isinstance(obj, dict):
        before = dict(obj)
        after = {k: _map(v, fn, memo, seen) for k, v in before.items()}
        changed = any(after[k] is not v for k, v in before.items())
        out = obj
        if changed:
            try:
                out = type(obj)(after)
            except TypeError:  # a mapping type that cannot be built from a dict
                out = dict(after)
    else:
        names = [f.name for f in dataclasses.fields(obj)]
        before = tuple([getattr(obj, n) for n in names])
        after = tuple([_map(v, fn, memo, seen) for v in before])
        changed = any(map(is_not, after, before))
        out = obj
        if changed:
            out = copy.copy(obj)  # no __init__ (nor __post_init__) runs
            for name, value in zip(names, after, strict=True):
                object.__setattr__(out, name, value)  # frozen ones too
    if changed:
        memo[id(obj)] = (obj, out)
    if seen is not None:
        seen.append((obj, out, after, before))
    return out


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested ``obj``, in the order ``map_tensors`` visits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)
    else:
        fields = dataclass_fields(obj)
        for f in fields or ():
            yield from tensors_in(getattr(obj, f.name))


def first_tensor_device(obj: Any) -> torch.device | None:
    """The device of the first tensor found in nested ``obj``, or None."""
    for t in tensors_in(obj):
        return t.device
    return None


_CALL_IMPL = nn.Module._call_impl.__code__


def calls_in_progress(frame: Any, modules: Sequence[nn.Module], stop_at: int = 0) -> int:
    """How many calls of any of ``modules`` (``Module._call_impl`` frames) are running in
    ``frame`` and its callers; counting ends at ``stop_at`` when it is above 0."""
    calls = 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL and any(frame.f_locals.get("self") is m for m in modules):
            calls += 1
            if calls == stop_at:
                break
        frame = frame.f_back
    return calls
