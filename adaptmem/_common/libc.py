"""Functions of the C library through ctypes, typed, for the few system calls Python's
standard library lacks (mincore, madvise, malloc_trim, ...)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["libc_function"]


def libc_function(name: str, argtypes: list[Any] | None, restype: Any) -> Any:
    """``name`` from the C library, typed; None where there is none (not Linux, or a C
    library without it). ``argtypes=None`` leaves the arguments unchecked."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function
