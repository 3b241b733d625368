"""Which simulation is running: at most one at a time, set by ``simulated_cuda()`` on entry
and cleared on exit. Kept apart from the state's class so that streams, which need the
running state, and the state, which makes streams, do not import each other."""

from __future__ import annotations

from typing import Any

__all__ = ["active", "running", "set_active"]

_active: Any = None  # the running simulation's SimState


def running() -> Any:
    """The running simulation's state, or None."""
    return _active


def active() -> Any:
    """The running simulation's state; raises outside ``with simulated_cuda():``."""
    if _active is None:
        raise RuntimeError("adaptmem.testing.simulated_cuda() is not active: a simulated CUDA "
                           "object was used outside its `with simulated_cuda():` block")
    return _active


def set_active(state: Any) -> None:
    global _active
    _active = state
