"""Functions of the C library through ctypes, typed, for the few system calls Python's
standard library lacks (mincore, madvise, malloc_trim, ...)."""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

__all__ = ["libc_function", "resident_pages"]


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


_mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
                         ctypes.c_int)
_RESIDENT = bytes(i & 1 for i in range(256))  # mincore: bit 0 says the page is resident


def resident_pages(address: int, nbytes: int) -> bytes | None:
    """Per page of ``[address, address + nbytes)`` (``address`` page-aligned), ``b"\\x01"``
    where it is resident (for a file mapping: in the page cache) and ``b"\\x00"`` where not,
    from mincore, which reads nothing; None where mincore cannot say."""
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if _mincore is None or _mincore(address, nbytes, vec) != 0:
        return None
    return bytes(vec).translate(_RESIDENT)
