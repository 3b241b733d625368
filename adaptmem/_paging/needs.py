"""What each module acquires when it is called.

A unit's module acquires the unit's tensors and those it borrows. Once a forward has been
learned, a module also acquires the tensors its own code read that no module always running
around it brings (``MultiheadAttention`` reading ``out_proj.weight``). Resident tensors are
never acquired.

[Note: modules inside a unit] A module below a unit's module keeps its hooks when its
subtree holds paged weights. While its unit runs, they are all loaded and it does nothing;
called on its own (an encoder, as ``generate()`` calls it) or from where its unit is not
running, it acquires its subtree's paged weights: what it needs ``alone``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._engines.hoststore import LOADED, Slot
from .._planning import Unit
from .learner import Learner
from .slots import SlotTable

__all__ = ["Needs", "enclosing_unit", "unit_heads"]


def unit_heads(units: Sequence[Unit]) -> set[str]:
    """The modules whose whole subtree is one unit."""
    return {u.module for u in units if not u.own}


def enclosing_unit(name: str, heads: set[str]) -> str | None:
    """The module of the unit ``name`` lies inside (below it), if any."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if ".".join(parts[:i]) in heads:
            return ".".join(parts[:i])
    return None


class Needs:
    """The slots each module acquires, by ``id(module)``: ``by_module`` when it runs where
    the plan expects it, ``alone`` for a module inside a unit (see [Note: modules inside a
    unit]); both in the slot table's order."""

    __slots__ = ("by_module", "alone")

    def __init__(self) -> None:
        self.by_module: dict[int, tuple[Slot, ...]] = {}
        self.alone: dict[int, tuple[Slot, ...]] = {}

    def for_call(self, mid: int, on_its_own: bool) -> tuple[Slot, ...] | None:
        """What module ``mid`` acquires for this call (``on_its_own``: no module of the
        model is running); None when nothing: it holds nothing paged, or it lies inside a
        unit that is running and holds everything it needs."""
        needs = self.by_module.get(mid)
        if needs is None:
            needs = self.alone.get(mid)
            if needs is not None and not on_its_own:
                for s in needs:
                    if s.state is not LOADED:
                        return needs
                return None  # its unit is running: everything is there already
            return needs
        if on_its_own and self.alone:
            return self.alone.get(mid, needs)
        return needs

    def hooked(self) -> set[int]:
        """The ids of the modules that acquire something, in any call."""
        return self.by_module.keys() | self.alone.keys()

    def compute(self, units: Sequence[Unit], modules: dict[str, nn.Module], table: SlotTable,
                learner: Learner) -> None:
        """Recompute from ``units`` and, once a forward is learned, what ``learner`` saw
        (``alone`` only then)."""
        brought: dict[str, set[str]] = {}
        for u in units:
            brought.setdefault(u.module, set()).update(u.tensors, u.borrowed)
        slots = table.slots
        rank = {n: i for i, n in enumerate(slots)}
        needs: dict[int, tuple[Slot, ...]] = {}
        for name, module in modules.items():
            mine = set(brought.get(name, ()))
            if not learner.learning:
                mine |= learner.reads(name, brought)
            found = [slots[n] for n in mine if not slots[n].resident]
            if found:
                needs[id(module)] = tuple(sorted(found, key=lambda s: rank[s.name]))
        self.by_module = needs
        if not learner.learning:
            self.alone = self._inside_units(units, modules, table, rank)

    def _inside_units(self, units: Sequence[Unit], modules: dict[str, nn.Module],
                      table: SlotTable, rank: dict[str, int]) -> dict[int, tuple[Slot, ...]]:
        """What each module inside a unit needs when its unit is not running: its subtree's
        paged weights and its own needs, when that is more than its own needs."""
        alone = {}
        heads = unit_heads(units)
        for name, module in modules.items():
            if not name or enclosing_unit(name, heads) is None:
                continue
            # Walked rather than looked up by name: a module registered under two names
            # is in the subtree of both.
            found = {id(s): s for m in module.modules()
                     for t in (*m._parameters.values(), *m._buffers.values())
                     if t is not None and (s := table.by_id.get(id(t))) is not None
                     and not s.resident}
            mine = self.by_module.get(id(module), ())
            found.update((id(s), s) for s in mine)
            if len(found) > len(mine):
                alone[id(module)] = tuple(sorted(found.values(), key=lambda s: rank[s.name]))
        return alone
