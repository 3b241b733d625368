"""Planning for chunk and split: placement targets, one recorded forward, atomic units.

Pure apart from the recorded forward, which runs on meta copies of the weights (no memory)
and only falls back to the real weights when a model cannot run on meta.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._devices import format_bytes, memory_info, parse_size, resolve_device
from ._errors import PlacementError
from ._planner import ModuleSizes, Plan, Unit, assign_devices, order_units, paging_units

__all__ = [
    "Target",
    "Recording",
    "ATOMIC_MODULE_TYPES",
    "parse_dtype",
    "make_label",
    "split_label",
    "split_inputs",
    "record_forward",
    "placement_units",
    "plan_placement",
    "canonical_tensors",
    "auto_capacity",
    "targets_from_devices",
]

_log = logging.getLogger("adaptmem")
_MIN_RESERVE = 512 * 1024**2

# Their forwards may read children's weights without calling the children, on fast paths
# that depend on grad mode and device (so a meta forward cannot reveal it): never split them.
ATOMIC_MODULE_TYPES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


@dataclass(frozen=True)
class Target:
    """One place units can go: a device, a capacity in bytes (None: unlimited), the dtype
    floating weights take there (None: keep theirs) and the label plans and device maps use."""

    device: torch.device
    capacity: int | None
    dtype: torch.dtype | None
    label: str


@dataclass
class Recording:
    """What one forward showed: modules in first-call order, for every tensor the modules
    whose own code (not a child's) passed it to a torch function, and the modules whose
    outputs their caller combined with other tensors (see ``_UseRecorder``)."""

    order: list[str]
    uses: dict[str, set[str]] = field(default_factory=dict)
    on_meta: bool = True
    # Modules whose outputs their caller's own code combined with other tensors.
    combined: set[str] = field(default_factory=set)


def parse_dtype(value: Any, name: str = "dtype") -> torch.dtype | None:
    """A floating ``torch.dtype`` from a dtype or its name (``"bfloat16"``); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            value = found
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.dtype such as torch.float16 or torch.bfloat16 "
            f"(or its name), got {value!r}"
        )
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_label(device: torch.device, dtype: torch.dtype | None, qualify: bool) -> str:
    """``"cuda:0"``, or ``"cpu@bfloat16"`` when one device holds several dtypes."""
    return f"{device}@{_dtype_name(dtype)}" if qualify and dtype is not None else str(device)


def split_label(label: str) -> tuple[str, torch.dtype | None]:
    """``"cpu@bfloat16"`` -> ``("cpu", torch.bfloat16)``; ``"cuda:0"`` -> ``("cuda:0", None)``."""
    device, sep, dtype = label.partition("@")
    return device, (parse_dtype(dtype, f"the dtype in {label!r}") if sep else None)


def qualify_labels(pairs: Sequence[tuple[torch.device, torch.dtype | None]]) -> list[str]:
    """Labels for (device, dtype) pairs: plain device names unless a device repeats."""
    counts: dict[torch.device, int] = {}
    for device, _ in pairs:
        counts[device] = counts.get(device, 0) + 1
    labels = [make_label(d, t, counts[d] > 1) for d, t in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(
            f"devices lists the same device and dtype twice: {labels}; give each (device, dtype) "
            f"pair once"
        )
    return labels


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from a tensor, a tuple of positional inputs or a dict of keywords."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def canonical_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer under its canonical name (as ``module_sizes``)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for registry in (module._parameters, module._buffers):
            for attr, t in registry.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                out[f"{mod_name}.{attr}" if mod_name else attr] = t
    return out


class _UseRecorder(TorchFunctionMode):
    """Notes which module's own code hands each known tensor to a torch function, and which
    children's outputs their caller's own code combines with other tensors.

    Outputs of a module with weights are tagged with it, in its caller (the innermost module
    with weights around it); results of ops on tagged tensors carry the tags on. An op in the
    caller's own code whose tensor arguments come from more than one source (two children,
    or a child and anything else) marks those children: their outputs must be handed back
    to the caller's device. The others can stay where they were computed.
    """

    def __init__(self, names: dict[int, str], stack: list[str], callers: list[str],
                 uses: dict[str, set[str]], combined: set[str]):
        super().__init__()
        self.names, self.stack, self.callers = names, stack, callers
        self.uses, self.combined = uses, combined
        self.tags: dict[int, tuple[str, frozenset[str]]] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids of tagged tensors from being reused

    def tag(self, obj: Any, caller: str, sources: frozenset[str]) -> None:
        for leaf in pytree.tree_leaves(obj):
            if isinstance(leaf, torch.Tensor):
                self.tags[id(leaf)] = (caller, sources)
                self.alive.append(leaf)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if self.stack:
            for leaf in leaves:
                name = self.names.get(id(leaf))
                if name is not None:
                    self.uses.setdefault(name, set()).add(self.stack[-1])
        result = func(*args, **kwargs)
        if self.callers and leaves:
            caller = self.callers[-1]
            sources: set[str] = set()
            other = False
            for leaf in leaves:
                tag = self.tags.get(id(leaf))
                if tag is not None and tag[0] == caller:
                    sources |= tag[1]
                else:
                    other = True
            if len(leaves) > 1 and len(sources) + other > 1:
                self.combined |= sources
            if sources:
                self.tag(result, caller, frozenset(sources))
        return result


def _run_recorded(model: nn.Module, call: Any, names: dict[int, str]) -> Recording:
    module_names = {id(m): n for n, m in model.named_modules()}
    weighted = {id(m) for m in model.modules()
                if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None}
    order: list[str] = []
    seen: set[str] = set()
    stack: list[str] = []
    callers: list[str] = []  # the innermost modules with weights
    uses: dict[str, set[str]] = {}
    combined: set[str] = set()
    recorder = _UseRecorder(names, stack, callers, uses, combined)

    def pre(module: nn.Module, _args: Any) -> None:
        name = module_names.get(id(module), "?")
        if name not in seen:
            seen.add(name)
            order.append(name)
        stack.append(name)
        if id(module) in weighted:
            callers.append(name)

    def post(module: nn.Module, _args: Any, out: Any) -> None:
        if stack:
            stack.pop()
        if id(module) in weighted and callers:
            name = callers.pop()
            if callers and out is not None:
                recorder.tag(out, callers[-1], frozenset((name,)))

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    try:
        with torch.no_grad(), recorder:
            call()
    finally:
        for h in handles:
            h.remove()
    return Recording(order, uses, combined=combined)


def record_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Recording:
    """Run ``model(*args, **kwargs)`` once to learn execution order and who reads which tensor.

    The forward runs on meta copies of weights and inputs, costing no memory. A model that
    cannot run on meta (data-dependent control flow, tensors kept outside its registries) is
    run for real, under ``no_grad``, on its own device with the inputs moved there.
    """
    tensors = canonical_tensors(model)
    metas = {id(t): torch.empty_like(t, device="meta") for t in tensors.values()}
    names = {id(metas[id(t)]): n for n, t in tensors.items()}
    params = {n: metas[id(t)] for n, t in model.named_parameters(remove_duplicate=False)}
    params.update({n: metas[id(t)] for n, t in model.named_buffers(remove_duplicate=False)})
    to_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    try:
        return _run_recorded(
            model, lambda: torch.func.functional_call(model, params, to_meta[0], to_meta[1]), names
        )
    except Exception as exc:  # noqa: BLE001 - any failure on meta means "run it for real"
        _log.info("adaptmem: the model cannot run on meta (%s); recording a real forward", exc)
    home = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    real = pytree.tree_map_only(torch.Tensor, lambda t: t.to(home), (args, kwargs))
    rec = _run_recorded(model, lambda: model(*real[0], **real[1]),
                        {id(t): n for n, t in tensors.items()})
    rec.on_meta = False
    return rec


def _inside(module: str, ancestor: str) -> bool:
    return ancestor == "" or module == ancestor or module.startswith(ancestor + ".")


def placement_units(
    model: nn.Module, sizes: ModuleSizes, recording: Recording | None
) -> list[Unit]:
    """The finest units that can live apart: each module's own tensors, except that a module
    of an ``ATOMIC_MODULE_TYPES`` type is one unit, and tensors an ancestor's own code reads
    (``MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``) join that
    ancestor's unit. Registration order; ``order_units`` sorts them."""
    units = paging_units(sizes, 0)
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.get(key, key) != key:
            key = parent[key]
        return key

    def absorb(ancestor: str, module: str) -> None:
        top, low = find(ancestor), find(module)
        if top == low:
            return
        # The representative is always the shallower module, so groups stay subtrees.
        if _inside(top, low):
            top, low = low, top
        parent[low] = top

    modules = dict(model.named_modules())
    for name in sizes.modules:
        if isinstance(modules.get(name), ATOMIC_MODULE_TYPES):
            for u in units:
                if _inside(u.module, name):
                    absorb(name, u.module)
    owner_unit = {t: u.module for u in units for t in u.tensors}
    for tensor, users in (recording.uses if recording else {}).items():
        if tensor not in owner_unit:
            continue
        holder = owner_unit[tensor]
        for user in users:
            if user != holder and _inside(holder, user) and not _inside(user, holder):
                absorb(user, holder)
    rank = {n: i for i, n in enumerate(sizes.tensors)}
    groups: dict[str, list[Unit]] = {}
    for u in units:
        groups.setdefault(find(u.module), []).append(u)
    merged: list[Unit] = []
    for key, members in groups.items():
        if len(members) == 1 and members[0].module == key:
            merged.append(members[0])
            continue
        owned = tuple(sorted({t for u in members for t in u.tensors}, key=rank.__getitem__))
        borrowed = tuple(sorted({t for u in members for t in u.borrowed} - set(owned)))
        whole = all(u in members for u in units if _inside(u.module, key))
        merged.append(Unit(key, not whole, sizes.bytes_of(owned), owned, borrowed))
    position = {id(u): i for i, u in enumerate(units)}
    merged.sort(key=lambda u: min(
        (position[id(m)] for m in groups.get(u.module, [u]) if id(m) in position), default=0))
    return merged


def plan_placement(
    model: nn.Module,
    sizes: ModuleSizes,
    targets: Sequence[Target],
    recording: Recording | None,
    *,
    mode: str,
    device_map: Mapping[str, str] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Plan:
    """Units in execution order, each given a target label: a prefix per target in order of
    ``targets`` by capacity (bytes in the dtype placed there), or as ``device_map`` says."""
    units = placement_units(model, sizes, recording)
    if recording is not None:
        units = order_units(units, recording.order)
    by_label = {t.label: t for t in targets}
    if device_map is None:
        placed = assign_devices(units, sizes, [(t.label, t.capacity, t.dtype) for t in targets])
    else:
        placed = [replace(u, placement=label_for_unit(u, device_map, by_label)) for u in units]
        check_ties(placed)
    used = placed_bytes(placed, sizes, by_label)
    for t in targets:
        if t.capacity is not None and used.get(t.label, 0) > t.capacity:
            raise PlacementError(
                f"the model does not fit: {t.label} would hold {format_bytes(used[t.label])} "
                f"but its capacity is {format_bytes(t.capacity)}; raise that capacity or add "
                f"an unlimited device last, e.g. {{..., 'cpu': None}}"
            )
    opts = {
        "devices": {t.label: t.capacity for t in targets},
        "dtypes": {t.label: _dtype_name(t.dtype) for t in targets if t.dtype is not None},
        "placed_bytes": used,
        "order": "recorded" if recording is not None else "registration",
    }
    opts.update(options or {})
    return Plan(mode, placed, sizes.total_bytes, opts)


def placed_bytes(units: Iterable[Unit], sizes: ModuleSizes, targets: Mapping[str, Target]
                 ) -> dict[str, int]:
    """Bytes per target label, counted in the dtype each target gives floating tensors."""
    used: dict[str, int] = {label: 0 for label in targets}
    for u in units:
        dtype = targets[u.placement].dtype if u.placement in targets else None
        used[u.placement] = used.get(u.placement, 0) + sizes.bytes_of(u.tensors, dtype)
    return used


def label_for_unit(unit: Unit, device_map: Mapping[str, str], targets: Mapping[str, Target]
                   ) -> str:
    """The one label ``device_map`` gives every tensor of ``unit`` (most specific key wins)."""
    names = unit.tensors or (unit.module,)
    found: dict[str, str] = {}
    for name in names:
        key = name
        while key not in device_map:
            if key == "":
                raise PlacementError(
                    f"device_map places no entry for {name!r}: add it (or one of its parent "
                    f"modules, '' for the whole model) with a device such as 'cpu'"
                )
            key = key.rpartition(".")[0]
        found[name] = str(device_map[key])
    labels = set(found.values())
    if len(labels) > 1:
        raise PlacementError(
            f"device_map splits {unit.name!r}, whose tensors must stay together "
            f"({', '.join(f'{n}->{v}' for n, v in found.items())}): its forward reads them all; "
            f"give {unit.module or 'the model'!r} one device"
        )
    label = labels.pop()
    if label not in targets:
        raise PlacementError(
            f"device_map places {unit.name!r} on {label!r}, which is not one of this "
            f"placement's devices {sorted(targets)}; use one of those labels"
        )
    return label


def check_ties(units: Sequence[Unit]) -> None:
    """A unit that borrows a tied tensor must sit where the tensor's owner sits."""
    where = {t: u.placement for u in units for t in u.tensors}
    for u in units:
        for t in u.borrowed:
            if where.get(t, u.placement) != u.placement:
                raise PlacementError(
                    f"device_map puts {u.name!r} on {u.placement!r} but the tied tensor {t!r} "
                    f"it shares lives on {where[t]!r}; tied tensors are never duplicated, so give "
                    f"both the same device"
                )


def capacity_of(value: Any, name: str) -> int | None:
    """Bytes from a capacity (int, "20GiB"); None means unlimited."""
    return None if value is None else parse_size(value, name)


def auto_capacity(device: torch.device, reserve: Any = "auto") -> tuple[int, int]:
    """``(capacity, reserve)`` in bytes for ``capacity="auto"``: free memory minus a reserve.

    ``reserve="auto"`` keeps back the larger of 10% of the device's total memory and
    512 MiB, for activations, the conversion copies at unit boundaries and the allocator's
    slack; pass bytes (or "2GiB") to choose it yourself.
    """
    free, total = memory_info(device)
    if reserve == "auto":
        kept = max(total // 10, _MIN_RESERVE)
    else:
        kept = capacity_of(reserve, "reserve") or 0
    return max(0, free - kept), kept


def targets_from_devices(devices: Any, dtype: Any, reserve: Any) -> list[Target]:
    """Targets from ``split``'s ``devices`` (mapping or list) and ``dtype`` arguments."""
    if isinstance(devices, (str, torch.device, int)) or not isinstance(devices, (Mapping, Sequence)):
        raise TypeError(
            f"devices must be an ordered mapping like {{'cuda:0': '20GiB', 'cpu': None}} or a "
            f"list like ['cuda:0', 'cuda:1'], got {devices!r}"
        )
    items = list(devices.items()) if isinstance(devices, Mapping) else [(d, "auto") for d in devices]
    if not items:
        raise ValueError("devices is empty: name at least one device, e.g. {'cpu': None}")
    if dtype is not None and not isinstance(dtype, Mapping):
        dtype = parse_dtype(dtype)
    resolved = []
    for key, capacity in items:
        key_dtype = None
        if isinstance(key, tuple) and len(key) == 2:
            key, key_dtype = key[0], parse_dtype(key[1], f"the dtype in devices key {key!r}")
        elif isinstance(key, str) and "@" in key:
            key, key_dtype = split_label(key)
        dev = resolve_device(key, f"devices key {key!r}")
        if key_dtype is None:
            if isinstance(dtype, Mapping):
                given = [v for k, v in dtype.items() if str(k) in (str(key), str(dev))]
                key_dtype = parse_dtype(given[0], f"dtype[{key!r}]") if given else None
            else:
                key_dtype = dtype
        cap: int | None
        if isinstance(capacity, str) and capacity == "auto":
            cap, _ = auto_capacity(dev, reserve)
        else:
            cap = capacity_of(capacity, f"devices[{key!r}]")
        resolved.append((dev, cap, key_dtype))
    labels = qualify_labels([(d, t) for d, _, t in resolved])
    return [Target(d, c, t, label) for (d, c, t), label in zip(resolved, labels, strict=True)]
