"""Placement units and their assignment to targets: attention blocks kept whole, weights a
module reads without calling their owner kept with it, tied tensors owned by their first
user, each target filled in execution order up to its capacity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from .._common.devices import format_bytes
from .._common.errors import PlacementError
from .plan import Plan
from .recording import Recording
from .sizes import ModuleSizes
from .targets import Target, dtype_name
from .units import Unit, assign_devices, order_units, paging_units

__all__ = [
    "ATOMIC_MODULE_TYPES", "placement_units", "plan_placement", "own_ties_where_first_used",
    "placed_bytes", "label_for_unit", "map_key", "check_ties"
]

# Their forwards may read children's weights without calling the children, on fast paths
# that depend on grad mode and device (so a meta forward cannot reveal it): never split them.
ATOMIC_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


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
    for members in _shared_budgets(targets):
        held = sum(used.get(t.label, 0) for t in members)
        if held > (members[0].capacity or 0):
            raise PlacementError(
                f"the model does not fit: {', '.join(t.label for t in members)} would hold "
                f"{format_bytes(held)} together but {members[0].device}'s 'auto' budget is "
                f"{format_bytes(members[0].capacity or 0)} for all of them (see "
                f"[Note: one budget per device]); add an unlimited device last, e.g. "
                f"{{..., 'cpu': None}}"
            )
    converts = any(t.dtype is not None for t in targets)
    if converts:  # sizes in the dtype each unit takes there
        placed = [replace(u, nbytes=sizes.bytes_of(
            u.tensors, by_label[u.placement].dtype if u.placement in by_label else None))
            for u in placed]
    opts = {
        "devices": {t.label: t.capacity for t in targets},
        "dtypes": {t.label: dtype_name(t.dtype) for t in targets if t.dtype is not None},
        "placed_bytes": used,
        "order": "recorded" if recording is not None else "registration",
    }
    opts.update(options or {})
    total = sum(u.nbytes for u in placed) if converts else sizes.total_bytes
    return Plan(mode, placed, total, opts)


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
        if targets[-1].label in over:  # the last device takes what is left
            return placed, used
        for label, excess in over.items():
            limits[label] = max(0, limits[label] - excess)  # type: ignore[operator]
        # See [Note: one budget per device]: the later keys on a device give way.
        shrunk = False
        for members in _shared_budgets(targets):
            excess = sum(used.get(t.label, 0) for t in members) - (members[0].capacity or 0)
            for t in reversed(members):
                give = min(excess, used.get(t.label, 0))
                if give <= 0 or t is targets[-1]:
                    continue
                limits[t.label] = min(limits[t.label] or 0, used[t.label] - give)
                excess -= give
                shrunk = True
        if not over and not shrunk:
            return placed, used


def _shared_budgets(targets: Sequence[Target]) -> list[list[Target]]:
    """Targets that draw on one device's ``"auto"`` budget, in order, where there are two or
    more on a device."""
    pools: dict[Any, list[Target]] = {}
    for t in targets:
        if t.shared:
            pools.setdefault(t.device, []).append(t)
    return [members for members in pools.values() if len(members) > 1]


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


def map_key(name: str, device_map: Mapping[str, Any]) -> str | None:
    """The key of ``device_map`` that places ``name`` (a tensor or module): the most specific
    one, itself or its nearest parent (``''``: the whole model); None if there is none."""
    key = name
    while key not in device_map:
        if key == "":
            return None
        key = key.rpartition(".")[0]
    return key


def label_for_unit(unit: Unit, device_map: Mapping[str, str], targets: Mapping[str, Target]
                   ) -> str:
    """The one label ``device_map`` gives every tensor of ``unit`` (most specific key wins)."""
    names = unit.tensors or (unit.module,)
    found: dict[str, str] = {}
    for name in names:
        key = map_key(name, device_map)
        if key is None:
            raise PlacementError(
                f"device_map places no entry for {name!r}: add it (or one of its parent "
                f"modules, '' for the whole model) with a device such as 'cpu'"
            )
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
