"""The ``torch.cuda`` (and ``torch.accelerator``) functions the simulation answers, and the
patching that installs them for the length of a simulation only."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._errors import SimulatedCudaError
from ._state import SimGenerator, SimState
from ._streams import SimEvent, SimStream

__all__ = ["Patches", "cuda_functions"]

_MISSING = object()
_SETTING = object()  # an entry of Patches that is a setting, not an attribute


class Patches:
    """Attributes replaced on modules, and settings of torch's, put back exactly (absent
    attributes removed) on ``undo``."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def setting(self, get: Callable[[], Any], put: Callable[[Any], Any], value: Any) -> None:
        """A setting read with ``get()`` and written with ``put(value)``, set to ``value``."""
        self._saved.append((put, _SETTING, get()))
        put(value)

    def undo(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if name is _SETTING:
                owner(old)
            elif old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


class _Properties:
    """What ``torch.cuda.get_device_properties`` returns for a simulated device: every
    field of torch's, with an H100 SXM's figures but the memory asked for."""

    def __init__(self, index: int, total: int) -> None:
        self.name = f"adaptmem simulated CUDA device {index}"
        self.total_memory = total
        self.major, self.minor = 9, 0
        self.multi_processor_count = 132
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.max_threads_per_multi_processor = 2048
        self.warp_size = 32
        self.L2_cache_size = 50 * 1024**2
        self.clock_rate = 1_980_000  # kHz
        self.memory_clock_rate = 2_619_000  # kHz
        self.memory_bus_width = 5120  # bits
        self.shared_memory_per_block = 48 * 1024
        self.shared_memory_per_block_optin = 227 * 1024
        self.shared_memory_per_multiprocessor = 228 * 1024
        self.max_threads_per_block = 1024
        self.regs_per_multiprocessor = 65536
        self.pci_bus_id, self.pci_device_id, self.pci_domain_id = index, 0, 0
        self.gcnArchName = ""
        self.uuid = f"simulated-{index}"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 1024**2}MB, "
                f"multi_processor_count={self.multi_processor_count})")


def cuda_functions(state: SimState) -> dict[str, Any]:
    """The simulated ``torch.cuda`` namespace, by attribute name."""
    allocators = state.allocators

    def alloc(device: Any = None) -> Any:
        return allocators[state.device_index(device)]

    class device:  # noqa: N801 - torch.cuda.device's own name
        def __init__(self, device: Any) -> None:
            self.idx = -1 if device is None or device == -1 else state.device_index(device)
            self.prev_idx = -1

        def __enter__(self) -> None:
            self.prev_idx = state.current_device
            if self.idx >= 0:
                state.current_device = self.idx

        def __exit__(self, *exc: object) -> None:
            state.current_device = self.prev_idx

    class device_of(device):  # noqa: N801
        def __init__(self, obj: Any) -> None:
            super().__init__(obj.get_device() if obj.is_cuda else -1)

    def set_device(device: Any) -> None:
        state.current_device = state.device_index(device)

    @contextlib.contextmanager
    def stream(stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        with stream:  # SimStream's own: current on its device, that device current
            yield

    def set_stream(stream: Any) -> None:
        state.current_streams[stream.index] = stream

    class ExternalStream(SimStream):
        """A stream made elsewhere, known by its ``cuda_stream``: under the simulation only
        its own streams exist (0 is the device's default stream, as on CUDA)."""

        def __new__(cls, stream_ptr: int, device: Any = None, **kwargs: Any) -> Any:
            index = state.device_index(device)
            if stream_ptr == 0:
                return state.default_streams[index]
            for known in list(state.streams):
                if known.index == index and known.cuda_stream == stream_ptr:
                    return known
            raise ValueError(
                f"torch.cuda.ExternalStream({stream_ptr!r}): the simulated cuda:{index} has no "
                f"stream with that cuda_stream (simulated CUDA has only its own streams). "
                f"Pass 0 (the default stream) or the cuda_stream of a torch.cuda.Stream "
                f"made inside the simulation.")

    def synchronize(device: Any = None) -> None:
        state.synchronize(state.device_index(device))

    def indexed(device: Any) -> Any:
        # torch's per-process fraction calls take None (the current device) or a device with
        # an index: torch.device("cuda") raises there, as it does here.
        if device is None or isinstance(device, int):
            return device
        if torch.device(device).index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer, "
                             f"but got:{device}")
        return device

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        device = indexed(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        alloc(device).fraction = fraction

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        a = alloc(device)
        return max(0, a.total - a.reserved), a.total

    def empty_cache() -> None:
        for a in allocators:
            a.empty_cache()

    def memory_stats(device: Any = None) -> dict[str, int]:
        return alloc(device).stats()

    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        nested: dict[str, Any] = {}
        for key, value in alloc(device).stats().items():
            *path, last = key.split(".")
            level = nested
            for part in path:
                level = level.setdefault(part, {})
            level[last] = value
        return nested

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        state.device_index(device)  # an index beyond the devices raises, as on CUDA
        return 9, 0

    def refuse_graphs(what: str) -> SimulatedCudaError:
        return SimulatedCudaError(
            f"simulated CUDA: {what}: CUDA graphs are not simulated (capture records kernels "
            f"on a real device). Test the path without graphs under simulated_cuda "
            f"(torch.cuda.is_current_stream_capturing() is False there), and graph capture "
            f"on a real GPU")

    class CUDAGraph:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            raise refuse_graphs("torch.cuda.CUDAGraph()")

    def make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
        raise refuse_graphs("torch.cuda.make_graphed_callables")

    def graph_pool_handle() -> Any:
        raise refuse_graphs("torch.cuda.graph_pool_handle()")

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    def lazy_init() -> None:
        # torch calls it before a CUDA call made without the simulation's modes: in a thread
        # the simulation is not active in, the real driver would answer "no NVIDIA driver".
        if threading.get_ident() not in state.threads:
            raise SimulatedCudaError(
                f"simulated CUDA: a CUDA call in thread {threading.current_thread().name!r}, "
                f"where the simulation is not active: it simulates the thread that entered "
                f"`with simulated_cuda():` (and a DataLoader's pinning thread), not others. "
                f"Make device tensors in that thread, or test threaded code on a real GPU")

    def refuse_memory_history(what: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> None:
            enabled = kwargs.get("enabled", args[0] if args else "all")
            if what == "_record_memory_history" and enabled in (None, False):
                return None  # turning recording off: nothing was recorded
            raise SimulatedCudaError(
                f"simulated CUDA: torch.cuda.memory.{what} is not simulated (the caching "
                f"allocator's history and snapshots live in the real CUDA runtime). Read "
                f"torch.cuda.memory_stats() or memory_allocated() under simulated_cuda, and "
                f"record the allocator's history on a real GPU")
        return refuse

    generators = state.generators

    def generator(device: Any = None) -> torch.Generator:
        return generators[state.device_index(device)]

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return generator(device).get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        generator(device).set_state(new_state)

    def set_rng_state_all(new_states: Any) -> None:
        for i, new_state in enumerate(new_states):
            set_rng_state(new_state, i)

    def manual_seed(seed: int) -> None:
        generator().manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        seed = int(seed)
        for g in generators:
            g.manual_seed(seed)

    def seed() -> None:
        generator().seed()

    def seed_all() -> None:
        manual_seed_all(generators[0].seed())

    # torch.cuda.cudart(): the runtime calls code outside torch makes; those of pinning.
    cudart = types.SimpleNamespace(cudaHostRegister=state.host_register,
                                   cudaHostUnregister=state.host_unregister,
                                   cudaGetLastError=state.get_last_error)

    return {
        "is_available": lambda: True,
        "cudart": lambda: cudart,
        "is_initialized": lambda: True,
        "_lazy_init": lazy_init,
        "_record_memory_history": refuse_memory_history("_record_memory_history"),
        "memory_snapshot": refuse_memory_history("memory_snapshot"),
        "_snapshot": refuse_memory_history("_snapshot"),
        "_dump_snapshot": refuse_memory_history("_dump_snapshot"),
        "init": nothing,
        "device_count": lambda: len(allocators),
        "current_device": lambda: state.current_device,
        "set_device": set_device,
        "device": device,
        "device_of": device_of,
        "get_device_properties": lambda device=None: _Properties(
            state.device_index(device), alloc(device).total),
        "get_device_name": lambda device=None: _Properties(
            state.device_index(device), 0).name,
        "get_device_capability": get_device_capability,
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": synchronize,
        "memory_allocated": lambda device=None: alloc(device).allocated,
        "max_memory_allocated": lambda device=None: alloc(device).peak_allocated,
        "memory_reserved": lambda device=None: alloc(device).reserved,
        "max_memory_reserved": lambda device=None: alloc(device).peak_reserved,
        "reset_peak_memory_stats": lambda device=None: alloc(device).reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: alloc(device).reset_peaks(),
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "reset_accumulated_memory_stats": lambda device=None: alloc(device).reset_accumulated(),
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        "set_per_process_memory_fraction": set_per_process_memory_fraction,
        "get_per_process_memory_fraction": lambda device=None: alloc(indexed(device)).fraction,
        "ipc_collect": nothing,
        "default_generators": generators,
        "get_rng_state": get_rng_state,
        "get_rng_state_all": lambda: [g.get_state() for g in generators],
        "set_rng_state": set_rng_state,
        "set_rng_state_all": set_rng_state_all,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": seed,
        "seed_all": seed_all,
        "initial_seed": lambda: generator().initial_seed(),
        "Stream": SimStream,
        "ExternalStream": ExternalStream,
        "Event": SimEvent,
        "current_stream": lambda device=None: state.current_stream(device),
        "default_stream": lambda device=None: state.default_streams[
            state.device_index(device)],
        "stream": stream,
        "set_stream": set_stream,
        "is_current_stream_capturing": lambda: False,
        "CUDAGraph": CUDAGraph,
        "make_graphed_callables": make_graphed_callables,
        "graph_pool_handle": graph_pool_handle,
    }


def accelerator_functions(state: SimState, cuda: dict[str, Any]) -> dict[str, Any]:
    """``torch.accelerator``'s answers under the simulation."""

    def set_index(index: int) -> None:
        cuda["set_device"](index)

    # torch.cuda.cudart(): the runtime calls code outside torch makes; those of pinning.
    cudart = types.SimpleNamespace(cudaHostRegister=state.host_register,
                                   cudaHostUnregister=state.host_unregister,
                                   cudaGetLastError=state.get_last_error)

    return {
        "is_available": lambda: True,
        "cudart": lambda: cudart,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": cuda["device_count"],
        "current_device_index": cuda["current_device"],
        "current_device_idx": cuda["current_device"],
        "set_device_index": set_index,
        "set_device_idx": set_index,
        "device_index": cuda["device"],  # a context manager, as torch.cuda.device
        "synchronize": cuda["synchronize"],
        "current_stream": cuda["current_stream"],
        "set_stream": cuda["set_stream"],
        "empty_cache": cuda["empty_cache"],
        "memory_allocated": cuda["memory_allocated"],
        "max_memory_allocated": cuda["max_memory_allocated"],
        "memory_reserved": cuda["memory_reserved"],
        "max_memory_reserved": cuda["max_memory_reserved"],
        "reset_peak_memory_stats": cuda["reset_peak_memory_stats"],
        "reset_accumulated_memory_stats": cuda["reset_accumulated_memory_stats"],
        "memory_stats": cuda["memory_stats"],
        "get_memory_info": cuda["mem_get_info"],
    }


_TORCH_STREAM = torch.Stream


class _AnyStream(type):
    """The simulation's ``torch.Stream`` is the real one to ``isinstance``/``issubclass``."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _TORCH_STREAM)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _TORCH_STREAM)


class _Stream(_TORCH_STREAM, metaclass=_AnyStream):
    """``torch.Stream(device)``: a simulated stream for a CUDA device (and for None, the
    current accelerator being CUDA), where torch would reach the CUDA runtime."""

    def __new__(cls, device: Any = None, *, priority: int = 0, **kwargs: Any) -> Any:
        if device is None or _is_cuda_device(device):
            return SimStream(device, priority)
        return _TORCH_STREAM(device, priority=priority, **kwargs)


_TORCH_GENERATOR = torch.Generator


class _AnyGenerator(type(_TORCH_GENERATOR)):  # type: ignore[misc]
    """The simulation's ``torch.Generator`` is the real one to ``isinstance``/``issubclass``."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _TORCH_GENERATOR)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _TORCH_GENERATOR)


def _generator_class(state: SimState) -> type:
    class _Generator(_TORCH_GENERATOR, metaclass=_AnyGenerator):
        """``torch.Generator("cuda")``: a generator of the simulated device, where torch
        would reach the CUDA runtime."""

        def __new__(cls, device: Any = "cpu") -> Any:
            if _is_cuda_device(device):
                index = state.device_index(device)
                return SimGenerator(index)
            return _TORCH_GENERATOR(device)

    return _Generator


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def install(state: SimState, patches: Patches) -> None:
    cuda = cuda_functions(state)
    patches.set(torch, "Stream", _Stream)
    patches.set(torch, "Generator", _generator_class(state))
    # Every simulated device has a context (torch's host allocator, and adaptmem, pin with
    # one that has, so as not to make another).
    patches.set(torch._C, "_cuda_hasPrimaryContext",
                lambda index: 0 <= index < len(state.allocators))
    memory = getattr(torch.cuda, "memory", None)
    streams = getattr(torch.cuda, "streams", None)
    random = getattr(torch.cuda, "random", None)
    graphs = getattr(torch.cuda, "graphs", None)
    for name, value in cuda.items():
        patches.set(torch.cuda, name, value)
        for module in (memory, streams, random, graphs):
            if module is not None and name in module.__dict__:
                patches.set(module, name, value)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        for name, value in accelerator_functions(state, cuda).items():
            if hasattr(accelerator, name):
                patches.set(accelerator, name, value)
            acc_memory = getattr(accelerator, "memory", None)
            if acc_memory is not None and name in getattr(acc_memory, "__dict__", {}):
                patches.set(acc_memory, name, value)
