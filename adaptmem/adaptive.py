"""The namespace users import: ``from adaptmem import adaptive``. Re-exports only."""

from . import cpu_memory
from ._errors import AdaptmemError, LoadError, OutOfMemoryError, PlacementError
from ._loading import empty_model, load
from ._planner import Plan, plan

__all__ = [
    "AdaptmemError",
    "LoadError",
    "OutOfMemoryError",
    "Plan",
    "PlacementError",
    "cpu_memory",
    "empty_model",
    "load",
    "plan",
]
