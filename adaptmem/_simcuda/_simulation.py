"""``simulated_cuda``: enter and leave a simulation, leaving nothing of torch changed."""

from __future__ import annotations

import numbers
import sys
import threading
import warnings
from typing import Any

import torch

from .._common.devices import format_bytes, parse_size
from .._common.pinning import release_kept
from . import _active, _tensors
from ._errors import SimulatedCudaError
from ._state import SimState
from ._storages import install_storages
from ._tensors import Tensors
from ._torch_cuda import Patches, install

__all__ = ["SimulatedCuda", "SimulatedCudaError", "simulated_cuda"]


class SimulatedCuda:
    """A running simulation (see ``simulated_cuda``)."""

    def __init__(self, devices: int, total_memory: int, bandwidth: float | None) -> None:
        self.devices = devices
        self.total_memory = total_memory
        self.bandwidth = bandwidth
        self._state: SimState | None = None
        self._tensors: Tensors | None = None
        self._patches = Patches()
        self._default_device: Any = None  # torch's default device context at __enter__

    def __repr__(self) -> str:
        link = "unlimited" if self.bandwidth is None else f"{self.bandwidth:g} GB/s"
        return (f"<SimulatedCuda devices={self.devices} total_memory="
                f"{format_bytes(self.total_memory)} each, bandwidth={link}>")

    @property
    def problems(self) -> list[str]:
        """Stream misuse seen so far (also raised as ``SimulatedCudaError`` at exit)."""
        return list(self._state.problems) if self._state is not None else []

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory in use now: each block torch's host allocator pinned
        (``pin_memory=True``, ``Tensor.pin_memory()``) at the power of two CUDA's allocator
        rounds it up to, and memory registered through ``torch.cuda.cudart().cudaHostRegister``
        at its size. Freed blocks count no more (CUDA's allocator keeps them cached)."""
        return self._state.pinned_bytes() if self._state is not None else 0

    @property
    def copy_stats(self) -> dict[str, float]:
        """The host's time on ``non_blocking`` copies so far (to the device, and to pinned
        host memory): ``copies`` (how many),
        ``copy_seconds`` (the host thread's CPU time moving their bytes: the simulation's
        own cost, which a GPU's copy engine does not put on the host) and ``wait_seconds``
        (wall time the host slept on the link: until a ``non_blocking`` copy it needed had
        completed, which a schedule that overlaps copies with compute keeps small, and for
        the link's time of each synchronous copy)."""
        state = self._state
        if state is None:
            return {"copies": 0, "copy_seconds": 0.0, "wait_seconds": 0.0}
        return {"copies": state.copies, "copy_seconds": state.copy_seconds,
                "wait_seconds": state.wait_seconds}

    def __enter__(self) -> SimulatedCuda:
        if _active.running() is not None:
            raise RuntimeError("simulated_cuda() is already active; simulations do not nest")
        state = SimState(self.devices, self.total_memory, self.bandwidth)
        tensors = Tensors(state)
        self._default_device = _default_device_context()
        _active.set_active(state)
        _tensors.set_current(tensors)
        try:
            install(state, self._patches)
            _pin_in_loader_threads(tensors, self._patches)
            install_storages(tensors, self._patches)
            _refuse_autocast(self._patches)
            _data_parallel(self._patches)
            # See [Note: kernels CUDA picks by device type] in _kernels.py.
            self._patches.setting(torch._C._get_cudnn_enabled, torch._C._set_cudnn_enabled,
                                  False)
            tensors.function_mode.__enter__()
            try:
                tensors.dispatch_mode.__enter__()
            except BaseException:
                tensors.function_mode.__exit__(None, None, None)
                raise
        except BaseException:
            self._patches.undo()
            _active.set_active(None)
            _tensors.set_current(None)
            raise
        self._state, self._tensors = state, tensors
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        state, tensors = self._state, self._tensors
        assert state is not None and tensors is not None
        try:
            release_kept()  # registered here: no use once the simulated runtime is gone
            state.synchronize(None)
            state.stop()
        finally:
            try:
                tensors.dispatch_mode.__exit__(None, None, None)
            finally:
                tensors.function_mode.__exit__(None, None, None)
                tensors.closed = True
                tensors.let_go()
                _restore_default_device(self._default_device)
                self._patches.undo()
                _active.set_active(None)
                _tensors.set_current(None)
        if state.last_error:
            state.report(f"a CUDA runtime call failed with error {state.last_error} and left it "
                         f"pending: on a GPU torch's next kernel launch raises it as its own "
                         f"(clear it with cudaGetLastError)")
        if state.problems and exc_type is None:
            raise SimulatedCudaError(
                "simulated CUDA saw stream misuse:\n- " + "\n- ".join(state.problems))


def _default_device_context() -> Any:
    """What ``torch.set_default_device`` set last (None: nothing)."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _restore_default_device(before: Any) -> None:
    """``torch.set_default_device("cuda")`` inside the block would outlive the simulated
    device: every factory of the process would then reach for real CUDA ("no NVIDIA
    driver"), failing the tests after this one. The default the block began with is put
    back, with a warning."""
    now = _default_device_context()
    if now is before or now is None or torch.device(now.device).type != "cuda":
        return
    warnings.warn(
        f"torch.set_default_device({str(now.device)!r}) inside simulated_cuda() was undone "
        f"when the block ended (the simulated device does not outlive it); set the default "
        f"device back inside the block", stacklevel=3)
    torch.set_default_device(None if before is None else before.device)


def _refuse_autocast(patches: Patches) -> None:
    """``torch.autocast("cuda")`` picks its kernels in C++ for a real device: with no driver
    the process ends ("terminate called ... CUDA driver version is insufficient"). Under
    the simulation it is refused with an error a test can see instead."""
    from torch.amp import autocast_mode

    cls = autocast_mode.autocast
    original = cls.__init__

    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        enabled = kwargs.get("enabled", args[1] if len(args) > 1 else True)
        if device_type == "cuda" and enabled:  # turned off (nn.DataParallel's replicas): fine
            raise SimulatedCudaError(
                "torch.autocast('cuda') is not simulated: its kernels are chosen in C++ for "
                "a real CUDA device, and without one the process would end. Run code that "
                "uses autocast on a real GPU, or leave autocast out under simulated_cuda "
                "(cast the model with .to(dtype) to see another dtype's memory)")
        original(self, device_type, *args, **kwargs)

    patches.set(cls, "__init__", __init__)


def _data_parallel(patches: Patches) -> None:
    """``nn.DataParallel`` (``torch.nn.parallel.comm``) scatters, broadcasts and gathers in
    C++ (``torch._C._scatter``, ...) on streams of CUDA's own, which the simulation's are not:
    under the simulation they copy with ``.to()``, as the C++ functions do, and the background
    streams torch asks for are new simulated ones each time (torch keeps its own for the
    life of the process, which would outlive the simulation). Replicas on several devices
    run in threads, where the simulation is not active: refused with a
    ``SimulatedCudaError``."""
    from torch.nn.parallel import _functions

    # The module, not the function of the same name that torch.nn.parallel exports.
    data_parallel = sys.modules["torch.nn.parallel.data_parallel"]

    def scatter(tensor: torch.Tensor, devices: Any, chunk_sizes: Any, dim: int,
                streams: Any) -> list[torch.Tensor]:
        if chunk_sizes is not None and len(chunk_sizes) != len(devices):
            raise RuntimeError(f"Expected devices and chunk_sizes to be of same length, but "
                               f"got len(devices) = {len(devices)} and len(chunk_sizes) = "
                               f"{len(chunk_sizes)} (simulated CUDA)")
        chunks = (tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None
                  else tensor.chunk(len(devices), dim))
        # As torch: fewer chunks than devices (a batch of one over two) fill the first ones.
        return [c.to(torch.device("cuda", i)) for c, i in zip(chunks, devices)]  # noqa: B905

    def broadcast_coalesced(tensors: Any, devices: Any, buffer_size: int) -> list[Any]:
        # The first device's are the tensors themselves, as torch's (they must be there).
        return [list(tensors), *([t.to(torch.device("cuda", i)) for t in tensors]
                                 for i in devices[1:])]

    def gather(tensors: Any, dim: int, destination: int | None) -> torch.Tensor:
        target = (torch.device("cpu") if destination == -1 else
                  torch.device("cuda", torch.cuda.current_device() if destination is None
                               else destination))
        return torch.cat([t.to(target) for t in tensors], dim)

    original = data_parallel.replicate

    def replicate(network: Any, devices: Any, detach: bool = False) -> Any:
        if len(devices) > 1:
            raise SimulatedCudaError(
                f"simulated CUDA: nn.DataParallel over {len(devices)} devices runs a replica "
                f"per device in a thread of its own, where the simulation is not active; "
                f"test it with one device (device_ids=[0]) or on real GPUs")
        # Detached: torch's autograd Broadcast would ask the driver (the simulation has no
        # autograd, and refuses backward anyway).
        return original(network, devices, True)

    patches.set(_functions, "_get_stream", lambda device: torch.Stream(device))
    patches.set(torch._C, "_scatter", scatter)
    patches.set(torch._C, "_broadcast_coalesced", broadcast_coalesced)
    patches.set(torch._C, "_gather", gather)
    patches.set(data_parallel, "replicate", replicate)


def _pin_in_loader_threads(tensors: Tensors, patches: Patches) -> None:
    """A DataLoader with ``pin_memory=True`` and workers pins in a thread of its own, where
    the simulation's modes are not active: there, pinning runs under modes of its own."""
    from torch.utils.data._utils import pin_memory as loader_pinning

    original = loader_pinning.pin_memory

    def pin_memory(data: Any, device: Any = None) -> Any:
        threads = tensors.state.threads
        ident = threading.get_ident()
        if ident in threads:  # the thread the simulation runs in (a loader without workers)
            return original(data, device)
        threads.add(ident)
        try:
            with _tensors.Functions(tensors), _tensors.Dispatch(tensors):
                return original(data, device)
        finally:
            threads.discard(ident)

    patches.set(loader_pinning, "pin_memory", pin_memory)


def simulated_cuda(devices: int = 1, total_memory: int | str = "16GiB",
                   bandwidth: float | None = None) -> SimulatedCuda:
    """A simulated CUDA device: inside ``with simulated_cuda():`` code written for CUDA runs
    unchanged on the CPU, and outside it nothing of torch is changed.

    Inside the block ``torch.cuda.is_available()`` is True and ``device_count()`` is
    ``devices``. Tensors on ``cuda``/``cuda:i`` hold real values computed on the CPU and
    report their CUDA device; mixing them with CPU tensors (0-dim ones aside), or ``cuda:0``
    with ``cuda:1``, raises CUDA's "Expected all tensors to be on the same device" error.
    Every allocation counts against ``total_memory`` through a model of the caching
    allocator (``memory_allocated``, ``memory_reserved``, ``empty_cache``, ``mem_get_info``,
    ``set_per_process_memory_fraction``); past the limit ``torch.OutOfMemoryError`` is raised
    with CUDA's message and nothing is allocated. Streams and events work; a copy to the
    device made with ``non_blocking=True`` completes later: ``nbytes / bandwidth`` seconds
    after the call returns when ``bandwidth`` in GB/s is given, queued behind its stream's
    earlier copies (the host goes on meanwhile; a synchronous copy between host and device
    holds the host that long). Reading its
    destination on a stream that did not wait for it raises ``StreamRaceError``, and so does
    a copy into a tensor another stream used, on a stream that did not wait for that use. A
    ``non_blocking`` copy from the device into pinned host memory completes likewise, and a
    host op using its destination before then (the host not synchronized) raises too.
    Freeing a tensor another stream still uses (without ``record_stream``, a host
    synchronize or the allocating stream waiting for it) raises ``SimulatedCudaError``
    when the block ends.
    Each device has a random stream of its own (``torch.cuda.manual_seed``,
    ``get_rng_state``/``set_rng_state``, ``default_generators``, ...), seeded at entry with
    ``torch.initial_seed()``; random ops on simulated tensors draw from it, not from the
    CPU's stream.

    Not simulated: kernel speed (ops run at CPU speed), memory fragmentation, real bus
    behaviour beyond a fixed bandwidth, autograd (every op on simulated tensors runs under
    ``no_grad``), other threads (the simulation is active in the thread that entered it; a
    CUDA call in another thread, and ``nn.DataParallel`` over several devices, whose
    replicas run in threads, raise ``SimulatedCudaError``),
    ``torch.compile``, custom CUDA kernels, cuDNN (the device has none:
    ``torch.backends.cudnn.enabled`` is False inside the block, and torch takes its own
    CUDA kernels, as a build without cuDNN does) and sparse tensors (making one on the
    device raises ``SimulatedCudaError``).

    Args:
        devices: how many devices (``cuda:0`` ...), 1 or more.
        total_memory: bytes per device (int or a string like ``"16GiB"``).
        bandwidth: host<->device link speed in GB/s, for asynchronous and synchronous
            copies alike; None copies as fast as the CPU does.

    Returns:
        A context manager; ``.problems`` lists stream misuse seen so far, ``.copy_stats``
        the host's time on ``non_blocking`` copies (moving bytes, waiting for them).

    Raises:
        TypeError, ValueError: an argument of the wrong type or range.

    Example:
        >>> import torch
        >>> from adaptmem.testing import simulated_cuda
        >>> available = torch.cuda.is_available  # False without a GPU
        >>> with simulated_cuda(total_memory="1GiB"):
        ...     x = torch.ones(4, device="cuda")
        ...     print(x.device, torch.cuda.memory_allocated(), (x * 2).sum().item())
        cuda:0 512 8.0
        >>> torch.cuda.is_available is available  # torch as it was
        True
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int of 1 or more, got {devices!r}")
    total = parse_size(total_memory, "total_memory")
    if total <= 0:
        raise ValueError(f"total_memory must be more than 0 bytes, got {total_memory!r}")
    if bandwidth is not None and (isinstance(bandwidth, bool)
                                  or not isinstance(bandwidth, numbers.Real)
                                  or not bandwidth > 0):
        raise ValueError(f"bandwidth must be None or a number of GB/s above 0, got "
                         f"{bandwidth!r}")
    return SimulatedCuda(devices, total, None if bandwidth is None else float(bandwidth))
