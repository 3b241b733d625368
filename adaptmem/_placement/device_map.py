"""A user's ``device_map``, made this placement's: plain device names become the placement's
labels, and every key and value is checked at the call that received the map (not at the
first forward, where a mistake would surface far from its cause)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from .._common.errors import PlacementError
from .._planning import Target, split_label

__all__ = ["normalise_map", "map_before_placement"]


def normalise_map(device_map: Mapping[str, str], targets: Mapping[str, Target],
                  modules: Collection[str], tensors: Collection[str]) -> dict[str, str]:
    """``device_map`` with each value a label of ``targets`` (``"cpu"`` becomes
    ``"cpu@bfloat16"`` where that is the only CPU target).

    Raises:
        PlacementError: a key names neither one of ``modules`` nor one of ``tensors``, a value
            names a device that is not among ``targets``, or a tensor is left without one.
    """
    out = {}
    for key, value in device_map.items():
        value = str(value)
        if value not in targets:
            value = _label_for(value, targets)
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
    uncovered = [
        name for name in tensors
        if not any(k == "" or name == k or name.startswith(k + ".") for k in out)
    ]
    if uncovered:
        raise PlacementError(
            f"device_map leaves {len(uncovered)} tensor(s) without a device (first: "
            f"{uncovered[0]!r}); name their module, a parent of it, or '' for everything"
        )
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
