"""Which calls share a size record: the user's function behind its wrappers, and the
instance a method is called through (see [Note: function keys] in
adaptmem/_execution/keys.py)."""

from __future__ import annotations

import functools
import gc
import importlib.util
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptmem._execution.cache as cache_module
from adaptmem import adaptive
from adaptmem._execution.keys import function_key
from adaptmem.testing import MemoryCeiling


@pytest.fixture(autouse=True)
def steady_free_memory(monkeypatch) -> None:
    """Free memory as the default cache reads it, steady (other processes move the real
    reading, and a bucket that moves starts a record of its own)."""
    monkeypatch.setattr(cache_module, "free_memory", lambda device: 8 << 30)


def _own_decorator(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


WRAPPERS = {
    "no_grad": torch.no_grad(),
    "inference_mode": torch.inference_mode(),
    "autocast": torch.autocast("cpu", enabled=False),
    "functools.wraps": _own_decorator,
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("cache", ["default", "global"])
def test_functions_under_one_wrapper_keep_their_sizes_apart(wrapper: str, cache: str) -> None:
    # Keyed by the wrapper's code, every function under @torch.inference_mode() shared one
    # record: embed_text ran at embed_image's 4 for good.
    wrap = WRAPPERS[wrapper]
    chosen = (adaptive.StacktraceMemoryBatchsizeCache() if cache == "default"
              else adaptive.GlobalBatchsizeCache())
    text, image = MemoryCeiling(64), MemoryCeiling(4)

    @adaptive.batch(initial_batchsize=64, cache=chosen)
    @wrap
    def embed_text(batchsize: int) -> int:
        text.require(batchsize)
        return batchsize

    @adaptive.batch(initial_batchsize=64, cache=chosen)
    @wrap
    def embed_image(batchsize: int) -> int:
        image.require(batchsize)
        return batchsize

    sizes = [embed() for _ in range(6) for embed in (embed_text, embed_image)]
    assert sizes[0::2] == [64] * 6 and text.failures == []
    assert sizes[1] == 4 and max(sizes[1::2]) <= 5  # a probe of 5 may fail now and then


def test_a_partial_and_a_wrapper_are_keyed_by_the_function_inside() -> None:
    def light(batchsize: int, scale: int) -> int:
        return batchsize

    def heavy(batchsize: int, scale: int) -> int:
        return batchsize

    inner = functools.partial(_own_decorator(functools.partial(light, scale=1)))
    assert function_key(inner) is function_key(light)
    assert function_key(functools.partial(light, scale=2)) is function_key(light)
    assert function_key(functools.partial(heavy)) is not function_key(functools.partial(light))


@pytest.mark.simulated_cuda(total_memory="256MiB")
def test_partials_of_two_functions_keep_their_auto_decisions_apart(
        simulated_cuda_device) -> None:
    # execute.* keeps an "auto" decision per function and call site; a partial was keyed by
    # its type, so heavy reused light's decision (4096 items, where 200 fit) at one line.
    tried: list[tuple[str, int]] = []

    def light(batchsize: int) -> int:
        tried.append(("light", batchsize))
        torch.empty(batchsize, 256, device="cuda")  # 1 KiB an item
        return batchsize

    def heavy(batchsize: int) -> int:
        tried.append(("heavy", batchsize))  # traced (fake) or real
        torch.empty(batchsize, 2**18, device="cuda")  # 1 MiB an item
        return batchsize

    for fn in [light, heavy] * 2:
        adaptive.execute.batch(initial_batchsize="auto", max_batchsize=4096)(
            functools.partial(fn))
    assert max(size for name, size in tried if name == "heavy") <= 256  # 256 MiB in all
    assert [size for name, size in tried if name == "light"][-1] == 4096


_TWIN = """
def infer(batchsize, ceiling):
    ceiling.require(batchsize)
    return batchsize
"""


def _load(path: Path) -> Any:
    path.write_text(_TWIN)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cache", ["default", "global"])
def test_functions_written_alike_in_two_modules_keep_their_sizes_apart(
        tmp_path: Path, cache: str) -> None:
    # Code objects compare by value, not by file: the two were one key to a dict.
    first, second = _load(tmp_path / "first.py"), _load(tmp_path / "second.py")
    assert first.infer.__code__ == second.infer.__code__  # what made them one key
    chosen = (adaptive.StacktraceMemoryBatchsizeCache() if cache == "default"
              else adaptive.GlobalBatchsizeCache())
    small, large = MemoryCeiling(4), MemoryCeiling(64)
    infer_small = adaptive.batch(initial_batchsize=64, cache=chosen)(first.infer)
    infer_large = adaptive.batch(initial_batchsize=64, cache=chosen)(second.infer)
    sizes = [infer(ceiling) for _ in range(4)
             for infer, ceiling in ((infer_small, small), (infer_large, large))]
    assert sizes[1::2] == [64] * 4 and large.failures == []


def _cache(kind: str) -> adaptive.BatchsizeCache:
    return (adaptive.StacktraceMemoryBatchsizeCache() if kind == "default"
            else adaptive.GlobalBatchsizeCache())


@pytest.mark.parametrize("cache", ["default", "global"])
def test_each_instance_learns_its_own_sizes(cache: str) -> None:
    # One record for every instance: the large model's failures held the small one at 5.
    chosen = _cache(cache)

    class Runner:
        def __init__(self, capacity: int) -> None:
            self.ceiling = MemoryCeiling(capacity)

        @adaptive.batch(initial_batchsize=64, cache=chosen)
        def infer(self, batchsize: int, x: int) -> int:
            self.ceiling.require(batchsize)
            return batchsize

    def call(runner: Runner, through_class: bool) -> int:
        # Through the class, with the instance first: the same records (one call site).
        infer = functools.partial(Runner.infer, runner) if through_class else runner.infer
        return infer(1)  # type: ignore[no-any-return]

    small, large = Runner(40), Runner(5)
    sizes = [call(runner, i % 3 == 2) for i in range(12) for runner in (small, large)]
    assert min(sizes[-8::2]) >= 36  # small: within 10% of its 40
    assert max(sizes[1::2]) <= 5  # large
    assert len(large.ceiling.failures) == 4  # 64, 32, 16, 8: its own search, once


def test_an_instance_made_for_every_call_starts_where_the_last_one_ended() -> None:
    cache = adaptive.StacktraceMemoryBatchsizeCache()

    class Request:
        ceiling = MemoryCeiling(8)

        @adaptive.range(initial_step=64, cache=cache)
        def fill(self, start: int, end: int) -> None:
            self.ceiling.require(end - start)

    for _ in range(20):
        Request().fill(0, 100)
    assert Request.ceiling.failures == [64, 32, 16]  # the first instance's search only
    assert len(cache) <= 2  # the records of collected instances are gone


def test_an_instance_made_after_free_memory_moved_starts_where_the_last_one_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A new instance's record was seeded only from a record made in the same free-memory
    # bucket: once free memory had moved a bucket, the next instance searched from the
    # initial size again.
    cache = adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=0)
    free = {"bytes": 8 << 30}
    monkeypatch.setattr(cache_module, "free_memory", lambda device: free["bytes"])
    ceiling = MemoryCeiling(4)

    class Request:
        @adaptive.batch(initial_batchsize=512, cache=cache)
        def infer(self, batchsize: int) -> int:
            ceiling.require(batchsize)
            return batchsize

    sizes = []
    for gib in (8, 10, 6, 16, 8):  # another bucket at every call but the last
        free["bytes"] = gib << 30
        sizes.append(Request().infer())
    assert sizes == [4] * 5
    assert ceiling.failures == [512, 256, 128, 64, 32, 16, 8]  # the first instance's search


def test_the_records_of_an_instance_do_not_keep_it_alive() -> None:
    cache = adaptive.StacktraceMemoryBatchsizeCache()

    class Model:
        @adaptive.batch(initial_batchsize=8, cache=cache)
        def infer(self, batchsize: int) -> int:
            return batchsize

    model = Model()
    assert model.infer() == 8 and len(cache) == 1
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and len(cache) == 0


def test_bound_methods_and_callable_objects_keep_their_own_records() -> None:
    cache = adaptive.StacktraceMemoryBatchsizeCache()

    class Runner:
        def __init__(self, capacity: int) -> None:
            self.ceiling = MemoryCeiling(capacity)

        def infer(self, batchsize: int) -> int:
            self.ceiling.require(batchsize)
            return batchsize

        __call__ = infer

    small, large = Runner(40), Runner(5)
    decorated = {runner: adaptive.batch(initial_batchsize=64, cache=cache)(runner)
                 for runner in (small, large)}
    for _ in range(8):
        for runner in (small, large):
            adaptive.explicit.batch(runner.infer, 64)  # a bound method, decorated anew
            decorated[runner]()  # a callable object
    assert min(small.ceiling.attempts[-4:]) >= 36
    assert max(large.ceiling.attempts[-4:]) <= 5


def test_instances_that_cannot_be_weakly_referenced_share_one_record() -> None:
    cache = adaptive.GlobalBatchsizeCache()

    class Slotted:
        __slots__ = ("ceiling",)

        def __init__(self, capacity: int) -> None:
            self.ceiling = MemoryCeiling(capacity)

        @adaptive.batch(initial_batchsize=64, cache=cache)
        def infer(self, batchsize: int) -> int:
            self.ceiling.require(batchsize)
            return batchsize

    first, second = Slotted(8), Slotted(8)
    assert first.infer() == 8 and second.infer() <= 8
    assert 64 not in second.ceiling.attempts  # it went on from what the first learned


def test_a_c_method_bound_to_a_new_object_per_call_keeps_no_object_alive() -> None:
    # x.new_zeros is a C method bound to x: keyed by the callable itself, every request's
    # tensor stayed alive in the cache, with a record of its own.
    from adaptmem._execution.cache import StacktraceMemoryBatchsizeCache, shared_cache

    cache = shared_cache(StacktraceMemoryBatchsizeCache)  # what explicit.batch uses
    before = len(cache)
    alive = []
    for _ in range(20):
        x = torch.zeros(256, 256)
        alive.append(weakref.ref(x))
        assert adaptive.explicit.batch(x.new_zeros, 16).shape == (16,)
        del x
    gc.collect()
    assert not any(r() is not None for r in alive)
    assert len(cache) - before <= 1  # one call site, one record


def test_the_call_slot_of_two_callables_gives_two_keys() -> None:
    # Every partial's __call__ is the same slot of the partial class: keyed by that slot,
    # two different callables would share their sizes.
    from adaptmem._execution.keys import function_key

    assert function_key(functools.partial(print).__call__) is not function_key(
        functools.partial(sum).__call__)
    x = torch.ones(2)
    assert function_key(x.__add__) is function_key(torch.ones(3).__add__)
    assert function_key(x.__add__) is not function_key(x.__radd__)
