"""Placement targets: the devices units go to, each with a capacity, the dtype floating weights
take there and the label plans and device maps use; parsing of ``devices=`` and ``dtype=``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._common.devices import capacity as device_capacity
from .._common.devices import format_bytes, parse_device, parse_size, resolve_device
from .._common.headroom import weight_room

__all__ = [
    "Target", "parse_dtype", "dtype_name", "make_label", "split_label", "qualify_labels",
    "capacity_of", "check_capacity", "auto_capacity", "targets_from_devices"
]


@dataclass(frozen=True)
class Target:
    """One place units can go: a device, a capacity in bytes (None: unlimited), the dtype
    floating weights take there (None: keep theirs) and the label plans and device maps use.

    ``shared``: the capacity is the device's ``"auto"`` budget, which every shared target on
    the same device draws from together, in order (see [Note: one budget per device])."""

    device: torch.device
    capacity: int | None
    dtype: torch.dtype | None
    label: str
    shared: bool = False


def parse_dtype(value: Any, name: str = "dtype") -> torch.dtype | None:
    """A floating ``torch.dtype`` from a dtype or its name (``"bfloat16"``); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            value = found
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.dtype such as torch.float16 or torch.bfloat16 "
            f"(or its name), got {value!r}"
        )
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_label(device: torch.device, dtype: torch.dtype | None) -> str:
    """``"cuda:0"``, or ``"cuda:0@float16"`` where the placement converts floating weights to
    a dtype: a ``device_map`` of such labels places in that dtype again."""
    return f"{device}@{dtype_name(dtype)}" if dtype is not None else str(device)


def split_label(label: str) -> tuple[str, torch.dtype | None]:
    """``"cpu@bfloat16"`` -> ``("cpu", torch.bfloat16)``; ``"cuda:0"`` -> ``("cuda:0", None)``."""
    device, sep, dtype = label.partition("@")
    return device, (parse_dtype(dtype, f"the dtype in {label!r}") if sep else None)


def qualify_labels(pairs: Sequence[tuple[torch.device, torch.dtype | None]]) -> list[str]:
    """Labels for (device, dtype) pairs: the device, with ``"@dtype"`` where there is one."""
    labels = [make_label(d, t) for d, t in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(
            f"devices lists the same device and dtype twice: {labels}; give each (device, dtype) "
            f"pair once"
        )
    return labels


def capacity_of(value: Any, name: str) -> int | None:
    """Bytes from a capacity (int, "20GiB"); None means unlimited."""
    return None if value is None else parse_size(value, name)


def check_capacity(device: torch.device, cap: int | None, name: str) -> None:
    """Refuse a capacity on an accelerator larger than this process can ever hold there:
    the first forward would run out of memory, and so would every call after it."""
    if cap is None or device.type == "cpu":
        return
    most = device_capacity(device)
    if cap > most:
        raise ValueError(
            f"{name}={format_bytes(cap)} is more than {device} can hold ({format_bytes(most)} "
            f"in all for this process); give at most what is free there, or 'auto' for free "
            f"memory minus a reserve")


def auto_capacity(device: torch.device, reserve: Any = "auto") -> tuple[int, int]:
    """``(capacity, reserve)`` in bytes for ``capacity="auto"``: free memory minus the reserve
    every engine keeps back (see [Note: headroom] in ``_common/headroom.py``); pass bytes
    (or "2GiB") as ``reserve`` to choose it yourself."""
    return weight_room(device, reserve)


def targets_from_devices(devices: Any, dtype: Any, reserve: Any, *, probe: bool = True
                         ) -> list[Target]:
    """Targets from ``split``'s ``devices`` (mapping or list) and ``dtype`` arguments.

    ``probe=False`` (``adaptive.plan``: plan for any machine) parses device names without
    asking whether the device exists here; ``"auto"`` capacities still need the device.
    """
    if isinstance(devices, (str, torch.device, int)) or not isinstance(devices, (Mapping, Sequence)):
        raise TypeError(
            f"devices must be an ordered mapping like {{'cuda:0': '20GiB', 'cpu': None}} or a "
            f"list like ['cuda:0', 'cuda:1'], got {devices!r}"
        )
    items = list(devices.items()) if isinstance(devices, Mapping) else [(d, "auto") for d in devices]
    if not items:
        raise ValueError("devices is empty: name at least one device, e.g. {'cpu': None}")
    if dtype is not None and not isinstance(dtype, Mapping):
        dtype = parse_dtype(dtype)
    resolved: list[tuple[torch.device, int | None, torch.dtype | None]] = []
    autos: list[bool] = []
    matched: set[Any] = set()  # keys of a dtype mapping that named one of the devices
    for key, capacity in items:
        key_dtype = None
        if isinstance(key, tuple) and len(key) == 2:
            key, key_dtype = key[0], parse_dtype(key[1], f"the dtype in devices key {key!r}")
        elif isinstance(key, str) and "@" in key:
            key, key_dtype = split_label(key)
        dev = (resolve_device if probe else _plan_device)(key, f"devices key {key!r}")
        if key_dtype is None:
            if isinstance(dtype, Mapping):
                names = [k for k in dtype if str(k) in (str(key), str(dev))
                         or _names_device(k, dev)]
                matched.update(names)
                key_dtype = parse_dtype(dtype[names[0]], f"dtype[{key!r}]") if names else None
            else:
                key_dtype = dtype
        cap: int | None = None
        auto = isinstance(capacity, str) and capacity == "auto"
        if auto:
            if not probe:  # "auto" reads free memory: the device must be here after all
                try:
                    resolve_device(key, "devices key")
                except ValueError as exc:
                    raise ValueError(
                        f"{exc}; capacity 'auto' reads the device's free memory, so to plan "
                        f"for another machine give bytes, e.g. {{{str(key)!r}: '20GiB'}}"
                    ) from None
        else:
            cap = capacity_of(capacity, f"devices[{key!r}]")
            if probe:
                check_capacity(dev, cap, f"devices[{key!r}]")
        resolved.append((dev, cap, key_dtype))
        autos.append(auto)
    if isinstance(dtype, Mapping):
        unknown = [k for k in dtype if k not in matched]
        if unknown:
            raise ValueError(
                f"dtype names {', '.join(repr(k) for k in unknown)}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not among the devices "
                f"({', '.join(repr(str(d)) for d, _, _ in resolved)}); key dtype by the "
                f"devices given")
    labels = qualify_labels([(d, t) for d, _, t in resolved])
    budgets = _device_budgets(resolved, autos, labels, reserve, probe)
    return [Target(d, budgets[d] if auto else c, t, label, shared=auto)
            for (d, c, t), auto, label in zip(resolved, autos, labels, strict=True)]


# [Note: one budget per device]
# Keys of ``devices`` that name one physical device (``"cuda:0@float16"``, ``"cuda:0"``) hold
# its one memory. Their explicit capacities together must fit what the device can hold, and
# their ``"auto"`` capacities are one budget (free memory minus the reserve, less the explicit
# capacities there), drawn in order: each key fills from what the keys before it left, so
# the first takes all it needs. A budget read per key would count the free memory once for
# each, and the plan would hold more than the device has.
def _device_budgets(resolved: Sequence[tuple[torch.device, int | None, torch.dtype | None]],
                    autos: Sequence[bool], labels: Sequence[str], reserve: Any, probe: bool
                    ) -> dict[torch.device, int]:
    """The ``"auto"`` budget of each device some key gives ``"auto"``; refuses explicit
    capacities on one accelerator that together pass what it can hold."""
    explicit: dict[torch.device, list[tuple[str, int]]] = {}
    for (dev, cap, _), auto, key in zip(resolved, autos, labels, strict=True):
        if not auto and cap is not None and dev.type != "cpu":
            explicit.setdefault(dev, []).append((key, cap))
    if probe:
        for dev, given in explicit.items():
            total = sum(cap for _, cap in given)
            most = device_capacity(dev)
            if len(given) > 1 and total > most:
                raise ValueError(
                    f"devices gives {dev} {format_bytes(total)} in all "
                    f"({', '.join(f'{k!r}: {format_bytes(c)}' for k, c in given)}), more than "
                    f"it can hold ({format_bytes(most)} for this process); keys on one device "
                    f"share its memory, so give capacities that add up to at most what is "
                    f"free there, or 'auto' for one shared budget")
    budgets: dict[torch.device, int] = {}
    for (dev, _, _), auto in zip(resolved, autos, strict=True):
        if auto and dev not in budgets:
            room, _ = auto_capacity(dev, reserve)
            budgets[dev] = max(0, room - sum(cap for _, cap in explicit.get(dev, [])))
    return budgets


def _names_device(name: Any, dev: torch.device) -> bool:
    """Whether a dtype key such as ``"cuda"`` names the device ``dev`` (``cuda:0``)."""
    try:
        return _plan_device(name, "dtype key") == dev
    except (ValueError, TypeError):
        return False


def _plan_device(key: Any, name: str) -> torch.device:
    """A device for a plan, which may be for another machine: a name with an index is taken
    as it is, while ``"cuda"`` without one (and None) is the current device where this
    machine has that kind, as ``split`` reads it; elsewhere index 0."""
    if key is None:
        return resolve_device(None, name)
    dev = parse_device(key, name)
    if dev.type != "cpu" and not isinstance(key, int) and torch.device(key).index is None:
        try:
            return resolve_device(key, name)
        except ValueError:  # no such accelerator here: plan for another machine's first
            pass
    return dev
