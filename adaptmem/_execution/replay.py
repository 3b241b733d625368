"""What a retried call passes again: the same arguments, which the failed attempt may have
used up or changed.

[Note: arguments a retry passes again] A retry calls the function again with the very
arguments of the failed attempt (``batch``'s call at a smaller size, or ``range`` and
``chunked``'s failed step over a shorter span: their steps share the arguments after the
bounds, and a step that succeeds may consume or write them as it likes; only what the
failed step did is looked at). An iterator among them (a generator, ``iter(...)``) was
partly consumed by that attempt, so the retry would see only what is left and return a wrong
result without any error: it is refused, saying to pass a list or a tensor instead. So is
one held inside an argument (``{"stream": gen}``, ``[gen]``, an object's attribute): the
check walks the containers, dataclasses and plain objects among the arguments, a few
levels deep, skipping modules and tensors (it runs only before a retry). Files
(``io`` objects, ``sys.stdout``) are iterators too, but a function is given one to write a
log or results into far more often than to read it, so they pass. A tensor
argument the failed attempt changed in place (``x.div_(255)``) is seen changed by the retry:
that is right for an output buffer the function fills, wrong for an input it reads after
changing it, and nothing here can tell which, so it is logged once per function as a
warning, naming the argument. Only tensors given to the call are looked at for that (not
tensors they hold), and only their versions are read on the success path, a few hundred
nanoseconds.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Replay", "StepReplay", "versions"]

logger = logging.getLogger("adaptmem")


def _named(args: tuple[Any, ...], kwargs: dict[str, Any], first: int
           ) -> Iterator[tuple[str, Any]]:
    for i, a in enumerate(args, first):
        yield f"argument {i}", a
    for k, v in kwargs.items():
        yield f"argument {k!r}", v


_DEPTH, _BUDGET = 4, 10_000  # how deep and how many objects the retry's check walks
# Endless iterators an object holds as a counter (``self.ids = itertools.count()``): reading
# from one is not reading items a retry would miss.
_COUNTERS = (itertools.count, itertools.cycle, itertools.repeat)
_OPAQUE = (torch.Tensor, nn.Module, str, bytes, bytearray, memoryview, type, io.IOBase,
           types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _iterator_in(value: Any, where: str) -> tuple[str, Iterator[Any]] | None:
    """The first iterator (not a file) in ``value`` or in what it holds (containers,
    dataclasses, plain objects' public attributes: a private one is the object's own state,
    a DataLoader's ``_iterator``; ``_DEPTH`` levels, ``_BUDGET`` objects), with where it
    is: ``argument 1['stream']``, ``argument 2.reader``."""
    seen: set[int] = set()
    todo = [(value, where, 0)]
    visited = 0
    while todo and visited < _BUDGET:
        obj, path, depth = todo.pop()
        visited += 1
        if isinstance(obj, _OPAQUE) or obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Iterator):
            if depth and isinstance(obj, _COUNTERS):  # held as a counter: nothing to miss
                continue
            return path, obj
        if depth == _DEPTH:
            continue
        items: Any
        if isinstance(obj, Mapping):
            items = ((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
        elif dataclasses.is_dataclass(obj):
            items = ((f"{path}.{f.name}", getattr(obj, f.name, None))
                     for f in dataclasses.fields(obj))
        else:
            try:
                attributes = vars(obj)
            except TypeError:  # no __dict__ (numbers, C objects)
                continue
            items = ((f"{path}.{k}", v) for k, v in attributes.items() if k[:1] != "_")
        todo.extend((v, p, depth + 1) for p, v in reversed(list(itertools.islice(items, _BUDGET))))
    return None


def _version_or_none(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None] | None:
    """The version of each tensor argument, None for the others; None when there is no
    tensor argument (the success path reads this before every call: kept lean)."""
    out: list[int | None] | None = None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if out is None:
                out = [None for _ in range(len(args) + len(kwargs))]
            out[i] = _version_or_none(a)
    if kwargs:
        for i, v in enumerate(kwargs.values(), len(args)):
            if isinstance(v, torch.Tensor):
                if out is None:
                    out = [None for _ in range(len(args) + len(kwargs))]
                out[i] = _version_or_none(v)
    return out


class Replay:
    """One batch call's arguments, checked before each retry passes them again (see
    [Note: arguments a retry passes again])."""

    __slots__ = ("owner", "name", "args", "kwargs", "versions", "first")

    def __init__(self, owner: Any, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any], before: list[int | None] | None,
                 first: int = 1) -> None:
        self.owner = owner  # its ``replay_warned`` says whether the warning was logged
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.versions = before  # ``versions(args, kwargs)`` before the first attempt
        self.first = first  # the caller's position of ``args[0]``, counted from 1

    def retrying(self, size: int, again: str | None = None) -> None:
        """About to call again at ``size`` after an out-of-memory error (``again`` says how,
        when not "with batchsize=size")."""
        again = again or f"with batchsize={size}"
        named = list(_named(self.args, self.kwargs, self.first))
        for where, value in named:
            found = _iterator_in(value, where)
            if found is not None:
                raise TypeError(
                    f"{self.name} ran out of memory and must be called again {again}, "
                    f"but its {found[0]} is an iterator "
                    f"({type(found[1]).__name__}) that the failed attempt may have consumed "
                    f"in part, so a retry would silently miss items. Pass a list, a tuple or "
                    f"a tensor instead (list(...) of the iterator)"
                )
        if self.versions is None or self.owner.replay_warned:
            return
        for (where, value), before in zip(named, self.versions, strict=True):
            if before is not None and _version_or_none(value) != before:
                self.owner.replay_warned = True
                logger.warning(
                    "%s changed its %s in place in an attempt that ran out of memory; the "
                    "retry %s sees the changed values. If the function reads what it "
                    "changed (an input normalised in place), clone it first inside the "
                    "function; an output buffer it fills is fine. (Logged once.)",
                    self.name, where, again)
                return

    def wrap(self, attempt: Callable[[int], Any], first_done: bool) -> Callable[[int], Any]:
        """``attempt`` checking the arguments before every call but the first (``first_done``:
        the first was made already)."""
        calls = [first_done]

        def again(size: int) -> Any:
            if calls[0]:
                self.retrying(size)
            calls[0] = True
            return attempt(size)

        return again


class StepReplay:
    """A ``range`` or ``chunked`` step function over one call's shared arguments: a step run
    again after the step before it failed gets them checked first, against the versions
    they had before that failed step (see [Note: arguments a retry passes again])."""

    __slots__ = ("replay", "step", "failed", "chunked", "output", "before")

    def __init__(self, replay: Replay, step: Callable[[int, int], Any],
                 chunked: torch.Tensor | None = None, output: str | None = None) -> None:
        self.replay, self.step, self.failed = replay, step, False
        # ``chunked``'s tensor, whose chunks the steps get (``output``: chunked's option)
        self.chunked, self.output = chunked, output
        self.before: tuple[int | None, int] | None = None  # its version, the step's end

    def __call__(self, start: int, end: int) -> Any:
        replay = self.replay
        if self.failed:
            replay.retrying(end - start, f"on [{start}, {end})")
            self._check_chunk(start, end)
        replay.versions = versions(replay.args, replay.kwargs)
        if self.chunked is not None:
            self.before = (_version_or_none(self.chunked), end)
        self.failed = True
        result = self.step(start, end)
        self.failed = False
        return result

    def _check_chunk(self, start: int, end: int) -> None:
        """A failed step that wrote into its chunk before running out of memory: the retry
        would see the written values (``chunk.mul_(2)`` applied twice). With ``output=None``
        the step writes into its chunk by design: logged once. With "input" or "new" it
        returns its values and must not write: refused (the input's later chunks untouched)."""
        version, failed_end = self.before or (None, end)
        if version is None or _version_or_none(self.chunked) == version:  # type: ignore[arg-type]
            return
        name = self.replay.name
        if self.output is not None:
            raise ValueError(
                f"{name} wrote into its chunk in place in a step that then ran out of memory "
                f"(the input's [{start}, {failed_end}) holds what it wrote), so running it "
                f"again on [{start}, {end}) would read the values it wrote; with "
                f"output={self.output!r} a step returns its result and does not write into "
                f"the chunk. Compute out of place (chunk * 2, not chunk.mul_(2)), or clone "
                f"the chunk first inside the step")
        owner = self.replay.owner
        if not owner.replay_warned:
            owner.replay_warned = True
            logger.warning(
                "%s wrote into its chunk in a step that ran out of memory; the retry on "
                "[%d, %d) sees the written values. Write only once the result is computed "
                "(chunk.copy_(result)), or use output='input'. (Logged once.)",
                name, start, end)
