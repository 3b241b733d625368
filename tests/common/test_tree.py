"""How a call's nested arguments and outputs are walked (``map_tensors``, ``tensors_in``):
the walk every engine uses to move inputs and hand outputs back."""

from __future__ import annotations

import torch

from adaptmem._common.tree import map_tensors


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
