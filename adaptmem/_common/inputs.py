"""A call's inputs moved to where a module computes, and what the forward wrote into them
handed back to the caller.

[Note: what a forward writes into its inputs]
An engine that moves a forward's inputs (the pager at the model's call, chunk and split
where a module computes on another device or dtype than its caller) hands the module
copies, so whatever the forward writes into them would stay in the copies: a streaming
model's state list (``state[0] = new``), an ``out`` tensor filled with ``copy_``. The
unplaced model writes into the caller's objects, so after the forward (also one that
raised) the writes are handed back:

- a moved tensor the forward wrote in place (its version counter moved) is copied back into
  the caller's tensor. A change of its shape or strides (``unsqueeze_``, ``t_``,
  ``resize_``) is made on the caller's tensor first; one the caller's tensor cannot take
  (a view that would reach past its storage, a storage that cannot grow) raises a
  ``PlacementError`` naming the argument rather than losing the write;
- a list, dict or dataclass instance the caller passed gets what the forward assigned,
  appended or deleted: new items moved back to where the caller's inputs came from, the
  caller's own items put back as they were (not copies);
- an input the forward returns (a moved tensor, a list it was given) comes back as the
  caller's object itself.

Only version counters and the identity of container items are compared, so a forward that
writes nothing costs a read per moved tensor and a look at each container passed. Writes
through ``.data`` move no version counter and are not seen. Under ``torch.inference_mode``
the copies are made outside it, as ordinary tensors: an inference tensor has no version
counter, and an ordinary one written inside inference mode still moves its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from operator import is_
from typing import Any

import torch

from .errors import PlacementError
from .tree import map_tensors

__all__ = ["MovedInputs"]

Move = Callable[[torch.Tensor], torch.Tensor]


def _unchanged(now: Any, passed: Any) -> bool:
    """Whether two sequences hold the same objects."""
    return len(now) == len(passed) and all(map(is_, now, passed))


def _versioned(move: Move) -> Move:
    """``move`` making tensors that keep a version counter: a copy made under
    ``torch.inference_mode`` is an inference tensor, which has none, so what the forward
    wrote into it could not be told (the forward, in inference mode, may still write into
    an ordinary tensor, and the write moves its counter)."""
    def plain(t: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():
            return move(t)
    return plain


class MovedInputs:
    """One call's ``args`` and ``kwargs`` with every tensor moved by ``move`` (``.args``,
    ``.kwargs``; the given objects when nothing moved), and the way back: See [Note: what a
    forward writes into its inputs]."""

    __slots__ = ("args", "kwargs", "_given", "_tensors", "_originals", "_returned",
                 "_containers")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], move: Move) -> None:
        if torch.is_inference_mode_enabled():
            move = _versioned(move)
        memo: dict[int, tuple[Any, Any]] = {}
        containers: list[Any] = []
        self._given = (args, kwargs)
        self.args = map_tensors(args, move, memo, containers)
        moved = {k: map_tensors(v, move, memo, containers) for k, v in kwargs.items()}
        self.kwargs = kwargs if all(moved[k] is v for k, v in kwargs.items()) else moved
        self._tensors: list[Any] = []
        self._originals: dict[int, torch.Tensor] = {}
        self._returned: dict[int, tuple[Any, Any]] = {}  # copied containers
        # Nothing moved: what the forward writes lands in the caller's objects already, and
        # where it computes is where the inputs are.
        self._containers = containers if memo else []
        for o, m in memo.values():
            if not isinstance(o, torch.Tensor):
                self._returned[id(m)] = (m, o)
                continue
            self._originals[id(m)] = o
            strided = m.layout is torch.strided
            self._tensors.append((o, m, m._version, m.stride() if strided else None,
                                  m.storage_offset() if strided else 0))

    @property
    def moved(self) -> bool:
        """Whether anything was replaced."""
        return self.args is not self._given[0] or self.kwargs is not self._given[1]

    def hand_back(self, output: Any, back: Move | None,
                  memo: dict[int, tuple[Any, Any]] | None = None) -> Any:
        """``output`` with its tensors moved by ``back`` (kept where they are for None); a
        moved input in it comes back as the caller's own object. Calls sharing ``memo``
        hand one tensor back once."""
        originals = self._originals

        def home(t: torch.Tensor) -> torch.Tensor:
            t = originals.get(id(t), t)
            return t if back is None else back(t)

        return map_tensors(output, home, dict(self._returned) if memo is None else memo)

    def write_back(self, back: Move | None) -> None:
        """Hand back what the forward wrote into its inputs: tensors written in place, then
        items put into lists, dicts and dataclass instances (moved by ``back``)."""
        for orig, moved, version, stride, offset in self._tensors:
            if moved._version != version:
                self._copy_back(orig, moved, stride, offset)
        done: set[int] = set()
        memo = dict(self._returned)  # one tensor put in two places comes back as one
        for orig, passed, after, before in self._containers:
            if id(orig) not in done:  # a container met twice is one
                done.add(id(orig))
                self._fill_back(orig, passed, after, before, (back, memo))

    # -- tensors ---------------------------------------------------------------------------

    def _copy_back(self, orig: torch.Tensor, moved: torch.Tensor,
                   stride: tuple[int, ...] | None, offset: int) -> None:
        if stride is not None and (moved.shape != orig.shape or moved.stride() != stride
                                   or moved.storage_offset() != offset):
            self._follow_geometry(orig, moved, stride, offset)
        orig.copy_(moved)

    def _follow_geometry(self, orig: torch.Tensor, moved: torch.Tensor,
                         stride: tuple[int, ...], offset: int) -> None:
        """Give the caller's tensor the shape and strides the forward gave its copy, as the
        forward would have given them to it."""
        try:
            if orig.stride() != stride:  # laid out otherwise than its copy: nothing maps
                raise RuntimeError(f"the caller's tensor has strides {tuple(orig.stride())}, "
                                   f"its copy had {stride}")
            if moved.is_contiguous() and moved.storage_offset() == offset:
                orig.resize_(moved.shape)  # grows its storage where needed, as resize_ does
            else:
                orig.as_strided_(moved.shape, moved.stride(),
                                 orig.storage_offset() + moved.storage_offset() - offset)
        except RuntimeError as exc:
            raise PlacementError(
                f"the forward changed the shape or strides of {self._name(orig)} (from "
                f"{tuple(orig.shape)} to {tuple(moved.shape)}, strides {tuple(moved.stride())}) "
                f"in the copy adaptmem moved to {moved.device} ({moved.dtype}), and the "
                f"caller's tensor on {orig.device} cannot follow ({exc}); pass it there "
                f"already, or let the forward return the new tensor instead of changing its "
                f"argument"
            ) from exc

    def _name(self, target: torch.Tensor) -> str:
        """Where ``target`` is among the call's arguments, as code would write it."""
        args, kwargs = self._given
        for name, obj in (*((f"args[{i}]", a) for i, a in enumerate(args)),
                          *((f"the argument {k!r}", v) for k, v in kwargs.items())):
            for path in _paths(obj, target, name):
                return path
        return "an argument"

    # -- containers ------------------------------------------------------------------------

    def _fill_back(self, orig: Any, passed: Any, after: Any, before: Any,
                   back: tuple[Move | None, dict[int, tuple[Any, Any]]]) -> None:
        """Put what the forward placed in ``passed`` (the list, dict or dataclass instance it
        got, ``orig`` or a copy of it) into the caller's ``orig``."""
        if isinstance(passed, list):
            if _unchanged(passed, after):
                return
            now = tuple(passed)
            items = self._items_back(now, after, before, back)
            if passed is not orig or not _unchanged(items, now):
                orig[:] = items
        elif isinstance(passed, dict):
            if _unchanged(passed.values(), after.values()) and tuple(passed) == tuple(after):
                return
            keys = tuple(passed)
            values = self._items_back(tuple(passed.values()), tuple(after.values()),
                                      tuple(before.values()), back)
            new = dict(zip(keys, values, strict=True))
            if keys != tuple(orig):
                orig.clear()
            for k, v in new.items():
                if k not in orig or orig[k] is not v:
                    orig[k] = v
        else:
            names = [f.name for f in dataclasses.fields(passed)]
            now = tuple(getattr(passed, n) for n in names)
            if _unchanged(now, after):
                return
            for name, value in zip(names, self._items_back(now, after, before, back),
                                   strict=True):
                if getattr(orig, name) is not value:
                    object.__setattr__(orig, name, value)  # frozen ones too

    def _items_back(self, now: tuple[Any, ...], after: tuple[Any, ...],
                    before: tuple[Any, ...],
                    back: tuple[Move | None, dict[int, tuple[Any, Any]]]) -> list[Any]:
        """The items ``now`` as the caller gets them: its own where they were passed on,
        what the forward put there handed back (by ``back``'s function, sharing its memo)."""
        own = {id(a): b for a, b in zip(after, before, strict=True)}
        return [own[id(x)] if id(x) in own else self.hand_back(x, *back) for x in now]


def _paths(obj: Any, target: torch.Tensor, path: str) -> Iterator[str]:
    """The paths under which ``target`` appears in nested ``obj``."""
    if obj is target:
        yield path
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from _paths(x, target, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from _paths(x, target, f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _paths(getattr(obj, f.name), target, f"{path}.{f.name}")
