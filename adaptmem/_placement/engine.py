"""chunk and split: place units of a model on several devices and convert at the boundaries.

Placement swaps tensor storage only (``param.data = ...``): parameter identity, ``state_dict``
keys and module classes never change. Forward pre-hooks move what a module receives to where
its weights live; forward hooks hand its outputs back to the device and dtype its caller
computes in, so a parent that adds or concatenates children's outputs never sees mixed
devices. The hand-back is skipped where it is not needed, so consecutive units on one device
never ping-pong activations: for children of a plain ``nn.Sequential`` (the next child is
the only consumer), and for modules whose outputs the recorded forward showed their caller
never combining with another tensor (ResNet only pools and flattens ``layer4``'s output
before ``fc``); whoever uses such an output converts it on entry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from .._common.claims import check_placeable
from .._common.devices import format_bytes, map_tensors, parse_size, resolve_device
from .._common.errors import PlacementError
from .._engines.base import Engine
from .._engines.guard import PlacementGuard
from .._engines.stats import PlacementStats
from .._planning import (
    Plan,
    Recording,
    Target,
    Unit,
    auto_capacity,
    canonical_tensors,
    check_ties,
    label_for_unit,
    module_sizes,
    parse_dtype,
    placed_bytes,
    plan_placement,
    qualify_labels,
    record_forward,
    split_inputs,
    split_label,
    targets_from_devices,
)

__all__ = ["Splitter", "Chunker", "split", "chunk", "chunk_targets"]

_log = logging.getLogger("adaptmem")


@dataclass(frozen=True)
class _Spec:
    device: torch.device | None  # None: pass-through (a plain nn.Sequential)
    dtype: torch.dtype | None


@dataclass
class _Frame:
    name: str
    received: tuple[torch.device | None, torch.dtype | None]
    where: tuple[torch.device | None, torch.dtype | None]
    passthrough: bool


class Splitter(Engine):
    """The handle ``adaptive.split`` returns: hooks, placed tensors and the kept originals.

    ``.plan`` (None until placed), ``.device_map`` (once placed, or given), ``.stats``,
    ``.remove()``; a context manager that removes itself on exit. Assigning
    ``handle.device_map = edited`` moves exactly the units whose entry changed. While it
    holds the model, the model cannot be deep-copied or pickled whole, and a dtype or device
    conversion (``model.half()``, ``.to()``) makes the next call raise; ``remove()`` first.
    See [Note: a placed model is neither copied nor converted].
    """

    _mode = "split"
    _engine, _handle = "adaptive.split", "splitter"

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
        self._output_device = output_device
        self._options = dict(options or {})
        self._pending_map: dict[str, str] | None = None
        self._sizes = module_sizes(model)
        self._tensors = canonical_tensors(model)
        self._modules = dict(model.named_modules())
        first = next(iter(self._tensors.values()), None)
        self._home_device = first.device if first is not None else torch.device("cpu")
        self._home_dtype = next((t.dtype for t in self._tensors.values()
                                 if t.is_floating_point()), torch.get_default_dtype())
        self._original = {n: (t.device, t.dtype) for n, t in self._tensors.items()}
        self._kept: dict[str, torch.Tensor] = {}  # originals a lossy dtype change replaced
        # (placed tensor's version, kept original's version) when placed: see _sync_back.
        self._versions: dict[str, tuple[int, int]] = {}
        self._where: dict[str, str] = {}  # tensor -> label, for tensors that were moved
        self._specs: dict[str, _Spec] = {}
        self._stays: frozenset[str] = frozenset()  # modules whose outputs need no hand-back
        self._plan: Plan | None = None
        self._recording: Recording | None = None
        self._local = threading.local()  # .busy while recording, .stack of call frames
        self._placing = threading.Lock()
        self._hooks: list[Any] = []
        self.stats = PlacementStats()
        self._guard = PlacementGuard(model, self._tensors, self._engine, self._handle)
        self._hold(self._modules.values())
        self._hooks.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._root_post, always_call=True))

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
            if self._pending_map is None:
                raise PlacementError(
                    f"{type(self).__name__}.device_map: the model is placed at its first call, "
                    f"which has not happened yet, so there is no map. Pass example_inputs= to "
                    f"adaptive.{self._mode} to place it now, or compute the same map first "
                    f"with adaptive.plan(model, devices=..., example_inputs=...)"
                )
            return dict(self._pending_map)
        return self._plan.device_map

    @device_map.setter
    def device_map(self, device_map: Mapping[str, str]) -> None:
        self.place(device_map)

    def place(self, device_map: Mapping[str, str]) -> None:
        """Re-place the model as ``device_map`` says, moving only the units whose device
        changed (before the first call, the map is kept for the placement then).

        Raises:
            PlacementError: the map misses a unit, splits one that must stay whole, separates
                tied tensors, or names a device the placement does not have.
        """
        if not isinstance(device_map, Mapping):
            raise TypeError(f"device_map must be a dict {{module name: device}}, got "
                            f"{type(device_map).__name__}")
        self._guard.check()
        device_map = self._normalise_map(device_map)
        if self._plan is None:
            self._pending_map = dict(device_map)
            return
        units = [replace(u, placement=label_for_unit(u, device_map, self._targets))
                 for u in self._plan.units]
        check_ties(units)
        self._apply(units)
        options = dict(self._plan.options)
        options["placed_bytes"] = placed_bytes(units, self._sizes, self._targets)
        self._plan = Plan(self._mode, units, self._plan.total_bytes, options)

    def remove(self) -> None:
        """Remove the hooks and put every tensor back, bitwise, on its original device and
        dtype. Safe to call twice."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with torch.no_grad():
            self._guard.put_back()
            for name in list(self._where):
                self._restore(name)
                del self._where[name]
        self._guard.release()
        self._let_go()

    def load_targets(self) -> dict[str, list[torch.Tensor]]:
        """Where a checkpoint value must be copied, in place, for each tensor.

        Keys are canonical tensor names as in ``module_sizes(model).tensors`` (the first
        ``named_modules()`` path plus the attribute; tie aliases are not repeated). Each value
        lists the tensors to ``copy_`` into: the tensor as placed (its ``.data``: no
        ``no_grad`` is needed, and the write is not taken for one the forward made, see
        ``_sync_back``) and, when a dtype change made this handle keep the original host
        tensor for ``remove()``, that original too. The lists are valid until the next
        re-placement or ``remove()``.
        """
        out: dict[str, list[torch.Tensor]] = {}
        for name, t in self._tensors.items():
            targets = [t.data]
            kept = self._kept.get(name)
            if kept is not None and not kept.is_meta:
                targets.append(kept)
            out[name] = targets
        return out


    def __repr__(self) -> str:
        state = "not placed yet" if self._plan is None else ", ".join(
            f"{k} {format_bytes(v)}" for k, v in self._plan.options["placed_bytes"].items())
        return f"{type(self).__name__}({state})"

    # -- placement ------------------------------------------------------------------------
    def _normalise_map(self, device_map: Mapping[str, str]) -> dict[str, str]:
        """Plain device names become this placement's label for that device."""
        out = {}
        for key, value in device_map.items():
            value = str(value)
            if value not in self._targets:
                device, dtype = split_label(value)
                try:
                    dev = torch.device(device)
                except (RuntimeError, ValueError):
                    dev = None
                same = [t for t in self._targets.values()
                        if dev is not None and t.device == dev and (dtype is None or t.dtype == dtype)]
                plain = [t for t in same if t.dtype is None]
                if len(same) == 1 or len(plain) == 1:
                    value = (same[0] if len(same) == 1 else plain[0]).label
            out[str(key)] = value
        # Checked here, at the call that received the map, not at the first forward.
        unknown = [k for k in out if k and k not in self._modules and k not in self._tensors]
        if unknown:
            raise PlacementError(
                f"device_map names {unknown[:5]}, which are neither modules nor tensors of this "
                f"model; use names from model.named_modules() (or '' for the whole model)"
            )
        bad = sorted({v for v in out.values() if v not in self._targets})
        if bad:
            raise PlacementError(
                f"device_map places modules on {bad}, which are not among this placement's "
                f"devices {sorted(self._targets)}; add them to devices= or change the map"
            )
        uncovered = [
            name for name in self._tensors
            if not any(k == "" or name == k or name.startswith(k + ".") for k in out)
        ]
        if uncovered:
            raise PlacementError(
                f"device_map leaves {len(uncovered)} tensor(s) without a device (first: "
                f"{uncovered[0]!r}); name their module, a parent of it, or '' for everything"
            )
        return out

    def _place_first(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._local.busy = True
        try:
            self._recording = record_forward(self._model, args, kwargs, keep=(self,))
        finally:
            self._local.busy = False
        targets = [self._targets[label] for label in self._target_order]
        plan = plan_placement(self._model, self._sizes, targets, self._recording,
                              mode=self._mode, device_map=self._pending_map, options=self._options)
        self._apply(plan.units)
        called = set(self._recording.order)
        self._stays = frozenset(n for n in self._specs
                                if n and n in called and n not in self._recording.combined)
        self._install_hooks()
        self._plan = plan
        _log.info("adaptmem %s: placed %d units: %s", self._mode, len(plan.units), ", ".join(
            f"{k} {format_bytes(v)}" for k, v in plan.options["placed_bytes"].items()))

    def _apply(self, units: Sequence[Unit]) -> None:
        """Move every tensor whose label changed; on any failure put back what moved."""
        wanted = {t: u.placement for u in units for t in u.tensors}
        before = dict(self._where)
        moved: list[str] = []
        try:
            with torch.no_grad():
                for name, label in wanted.items():
                    if self._where.get(name) != label:
                        moved.append(name)
                        self._move(name, self._targets[label])
                        self._where[name] = label
        except BaseException:
            with torch.no_grad():
                for name in moved:
                    if name in before:
                        self._move(name, self._targets[before[name]])
                        self._where[name] = before[name]
                    else:
                        self._restore(name)
                        self._where.pop(name, None)
            raise
        self._guard.expect({n: t.data for n, t in self._tensors.items()})
        self._specs = self._module_specs(units)

    def _move(self, name: str, target: Target) -> None:
        t = self._tensors[name]
        self._sync_back(name)
        device, dtype = self._original[name]
        want = target.dtype if target.dtype is not None and t.is_floating_point() else dtype
        source = self._kept.get(name, t.data)
        if source.is_meta and not t.data.is_meta:
            source = t.data  # materialised from meta earlier: its values live only here
        if source.device == target.device and source.dtype == want:
            placed = source
        elif source.is_meta:
            placed = torch.empty_like(source, device=target.device, dtype=want)
        else:
            placed = source.to(device=target.device, dtype=want, copy=True)
        if want != dtype or source.is_meta:
            self._kept.setdefault(name, source)
        else:
            self._kept.pop(name, None)
        _set_data(t, placed)
        kept = self._kept.get(name)
        self._versions[name] = (t._version, -1 if kept is None else kept._version)

    def _sync_back(self, name: str) -> None:
        """Carry writes made to a converted copy (a step counter, a running statistic) into
        the kept original, so that re-placing or ``remove()`` keeps them like an unconverted
        tensor keeps them (in the original dtype, so rounded by the trip through the
        placed one). Writes are seen by the version counter of the parameter or buffer
        itself; the loader writes through ``.data`` aliases (``load_targets``), which leave
        it alone, and fills the original too."""
        kept = self._kept.get(name)
        versions = self._versions.get(name)
        if kept is None or kept.is_meta or versions is None:
            return
        t = self._tensors[name]
        if t._version != versions[0] and kept._version == versions[1]:
            kept.copy_(t.data)
            self._versions[name] = (t._version, kept._version)

    def _restore(self, name: str) -> None:
        t = self._tensors[name]
        self._sync_back(name)
        self._versions.pop(name, None)
        kept = self._kept.pop(name, None)
        if kept is not None:
            _set_data(t, kept)
        device, dtype = self._original[name]
        if t.device != device or t.dtype != dtype:
            _set_data(t, t.data.to(device=device, dtype=dtype))

    def _module_specs(self, units: Sequence[Unit]) -> dict[str, _Spec]:
        """Where each module with weights computes; None device for a plain Sequential."""
        sizes = self._sizes
        by_module = {u.module: u for u in units}
        by_tensor = {t: u for u in units for t in u.tensors}
        specs: dict[str, _Spec] = {}
        for name in sizes.modules:
            subtree = sizes.subtree_tensors[name]
            if not subtree:
                continue
            unit = by_module.get(name)
            if unit is None and sizes.own[name]:
                unit = by_tensor.get(sizes.own[name][0])
            if unit is None and type(self._modules[name]).forward is nn.Sequential.forward:
                specs[name] = _Spec(None, None)
                continue
            if unit is None:  # a container: it starts where its first unit runs
                unit = next((u for u in units if subtree & set(u.tensors)), None)
            if unit is None:
                continue
            target = self._targets[unit.placement]
            dtype = target.dtype
            if dtype is None:
                floats = [self._original[t][1] for t in (*unit.tensors, *unit.borrowed)
                          if self._tensors[t].is_floating_point()]
                dtype = floats[0] if floats else None
            specs[name] = _Spec(target.device, dtype)
        return specs

    def _install_hooks(self) -> None:
        for name in self._specs:
            if name == "":
                continue
            module = self._modules[name]
            self._hooks.append(module.register_forward_pre_hook(
                partial(self._pre, name), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                partial(self._post, name), always_call=True))

    # -- execution ------------------------------------------------------------------------
    def _stack(self) -> list[_Frame]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if getattr(self._local, "busy", False):
            return None
        self._stack().clear()  # a frame left by a forward that raised
        # See [Note: a placed model is neither copied nor converted]; checked under the
        # lock while another thread may be placing the model.
        if self._plan is None:
            with self._placing:  # two threads making the first call place it once
                if self._plan is None:
                    self._guard.check()
                    self._place_first(args, kwargs)
        else:
            self._guard.check()
        self.stats.forwards += 1
        return self._pre("", module, args, kwargs)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if getattr(self._local, "busy", False) or self._plan is None:
            return None
        return self._post("", module, args, output)

    def _pre(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> Any:
        stack = self._stack()
        if not stack and name:  # a submodule called on its own
            self._guard.check()
        spec = self._specs.get(name)
        enclosing = stack[-1] if stack else None
        received = self._received((args, kwargs), enclosing)
        if spec is None or spec.device is None:
            stack.append(_Frame(name, received, enclosing.where if enclosing else received, True))
            return None
        stack.append(_Frame(name, received, (spec.device, spec.dtype), False))
        moved = self._convert((args, kwargs), spec.device, spec.dtype)
        return moved if moved[0] is not args or moved[1] is not kwargs else None

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
        if stack and stack[-1].passthrough:
            return None  # the next child of a plain Sequential converts what it needs
        if stack and name in self._stays:
            return None  # its caller never combines its outputs: whoever uses them converts
        device, dtype = frame.received
        if stack:
            # Back to where the caller computes: what this module received may have come
            # straight from a child that did not hand its outputs back.
            device, dtype = stack[-1].where[0] or device, stack[-1].where[1] or dtype
        if name == "" and self._output_device is not None:
            device = self._output_device
        if device is None or output is None:
            return None
        moved = self._convert(output, device, dtype)
        return None if moved is output else moved

    def _received(self, obj: Any, enclosing: _Frame | None
                  ) -> tuple[torch.device | None, torch.dtype | None]:
        device, dtype = _first_device_and_float(obj)
        if enclosing is not None:
            device, dtype = device or enclosing.where[0], dtype or enclosing.where[1]
        return device or self._home_device, dtype or self._home_dtype

    def _convert(self, obj: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
        if not _needs_move(obj, device, dtype):
            return obj
        moved_bytes = 0

        def move(t: torch.Tensor) -> torch.Tensor:
            nonlocal moved_bytes
            want = dtype if dtype is not None and t.is_floating_point() else t.dtype
            if t.device == device and t.dtype == want:
                return t
            moved_bytes += t.numel() * t.element_size()
            return t.to(device=device, dtype=want)

        out = map_tensors(obj, move)
        if moved_bytes:
            self.stats.boundary_crossings += 1
            self.stats.bytes_converted += moved_bytes
        return out


def _set_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """Point ``t`` (a registered parameter or buffer) at ``data``, keeping its identity."""
    if t.is_meta == data.is_meta:
        t.data = data
        return
    # set_data cannot cross between meta and real tensors; swapping contents can, and the
    # Python object (and so every reference to the parameter) stays the same.
    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    torch.utils.swap_tensors(t, new)


def _first_device_and_float(obj: Any) -> tuple[torch.device | None, torch.dtype | None]:
    """The first tensor's device and the first floating tensor's dtype in nested ``obj``
    (tuples, lists, dicts, as ``map_tensors`` walks them); a hot path, so no pytree."""
    if isinstance(obj, torch.Tensor):
        return obj.device, (obj.dtype if obj.is_floating_point() else None)
    device = dtype = None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        d, t = _first_device_and_float(item)
        device, dtype = device or d, dtype or t
        if device is not None and dtype is not None:
            break
    return device, dtype


def _needs_move(obj: Any, device: torch.device, dtype: torch.dtype | None) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device != device or (
            dtype is not None and obj.dtype != dtype and obj.is_floating_point())
    if isinstance(obj, dict):
        return any(_needs_move(v, device, dtype) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_needs_move(v, device, dtype) for v in obj)
    return False


class Chunker(Splitter):
    """The handle ``adaptive.chunk`` returns: a Splitter over ``{device: capacity, "cpu": None}``."""

    _mode = "chunk"
    _engine, _handle = "adaptive.chunk", "chunker"


def _undo_on_failure(handle: Splitter, step: Any, *args: Any) -> Any:
    """Run a set-up ``step``; if it fails, remove ``handle`` so the model is as it was."""
    try:
        return step(*args)
    except BaseException:
        handle.remove()
        raise


def split(
    model: nn.Module,
    devices: Any = None,
    *,
    device_map: Mapping[str, str] | None = None,
    dtype: Any = None,
    output_device: Any = None,
    example_inputs: Any = None,
    reserve: Any = "auto",
    _allow_meta: bool = False,
) -> Splitter:
    """Spread ``model`` over several devices, a prefix of its execution order per device.

    Units (each module's own weights; attention blocks whole) fill each device in the order
    they run, not the order they were registered, until the next would pass its capacity in
    the dtype placed there. Execution order is learned from one forward on a copy of the
    model and its inputs, on the meta device when the model can run there (so it costs no
    memory and neither the model nor the inputs change): at the first call, or now when
    ``example_inputs`` is given. ``adaptive.plan(model, devices, example_inputs=...)`` shows
    the same placement in advance. Each unit moves what it receives (args and kwargs,
    nested) to its device and floating dtype and hands outputs back where its caller has
    them; outputs reach you on the device of your inputs.

    Args:
        model: an ``nn.Module`` in eval mode with real (not meta) weights.
        devices: an ordered mapping ``{device: capacity}`` (bytes, "20GiB", ``"auto"``, or None
            for unlimited) or a list of devices (each ``"auto"``). A key may carry a dtype,
            ``("cpu", torch.bfloat16)`` or ``"cpu@bfloat16"``, so one device can hold two.
        device_map: ``{module name: device}`` (accelerate style) instead of capacities; the
            keys of ``handle.device_map`` work, and tensor names for a split module's own
            tensors. Devices come from the values when ``devices`` is None.
        dtype: the dtype floating weights take on placement: one for all devices, or a
            mapping ``{device: dtype}``. The originals are kept for ``remove()``.
        output_device: where outputs are returned (default: where the inputs came from).
        example_inputs: a tensor, tuple of positional inputs or dict of keyword inputs;
            given, the model is placed now instead of at the first call.
        reserve: what ``"auto"`` capacities keep free for activations (see ``chunk``).
        _allow_meta: for ``adaptive.load`` only: accept meta tensors and allocate them,
            uninitialised, where the plan puts them (fill them through
            ``handle.load_targets()``); ``remove()`` puts the meta tensors back.

    Returns:
        A ``Splitter`` with ``.plan``, ``.device_map`` (assignable), ``.stats``,
        ``.remove()``; a context manager.

    Raises:
        TypeError / ValueError: a bad argument (named in the message); nothing was changed.
        PlacementError: a training-mode, meta or already placed model, a model that does not
            fit, or a device_map that misses or splits a unit.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).eval()
        >>> with adaptive.split(net, {"cpu@bfloat16": 64 * 65 * 2, "cpu": None},
        ...                     example_inputs=torch.ones(1, 64)) as s:
        ...     s.device_map
        ...     net(torch.ones(1, 64)).dtype
        {'0': 'cpu@bfloat16', '1': 'cpu'}
        torch.float32
    """
    check_placeable(model, "adaptive.chunk/split", _allow_meta)
    out_dev = None if output_device is None else resolve_device(output_device, "output_device")
    if devices is None:
        if device_map is None:
            raise TypeError("split needs devices ({'cuda:0': '20GiB', 'cpu': None}) or device_map")
        if not isinstance(device_map, Mapping) or not device_map:
            raise TypeError(f"device_map must be a non-empty dict {{module: device}}, got "
                            f"{device_map!r}")
        devices = {v: None for v in dict.fromkeys(str(v) for v in device_map.values())}
    targets = targets_from_devices(devices, dtype, reserve)
    if device_map is not None and not isinstance(device_map, Mapping):
        raise TypeError(f"device_map must be a dict {{module: device}}, got {device_map!r}")
    handle = Splitter(model, targets, output_device=out_dev, options={"reserve": reserve})
    if device_map is not None:
        handle._pending_map = _undo_on_failure(handle, handle._normalise_map, device_map)
    if example_inputs is not None:
        _undo_on_failure(handle, handle._place_first, *split_inputs(example_inputs))
    return handle


def chunk(
    model: nn.Module,
    device: Any = None,
    *,
    capacity: Any = "auto",
    dtype: Any = None,
    reserve: Any = "auto",
    output_device: Any = None,
    example_inputs: Any = None,
    _allow_meta: bool = False,
) -> Chunker:
    """Keep the first part of ``model`` (in execution order) resident on ``device`` and run
    the rest on the CPU: ``split(model, {device: capacity, "cpu": None})``.

    ``capacity="auto"`` is the device's free memory minus ``reserve``; ``reserve="auto"``
    keeps back the larger of 10% of the device's total memory and 512 MiB, room for
    activations, the copies made at the boundary and allocator slack. Pass ``reserve=``
    bytes (or "2GiB") to choose it, or a fixed ``capacity``.

    Args:
        model: an ``nn.Module`` in eval mode with real weights.
        device: where the resident part lives; None means the current accelerator, else CPU.
        capacity: bytes the resident part may take (int, "6GiB"), counted in ``dtype``.
        dtype: the floating dtype of the resident part (e.g. ``torch.float16``); the CPU part
            keeps the model's own. Originals are kept so ``remove()`` restores them bitwise.
        reserve: see above; only used when ``capacity="auto"``.
        output_device: where outputs are returned (default: where the inputs came from).
        example_inputs: inputs for one forward that learns the execution order now; without
            them the model is placed at its first call.
        _allow_meta: for ``adaptive.load`` only; see ``split``.

    Returns:
        A ``Chunker`` (``.plan``, ``.device_map``, ``.stats``, ``.remove()``, context manager).

    Raises:
        TypeError / ValueError: a bad argument (named in the message); the model is untouched.
        PlacementError: a training-mode, meta or already placed model.

    Example:
        >>> import torch
        >>> from adaptmem import adaptive
        >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).eval()
        >>> chunker = adaptive.chunk(net, "cpu", capacity=8_500, dtype=torch.bfloat16,
        ...                          example_inputs=torch.ones(1, 64))
        >>> chunker.device_map
        {'0': 'cpu@bfloat16', '1': 'cpu'}
        >>> chunker.remove()
    """
    check_placeable(model, "adaptive.chunk/split", _allow_meta)
    dev = resolve_device(device, "device")
    dt = parse_dtype(dtype)
    out_dev = None if output_device is None else resolve_device(output_device, "output_device")
    if isinstance(capacity, str) and capacity == "auto":
        cap, kept = auto_capacity(dev, reserve)
        _log.info("adaptmem chunk: capacity auto on %s = %s free minus %s reserve", dev,
                  format_bytes(cap + kept), format_bytes(kept))
    else:
        if reserve != "auto":
            raise ValueError(f"reserve={reserve!r} only applies to capacity='auto'; with "
                             f"capacity={capacity!r} leave reserve out")
        if capacity is None:
            raise TypeError("capacity must be bytes (int or '6GiB') or 'auto', got None")
        cap = parse_size(capacity, "capacity")
    targets = chunk_targets(dev, cap, dt)
    handle = Chunker(model, targets, output_device=out_dev,
                     options={"capacity": cap, "reserve": reserve})
    if example_inputs is not None:
        _undo_on_failure(handle, handle._place_first, *split_inputs(example_inputs))
    return handle


def chunk_targets(device: torch.device, capacity: int | None, dtype: torch.dtype | None
                  ) -> list[Target]:
    """``chunk``'s targets: ``device`` holding ``capacity`` bytes in ``dtype``, then the CPU
    for the rest; one CPU target (capacity moot) when both are the CPU in its own dtype."""
    cpu = torch.device("cpu")
    if device == cpu and dtype is None:
        return [Target(cpu, None, None, "cpu")]
    labels = qualify_labels([(device, dtype), (cpu, None)])
    return [Target(device, capacity, dtype, labels[0]), Target(cpu, None, None, labels[1])]
