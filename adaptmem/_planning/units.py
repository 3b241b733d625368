"""Units: groups of tensors placed or paged together, made from sizes alone, ordered by the
execution order the recorder learned, and assigned to devices in that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._common.enums import TextEnum
from .sizes import ModuleSizes

__all__ = [
    "Placement", "Unit", "paging_units", "split_unit", "order_units", "assign_devices",
    "plan_field",
]


class Placement(TextEnum):
    """Where a paging unit's tensors live between calls. ``Unit.placement`` is one of these
    for a paging plan and a target label (``"cuda:0"``, ``"cpu@bfloat16"``) for a placement
    plan; both compare equal to their text (``Placement.PAGED == "paged"``)."""

    PAGED = "paged"  # host master, copied to the device for each call
    RESIDENT = "resident"  # kept on the device


@dataclass
class Unit:
    """A group of tensors placed or paged together.

    ``module`` is the module the unit stands for; ``own`` is True when the unit holds only
    the tensors registered directly on that module (its children are units of their own).
    ``tensors`` are the distinct tensors the unit owns; ``borrowed`` are tensors it uses
    that another unit owns (tied weights), which are never counted or placed twice.
    """

    module: str
    own: bool
    nbytes: int
    tensors: tuple[str, ...]
    borrowed: tuple[str, ...] = ()
    placement: str = ""

    @property
    def name(self) -> str:
        label = self.module or "<root>"
        return f"{label} (own)" if self.own else label

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "own": self.own,
            "bytes": self.nbytes,
            "tensors": list(self.tensors),
            "borrowed": list(self.borrowed),
            "placement": self.placement,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "the unit") -> Unit:
        """The unit ``to_dict`` gave. ``where`` names it in errors (``"units[3]"``).

        Raises:
            TypeError: ``d`` is not a dict, or a field has the wrong type.
            ValueError: a field is missing, or ``bytes`` is negative.
        """
        fields = ("a unit is the dict Unit.to_dict() returns: 'module', 'own', 'bytes', "
                  "'tensors' and, optionally, 'borrowed' and 'placement'")
        if not isinstance(d, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(d).__name__}; {fields}")
        return cls(
            plan_field(d, "module", str, where, fields),
            plan_field(d, "own", bool, where, fields),
            plan_field(d, "bytes", int, where, fields),
            plan_field(d, "tensors", tuple, where, fields),
            plan_field(d, "borrowed", tuple, where, fields, ()),
            plan_field(d, "placement", str, where, fields, ""),
        )


_KINDS = {str: "a string", bool: "true or false", int: "an int number of bytes (0 or more)",
          tuple: "a list of tensor names", dict: "a dict", list: "a list"}
_MISSING: Any = object()


def plan_field(d: Mapping[str, Any], key: str, kind: type, where: str, fields: str,
               default: Any = _MISSING) -> Any:
    """``d[key]`` checked to be of ``kind`` (``tuple``: a list of strings, returned as a
    tuple; ``int``: not a bool, not negative), or ``default`` when it is absent and has
    one. The errors name ``where`` and ``key`` and say what was expected (``fields``: the
    fields ``d`` should have)."""
    if key not in d:
        if default is not _MISSING:
            return default
        raise ValueError(f"{where} has no {key!r} field; {fields}")
    value = d[key]
    if kind is tuple:
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is dict:
        ok = isinstance(value, Mapping)
    elif kind is list:
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, kind)
    if not ok:
        text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise TypeError(f"{key!r} of {where} must be {_KINDS[kind]}, got "
                        f"{type(value).__name__} {text}")
    if kind is int and value < 0:
        raise ValueError(f"{key!r} of {where} must be {_KINDS[kind]}, got {value}")
    return tuple(value) if kind is tuple else value


def paging_units(sizes: ModuleSizes, limit: int | None) -> list[Unit]:
    """The coarsest units whose bytes stay under ``limit`` (registration order).

    A module whose subtree fits becomes one unit. One that does not is descended into: its
    own tensors form a unit of their own, and each child is planned the same way. A leaf
    larger than ``limit`` is still one unit (a tensor cannot be split); executors check it.
    ``limit=None`` gives the whole model as one unit; ``limit=0`` gives the finest units.
    """
    units: list[Unit] = []
    claimed: set[str] = set()

    def take(names: Iterable[str]) -> tuple[str, ...]:
        fresh = tuple(n for n in sorted(names, key=_order_key) if n not in claimed)
        claimed.update(fresh)
        return fresh

    def _order_key(name: str) -> int:
        return tensor_rank[name]

    tensor_rank = {name: i for i, name in enumerate(sizes.tensors)}

    def visit(module: str) -> None:
        if not sizes.subtree_tensors[module]:
            return  # no tensors at all; empty (0-byte) ones still need their unit placed
        whole = sizes.subtree_bytes[module]
        if limit is None or whole <= limit or not sizes.children[module]:
            owned = take(sizes.subtree_tensors[module])
            borrowed = tuple(n for n in sizes.subtree_tensors[module] if n not in owned)
            units.append(Unit(module, False, sizes.bytes_of(owned), owned, tuple(sorted(borrowed))))
            return
        if sizes.own[module]:
            owned = take(sizes.own[module])
            units.append(Unit(module, True, sizes.bytes_of(owned), owned))
        for kid in sizes.children[module]:
            visit(kid)

    if sizes.modules:
        visit(sizes.modules[0])
    return units


def split_unit(sizes: ModuleSizes, unit: Unit) -> list[Unit] | None:
    """``unit`` split one level: its module's own tensors, then one unit per child.

    Ownership stays as it was: the new units own exactly ``unit.tensors`` between them, and
    borrow every other tensor their subtree uses. Returns None when the unit cannot be split
    (an own-tensor unit, or a module without children), because its module needs all of it
    at once.
    """
    if unit.own or not sizes.children.get(unit.module):
        return None
    remaining = list(unit.tensors)
    kids: list[Unit] = []
    in_kids: set[str] = set()
    for kid in sizes.children[unit.module]:
        sub = sizes.subtree_tensors[kid]
        if not sub:
            continue
        in_kids |= sub
        owned = tuple(n for n in remaining if n in sub)
        remaining = [n for n in remaining if n not in sub]
        borrowed = tuple(sorted(sub - set(owned)))
        kids.append(Unit(kid, False, sizes.bytes_of(owned), owned, borrowed))
    # Tensors registered on the module itself, including aliases of tensors owned elsewhere.
    direct = set(sizes.own[unit.module])
    for info in sizes.tensors.values():
        if any(a.rpartition(".")[0] == unit.module for a in info.aliases):
            direct.add(info.name)
    owned = tuple(remaining)
    borrowed = tuple(sorted((direct | set(unit.borrowed)) - set(owned) - in_kids))
    head = [Unit(unit.module, True, sizes.bytes_of(owned), owned, borrowed)] if owned or borrowed else []
    return head + kids


def order_units(units: Sequence[Unit], order: Sequence[str]) -> list[Unit]:
    """``units`` sorted by when their module first ran (``order``: module names, first call
    first). A parent's own tensors come before its children; modules that never ran keep
    their registration order, after those that did."""
    first: dict[str, int] = {}
    for i, name in enumerate(order):
        first.setdefault(name, i)
    never = len(first)

    def key(item: tuple[int, Unit]) -> tuple[int, int]:
        index, unit = item
        rank = first.get(unit.module)
        if rank is None:
            # A unit whose own module never ran as a module (a container): rank by its
            # first descendant that did.
            prefix = unit.module + "." if unit.module else ""
            ranks = [r for m, r in first.items() if m.startswith(prefix)]
            rank = min(ranks) if ranks else never
        return (rank, index)

    return [u for _, u in sorted(enumerate(units), key=key)]


def assign_devices(
    units: Sequence[Unit],
    sizes: ModuleSizes,
    devices: Sequence[tuple[str, int | None, torch.dtype | None]],
) -> list[Unit]:
    """Place ``units`` (already in execution order) as a prefix per device.

    Each device in turn takes units until the next one would exceed its capacity (bytes in
    the dtype placed there); ``None`` capacity is unlimited. A unit that borrows a tied
    tensor goes where that tensor's owner went, so no tensor is ever on two devices.
    Units that fit nowhere get the last device.
    """
    if not devices:
        raise ValueError("devices must name at least one device")
    placed: list[Unit] = []
    where: dict[str, str] = {}
    used = [0] * len(devices)
    current = 0
    for unit in units:
        target = None
        for name in unit.borrowed:
            if name in where:
                target = where[name]
                break
        if target is None:
            while current < len(devices):
                device, capacity, dtype = devices[current]
                need = sizes.bytes_of(unit.tensors, dtype)
                if capacity is None or used[current] + need <= capacity:
                    break
                current += 1
            index = min(current, len(devices) - 1)
        else:
            index = next(i for i, d in enumerate(devices) if d[0] == target)
        device, _, dtype = devices[index]
        used[index] += sizes.bytes_of(unit.tensors, dtype)
        for name in unit.tensors:
            where[name] = device
        placed.append(replace(unit, placement=device))
    return placed
