"""The recorded forward: one run of a model that shows what placement needs to know.

[Note: recording on a copy]
Placement learns from one forward: the order modules first run in, which module's own code
hands which tensor to a torch function, and which outputs a caller combines with other
tensors. That forward must leave no trace, on the model or on anything the caller passed:
models build tensors from their own state and keep them (anchor caches), callers pass
objects the forward writes into (a Hugging Face ``DynamicCache``), buffers count steps.
So it never runs on the model itself. It runs on a deep copy of the model and of the
inputs, made while ``_CopyTensors`` turns every tensor the copy meets into a meta tensor
of the same shape, dtype and strides: the copy costs no tensor memory, and ties (a tensor
or module reachable under several names) stay ties, because deepcopy's memo maps each
object once. Only a model that cannot run on meta (data-dependent control flow, ``.item()``)
runs for real, on a copy that shares the parameters (read, never written, in inference) and
holds copies of the buffers and of everything else; the random number generators of the
CPU and the model's device are put back afterwards.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._common.claims import holder
from .._common.errors import PlacementError
from .._common.tree import canonical_tensors, tensors_in

__all__ = ["Recording", "meta_copy", "record_execution_order", "record_forward"]

_log = logging.getLogger("adaptmem")


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
    # The dtype of the forward's first floating output (None: it had none).
    output_dtype: torch.dtype | None = None


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    try:
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
    except (RuntimeError, NotImplementedError):  # layouts without strides (sparse, ...)
        out = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad and t.is_floating_point())


def _real_copy(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone()
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out


class _CopyTensors(TorchFunctionMode):
    """While ``copy.deepcopy`` runs under it, every tensor is copied by ``make``.

    ``Tensor.__deepcopy__`` reaches a torch-function mode before anything else, and
    ``Parameter.__deepcopy__`` clones ``self.data``: both are answered here, so no tensor
    storage is copied unless ``make`` copies it, and non-leaf tensors copy too.
    """

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.make = make

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__deepcopy__ or func is torch.Tensor.clone:
            return self.make(args[0])
        return func(*args, **(kwargs or {}))


def _copy(obj: Any, make: Callable[[torch.Tensor], torch.Tensor],
          memo: dict[int, Any]) -> Any:
    with _CopyTensors(make):
        return copy.deepcopy(obj, memo)


def meta_copy(obj: Any) -> Any:
    """A deep copy of ``obj`` in which every tensor (inside modules and objects too) is a meta
    tensor of the same shape, dtype and strides; ties stay ties and nothing is allocated. The
    hooks an engine put on a module in ``obj`` are left off its copy. See [Note: recording
    on a copy]."""
    engines = _machinery(_modules_in(obj))
    try:
        copied = _copy(obj, _meta_like, dict(engines))
    except Exception as exc:  # noqa: BLE001 - any object deepcopy cannot copy
        raise PlacementError(
            f"adaptmem traces on a meta copy of the arguments (so that none of them changes), "
            f"but they cannot be deep-copied: {type(exc).__name__}: {exc}"
        ) from exc
    for m in _modules_in(copied):
        _drop_hooks_of(m, set(engines))
    return copied


def _modules_in(obj: Any) -> list[nn.Module]:
    """Modules among ``obj``'s nested tuples, lists and dict values."""
    if isinstance(obj, nn.Module):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return [m for item in items for m in _modules_in(item)]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_PACKAGE = __name__.split(".")[0] + "."


def _hooks(module: nn.Module) -> list[tuple[dict[Any, Any], Any, Any]]:
    """(its dict, key, hook) for every hook on ``module``."""
    out: list[tuple[dict[Any, Any], Any, Any]] = []
    for attr in _HOOK_DICTS:
        hooks = getattr(module, attr, None)
        if hooks:
            out.extend((hooks, key, hook) for key, hook in list(hooks.items()))
    return out


def _owner(hook: Any) -> Any:
    """The object a hook is a method of (None for a plain function)."""
    return getattr(getattr(hook, "func", hook), "__self__", None)


def _ours(hook: Any) -> bool:
    """Whether ``hook`` is adaptmem's: a method of one of its objects, or one of its
    functions."""
    owner = _owner(hook)
    where = type(owner).__module__ if owner is not None else getattr(
        getattr(hook, "func", hook), "__module__", None)
    return isinstance(where, str) and where.startswith(_PACKAGE)


def _machinery(modules: Iterable[nn.Module]) -> dict[int, Any]:
    """The engines holding ``modules`` and every adaptmem object whose methods are hooks on
    them (a clock timing several models, engines of other models): copies share these
    instead of copying them. Copying one would reach everything it hooks, other models and
    their engines too, which refuse to be copied."""
    found: dict[int, Any] = {}
    for model in modules:
        engine = holder(model)
        if engine is not None:
            found[id(engine)] = engine
        for module in model.modules():
            for _, _, hook in _hooks(module):
                owner = _owner(hook)
                if owner is not None and _ours(hook):
                    found[id(owner)] = owner
    return found


# [Note: recording a model already on two devices] A model loaded straight where a plan
# puts it (``adaptive.load(..., device=plan)``: part on the GPU, part on the host, maybe in
# two dtypes) and then split by that plan is recorded before any boundary exists. Where it
# cannot run on meta (a Hugging Face model given an attention mask reads values), the real
# forward on the copy would mix devices at the first module on the other side. So the copy
# gets boundaries of its own for that one forward, as the splitter's: a module with tensors
# of its own gets its inputs on its device, in its floating dtype; a module's outputs go
# back to where its caller computes (a block adding a child's output to its residual). A
# ``.to`` of one tensor neither reads a weight nor combines outputs, so the recording
# learns what it would have on one device.
def _align_inputs(replica: nn.Module) -> None:
    frames: list[tuple[torch.device, torch.dtype | None]] = []  # where each call computes
    # Read now, outside the recording: a weight's metadata read in a hook would count as
    # the module around it reading the weight.
    owns: dict[int, tuple[torch.device, torch.dtype]] = {}
    for module in replica.modules():
        own = next((t for t in (*module._parameters.values(), *module._buffers.values())
                    if t is not None and t.is_floating_point()), None)
        if own is not None:
            owns[id(module)] = (own.device, own.dtype)

    def place(obj: Any, where: tuple[torch.device, torch.dtype | None]) -> Any:
        device, dtype = where

        def move(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(device, dtype)
            return t.to(device)

        return pytree.tree_map_only(torch.Tensor, move, obj)

    def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
        own = owns.get(id(module))
        if own is not None:
            frames.append(own)
            return place((args, kwargs), own)
        first = next((t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        frames.append((first.device, None) if first is not None else
                      frames[-1] if frames else (torch.device("cpu"), None))
        return None

    def post(module: nn.Module, args: Any, output: Any) -> Any:
        frames.pop()
        return place(output, (frames[-1][0], None)) if frames and output is not None else None

    for module in replica.modules():
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, always_call=True)


def _drop_hooks_of(model: nn.Module, owners: set[int]) -> None:
    """Remove from ``model`` (a copy) adaptmem's hooks: methods of ``owners`` and its own
    functions. An engine holding the original must not act on the copy, nor a clock count
    the copy's forward."""
    for module in model.modules():
        for hooks, key, hook in _hooks(module):
            owner = _owner(hook)
            if (owner is not None and id(owner) in owners) or (owner is None and _ours(hook)):
                del hooks[key]


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
        for leaf in tensors_in(obj):  # as the engines walk outputs: dataclasses too
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


def _run_recorded(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Recording:
    names = {id(t): n for n, t in canonical_tensors(model).items()}
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
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    dtype = next((t.dtype for t in tensors_in(out) if t.is_floating_point()), None)
    return Recording(order, uses, combined=combined, output_dtype=dtype)


def _rng_devices(device: torch.device) -> tuple[list[int], str]:
    if device.type in ("cpu", "meta"):
        return [], "cuda"
    return [device.index or 0], device.type


def record_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   keep: Iterable[object] = ()) -> Recording:
    """Run ``model(*args, **kwargs)`` once, on a copy, to learn execution order, who reads
    which tensor and which outputs callers combine. See [Note: recording on a copy]: neither
    the model nor the inputs (nor anything reachable from them) change.

    Args:
        model: the model; names in the result are its ``named_modules()`` names.
        args, kwargs: the call's inputs; tensors anywhere in them (inside objects too).
        keep: objects the copies share instead of copying; their hooks are left off the
            copy. The engine holding ``model``, if any, and every adaptmem object hooked on
            it are always among them.

    Raises:
        PlacementError: the model or the inputs cannot be deep-copied.
        Exception: what the forward raised, when it fails for real, or on meta for a model
            with meta tensors (there is nothing real to run instead).
    """
    tensors = canonical_tensors(model)
    home = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    shared = {**{id(k): k for k in keep}, **_machinery([model])}
    try:
        memo: dict[int, Any] = dict(shared)
        replica, inputs = _copy((model, (args, kwargs)), _meta_like, memo)
    except Exception as exc:  # noqa: BLE001 - any object deepcopy cannot copy
        raise PlacementError(
            f"adaptmem records one forward on a copy of the model and its inputs (so that "
            f"neither changes), but they cannot be deep-copied: {type(exc).__name__}: {exc}. "
            f"Make that object deep-copyable, or pass example_inputs that can be copied"
        ) from exc
    _drop_hooks_of(replica, set(shared))
    devices, device_type = _rng_devices(home)
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        try:
            return _run_recorded(replica, *inputs)
        except Exception as exc:  # noqa: BLE001 - any failure on meta means "run it for real"
            failure = exc
        del replica, inputs
        if any(t.is_meta for t in tensors.values()):
            raise failure  # nothing real to run instead: the forward's own error says why
        _log.info("adaptmem: the model cannot run on meta (%s); recording a real forward "
                  "on a copy that shares its parameters", failure)
        memo = dict(shared)
        memo.update({id(p): p for p in model.parameters()})
        replica, inputs = _copy((model, (args, kwargs)), _real_copy, memo)
        _drop_hooks_of(replica, set(shared))
        inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(home), inputs)
        if len({(t.device, t.dtype) for t in tensors.values() if t.is_floating_point()}) > 1:
            _align_inputs(replica)  # See [Note: recording a model already on two devices]
        rec = _run_recorded(replica, *inputs)
    rec.on_meta = False
    return rec


def record_execution_order(model: nn.Module, *args: Any, **kwargs: Any) -> list[str]:
    """Module names in first-call order, from one forward of ``model(*args, **kwargs)``.

    The forward runs on a copy (meta when it can; see [Note: recording on a copy] in
    ``recording.py``), so neither the model nor the inputs change.
    """
    return record_forward(model, args, kwargs).order
