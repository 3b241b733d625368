"""Locks held for a whole call, made new in a child process that ``fork`` made.

[Note: locks across a fork]
``os.fork`` copies a process with one thread, the one that forked, and every lock as it
was: one another thread held then stays held in the child, where no thread will ever let it
go. A decorated ``model=`` function holds its lock for its whole call (see [Note: calls
from several threads] in ``_dispatch/api.py``), and a first call holds its prediction's
lock for all its traces: a service that forks workers while a thread serves (a pre-fork
server, ``multiprocessing`` with ``fork``) had children that hung at their first call. So
the objects holding such locks register here, and in a forked child each makes its locks
anew. The state they guard is as the parent's thread left it; what
outlives a cut-short call is cleared by the next one as after an interrupt (a pager's
frames of a forward that never ended, say). Locks held for a moment only are left as they
are: a fork lands inside one rarely, as with any library.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["renew_after_fork"]

_owners: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def renew_after_fork(owner: Any, renew: Callable[[Any], None]) -> None:
    """Call ``renew(owner)`` in every child process a fork makes from now on, while
    ``owner`` lives (see [Note: locks across a fork]). ``renew`` must not hold ``owner``."""
    _owners[owner] = renew


def _in_child() -> None:
    for owner, renew in list(_owners.items()):
        renew(owner)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
