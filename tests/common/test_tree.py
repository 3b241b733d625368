"""How a call's nested arguments and outputs are walked (``map_tensors``, ``tensors_in``):
the walk every engine uses to move inputs and hand outputs back."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar

import torch

from adaptmem._common.tree import map_tensors, tensors_in


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_one_tensor_met_several_times_is_mapped_once_and_stays_one_object() -> None:
    x, y = torch.ones(2), torch.zeros(2)
    calls: list[torch.Tensor] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t + 1

    out = map_tensors(((x, x), {"k": x, "v": [x, y]}), fn)
    assert len(calls) == 2
    assert out[0][0] is out[0][1] is out[1]["k"] is out[1]["v"][0]
    assert out[1]["v"][1] is not out[0][0]


def test_one_list_met_twice_is_copied_once() -> None:
    state = [torch.ones(2)]
    out = map_tensors((state, {"again": state}), _double)
    assert out[0] is out[1]["again"] and out[0] is not state


def test_what_holds_no_tensor_to_change_comes_back_as_it_was() -> None:
    args = ([1, "a"], {"k": None}, torch.ones(2))
    assert map_tensors(args, lambda t: t) is args


@dataclasses.dataclass(frozen=True)
class _Frozen:
    made: ClassVar[int] = 0
    h: torch.Tensor
    name: str = "x"

    def __post_init__(self) -> None:
        type(self).made += 1


Pair = collections.namedtuple("Pair", "a b")


def test_dataclass_instances_are_walked_and_copied_without_running_init() -> None:
    value = _Frozen(torch.ones(2), "kept")
    made = _Frozen.made
    out = map_tensors(Pair(value, [value]), _double)
    assert _Frozen.made == made
    assert type(out) is Pair and type(out.a) is _Frozen
    assert out.a is out.b[0] and out.a is not value
    assert torch.equal(out.a.h, torch.full((2,), 2.0)) and out.a.name == "kept"
    assert torch.equal(value.h, torch.ones(2))  # the original is untouched
    assert [t.tolist() for t in tensors_in(value)] == [[1.0, 1.0]]


def test_a_dataclass_type_is_not_taken_for_an_instance() -> None:
    args: Any = (_Frozen, torch.ones(1))
    out = map_tensors(args, _double)
    assert out[0] is _Frozen and list(tensors_in(args)) == [args[1]]


def test_containers_met_are_listed_with_their_items_before_and_after() -> None:
    t = torch.ones(2)
    memo: dict[int, tuple[Any, Any]] = {}
    seen: list[Any] = []
    state: list[Any] = [t, "x"]
    out = map_tensors((state,), _double, memo, seen)
    ((original, passed, after, before),) = seen
    assert original is state and passed is out[0]
    assert after[0] is out[0][0] and before[0] is t and after[1] == before[1] == "x"
    assert memo[id(t)] == (t, out[0][0]) and memo[id(state)] == (state, out[0])
