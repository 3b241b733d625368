"""What the simulation refuses, and the error it refuses with.

A simulated tensor is a dense (strided) wrapper over a CPU tensor, found by its storage
(See [Note: how a simulated tensor finds its values] in _tensors.py): a sparse tensor has
no storage, and a wrapper made for one would be a dense tensor of its shape, so every call
that would make one on the device is refused (``refuse_layout``) rather than densified.
An op whose only kernel is CUDA's, with no CPU equivalent in the simulation (_kernels.py),
is refused by name (``no_cpu_kernel``), not with torch's "Could not run ... with arguments
from the 'CPU' backend", which names the wrong device. An op with kernels for the CPU only
is refused on device tensors as CUDA refuses it (``no_cuda_kernel``), not run in silence."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SimulatedCudaError", "no_cpu_kernel", "no_cuda_kernel", "refuse_layout"]


class SimulatedCudaError(RuntimeError):
    """What the simulation does not simulate (``torch.autocast("cuda")``, sparse tensors on
    the device, a CUDA-only kernel it has no CPU equivalent for), refused where it is asked
    for; and stream misuse it saw but could not raise where it happened (a tensor freed
    while another stream still used it), raised when the simulation ends."""


_SPARSE = {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
           torch.sparse_bsc}


def refuse_layout(layout: torch.layout, what: Any, device: Any) -> None:
    """Raise ``SimulatedCudaError`` when ``what`` (an op, a call) would make a tensor of
    ``layout`` on simulated ``device``: only dense (strided) tensors are simulated."""
    if layout is torch.strided:
        return
    kind = "sparse tensors" if layout in _SPARSE else f"tensors of layout {layout}"
    raise SimulatedCudaError(
        f"simulated CUDA: {kind} are not simulated: {_name(what)} would make a {layout} "
        f"tensor on {device}. Keep it on the CPU, or make it dense first (t.to_dense()) "
        f"to test with the memory of its dense form; sparse code needs a real GPU")


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


def no_cuda_kernel(func: Any) -> NotImplementedError:
    """What CUDA raises for op ``func`` on device tensors when it has kernels for the CPU
    only (a dynamic quantized linear): torch's own error, with its words."""
    return NotImplementedError(
        f"Could not run '{_name(func)}' with arguments from the 'CUDA' backend (simulated "
        f"CUDA, as a real GPU): the op has kernels for the CPU only. Run it on the CPU "
        f"(keep that module and its inputs there), or use an op with a CUDA kernel")


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
