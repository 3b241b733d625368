"""The checkpoint files one load holds open: a few dozen at most, however many files the
checkpoint has. See [Note: a directory of many files]."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping
from typing import BinaryIO

from .._common.errors import LoadError

__all__ = ["FileId", "OpenFiles", "file_id", "replaced_message"]

FileId = tuple[int, int]  # (st_dev, st_ino): which file a name reached when it was opened

# [Note: a file replaced during a load]
# Trainers save by writing a new file and renaming it over the checkpoint (os.replace). A
# load that opened the path again after reading the header (a file of many, or the O_DIRECT
# descriptor) then read the new file at the old header's offsets: garbage weights, no error.
# So each file's header is read through one open (the format sniff, the safetensors header,
# the zip directory and torch's pickle alike), and the (st_dev, st_ino) of that descriptor
# goes with the checkpoint (`Checkpoint.identities`). Every later open of the name is
# checked against it (one fstat per open, not per tensor): the reads' own descriptors
# (`OpenFiles`) refuse a different file with a LoadError that asks to load again, and an
# O_DIRECT descriptor that reaches a different file is closed unused (the tensors are read
# through the checked descriptor, see direct.py). A file written in place, without a rename,
# is the same file: see [Note: a file that shrinks during a load].

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

    def __init__(self, settle: Callable[[], None], advice: Callable[[str], int | None],
                 identities: Mapping[str, FileId] | None = None) -> None:
        self._files: dict[str, BinaryIO] = {}
        self._settle = settle
        self._advice = advice
        # name -> the file its header was read from (see [Note: a file replaced during a load])
        self._identities = identities or {}

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
        expected = self._identities.get(name)
        if expected is not None and file_id(os.fstat(f.fileno())) != expected:
            f.close()
            raise LoadError(replaced_message(name))
        advice = self._advice(name)
        if _FADVISE is not None and advice is not None:
            with contextlib.suppress(OSError):
                _FADVISE(f.fileno(), 0, 0, advice)
        return f


def file_id(stat: os.stat_result) -> FileId:
    """Which file ``stat`` describes (see [Note: a file replaced during a load])."""
    return stat.st_dev, stat.st_ino


def replaced_message(name: str) -> str:
    """The error for checkpoint file ``name`` replaced by another after its header was read."""
    return (f"{name!r} was replaced during the load: its header was read from one file, and "
            f"the name now reaches another (a save that writes a new file and renames it over "
            f"the checkpoint, as trainers do). Nothing was read from the new file; load again "
            f"once the save is done")
