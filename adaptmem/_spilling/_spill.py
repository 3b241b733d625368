"""``adaptive.spill``: saved activations go to the next tier during forward and come back,
prefetched in reverse save order, during backward. The handle; each ``with`` block is one
``Step`` (``_hooks.py``).

[Note: a failed attempt's escalation]
With ``limit="auto"``, a step that runs out of memory makes the handle keep more memory free
for the next (three quarters, then spill everything over the threshold): the next try of a
step that does not fit should spill more. Inside ``@adaptive.batch(accumulate=...)`` the
failures are the batch search's own (each size too large fails once before a smaller one
runs), and a handle escalated by them would spill everything, to disk, for the rest of the
training at a micro-batch size that fits without it. So there a step's escalation is filed
with the retried call (``_common/attempts.py``) and undone once an attempt at a smaller size
succeeds: the search answered the failure. A call that fails at its smallest size keeps the
escalation, as a step outside the decorator does.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from .._common.attempts import current_attempt
from .._common.callables import lazy_body
from .._common.devices import format_bytes, parse_size, whole_number
from .._common.oom import is_oom
from .._common.reporting import report
from ._heap import check_mmap_threshold
from ._hooks import Step
from ._settings import StepSettings
from ._stats import SpillStats, track
from ._tiers import HostLink, check_directory, in_memory

__all__ = ["Spill", "spill"]

logger = logging.getLogger("adaptmem")
F = TypeVar("F", bound=Callable[..., Any])


class Spill:
    """A ``spill`` handle: a context manager (and decorator) for training steps. See
    ``spill``. ``link`` says how a device's tensors reach host memory (default:
    ``HostLink()``, through a side stream for an accelerator)."""

    def __init__(self, threshold: int | str = "1MiB", limit: int | str = "auto",
                 to: str | os.PathLike[str] | None = None, *, prefetch: int = 2,
                 max_pending: int | str = "auto",
                 mmap_threshold: int | str | None = None, link: HostLink | None = None) -> None:
        if callable(threshold):  # `@adaptive.spill` above a def, without the call
            raise TypeError(
                f"adaptive.spill makes a handle, which then decorates: write "
                f"@adaptive.spill() (or @adaptive.spill(threshold='1MiB', ...)) above the "
                f"def, with parentheses; got {getattr(threshold, '__name__', threshold)!r} "
                f"as threshold"
            )
        self.threshold = parse_size(threshold, "threshold")
        if isinstance(limit, str) and limit.strip().lower() == "auto":
            self.limit: int | str = "auto"
        else:
            try:
                self.limit = parse_size(limit, "limit")
            except ValueError as exc:
                raise ValueError(f"{exc}; or limit='auto' to spill only what does not fit") \
                    from None
        if to is None or (isinstance(to, str) and to == "host"):
            self.to: str | None = to
        elif isinstance(to, (str, os.PathLike)):
            self.to = check_directory(to)
            kind = in_memory(self.to)
            if kind is not None:  # See [Note: a spill directory in memory] in _tiers.py
                warnings.warn(
                    f"to={os.fspath(to)!r} is on {kind}, which keeps its files in memory: "
                    f"tensors spilled there free no memory. Pass a directory on a disk "
                    f"(/var/tmp, say)", stacklevel=3)
        else:
            raise TypeError(
                f"to must be 'host', a directory path, or None (the default tier), got "
                f"{type(to).__name__} {to!r}"
            )
        self.prefetch = _count(prefetch)
        self.keep_free = 0.5  # limit="auto": the share of free memory kept for backward
        if isinstance(max_pending, str) and max_pending.strip().lower() == "auto":
            self.max_pending: int | str = "auto"
        else:
            try:
                self.max_pending = max(1, parse_size(max_pending, "max_pending"))
            except ValueError as exc:
                raise ValueError(f"{exc}; or max_pending='auto' for an eighth of the free host "
                                 f"memory, at most 128 MiB") from None
        self.mmap_threshold = check_mmap_threshold(mmap_threshold)
        self.link = HostLink() if link is None else link
        self._stats = SpillStats()
        self._local = threading.local()
        track(self, self._stats)
        report(self, "spill handle", self._stats)  # see [Note: one place for statistics]

    @property
    def stats(self) -> SpillStats:
        """What this handle spilled and restored, over all its steps so far."""
        return self._stats

    def __repr__(self) -> str:
        limit = self.limit if self.limit == "auto" else format_bytes(int(self.limit))
        return (f"Spill(threshold={format_bytes(self.threshold)}, limit={limit}, "
                f"to={self.to or 'default'}, prefetch={self.prefetch})")

    def __enter__(self) -> Spill:
        steps = self._local.__dict__.setdefault("steps", [])
        step = Step(StepSettings(self.threshold, self.limit, self.keep_free, self.max_pending,
                                 self.prefetch, self.to, self.mmap_threshold, self.link),
                    self._stats)
        hooks = step.hooks()
        hooks.__enter__()
        steps.append((step, hooks))
        self._stats.steps += 1
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        step, hooks = self._local.steps.pop()
        hooks.__exit__(exc_type, exc, tb)
        if exc_type is None:
            step.finish()
            return
        step.discard()
        if self.limit == "auto" and self.keep_free < 1.0 and exc is not None and is_oom(exc):
            attempt = current_attempt()  # see [Note: a failed attempt's escalation]
            if attempt is not None:
                attempt.undo.append(functools.partial(setattr, self, "keep_free",
                                                      self.keep_free))
            self.keep_free = min(1.0, self.keep_free + 0.25)
            logger.info("spill: the step ran out of memory with limit='auto'; the next step "
                        "keeps %.0f%% of the free memory for backward%s", self.keep_free * 100,
                        " (spills every saved tensor over the threshold)"
                        if self.keep_free >= 1.0 else "")

    def __call__(self, fn: F) -> F:
        # Above @staticmethod / @classmethod: wrap the function, and bind as they would.
        binding = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
        func = fn.__func__ if binding is not None else fn  # type: ignore[attr-defined]
        if not callable(func):
            raise TypeError(
                f"a spill handle decorates a function (@adaptive.spill() above a def, or "
                f"adaptive.spill()(function)), got {type(fn).__name__} {fn!r}; to spill a "
                f"block of code, use the handle as `with adaptive.spill():` instead"
            )
        body = lazy_body(func)  # a generator function, or a callable object making one
        if body is not None:
            name = getattr(func, "__qualname__", None) or getattr(body, "__qualname__", func)
            raise TypeError(
                f"@adaptive.spill() spills what the decorated call saves while it runs, but "
                f"{name!r} is a generator or async function: calling it only makes the "
                f"generator or coroutine, and its forward runs after the call, outside the "
                f"spill. Put `with handle:` around the forward and backward inside it "
                f"instead (one handle = adaptive.spill(...))"
            )

        @functools.wraps(func)
        def step(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return step if binding is None else binding(step)  # type: ignore[return-value]


def _count(prefetch: Any) -> int:
    """``prefetch`` as a whole number, 0 or more (NumPy integers too), else ValueError."""
    n = whole_number(prefetch)
    if n is not None and n >= 0:
        return n
    raise ValueError(f"prefetch must be a whole number of tensors, 0 or more, got "
                     f"{prefetch!r}: pass e.g. prefetch=2 (0 restores each tensor only when "
                     f"backward asks for it)")


def spill(threshold: int | str = "1MiB", limit: int | str = "auto",
          to: str | os.PathLike[str] | None = None, *, prefetch: int = 2,
          max_pending: int | str = "auto", mmap_threshold: int | str | None = None) -> Spill:
    """Spill the activations a training step saves for backward to the next memory tier, and
    bring them back, prefetched, when backward needs them.

    Use it as a context manager around forward (and backward, if you like), or as a
    decorator on the step function. Inside, every tensor autograd saves whose storage is at
    least ``threshold`` bytes is copied out in the background once memory in use on its
    device exceeds ``limit``; its memory is freed as soon as the copy is done. In backward
    the copies come back in reverse save order, ``prefetch`` ahead of use. Gradients are
    bitwise those of the same step without spilling.

    Args:
        threshold: saved tensors smaller than this (bytes or a string like ``"1MiB"``) stay.
        limit: spill only while memory in use on the tensor's device exceeds this many bytes
            (on the CPU: the process's anonymous resident memory, what
            ``cpu_memory.set_cpu_memory_limit`` caps). ``"auto"``: spill once less than half
            of what was free at the step's first large save is left (the other half is kept
            for backward); after a step under the handle runs out of memory, the next keeps
            three quarters, and after a second one every saved tensor over the threshold
            is spilled, as with ``0``. ``0``: spill everything over the threshold.
        to: the next tier. ``"host"``: pinned host memory (the default for an accelerator;
            for CPU tensors there is no host tier, they stay). A directory: an unlinked
            scratch file in it (the default for CPU tensors: the temporary directory),
            emptied when backward is done, and gone with the process whatever happens.
        prefetch: how many spilled tensors backward restores ahead of use.
        max_pending: how many bytes may wait to be copied out before forward waits;
            ``"auto"``: an eighth of the free host memory at the first spill, at most 128 MiB.
        mmap_threshold: glibc only, for a process under ``cpu_memory.set_cpu_memory_limit``
            (whose cap counts address space, not resident memory): from a step's first spill
            of a CPU tensor until the step ends, allocations of at least this many bytes
            (``"1MiB"`` works well) get mappings of their own, so memory that spilling frees
            leaves the address space too. It is glibc's process-wide ``M_MMAP_THRESHOLD``;
            after the step it is set to 32 MiB, not back to glibc's adaptive threshold (glibc
            cannot do that), and large allocations then cost page faults. ``None``, the
            default, changes no allocator setting: freed memory still goes back to the system
            (``malloc_trim``), which lowers resident memory but not address space.

    Returns:
        A ``Spill`` handle; its ``stats`` (a ``SpillStats``) say what moved and how long
        the step waited. ``adaptive.memory_stats()`` adds them up for the process.

    Raises:
        ValueError: a negative or unreadable ``threshold`` / ``limit``; ``to`` is not a
            directory this process can create a file in; ``mmap_threshold`` outside 1 byte
            to 32 MiB, or given where the C library is not glibc.
        TypeError: ``to`` is not a string, a path or None; a function given as
            ``threshold`` (``@adaptive.spill`` without parentheses); the handle called on
            something that is not a function, or on a generator or async function (or a
            callable object whose ``__call__`` is one).
        OSError: (inside the step) the spill directory's disk is full, or the directory
            is gone; the message says where and what to do.
        RuntimeError: (in backward) a spilled tensor was changed in place after it was
            saved, as autograd reports it without spilling.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        >>> with adaptive.spill(threshold=0, limit=0) as handle:
        ...     model(torch.randn(32, 64)).sum().backward()
        >>> handle.stats.tensors_spilled, handle.stats.bytes_out, handle.stats.tensors_restored
        (2, 16384, 2)
    """
    return Spill(threshold, limit, to, prefetch=prefetch, max_pending=max_pending,
                 mmap_threshold=mmap_threshold)
