"""``adaptive.page``: check the request, size the units, hand the model to a ``Pager``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._common.callables import hide_private_parameters
from .._common.claims import check_placeable, refuse_compiled
from .._common.devices import capacity, format_bytes, parse_size, resolve_device
from .._engines.transfer import Transfer
from .._planning import ModuleSizes, Unit, module_sizes, paging_units
from .pager import Pager
from .slots import room_for_weights

__all__ = ["Pager", "page", "page_as_asked"]


def _size_option(value: Any, name: str, auto_ok: bool = True) -> int | None:
    if auto_ok and value == "auto":
        return None
    return parse_size(value, name)


# _transfer (tests, benchmarks): how host masters reach the device. _check_room
# (page_as_asked): False takes any resident_bytes the device can hold. Hidden from the
# signature users see.
@hide_private_parameters
def page(
    model: nn.Module,
    device: Any = None,
    *,
    unit_bytes: int | str | None = "auto",
    prefetch: int = 1,
    resident_bytes: int | str = "auto",
    device_budget: int | str | None = None,
    pin_memory: bool = True,
    output_device: Any = None,
    _transfer: Transfer | None = None,
    _check_room: bool = True,
) -> Pager:
    """Page ``model``'s weights to ``device`` just in time, and return the ``Pager``.

    Weights stay in host memory (pinned when the device is an accelerator); each part of
    the model is copied to the device right before it runs and released after, while the
    next ``prefetch`` parts are already on their way. Call the model as before. Until
    ``remove()``, the model cannot be deep-copied or pickled whole, and after a dtype or
    device conversion (``model.half()``, ``.to()``) its calls raise ``PlacementError``.

    Args:
        model: a model in eval mode with real (not meta) weights, anywhere.
        device: where compute runs; None means the current accelerator, else the CPU.
        unit_bytes: the largest group of weights paged together ("64MiB"); "auto" for
            the coarsest units that fit the working budget, no larger than a
            ``resident_bytes`` that keeps part of the model; None for one unit.
        prefetch: how many units ahead are copied while one runs, within a forward
            (0 turns it off).
        resident_bytes: bytes of units kept on the device for good; "auto" keeps as many as
            free memory allows after room for the paged working set, 0 pages everything.
        device_budget: a cap on the device bytes the pager uses for weights (None: free
            memory decides). Units that do not fit under it are split at run time, down to
            one module's own tensors: a budget smaller than those of some module is
            refused here.
        pin_memory: pin the host masters when the device is an accelerator.
        output_device: where outputs go; None returns them on the inputs' device (where
            the model was, for a call without tensor inputs).

    Returns:
        A ``Pager`` with ``.plan``, ``.stats`` and ``.remove()``; also a context manager.

    Raises:
        TypeError: ``model`` is not a module, or a size is neither int nor string.
        ValueError: an unknown device, a negative or unparsable size or ``prefetch``, or a
            ``device_budget`` smaller than the weights one module needs at once (its own
            tensors, which are never split; the error names the module, its largest tensor
            and the smallest budget that can work), or a ``resident_bytes`` whose resident
            units leave too little room to page the rest (within ``device_budget``, or with
            room for activations on the device; the error names the largest that leaves room).
        PlacementError: the model is in training mode, has meta tensors, or is (part of)
            a model already paged. The model is untouched in every case.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
        ...                           torch.nn.Linear(8, 2)).eval()
        >>> x = torch.randn(3, 8)
        >>> expected = net(x)
        >>> with adaptive.page(net, "cpu", unit_bytes=0, resident_bytes=0) as pager:
        ...     torch.equal(net(x), expected)
        True
    """
    check_placeable(model, "adaptive.page")
    refuse_compiled(model, "adaptive.page")
    dev = resolve_device(device, "device")
    out_dev = None if output_device is None else resolve_device(output_device, "output_device")
    units = None if unit_bytes is None else _size_option(unit_bytes, "unit_bytes")
    resident = _size_option(resident_bytes, "resident_bytes")
    budget = None if device_budget is None else parse_size(device_budget, "device_budget")
    if budget == 0:
        raise ValueError("device_budget=0 leaves no device memory for weights, so no forward "
                         "could run; give bytes (int or '6GiB'), or None for free memory")
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be True or False, got {pin_memory!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"prefetch must be an int number of units, got {prefetch!r}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 or more units, got {prefetch}; 0 turns it off")
    if budget is not None and resident is not None and resident > budget:
        raise ValueError(
            f"resident_bytes={format_bytes(resident)} is more than device_budget="
            f"{format_bytes(budget)}; lower resident_bytes or raise device_budget")
    if budget is not None:
        _check_budget(module_sizes(model), budget)
    elif resident is not None and dev.type != "cpu":
        # More resident than the device can ever hold: every call would run out of memory.
        keep, most = min(resident, module_sizes(model).total_bytes), capacity(dev)
        if keep > most:
            raise ValueError(
                f"resident_bytes={format_bytes(resident)} would keep {format_bytes(keep)} of "
                f"weights on {dev}, which this process can hold {format_bytes(most)} of at "
                f"most; lower resident_bytes, or leave it out ('auto' keeps what free memory "
                f"allows)")
    if unit_bytes == "auto":
        units = _auto_unit_bytes(model, dev, prefetch, resident, budget)
    if _check_room and resident is not None and (budget is not None or dev.type != "cpu"):
        _check_resident(module_sizes(model), units, resident, dev, budget)
    # Masters and resident copies must be ordinary tensors even when page() is called
    # under inference_mode, or the model could not run with autograd on afterwards.
    with torch.inference_mode(False):
        return Pager(model, dev, unit_bytes=units, prefetch=prefetch, resident_bytes=resident,
                     device_budget=budget, pin_memory=pin_memory, output_device=out_dev,
                     transfer=_transfer)


def page_as_asked(model: nn.Module, device: Any, *, resident_bytes: int) -> Pager:
    """``page``, taking any ``resident_bytes`` the device can hold: for the ``model=``
    decorator, whose calls give residency back when they run out of memory."""
    return page(model, device, resident_bytes=resident_bytes, _check_room=False)


def _held_at_once(sizes: ModuleSizes) -> list[tuple[Unit, set[str]]]:
    """Each of the finest units (what run-time splitting reaches) with the tensors it needs
    on the device at once: a module running holds its own tensors while its children run,
    so a child needs its weights beside those of every ancestor with tensors of its own."""
    units = paging_units(sizes, 0)
    own = {u.module: u.tensors for u in units if u.own}

    def held_with(u: Unit) -> set[str]:
        names = {*u.tensors, *u.borrowed}
        for ancestor, tensors in own.items():
            if ancestor != u.module and (ancestor == "" or u.module.startswith(ancestor + ".")):
                names.update(tensors)
        return names

    return [(u, held_with(u)) for u in units]


def _kept(units: list[Unit], allowance: int) -> set[str]:
    """The tensors ``SlotTable.keep_resident`` keeps for ``allowance`` when memory allows."""
    kept: set[str] = set()
    used = 0
    for u in units:
        if u.tensors and used + u.nbytes <= allowance:
            kept.update(u.tensors)
            used += u.nbytes
    return kept


def _check_resident(sizes: ModuleSizes, unit_bytes: int | None, resident: int,
                    device: torch.device, budget: int | None) -> None:
    """Refuse a ``resident_bytes`` whose resident units leave too little room to page the rest:
    the weights kept plus those the largest paged module needs at once (split as finely as
    run time can) must fit under ``budget``, or leave room for the forward's inputs and
    activations on ``device``; else every call would run out of memory."""
    units = paging_units(sizes, unit_bytes)
    held = _held_at_once(sizes)
    most = budget if budget is not None else capacity(device)

    def working_set(allowance: int) -> tuple[int, int, str]:
        kept = _kept(units, allowance)
        need, module = max(((sizes.bytes_of(n - kept), u.module) for u, n in held),
                           key=lambda item: item[0], default=(0, ""))
        return sizes.bytes_of(kept), need, module

    def fits(kept: int, need: int) -> bool:
        return need == 0 or (kept + need <= most if budget is not None else kept + need < most)

    kept, need, module = working_set(resident)
    if fits(kept, need):
        return
    # Keeping fewer units: the largest resident_bytes that keeps only what fits. When none
    # does, a module alone is too large for the device: not resident_bytes' doing, and its
    # first call says so (the model= decorator chunks such a model instead).
    smaller = kept
    while True:
        if smaller == 0:
            return
        below, need_below, _ = working_set(smaller - 1)
        if fits(below, need_below):
            break
        smaller = below
    where = (f"more than device_budget={format_bytes(budget)} ({budget} bytes)"
             if budget is not None else
             f"all of the {format_bytes(most)} this process can hold on {device}, with nothing "
             f"left for the forward's inputs and activations")
    raise ValueError(
        f"resident_bytes={format_bytes(resident)} would keep {format_bytes(kept)} of weights "
        f"resident on {device}, and paging the rest needs {format_bytes(need)} more at once "
        f"(module {module or '<root>'!r}): {format_bytes(kept + need)} ({kept + need} bytes), "
        f"{where}, so every call would run out of memory. Give resident_bytes under {smaller} "
        f"({format_bytes(smaller)}), which keeps {format_bytes(below)} (less leaves more room "
        f"for activations and prefetching), or leave it out ('auto' keeps what free memory "
        f"allows after room for the paged working set)")


def _check_budget(sizes: ModuleSizes, budget: int) -> None:
    """Refuse a ``device_budget`` smaller than the weights some module needs on the device at
    once: its own tensors (and those it shares with another module), which the pager never
    splits. A budget this size can work (with ``resident_bytes=0``); whether a smaller share
    of it is enough with parents or resident units held too is only known at run time."""
    held = _held_at_once(sizes)
    if not held:
        return
    need, unit, names = max(((sizes.bytes_of(n), u, n) for u, n in held),
                            key=lambda item: item[0])
    if need <= budget:
        return
    largest = max((sizes.tensors[n] for n in names), key=lambda t: t.nbytes)
    around = sizes.bytes_of(names - {*unit.tensors, *unit.borrowed})
    with_parents = (f", {format_bytes(around)} of it its parents' own tensors, which they hold "
                    f"while it runs" if around else "")
    raise ValueError(
        f"device_budget={format_bytes(budget)} ({budget} bytes) is less than module "
        f"{unit.module or '<root>'!r} needs on the device at once: {format_bytes(need)} "
        f"({need} bytes) of weights{with_parents}, the largest tensor {largest.name!r} "
        f"{format_bytes(largest.nbytes)}. The pager splits units down to one module's own "
        f"tensors, never further. Give device_budget={need} or more (with resident_bytes=0; "
        f"more leaves room for resident units and prefetching), or None to use the free "
        f"memory")


def _auto_unit_bytes(model: nn.Module, device: torch.device, prefetch: int,
                     resident: int | None, budget: int | None) -> int | None:
    """The coarsest unit size whose working set (``prefetch + 2`` units) fits, and no
    larger than ``resident`` when that keeps only part of the model: a unit larger than
    the bytes asked to stay resident would keep none of them there. (Not where no unit
    fits in ``resident`` even then: finer units would keep nothing either, and page in more
    transfers.)"""
    sizes = module_sizes(model)
    total = sizes.total_bytes
    room = room_for_weights(device, budget)
    if resident is None and total <= room:
        return None
    working = room - resident if resident is not None else room // 2
    units = max(0, working) // (prefetch + 2)
    if (resident is not None and 0 < resident < min(total, units)
            and any(0 < u.nbytes <= resident for u in paging_units(sizes, resident))):
        units = resident
    return units
