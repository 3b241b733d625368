from __future__ import annotations

import sys

import pytest
import torch

from adaptmem import OutOfMemoryError
from adaptmem._common.errors import oom_error_for
from adaptmem._common.oom import drop_frames, is_oom
from adaptmem.testing import OOM_KINDS, make_oom


@pytest.mark.parametrize("kind", sorted(OOM_KINDS))
def test_every_backend_out_of_memory_message_is_recognised(kind: str) -> None:
    assert is_oom(make_oom(kind))


def test_real_cpu_allocator_failure_is_recognised() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom(info.value)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("CUDA out of memory"),  # right words, wrong type: not from a backend
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        RuntimeError(),
        RuntimeError(42),
        KeyboardInterrupt(),
        TypeError("out of memory"),
    ],
)
def test_other_errors_are_not_out_of_memory(exc: BaseException) -> None:
    assert not is_oom(exc)


@pytest.mark.parametrize("kind", ["cuda", "python", "cpu", "cuda-driver"])
def test_adaptmem_oom_is_still_an_instance_of_the_original_type(kind: str) -> None:
    original = make_oom(kind)
    error = oom_error_for(original)("message")
    assert isinstance(error, type(original))
    assert isinstance(error, OutOfMemoryError)
    assert str(error) == "message"


@pytest.mark.parametrize("kind", sorted(OOM_KINDS))
def test_adaptmem_oom_is_recognised_whatever_the_original(kind: str) -> None:
    # adaptmem's error has its own message, so recognising it must not depend on the text.
    error = oom_error_for(make_oom(kind))("f ran out of memory at the smallest batchsize, 1")
    assert is_oom(error)


@pytest.mark.parametrize("kind", sorted(OOM_KINDS))
def test_adaptmem_oom_crosses_processes_as_the_same_kind_of_error(kind: str) -> None:
    # multiprocessing and torch.multiprocessing.spawn pickle a worker's error for the
    # parent: the made-up class pickles as its original type, with its phase.
    import pickle

    from adaptmem._common.errors import Phase

    original = make_oom(kind)
    error = oom_error_for(original)("f ran out of memory at the smallest batchsize, 1")
    error.phase = Phase.TRANSFER
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert isinstance(back, type(original)) and isinstance(back, OutOfMemoryError)
    assert str(back) == str(error) and back.phase == Phase.TRANSFER
    assert is_oom(back)


def test_a_numpy_allocation_failure_at_the_smallest_size_prints_its_message() -> None:
    np = pytest.importorskip("numpy")
    from adaptmem import adaptive

    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    def prepare(batchsize: int) -> object:
        # 2**60 bytes a row: more than any address space, so no overcommit setting lets it
        # through (2**46 did, on a host that overcommits always).
        return np.empty((batchsize, 2**60), dtype=np.uint8)  # NumPy's _ArrayMemoryError

    with pytest.raises(MemoryError) as info:
        prepare()
    assert isinstance(info.value, OutOfMemoryError)
    assert "prepare ran out of memory at the smallest batchsize, 1" in str(info.value)


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - any error, for its traceback
        return caught


def test_drop_frames_walks_cause_and_context_and_ends_on_a_cycle() -> None:
    cause, context, top = _raised(MemoryError("cause")), _raised(KeyError("ctx")), _raised(
        MemoryError("top"))
    top.__cause__, top.__context__ = cause, context
    context.__context__ = top  # a cycle: the walk must end
    cause.__cause__ = context
    drop_frames(top)
    assert [e.__traceback__ for e in (top, cause, context)] == [None, None, None]


def test_drop_frames_drops_the_frames_of_an_exception_groups_members() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("exception groups came with Python 3.11")
    member = _raised(KeyError("member"))
    group = _raised(BaseExceptionGroup("group", [member]))  # noqa: F821 - 3.11+
    top = _raised(MemoryError("top"))
    top.__context__ = group
    drop_frames(top)
    assert member.__traceback__ is None and group.__traceback__ is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11+")
def test_a_group_is_out_of_memory_and_shrinks_only_where_each_of_its_errors_does() -> None:
    from adaptmem._common.errors import Phase
    from adaptmem._common.oom import shrinks_size, transfer_errors_shrink

    compute = make_oom("cuda")
    pager = object()
    transfer = OutOfMemoryError("adaptmem page: module 'x' needs ...")
    transfer.phase, transfer.engine_id = Phase.TRANSFER, id(pager)
    group = ExceptionGroup  # noqa: F821 - Python 3.11+
    assert is_oom(group("g", [compute, make_oom("mps")]))
    assert not is_oom(group("g", [compute, ValueError("not memory")]))
    assert shrinks_size(group("g", [compute]))
    # A pager's transfer error shrinks the batch where the decorator holds that pager, in a
    # group as alone; elsewhere, neither does.
    assert not shrinks_size(transfer) and not shrinks_size(group("g", [transfer]))
    with transfer_errors_shrink(lambda: [pager]):
        assert shrinks_size(transfer) and shrinks_size(group("g", [transfer, compute]))


def test_a_memory_ceiling_shows_what_it_holds_and_what_it_refused() -> None:
    from adaptmem.testing import MemoryCeiling

    ceiling = MemoryCeiling(100, kind="cpu")
    ceiling.require(3)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        ceiling.require(300)
    assert repr(ceiling) == "<MemoryCeiling capacity=100 kind='cpu' attempts=2 failures=1>"
