"""The pager's forward hooks and its call stack.

Each module gets one pre-hook and one post-hook (``with_kwargs=True``; the post-hook with
``always_call=True``, so it runs when the forward raises). The call stack holds a ``Frame``
per module running now, with the slots its pre-hook acquired and its post-hook releases; a
call that finds the stack empty is an outermost call, of the model or of a submodule on its
own.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from .._common.errors import PlacementError
from .._engines.base import HookSet, RootHook
from .._engines.hoststore import Slot

__all__ = ["CallStack", "Frame", "Hooks"]


class Frame:
    """A module running now, and the slots it holds."""

    __slots__ = ("module", "slots")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots: Sequence[Slot] = ()


class CallStack(list[Frame]):
    """The frames of the modules running now, and the thread running them: a paged model
    runs one forward at a time. A second thread's forward would release the first one's
    weights while it computes (on a GPU: kernels reading memory handed to other copies),
    so it is refused. The stack is the thread's from its outermost call's first hook to
    that call's last (``let_go``), taken under a lock: two threads that both found it free
    cannot both run. ``modules``: the model's, to tell a thread still in a forward from one
    whose forward was cut short (a ``KeyboardInterrupt`` or ``SystemExit`` skips the hooks
    that end it)."""

    __slots__ = ("thread", "_lock", "_modules")

    def __init__(self, modules: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.thread = 0  # the thread whose outermost call runs now; 0: none
        self._lock = threading.Lock()
        self._modules: Mapping[str, nn.Module] = {} if modules is None else modules

    def claim(self) -> None:
        """A hook runs on this thread: the stack is the thread's if it is free, or if the
        thread holding it is no longer in a forward of the model (its forward was cut
        short: the next outermost call clears its frames). Raises ``PlacementError`` while
        another thread runs a forward."""
        me = threading.get_ident()
        if self.thread == me:
            return
        with self._lock:
            if self._take(me):
                raise PlacementError(
                    f"adaptive.page: another thread is running a forward of this paged model "
                    f"(thread {self.thread}); a paged model runs one forward at a time, since "
                    f"each forward moves its weights. Hold a lock around the model's calls, "
                    f"or page one copy of the model per thread")

    def mine(self) -> bool:
        """Whether the stack is this thread's. A post-hook runs after its pre-hook raised
        (``always_call``): a call ``claim`` refused must not end the owner's forward (pop
        its frames, release its weights, take its inputs)."""
        return self.thread == threading.get_ident()

    def let_go(self, result: Any = None) -> Any:
        """The outermost call's last hook has run (its outputs handed back): another
        thread's call may begin. Returns ``result``. A hook that raised before this leaves
        the stack to a thread no longer in a forward, which the next claim takes over."""
        if not self and self.mine():
            self.thread = 0
        return result

    def claim_idle(self, what: str) -> None:
        """Take the stack for ``what`` (``remove()``), so that no forward starts meanwhile;
        ``PlacementError`` if a forward of the model runs now, in any thread: ``what``
        would take its weights from under it."""
        me = threading.get_ident()
        with self._lock:
            owner = self.thread
            if self._take(me):
                where = ("this thread, inside the forward (a hook?)"
                         if owner == me else f"thread {owner}")
                raise PlacementError(
                    f"adaptive.page: {what} while a forward of the paged model runs in "
                    f"{where}; it would take the weights from under that forward. Call it "
                    f"once the forward has returned (hold the lock your threads call the "
                    f"model under)")

    def _take(self, me: int) -> bool:
        """Take the stack for thread ``me`` (under the lock), unless its owner is in a
        forward (``me`` too, for ``claim_idle``): then the owner keeps it, and True. The
        stack stays the owner's while it is looked for: marked ``me``'s meanwhile, the
        owner's own hooks would take it for another thread's (its next pre-hook refused, its
        post-hooks skipped). An owner whose forward was cut short that calls again in that
        moment takes the fast path and runs beside ``me``: a window of a few microseconds,
        after a ``KeyboardInterrupt``, that a lock on every hook would close at a cost to
        every forward."""
        owner = self.thread
        if owner and self._in_forward(owner):
            return True
        self.thread = me
        return False

    def _in_forward(self, thread: int) -> bool:
        """Whether ``thread`` is inside a call of one of the model's modules now."""
        frame = sys._current_frames().get(thread)
        ids = {id(m) for m in self._modules.values()}
        while frame is not None:
            if frame.f_code is _CALL_IMPL and id(frame.f_locals.get("self")) in ids:
                return True
            frame = frame.f_back
        return False


_CALL_IMPL = nn.Module._call_impl.__code__


class Hooks:
    """One ``pre``/``post`` hook pair per module, added at most once. On ``root``, ``post``
    runs before the forward hooks the model had: they see the outputs handed back, as
    without a pager; both are ``RootHook`` objects there (a shallow copy of the model runs
    as the model)."""

    __slots__ = ("pre", "post", "installed", "root")

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any],
                 root: nn.Module | None = None) -> None:
        self.pre = pre
        self.post = post
        self.installed = HookSet()
        self.root = root

    def add(self, module: nn.Module) -> None:
        """Hook ``module``, unless it is hooked already."""
        if module in self.installed:
            return
        root = module is self.root
        pre, post = ((RootHook(self.pre, module), RootHook(self.post, module)) if root
                     else (self.pre, self.post))
        self.installed.add(
            module,
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True,
                                         prepend=root))

    def remove(self, module: nn.Module) -> None:
        """Unhook ``module``, if it is hooked."""
        self.installed.remove(module)

    def keep_needed(self, modules: Iterable[nn.Module], needed: Container[int],
                    seen: Container[int]) -> None:
        """Unhook the modules a learned forward called (ids in ``seen``) that need no hooks
        (ids not in ``needed``), but the root."""
        for m in modules:
            if id(m) in seen and id(m) not in needed and m is not self.root:
                self.remove(m)

    def __contains__(self, module: nn.Module) -> bool:
        return module in self.installed

    def clear(self) -> None:
        """Unhook every module."""
        self.installed.clear()
