"""Spilling saved activations to the next memory tier during training (``adaptive.spill``),
and the memory statistics of the whole library (``adaptive.memory_stats``).

One job per file: ``_tiers`` moves bytes (scratch file, pinned host memory, side stream),
``_hooks`` decides what to spill and when (the saved-tensor hooks, prefetching),
``_stats`` counts.
"""

from ._hooks import Spill, fixed_mmap_threshold, spill
from ._stats import MemoryStats, SpillStats, memory_stats

__all__ = ["MemoryStats", "Spill", "SpillStats", "fixed_mmap_threshold", "memory_stats",
           "spill"]
