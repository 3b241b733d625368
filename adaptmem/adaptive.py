"""The namespace users import: ``from adaptmem import adaptive``. Re-exports only."""

from . import cpu_memory
from ._errors import AdaptmemError, LoadError, OutOfMemoryError, PlacementError
from ._placement import Chunker, Splitter, chunk, split
from ._planner import Plan, plan

__all__ = [
    "AdaptmemError",
    "Chunker",
    "LoadError",
    "OutOfMemoryError",
    "Plan",
    "PlacementError",
    "Splitter",
    "chunk",
    "cpu_memory",
    "plan",
    "split",
]
