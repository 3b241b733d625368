"""The namespace users import: ``from adaptmem import adaptive``. Re-exports only: the
functions, and the types they return or take, so that users can annotate with them."""

from . import cpu_memory
from ._common.claims import public_holder as holder
from ._common.errors import (
    AdaptmemError,
    LoadError,
    OutOfMemoryError,
    PlacementError,
    RankError,
)
from ._common.oom import is_oom
from ._dispatch import batch, chunked
from ._dispatch import range as range  # noqa: A004 - mirrors toma's name
from ._engines.stats import LoadStats, PagingStats, PlacementStats
from ._execution.accumulate import microbatches
from ._execution.cache import (
    BatchsizeCache,
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    SizeRecord,
    StacktraceMemoryBatchsizeCache,
    get_default_cache,
    set_default_cache,
)
from ._execution.decorated import Decorated
from ._execution.decorators import execute, explicit
from ._execution.stats import Adaptation, CallStats
from ._loading.loader import empty_model, load
from ._paging.api import Pager, page
from ._placement import Chunker, Splitter, chunk, split
from ._planning import Plan, plan
from ._spilling import MemoryStats, Spill, SpillStats, memory_stats, spill

__all__ = [
    "Adaptation",
    "AdaptmemError",
    "BatchsizeCache",
    "CallStats",
    "Chunker",
    "Decorated",
    "GlobalBatchsizeCache",
    "LoadError",
    "LoadStats",
    "MemoryStats",
    "NoBatchsizeCache",
    "OutOfMemoryError",
    "Pager",
    "PagingStats",
    "Plan",
    "PlacementError",
    "PlacementStats",
    "RankError",
    "SizeRecord",
    "Spill",
    "SpillStats",
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
    "holder",
    "is_oom",
    "load",
    "memory_stats",
    "microbatches",
    "page",
    "plan",
    "range",
    "set_default_cache",
    "spill",
    "split",
]
