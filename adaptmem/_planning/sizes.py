"""Bytes over a module tree: every distinct tensor once (tied tensors counted once), by module
and by subtree. Pure arithmetic; works on a model built on the meta device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._common.tree import join_name, registrations

__all__ = ["HiddenWeightsError", "TensorInfo", "ModuleSizes", "module_sizes", "tensor_bytes"]

_NOT_OURS = ("Run a quantized model without adaptmem (dynamic quantization runs on the "
             "CPU), or give adaptmem the float model")


class HiddenWeightsError(ValueError):
    """A model keeps weights adaptmem cannot count or move: packed in a ``torch.ScriptObject``
    (``torch.ao`` quantized modules' ``_packed_params``) or quantized tensors."""


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes ``t`` takes, or would take with its floating values converted to ``dtype``."""
    if dtype is not None and t.is_floating_point():
        return t.numel() * dtype.itemsize
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class TensorInfo:
    """One distinct tensor of a model; ``aliases`` are its other qualified names (ties)."""

    name: str
    module: str
    attr: str
    kind: str  # "parameter" or "buffer"
    nbytes: int
    numel: int
    dtype: torch.dtype
    floating: bool
    aliases: tuple[str, ...] = ()

    def bytes_as(self, dtype: torch.dtype | None) -> int:
        if dtype is not None and self.floating:
            return self.numel * dtype.itemsize
        return self.nbytes


@dataclass
class ModuleSizes:
    """Bytes of every module of a model, counting each distinct tensor once.

    ``own[m]`` lists the tensors registered directly on module ``m``; ``subtree_bytes[m]``
    counts the distinct tensors of ``m`` and everything below it. Modules registered under
    two names appear once, under the first name ``named_modules()`` gives.
    """

    modules: list[str]
    children: dict[str, list[str]]
    own: dict[str, list[str]]
    tensors: dict[str, TensorInfo]
    subtree_bytes: dict[str, int]
    subtree_tensors: dict[str, frozenset[str]]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def own_bytes(self, module: str, dtype: torch.dtype | None = None) -> int:
        return sum(self.tensors[n].bytes_as(dtype) for n in self.own[module])

    def bytes_of(self, names: Iterable[str], dtype: torch.dtype | None = None) -> int:
        return sum(self.tensors[n].bytes_as(dtype) for n in names)

    def largest_tensor(self) -> TensorInfo | None:
        return max(self.tensors.values(), key=lambda t: t.nbytes, default=None)


def _refuse_packed(name: str, module: nn.Module) -> None:
    """Refuse ``module`` when it keeps weights outside its parameters and buffers, where they
    would count as 0 bytes and stay where they are."""
    packed = next((k for k, v in vars(module).items() if isinstance(v, torch.ScriptObject)),
                  None)
    if packed is not None:
        raise HiddenWeightsError(
            f"module {name or '<root>'!r} ({type(module).__name__}) keeps its weights packed "
            f"in {packed!r} (a torch.ScriptObject, as torch.ao quantized modules do), outside "
            f"its parameters and buffers, where adaptmem cannot count or move them. {_NOT_OURS}")


def module_sizes(model: nn.Module) -> ModuleSizes:
    """Walk ``model`` once and count bytes per module, dtype-aware, ties counted once."""
    modules: list[str] = []
    children: dict[str, list[str]] = {}
    own: dict[str, list[str]] = {}
    tensors: dict[str, TensorInfo] = {}
    aliases: dict[str, list[str]] = {}
    seen_modules: dict[int, str] = {}
    walked = list(model.named_modules())
    for mod_name, module in walked:
        seen_modules[id(module)] = mod_name
    for mod_name, module in walked:
        _refuse_packed(mod_name, module)
        modules.append(mod_name)
        own[mod_name] = []
        # A child registered under two names is the child of its first registration only
        # (the name named_modules() gives), wherever the other one sits.
        children[mod_name] = [
            full for child_name, child in module.named_children() if child is not None
            and seen_modules[id(child)] == (full := join_name(mod_name, child_name))]
    for r in registrations(model):  # see [Note: canonical tensor names] in _common/tree.py
        if r.name != r.canonical:
            aliases[r.canonical].append(r.name)
            continue
        t = r.tensor
        if is_lazy(t):
            owner = type(model.get_submodule(r.module_name)).__name__
            raise ValueError(
                f"{r.name!r} ({owner}) is an uninitialised lazy "
                f"{'parameter' if r.kind == 'parameter' else 'buffer'}: its shape is not known "
                f"yet. Run one forward pass (or build the module with its sizes) before "
                f"handing the model to adaptmem")
        if t.is_quantized:
            raise HiddenWeightsError(
                f"{r.name!r} is a quantized tensor ({t.dtype}), which adaptmem cannot count or "
                f"move. {_NOT_OURS}")
        aliases[r.name] = []
        own[r.module_name].append(r.name)
        tensors[r.name] = TensorInfo(r.name, r.module_name, r.attr, r.kind, tensor_bytes(t),
                                     t.numel(), t.dtype, t.is_floating_point())
    for name, extra in aliases.items():
        if extra:
            tensors[name] = replace(tensors[name], aliases=tuple(extra))
    # children[] only keeps each module's first registration, so this is a tree.
    subtree_tensors: dict[str, frozenset[str]] = {}
    for mod_name in reversed(modules):
        names = set(own[mod_name])
        for kid in children[mod_name]:
            names |= subtree_tensors[kid]
        subtree_tensors[mod_name] = frozenset(names)
    # A tensor registered on module A and tied into module B belongs to B's subtree too.
    for canonical, extra in aliases.items():
        for alias in extra:
            holder = alias.rpartition(".")[0]
            parts = holder.split(".") if holder else []
            for i in range(len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in subtree_tensors:
                    subtree_tensors[prefix] = subtree_tensors[prefix] | {canonical}
    subtree_bytes = {
        m: sum(tensors[n].nbytes for n in names) for m, names in subtree_tensors.items()
    }
    return ModuleSizes(modules, children, own, tensors, subtree_bytes, subtree_tensors)
