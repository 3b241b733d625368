"""The namespace users import: ``from adaptmem import adaptive``. Re-exports only."""

from . import cpu_memory
from ._errors import AdaptmemError, LoadError, OutOfMemoryError, PlacementError
from ._paging import Pager, page
from ._planner import Plan, plan

__all__ = [
    "AdaptmemError",
    "LoadError",
    "OutOfMemoryError",
    "Pager",
    "Plan",
    "PlacementError",
    "cpu_memory",
    "page",
    "plan",
]
