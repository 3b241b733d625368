"""Spilling saved activations to the next memory tier during training (``adaptive.spill``),
and the memory statistics of the whole library (``adaptive.memory_stats``).

One job per file: ``_spill`` is the handle, ``_hooks`` decides what to spill and when (the
saved-tensor hooks of one step, prefetching), ``_saved`` is what autograd holds for a saved
tensor, ``_limits`` says when memory is short, ``_copies`` runs the background copies,
``_tiers`` moves bytes (scratch file, pinned host memory, side stream), ``_heap`` gives
freed memory back to the system, ``_stats`` counts.
"""

from ._heap import fixed_mmap_threshold
from ._spill import Spill, spill
from ._stats import MemoryStats, SpillStats, memory_stats
from ._tiers import HostLink

__all__ = ["HostLink", "MemoryStats", "Spill", "SpillStats", "fixed_mmap_threshold",
           "memory_stats", "spill"]
