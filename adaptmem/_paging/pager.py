"""The pager: weights live in host memory and reach the device just before they are used.

Per distinct tensor there is a slot: the Parameter or buffer object itself (identity never
changes), its host master (pinned when the target is an accelerator) and, while it is
needed, a device copy. Loading a tensor assigns ``tensor.data = copy``; releasing assigns
``tensor.data = master`` and drops the copy. Parameters are never written back; a buffer the
forward wrote in place (a cache) is.

Forward pre-hooks acquire what a module needs and post-hooks release it (reference counts,
so tied tensors and nested units are on the device once). The first forward runs with a
``TorchFunctionMode`` probe that loads any weight a module reads without calling its owner
(``MultiheadAttention`` reading ``out_proj.weight``) and records it; from then on those
needs are acquired by hooks, in an execution order used for prefetching. A module inside a
unit keeps its hooks when its subtree holds paged weights: they find them there while its
unit runs, and bring them in when it is called on its own, or from where its unit is not
running. Every
outermost call (of the model, or of a submodule on its own) is watched until a whole
forward has been learned.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._common.devices import first_tensor_device, format_bytes, free_memory, synchronize, to_device
from .._common.errors import OutOfMemoryError, Phase, PlacementError, oom_error_for
from .._common.oom import free_caches, is_oom
from .._engines.base import Engine
from .._engines.guard import PlacementGuard
from .._engines.hoststore import HOST, LOADED, PENDING, Slot, make_slots
from .._engines.stats import PagingStats
from .._engines.transfer import SyncTransfer, Transfer, transfer_for
from .._planning import Plan, module_sizes, order_units, paging_units, split_unit
from .probe import Probe

__all__ = ["Pager"]

logger = logging.getLogger("adaptmem")

class _Quiet:
    """While the pager moves weights, its probe ignores what it sees (the pager's own
    work). Other TorchFunctionModes (users', a simulated device's, ``torch.device``) keep
    seeing everything: disabling torch functions would turn them off too."""

    __slots__ = ("pager",)

    def __init__(self, pager: Pager) -> None:
        self.pager = pager

    def __enter__(self) -> None:
        self.pager._busy += 1

    def __exit__(self, *exc: object) -> None:
        self.pager._busy -= 1


class _Frame:
    """A module running now, and the slots it holds."""

    __slots__ = ("module", "slots")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots: list[Slot] | tuple[Slot, ...] = ()


class _NoRoom(Exception):
    """A fetch did not fit (budget, or an OOM that survived one retry)."""

    def __init__(self, need: int, oom: BaseException | None = None) -> None:
        super().__init__(need)
        self.need = need
        self.oom = oom


class Pager(Engine):
    """A model whose weights are paged to ``device`` module by module; see ``page``.

    While it holds the model, the model cannot be deep-copied or pickled whole, and a dtype
    or device conversion (``model.half()``, ``.to()``) makes the next call raise instead of
    running; ``remove()`` first. See [Note: a placed model is neither copied nor converted].

    Attributes:
        plan: the units in execution order, each ``"resident"`` or ``"paged"``; refinements
            made at run time are listed in ``plan.refinements``.
        stats: a ``PagingStats`` with bytes moved, transfers, prefetch hits and misses,
            refinements and the peak device bytes held for weights.
    """

    _engine, _handle = "adaptive.page", "pager"

    def __init__(self, model: nn.Module, device: torch.device, *, unit_bytes: int | None,
                 prefetch: int, resident_bytes: int | None, device_budget: int | None,
                 pin_memory: bool, output_device: torch.device | None) -> None:
        self.model = model
        self.device = device
        self.prefetch = prefetch
        self.budget = device_budget
        self.output_device = output_device
        self._stats = PagingStats()
        self._transfer: Transfer = transfer_for(device)
        self._synchronous = isinstance(self._transfer, SyncTransfer)
        self._sizes = module_sizes(model)
        self._modules = dict(model.named_modules())
        self._name_of = {id(m): n for n, m in self._modules.items()}
        self._device_bytes = 0
        self._stack: list[_Frame] = []
        self._handles: dict[int, tuple[Any, Any]] = {}
        self._needs: dict[int, tuple[Slot, ...]] = {}
        # Modules inside a unit: nothing more to do while their unit runs; called on their
        # own (or where their unit is not running), they bring in their subtree's paged
        # weights.
        self._alone: dict[int, tuple[Slot, ...]] = {}
        self._schedule: list[int] = []
        self._schedule_needs: list[tuple[Slot, ...]] = []
        self._schedule_masters: list[tuple[torch.Tensor, ...]] = []  # what each step copies
        self._cursor = 0
        self._input_device: torch.device | None = None
        self._learning = True
        self._probe: Probe | None = None
        self._calls: list[str] = []
        # What watched forwards saw, accumulated over all of them: the tensors ops received
        # while each module was the innermost one running, and the modules always running
        # around each module when it was called.
        self._direct: dict[str, set[str]] = {}
        self._enclosing: dict[str, set[str]] = {}
        self._seen_ids: set[int] = set()  # modules some watched forward called
        self._written: set[str] = set()  # paged tensors a forward wrote in place
        self._resident_bytes = 0
        self._relearn = False
        self._removed = False
        self._busy = 0  # > 0 while the pager moves weights: its probe looks away
        self._quiet = _Quiet(self)

        units = paging_units(self._sizes, unit_bytes)
        self._slots = make_slots(self._modules, self._sizes, device, pin_memory)
        self._slot_by_id = {id(s.tensor): s for s in self._slots.values()}
        self._units = units
        self._options = {
            "device": str(device), "unit_bytes": unit_bytes, "prefetch": prefetch,
            "resident_bytes": resident_bytes, "device_budget": device_budget,
        }
        self.plan = Plan("page", [], self._sizes.total_bytes, dict(self._options))
        self._guard = PlacementGuard(model, {n: s.tensor for n, s in self._slots.items()},
                                     self._engine, self._handle)
        # Nothing above touched the model; from here on it is paged, or put back on failure.
        self._hold(self._modules.values())
        try:
            for s in self._slots.values():
                if s.original is None:
                    s.tensor.data = s.master
            self._make_resident(resident_bytes)
            self._guard.expect({n: s.copy if s.resident else s.master  # type: ignore[misc]
                                for n, s in self._slots.items()})
            self._compute_needs()
            for m in self._modules.values():
                self._hook(m)
        except BaseException:
            self.remove()
            raise

    # -- set-up ---------------------------------------------------------------------------

    def _make_resident(self, resident_bytes: int | None) -> None:
        total = self._sizes.total_bytes
        if resident_bytes is None:  # "auto"
            room = self._room()
            if total <= room:
                allowance = room
            else:
                working = (self.prefetch + 2) * max((u.nbytes for u in self._units), default=0)
                allowance = max(0, room - working)
        else:
            allowance = resident_bytes
        used = 0
        placed = []
        for unit in self._units:
            slots = [self._slots[n] for n in unit.tensors]
            need = sum(s.nbytes for s in slots)
            resident = bool(slots) and used + need <= allowance
            if resident:
                try:
                    copies, ticket = self._start([s.master for s in slots])
                    self._transfer.wait([(ticket, copies)], demand=True)
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    logger.info("adaptmem page: %s did not fit on %s while making it resident "
                                "(%s); it is paged instead", unit.name, self.device, exc)
                    resident = False
                    allowance = used
            if resident:
                with self._quiet:
                    for s, c in zip(slots, copies, strict=True):
                        s.copy, s.state, s.resident = c, LOADED, True
                        s.tensor.data = c
                used += need
                self._add_device_bytes(need)
                self._resident_bytes += need
            placed.append(replace(unit, placement="resident" if resident else "paged"))
        self._units = placed
        self.plan.units = list(placed)

    def _room(self) -> int:
        if self.budget is not None:
            return self.budget
        free = free_memory(self.device)
        # Leave room for activations; on the CPU the masters share the same memory.
        return int(free * (0.5 if self.device.type == "cpu" else 0.8))

    def _compute_needs(self) -> None:
        """Which slots each module acquires, from the units and what the probe learned."""
        heads: dict[str, set[str]] = {}
        for u in self._units:
            heads.setdefault(u.module, set()).update(u.tensors, u.borrowed)
        needs: dict[int, tuple[Slot, ...]] = {}
        rank = {n: i for i, n in enumerate(self._slots)}
        for name, module in self._modules.items():
            mine = set(heads.get(name, ()))
            if not self._learning:
                extra = self._direct.get(name, set()) - mine
                for outer in self._enclosing.get(name, ()):
                    extra -= heads.get(outer, set())
                mine |= extra
            slots = [self._slots[n] for n in mine if not self._slots[n].resident]
            if slots:
                needs[id(module)] = tuple(sorted(slots, key=lambda s: rank[s.name]))
        self._needs = needs
        if not self._learning:
            self._schedule = [id(self._modules[n]) for n in self._calls
                              if id(self._modules[n]) in needs]
            self._schedule_needs = [needs[mid] for mid in self._schedule]
            self._schedule_masters = [tuple(s.master for s in step)
                                      for step in self._schedule_needs]
            self._alone = self._inside_units(needs, rank)
            for m in self._modules.values():
                if id(m) in needs:
                    self._hook(m)

    def _inside_units(self, needs: dict[int, tuple[Slot, ...]],
                      rank: dict[str, int]) -> dict[int, tuple[Slot, ...]]:
        """What each module inside a unit (below the unit's module) needs on the device when
        its unit is not running: its subtree's paged weights and its own needs, if larger
        than its own needs."""
        alone = {}
        heads = self._unit_heads()
        for name, module in self._modules.items():
            if not name or self._enclosing_unit(name, heads) is None:
                continue
            # Walked rather than looked up by name: a module registered under two names
            # is in the subtree of both.
            found = {id(s): s for m in module.modules()
                     for t in (*m._parameters.values(), *m._buffers.values())
                     if t is not None and (s := self._slot_by_id.get(id(t))) is not None
                     and not s.resident}
            mine = needs.get(id(module), ())
            found.update((id(s), s) for s in mine)
            if len(found) > len(mine):
                alone[id(module)] = tuple(sorted(found.values(), key=lambda s: rank[s.name]))
        return alone

    def _unit_heads(self) -> set[str]:
        """The modules whose whole subtree is one unit."""
        return {u.module for u in self._units if not u.own}

    @staticmethod
    def _enclosing_unit(name: str, heads: set[str]) -> str | None:
        """The module of the unit ``name`` lies inside (below it), if any."""
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            if ".".join(parts[:i]) in heads:
                return ".".join(parts[:i])
        return None

    def _hook(self, module: nn.Module) -> None:
        if id(module) in self._handles:
            return
        pre = module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        post = module.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        self._handles[id(module)] = (pre, post)

    def _name(self, module: nn.Module) -> str:
        return self._name_of.get(id(module), "")

    def _unhook_idle(self) -> None:
        # Modules the first forward never called keep their hooks (free until called): if a
        # later forward takes that path, the probe comes back for it. Modules inside a unit
        # that hold paged weights keep theirs too (in place, so user hooks keep their order),
        # for when they are called on their own or from where their unit is not running.
        seen = self._seen_ids
        drop = [mid for mid in self._handles
                if mid not in self._needs and mid not in self._alone and mid in seen]
        for mid in drop:
            if mid == id(self.model):
                continue
            for h in self._handles.pop(mid):
                h.remove()

    # -- hooks ----------------------------------------------------------------------------

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        root = module is self.model
        if root:
            args, kwargs = self._begin_forward(args, kwargs)
        elif not self._stack:  # a submodule called on its own (an encoder, say)
            self._begin_call()
        mid = id(module)
        if not self._learning:  # the steady state: keep this path short
            if mid not in self._seen_ids and self._probe is None:
                self._watch_unseen_path(self._name(module))
            frame = _Frame(module)
            self._stack.append(frame)
            needs = self._needs.get(mid)
            if needs is None:  # inside a unit, if anything
                needs = self._alone.get(mid)
                if needs is not None and len(self._stack) > 1:
                    for s in needs:
                        if s.state != LOADED:
                            break
                    else:
                        return None  # its unit is running: everything is there already
            elif self._alone and len(self._stack) == 1:  # called on its own
                needs = self._alone.get(mid, needs)
            if needs is not None:
                if self._probe is not None:
                    with self._quiet:
                        self._enter(frame, mid, needs)
                else:
                    self._enter(frame, mid, needs)
            return (args, kwargs) if root else None
        name = self._name(module)
        self._calls.append(name)
        outer = {self._name(f.module) for f in self._stack}
        seen = self._enclosing.get(name)
        self._enclosing[name] = outer if seen is None else seen & outer
        frame = _Frame(module)
        self._stack.append(frame)
        if mid in self._needs:
            with self._quiet:
                self._acquire(frame)
        return (args, kwargs) if root else None

    def _enter(self, frame: _Frame, mid: int, needs: tuple[Slot, ...]) -> None:
        """Acquire a module's weights in the steady state, then prefetch what comes next.

        The usual case is handled inline: everything the module needs was prefetched
        together, and nothing wrote to it through the parameter since (its version counter)."""
        first = needs[0]
        if first.state == PENDING:
            ticket = first.ticket
            for s in needs:
                if s.state != PENDING or s.ticket is not ticket or s.tensor._version != s.version:
                    self._acquire(frame)
                    break
            else:
                if self._synchronous:  # the copy was done before start() returned
                    self._stats.prefetch_hits += 1
                    for s in needs:
                        s.tensor.data = s.copy  # type: ignore[assignment]
                        s.state, s.ticket = LOADED, None
                        s.refs += 1
                else:
                    self._install(needs, self._transfer.wait(
                        ((ticket, [s.copy for s in needs]),), False))  # type: ignore[misc]
                    for s in needs:
                        s.refs += 1
                frame.slots = needs
        else:
            self._acquire(frame)
        if not self.prefetch:
            return
        # Start copying what the next ``prefetch`` scheduled modules need, within this
        # forward only: a copy made before the next forward could miss weights edited in
        # between (through ``.data``, which no version counter sees).
        sched = self._schedule
        n = len(sched)
        pos = self._cursor
        if pos < n and sched[pos] == mid:
            self._cursor = pos + 1
        else:
            found = self._find(mid)
            if found is None:
                return
            pos = found
        end = pos + self.prefetch + 1
        plan = self._schedule_needs
        for k in range(pos + 1, end if end < n else n):
            ahead: tuple[Slot, ...] | list[Slot] = plan[k]
            masters: tuple[torch.Tensor, ...] | None = self._schedule_masters[k]
            for s in ahead:  # usually all of it is on the host
                if s.state != HOST:
                    ahead = [s for s in ahead if s.state == HOST]
                    masters = None
                    break
            if not ahead:
                continue
            if self.budget is not None and not self._fits(sum(s.nbytes for s in ahead)):
                return
            try:
                self._fetch(ahead, masters)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                return  # prefetching is an optimisation; the demand path adapts

    def _watch_unseen_path(self, name: str) -> None:
        """A path the first forward did not take: watch the rest of this forward with the
        probe, and learn again from the next one."""
        logger.info("adaptmem page: module %r ran for the first time; watching this forward "
                    "and relearning the execution order from the next one", name or "<root>")
        self._probe = Probe(self)
        self._probe.__enter__()
        self._relearn = True

    def _post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        stack = self._stack
        if stack and stack[-1].module is module:
            slots = stack.pop().slots
            if slots:
                if self._probe is not None:
                    with self._quiet:
                        self._release(slots)
                else:
                    self._release(slots)
        if module is not self.model:
            if not stack:  # a submodule called on its own (an encoder, say) has finished
                self._end_call()
                self._end_forward(failed=True)  # only a whole forward ends the learning
            return None
        self._end_call()
        failed = output is None and sys.exc_info()[1] is not None
        self._end_forward(failed)
        if failed:
            return None
        target = self.output_device or self._input_device
        if target is not None and target != self.device:
            output = to_device(output, target)
        return output

    def _end_call(self) -> None:
        """The outermost call into the model ended: drop copies prefetched for modules it
        did not reach, so none is left to serve weights edited before the next call."""
        if self._device_bytes != self._resident_bytes:
            self._drop_pending(())
        self._guard.adopt_replacements()

    def _begin_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._begin_call()
        self._stats.forwards += 1
        self._input_device = first_tensor_device((args, kwargs))
        return to_device((args, kwargs), self.device)

    def _begin_call(self) -> None:
        """An outermost call into the model begins: of the model, or of a submodule on its
        own. Until a whole forward has been learned, every call is watched by the probe."""
        if self._removed:
            raise PlacementError("this Pager was removed; page the model again to use it")
        if self._stack or self._probe is not None:  # interrupted past the hooks (Ctrl-C)
            with self._quiet:
                while self._stack:
                    self._release(self._stack.pop().slots)
                self._drop_pending(())
            self._end_forward(failed=True)
        self._guard.check()  # See [Note: a placed model is neither copied nor converted]
        self._cursor = 0
        self._settle(block=False)
        if self._relearn:
            self._relearn, self._learning = False, True
            for m in self._modules.values():
                self._hook(m)
        if self._learning:
            self._calls = []
            self._probe = Probe(self)
            self._probe.__enter__()

    def _end_forward(self, failed: bool) -> None:
        if self._probe is None:
            return
        probe, self._probe = self._probe, None
        if torch.overrides._get_current_function_mode() is probe:
            probe.__exit__(None, None, None)
        if not self._learning:  # a probe for an unseen path; the next forward relearns
            return
        if failed:  # what it saw stays learned; the next call watches again
            return
        self._learning = False
        self._seen_ids |= {id(self._modules[n]) for n in self._calls}
        first: dict[str, None] = dict.fromkeys(self._calls)
        self._units = order_units(self._units, list(first))
        self.plan.units = list(self._units)
        self._compute_needs()
        self._unhook_idle()

    # -- acquiring and releasing -----------------------------------------------------------

    def _acquire(self, frame: _Frame) -> None:
        needs = self._needs_of(frame.module)
        missing = [s for s in needs if s.state != LOADED]
        if missing:
            needs = self._bring_in_or_refine(frame, missing, needs)
        for s in needs:
            s.refs += 1
        frame.slots = needs

    def _needs_of(self, module: nn.Module) -> tuple[Slot, ...]:
        mid = id(module)
        needs = self._needs.get(mid)
        if needs is None or len(self._stack) == 1:  # nothing of its own, or on its own
            return self._alone.get(mid, needs or ())
        return needs

    def _bring_in_or_refine(self, frame: _Frame, missing: list[Slot],
                            needs: tuple[Slot, ...]) -> tuple[Slot, ...]:
        """Bring ``missing`` in; when it does not fit, split the module's unit and retry.
        Returns the module's needs as they stand after any split."""
        while True:
            try:
                self._bring_in(missing, keep=needs)
                return needs
            except _NoRoom as exc:
                name = self._name(frame.module)
                # A module inside a unit, called where its unit is not running: split that
                # unit, which may make the module a unit of its own.
                outer = (self._enclosing_unit(name, self._unit_heads())
                         if id(frame.module) in self._alone else None)
                if not (self._refine(name, exc) or (outer is not None
                                                    and self._refine(outer, exc))):
                    self._give_up(name, missing, exc)
            needs = self._needs_of(frame.module)
            missing = [s for s in needs if s.state != LOADED]
            if not missing:
                return needs

    def _bring_in(self, missing: list[Slot], keep: tuple[Slot, ...] | list[Slot]) -> None:
        for s in missing:
            # Written in place since its copy was made (by a hook, or by an earlier module's
            # forward): the copy is stale.
            if s.state == PENDING and s.tensor._version != s.version:
                self._unload(s)
        ticket = missing[0].ticket
        if missing[0].state == PENDING:
            # The usual steady state: everything was prefetched together.
            together = True
            for s in missing:
                if s.state != PENDING or s.ticket is not ticket:
                    together = False
                    break
            if together:
                self._install(missing, self._transfer.wait(
                    [(ticket, [s.copy for s in missing])], False))  # type: ignore[misc]
                return
        absent = [s for s in missing if s.state == HOST]
        need = sum(s.nbytes for s in absent)
        if absent:
            if not self._fits(need):
                self._drop_pending(keep)
                if not self._fits(need):
                    raise _NoRoom(need)
            try:
                self._fetch(absent)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self._drop_pending(keep)
                free_caches(self.device)
                try:
                    self._fetch(absent)
                except Exception as again:
                    if not is_oom(again):
                        raise
                    free_caches(self.device)
                    raise _NoRoom(need, again) from None
        ticket = missing[0].ticket
        if all(s.ticket is ticket for s in missing):  # the usual case: one prefetch or fetch
            groups = [(ticket, [s.copy for s in missing])]
        else:
            tickets: dict[int, list[Slot]] = {}
            for s in missing:
                tickets.setdefault(id(s.ticket), []).append(s)
            groups = [(g[0].ticket, [s.copy for s in g]) for g in tickets.values()]
        self._install(missing, self._transfer.wait(groups, demand=bool(absent)))  # type: ignore[arg-type]

    def _install(self, slots: Sequence[Slot], waited: bool | None) -> None:
        """Point each slot's tensor at its device copy; count whether compute waited on it
        (a prefetch miss) or found it ready (a hit); None means neither applies."""
        if waited:
            self._stats.prefetch_misses += 1
        elif waited is not None:
            self._stats.prefetch_hits += 1
        for s in slots:
            s.tensor.data = s.copy  # type: ignore[assignment]
            s.state, s.ticket = LOADED, None

    def _fetch(self, slots: list[Slot] | tuple[Slot, ...],
               masters: tuple[torch.Tensor, ...] | None = None) -> None:
        """Start copying ``slots`` to the device (``masters``: theirs, when known)."""
        copies, ticket = self._start(masters or [s.master for s in slots])
        nbytes = 0
        for s, c in zip(slots, copies, strict=True):
            s.copy, s.ticket, s.state, s.version = c, ticket, PENDING, s.tensor._version
            nbytes += s.nbytes
        self._add_device_bytes(nbytes)
        self._stats.transfers += 1
        self._stats.bytes_moved += nbytes

    def _start(self, hosts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        if torch.is_inference_mode_enabled():
            # A copy made under inference_mode is an inference tensor, which a forward with
            # autograd on could not use; resident copies outlive the mode they were made in.
            with torch.inference_mode(False):
                return self._transfer.start(hosts)
        return self._transfer.start(hosts)

    def _fits(self, need: int) -> bool:
        return self.budget is None or self._device_bytes + need <= self.budget

    def _add_device_bytes(self, n: int) -> None:
        self._device_bytes += n
        if self._device_bytes > self._stats.peak_device_bytes:
            self._stats.peak_device_bytes = self._device_bytes

    def _unload(self, s: Slot) -> None:
        if s.state == LOADED:
            s.tensor.data = s.master
        s.copy, s.ticket, s.state = None, None, HOST
        self._device_bytes -= s.nbytes

    def _drop_pending(self, keep: Any) -> None:
        kept = {id(s) for s in keep}
        for s in self._slots.values():
            if s.state == PENDING and id(s) not in kept:
                self._unload(s)

    def _release(self, slots: tuple[Slot, ...] | list[Slot]) -> None:
        freed = 0
        for s in slots:
            s.refs -= 1
            if s.refs == 0 and not s.resident:  # _unload, inlined: this runs per unit
                if s.buffer and s.tensor._version != s.version:
                    self._write_back(s)
                s.tensor.data = s.master
                s.copy = None
                s.state = HOST
                freed += s.nbytes
        self._device_bytes -= freed

    def _write_back(self, s: Slot) -> None:
        """The forward wrote a paged tensor in place (a cache kept in a buffer): keep what
        it wrote, by copying the device copy into the host master before dropping it."""
        if s.name not in self._written:
            self._written.add(s.name)
            logger.info("adaptmem page: %r was written in place during a forward; its device "
                        "copy is copied back to the host after each use (keep it resident to "
                        "avoid that: raise resident_bytes)", s.name)
        s.master.copy_(s.copy)  # type: ignore[arg-type]

    def _find(self, mid: int) -> int | None:
        sched, n, start = self._schedule, len(self._schedule), self._cursor
        if start < n and sched[start] == mid:
            self._cursor = start + 1
            return start
        for i in range(n):
            pos = (start + i) % n
            if sched[pos] == mid:
                self._cursor = pos + 1
                return pos
        return None

    # -- the first forward's probe ---------------------------------------------------------

    def _touch(self, args: Any, kwargs: Any) -> None:
        if not self._stack:
            return
        frame = self._stack[-1]
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            s = self._slot_by_id.get(id(t))
            if s is None:
                continue
            if self._learning:
                self._direct.setdefault(self._name(frame.module), set()).add(s.name)
            if s.state != LOADED:
                with self._quiet:
                    try:
                        self._bring_in([s], keep=frame.slots)
                    except _NoRoom as exc:
                        self._give_up(self._name(frame.module), [s], exc)
                    s.refs += 1
                    frame.slots = [*frame.slots, s]

    # -- granularity fallback --------------------------------------------------------------

    def _refine(self, module: str, cause: _NoRoom) -> bool:
        for i, unit in enumerate(self._units):
            if unit.module != module or unit.own or unit.placement == "resident":
                continue
            parts = split_unit(self._sizes, unit)
            if not parts:
                return False
            parts = [replace(p, placement="paged") for p in parts]
            self._units[i:i + 1] = parts
            self.plan.units = list(self._units)
            why = "out of memory" if cause.oom is not None else "over device_budget"
            record = {"unit": unit.name, "bytes": unit.nbytes, "reason": why,
                      "into": [p.name for p in parts]}
            self.plan.refinements.append(record)
            self._stats.refinements += 1
            logger.info(
                "adaptmem page: unit %s (%s) did not fit on %s (%s; %s of weights held, "
                "%s free): split into %d units", unit.name, format_bytes(unit.nbytes),
                self.device, why, format_bytes(self._device_bytes),
                format_bytes(free_memory(self.device)), len(parts))
            self._compute_needs()
            for p in parts:
                self._hook(self._modules[p.module])
            return True
        return False

    def _give_up(self, module: str, missing: list[Slot], cause: _NoRoom) -> None:
        largest = max(missing, key=lambda s: s.nbytes)
        held = self._device_bytes
        limit = (f"device_budget={format_bytes(self.budget)}" if self.budget is not None
                 else f"{format_bytes(free_memory(self.device))} free")
        message = (
            f"adaptmem page: module {module or '<root>'!r} needs {format_bytes(cause.need)} of "
            f"weights on {self.device} at once (largest tensor {largest.name!r}, "
            f"{format_bytes(largest.nbytes)}), but with {format_bytes(held)} already held "
            f"(resident units and running parents) it does not fit under {limit}. "
            f"It cannot be split further: raise device_budget, lower resident_bytes, or free "
            f"device memory."
        )
        if cause.oom is not None:
            err = oom_error_for(cause.oom)(message)
            err.phase = Phase.TRANSFER
            raise err from cause.oom
        err = OutOfMemoryError(message)
        err.phase = Phase.TRANSFER
        raise err

    # -- public ----------------------------------------------------------------------------

    @property
    def stats(self) -> PagingStats:
        """What the pager did so far (on a GPU, reading it waits for queued copies)."""
        self._settle(block=True)
        return self._stats

    def _settle(self, block: bool) -> None:
        hits, misses = self._transfer.settle(block)
        self._stats.prefetch_hits += hits
        self._stats.prefetch_misses += misses

    def remove(self) -> None:
        """Put every parameter and buffer back on its original device and dtype, remove the
        hooks and release device memory. Unedited tensors come back bitwise; resident ones
        are copied back from the device, so edits made to them are kept. Calling it again
        does nothing."""
        if self._removed:
            return
        self._removed = True
        if not self._synchronous:  # copies in flight finish before they are read back
            synchronize(self.device)
        if self._probe is not None:
            self._end_forward(failed=True)
        for pre, post in self._handles.values():
            pre.remove()
            post.remove()
        self._handles.clear()
        with torch.inference_mode(False):  # See [Note: a placed model is neither copied ...]
            self._guard.put_back()
        self._stack.clear()
        with self._quiet, torch.inference_mode(False):
            for s in self._slots.values():
                s.restore()
        self._guard.release()
        self._device_bytes = 0
        self._let_go()

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """Where checkpoint values go, for ``adaptive.load`` on a paged model.

        Returns ``{canonical name: tensors}``: names as ``module_sizes(model).tensors`` gives
        them (the first ``named_modules()`` path plus the attribute; tie aliases are not
        repeated). Copy a checkpoint value into every listed tensor in place (``copy_``):
        the host master first, then the device copy when the tensor is resident. Call it
        outside a forward; the tensors keep their shape, dtype and device.
        """
        self._settle(block=True)
        self._drop_pending(())
        out = {}
        for name, s in self._slots.items():
            targets = [s.master]
            if s.resident and s.copy is not None:
                targets.append(s.copy)
            out[name] = targets
        return out


    def __repr__(self) -> str:
        paged = sum(u.nbytes for u in self._units if u.placement == "paged")
        return (f"Pager(device={str(self.device)!r}, units={len(self._units)}, "
                f"paged={format_bytes(paged)}, resident="
                f"{format_bytes(self._sizes.total_bytes - paged)})")
