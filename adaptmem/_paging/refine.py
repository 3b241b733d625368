"""Run-time refinement: a unit that does not fit on the device when a module needs it is
split into its parts, and the same forward goes on with them. A tensor that cannot be split
further fails with an error that says what to change.

Where an out-of-memory error strikes decides which lever moves: during a weight transfer the
pager refines its units; during compute ``adaptive.batch`` shrinks the batch. The pager's
error says which (``OutOfMemoryError.phase == "transfer"``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

from .._common.devices import capacity, format_bytes, free_memory
from .._common.errors import OutOfMemoryError, Phase, oom_error_for
from .._engines.hoststore import LOADED, Slot
from .._engines.stats import PagingStats
from .._planning import ModuleSizes, Placement, Plan, Unit, split_unit
from .needs import enclosing_unit, unit_heads
from .slots import NoRoom, SlotTable

__all__ = ["Refiner"]

logger = logging.getLogger("adaptmem")


class Refiner:
    """Splits the pager's units at run time and records each split in ``plan`` and
    ``stats``, or raises the transfer error."""

    def __init__(self, sizes: ModuleSizes, plan: Plan, stats: PagingStats,
                 table: SlotTable, owner: object) -> None:
        self.sizes = sizes
        self.plan = plan
        self.stats = stats
        self.table = table
        self.owner = id(owner)  # the pager, named on its errors (see transfer_errors_shrink)

    def refine(self, units: list[Unit], module: str, inside: bool, needs: Sequence[Slot],
               cause: NoRoom, running: Sequence[tuple[str, int]] = ()) -> None:
        """``module``'s ``needs`` did not fit (``cause``): split its unit in ``units``, in
        place, or when it has none to split and lies ``inside`` a unit (called where that
        unit is not running), that unit, which may make ``module`` a unit of its own.
        Raises the transfer error when there is nothing to split (``running``: the modules
        running around it and the paged bytes each holds, named in the error)."""
        if self._split(units, module, cause):
            return
        outer = enclosing_unit(module, unit_heads(units)) if inside else None
        if outer is None or not self._split(units, outer, cause):
            self.give_up(module, [s for s in needs if s.state is not LOADED], cause, running)

    def _split(self, units: list[Unit], module: str, cause: NoRoom) -> bool:
        """Split the paged unit of ``module`` in ``units``, in place. False when ``module``
        has no paged unit, or its unit has no parts."""
        for i, unit in enumerate(units):
            if unit.module != module or unit.own or unit.placement is Placement.RESIDENT:
                continue
            parts = split_unit(self.sizes, unit)
            if not parts:
                return False
            parts = [replace(p, placement=Placement.PAGED) for p in parts]
            units[i:i + 1] = parts
            self.plan.units = list(units)
            why = "out of memory" if cause.oom is not None else "over device_budget"
            self.plan.refinements.append({"unit": unit.name, "bytes": unit.nbytes,
                                          "reason": why, "into": [p.name for p in parts]})
            self.stats.refinements += 1
            device = self.table.device
            logger.info(
                "adaptmem page: unit %s (%s) did not fit on %s (%s; %s of weights held, "
                "%s free): split into %d units", unit.name, format_bytes(unit.nbytes),
                device, why, format_bytes(self.table.held), format_bytes(free_memory(device)),
                len(parts))
            return True
        return False

    def _splittable(self, module: str) -> bool:
        """Whether a smaller ``unit_bytes`` would split ``module``'s unit: it holds more
        than the module's own tensors."""
        return any(u.module == module and split_unit(self.sizes, u) is not None
                   for u in self.plan.units)

    def give_up(self, module: str, missing: Sequence[Slot], cause: NoRoom,
                running: Sequence[tuple[str, int]] = ()) -> NoReturn:
        """Raise the transfer error: ``missing`` (``module``'s) does not fit and cannot be
        split further. An instance of the original OOM's type when there was one. The units
        ``running`` around it (name, paged bytes held) are named: a unit that is running is
        not split (its frames hold its weights), but a smaller ``unit_bytes`` splits it from
        the start."""
        table = self.table
        largest = max(missing, key=lambda s: s.nbytes)
        # Only advice that changes something: no resident units, nothing to lower.
        lower = (f"lower resident_bytes ({format_bytes(table.resident_bytes)} resident), "
                 if table.resident_bytes else "")
        free = ("free device memory (other tensors; a smaller batch leaves its activations' "
                "room to the weights)")
        either = f"{lower}or {free}" if lower else free
        if table.budget is not None:
            fits = f"it does not fit under device_budget={format_bytes(table.budget)}"
            fix = f"raise device_budget, {lower}or {free}"
        elif cause.oom is None:
            fits = (f"it does not fit in the memory the pager may take "
                    f"({format_bytes(free_memory(table.device))} free, less the reserve it "
                    f"leaves for activations)")
            fix = either
        else:
            # Free memory counts the allocator's cached blocks, and fragmentation (or a pool
            # of small blocks) can leave them unable to serve one block this size.
            fits = (f"the device ran out of memory for it, with "
                    f"{format_bytes(free_memory(table.device))} free by the allocator's "
                    f"count (cached blocks included, which fragmentation can leave unable "
                    f"to serve a block this size)")
            fix = either + (
                "; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation"
                if table.device.type == "cuda" else "")
        message = (
            f"adaptmem page: module {module or '<root>'!r} needs {format_bytes(cause.need)} of "
            f"weights on {table.device} at once (largest tensor {largest.name!r}, "
            f"{format_bytes(largest.nbytes)}), but with {format_bytes(table.held)} already "
            f"held (resident units and running parents) {fits}. It cannot be split further: "
            f"{fix}."
        )
        holders = [(name, nbytes) for name, nbytes in running if nbytes]
        if holders:
            listed = ", ".join(f"{n or '<root>'!r} {format_bytes(b)}" for n, b in holders)
            message += f" Of the bytes held, running units hold {listed}"
            splittable = [h for h in holders if self._splittable(h[0])]
            if splittable:
                name, nbytes = max(splittable, key=lambda h: h[1])
                message += (
                    f": a unit is not split while it runs, but unit_bytes below "
                    f"{format_bytes(nbytes)} splits {name or '<root>'!r} from the start, so "
                    f"that only its parts in use are held.")
            else:
                own = cause.need + sum(b for _, b in holders)
                needs = (f"device_budget={own} ({format_bytes(own)}) or more"
                         if table.budget is not None else
                         f"{format_bytes(own)} of device memory for weights")
                message += (
                    f", their own tensors, which a module holds while it runs and no "
                    f"unit_bytes splits: this module needs {needs} with nothing resident.")
        err = (oom_error_for(cause.oom)(message) if cause.oom is not None
               else OutOfMemoryError(message))
        err.phase = Phase.TRANSFER
        err.engine_id = self.owner
        # As large as the device: nothing else (the inputs) could be there beside it.
        err.beyond_device = cause.need >= (table.budget if table.budget is not None
                                           else capacity(table.device))
        if cause.oom is not None:
            raise err from cause.oom
        raise err from None  # raised while handling NoRoom, which it replaces
