"""The engine behind ``adaptive.chunk`` and ``adaptive.split``: places units of a model on
several devices (``mover.py``), converts activations at the boundaries (``boundaries.py``),
and re-places the model when its ``device_map`` is edited (``device_map.py``)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .._common.devices import format_bytes
from .._common.enums import TextEnum
from .._common.errors import PlacementError
from .._common.peak import NotYet, fake_mode
from .._common.reporting import report
from .._common.tree import calls_in_progress, canonical_tensors
from .._engines.base import Engine, HookSet, RootHook
from .._engines.guard import PlacementGuard
from .._engines.stats import PlacementStats
from .._planning import (
    Plan,
    Recording,
    Target,
    Unit,
    check_ties,
    label_for_unit,
    module_sizes,
    placed_bytes,
    plan_placement,
    record_forward,
    split_inputs,
)
from .boundaries import BoundaryHooks, module_specs
from .device_map import map_before_placement, normalise_map
from .mover import PlacedTensors

__all__ = ["Splitter", "Chunker", "Mode"]

_log = logging.getLogger("adaptmem")


class Mode(TextEnum):
    """Which engine a handle is (``plan.mode`` holds its text)."""

    SPLIT = "split"
    CHUNK = "chunk"


class Splitter(BoundaryHooks, Engine):
    """The handle ``adaptive.split`` returns: hooks, placed tensors and the kept originals.

    ``.plan`` (None until placed), ``.device_map`` (once placed, or given), ``.stats``,
    ``.remove()``; a context manager that removes itself on exit. Assigning
    ``handle.device_map = edited`` moves exactly the units whose entry changed. While it
    holds the model, the model cannot be deep-copied or pickled whole, and a dtype or device
    conversion (``model.half()``, ``.to()``) makes the next call raise; ``remove()`` first.
    See [Note: a placed model is neither copied nor converted].
    """

    _mode = Mode.SPLIT
    made_by, handle_name = "adaptive.split", "splitter"

    def __init__(
        self,
        model: nn.Module,
        targets: Sequence[Target],
        *,
        output_device: torch.device | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self._model = model
        self._targets = {t.label: t for t in targets}
        self._target_order = [t.label for t in targets]
        self._options = dict(options or {})
        self._pending_map: dict[str, str] | None = None
        self._sizes = module_sizes(model)
        tensors = canonical_tensors(model)
        self._modules = dict(model.named_modules())
        first = next(iter(tensors.values()), None)
        self._init_boundaries(
            first.device if first is not None else torch.device("cpu"),
            next((t.dtype for t in tensors.values() if t.is_floating_point()),
                 torch.get_default_dtype()),
            output_device)
        self._placed = PlacedTensors(tensors, self._targets)
        self._plan: Plan | None = None
        self._recording: Recording | None = None
        self._local = threading.local()  # .busy while recording
        self._placing = threading.Lock()
        self._hooks = HookSet()
        self.stats = PlacementStats()
        # See [Note: one place for statistics].
        report(self, f"{self.handle_name} ({type(model).__name__})", self.stats)
        places = {(t.device, t.dtype) for t in targets}
        only = next(iter(places)) if len(places) == 1 else None
        self._guard = PlacementGuard(  # one device in the model's own dtype: computes there
            model, tensors, self.made_by, self.handle_name,
            computes_on=only[0] if only is not None and only[1] is None else None)
        self._hold(self._modules.values(), tensors)
        # The root's post hook runs before forward hooks the model had: they see the outputs
        # handed back, as without a placement.
        self._hooks.add(model,  # RootHook: see its docstring
                        model.register_forward_pre_hook(RootHook(self._root_pre, model),
                                                        with_kwargs=True),
                        model.register_forward_hook(RootHook(self._root_post, model),
                                                    always_call=True, prepend=True))

    # -- public surface -------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The placement plan; None until placed (at the first call without example_inputs)."""
        return self._plan

    @property
    def device_map(self) -> dict[str, str]:
        """``{module or tensor name: device label}``, coarsest. Before the model is placed:
        the map given to ``split``/``place``.

        Raises:
            PlacementError: the model is not placed yet and no map was given (the plan
                needs one forward: pass ``example_inputs=`` to place it at once, or see the
                map in advance with ``adaptive.plan(model, devices=..., example_inputs=...)``).
        """
        if self._plan is None:
            return map_before_placement(self._pending_map, type(self).__name__, self._mode)
        return self._plan.device_map

    @device_map.setter
    def device_map(self, device_map: Mapping[str, str]) -> None:
        self.place(device_map)

    def place(self, device_map: Mapping[str, str] | None = None, *,
              example_inputs: Any = None) -> None:
        """Re-place the model as ``device_map`` says, moving only the units whose device
        changed (before the first call, the map is kept for the placement then); with
        ``example_inputs``, place a model not placed yet now, learning the execution order
        from one forward of those inputs (as ``split(..., example_inputs=)`` does).

        Raises:
            TypeError: ``device_map`` is not a mapping, or neither argument was given.
            PlacementError: the map misses a unit, splits one that must stay whole, separates
                tied tensors, or names a device the placement does not have; or
                ``example_inputs`` was given for a model placed already.
        """
        if device_map is None and example_inputs is None:
            raise TypeError("place needs a device_map ({module name: device}) or "
                            "example_inputs= (inputs of one forward)")
        if device_map is not None and not isinstance(device_map, Mapping):
            raise TypeError(f"device_map must be a dict {{module name: device}}, got "
                            f"{type(device_map).__name__}")
        self._guard.check()  # a removed handle says so first: it places nothing again
        if example_inputs is not None and self._plan is not None:
            raise PlacementError(
                f"{type(self).__name__}.place(example_inputs=...): the model is placed "
                f"already; assign device_map to move units, or remove() and place it again")
        if device_map is not None:
            self._set_map(normalise_map(device_map, self._targets, self._modules,
                                        self._placed.tensors))
        if example_inputs is not None:
            args, kwargs = split_inputs(example_inputs)
            with self._placing:
                if self._plan is None:
                    self._place_first(args, kwargs)

    def remove(self) -> None:
        """Remove the hooks and put every tensor back, bitwise, on its original device and
        dtype. Safe to call twice."""
        self._hooks.clear()
        with torch.no_grad():
            self._guard.put_back()
            with self._moving():
                self._placed.restore_all()
        self._guard.release()
        self._let_go()

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """Where a checkpoint value must be copied, in place, for each tensor.

        Keys are canonical tensor names as in ``module_sizes(model).tensors`` (the first
        ``named_modules()`` path plus the attribute; tie aliases are not repeated). Each value
        lists the tensors to ``copy_`` into: the tensor as placed (its ``.data``: no
        ``no_grad`` is needed, and the write is not taken for one the forward made, see
        [Note: writes to a converted copy]) and, when a dtype change made this handle keep
        the original host tensor for ``remove()``, that original too. The lists are valid
        until the next re-placement or ``remove()``.
        """
        return self._placed.load_targets()

    def __repr__(self) -> str:
        state = "not placed yet" if self._plan is None else ", ".join(
            f"{k} {format_bytes(v)}" for k, v in self._plan.options["placed_bytes"].items())
        return f"{type(self).__name__}({state})"

    # -- placement ------------------------------------------------------------------------
    def _set_map(self, device_map: dict[str, str]) -> None:
        if self._plan is None:
            self._pending_map = device_map
            return
        units = [replace(u, placement=label_for_unit(u, device_map, self._targets))
                 for u in self._plan.units]
        check_ties(units)
        self._apply(units)
        options = dict(self._plan.options)
        options["placed_bytes"] = placed_bytes(units, self._sizes, self._targets)
        self._plan = Plan(self._mode.value, units, self._plan.total_bytes, options)

    def _place_first(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if fake_mode() is not None:  # See [Note: no placement inside a trace]
            raise NotYet(
                f"{self.made_by} places its model at its first real forward, and this one "
                f"runs on fake tensors (a trace predicting memory); run the model once "
                f"outside the trace first")
        self._local.busy = True
        try:
            self._recording = record_forward(self._model, args, kwargs, keep=(self,))
        finally:
            self._local.busy = False
        targets = [self._targets[label] for label in self._target_order]
        plan = plan_placement(self._model, self._sizes, targets, self._recording,
                              mode=self._mode.value, device_map=self._pending_map, options=self._options)
        # The model's outputs, given no floating tensor, come back in the dtype the recorded
        # forward gave them (float32 logits after bfloat16 layers loaded for a plan).
        self._output_dtype = self._recording.output_dtype
        self._apply(plan.units)
        called = set(self._recording.order)
        self._install_boundaries(
            self._modules, self._hooks, self._specs,
            frozenset(n for n in self._specs
                      if n and n in called and n not in self._recording.combined))
        self._plan = plan
        _log.info("adaptmem %s: placed %d units: %s", self._mode, len(plan.units), ", ".join(
            f"{k} {format_bytes(v)}" for k, v in plan.options["placed_bytes"].items()))

    def _apply(self, units: Sequence[Unit]) -> None:
        """Move every tensor whose label changed (all or nothing), then point the guard and
        the boundary hooks at the new placement."""
        # Not inference tensors, even when the first call runs under inference_mode: the
        # model must still run with autograd on afterwards.
        with torch.inference_mode(False), self._moving():
            self._placed.apply(units)
        self._specs = module_specs(units, self._sizes, self._modules, self._targets,
                                   self._placed.original, self._placed.tensors)

    @contextmanager
    def _moving(self) -> Iterator[None]:
        """While tensors move, the guard holds meta stand-ins for the data at rest, which it
        would otherwise keep alive on its device until every tensor had moved (see [Note:
        originals kept in host memory] in ``mover.py``); after, the data then at rest."""
        self._guard.expect({n: t.data.to("meta") for n, t in self._placed.tensors.items()})
        try:
            yield
        finally:
            self._guard.expect({n: t.data for n, t in self._placed.tensors.items()})

    # -- the root's hooks -----------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if getattr(self._local, "busy", False):
            return None
        stack = self._stack()
        # The model called from its own forward: part of that call (not counted, its outputs
        # stay where the outer forward computes). See [Note: a model that calls itself] in
        # ``_paging/pager.py``, which tells it from frames an interrupted forward left.
        if stack and calls_in_progress(sys._getframe(1), (module,), stop_at=2) == 2:
            return self._pre("", module, args, kwargs)
        stack.clear()  # frames left by a forward interrupted past its hooks
        # See [Note: a placed model is neither copied nor converted]; checked under the
        # lock while another thread may be placing the model.
        if self._plan is None:
            with self._placing:  # two threads making the first call place it once
                if self._plan is None:
                    self._guard.check()
                    self._place_first(args, kwargs)
        else:
            self._guard.check()
        if fake_mode() is None:  # See [Note: a trace is not counted] in _engines/stats.py
            self.stats.forwards += 1
        return self._pre("", module, args, kwargs)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if getattr(self._local, "busy", False) or self._plan is None:
            return None
        return self._post("", module, args, output)


class Chunker(Splitter):
    """The handle ``adaptive.chunk`` returns: a Splitter over ``{device: capacity, "cpu": None}``."""

    _mode = Mode.CHUNK
    made_by, handle_name = "adaptive.chunk", "chunker"
