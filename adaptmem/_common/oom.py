"""Recognising out-of-memory errors, and clearing up after a failed attempt."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

import torch

from .devices import empty_cache
from .errors import EXCEPTION_GROUP, OutOfMemoryError, Phase

__all__ = ["is_oom", "oom_phase", "owned_engines", "shrinks_size", "transfer_errors_shrink",
           "raised_by", "drop_frames", "free_caches", "OOM_MESSAGES"]

# Matched against every string argument of a RuntimeError, case-sensitively, because these are
# the exact words the backends print (checked against their sources and real failures).
OOM_MESSAGES: tuple[tuple[str, str], ...] = (
    ("CUDA out of memory", "CUDA caching allocator"),
    ("CUDA error: out of memory", "CUDA runtime (AcceleratorError)"),
    ("CUDA driver error: out of memory", "CUDA driver API (C10_CUDA_DRIVER_CHECK)"),
    ("HIP out of memory", "ROCm caching allocator"),
    ("HIP error: out of memory", "ROCm driver"),
    ("MPS backend out of memory", "Apple MPS allocator"),
    ("XPU out of memory", "Intel XPU allocator"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS workspace allocation"),
    ("CUDNN_STATUS_ALLOC_FAILED", "cuDNN workspace allocation"),
    ("CUFFT_ALLOC_FAILED", "cuFFT plan allocation"),
    ("CUSOLVER_STATUS_ALLOC_FAILED", "cuSOLVER workspace allocation"),
    ("resource allocation failed when calling `cusparse", "cuSPARSE allocation"),
    ("CUDNN_STATUS_NOT_SUPPORTED", "cuDNN, which reports a failed workspace this way"),
    ("CUDNN_STATUS_INTERNAL_ERROR", "cuDNN, whose workspace failure can surface this way"),
    ("CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
     "cuBLAS, whose handle creation fails this way on a full device"),
    ("DefaultCPUAllocator: can't allocate memory", "CPU allocator"),
    ("DefaultCPUAllocator: not enough memory", "CPU allocator (Windows)"),
    ("PT_DEVMEM Allocation failed", "Habana HPU allocator"),
)


# Python 3.11's exception groups (none before): an ``asyncio.TaskGroup``'s errors; their
# members carry tracebacks of their own.
_GROUPS: tuple[type, ...] = () if EXCEPTION_GROUP is None else (EXCEPTION_GROUP,)


def _message_match(exc: BaseException) -> bool:
    for arg in exc.args:
        if isinstance(arg, str):
            for needle, _ in OOM_MESSAGES:
                if needle in arg:
                    return True
    return False


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` means memory ran out: the OOM types first (adaptmem's own
    ``OutOfMemoryError`` included, whatever the original it stands for), then the messages.

    >>> is_oom(MemoryError())
    True
    >>> is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes."))
    True
    >>> is_oom(ValueError("CUDA out of memory"))
    False
    """
    # adaptmem's own error carries adaptmem's message, not the backend's, and stands for an
    # original that may be a plain RuntimeError (CPU allocator, MPS, cuBLAS, CUDA driver).
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError, OutOfMemoryError)):
        return True
    if isinstance(exc, _GROUPS):
        # Tasks of an ``asyncio.TaskGroup`` (or ``except*`` code) fail as a group: one that
        # ran out of memory cancels the others, which the group does not hold. A group of
        # nothing but out-of-memory errors is one; one holding another error is not.
        return all(map(is_oom, getattr(exc, "exceptions", ())))
    return isinstance(exc, RuntimeError) and _message_match(exc)


def oom_phase(exc: BaseException) -> Phase:
    """``Phase.TRANSFER`` if memory ran out while adaptmem moved weights, else
    ``Phase.COMPUTE`` (for a group, ``COMPUTE`` when any of its errors is)."""
    if isinstance(exc, _GROUPS):
        phases = {oom_phase(e) for e in getattr(exc, "exceptions", ())}
        return Phase.COMPUTE if Phase.COMPUTE in phases or not phases else Phase.TRANSFER
    return Phase(getattr(exc, "phase", Phase.COMPUTE))


# The engines of the decorator with ``model=`` whose function runs (see [Note: batch size and
# residency together] in ``_dispatch/placed.py``).
_owned: ContextVar[Callable[[], Iterable[object]]] = ContextVar("adaptmem_owned_engines",
                                                              default=tuple)


@contextlib.contextmanager
def transfer_errors_shrink(engines: Callable[[], Iterable[object]]) -> Iterator[None]:
    """Inside, an error one of ``engines()`` (pagers) raised while moving weights shrinks the
    batch or step too: the decorator that placed them holds both, and a smaller batch leaves
    the weights the room its activations held. Other pagers' errors do not. ``engines`` is
    asked when an error comes: the decorator's placement may have changed since (new
    pagers), and work made inside the scope may run after it (``owned_engines``)."""
    token = _owned.set(engines)
    try:
        yield
    finally:
        _owned.reset(token)


def raised_by(exc: BaseException, engines: Iterable[object]) -> bool:
    """Whether ``exc`` is a transfer error one of ``engines`` raised."""
    return getattr(exc, "engine_id", None) in {id(e) for e in engines}


def owned_engines() -> Callable[[], Iterable[object]]:
    """What ``transfer_errors_shrink`` says here, for work that runs after the scope has
    ended (a generator's or a coroutine's body): pass it to ``shrinks_size`` then."""
    return _owned.get()


def shrinks_size(exc: BaseException,
                 owned: Callable[[], Iterable[object]] | None = None) -> bool:
    """True for an out-of-memory error that a smaller batch or step can help: one raised in
    compute, not one a pager raised while moving weights (unless that pager's decorator holds
    the batch too: ``transfer_errors_shrink``, or ``owned`` taken from it earlier with
    ``owned_engines``; and its weights are not more than the device can ever hold:
    ``OutOfMemoryError.beyond_device``)."""
    if not is_oom(exc):
        return False
    if isinstance(exc, _GROUPS):  # each of its errors shrinks it
        return all(shrinks_size(e, owned) for e in getattr(exc, "exceptions", ()))
    if oom_phase(exc) is not Phase.TRANSFER:
        return True
    return (raised_by(exc, (_owned.get() if owned is None else owned)())
            and not getattr(exc, "beyond_device", False))


def drop_frames(exc: BaseException) -> None:
    """Drop every frame a failed attempt left in ``exc``'s tracebacks: their locals are
    cleared, then the tracebacks themselves go (a frame keeps its function, and so the
    closures it captured, alive even when cleared). Every exception ``exc`` leads to is
    walked: its ``__cause__`` and its ``__context__`` (an error raised ``from`` an
    out-of-memory error while handling another links to each through one of them), and the
    members of an exception group; each once, so a cycle ends the walk. The walk does not go
    past an exception the caller is handling (the call was made in an ``except`` block): its
    traceback starts in a frame still running outside adaptmem, and it is the caller's."""
    seen: set[int] = set()
    running: set[int] | None = None
    pending: list[BaseException | None] = [exc]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        tb = link.__traceback__
        if link is not exc and tb is not None:
            if running is None:
                running = _running_outside()
            if id(tb.tb_frame) in running:
                continue
        traceback.clear_frames(tb)
        link.__traceback__ = None
        pending += (link.__context__, link.__cause__)
        if isinstance(link, _GROUPS):
            pending += link.exceptions  # type: ignore[attr-defined]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _running_outside() -> set[int]:
    """The frames running now (this thread's stack) that are not adaptmem's."""
    frames = set()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
            frames.add(id(frame))
        frame = frame.f_back
    return frames


def free_caches(device: torch.device | None) -> None:
    """Collect garbage, then hand cached device memory back before the next attempt."""
    gc.collect()
    empty_cache(device)
