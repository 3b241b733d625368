"""What calling a decorated callable does: whether its body runs in the call, or later."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["hide_private_parameters", "is_lazy_function", "lazy_body"]

_F = TypeVar("_F", bound=Callable[..., Any])


def lazy_body(func: Any) -> Any:
    """The generator or async function whose body runs only after a call of ``func``
    returns (the call makes a generator or coroutine), else None. Seen through
    ``staticmethod``/``classmethod``, ``functools.partial`` and a callable object's
    ``__call__``; a wrapper that hides it shows only in what a call returns."""
    inner = getattr(func, "__func__", func)  # staticmethod, classmethod, bound method
    while isinstance(inner, functools.partial):
        inner = inner.func
    if not inspect.isroutine(inner) and callable(inner):
        inner = type(inner).__call__  # a callable object: its class's method
    return inner if is_lazy_function(inner) else None


def is_lazy_function(func: Any) -> bool:
    """Whether ``func`` itself is a generator, coroutine or async generator function (no
    unwrapping: ``lazy_body`` looks through what wraps it)."""
    return (inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func)
            or inspect.isasyncgenfunction(func))


def hide_private_parameters(func: _F) -> _F:
    """``func``, its signature (what ``inspect.signature``, ``help()`` and completion in a
    running interpreter show) without its underscore parameters: switches for adaptmem's own
    callers and tests, which users neither need nor should lean on. They still work."""
    signature = inspect.signature(func)
    func.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if not p.name.startswith("_")])
    return func

