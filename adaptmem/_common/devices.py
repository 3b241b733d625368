"""Device resolution, free/total memory probes and size parsing."""

from __future__ import annotations

import math
import numbers
import operator
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from .tree import map_tensors

__all__ = [
    "resolve_device",
    "parse_device",
    "default_device",
    "memory_info",
    "free_memory",
    "empty_cache",
    "synchronize",
    "parse_size",
    "whole_number",
    "format_bytes",
    "mover",
    "to_device",
    "stream_module",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def whole_number(value: Any) -> int | None:
    """``value`` as an int: anything with ``__index__`` (NumPy and torch integers too); None
    for a bool (a torch bool too, whose ``__index__`` gives 0 or 1) or anything else, for
    the caller's own error."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor)
                                   and value.dtype is torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from a number or a string such as ``"1.5GiB"``, ``"512MB"`` or ``"4096"``;
    a fraction of a byte is rounded down (``0.8 * free`` is a size). NumPy integers and
    floats are numbers too.

    Raises:
        TypeError: ``value`` is neither a number nor a string (``bool`` is refused too).
        ValueError: the string cannot be parsed, or the size is negative or not finite, or
            a number of bytes with a fraction is under 1 KiB (``2.5`` or ``"2.5"`` meant as
            GiB, which would be 2 bytes).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(
            f"{name} must be a number of bytes (int) or a string like '512MiB', "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        negated = _SIZE_RE.match(value.strip()[1:]) if value.strip()[:1] == "-" else None
        if negated is not None and negated.group(2).lower() in _UNITS:  # "-5MiB"
            raise ValueError(f"{name} must be a finite number of bytes, zero or more, got "
                             f"{value!r}")
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: write bytes as an int or a string like "
                f"'512MiB', '1.5GiB' or '20GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        number = float(match.group(1)) * _UNITS[unit]
        plain, shown = unit in ("", "b"), match.group(1)
    else:
        number = float(value)
        plain, shown = True, str(value)
    if plain and 0 < number < 1024 and not number.is_integer():  # "2.5" meant as GiB
        raise ValueError(f"{name}={value!r}: sizes are bytes, and this is under 1 KiB with a "
                         f"fraction of a byte; write a unit, e.g. '{shown}GiB'")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number of bytes, zero or more, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """A short human-readable size: ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_device() -> torch.device:
    """The current accelerator if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return torch.device("xpu", xpu.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(device: Any, name: str = "device") -> torch.device:
    """A concrete ``torch.device`` (with an index for accelerators) from user input.

    ``None`` means the current accelerator, else the CPU. An unknown device type, an
    accelerator that is not available, or an index past the last device raises ValueError.
    """
    if device is None:
        return default_device()
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"{name} must be a torch.device, a string like 'cuda:0' or 'cpu', or None, "
            f"got {type(device).__name__} {device!r}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"{name}={device!r} is not a device torch knows: use 'cpu', 'cuda', 'cuda:1', ..."
        ) from exc
    if dev.type == "meta":
        raise ValueError(f"{name}={device!r}: the meta device holds no data; pick 'cpu' or 'cuda'")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r} but CUDA is not available here; use 'cpu' or None")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{name}={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device("cuda", index)
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    if dev.type == "mps":
        available = torch.backends.mps.is_available
    if available is None or not available():
        raise ValueError(f"{name}={device!r} is not available on this machine; use 'cpu' or None")
    return dev


def parse_device(device: Any, name: str = "device") -> torch.device:
    """A ``torch.device`` from its name without asking whether this machine has it, for plans
    made for another machine (``resolve_device`` checks). An integer or an accelerator name
    without an index means index 0 (``"cuda"`` is ``cuda:0``); the CPU has no index."""
    what = name if name.endswith(repr(device)) else f"{name} {device!r}"  # named once
    try:
        dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what} is not a device name such as 'cuda:0' or 'cpu'") from None
    if dev.type == "meta":
        raise ValueError(f"{what}: the meta device holds no data; pick 'cpu' or 'cuda'")
    if dev.type == "cpu":
        return torch.device("cpu")
    return dev if dev.index is not None else torch.device(dev.type, 0)


def _cuda_fraction(device: torch.device) -> float:
    """The per-process memory fraction of CUDA ``device`` (1.0 where torch cannot say)."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is None:
        return 1.0
    return float(fraction(torch.cuda.current_device() if device.index is None
                          else device.index))


def memory_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes on ``device``: on CUDA within any per-process memory fraction,
    on the CPU under any adaptmem CPU limit."""
    if device.type == "cuda":
        free, total = (int(n) for n in torch.cuda.mem_get_info(device))
        reserved = int(torch.cuda.memory_reserved(device))
        # Under set_per_process_memory_fraction the allocator refuses to reserve past
        # fraction * total, however much the card has free.
        free = min(free, max(0, int(_cuda_fraction(device) * total) - reserved))
        # Blocks torch's caching allocator holds but does not use are free to this process.
        cached = reserved - int(torch.cuda.memory_allocated(device))
        return free + max(0, cached), total
    if device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
        free, total = torch.xpu.mem_get_info(device)
        return int(free), int(total)
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        return max(0, total - int(torch.mps.driver_allocated_memory())), total
    from ..cpu_memory import cpu_memory_info

    return cpu_memory_info()


def capacity(device: torch.device) -> int:
    """The most bytes this process can ever hold on ``device``: its total memory, on CUDA
    times any per-process memory fraction (see ``memory_info``), on MPS times the high
    watermark ratio the allocator allows past its recommended maximum (1.7 unless
    ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` says otherwise; 0 means no limit)."""
    total = memory_info(device)[1]
    if device.type == "cuda":
        return int(_cuda_fraction(device) * total)
    if device.type == "mps":
        try:
            ratio = float(os.environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.7"))
        except ValueError:
            ratio = 1.7
        return sys.maxsize if ratio <= 0 else int(ratio * total)
    return total


def free_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (see ``memory_info``)."""
    return memory_info(device)[0]


def empty_cache(device: torch.device | None = None) -> None:
    """Return cached allocator blocks of accelerators already in use to the driver: those
    of ``device``'s kind, and with ``device=None`` (a function whose device is not known)
    of every kind available."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    kind = None if device is None else device.type
    if kind in (None, "mps"):
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            torch.mps.empty_cache()
    if kind in (None, "xpu"):
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            xpu.empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device``; a no-op for the CPU."""
    if device.type in ("cuda", "xpu"):
        torch.get_device_module(device.type).synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def stream_module(device: torch.device) -> Any:
    """The ``torch.<type>`` module of an accelerator with streams and events (CUDA and ROCm
    as ``cuda``, XPU), or None: what asynchronous copies need, in one place."""
    if device.type not in ("cuda", "xpu"):
        return None
    module = torch.get_device_module(device.type)
    needed = ("Stream", "Event", "stream", "current_stream", "synchronize")
    return module if all(hasattr(module, n) for n in needed) else None


def mover(
    device: torch.device,
    dtype: torch.dtype | None = None,
    non_blocking: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``to_device`` does to one tensor, as a function (for ``map_tensors``)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.device == device and t.dtype == target:
            return t
        return t.to(device=device, dtype=target, non_blocking=non_blocking)

    return move


def to_device(
    obj: Any,
    device: torch.device,
    dtype: torch.dtype | None = None,
    non_blocking: bool = False,
) -> Any:
    """Move every tensor in ``obj`` (nested) to ``device``; floating tensors also to ``dtype``
    when given (integer and bool tensors keep theirs). Tensors already there are untouched;
    a tensor met twice gives one moved tensor (See [Note: aliased arguments])."""
    return map_tensors(obj, mover(device, dtype, non_blocking))
