"""How a decorated function is called and what it looks like: methods and their binding,
signatures, the arguments range and chunked take, and the messages of wrong calls."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from adaptmem import OutOfMemoryError, adaptive
from adaptmem.testing import MemoryCeiling, make_oom, raise_oom


class _Model:
    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def infer(self, batchsize: int, x: int) -> tuple[int, int]:
        """Run inference."""
        return batchsize, x


def test_a_method_read_through_an_instance_looks_like_its_function() -> None:
    bound = _Model().infer
    assert bound(3) == (8, 3)
    assert bound.__name__ == "infer" and bound.__qualname__ == "_Model.infer"
    assert bound.__doc__ == "Run inference." and inspect.getdoc(bound) == "Run inference."
    assert bound.__wrapped__ is _Model.__dict__["infer"].__wrapped__
    assert bound.prediction is None and bound.stats is _Model.infer.stats
    assert "_Model.infer" in repr(bound) and "_Model object" in repr(bound)
    assert repr(_Model.__dict__["infer"]) == "<adaptive.batch _Model.infer>"
    assert bound.__module__ == __name__ == _Model.__dict__["infer"].__module__
    assert pickle.loads(pickle.dumps(type(bound))) is type(bound)  # its class's is a str


def test_a_method_called_through_its_class_gets_its_instance_whatever_it_is_called() -> None:
    class Model:
        @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
        def infer(this, batchsize: int, x: int) -> tuple[str, int, int]:
            return type(this).__name__, batchsize, x

    model = Model()
    assert model.infer(1) == Model.infer(model, 1) == ("Model", 4, 1)
    # Set on the class after it was made: bound when read through an instance.
    late = adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)(
        lambda me, batchsize, x: (type(me).__name__, batchsize, x))
    Model.late = late  # type: ignore[attr-defined]
    assert model.late(1) == ("Model", 4, 1)  # type: ignore[attr-defined]


def test_a_function_a_class_only_names_keeps_its_direct_calls_and_signature() -> None:
    @adaptive.batch(initial_batchsize=8, cache=adaptive.NoBatchsizeCache)
    def infer(batchsize: int, data: str) -> tuple[int, str]:
        return batchsize, data

    signature = inspect.signature(infer)

    class Holder:
        fn = infer  # names it; defined elsewhere

    class Later:
        pass

    Later.fn = infer  # type: ignore[attr-defined]
    assert Holder.fn is infer and Later.fn is infer  # type: ignore[attr-defined]
    assert infer("x") == (8, "x")  # once ("x", 8): the class had made it a method
    assert inspect.signature(infer) == signature


def test_a_method_without_room_for_the_size_fails_when_its_class_is_made() -> None:
    with pytest.raises((TypeError, RuntimeError)) as error:  # RuntimeError before 3.12
        class Model:
            @adaptive.batch(initial_batchsize=4)
            def infer(self) -> None: ...

    assert "must take the injected batch size as its first parameter after the instance" in (
        f"{error.value} {error.value.__cause__}")


def test_a_plain_function_whose_first_parameter_is_self_gets_the_size_there() -> None:
    @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
    def scale(self: int, x: int) -> tuple[int, int]:  # a name, not a method
        return self, x

    assert scale(1) == (4, 1)


def test_the_signature_leaves_out_what_the_decorator_passes() -> None:
    @adaptive.batch(initial_batchsize=4)
    def infer(batchsize: int, x: int, *, scale: int = 1) -> int:
        return batchsize

    @adaptive.range(initial_step=4)
    def fill(start: int, end: int, out: list) -> None:
        out.extend(range(start, end))

    @adaptive.chunked(initial_step=4)
    def work(chunk: torch.Tensor, start: int, end: int, factor: float) -> None:
        chunk.mul_(factor)

    assert str(inspect.signature(infer)) == "(x: 'int', *, scale: 'int' = 1) -> 'int'"
    assert list(inspect.signature(fill).parameters) == ["start", "end", "out"]
    assert list(inspect.signature(work).parameters) == ["tensor", "factor"]
    inspect.signature(infer).bind(1)  # bound as it must be called
    inspect.signature(fill).bind(0, 10, [])
    inspect.signature(work).bind(torch.ones(3), 2.0)
    assert list(inspect.signature(_Model.infer).parameters) == ["self", "x"]
    assert list(inspect.signature(_Model().infer).parameters) == ["x"]


def test_the_signature_says_what_the_call_returns() -> None:
    # A chunked step returns None (it writes its chunk) or its chunk's result; the call
    # returns a tensor. A range's call returns the list of its steps' results.
    @adaptive.chunked(initial_step=4)
    def double(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk.mul_(2)

    @adaptive.range(initial_step=4)
    def span(start: int, end: int) -> int:
        return end - start

    @adaptive.range(initial_step=4)
    def bare(start, end):  # type: ignore[no-untyped-def]
        return end - start

    def ints(start: int, end: int) -> None:
        pass

    ints.__annotations__["return"] = int  # as written without postponed annotations

    assert inspect.signature(double).return_annotation is torch.Tensor
    assert inspect.signature(span).return_annotation == "list[int]"
    assert inspect.signature(bare).return_annotation is list
    assert inspect.signature(adaptive.range(initial_step=4)(ints)).return_annotation == list[int]


def test_range_takes_its_bounds_as_keywords_and_any_integer() -> None:
    @adaptive.range(initial_step=4)
    def fill(start: int, end: int, scale: int = 1) -> tuple[int, int, int]:
        return start, end, scale

    want = [(0, 4, 1), (4, 8, 1), (8, 10, 1)]
    assert fill(start=0, end=10) == fill(0, end=10) == want
    assert fill(np.int64(0), np.int64(10)) == fill(0, torch.tensor(10)) == want
    assert all(type(s) is int and type(e) is int for s, e, _ in fill(0, np.int64(10)))
    with pytest.raises(TypeError, match=r"needs the range's start and end.*fill\(0, n"):
        fill(0, scale=2)
    with pytest.raises(TypeError, match="end must be an int, got float"):
        fill(0, 10.0)


@pytest.mark.parametrize("integer", [np.int64(4), np.uint8(4), torch.tensor(4)],
                         ids=["numpy int64", "numpy uint8", "torch"])
def test_sizes_take_any_integer_with_index_as_start_and_end_do(integer: Any) -> None:
    # initial_batchsize=np.int64(64) raised TypeError while start and end took it.
    cache = adaptive.NoBatchsizeCache
    got = adaptive.batch(initial_batchsize=integer, min_batchsize=integer, cache=cache)(
        lambda batchsize: batchsize)()
    assert got == 4 and type(got) is int
    assert adaptive.explicit.batch(lambda batchsize: batchsize, integer) == 4
    spans = adaptive.range(initial_step=integer, min_step=integer, cache=cache)(
        lambda s, e: (s, e))(0, 6)
    assert spans == [(0, 4), (4, 6)]
    auto = adaptive.range(initial_step="auto", max_step=integer)(lambda s, e: e - s)
    assert auto(0, 4) == [4]
    doubled = adaptive.chunked(initial_step=integer, dimension=np.int64(-1), cache=cache)(
        lambda chunk, s, e: chunk.mul_(2))(torch.ones(2, 6))
    assert doubled.sum().item() == 24.0
    assert [len(b) for b, _ in adaptive.microbatches(integer, torch.ones(6))] == [4, 2]


@pytest.mark.parametrize("decorator", ["batch", "range", "chunked"])
def test_a_size_given_as_another_string_than_auto_says_auto(decorator: str) -> None:
    name = "initial_batchsize" if decorator == "batch" else "initial_step"
    make = getattr(adaptive, decorator)
    with pytest.raises(TypeError, match=rf"{name} must be a positive int or 'auto', got str "
                                        rf"'AUTO'; write {name}='auto' \(lower case\)"):
        make(**{name: "AUTO"})
    with pytest.raises(TypeError, match=rf"got str 'big'; write @adaptive.{decorator}\("):
        make(**{name: "big"})


@pytest.mark.parametrize("flag", [True, np.bool_(True), torch.tensor(True)],
                         ids=["bool", "numpy bool", "torch bool"])
def test_a_bool_is_not_a_size(flag: Any) -> None:
    with pytest.raises(TypeError, match="initial_batchsize must be a positive int"):
        adaptive.batch(initial_batchsize=flag)
    with pytest.raises(TypeError, match="initial_step must be a positive int"):
        adaptive.explicit.range(lambda s, e: None, 0, 4, flag)
    with pytest.raises(TypeError, match="microbatches takes the batch size first"):
        adaptive.microbatches(flag, torch.ones(3))
    with pytest.raises(TypeError, match="start must be an int"):  # torch's bool gave 1 here
        adaptive.explicit.range(lambda s, e: None, flag, 4, 2)


def test_chunked_says_the_tensor_comes_first_and_positional() -> None:
    @adaptive.chunked(initial_step=4)
    def scale(chunk: torch.Tensor, start: int, end: int) -> None:
        chunk.mul_(2)

    with pytest.raises(TypeError, match=r"tensor to chunk as its first positional argument.*"
                                        r"scale\(tensor, \.\.\.\).*keywords \['tensor'\]"):
        scale(tensor=torch.ones(3))
    with pytest.raises(ValueError, match="0-dim tensor, which has no dimension to chunk"):
        scale(torch.tensor(1.0))


def test_a_call_passing_too_much_is_told_what_each_decorator_passes_itself() -> None:
    @adaptive.batch(initial_batchsize=4)
    def infer(batchsize: int, x: torch.Tensor) -> torch.Tensor:
        return x

    @adaptive.range(initial_step=4)
    def fill(start: int, end: int, out: torch.Tensor) -> None:
        out[start:end] = 1

    @adaptive.chunked(initial_step=4)
    def work(chunk: torch.Tensor, start: int, end: int, scale: float) -> None:
        chunk.mul_(scale)

    x = torch.zeros(10)
    with pytest.raises(TypeError, match=r"infer\(\) takes 1 positional argument\(s\), but got "
                                        r"2; @adaptive.batch passes batchsize itself"):
        infer(x, 2)
    with pytest.raises(TypeError, match=r"infer\(\) got batchsize= from the caller"):
        infer(x, batchsize=2)
    # range's caller passes start and end: it must not be told to leave them out.
    with pytest.raises(TypeError, match=r"fill\(\) takes the range's start and end and 1 more "
                                        r"positional argument\(s\), but got 2 more$"):
        fill(0, 10, x, 5)
    with pytest.raises(TypeError, match=r"fill\(\) got start= as well as the range's start and "
                                        r"end .*fill\(0, n, \.\.\.\) or .*fill\(start=0, end=n"):
        fill(0, 10, x, start=3)
    with pytest.raises(TypeError, match=r"work\(\) takes the tensor to chunk and 1 more "
                                        r"positional argument\(s\), but got 2 more; "
                                        r"@adaptive.chunked passes chunk, start and end itself"):
        work(x, 2.0, 3.0)
    with pytest.raises(TypeError, match=r"work\(\) got start= from the caller.*"
                                        r"work\(tensor, \.\.\.\) without it"):
        work(x, 2.0, start=3)
    fill(0, 10, x)
    work(x, 2.0)
    assert torch.equal(x, torch.full((10,), 2.0))


def test_giving_up_at_a_smallest_size_of_one_does_not_advise_lowering_it() -> None:
    def always_oom(batchsize: int) -> None:
        raise make_oom("cpu")

    with pytest.raises(OutOfMemoryError) as one:
        adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)(always_oom)()
    assert "min_batchsize" not in str(one.value) and "Free memory" in str(one.value)
    with pytest.raises(OutOfMemoryError, match="Lower min_batchsize if smaller sizes"):
        adaptive.batch(initial_batchsize=4, min_batchsize=2,
                       cache=adaptive.NoBatchsizeCache)(always_oom)()


def test_decoration_errors_name_the_argument_that_set_the_size_and_what_is_injected() -> None:
    with pytest.raises(ValueError, match=r"min_batchsize \(8\) is larger than max_batchsize "
                                         r"\(4\); lower min_batchsize or raise max_batchsize"):
        adaptive.batch(initial_batchsize="auto", max_batchsize=4, min_batchsize=8)
    with pytest.raises(TypeError, match="must take the injected chunk, start and end"):
        adaptive.chunked(initial_step=4)(lambda chunk, start: None)
    with pytest.raises(TypeError, match="must take the injected start and end"):
        adaptive.range(initial_step=4)(lambda start: None)


def test_a_method_wrapped_without_functools_wraps_is_still_a_method() -> None:
    def timed(f: Any) -> Any:  # names its wrapper itself: timed.<locals>.wrapper
        def wrapper(self: Any, batchsize: int, x: int) -> Any:
            return f(self, batchsize, x)
        return wrapper

    class Model:
        @adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)
        @timed
        def infer(self, batchsize: int, x: int) -> tuple[str, int, int]:
            return type(self).__name__, batchsize, x

    model = Model()
    assert model.infer(1) == Model.infer(model, 1) == ("Model", 4, 1)


def test_the_call_forms_pass_every_keyword_to_the_function() -> None:
    # explicit.*'s own leading parameters are positional-only: a function parameter that
    # shares one of their names gets its keyword (it raised "multiple values for 'func'").
    assert adaptive.explicit.batch(lambda bs, func: func, 4, func=1) == 1
    assert adaptive.explicit.batch(lambda bs, initial_batchsize: initial_batchsize, 4,
                                   initial_batchsize="mine") == "mine"
    assert adaptive.explicit.range(lambda s, e, start: (s, e, start), 0, 4, 4,
                                   start="mine") == [(0, 4, "mine")]
    tensor = torch.arange(4.0)
    got = adaptive.explicit.chunked(lambda c, s, e, tensor, initial_step: c.add_(tensor),
                                    tensor, 4, tensor=1.0, initial_step=0)
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_function_naming_an_injected_parameter_elsewhere_is_refused() -> None:
    # The size went to the first parameter whatever it was called: def infer(data, batchsize)
    # got data=4 and batchsize="DATA", and no error.
    with pytest.raises(TypeError, match=r"passes the batch size as its first positional "
                                        r"parameter, but .*\(data, x, batchsize\) has "
                                        r"'batchsize' as parameter 3.*def <lambda>\(batchsize, "
                                        r"data, x\)"):
        adaptive.batch(initial_batchsize=4)(lambda data, x, batchsize: data)
    # One that would fit as a method set on a class later is refused when called without
    # an instance, and runs as a method.
    infer = adaptive.batch(initial_batchsize=4, cache=adaptive.NoBatchsizeCache)(
        lambda data, batchsize, x: (data, batchsize, x))
    with pytest.raises(TypeError, match=r"'data' would get the injected value and "
                                        r"'batchsize' a caller's argument"):
        infer("DATA", 1)
    fill = adaptive.range(initial_step=4)(lambda out, start, end: None)
    with pytest.raises(TypeError, match=r"start and end as its first two positional "
                                        r"parameters.*Put start, end first"):
        fill([0] * 10, 0, 10)

    class Model:
        run = infer

    model = Model()
    assert model.run(1) == (model, 4, 1)  # the instance is its "data"
    # Python 3.12 raises __set_name__'s error itself (with a note); before, a RuntimeError
    # whose cause it is.
    with pytest.raises((TypeError, RuntimeError)) as made:
        class Bad:
            @adaptive.batch(initial_batchsize=4)
            def infer(self, x: int, batchsize: int) -> int:
                return batchsize
    error = made.value.__cause__ or made.value
    assert isinstance(error, TypeError)
    assert "after the instance" in str(error) and "def infer(self, batchsize, x)" in str(error)


def test_the_call_forms_and_the_cache_refuse_bad_input_in_their_own_words() -> None:
    # explicit.batch(5, 4) was told to decorate (which fails), a missing size named the
    # private _explicit_batch(), and refresh_seconds="a" failed at the second call.
    with pytest.raises(TypeError, match=r"adaptive.explicit.batch calls a function now: "
                                        r"adaptive.explicit.batch\(fn, initial_batchsize"):
        adaptive.explicit.batch(5, 4)
    with pytest.raises(TypeError, match=r"^adaptive.explicit.batch\(\) missing 1 required "
                                        r"positional argument: 'initial_batchsize'"):
        adaptive.explicit.batch(lambda batchsize: batchsize)
    for bad, error in [("a", TypeError), (None, TypeError), (True, TypeError),
                       (-1, ValueError), (float("nan"), ValueError)]:
        with pytest.raises(error, match="refresh_seconds is how long"):
            adaptive.StacktraceMemoryBatchsizeCache(refresh_seconds=bad)
    with pytest.raises(TypeError, match="and no initial_batchsize was given"):
        adaptive.batch(max_batchsize=4)(lambda batchsize: batchsize)


def test_the_testing_helpers_refuse_bad_amounts_before_recording_anything() -> None:
    # MemoryCeiling(-5) and NaN were taken (NaN refused every request), require("x")
    # recorded "x" and then failed with a raw TypeError, make_oom(nbytes="2GiB") failed
    # inside a format string, and raise_oom(["cuda"]) with "unhashable type".
    for bad, error in [(-5, ValueError), (float("nan"), ValueError), ("lots", TypeError),
                       (True, TypeError)]:
        with pytest.raises(error, match="capacity must be a number of units"):
            MemoryCeiling(bad)
    ceiling = MemoryCeiling(10)
    with pytest.raises(TypeError, match=r"require\(n\) must be the units asked for"):
        ceiling.require("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="capacity must be"):
        ceiling.capacity = "lots"  # type: ignore[assignment]
    assert ceiling.attempts == [] and ceiling.capacity == 10
    with pytest.raises(TypeError, match="nbytes must be a number of bytes"):
        make_oom(nbytes="2GiB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes must be a number of bytes >= 0"):
        make_oom(nbytes=-1)
    with pytest.raises(TypeError, match=r"kind=\['cuda'\] is unknown"):
        raise_oom(["cuda"])  # type: ignore[arg-type]


def test_parameters_with_defaults_named_like_the_injected_ones_are_options() -> None:
    # The first check refused these: a batch_size option after the injected batchsize, a
    # library's batchsize=32 option, range and chunked steps with start/end options.
    def embed(batchsize: int, texts: list[str], batch_size: int | None = None) -> int:
        return batchsize

    def encode(bs: int, data: list[str], batchsize: int = 32) -> int:
        return bs

    def fill(lo: int, hi: int, data: Any, start: int = 0, end: int | None = None) -> int:
        return hi - lo

    assert adaptive.batch(initial_batchsize=4)(embed)(["a"]) == 4
    assert adaptive.batch(initial_batchsize=4)(encode)(["a"]) == 4
    assert adaptive.range(initial_step=4)(fill)(0, 8, None) == [4, 4]
