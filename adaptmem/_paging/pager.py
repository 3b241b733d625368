"""The pager: weights live in host memory and reach the device just before they are used.

``Pager`` coordinates; each job has its own file:

- ``slots.py``: a slot per distinct tensor (host master, device copy), the device bytes
  they hold, and the one path that brings weights in and lets them go;
- ``writeback.py``: buffers the forward wrote (or may have) copied back to the host;
- ``needs.py``: which slots each module acquires when it is called;
- ``hooks.py``: the forward hooks and the call stack (pre-hooks acquire, post-hooks
  release);
- ``learner.py``: the probe that watches a forward and what it learned: weights a module
  reads without calling their owner, and the execution order;
- ``schedule.py``: the learned order, which prefetches the next units while one runs;
- ``refine.py``: a unit that does not fit when it is needed is split at run time;
- ``_engines/transfer.py``: the copies to the device (a side stream, or synchronous).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._common.devices import format_bytes, mover, synchronize, to_device
from .._common.errors import PlacementError, first_line
from .._common.inputs import MovedInputs
from .._common.oom import is_oom
from .._common.pinning import release_pinned
from .._common.reporting import report
from .._common.tree import calls_in_progress, first_tensor_device
from .._engines.base import Engine
from .._engines.guard import PlacementGuard
from .._engines.hoststore import LOADED, Slot, make_slots
from .._engines.stats import PagingStats, TraceCounts
from .._engines.transfer import Transfer, transfer_for
from .._planning import Placement, Plan, Unit, module_sizes, order_units, paging_units
from .hooks import CallStack, Frame, Hooks
from .learner import Learner, Quiet
from .needs import Needs
from .refine import Refiner
from .schedule import Schedule
from .slots import NoRoom, SlotTable, modes_on, room_for_weights

__all__ = ["Pager"]

# [Note: a model that calls itself]
# A forward may call its own model again (a recursive or two-pass model: ``x + self(x,
# depth - 1)``). That inner call is part of the outer one: it is not a new forward (not
# counted in ``stats.forwards``), its inputs and outputs stay where the outer forward
# computes, and the outer call's weights stay held. A call of the model that finds the
# stack not empty is either that, or the next call after a forward interrupted past its
# hooks (a ``KeyboardInterrupt``), whose frames are stale and released. Only the Python call
# stack tells the two apart, so it is walked then, and only then: the model is running when
# a second ``Module._call_impl`` of it is among the callers.


# [Note: a removed pager holds nothing] ``remove()`` lets go of the host masters at once (on
# an accelerator, a pinned copy of every paged weight: pinned memory is scarce), and of the
# bound methods its hooks, its probe and its guard hold, which made the pager a reference
# cycle with itself. Users keep a handle after removing it (``pager = adaptive.page(...)``
# at the top of a script), and ``model=`` replaces its pagers each time it gives residency
# back: without this the masters of a removed pager stayed until the handle was dropped,
# and then until the garbage collector's next full pass, the model's weights held twice in
# host memory meanwhile. A removed pager keeps its plan and stats, and its model. On CUDA,
# torch's host allocator keeps freed pinned blocks page-locked for reuse, so small masters'
# memory went back to that cache, not to the system: ``release_pinned`` empties the cache of
# blocks nothing uses (large masters are unregistered as they go: see [Note: pinned memory
# at its size] in ``_common/pinning.py``).


def _ignore(*args: Any) -> None:
    """What a removed pager's hooks and probe call: nothing."""


def _pack_groups(units: list[Unit]) -> list[list[str]]:
    """The tensors whose masters share a pinned buffer, one group per unit: those it owns
    that no unit borrows (see [Note: packed masters] in ``hoststore.py``)."""
    borrowed = {n for u in units for n in u.borrowed}
    return [[n for n in u.tensors if n not in borrowed] for u in units]


def _running(stack: list[Frame], frame: Frame,
             name: Callable[[nn.Module], str]) -> list[tuple[str, int]]:
    """The modules running around ``frame``, with the paged bytes each holds."""
    return [(name(f.module), sum(s.nbytes for s in f.slots if not s.resident))
            for f in stack if f is not frame]


def _hand_back(inputs: MovedInputs | None, output: Any, device: torch.device,
               home: torch.device | None, output_device: torch.device | None) -> Any:
    """The end of the model's call: what its forward wrote into the inputs goes back to the
    caller (See [Note: what a forward writes into its inputs]); the outputs (None after a
    failure) go to ``output_device``, else where the inputs came from (``home``; where the
    model was for a call without tensor inputs, as in chunk and split)."""
    if inputs is not None:
        inputs.write_back(None if home is None or home == device else mover(home))
    target = output_device or home
    if output is None or target is None or target == device:
        return None
    _warn_if_opaque(output, device, target)
    return inputs.hand_back(output, mover(target)) if inputs else to_device(output, target)


def _warn_if_opaque(output: Any, device: torch.device, target: torch.device) -> None:
    """Warn when the model returned an object of a class of its own holding tensors on
    ``device``: outputs are moved back only inside tuples, lists, dicts, namedtuples and
    dataclasses, so they would stay there unseen."""
    if isinstance(output, (torch.Tensor, tuple, list, dict)) or hasattr(
            type(output), "__dataclass_fields__"):  # (per forward: the type's attribute only)
        return
    held = [n for n, v in getattr(output, "__dict__", {}).items()
            if isinstance(v, torch.Tensor) and v.device == device]
    if held:
        name = type(output).__name__
        warnings.warn(
            f"adaptive.page: the model returned an object of class {name}, whose tensors "
            f"({', '.join(held[:3])}) stay on {device}: outputs are moved to {target} only "
            f"inside tuples, lists, dicts, namedtuples and dataclasses. Make {name} a "
            f"dataclass, or move its tensors yourself", RuntimeWarning, stacklevel=2)


def _synchronized(device: torch.device, stacklevel: int) -> BaseException | None:
    """Wait for ``device`` (copies in flight finish before they are read back); its error,
    with a warning, when it can no longer be used (a sticky CUDA error, a simulation that
    ended): the host masters are then what the model is restored from. ``stacklevel``: the
    user's frame, counted from this function's (1)."""
    try:
        synchronize(device)
    except Exception as exc:
        _warn_lost(device, exc, stacklevel=stacklevel + 1)
        return exc
    return None


def _restored(table: SlotTable, device: torch.device,
              lost: BaseException | None) -> BaseException | None:
    """Put ``table``'s tensors back (slots already restored are skipped): from ``device``
    unless it was ``lost``, or fails a copy back although it answered the synchronize (a
    simulation that ended, where a real GPU answers for its index); then the rest comes
    from the host copies, as for a device that failed the synchronize. Running out of memory
    is no sign of a lost device: it is raised, and the next ``remove()`` goes on from the
    device. Returns why the device could not be read, if it could not."""
    try:
        table.restore(from_device=lost is None)
    except RuntimeError as exc:
        if lost is not None or is_oom(exc):
            raise
        _warn_lost(device, exc, stacklevel=4)
        table.restore(from_device=False)
        return exc
    return lost


def _warn_lost(device: torch.device, exc: BaseException, stacklevel: int) -> None:
    """Say that ``remove()`` restores from the host copies, ``device`` having failed."""
    warnings.warn(
        f"adaptmem page: remove() could not reach {device} ({first_line(exc)}): the "
        f"model's tensors come back from their host copies, so edits made to resident "
        f"weights on the device since paging are lost", RuntimeWarning, stacklevel=stacklevel)


def _allowance(resident_bytes: int | None, device: torch.device, budget: int | None,
               prefetch: int, units: list[Unit], total_bytes: int) -> int:
    """The bytes of units kept resident: ``resident_bytes``, or for "auto" (None) what free
    memory allows after room for the paged working set."""
    if resident_bytes is not None:
        return resident_bytes
    room = room_for_weights(device, budget)
    working = (prefetch + 2) * max((u.nbytes for u in units), default=0)
    return room if total_bytes <= room else max(0, room - working)


class Pager(Engine):
    """A model whose weights are paged to ``device`` module by module; see ``page``.

    While it holds the model, the model cannot be deep-copied or pickled whole, and a dtype
    or device conversion (``model.half()``, ``.to()``) makes the next call raise instead of
    running; ``remove()`` first. See [Note: a placed model is neither copied nor converted].

    Attributes:
        plan: the units in execution order, each ``Placement.RESIDENT`` or
            ``Placement.PAGED`` (equal to ``"resident"`` and ``"paged"``); refinements made
            at run time are listed in ``plan.refinements``.
        stats: a ``PagingStats`` with bytes moved, transfers, prefetch hits and misses,
            refinements and the peak device bytes held for weights.

    ``transfer``: how host masters reach the device (tests pass their own).
    """

    made_by, handle_name, held_as = "adaptive.page", "pager", "paged"

    def __init__(self, model: nn.Module, device: torch.device, *, unit_bytes: int | None,
                 prefetch: int, resident_bytes: int | None, device_budget: int | None,
                 pin_memory: bool, output_device: torch.device | None,
                 transfer: Transfer | None = None) -> None:
        self.model, self.device, self.prefetch, self.budget = model, device, prefetch, device_budget
        self.output_device = output_device
        self._stats, self._sizes = PagingStats(), module_sizes(model)
        self._counts = TraceCounts(self._stats)
        self._modules = dict(model.named_modules())
        self._name_of = {id(m): n for n, m in self._modules.items()}
        self._input_device: torch.device | None = None
        self._inputs: MovedInputs | None = None  # the outermost call's, while it runs
        self._removed: bool | str = False  # "restoring": remove() was cut short
        self._stack, self._quiet = CallStack(self._modules), Quiet()  # Quiet: the probe looks away
        self._units = paging_units(self._sizes, unit_bytes)
        self.plan = Plan("page", [], self._sizes.total_bytes, {
            "device": str(device), "unit_bytes": unit_bytes, "prefetch": prefetch,
            "resident_bytes": resident_bytes, "device_budget": device_budget})
        self._table = SlotTable(make_slots(self._modules, self._sizes, device, pin_memory,
                                           _pack_groups(self._units)),
                                device, transfer if transfer is not None else transfer_for(device),
                                device_budget, self._stats)
        self._needs, self._schedule = Needs(), Schedule(prefetch, self._table)
        self._learner = Learner(self._modules, self._touch, self._quiet)
        self._refiner = Refiner(self._sizes, self.plan, self._stats, self._table, self)
        self._hooks = Hooks(self._pre_hook, self._post_hook, model)
        slots = self._table.slots
        self._home = next((s.origin for s in slots.values()), torch.device("cpu"))  # _hand_back
        self._guard = PlacementGuard(model, {n: s.tensor for n, s in slots.items()},
                                     self.made_by, self.handle_name, computes_on=self.device)
        self._guard.on_new_data = self._adopt  # `weight.data = new` between calls
        # Nothing above touched the model; from here on it is paged, or put back on failure.
        self._hold(self._modules.values(), {n: s.tensor for n, s in slots.items()})
        try:
            for s in slots.values():
                if s.original is None:
                    s.tensor.data = s.master
            self._units = self._table.keep_resident(self._units, _allowance(
                resident_bytes, self.device, self.budget, self.prefetch, self._units,
                self._sizes.total_bytes))
            self.plan.units = list(self._units)
            self._guard.expect({n: s.copy if s.resident else s.master  # type: ignore[misc]
                                for n, s in slots.items()})
            self._compute_needs()
            for m in self._modules.values():
                self._hooks.add(m)
        except BaseException:
            self.remove()
            raise
        # See [Note: one place for statistics].
        report(self, f"pager ({type(model).__name__})", self._stats)

    def _compute_needs(self) -> None:
        """What each module acquires; once a forward is learned, the prefetch schedule and
        hooks on every module that acquires something (while learning, all have them)."""
        self._needs.compute(self._units, self._modules, self._table, self._learner)
        if self._learner.learning:
            return
        needs = self._needs.by_module
        self._schedule.rebuild([id(self._modules[n]) for n in self._learner.calls], needs)
        for m in self._modules.values():
            if id(m) in needs:
                self._hooks.add(m)

    def _name(self, module: nn.Module) -> str:
        return self._name_of.get(id(module), "")

    # -- hooks ----------------------------------------------------------------------------

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        stack = self._stack
        stack.claim()  # one forward at a time: another thread's is refused
        # See [Note: a model that calls itself]
        root = module is self.model and not (
            stack and calls_in_progress(sys._getframe(1), (module,), stop_at=2) == 2)
        if root:
            self._begin_call()
            self._stats.forwards += 1
            self._input_device = first_tensor_device((args, kwargs)) or self._home
            # See [Note: what a forward writes into its inputs]
            self._inputs = inputs = MovedInputs(args, kwargs, mover(self.device))
            args, kwargs = inputs.args, inputs.kwargs
        elif not stack:  # a submodule called on its own (an encoder, say)
            self._begin_call()
        mid = id(module)
        learner = self._learner
        frame = Frame(module)
        if learner.learning:
            learner.called(self._name(module), {self._name(f.module) for f in stack})
            stack.append(frame)
            if mid in self._needs.by_module:
                with self._quiet:
                    self._acquire(frame, self._needs.for_call(mid, len(stack) == 1) or ())
            return (args, kwargs) if root else None
        if mid not in learner.seen and learner.probe is None:
            learner.watch_unseen(self._name(module))
        stack.append(frame)
        needs = self._needs.for_call(mid, len(stack) == 1)
        if needs is not None:
            if learner.probe is None:
                self._enter(frame, needs)
            else:
                with self._quiet:
                    self._enter(frame, needs)
        return (args, kwargs) if root else None

    def _enter(self, frame: Frame, needs: tuple[Slot, ...]) -> None:
        """Acquire a module's weights in the steady state, then prefetch what comes next."""
        self._acquire(frame, needs)
        if self.prefetch:
            self._schedule.prefetch_after(id(frame.module))

    def _post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        stack = self._stack
        if not stack.mine():  # a call refused at its first hook: it has nothing to end
            return None
        if stack and stack[-1].module is module:
            slots = stack.pop().slots
            if slots:
                if self._learner.probe is None:
                    self._table.release(slots)
                else:
                    with self._quiet:
                        self._table.release(slots)
        if module is not self.model or any(f.module is module for f in stack):
            # (the model called from its own forward: See [Note: a model that calls itself])
            if not stack:  # a submodule called on its own (an encoder, say) has finished
                self._end_call()
                self._end_forward(failed=True)  # only a whole forward ends the learning
                stack.let_go()
            return None
        self._end_call()
        failed = output is None and sys.exc_info()[1] is not None
        self._end_forward(failed)
        inputs, self._inputs = self._inputs, None
        return stack.let_go(_hand_back(inputs, None if failed else output, self.device,
                                       self._input_device, self.output_device))

    def _begin_call(self) -> None:
        """An outermost call (of the model, or a submodule on its own) begins; until a whole
        forward was learned, the probe watches every call."""
        if self._removed:
            raise PlacementError("this Pager was removed; page the model again to use it")
        if self._stack or self._learner.probe is not None:  # interrupted past the hooks
            with self._quiet:
                while self._stack:
                    self._table.release(self._stack.pop().slots)
                self._table.drop_pending()
            self._end_forward(failed=True)
        self._guard.check()  # See [Note: a placed model is neither copied nor converted]
        self._schedule.restart()
        self._table.modes = modes_on()  # See [Note: version reads skip torch function modes]
        self._table.settle(block=False)
        self._counts.begin()  # See [Note: a trace is not counted]
        if self._learner.begin_call():  # learning again: every module watched
            for m in self._modules.values():
                self._hooks.add(m)

    def _end_call(self) -> None:
        """The outermost call into the model ended (see ``SlotTable.end_call``)."""
        self._table.end_call()
        self._counts.end()
        self._guard.adopt_replacements()

    def _end_forward(self, failed: bool) -> None:
        order = self._learner.finish(failed)
        if order is None:
            return
        self._units = order_units(self._units, order)
        self.plan.units = list(self._units)
        self._compute_needs()
        # Modules the learned forward never called keep their hooks (free until called): a
        # later forward down that path brings the probe back. So do modules inside a unit
        # holding paged weights ([Note: modules inside a unit]; users' hooks keep order).
        self._hooks.keep_needed(self._modules.values(), self._needs.hooked(),
                                self._learner.seen)

    # -- acquiring -------------------------------------------------------------------------

    def _acquire(self, frame: Frame, needs: tuple[Slot, ...]) -> None:
        """Hold ``needs`` while ``frame`` runs; what does not fit is split first (refine.py)."""
        module = frame.module
        while True:
            try:
                if needs:
                    self._table.acquire(needs)
                frame.slots = needs
                return
            except NoRoom as cause:
                self._refiner.refine(self._units, self._name(module), id(module) in
                                     self._needs.alone, needs, cause,
                                     _running(self._stack, frame, self._name))
            self._compute_needs()  # hooks the parts' modules too
            needs = self._needs.for_call(id(module), len(self._stack) == 1) or ()

    def _touch(self, args: Any, kwargs: Any) -> None:
        """The probe saw an op: any weight among its arguments is loaded first (and, while
        learning, recorded as read by the module running)."""
        if not self._stack:
            return
        frame = self._stack[-1]
        for t in tree_leaves((args, kwargs)):
            s = self._table.by_id.get(id(t))  # (ids of live tensors: no other leaf has one)
            if s is None:
                continue
            if self._learner.learning:
                self._learner.read(self._name(frame.module), s.name)
            if s.state is not LOADED:
                with self._quiet:
                    try:
                        self._table.acquire((s,))
                    except NoRoom as exc:
                        self._refiner.give_up(self._name(frame.module), [s], exc,
                                              _running(self._stack, frame, self._name))
                    frame.slots = [*frame.slots, s]

    # -- public ----------------------------------------------------------------------------

    @property
    def stats(self) -> PagingStats:
        """What the pager did so far (on a GPU, reading it waits for queued copies)."""
        self._table.settle(block=True)
        return self._stats

    def remove(self) -> None:
        """Put every parameter and buffer back on its original device and dtype, remove the
        hooks and release device memory. Unedited tensors come back bitwise, resident ones
        from the device (edits kept). Called again: nothing, or finishes an interrupted one."""
        if self._removed is True:
            return
        if self._removed is False:  # unhooked once; a Ctrl-C past here: the next call goes on
            self._stack.claim_idle("remove()")
            self._lost, self._removed = self._unhook(), "restoring"
        elif self._lost is None and not self._table.synchronous:
            self._lost = _synchronized(self.device, 3)  # lost since the interrupted call?
        with self._quiet, torch.inference_mode(False):
            self._lost = _restored(self._table, self.device, self._lost)
        self._guard.release()
        self._let_go()
        self._table.forget()  # See [Note: a removed pager holds nothing]
        release_pinned()
        self._needs, self._schedule = Needs(), Schedule(self.prefetch, self._table)
        self._hooks, self._learner = Hooks(_ignore, _ignore), Learner({}, _ignore, self._quiet)
        self._modules, self._name_of, self._inputs = {}, {}, None
        self._removed = True

    def _unhook(self) -> BaseException | None:
        """``remove()``'s first part; returns why the device cannot be read, if it cannot."""
        lost = None if self._table.synchronous else _synchronized(self.device, 4)
        if self._learner.probe is not None:
            self._end_forward(failed=True)
        self._hooks.clear()
        with torch.inference_mode(False):  # See [Note: a placed model is neither copied ...]
            self._guard.put_back()
            with contextlib.suppress(PlacementError):  # data given since: kept (if it fits)
                self._guard.follow_new_data()
        self._stack.clear()
        return lost

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """Where checkpoint values go, for ``adaptive.load`` on a paged model.

        Returns ``{canonical name: tensors}``: names as ``module_sizes(model).tensors`` gives
        them (the first ``named_modules()`` path plus the attribute; tie aliases are not
        repeated). Copy a checkpoint value into every listed tensor in place (``copy_``):
        the host master first, then the device copy when the tensor is resident. Call it
        outside a forward; the tensors keep their shape, dtype and device.
        """
        self._guard.follow_new_data()  # data given since the last call is written into
        return self._table.load_targets()

    def _adopt(self, names: list[str]) -> None:
        """Tensors given other data between calls (found by the guard): the slots adopt it."""
        self._table.adopt(names)
        self._schedule.refresh()

    def __repr__(self) -> str:
        paged = sum(u.nbytes for u in self._units if u.placement is Placement.PAGED)
        return (f"Pager(device={str(self.device)!r}, units={len(self._units)}, "
                f"paged={format_bytes(paged)}, resident="
                f"{format_bytes(self._sizes.total_bytes - paged)})")
