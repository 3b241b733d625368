"""The checkpoint files one load holds open: a few dozen at most, however many files the
checkpoint has. See [Note: a directory of many files]."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from typing import BinaryIO

from .._common.errors import LoadError

__all__ = ["OpenFiles"]

# [Note: a directory of many files]
# A checkpoint may be a directory of one file per tensor: hundreds or thousands of files.
# Keeping each open until the load ended ran out of descriptors (RLIMIT_NOFILE, often 1024)
# after most tensors of a built model had been overwritten in place. So a load holds at most
# _MAX_OPEN files open: files are read in order, and when one more is needed, the reads in
# flight (which use descriptors by number) are waited for and the open files are closed.
# Every file is opened once before the first write (`check`), so one that cannot be opened
# fails the load before anything changes; a load that runs out of descriptors later (other
# code of the process holding many) closes its files and tries again.
_MAX_OPEN = 64
_FADVISE = getattr(os, "posix_fadvise", None)


class OpenFiles:
    """Open checkpoint files by name, closed and opened again as needed. ``settle`` waits
    for every read in flight; ``advice(name)`` is the ``posix_fadvise`` advice a file gets
    when it is opened."""

    def __init__(self, settle: Callable[[], None], advice: Callable[[str], int | None]) -> None:
        self._files: dict[str, BinaryIO] = {}
        self._settle = settle
        self._advice = advice

    def get(self, name: str) -> BinaryIO:
        """``name`` open for reading (unbuffered); the file of a read in flight stays open."""
        f = self._files.get(name)
        if f is None:
            if len(self._files) >= _MAX_OPEN:
                self.close()
            f = self._files[name] = self._open(name)
        return f

    def opened(self, name: str) -> BinaryIO:
        """``name``, which a read in flight has open (no file is closed meanwhile)."""
        return self._files[name]

    def check(self, names: list[str]) -> None:
        """Open each of ``names`` once: a file that cannot be opened fails here."""
        for name in names:
            self.get(name)

    def close(self) -> None:
        """Wait for the reads in flight, then close every file."""
        self._settle()
        files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()

    def _open(self, name: str) -> BinaryIO:
        try:
            f = open(name, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and self._files:
                self.close()  # descriptors held elsewhere in the process: give ours back
                return self._open(name)
            raise LoadError(f"cannot open checkpoint file {name!r}: {exc}") from None
        advice = self._advice(name)
        if _FADVISE is not None and advice is not None:
            with contextlib.suppress(OSError):
                _FADVISE(f.fileno(), 0, 0, advice)
        return f
