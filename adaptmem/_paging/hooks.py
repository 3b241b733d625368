"""The pager's forward hooks and its call stack.

Each module gets one pre-hook and one post-hook (``with_kwargs=True``; the post-hook with
``always_call=True``, so it runs when the forward raises). The call stack holds a ``Frame``
per module running now, with the slots its pre-hook acquired and its post-hook releases; a
call that finds the stack empty is an outermost call, of the model or of a submodule on its
own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .._common.errors import PlacementError
from .._engines.base import HookSet
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
    so it is refused."""

    __slots__ = ("thread",)

    def __init__(self) -> None:
        super().__init__()
        self.thread = 0

    def claim(self) -> None:
        """A hook runs on this thread: the thread owns the stack if it is empty, or if the
        thread that left frames there has ended (its forward was cut short: the next
        outermost call clears them). Raises ``PlacementError`` while another live thread
        runs a forward."""
        me = threading.get_ident()
        if self and self.thread != me and any(t.ident == self.thread
                                               for t in threading.enumerate()):
            raise PlacementError(
                f"adaptive.page: another thread is running a forward of this paged model "
                f"(thread {self.thread}, in {type(self[0].module).__name__}); a paged model "
                f"runs one forward at a time, since each forward moves its weights. Hold a "
                f"lock around the model's calls, or page one copy of the model per thread")
        self.thread = me


class Hooks:
    """One ``pre``/``post`` hook pair per module, added at most once. On ``root``, ``post``
    runs before the forward hooks the model had: they see the outputs handed back, as
    without a pager."""

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
        self.installed.add(
            module,
            module.register_forward_pre_hook(self.pre, with_kwargs=True),
            module.register_forward_hook(self.post, with_kwargs=True, always_call=True,
                                         prepend=module is self.root))

    def remove(self, module: nn.Module) -> None:
        """Unhook ``module``, if it is hooked."""
        self.installed.remove(module)

    def __contains__(self, module: nn.Module) -> bool:
        return module in self.installed

    def clear(self) -> None:
        """Unhook every module."""
        self.installed.clear()
