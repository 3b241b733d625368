"""Where CUDA lets CPU and CUDA tensors meet in one op, and the errors where it does not.

An op refuses tensors of two devices (CPU scalars aside), but indexing mixes them by rule:
``cuda_tensor[cpu_or_cuda_index]`` is read, ``cpu_tensor[cuda_index]`` is refused (aten's
``index`` checks its indices), and a write ``t[index] = value`` moves the indices to
``t``'s device but not the value, unless it is 0-dim or a one-element CPU tensor written
through one boolean mask on ``t``'s device (a ``masked_fill_``; ``index_put_`` with
``accumulate=True`` never takes that path): a write through basic indexing (ints,
slices) is a ``copy_``, which any two devices may take part in."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INDEX_PUTS", "check_index_op", "check_item_access", "mixed"]

aten = torch.ops.aten
INDEX_PUTS = {aten.index_put_.default, aten.index_put.default,
              aten._index_put_impl_.default}


def mixed(a: str, b: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{a} and {b}! (simulated CUDA)")


def _indices_elsewhere(device: torch.device) -> RuntimeError:
    return RuntimeError(
        f"indices should be either on cpu or on the same device as the indexed tensor "
        f"({device}) (simulated CUDA): move the indices to the CPU (index.cpu()) or the "
        f"indexed tensor to their device")


def _value_elsewhere(target: torch.Tensor, value: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{target.device} and {value.device}! (simulated CUDA: a write through advanced "
        f"indexing takes a value on the written tensor's device, or a 0-dim one; move the "
        f"value with .to({str(target.device)!r}))")


def _basic(i: Any) -> bool:
    return i is None or i is Ellipsis or (isinstance(i, (int, slice)) and i is not True
                                          and i is not False)


def _masked_fill(target: torch.Tensor, indices: Any, value: torch.Tensor) -> bool:
    """aten's ``index_put_`` writes a one-element CPU value through one mask on the
    target's device as ``masked_fill_(mask, value.item())``, whatever the devices."""
    if value.numel() != 1 or value.is_cuda:
        return False
    masks = 0
    for i in indices:
        if isinstance(i, torch.Tensor):
            if i.dtype not in (torch.bool, torch.uint8) or i.device != target.device:
                return False
            masks += 1
        elif not _basic(i):
            return False
    return masks == 1


def _advanced(index: Any) -> bool:
    """``index`` makes ``t[index]`` advanced indexing (an ``index``/``index_put_``), not a
    view: a tensor other than a 0-dim integer one, a list, an array, a bool."""
    for i in index if type(index) is tuple else (index,):
        if isinstance(i, torch.Tensor):
            if i.dim() or i.dtype in (torch.bool, torch.uint8):
                return True
        elif not _basic(i):
            return True
    return False


def check_item_access(func: Any, args: Any) -> None:
    """``t[index]`` or ``t[index] = value`` (the Python bindings) refused as CUDA refuses
    them. Called only when a CUDA tensor takes part and ``t`` is a CPU tensor or a CPU
    tensor of one dimension or more is among the arguments."""
    target, index = args[0], args[1]
    if func is torch.Tensor.__getitem__:
        if not target.is_cuda:
            for i in index if type(index) in (tuple, list) else (index,):
                if isinstance(i, torch.Tensor) and i.is_cuda and i.dim():
                    raise _indices_elsewhere(target.device)
        return
    value = args[2] if len(args) > 2 else None
    if (isinstance(value, torch.Tensor) and value.dim() and value.device != target.device
            and _advanced(index)
            and not _masked_fill(target, index if type(index) is tuple else (index,), value)):
        raise _value_elsewhere(target, value)


def check_index_op(func: Any, args: Any) -> None:
    """The aten indexing ops (``aten.index``, ``index_put_``) refused as CUDA refuses them,
    for an op mixing CPU and CUDA tensors."""
    target = args[0]
    if func is aten.index.Tensor:
        if not target.is_cuda and any(isinstance(i, torch.Tensor) and i.is_cuda
                                      for i in args[1]):
            raise _indices_elsewhere(target.device)
    elif func in INDEX_PUTS:
        value = args[2]
        # aten takes the masked_fill_ path only without accumulate=True.
        accumulate = len(args) > 3 and bool(args[3])
        if (value.dim() and value.device != target.device
                and (accumulate or not _masked_fill(target, args[1], value))):
            raise _value_elsewhere(target, value)
