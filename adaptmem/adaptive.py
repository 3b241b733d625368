"""The namespace users import: ``from adaptmem import adaptive``. Re-exports only."""

from . import cpu_memory
from ._cache import (
    BatchsizeCache,
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
    get_default_cache,
    set_default_cache,
)
from ._decorators import batch, chunked, execute, explicit
from ._decorators import range as range  # noqa: A004 - mirrors toma's name
from ._errors import AdaptmemError, LoadError, OutOfMemoryError, PlacementError
from ._loading import empty_model, load
from ._oom import is_oom
from ._paging import Pager, page
from ._placement import Chunker, Splitter, chunk, split
from ._placement_plan import plan
from ._planner import Plan
from ._spilling import memory_stats, spill

__all__ = [
    "AdaptmemError",
    "BatchsizeCache",
    "Chunker",
    "GlobalBatchsizeCache",
    "LoadError",
    "NoBatchsizeCache",
    "OutOfMemoryError",
    "Pager",
    "Plan",
    "PlacementError",
    "Splitter",
    "StacktraceMemoryBatchsizeCache",
    "batch",
    "chunk",
    "chunked",
    "cpu_memory",
    "empty_model",
    "execute",
    "explicit",
    "get_default_cache",
    "is_oom",
    "load",
    "memory_stats",
    "page",
    "plan",
    "range",
    "set_default_cache",
    "spill",
    "split",
]
