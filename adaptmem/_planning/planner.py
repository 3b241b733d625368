"""The planner's front: ``adaptive.plan`` (paging units, or a placement over devices) and the
inputs it takes. Pure apart from the recorded forward, which runs on a copy of the model and
its inputs: see [Note: recording on a copy] in ``recording.py``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from .._common.devices import parse_size
from .._common.errors import first_line
from .assignment import plan_placement
from .peak import activation_report
from .plan import Plan
from .recording import Recording, record_forward
from .sizes import ModuleSizes, module_sizes
from .targets import targets_from_devices
from .units import Placement, order_units, paging_units

__all__ = ["split_inputs", "plan", "cannot_run_on_meta"]

logger = logging.getLogger("adaptmem")



def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from a tensor, a tuple of positional inputs or a dict of keywords."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


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
        order: module names in execution order, each once, when already known (for a
            model that cannot run ``example_inputs``' forward); not with ``example_inputs``.

    Returns:
        A ``Plan``: ``print(plan)`` is a table, ``plan.device_map`` a ``{module: device}`` dict.

    Raises:
        TypeError / ValueError: a bad argument, named in the message; ``order`` with
            ``example_inputs``, or naming a module twice.
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
        {'': 'cuda:0@float16'}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sizes = module_sizes(model)
    if order is not None:
        if isinstance(order, str) or not isinstance(order, Sequence):
            raise TypeError(f"order must be a list of module names in execution order, got "
                            f"{order!r}")
        if example_inputs is not None:
            raise TypeError(
                "order= and example_inputs= both give the execution order (the forward "
                "example_inputs runs records it, with the weights each module reads); pass "
                "one: order= for a model that cannot run that forward, example_inputs= "
                "otherwise")
        known = set(sizes.modules)
        unknown = [n for n in order if n not in known]
        if unknown:
            raise ValueError(
                f"order names {', '.join(repr(n) for n in unknown[:5])}"
                f"{' ...' if len(unknown) > 5 else ''}, not module(s) of this model; give "
                f"names as model.named_modules() does")
        twice = sorted(n for n, times in Counter(order).items() if times > 1)
        if twice:
            raise ValueError(
                f"order names {', '.join(repr(n) for n in twice[:5])}"
                f"{' ...' if len(twice) > 5 else ''} more than once; give each module once, "
                f"where it first runs")
    recording = None
    unrecorded = None  # why a model on meta could not run the example forward
    if example_inputs is not None:
        try:
            recording = record_forward(model, *split_inputs(example_inputs))
        except Exception as exc:
            if not (cannot_run_on_meta(exc) and _has_meta_tensors(model)):
                raise
            # A model on meta that reads values (detection's nonzero, a regnet's .item()):
            # the units are in registration order, and the plan says why.
            unrecorded = (f"the model cannot run on the meta device "
                          f"({first_line(exc, typed=False)}); units are in "
                          f"registration order: build it with real weights, or pass order= "
                          f"the modules' execution order instead of example_inputs=")
            logger.info("adaptive.plan: %s", unrecorded)
        else:
            order = recording.order
    result = _plan(model, sizes, recording, unit_bytes, devices, dtype, order)
    if unrecorded is not None:
        result.options["activations"] = {"predicted": False, "reason": unrecorded}
    elif example_inputs is not None:
        room = None
        if devices is not None:
            first = result.units[0].placement if result.units else None
            capacity = result.options.get("devices", {}).get(str(first))
            if capacity is not None:
                room = max(0, capacity - result.options.get("placed_bytes", {}).get(first, 0))
        result.options["activations"] = activation_report(
            model, *split_inputs(example_inputs), room,
            result.dtype_of(result.units[0].placement) if result.units else None)
    return result


def cannot_run_on_meta(exc: BaseException) -> bool:
    """Whether ``exc`` is the meta device's own failure (no kernel, a data-dependent op),
    not the input's or the model's."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _plan(model: nn.Module, sizes: ModuleSizes, recording: Recording | None, unit_bytes: Any,
          devices: Any, dtype: Any, order: Sequence[str] | None) -> Plan:
    if devices is None:
        if dtype is not None:
            raise TypeError("dtype is for a placement plan: pass devices= too, e.g. "
                            "devices={'cuda:0': '6GiB', 'cpu': None}")
        limit = None if unit_bytes is None else parse_size(unit_bytes, "unit_bytes")
        units = paging_units(sizes, limit)
        if order is not None:
            units = order_units(units, order)
        units = [replace(u, placement=Placement.PAGED) for u in units]
        return Plan("page", units, sizes.total_bytes, {"unit_bytes": limit})
    if unit_bytes is not None:
        raise TypeError("unit_bytes is for a paging plan; a placement plan (devices=) makes "
                        "its units from the module tree")
    targets = targets_from_devices(devices, dtype, "auto", probe=False)
    if order is not None and (recording is None or order is not recording.order):
        recording = Recording(list(order), {} if recording is None else recording.uses,
                              combined=set() if recording is None else recording.combined,
                              output_dtype=None if recording is None else recording.output_dtype)
    return plan_placement(model, sizes, targets, recording, mode="split")
