"""What the simulation refuses, and the error it refuses with.

An op whose only kernel is CUDA's, with no CPU equivalent in the simulation (_kernels.py),
is refused by name (``no_cpu_kernel``), not with torch's "Could not run ... with arguments
from the 'CPU' backend", which names the wrong device."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SimulatedCudaError", "no_cpu_kernel"]


class SimulatedCudaError(RuntimeError):
    """What the simulation does not simulate (``torch.autocast("cuda")``, a CUDA-only kernel
    it has no CPU equivalent for), refused where it is asked for; and stream misuse it saw
    but could not raise where it happened (a tensor freed while another stream still used
    it), raised when the simulation ends."""


def no_cpu_kernel(func: Any, index: int) -> SimulatedCudaError:
    """The error for op ``func`` on ``cuda:index`` when its only kernels are CUDA's and the
    simulation has no CPU equivalent for it."""
    hint = ""
    if "cudnn" in str(func) or "miopen" in str(func):
        hint = (" The simulated device has no cuDNN: torch.backends.cudnn.enabled is False "
                "inside the block (torch then takes its own CUDA kernels), and was turned on "
                "there; leave it off under simulated_cuda.")
    return SimulatedCudaError(
        f"simulated CUDA: {_name(func)} has only a CUDA kernel, and the simulation has no CPU "
        f"equivalent for it, so it cannot run on cuda:{index}.{hint} Run this code on a real "
        f"GPU, or report the op so that an equivalent can be added")


def _name(what: Any) -> str:
    """What the user called, in their words: ``torch.empty_like``, ``Tensor.new_zeros``."""
    if isinstance(what, torch._ops.OpOverload):
        return str(what._schema.name)
    qualname = getattr(what, "__qualname__", None)
    if qualname is None:
        return str(what)
    owner, _, name = qualname.rpartition(".")
    if owner.startswith("_VariableFunctions"):
        return f"torch.{name}"
    return f"Tensor.{name}" if owner == "TensorBase" else qualname
