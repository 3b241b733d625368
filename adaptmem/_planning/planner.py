"""The parameter-size planner: module tree -> bytes -> units -> placement. No tensor moves.

Everything here works on a model built on the meta device, so planning a 70B-parameter
model costs no memory. Executors (the pager, chunk/split) take a ``Plan`` and act on it;
``adaptive.plan`` (in ``_placement_plan``) is the public front of both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .._common.devices import format_bytes
from .recording import record_forward

__all__ = [
    "TensorInfo",
    "ModuleSizes",
    "Unit",
    "Plan",
    "module_sizes",
    "paging_units",
    "split_unit",
    "order_units",
    "assign_devices",
    "record_execution_order",
    "tensor_bytes",
]


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes ``t`` takes, or would take with its floating values converted to ``dtype``."""
    if dtype is not None and t.is_floating_point():
        return t.numel() * dtype.itemsize
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class TensorInfo:
    """One distinct tensor of a model; ``aliases`` are its other qualified names (ties)."""

    name: str
    module: str
    attr: str
    kind: str  # "parameter" or "buffer"
    nbytes: int
    numel: int
    dtype: torch.dtype
    floating: bool
    aliases: tuple[str, ...] = ()

    def bytes_as(self, dtype: torch.dtype | None) -> int:
        if dtype is not None and self.floating:
            return self.numel * dtype.itemsize
        return self.nbytes


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class ModuleSizes:
    """Bytes of every module of a model, counting each distinct tensor once.

    ``own[m]`` lists the tensors registered directly on module ``m``; ``subtree_bytes[m]``
    counts the distinct tensors of ``m`` and everything below it. Modules registered under
    two names appear once, under the first name ``named_modules()`` gives.
    """

    modules: list[str]
    children: dict[str, list[str]]
    own: dict[str, list[str]]
    tensors: dict[str, TensorInfo]
    subtree_bytes: dict[str, int]
    subtree_tensors: dict[str, frozenset[str]]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def own_bytes(self, module: str, dtype: torch.dtype | None = None) -> int:
        return sum(self.tensors[n].bytes_as(dtype) for n in self.own[module])

    def bytes_of(self, names: Iterable[str], dtype: torch.dtype | None = None) -> int:
        return sum(self.tensors[n].bytes_as(dtype) for n in names)

    def largest_tensor(self) -> TensorInfo | None:
        return max(self.tensors.values(), key=lambda t: t.nbytes, default=None)


def module_sizes(model: nn.Module) -> ModuleSizes:
    """Walk ``model`` once and count bytes per module, dtype-aware, ties counted once."""
    modules: list[str] = []
    children: dict[str, list[str]] = {}
    own: dict[str, list[str]] = {}
    tensors: dict[str, TensorInfo] = {}
    by_id: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    seen_modules: dict[int, str] = {}
    walked = list(model.named_modules())
    for mod_name, module in walked:
        seen_modules[id(module)] = mod_name
    for mod_name, module in walked:
        modules.append(mod_name)
        own[mod_name] = []
        # A child registered under two names is the child of its first registration only
        # (the name named_modules() gives), wherever the other one sits.
        children[mod_name] = [
            full for child_name, child in module.named_children() if child is not None
            and seen_modules[id(child)] == (full := _join(mod_name, child_name))]
        for kind, registry in (("parameter", module._parameters), ("buffer", module._buffers)):
            for attr, t in registry.items():
                if t is None:
                    continue
                full = _join(mod_name, attr)
                canonical = by_id.get(id(t))
                if canonical is not None:
                    aliases[canonical].append(full)
                    continue
                by_id[id(t)] = full
                aliases[full] = []
                own[mod_name].append(full)
                tensors[full] = TensorInfo(
                    full, mod_name, attr, kind, tensor_bytes(t), t.numel(), t.dtype,
                    t.is_floating_point(),
                )
    for name, extra in aliases.items():
        if extra:
            tensors[name] = replace(tensors[name], aliases=tuple(extra))
    # children[] only keeps each module's first registration, so this is a tree.
    subtree_tensors: dict[str, frozenset[str]] = {}
    for mod_name in reversed(modules):
        names = set(own[mod_name])
        for kid in children[mod_name]:
            names |= subtree_tensors[kid]
        subtree_tensors[mod_name] = frozenset(names)
    # A tensor registered on module A and tied into module B belongs to B's subtree too.
    for canonical, extra in aliases.items():
        for alias in extra:
            holder = alias.rpartition(".")[0]
            parts = holder.split(".") if holder else []
            for i in range(len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in subtree_tensors:
                    subtree_tensors[prefix] = subtree_tensors[prefix] | {canonical}
    subtree_bytes = {
        m: sum(tensors[n].nbytes for n in names) for m, names in subtree_tensors.items()
    }
    return ModuleSizes(modules, children, own, tensors, subtree_bytes, subtree_tensors)


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
    def from_dict(cls, d: Mapping[str, Any]) -> Unit:
        return cls(
            d["module"], bool(d["own"]), int(d["bytes"]), tuple(d["tensors"]),
            tuple(d.get("borrowed", ())), str(d.get("placement", "")),
        )


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
        whole = sizes.subtree_bytes[module]
        if whole == 0:
            return
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


def record_execution_order(model: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """Module names in first-call order, from one forward of ``model(*args, **kwargs)``.

    The forward runs on a copy (meta when it can; see [Note: recording on a copy] in
    ``_recording``), so neither the model nor the inputs change.
    """
    return record_forward(model, args, kwargs).order


@dataclass
class Plan:
    """What an engine decided: units in execution order, their bytes and placement.

    ``print(plan)`` shows a table; ``plan.to_dict()`` / ``Plan.from_dict`` round-trip
    through JSON; ``plan.device_map`` is an accelerate-style ``{module: device}`` dict.
    """

    mode: str
    units: list[Unit]
    total_bytes: int
    options: dict[str, Any] = field(default_factory=dict)
    refinements: list[dict[str, Any]] = field(default_factory=list)

    def bytes_by_placement(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for u in self.units:
            out[u.placement] = out.get(u.placement, 0) + u.nbytes
        return out

    @property
    def device_map(self) -> dict[str, str]:
        """``{module name: placement}``, coarsest: a module whose units all share one
        placement is named once instead of its descendants; a split module's own tensors
        are named one by one (``"encoder.pos_embedding"``), as accelerate allows."""
        out: dict[str, str] = {}

        def visit(prefix: str, units: list[Unit]) -> None:
            places = {u.placement for u in units}
            if len(places) == 1:
                out[prefix] = places.pop()
                return
            groups: dict[str, list[Unit]] = {}
            for u in units:
                if u.module == prefix:
                    for t in u.tensors:
                        out[t] = u.placement
                    continue
                tail = u.module[len(prefix) + 1:] if prefix else u.module
                groups.setdefault(_join(prefix, tail.split(".")[0]), []).append(u)
            for child, members in groups.items():
                visit(child, members)

        if self.units:
            visit("", list(self.units))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "total_bytes": self.total_bytes,
            "options": {k: _jsonable(v) for k, v in self.options.items()},
            "units": [u.to_dict() for u in self.units],
            "refinements": list(self.refinements),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        return cls(
            str(d["mode"]), [Unit.from_dict(u) for u in d["units"]], int(d["total_bytes"]),
            dict(d.get("options", {})), list(d.get("refinements", [])),
        )

    def __str__(self) -> str:
        rows = [(str(i), u.name, format_bytes(u.nbytes), u.placement or "-")
                for i, u in enumerate(self.units)]
        head = ("#", "unit", "bytes", "placement")
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(4)]
        fmt = "  ".join(f"{{:{'>' if c in (0, 2) else '<'}{w}}}" for c, w in enumerate(widths))
        lines = [f"adaptmem plan ({self.mode}): {len(self.units)} units, "
                 f"{format_bytes(self.total_bytes)}", fmt.format(*head)]
        lines += [fmt.format(*r) for r in rows]
        lines.append("totals: " + ", ".join(
            f"{place or '-'} {format_bytes(n)}" for place, n in self.bytes_by_placement().items()))
        for r in self.refinements:
            lines.append(f"refined: {r}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Plan(mode={self.mode!r}, units={len(self.units)}, total_bytes={self.total_bytes})"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)
