"""The public surface is chosen on purpose: a name added or lost here is an API change."""

from __future__ import annotations

import adaptmem
from adaptmem import adaptive


def test_the_top_level_exports_only_the_front_door() -> None:
    assert sorted(adaptmem.__all__) == [
        "AdaptmemError", "LoadError", "OutOfMemoryError", "PlacementError", "__version__",
        "adaptive",
    ]


def test_the_adaptive_namespace_exports_the_designed_api() -> None:
    assert sorted(adaptive.__all__) == sorted([
        "Adaptation", "AdaptmemError", "BatchsizeCache", "CallStats", "Chunker", "Decorated",
        "GlobalBatchsizeCache", "LoadError", "LoadStats", "MemoryStats", "NoBatchsizeCache",
        "OutOfMemoryError", "Pager", "PagingStats", "Plan", "PlacementError", "PlacementStats",
        "RankError",
        "SizeRecord", "Spill", "SpillStats", "Splitter",
        "StacktraceMemoryBatchsizeCache", "batch", "chunk", "chunked", "cpu_memory",
        "empty_model", "execute", "explicit", "get_default_cache", "holder", "is_oom", "load",
        "memory_stats", "microbatches", "page", "plan", "range", "set_default_cache", "spill", "split",
    ])
    for name in adaptive.__all__:
        assert getattr(adaptive, name) is not None, name


def test_the_testing_module_exports_its_test_doubles() -> None:
    import adaptmem.testing as testing

    assert sorted(testing.__all__) == sorted([
        "MemoryCeiling", "OOM_KINDS", "SimulatedCuda", "SimulatedCudaError", "StreamRaceError",
        "make_oom", "raise_oom", "simulated_cuda",
    ])
    for name in testing.__all__:
        assert getattr(testing, name) is not None, name


def test_public_functions_show_no_underscore_parameters() -> None:
    # help() and completion read these signatures; a parameter users may not pass is noise
    # there (adaptive.page showed _transfer and _check_room, chunk and split _allow_meta).
    import inspect

    for name in adaptive.__all__:
        value = getattr(adaptive, name)
        if not inspect.isfunction(value):
            continue
        hidden = [p for p in inspect.signature(value).parameters if p.startswith("_")]
        assert not hidden, f"adaptive.{name} shows {hidden}"
        assert "_transfer" not in (value.__doc__ or ""), name
        assert "_allow_meta" not in (value.__doc__ or ""), name

