"""Learning what a forward reads: the probe that watches it, and what watched forwards saw.

The planner cannot see a module that reads a child's weight without calling the child
(``MultiheadAttention`` and ``out_proj``, swin's ``ShiftedWindowAttention`` and ``qkv``).
A ``Probe``, a ``TorchFunctionMode``, sees every op and hands its arguments to the pager,
which loads any weight among them before the op runs. The ``Learner`` keeps what watched
forwards saw: the order modules were called in, the tensors each module's own code read,
and the modules always running around each one. Every outermost call (of the model, or of a
submodule on its own) is watched until a whole forward has been learned; a forward that
then calls a module the learned one did not is watched from there, and the next one is
learned again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Learner", "Probe", "Quiet", "is_metadata"]

logger = logging.getLogger("adaptmem")

# Reading these from a weight does not need its values, so the probe leaves it on the host.
# Where a weight lives is not among them: see [Note: a device query is a use].
_METADATA = frozenset({
    "shape", "dtype", "is_meta", "requires_grad", "ndim", "layout", "is_sparse",
    "is_quantized", "names", "size", "dim", "numel", "nelement", "stride", "element_size",
    "itemsize", "nbytes", "is_floating_point", "is_complex", "is_contiguous", "data_ptr",
    "storage_offset", "grad_fn", "is_leaf", "_version", "__len__",
})


# [Note: a watched forward cut short inside a mode]
# A ``KeyboardInterrupt`` skips the hooks (torch runs forward hooks on ``Exception`` only),
# so the probe stays on top of torch's mode stack. When the forward ran inside a mode of the
# caller's (``with MyMode():``, ``with torch.device("cuda"):``), that mode's exit pops the
# top of the stack, the probe, in place of itself; each exit further out pops the mode of
# the one inside it, and the outermost mode exited stays there for good: every later op of
# the process would go through it. The next outermost call (or ``remove()``) finds the
# probe gone and takes off the highest mode still where the probe found it: the one left
# in the probe's place. A probe still on the stack under other modes (left there by code
# that entered a mode and never exited it) is taken out from under them. The caller's mode
# stays active until then.

# [Note: a probe stranded on another thread]
# Torch's mode stack is per thread. A watched forward cut short in one thread (a worker's
# ``KeyboardInterrupt``) leaves the probe on that thread's stack, and the next outermost
# call may come from another thread, which cannot reach that stack. It makes the probe look
# away for good instead (its ops pass straight through, and it no longer holds the pager),
# and the stranded probe is taken off when its thread next begins an outermost call of any
# paged model. Until then that thread's ops each pay one Python call.

# [Note: a device query is a use]
# ``next(self.parameters()).device`` (Hugging Face's ``self.device``) or ``other.weight.device``
# read inside a forward must name the device the forward computes on: the code builds its
# helper tensors there (``torch.arange(n, device=...)``) and mixes them with the weights'
# outputs. A paged weight at rest reports the host, so asking where a weight lives counts as
# reading it: the probe loads it on the spot, and the learned forward has the module whose
# code asked hold it for its whole call (its needs), as it would a weight read for values.
# The price is that weight's bytes on the device while the asking module runs; reading the
# input's device (``input_ids.device``) costs nothing.


def is_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA


class Quiet:
    """While entered (it nests), probes built on it look away: the pager moving weights is
    not the model reading them. Other TorchFunctionModes (users', a simulated device's,
    ``torch.device``) keep seeing everything: disabling torch functions would turn them off
    too."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


class Probe(TorchFunctionMode):
    """Watches a forward: hands the arguments of every op that reads values or asks where a
    tensor lives (not other metadata; see [Note: a device query is a use]) to ``on_op``
    before the op runs, unless ``quiet`` is entered."""

    def __init__(self, on_op: Callable[[Any, Any], None], quiet: Quiet) -> None:
        super().__init__()
        self.on_op = on_op
        self.quiet = quiet
        self.below: list[Any] = []  # torch's mode stack when the probe went on
        self.thread = 0  # the thread whose stack it went on

    def __enter__(self) -> Probe:
        self.below = torch.overrides._get_current_function_mode_stack()
        self.thread = threading.get_ident()
        return super().__enter__()

    def strand(self) -> None:
        """Look away for good: see [Note: a probe stranded on another thread]."""
        self.on_op, self.below = _ignore_op, []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.quiet.depth and not is_metadata(func):
            self.on_op(args, kwargs)
        return func(*args, **kwargs)


class Learner:
    """What watched forwards saw, accumulated over all of them, and the probe watching now.

    Attributes:
        learning: no whole forward has been learned yet (or one is being learned again).
        relearn: a module ran that the learned forward did not call; the next outermost
            call learns again.
        probe: the ``Probe`` watching the current call, if any.
        calls: the modules called so far in the forward being learned, in call order.
        seen: ids of the modules a learned forward called.
    """

    def __init__(self, modules: dict[str, nn.Module], on_op: Callable[[Any, Any], None],
                 quiet: Quiet) -> None:
        self.modules = modules
        self.on_op = on_op
        self.quiet = quiet
        self.learning = True
        self.relearn = False
        self.probe: Probe | None = None
        self.calls: list[str] = []
        self.seen: set[int] = set()
        # The tensors ops received while each module was the innermost one running, and
        # the modules always running around each module when it was called.
        self._direct: dict[str, set[str]] = {}
        self._enclosing: dict[str, set[str]] = {}

    def begin_call(self) -> bool:
        """An outermost call begins: watch it while learning. Returns True when learning
        starts again (every module needs its hooks back)."""
        again = self.relearn
        if again:
            self.relearn, self.learning = False, True
        if torch._C._len_torch_function_stack():
            _drop_stranded()
        if self.learning:
            self.calls = []
            self._watch()
        return again

    def called(self, name: str, running: set[str]) -> None:
        """Module ``name`` was called while the modules ``running`` were."""
        self.calls.append(name)
        before = self._enclosing.get(name)
        self._enclosing[name] = running if before is None else before & running

    def read(self, module: str, tensor: str) -> None:
        """An op read ``tensor`` while ``module`` was the innermost module running."""
        self._direct.setdefault(module, set()).add(tensor)

    def watch_unseen(self, name: str) -> None:
        """Module ``name`` ran for the first time since the forward was learned: watch the
        rest of this call, and learn again from the next one."""
        logger.info("adaptmem page: module %r ran for the first time; watching this forward "
                    "and relearning the execution order from the next one", name or "<root>")
        self._watch()
        self.relearn = True

    def finish(self, failed: bool) -> list[str] | None:
        """Stop watching. Returns the modules in the order the forward first called them
        when it has just been learned whole (not ``failed``), else None: what a failed
        call saw stays learned, and the next call is watched again."""
        probe, self.probe = self.probe, None
        if probe is None:
            return None
        if probe.thread != threading.get_ident():
            probe.strand()
        elif torch.overrides._get_current_function_mode() is probe:
            probe.__exit__(None, None, None)
        else:
            self._unwatch(probe)
        if not self.learning or failed:
            return None
        self.learning = False
        self.seen |= {id(self.modules[n]) for n in self.calls}
        return list(dict.fromkeys(self.calls))

    def reads(self, name: str, brought: dict[str, set[str]]) -> set[str]:
        """The tensors module ``name``'s own code read that neither it nor a module always
        running around it brings (``brought``: what each module brings)."""
        extra = self._direct.get(name, set()) - brought.get(name, set())
        for outer in self._enclosing.get(name, ()):
            extra -= brought.get(outer, set())
        return extra

    def _watch(self) -> None:
        self.probe = Probe(self.on_op, self.quiet)
        self.probe.__enter__()

    def _unwatch(self, probe: Probe) -> None:
        """Take ``probe`` off torch's mode stack when it is not on top, or the mode an exit
        left there in its place: see [Note: a watched forward cut short inside a mode]."""
        stack = torch.overrides._get_current_function_mode_stack()
        drop = next((i for i, m in enumerate(stack) if m is probe), None)
        if drop is None:
            kept = 0  # how much of the stack below the probe is still there
            for now, before in zip(stack, probe.below, strict=False):
                if now is not before:
                    break
                kept += 1
            if not kept:
                return
            drop = kept - 1
            name = type(stack[drop]).__name__
            logger.warning(
                "adaptmem page: a forward the pager watched was cut short (a "
                "KeyboardInterrupt?) inside %s, whose exit took the pager's mode off torch's "
                "mode stack in place of its own; %s is taken off now", name, name)
        above = [torch._C._pop_torch_function_stack() for _ in range(len(stack) - drop - 1)]
        torch._C._pop_torch_function_stack()
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)


def _ignore_op(args: Any, kwargs: Any) -> None:
    """What a stranded probe hands its ops to: nothing."""


def _drop_stranded() -> None:
    """Take this thread's stranded probes off torch's mode stack (see [Note: a probe
    stranded on another thread]), keeping the modes above them in order."""
    stack = torch.overrides._get_current_function_mode_stack()
    if not any(isinstance(m, Probe) and m.on_op is _ignore_op for m in stack):
        return
    popped = [torch._C._pop_torch_function_stack() for _ in stack]
    for mode in reversed(popped):
        if not (isinstance(mode, Probe) and mode.on_op is _ignore_op):
            torch._C._push_on_torch_function_stack(mode)
