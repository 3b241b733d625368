"""A user's ``device_map``, made this placement's: plain device names become the placement's
labels, and every key and value is checked at the call that received the map (not at the
first forward, where a mistake would surface far from its cause)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from .._common.devices import resolve_device
from .._common.errors import PlacementError
from .._planning import Target, map_key, split_label

__all__ = ["normalise_map", "map_before_placement", "map_label"]


def map_label(value: Any) -> str:
    """A ``device_map`` value as a label: accelerate's GPU index (``0``) is ``"cuda:0"``, a
    device without its index (``"cuda"``) the current one, ``"cpu:0"`` is ``"cpu"``; a dtype
    (``"@bfloat16"``) is kept. A value that names no usable device comes back as text, for
    the caller to report."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"cuda:{value}"
    text = str(value)
    device, sep, dtype = text.partition("@")
    try:
        dev = resolve_device(device)
    except (TypeError, ValueError):
        return text
    return f"{dev}{sep}{dtype}"


def normalise_map(device_map: Mapping[str, str], targets: Mapping[str, Target],
                  modules: Collection[str], tensors: Collection[str]) -> dict[str, str]:
    """``device_map`` with each value a label of ``targets`` (``"cpu"`` becomes
    ``"cpu@bfloat16"`` where that is the only CPU target).

    Raises:
        PlacementError: a key names neither one of ``modules`` nor one of ``tensors``, a value
            names a device that is not among ``targets``, or a tensor is left without one.
    """
    out = {}
    for key, given in device_map.items():
        value = str(given)
        if value not in targets:
            value = _label_for(map_label(given), targets)
        out[str(key)] = value
    unknown = [k for k in out if k and k not in modules and k not in tensors]
    if unknown:
        raise PlacementError(
            f"device_map names {unknown[:5]}, which are neither modules nor tensors of this "
            f"model; use names from model.named_modules() (or '' for the whole model)"
        )
    bad = sorted({v for v in out.values() if v not in targets})
    if bad:
        raise PlacementError(
            f"device_map places modules on {bad}, which are not among this placement's "
            f"devices {sorted(targets)}; add them to devices= or change the map"
        )
    deciding = {name: map_key(name, out) for name in tensors}
    uncovered = [name for name, key in deciding.items() if key is None]
    if uncovered:
        raise PlacementError(
            f"device_map leaves {len(uncovered)} tensor(s) without a device (first: "
            f"{uncovered[0]!r}); name their module, a parent of it, or '' for everything"
        )
    # A key over some tensor (the tensor itself or a parent of it) that places none of them.
    over = {prefix for name in tensors for prefix in _names_and_parents(name)}
    used = set(deciding.values())
    shadowed = next((k for k in out if k and k in over and k not in used), None)
    if shadowed is not None:
        finer = sorted({key or "" for name, key in deciding.items()
                        if name == shadowed or name.startswith(shadowed + ".")})
        raise PlacementError(
            f"device_map[{shadowed!r}] places nothing: every tensor under it is placed by a "
            f"more specific key ({', '.join(repr(k) for k in finer[:4])}"
            f"{' ...' if len(finer) > 4 else ''}), which wins; to move all of {shadowed!r}, "
            f"drop those keys from the map")
    return out


def _names_and_parents(name: str) -> list[str]:
    """``"a.b.w"`` -> ``["a.b.w", "a.b", "a"]``."""
    out = [name]
    while "." in name:
        name = name.rpartition(".")[0]
        out.append(name)
    return out


def _label_for(value: str, targets: Mapping[str, Target]) -> str:
    """The one target a plain device name (``"cpu"``, ``"cuda:0@float16"``) can mean, else
    ``value`` unchanged (which the caller then reports)."""
    device, dtype = split_label(value)
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return value
    same = [t for t in targets.values()
            if t.device == dev and (dtype is None or t.dtype == dtype)]
    plain = [t for t in same if t.dtype is None]
    if len(same) == 1 or len(plain) == 1:
        return (same[0] if len(same) == 1 else plain[0]).label
    return value


def map_before_placement(pending: Mapping[str, str] | None, handle: str, mode: str
                         ) -> dict[str, str]:
    """What ``handle.device_map`` says before the model is placed: the map it was given.

    Raises:
        PlacementError: no map was given; the message says how to get one.
    """
    if pending is None:
        raise PlacementError(
            f"{handle}.device_map: the model is placed at its first call, which has not "
            f"happened yet, so there is no map. Pass example_inputs= to adaptive.{mode} to "
            f"place it now, or compute the same map first with adaptive.plan(model, "
            f"devices=..., example_inputs=...)"
        )
    return dict(pending)
