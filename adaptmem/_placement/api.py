"""The public ``adaptive.chunk`` and ``adaptive.split``, and the targets ``chunk`` places on
(which the CLI's ``plan --mode chunk`` uses too)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from .._common.callables import hide_private_parameters
from .._common.claims import check_placeable
from .._common.devices import format_bytes, parse_device, parse_size, resolve_device
from .._planning import (
    Target,
    auto_capacity,
    check_capacity,
    parse_dtype,
    qualify_labels,
    targets_from_devices,
)
from .device_map import map_label
from .splitter import Chunker, Splitter

__all__ = ["split", "chunk", "chunk_targets"]

_log = logging.getLogger("adaptmem")


def _undo_on_failure(handle: Splitter, step: Callable[[], None]) -> None:
    """Run a set-up ``step``; if it fails, remove ``handle`` so the model is as it was."""
    try:
        step()
    except BaseException:
        handle.remove()
        raise


# _allow_meta (for adaptive.load): accept meta tensors and allocate them, uninitialised,
# where the plan puts them (filled through handle.load_targets()); remove() puts the meta
# tensors back. Hidden from the signature users see, as in chunk.
@hide_private_parameters
def split(
    model: nn.Module,
    devices: Any = None,
    *,
    device_map: Mapping[str, str] | None = None,
    dtype: Any = None,
    output_device: Any = None,
    example_inputs: Any = None,
    reserve: Any = "auto",
    _allow_meta: bool = False,
) -> Splitter:
    """Spread ``model`` over several devices, a prefix of its execution order per device.

    Units (each module's own weights; attention blocks whole) fill each device in the order
    they run, not the order they were registered, until the next would pass its capacity in
    the dtype placed there. Execution order is learned from one forward on a copy of the
    model and its inputs, on the meta device when the model can run there (so it costs no
    memory and neither the model nor the inputs change): at the first call, or now when
    ``example_inputs`` is given. ``adaptive.plan(model, devices, example_inputs=...)`` shows
    the same placement in advance. Each unit moves what it receives (args and kwargs,
    nested) to its device, and to its floating dtype where its placement converts one, and
    hands outputs back where its caller has them; outputs reach you on the device of your
    inputs. Without a dtype conversion no activation changes dtype.

    Args:
        model: an ``nn.Module`` in eval mode with real (not meta) weights.
        devices: an ordered mapping ``{device: capacity}`` (bytes, "20GiB", ``"auto"``, or None
            for unlimited) or a list of devices (each ``"auto"``). A key may carry a dtype,
            ``("cpu", torch.bfloat16)`` or ``"cpu@bfloat16"``, so one device can hold two.
        device_map: ``{module name: device}`` (accelerate style) instead of capacities; the
            keys of ``handle.device_map`` work, and tensor names for a split module's own
            tensors. Devices come from the values when ``devices`` is None.
        dtype: the dtype floating weights take on placement: one for all devices, or a
            mapping ``{device: dtype}``. The originals are kept for ``remove()``.
        output_device: where outputs are returned (default: where the inputs came from).
        example_inputs: a tensor, tuple of positional inputs or dict of keyword inputs;
            given, the model is placed now instead of at the first call.
        reserve: what ``"auto"`` capacities keep free for activations (see ``chunk``).

    Returns:
        A ``Splitter`` with ``.plan``, ``.device_map`` (assignable), ``.stats``,
        ``.remove()``; a context manager.

    Raises:
        TypeError / ValueError: a bad argument (named in the message); nothing was changed.
        PlacementError: a training-mode, meta or already placed model, a model that does not
            fit, or a device_map that misses or splits a unit.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).eval()
        >>> with adaptive.split(net, {"cpu@bfloat16": 64 * 65 * 2, "cpu": None},
        ...                     example_inputs=torch.ones(1, 64)) as s:
        ...     s.device_map
        ...     net(torch.ones(1, 64)).dtype
        {'0': 'cpu@bfloat16', '1': 'cpu'}
        torch.float32
    """
    check_placeable(model, "adaptive.chunk/split", _allow_meta)
    out_dev = None if output_device is None else resolve_device(output_device, "output_device")
    if device_map is None and _is_module_map(devices, model):
        raise TypeError(
            f"devices={dict(devices)!r} maps module names to devices: that is a device_map; "
            f"pass it as adaptive.split(model, device_map=...), and devices= as "
            f"{{device: capacity}} (e.g. {{'cuda:0': '20GiB', 'cpu': None}}) or a list")
    if devices is None:
        if device_map is None:
            raise TypeError("split needs devices ({'cuda:0': '20GiB', 'cpu': None}) or device_map")
        if not isinstance(device_map, Mapping) or not device_map:
            raise TypeError(f"device_map must be a non-empty dict {{module: device}}, got "
                            f"{device_map!r}")
        for key, value in device_map.items():  # named by its entry, not as a devices key
            resolve_device(map_label(value).partition("@")[0], f"device_map[{str(key)!r}]")
        devices = {v: None for v in dict.fromkeys(map_label(v) for v in device_map.values())}
    targets = targets_from_devices(devices, dtype, reserve)
    if device_map is not None and not isinstance(device_map, Mapping):
        raise TypeError(f"device_map must be a dict {{module: device}}, got {device_map!r}")
    handle = Splitter(model, targets, output_device=out_dev, options={"reserve": reserve})
    if device_map is not None or example_inputs is not None:
        _undo_on_failure(handle, partial(handle.place, device_map, example_inputs=example_inputs))
    return handle


def _is_module_map(devices: Any, model: nn.Module) -> bool:
    """Whether ``devices`` is a ``{module name: device}`` map (a plan's ``device_map``): every
    key a module name of ``model`` and no device name, every value a device name."""
    if not isinstance(devices, Mapping) or not devices:
        return False
    names = dict(model.named_modules())
    return all(isinstance(key, str) and key in names and not _is_device_name(key)
               and _is_device_name(value) for key, value in devices.items())


def _is_device_name(value: Any) -> bool:
    """Whether ``value`` names a device (here or not): ``"cuda:7"``, ``"cpu@bfloat16"``, ``0``."""
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        return False
    try:
        parse_device(map_label(value).partition("@")[0])
    except ValueError:
        return False
    return True


@hide_private_parameters  # _allow_meta: see split
def chunk(
    model: nn.Module,
    device: Any = None,
    *,
    capacity: Any = "auto",
    dtype: Any = None,
    reserve: Any = "auto",
    output_device: Any = None,
    example_inputs: Any = None,
    _allow_meta: bool = False,
) -> Chunker:
    """Keep the first part of ``model`` (in execution order) resident on ``device`` and run
    the rest on the CPU: ``split(model, {device: capacity, "cpu": None})``.

    ``capacity="auto"`` is the device's free memory minus ``reserve``; ``reserve="auto"``
    keeps back the larger of 10% of the device's total memory and 512 MiB, room for
    activations, the copies made at the boundary and allocator slack. Pass ``reserve=``
    bytes (or "2GiB") to choose it, or a fixed ``capacity``.

    Args:
        model: an ``nn.Module`` in eval mode with real weights.
        device: where the resident part lives; None means the current accelerator, else CPU.
        capacity: bytes the resident part may take (int, "6GiB"), counted in ``dtype``.
        dtype: the floating dtype of the resident part (e.g. ``torch.float16``); the CPU part
            keeps the model's own. Originals are kept so ``remove()`` restores them bitwise.
        reserve: see above; only used when ``capacity="auto"``.
        output_device: where outputs are returned (default: where the inputs came from).
        example_inputs: inputs for one forward that learns the execution order now; without
            them the model is placed at its first call.

    Returns:
        A ``Chunker`` (``.plan``, ``.device_map``, ``.stats``, ``.remove()``, context manager).

    Raises:
        TypeError / ValueError: a bad argument (named in the message); the model is untouched.
        PlacementError: a training-mode, meta or already placed model.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).eval()
        >>> chunker = adaptive.chunk(net, "cpu", capacity=8_500, dtype=torch.bfloat16,
        ...                          example_inputs=torch.ones(1, 64))
        >>> chunker.device_map
        {'0': 'cpu@bfloat16', '1': 'cpu'}
        >>> chunker.remove()
    """
    check_placeable(model, "adaptive.chunk/split", _allow_meta)
    dev = resolve_device(device, "device")
    dt = parse_dtype(dtype)
    out_dev = None if output_device is None else resolve_device(output_device, "output_device")
    if isinstance(capacity, str) and capacity == "auto":
        cap, kept = auto_capacity(dev, reserve)
        _log.info("adaptmem chunk: capacity auto on %s = %s free minus %s reserve", dev,
                  format_bytes(cap + kept), format_bytes(kept))
    else:
        if reserve != "auto":
            raise ValueError(f"reserve={reserve!r} only applies to capacity='auto'; with "
                             f"capacity={capacity!r} leave reserve out")
        if capacity is None:
            raise TypeError("capacity must be bytes (int or '6GiB') or 'auto', got None")
        cap = parse_size(capacity, "capacity")
        check_capacity(dev, cap, "capacity")
    targets = chunk_targets(dev, cap, dt)
    handle = Chunker(model, targets, output_device=out_dev,
                     options={"capacity": cap, "reserve": reserve})
    if example_inputs is not None:
        _undo_on_failure(handle, partial(handle.place, example_inputs=example_inputs))
    return handle


def chunk_targets(device: torch.device, capacity: int | None, dtype: torch.dtype | None
                  ) -> list[Target]:
    """``chunk``'s targets: ``device`` holding ``capacity`` bytes in ``dtype``, then the CPU
    for the rest; one CPU target (capacity moot) when both are the CPU in its own dtype."""
    cpu = torch.device("cpu")
    if device == cpu and dtype is None:
        return [Target(cpu, None, None, "cpu")]
    labels = qualify_labels([(device, dtype), (cpu, None)])
    return [Target(device, capacity, dtype, labels[0]), Target(cpu, None, None, labels[1])]
