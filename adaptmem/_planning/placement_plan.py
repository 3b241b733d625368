"""Planning for chunk and split: placement targets, atomic units, ties, ``adaptive.plan``.

Pure apart from the recorded forward (``_recording``), which runs on a copy of the model
and its inputs: see [Note: recording on a copy] there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .._common.devices import format_bytes, memory_info, parse_size, resolve_device
from .._common.errors import PlacementError
from .planner import (
    ModuleSizes,
    Plan,
    Unit,
    assign_devices,
    module_sizes,
    order_units,
    paging_units,
)
from .recording import Recording, canonical_tensors, record_forward

__all__ = [
    "Target",
    "Recording",
    "ATOMIC_MODULE_TYPES",
    "parse_dtype",
    "make_label",
    "split_label",
    "split_inputs",
    "record_forward",
    "placement_units",
    "plan_placement",
    "canonical_tensors",
    "auto_capacity",
    "targets_from_devices",
    "own_ties_where_first_used",
    "plan",
]

_log = logging.getLogger("adaptmem")
_MIN_RESERVE = 512 * 1024**2

# Their forwards may read children's weights without calling the children, on fast paths
# that depend on grad mode and device (so a meta forward cannot reveal it): never split them.
ATOMIC_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


@dataclass(frozen=True)
class Target:
    """One place units can go: a device, a capacity in bytes (None: unlimited), the dtype
    floating weights take there (None: keep theirs) and the label plans and device maps use."""

    device: torch.device
    capacity: int | None
    dtype: torch.dtype | None
    label: str


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_label(device: torch.device, dtype: torch.dtype | None, qualify: bool) -> str:
    """``"cuda:0"``, or ``"cpu@bfloat16"`` when one device holds several dtypes."""
    return f"{device}@{_dtype_name(dtype)}" if qualify and dtype is not None else str(device)


def split_label(label: str) -> tuple[str, torch.dtype | None]:
    """``"cpu@bfloat16"`` -> ``("cpu", torch.bfloat16)``; ``"cuda:0"`` -> ``("cuda:0", None)``."""
    device, sep, dtype = label.partition("@")
    return device, (parse_dtype(dtype, f"the dtype in {label!r}") if sep else None)


def qualify_labels(pairs: Sequence[tuple[torch.device, torch.dtype | None]]) -> list[str]:
    """Labels for (device, dtype) pairs: plain device names unless a device repeats."""
    counts: dict[torch.device, int] = {}
    for device, _ in pairs:
        counts[device] = counts.get(device, 0) + 1
    labels = [make_label(d, t, counts[d] > 1) for d, t in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(
            f"devices lists the same device and dtype twice: {labels}; give each (device, dtype) "
            f"pair once"
        )
    return labels


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from a tensor, a tuple of positional inputs or a dict of keywords."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def _inside(module: str, ancestor: str) -> bool:
    return ancestor == "" or module == ancestor or module.startswith(ancestor + ".")


def placement_units(
    model: nn.Module, sizes: ModuleSizes, recording: Recording | None
) -> list[Unit]:
    """The finest units that can live apart: each module's own tensors, except that a module
    of an ``ATOMIC_MODULE_TYPES`` type is one unit, and tensors an ancestor's own code reads
    (``MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``) join that
    ancestor's unit. Registration order; ``order_units`` sorts them."""
    units = paging_units(sizes, 0)
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.get(key, key) != key:
            key = parent[key]
        return key

    def absorb(ancestor: str, module: str) -> None:
        top, low = find(ancestor), find(module)
        if top == low:
            return
        # The representative is always the shallower module, so groups stay subtrees.
        if _inside(top, low):
            top, low = low, top
        parent[low] = top

    modules = dict(model.named_modules())
    for name in sizes.modules:
        if isinstance(modules.get(name), ATOMIC_MODULE_TYPES):
            for u in units:
                if _inside(u.module, name):
                    absorb(name, u.module)
    owner_unit = {t: u.module for u in units for t in u.tensors}
    for tensor, users in (recording.uses if recording else {}).items():
        if tensor not in owner_unit:
            continue
        holder = owner_unit[tensor]
        for user in users:
            if user != holder and _inside(holder, user) and not _inside(user, holder):
                absorb(user, holder)
    rank = {n: i for i, n in enumerate(sizes.tensors)}
    groups: dict[str, list[Unit]] = {}
    for u in units:
        groups.setdefault(find(u.module), []).append(u)
    merged: list[Unit] = []
    for key, members in groups.items():
        if len(members) == 1 and members[0].module == key:
            merged.append(members[0])
            continue
        owned = tuple(sorted({t for u in members for t in u.tensors}, key=rank.__getitem__))
        borrowed = tuple(sorted({t for u in members for t in u.borrowed} - set(owned)))
        whole = all(u in members for u in units if _inside(u.module, key))
        merged.append(Unit(key, not whole, sizes.bytes_of(owned), owned, borrowed))
    position = {id(u): i for i, u in enumerate(units)}
    merged.sort(key=lambda u: min(
        (position[id(m)] for m in groups.get(u.module, [u]) if id(m) in position), default=0))
    return merged


def plan_placement(
    model: nn.Module,
    sizes: ModuleSizes,
    targets: Sequence[Target],
    recording: Recording | None,
    *,
    mode: str,
    device_map: Mapping[str, str] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Plan:
    """Units in execution order, each given a target label: a prefix per target in order of
    ``targets`` by capacity (bytes in the dtype placed there), or as ``device_map`` says."""
    units = placement_units(model, sizes, recording)
    if recording is not None:
        units = order_units(units, recording.order)
    units = own_ties_where_first_used(units, sizes)
    by_label = {t.label: t for t in targets}
    if device_map is None:
        placed, used = _assign_within_capacity(units, sizes, targets)
    else:
        placed = [replace(u, placement=label_for_unit(u, device_map, by_label)) for u in units]
        check_ties(placed)
        used = placed_bytes(placed, sizes, by_label)
    for t in targets:
        if t.capacity is not None and used.get(t.label, 0) > t.capacity:
            raise PlacementError(
                f"the model does not fit: {t.label} would hold {format_bytes(used[t.label])} "
                f"but its capacity is {format_bytes(t.capacity)}; raise that capacity or add "
                f"an unlimited device last, e.g. {{..., 'cpu': None}}"
            )
    opts = {
        "devices": {t.label: t.capacity for t in targets},
        "dtypes": {t.label: _dtype_name(t.dtype) for t in targets if t.dtype is not None},
        "placed_bytes": used,
        "order": "recorded" if recording is not None else "registration",
    }
    opts.update(options or {})
    return Plan(mode, placed, sizes.total_bytes, opts)


def _assign_within_capacity(units: Sequence[Unit], sizes: ModuleSizes, targets: Sequence[Target]
                            ) -> tuple[list[Unit], dict[str, int]]:
    """``assign_devices``, with each device's prefix cut short where the units that follow a
    tied tensor to it (they must: a tensor is never on two devices) would overflow it.

    Each pass lowers an overflowing device's limit by its overflow, so the prefix ends
    before the tie's owner and its borrowers go on with it to the next device; the limits
    only fall, so this ends (at worst with an empty prefix)."""
    by_label = {t.label: t for t in targets}
    limits = {t.label: t.capacity for t in targets}
    while True:
        placed = assign_devices(units, sizes, [(t.label, limits[t.label], t.dtype)
                                               for t in targets])
        used = placed_bytes(placed, sizes, by_label)
        over = {label: used.get(label, 0) - cap for label, cap in limits.items()
                if cap is not None and cap > 0 and used.get(label, 0) > cap}
        if not over or targets[-1].label in over:  # the last device takes what is left
            return placed, used
        for label, excess in over.items():
            limits[label] = max(0, limits[label] - excess)  # type: ignore[operator]


def own_ties_where_first_used(units: Sequence[Unit], sizes: ModuleSizes) -> list[Unit]:
    """``units`` (in execution order) with each tied tensor owned by the first unit that
    holds it, owner or borrower, and borrowed by the others.

    The tensor's canonical owner may never run: T5's ``shared`` embedding is read through
    ``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``lm_head``, never called. Placed
    in execution order, borrowers go where the owner went; so the owner must come first, or
    the users would be placed (and given a dtype) before the tensor they compute with.
    """
    first: dict[str, int] = {}
    for i, u in enumerate(units):
        for t in (*u.tensors, *u.borrowed):
            first.setdefault(t, i)
    moved = {t: i for t, i in first.items() if t not in units[i].tensors}
    if not moved:
        return list(units)
    rank = {n: i for i, n in enumerate(sizes.tensors)}
    out = []
    for i, u in enumerate(units):
        owned = [t for t in u.tensors if t not in moved]
        owned += [t for t in u.borrowed if moved.get(t) == i]
        borrowed = [t for t in u.borrowed if moved.get(t) != i]
        borrowed += [t for t in u.tensors if t in moved]
        owned.sort(key=rank.__getitem__)
        out.append(replace(u, tensors=tuple(owned), borrowed=tuple(sorted(borrowed)),
                           nbytes=sizes.bytes_of(owned)))
    return out


def placed_bytes(units: Iterable[Unit], sizes: ModuleSizes, targets: Mapping[str, Target]
                 ) -> dict[str, int]:
    """Bytes per target label, counted in the dtype each target gives floating tensors."""
    used: dict[str, int] = {label: 0 for label in targets}
    for u in units:
        dtype = targets[u.placement].dtype if u.placement in targets else None
        used[u.placement] = used.get(u.placement, 0) + sizes.bytes_of(u.tensors, dtype)
    return used


def label_for_unit(unit: Unit, device_map: Mapping[str, str], targets: Mapping[str, Target]
                   ) -> str:
    """The one label ``device_map`` gives every tensor of ``unit`` (most specific key wins)."""
    names = unit.tensors or (unit.module,)
    found: dict[str, str] = {}
    for name in names:
        key = name
        while key not in device_map:
            if key == "":
                raise PlacementError(
                    f"device_map places no entry for {name!r}: add it (or one of its parent "
                    f"modules, '' for the whole model) with a device such as 'cpu'"
                )
            key = key.rpartition(".")[0]
        found[name] = str(device_map[key])
    labels = set(found.values())
    if len(labels) > 1:
        raise PlacementError(
            f"device_map splits {unit.name!r}, whose tensors must stay together "
            f"({', '.join(f'{n}->{v}' for n, v in found.items())}): its forward reads them all; "
            f"give {unit.module or 'the model'!r} one device"
        )
    label = labels.pop()
    if label not in targets:
        raise PlacementError(
            f"device_map places {unit.name!r} on {label!r}, which is not one of this "
            f"placement's devices {sorted(targets)}; use one of those labels"
        )
    return label


def check_ties(units: Sequence[Unit]) -> None:
    """A unit that borrows a tied tensor must sit where the tensor's owner sits."""
    where = {t: u.placement for u in units for t in u.tensors}
    for u in units:
        for t in u.borrowed:
            if where.get(t, u.placement) != u.placement:
                raise PlacementError(
                    f"device_map puts {u.name!r} on {u.placement!r} but the tied tensor {t!r} "
                    f"it shares lives on {where[t]!r}; tied tensors are never duplicated, so give "
                    f"both the same device"
                )


def capacity_of(value: Any, name: str) -> int | None:
    """Bytes from a capacity (int, "20GiB"); None means unlimited."""
    return None if value is None else parse_size(value, name)


def auto_capacity(device: torch.device, reserve: Any = "auto") -> tuple[int, int]:
    """``(capacity, reserve)`` in bytes for ``capacity="auto"``: free memory minus a reserve.

    ``reserve="auto"`` keeps back the larger of 10% of the device's total memory and
    512 MiB, for activations, the conversion copies at unit boundaries and the allocator's
    slack; pass bytes (or "2GiB") to choose it yourself.
    """
    free, total = memory_info(device)
    if reserve == "auto":
        kept = max(total // 10, _MIN_RESERVE)
    else:
        kept = capacity_of(reserve, "reserve") or 0
    return max(0, free - kept), kept


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
    resolved = []
    for key, capacity in items:
        key_dtype = None
        if isinstance(key, tuple) and len(key) == 2:
            key, key_dtype = key[0], parse_dtype(key[1], f"the dtype in devices key {key!r}")
        elif isinstance(key, str) and "@" in key:
            key, key_dtype = split_label(key)
        dev = resolve_device(key, f"devices key {key!r}") if probe else _parse_device(key)
        if key_dtype is None:
            if isinstance(dtype, Mapping):
                given = [v for k, v in dtype.items() if str(k) in (str(key), str(dev))]
                key_dtype = parse_dtype(given[0], f"dtype[{key!r}]") if given else None
            else:
                key_dtype = dtype
        cap: int | None
        if isinstance(capacity, str) and capacity == "auto":
            if not probe:  # "auto" reads free memory: the device must be here after all
                try:
                    resolve_device(key, "devices key")
                except ValueError as exc:
                    raise ValueError(
                        f"{exc}; capacity 'auto' reads the device's free memory, so to plan "
                        f"for another machine give bytes, e.g. {{{str(key)!r}: '20GiB'}}"
                    ) from None
            cap, _ = auto_capacity(dev, reserve)
        else:
            cap = capacity_of(capacity, f"devices[{key!r}]")
        resolved.append((dev, cap, key_dtype))
    labels = qualify_labels([(d, t) for d, _, t in resolved])
    return [Target(d, c, t, label) for (d, c, t), label in zip(resolved, labels, strict=True)]


def _parse_device(key: Any) -> torch.device:
    """A device from its name without probing this machine (``"cuda"`` means ``cuda:0``)."""
    try:
        dev = torch.device(f"cuda:{key}" if isinstance(key, int) else key)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"devices key {key!r} is not a device name such as 'cuda:0' or "
                         f"'cpu'") from None
    if dev.type == "meta":
        raise ValueError(f"devices key {key!r}: the meta device holds no data; pick 'cpu' "
                         f"or 'cuda'")
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, 0)
    return dev


def plan(
    model: nn.Module,
    *,
    unit_bytes: int | str | None = None,
    devices: Any = None,
    dtype: Any = None,
    example_inputs: Any = None,
    order: Sequence[str] | None = None,
) -> Plan:
    """Plan ``model`` without moving a tensor: paging units, or a placement over devices.

    A placement plan is the one ``adaptive.split(model, devices, dtype=dtype)`` makes: the
    same units (attention blocks whole, weights a module reads without calling their owner
    kept with it, tied tensors with their first user), the same order and the same capacity
    rule, so ``split(model, devices, device_map=plan.device_map)`` takes it as it is. The
    units that read other modules' weights are learned from the forward ``example_inputs``
    runs; without them, only the attention and transformer layers are kept whole.

    Args:
        model: any ``nn.Module``; a model built on the meta device costs no memory.
        unit_bytes: for a paging plan, the largest unit in bytes (``"64MiB"``); None gives
            the whole model as one unit.
        devices: for a placement plan, as ``split`` takes it: an ordered ``{device: capacity}``
            mapping (bytes, ``"20GiB"``, None for unlimited) or a list of devices; a key may
            carry a dtype (``"cpu@bfloat16"``, ``("cpu", torch.bfloat16)``), and capacity
            counts bytes in that dtype. Device names are not checked against this machine.
        dtype: the dtype floating weights take on placement, one for all or ``{device: dtype}``.
        example_inputs: a tensor, a tuple of positional inputs, or a dict of keyword inputs
            (meta works). One forward, on a copy of the model (which does not change),
            learns the execution order.
        order: module names in execution order, when already known.

    Returns:
        A ``Plan``: ``print(plan)`` is a table, ``plan.device_map`` a ``{module: device}`` dict.

    Raises:
        TypeError / ValueError: a bad argument, named in the message.
        PlacementError: the model does not fit the devices given.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> with torch.device("meta"):
        ...     net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
        >>> p = adaptive.plan(net, devices={"cuda:0": "5MiB", "cpu": None})
        >>> p.device_map
        {'0': 'cuda:0', '1': 'cpu'}
        >>> adaptive.plan(net, devices={"cuda:0@float16": "5MiB", "cpu": None}).device_map
        {'': 'cuda:0'}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sizes = module_sizes(model)
    recording = None
    if example_inputs is not None:
        recording = record_forward(model, *split_inputs(example_inputs))
        order = recording.order if order is None else order
    if devices is None:
        if dtype is not None:
            raise TypeError("dtype is for a placement plan: pass devices= too, e.g. "
                            "devices={'cuda:0': '6GiB', 'cpu': None}")
        limit = None if unit_bytes is None else parse_size(unit_bytes, "unit_bytes")
        units = paging_units(sizes, limit)
        if order is not None:
            units = order_units(units, order)
        units = [replace(u, placement="paged") for u in units]
        return Plan("page", units, sizes.total_bytes, {"unit_bytes": limit})
    if unit_bytes is not None:
        raise TypeError("unit_bytes is for a paging plan; a placement plan (devices=) makes "
                        "its units from the module tree")
    targets = targets_from_devices(devices, dtype, "auto", probe=False)
    if order is not None and (recording is None or order is not recording.order):
        recording = Recording(list(order), {} if recording is None else recording.uses,
                              combined=set() if recording is None else recording.combined)
    return plan_placement(model, sizes, targets, recording, mode="split")
