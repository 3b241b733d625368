"""Which calls share a size record: the user's function behind its wrappers, and the
instance a method is called through (see [Note: function keys] in
adaptmem/_execution/keys.py)."""

from __future__ import annotations

import functools
import importlib.util
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
