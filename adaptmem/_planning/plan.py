"""``Plan``: what the planner decided (units in execution order, their bytes and placement), the
one object every engine, ``adaptive.plan`` and the CLI show and consume.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._common.devices import format_bytes
from .._common.tree import join_name
from .targets import parse_dtype, split_label
from .units import Unit, plan_field

__all__ = ["Plan"]


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

    def dtype_of(self, placement: str) -> torch.dtype | None:
        """The dtype floating weights take on ``placement`` (a unit's label: ``"cuda:0"``,
        ``"cpu@bfloat16"``), as the plan sized them; None: they keep their own."""
        stored = self.options.get("dtypes", {}).get(placement)
        return split_label(placement)[1] or (
            parse_dtype(stored, f"the plan's dtype for {placement!r}") if stored else None)

    def bytes_by_placement(self) -> dict[str, int]:
        """``{placement: bytes}`` in the order placements first come: plain strings
        (``"paged"``, ``"cuda:0"``, ``"cpu@bfloat16"``), for a paging plan and a placement
        plan alike."""
        out: dict[str, int] = {}
        for u in self.units:
            key = str(u.placement)
            out[key] = out.get(key, 0) + u.nbytes
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
                groups.setdefault(join_name(prefix, tail.split(".")[0]), []).append(u)
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
        """The plan ``to_dict`` gave (or its JSON, parsed).

        Args:
            d: the dict ``plan.to_dict()`` returns; from JSON text, ``json.loads(text)``;
                from a file, ``json.load(f)``.

        Returns:
            The ``Plan``.

        Raises:
            TypeError: ``d`` is not a dict (a str or path: read the JSON first, as above),
                or a field has the wrong type.
            ValueError: a field is missing, or a size is negative.

        Example:
            >>> import json
            >>> from adaptmem import adaptive
            >>> plan = adaptive.Plan("page", [], 0)
            >>> adaptive.Plan.from_dict(json.loads(plan.to_json()))
            Plan(mode='page', units=0, total_bytes=0)
        """
        fields = ("expected the dict plan.to_dict() returns: 'mode', 'total_bytes', 'units' "
                  "and, optionally, 'options' and 'refinements'")
        if isinstance(d, (str, bytes, os.PathLike)):
            raise TypeError(
                f"Plan.from_dict takes the dict plan.to_dict() returns, got "
                f"{type(d).__name__} {_short(d)}; read the JSON first: "
                f"Plan.from_dict(json.loads(text)) for JSON text, or "
                f"Plan.from_dict(json.load(open(path))) for a file")
        if not isinstance(d, Mapping):
            raise TypeError(f"Plan.from_dict takes the dict plan.to_dict() returns, got "
                            f"{type(d).__name__} {_short(d)}")
        where = "the plan"
        units = plan_field(d, "units", list, where, fields)
        return cls(
            plan_field(d, "mode", str, where, fields),
            [Unit.from_dict(u, f"units[{i}] of the plan") for i, u in enumerate(units)],
            plan_field(d, "total_bytes", int, where, fields),
            dict(plan_field(d, "options", dict, where, fields, {})),
            list(plan_field(d, "refinements", list, where, fields, [])),
        )

    def __str__(self) -> str:
        rows = [(str(i), u.name, format_bytes(u.nbytes), u.placement or "-")
                for i, u in enumerate(self.units)]
        head = ("#", "unit", "bytes", "placement")
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(4)]
        fmt = "  ".join(f"{{:{'>' if c in (0, 2) else '<'}{w}}}" for c, w in enumerate(widths))
        count = len(self.units)
        lines = [f"adaptmem plan ({self.mode}): {count} unit{'' if count == 1 else 's'}, "
                 f"{format_bytes(self.total_bytes)}", fmt.format(*head)]
        lines += [fmt.format(*r) for r in rows]
        lines.append("totals: " + ", ".join(
            f"{place or '-'} {format_bytes(n)}" for place, n in self.bytes_by_placement().items()))
        act = self.options.get("activations")
        if act is not None:
            lines.append(_activations_line(act, str(self.units[0].placement) if self.units else ""))
        for r in self.refinements:
            lines.append(f"refined: {r}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Plan(mode={self.mode!r}, units={len(self.units)}, total_bytes={self.total_bytes})"


def _short(v: Any) -> str:
    """``repr(v)``, cut to a line."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


def _activations_line(act: Mapping[str, Any], first: str) -> str:
    if not act.get("predicted"):
        return f"activations: not predicted ({act.get('reason', 'unknown')})"
    line = (f"activations (predicted on meta): {format_bytes(act['per_item_bytes'])} per item "
            f"+ {format_bytes(act['fixed_bytes'])}")
    if "largest_batch" in act:
        line += (f"; largest batch within 80% of the {format_bytes(act['room_bytes'])} left "
                 f"on {first}: {act['largest_batch']}")
    return line
