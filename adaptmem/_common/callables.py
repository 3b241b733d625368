"""What calling a decorated callable does: whether its body runs in the call, or later."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ModuleOf", "hide_private_parameters", "is_lazy_function", "lazy_body"]

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


class ModuleOf(str):
    """The ``__module__`` of a decorated function's bound form (a class with ``__slots__``,
    whose own ``__module__`` would answer for every instance): read through an instance, the
    ``__module__`` of what its ``attribute`` holds, as a bound method gives its function's;
    read from the class, the class's own module (a ``str``, so pickle and ``repr`` of the
    class still read it as one)."""

    attribute: str

    def __new__(cls, module: str, attribute: str) -> ModuleOf:
        self = super().__new__(cls, module)
        self.attribute = attribute
        return self

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else getattr(obj, self.attribute).__module__

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        return str, (str(self),)  # pickling the class by reference writes its module name
