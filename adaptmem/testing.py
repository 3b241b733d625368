"""Test helpers users need too: realistic out-of-memory errors, a memory ceiling and a
simulated CUDA device.

``raise_oom(kind)`` raises the exact error a backend raises when memory runs out, and
``MemoryCeiling`` makes any function behave as if the device held only so much, so code
decorated with ``adaptive.batch`` can be tested on a machine without an accelerator.
``simulated_cuda()`` runs code written for CUDA unchanged on the CPU (see its docstring);
``adaptmem.testing_plugin`` is a pytest plugin with a ``simulated_cuda_device`` fixture.

Example:
    >>> from adaptmem import adaptive
    >>> from adaptmem.testing import MemoryCeiling
    >>> ceiling = MemoryCeiling(100)
    >>> @adaptive.batch(initial_batchsize=512, cache=adaptive.NoBatchsizeCache)
    ... def infer(batchsize):
    ...     ceiling.require(batchsize)
    ...     return batchsize
    >>> infer()
    64
    >>> ceiling.failures
    [512, 256, 128]
"""

from __future__ import annotations

import numbers
import threading
from typing import Any, NoReturn

import torch

from ._simcuda import SimulatedCuda, SimulatedCudaError, StreamRaceError, simulated_cuda

__all__ = ["OOM_KINDS", "make_oom", "raise_oom", "MemoryCeiling", "SimulatedCuda",
           "SimulatedCudaError", "StreamRaceError", "simulated_cuda"]

# The messages backends really print (taken from their sources and from real failures);
# ``{n}`` is the size of the allocation that failed, in bytes.
OOM_KINDS: dict[str, tuple[type[BaseException], tuple[str, ...]]] = {
    "cuda": (torch.OutOfMemoryError, (
        "CUDA out of memory. Tried to allocate {gib:.2f} GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
        "78.12 GiB memory in use. Of the allocated memory 76.50 GiB is allocated by PyTorch, "
        "and 1.02 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",)),
    "cuda-runtime": (RuntimeError, (
        "CUDA out of memory. Tried to allocate {gib:.2f} GiB (GPU 0; 15.78 GiB total capacity; "
        "14.21 GiB already allocated; 45.75 MiB free; 14.61 GiB reserved in total by PyTorch)",)),
    "cuda-driver": (getattr(torch, "AcceleratorError", RuntimeError), (
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
        "other API call, so the stacktrace below might be incorrect.\nFor debugging consider "
        "passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable "
        "device-side assertions.\n",)),
    "cuda-driver-api": (RuntimeError, (  # C10_CUDA_DRIVER_CHECK (c10/cuda/driver_api.h)
        "CUDA driver error: out of memory",)),
    "hip": (torch.OutOfMemoryError, (
        "HIP out of memory. Tried to allocate {gib:.2f} GiB. GPU 0 has a total capacity of "
        "63.98 GiB of which 0 bytes is free. Of the allocated memory 62.10 GiB is allocated by "
        "PyTorch, and 1.41 GiB is reserved by PyTorch but unallocated.",)),
    "mps": (RuntimeError, (
        "MPS backend out of memory (MPS allocated: 17.51 GB, other allocations: 1.36 GB, max "
        "allowed: 18.13 GB). Tried to allocate {mib:.2f} MB on private pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
        "(may cause system failure).",)),
    "xpu": (torch.OutOfMemoryError, (
        "XPU out of memory. Tried to allocate {gib:.2f} GiB. GPU 0 has a total capacity of "
        "15.11 GiB. Of the allocated memory 14.20 GiB is allocated by PyTorch, and 0.10 GiB is "
        "reserved by PyTorch but unallocated.",)),
    "cublas": (RuntimeError, (
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",)),
    "cublas-handle": (RuntimeError, (  # a new thread's handle, device full
        "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",)),
    "cudnn": (RuntimeError, (
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",)),
    "cudnn-alloc": (RuntimeError, ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED",)),
    "cufft": (RuntimeError, ("cuFFT error: CUFFT_ALLOC_FAILED",)),
    "cusolver": (RuntimeError, (
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling "
        "`cusolverDnCreate(handle)`. ",)),
    "cusparse": (RuntimeError, (
        "CUDA error: resource allocation failed when calling `cusparseCreate(&handle)`",)),
    "cpu": (RuntimeError, (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate {n} bytes. Error code 12 (Cannot allocate memory)",)),
    "python": (MemoryError, ()),
    # Some wrappers re-raise with the message split over two arguments.
    "two-args": (RuntimeError, ("CUDA out of memory.", "Tried to allocate {gib:.2f} GiB")),
}


def make_oom(kind: str = "cuda", nbytes: int = 2 * 1024**3) -> BaseException:
    """The exception a backend of ``kind`` raises when ``nbytes`` could not be allocated.

    ``kind`` is one of ``OOM_KINDS``: cuda, cuda-runtime, cuda-driver, cuda-driver-api, hip,
    mps, xpu, cublas, cublas-handle, cudnn, cudnn-alloc, cufft, cusolver, cusparse, cpu,
    python, two-args.
    """
    if not isinstance(kind, str) or kind not in OOM_KINDS:
        raise (ValueError if isinstance(kind, str) else TypeError)(
            f"kind={kind!r} is unknown; use one of {sorted(OOM_KINDS)}")
    exc_type, templates = OOM_KINDS[kind]
    _check_amount(nbytes, "nbytes", "a number of bytes")
    args = tuple(t.format(n=nbytes, gib=nbytes / 1024**3, mib=nbytes / 1024**2) for t in templates)
    return exc_type(*args)


def _check_amount(value: Any, name: str, what: str) -> None:
    """Refuse a ``value`` that is not a real number >= 0 (NaN, a bool, a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what} (an int >= 0), got {type(value).__name__} "
                        f"{value!r}")
    if not float(value) >= 0:  # NaN too
        raise ValueError(f"{name} must be {what} >= 0, got {value!r}")


def raise_oom(kind: str = "cuda", nbytes: int = 2 * 1024**3) -> NoReturn:
    """Raise ``make_oom(kind, nbytes)``."""
    raise make_oom(kind, nbytes)


class MemoryCeiling:
    """A pretend device that holds ``capacity`` units (items of a batch, bytes, ...).

    ``require(n)`` raises a realistic OOM of ``kind`` when ``n > capacity`` and records every
    request in ``attempts`` and every refusal in ``failures``. Thread-safe. Set ``capacity``
    at any time to model memory growing or shrinking.
    """

    def __init__(self, capacity: int, kind: str = "cuda") -> None:
        make_oom(kind)  # fail early on an unknown kind
        self.capacity = capacity  # checked: see the property
        self.kind = kind
        self.attempts: list[int] = []
        self.failures: list[int] = []
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """What the pretend device holds; set it at any time (a number >= 0)."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        # NumPy numbers and floats are numbers too; infinity holds anything.
        _check_amount(value, "capacity", "a number of units (items, bytes, ...)")
        self._capacity = value

    def __repr__(self) -> str:
        return (f"<MemoryCeiling capacity={self.capacity} kind={self.kind!r} "
                f"attempts={len(self.attempts)} failures={len(self.failures)}>")

    def require(self, n: int) -> None:
        _check_amount(n, "require(n)", "the units asked for")
        with self._lock:
            self.attempts.append(n)
            fits = n <= self.capacity
            if not fits:
                self.failures.append(n)
        if not fits:
            raise_oom(self.kind, n)

    def reset(self) -> None:
        with self._lock:
            self.attempts.clear()
            self.failures.clear()
