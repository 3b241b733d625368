"""``TextEnum``: enums whose members are their text, for states users read.

Users compare ``error.phase == "transfer"`` and ``unit.placement == "paged"``, print them and
write them to JSON; a member of a ``TextEnum`` is a ``str`` equal to its value, prints as its
value (not ``Phase.TRANSFER``) and serialises as it, while code inside adaptmem names the
member and a typo is an ``AttributeError`` instead of a silent mismatch.
"""

from __future__ import annotations

import enum

__all__ = ["TextEnum"]


class TextEnum(str, enum.Enum):
    """A ``str`` enum that prints, formats and compares as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
