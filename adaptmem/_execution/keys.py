"""Which user function a size record belongs to: the key the caches get for it.

[Note: function keys] The caches key a decorated callable by the user's own function, found
through what wraps it: ``__wrapped__`` (set by ``functools.wraps``, so by
``@torch.no_grad()``, ``@torch.inference_mode()``, ``torch.autocast`` and most decorators)
and ``functools.partial``, to any depth. Keyed by the wrapper's code instead, every function
under ``@torch.inference_mode()`` shared one record. Closures of one function share its
code, so they share sizes (closures made anew at every call neither start over nor pile up
records), and no key holds the callable itself: a partial or a callable object holding a
model is not kept alive. A callable object is keyed by its class with its ``__call__``'s
code (classes that inherit one ``__call__``, every ``nn.Module``, stay apart), and a C method
bound to an object (``x.new_zeros``) by its class's method, not the object.

A key compares by identity. Code objects compare by value, and ``co_filename`` is not part
of the comparison: two functions written alike at the same line of two modules are equal,
and were one key. So each code object (and each class with its code) gets one
``FunctionKey`` of its own, the same object for as long as anything holds it: the default
cache keys a call by the key's ``id`` and keeps the keys it recorded alive, so an id is
never reused while a record is filed under it.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
from typing import Any

__all__ = ["FunctionKey", "function_key", "code_key", "unwrapped", "instance_of"]


class FunctionKey:
    """The caches' key of one user function, or of one callable class: equal only to
    itself (see [Note: function keys])."""

    __slots__ = ("code", "owner", "__weakref__")

    def __init__(self, code: Any, owner: type | None = None) -> None:
        self.code = code
        self.owner = owner  # the class of a callable object

    def __repr__(self) -> str:
        code = self.code
        name = (f"{self.owner.__qualname__}.__call__" if self.owner is not None
                else getattr(code, "co_qualname", code.co_name))
        return f"FunctionKey({name}, {code.co_filename}:{code.co_firstlineno})"


_keys: weakref.WeakValueDictionary[tuple[int, int], FunctionKey] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def code_key(code: Any, owner: type | None = None) -> FunctionKey:
    """The one key of ``code`` (with ``owner``, the class of a callable object), alive as
    long as anything holds it. Its ids cannot be reused meanwhile: the key holds both."""
    ident = (id(code), id(owner))
    key = _keys.get(ident)
    if key is None:
        with _lock:
            key = _keys.get(ident)
            if key is None:
                key = _keys[ident] = FunctionKey(code, owner)
    return key


def unwrapped(func: Any) -> Any:
    """``func`` without what wraps it: ``__wrapped__`` and ``functools.partial``, to any
    depth (a chain that loops ends where it loops)."""
    while True:
        if isinstance(func, functools.partial):
            func = func.func
            continue
        try:
            inner = inspect.unwrap(func)
        except Exception:  # __wrapped__ leads back to itself, or reading it failed
            return func
        if inner is func:
            return func
        func = inner


def function_key(func: Any) -> Any:
    """What the size caches key the decorated callable ``func`` by (see [Note: function
    keys]): a ``FunctionKey``, or ``func`` itself when it has no Python code (a builtin)."""
    func = unwrapped(func)
    code = getattr(getattr(func, "__func__", func), "__code__", None)
    if code is not None:
        return code_key(code)
    if isinstance(func, _BUILTIN_METHODS):
        # A C method bound to an object (``x.new_zeros``): keyed by the class's method, so
        # that no record holds the object (a tensor per request, kept for good).
        bound = getattr(func, "__self__", None)
        if bound is not None and not isinstance(bound, (type, types.ModuleType)):
            if func.__name__ == "__call__":  # ``f.__call__`` calls ``f``: keyed as ``f``
                return function_key(bound)
            unbound = getattr(type(bound), func.__name__, None)
            if unbound is not None:
                return unbound
        return func
    call = getattr(type(func), "__call__", None)  # noqa: B004 (the class's method)
    code = getattr(getattr(call, "__func__", call), "__code__", None)
    if code is None:
        return func
    return code_key(code, type(func))


_BUILTIN_METHODS = (types.BuiltinMethodType, types.MethodWrapperType)


def instance_of(func: Any) -> Any:
    """The instance a call of ``func`` is made through, whose records it keeps (see [Note:
    records per instance] in cache.py): a bound method's instance, a callable object
    itself; None for a function, a builtin, or a method bound to a class."""
    while True:
        while isinstance(func, functools.partial):
            func = func.func
        if inspect.ismethod(func):  # before unwrapping, which goes to the plain function
            return None if isinstance(func.__self__, type) else func.__self__
        inner = unwrapped(func)
        if inner is func:
            break
        func = inner
    if (getattr(func, "__code__", None) is not None or isinstance(func, type)
            or isinstance(func, _BUILTIN_METHODS)):
        return None
    return None if function_key(func) is func else func
