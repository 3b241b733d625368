"""The forward hooks that convert activations where a model crosses from one placement to
another.

Forward pre-hooks move what a module receives to where its weights live; forward hooks hand
its outputs back to the device and dtype its caller computes in, so a parent that adds or
concatenates children's outputs never sees mixed devices. The hand-back is skipped where it
is not needed, so consecutive units on one device never ping-pong activations: for children
of a plain ``nn.Sequential`` (the next child is the only consumer), and for modules whose
outputs the recorded forward showed their caller never combining with another tensor
(ResNet only pools and flattens ``layer4``'s output before ``fc``); whoever uses such an
output converts it on entry.

[Note: boundary hooks are the engine's methods] ``BoundaryHooks`` is a base class of the
engine, not an object the engine holds: a hook's owner is how the recorder knows which hooks
to leave off its copy of a model an engine holds (it drops the engine's bound methods), and
a collaborator's methods would be copied and run on the copy; a delegating call instead
would add to the cost of every hook, the path ``benchmarks/chunking.py`` measures.

[Note: dtypes change only where a placement converts]
A model may mix floating dtypes (bfloat16 layers beside float16 ones, a LayerNorm kept in
float32) and convert between them in its own code. Where no target converts weights to a
dtype (``dtype=`` not given), the hooks move activations between devices and never change a
dtype: each module receives what the unplaced model would give it. Where a target does
convert, a module placed there computes in that dtype (its inputs are converted on entry,
its outputs handed back in the dtype it received; the model's, given no floating tensor,
in the dtype its recorded forward gave them), and a module placed where nothing is
converted takes its inputs in its own weights' first floating dtype (else its unit's): an
output that was not handed back (see above) may reach it in the converted dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .._common.inputs import MovedInputs
from .._common.peak import fake_mode
from .._common.tree import dataclass_fields, map_tensors
from .._engines.base import HookSet
from .._engines.guard import PlacementGuard
from .._engines.stats import PlacementStats
from .._planning import ModuleSizes, Target, Unit

__all__ = ["BoundaryHooks", "Spec", "module_specs", "needs_move"]


@dataclass(frozen=True)
class Spec:
    """Where a module computes: its device (None: pass-through, a plain nn.Sequential) and
    the floating dtype its inputs take there."""

    device: torch.device | None
    dtype: torch.dtype | None


@dataclass
class _Frame:
    name: str
    received: tuple[torch.device | None, torch.dtype | None]
    where: tuple[torch.device | None, torch.dtype | None]
    passthrough: bool
    inputs: MovedInputs | None = None  # what its pre-hook moved, when anything


def module_specs(units: Sequence[Unit], sizes: ModuleSizes, modules: Mapping[str, nn.Module],
                 targets: Mapping[str, Target],
                 original: Mapping[str, tuple[torch.device, torch.dtype]],
                 tensors: Mapping[str, torch.Tensor]) -> dict[str, Spec]:
    """Where each module with weights computes; None device for a plain Sequential.
    ``original`` gives each tensor's own device and dtype (the dtype a target without one
    computes in, when another target converts; else no dtype: See [Note: dtypes change only
    where a placement converts])."""
    converting = any(t.dtype is not None for t in targets.values())
    by_module = {u.module: u for u in units}
    by_tensor = {t: u for u in units for t in u.tensors}
    specs: dict[str, Spec] = {}
    for name in sizes.modules:
        subtree = sizes.subtree_tensors[name]
        if not subtree:
            continue
        unit = by_module.get(name)
        if unit is None and sizes.own[name]:
            unit = by_tensor.get(sizes.own[name][0])
        if unit is None and type(modules[name]).forward is nn.Sequential.forward:
            specs[name] = Spec(None, None)
            continue
        if unit is None:  # a container: it starts where its first unit runs
            unit = next((u for u in units if subtree & set(u.tensors)), None)
        if unit is None:
            continue
        target = targets[unit.placement]
        dtype = target.dtype
        if dtype is None and converting:
            floats = [original[t][1] for t in (*sizes.own[name], *unit.tensors, *unit.borrowed)
                      if tensors[t].is_floating_point()]
            dtype = floats[0] if floats else None
        specs[name] = Spec(target.device, dtype)
    return specs


class BoundaryHooks:
    """Per-module forward hooks converting activations at placement boundaries, and their
    counters. A base of the engine: see [Note: boundary hooks are the engine's methods]."""

    stats: PlacementStats
    _guard: PlacementGuard

    def _init_boundaries(self, home_device: torch.device, home_dtype: torch.dtype,
                         output_device: torch.device | None) -> None:
        self._home_device = home_device
        self._home_dtype = home_dtype
        self._output_dtype: torch.dtype | None = None  # the model's unplaced, once recorded
        self._output_device = output_device
        self._specs: dict[str, Spec] = {}
        self._stays: frozenset[str] = frozenset()  # modules whose outputs need no hand-back
        self._converts = False  # some module computes in a dtype: See [Note: dtypes change ...]
        self._frames = threading.local()  # .stack: the calls under way in this thread

    def _install_boundaries(self, modules: Mapping[str, nn.Module], hooks: HookSet,
                            specs: dict[str, Spec], stays: frozenset[str]) -> None:
        """Hook every module with a spec (the root's hooks are the engine's own)."""
        self._specs, self._stays = specs, stays
        self._converts = any(spec.dtype is not None for spec in specs.values())
        for name in specs:
            if name == "":
                continue
            module = modules[name]
            hooks.add(module,
                      module.register_forward_pre_hook(partial(self._pre, name), with_kwargs=True),
                      module.register_forward_hook(partial(self._post, name), always_call=True))

    def _stack(self) -> list[_Frame]:
        stack = getattr(self._frames, "stack", None)
        if stack is None:
            stack = self._frames.stack = []
        return stack

    def _pre(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> Any:
        stack = self._stack()
        if not stack and name:  # a submodule called on its own
            self._guard.check()
        spec = self._specs.get(name)
        enclosing = stack[-1] if stack else None
        received = self._received((args, kwargs), enclosing, name)
        if spec is None or spec.device is None:
            stack.append(_Frame(name, received, enclosing.where if enclosing else received, True))
            return None
        frame = _Frame(name, received, (spec.device, spec.dtype), False)
        stack.append(frame)
        if not needs_move((args, kwargs), spec.device, spec.dtype):
            return None
        converted = self.stats.bytes_converted
        # See [Note: what a forward writes into its inputs]
        frame.inputs = inputs = MovedInputs(args, kwargs, self._mover(spec.device, spec.dtype))
        self._count(converted)
        return (inputs.args, inputs.kwargs) if inputs.moved else None

    def _post(self, name: str, module: nn.Module, args: Any, output: Any) -> Any:
        stack = self._stack()
        while stack:
            frame = stack.pop()
            if frame.name == name:
                break
        else:
            return None
        if not stack:  # an outermost call ended
            self._guard.adopt_replacements()
        if frame.inputs is not None:  # See [Note: what a forward writes into its inputs]
            converted = self.stats.bytes_converted
            frame.inputs.write_back(self._mover(*frame.received))
            self._count(converted)
        if stack and stack[-1].passthrough:
            return None  # the next child of a plain Sequential converts what it needs
        if stack and name in self._stays:
            return None  # its caller never combines its outputs: whoever uses them converts
        device, dtype = frame.received
        if stack:
            # Back to where the caller computes: what this module received may have come
            # straight from a child that did not hand its outputs back.
            device, dtype = stack[-1].where[0] or device, stack[-1].where[1] or dtype
        if not stack and name == "" and self._output_device is not None:
            device = self._output_device
        if device is None or output is None:
            return None
        moved = self._convert(output, device, dtype, frame.inputs)
        return None if moved is output else moved

    def _received(self, obj: Any, enclosing: _Frame | None, name: str
                  ) -> tuple[torch.device | None, torch.dtype | None]:
        device, dtype = _first_device_and_float(obj)
        if enclosing is not None:
            device, dtype = device or enclosing.where[0], dtype or enclosing.where[1]
        if not self._converts:  # See [Note: dtypes change only where a placement converts]
            return device or self._home_device, None
        if dtype is None and name == "" and enclosing is None:  # the model given no float
            dtype = self._output_dtype
        return device or self._home_device, dtype or self._home_dtype

    def _convert(self, obj: Any, device: torch.device, dtype: torch.dtype | None,
                 inputs: MovedInputs | None = None) -> Any:
        """``obj`` moved to ``device`` (floating tensors to ``dtype``); a moved input of
        ``inputs`` in it comes back as the caller's own."""
        if inputs is None and not needs_move(obj, device, dtype):
            return obj
        converted = self.stats.bytes_converted
        move = self._mover(device, dtype)
        out = map_tensors(obj, move) if inputs is None else inputs.hand_back(obj, move)
        self._count(converted)
        return out

    def _mover(self, device: torch.device | None,
               dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """A tensor moved to ``device`` (floating ones to ``dtype``), its bytes counted (not
        under a trace: See [Note: a trace is not counted] in ``_engines/stats.py``)."""
        stats = self.stats if fake_mode() is None else PlacementStats()

        def move(t: torch.Tensor) -> torch.Tensor:
            want = dtype if dtype is not None and t.is_floating_point() else t.dtype
            if (device is None or t.device == device) and t.dtype == want:
                return t
            stats.bytes_converted += t.numel() * t.element_size()
            return t.to(device=device, dtype=want)

        return move

    def _count(self, converted: int) -> None:
        """One crossing more when bytes were converted since ``converted``."""
        if self.stats.bytes_converted != converted:
            self.stats.boundary_crossings += 1


def _first_device_and_float(obj: Any) -> tuple[torch.device | None, torch.dtype | None]:
    """The first tensor's device and the first floating tensor's dtype in nested ``obj``
    (tuples, lists, dicts, dataclass instances, as ``map_tensors`` walks them); a hot path,
    so no pytree."""
    if isinstance(obj, torch.Tensor):
        return obj.device, (obj.dtype if obj.is_floating_point() else None)
    device = dtype = None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) \
        else _field_values(obj)
    for item in items:
        d, t = _first_device_and_float(item)
        device, dtype = device or d, dtype or t
        if device is not None and dtype is not None:
            break
    return device, dtype


def needs_move(obj: Any, device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether any tensor in nested ``obj`` is off ``device`` or (floating) off ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.device != device or (
            dtype is not None and obj.dtype != dtype and obj.is_floating_point())
    if isinstance(obj, dict):
        return any(needs_move(v, device, dtype) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(needs_move(v, device, dtype) for v in obj)
    return any(needs_move(v, device, dtype) for v in _field_values(obj))


def _field_values(obj: Any) -> list[Any]:
    """The field values of a dataclass instance; nothing for other objects."""
    return [getattr(obj, f.name) for f in dataclass_fields(obj) or ()]
