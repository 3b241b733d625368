"""The state of one simulation: its devices, current device and streams, what was reported."""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any

import torch

from ._memory import Allocator
from ._streams import SimStream

__all__ = ["SimGenerator", "SimState"]

logger = logging.getLogger("adaptmem.testing")

class SimGenerator(torch.Generator):
    """A generator of a simulated device (``torch.Generator("cuda")``, the devices' default
    ones): a CPU generator underneath, which the ops run on the host draw from, reporting
    its CUDA device. See [Note: simulated random state] in _tensors.py."""

    def __new__(cls, index: int) -> SimGenerator:
        return super().__new__(cls)  # a CPU generator (torch's takes the device here)

    def __init__(self, index: int) -> None:
        self.index = index

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)

    def set_state(self, new_state: torch.Tensor) -> torch.Generator:
        """Also takes a GPU's 16-byte Philox state (seed, offset; a checkpoint's
        ``"cuda_rng_state"``): seeded with its seed, as its offset has no counterpart in a
        CPU generator's state."""
        if new_state.numel() == _PHILOX_STATE_BYTES and new_state.dtype == torch.uint8:
            return self.manual_seed(int.from_bytes(bytes(new_state[:8].tolist()), "little"))
        return super().set_state(new_state)

    def __repr__(self) -> str:
        return f"<simulated torch.Generator device=cuda:{self.index}>"

    def __reduce__(self) -> Any:
        """Copied (``copy.deepcopy``) or pickled as a generator of its device, with its
        state: torch's own reduction would make a CPU generator of it."""
        return _restored, (self.index, self.get_state())


def _restored(index: int, state: torch.Tensor) -> SimGenerator:
    """A simulated device's generator, from ``SimGenerator.__reduce__``."""
    generator = SimGenerator(index)
    generator.set_state(state)
    return generator


_PHILOX_STATE_BYTES = 16  # a CUDA generator's state: seed and offset, 8 bytes each


class SimState:
    def __init__(self, devices: int, total: int, bandwidth: float | None) -> None:
        self.bandwidth = bandwidth
        self.allocators = [Allocator(i, total) for i in range(devices)]
        self.current_device = 0
        self.streams: weakref.WeakSet[Any] = weakref.WeakSet()
        self.problems: list[str] = []
        # The host's time on copies: its CPU time moving the bytes of asynchronous ones (the
        # simulation's own cost; a GPU's copy engine spends none) and the time it slept on
        # the link (until an asynchronous copy completed, or for a synchronous one).
        self.copies = 0
        self.copy_seconds = 0.0
        self.wait_seconds = 0.0
        self.pinned: dict[int, Any] = {}  # host storage data_ptr -> its finalizer
        # Host memory page-locked with cudaHostRegister: its address -> its bytes.
        self.registered: dict[int, int] = {}
        # The error of the last failed runtime call (cudaHostRegister, cudaHostUnregister)
        # that cudaGetLastError has not cleared: on a GPU torch's next kernel launch raises it.
        self.last_error = 0
        # pinned host storage data_ptr -> the last non_blocking copy reading it (Job), while
        # that copy may be in flight; every op writing a host tensor checks it (see
        # check_host_write in _tensors.py) while it is not empty.
        self.host_reads: dict[int, Any] = {}
        self.host_reads_until = 0.0  # when the last of those copies completes
        # pinned host storage data_ptr -> the last non_blocking device-to-host copy writing
        # it (Job), while that copy may be in flight; every host op reading or writing a
        # host tensor checks it (see check_host_use in _tensors.py) while it is not empty.
        self.host_writes: dict[int, Any] = {}
        self.host_writes_until = 0.0
        self._ids = itertools.count(1)
        self.lock = threading.Lock()
        self.default_streams = [SimStream(i, _sim_state=self, _default=True)
                                for i in range(devices)]
        self.current_streams = list(self.default_streams)
        # See [Note: simulated random state] in _tensors.py. Seeded as torch.manual_seed(s)
        # before the block would have seeded a real device.
        self.generators = tuple(SimGenerator(i).manual_seed(torch.initial_seed())
                                for i in range(devices))
        self.threads = {threading.get_ident()}  # the threads the simulation is active in
        self.drawing_for: int | None = None  # the device a CPU-run factory makes values for
        self._known: dict[Any, int | None] = {}  # device_index's answers for devices, strings

    def next_stream_id(self) -> int:
        return next(self._ids)

    def device_index(self, device: Any) -> int:
        """The simulated device meant by ``device`` (None: the current one)."""
        if device is None:
            return self.current_device
        kind = type(device)
        if kind is torch.device or kind is str:
            # Asked per copy and per stream lookup; torch.device's attributes are slow.
            known = self._known.get(device, -1)
            if known != -1:
                return self.current_device if known is None else known
        if isinstance(device, int) and not isinstance(device, bool):
            index: int | None = device
        else:
            if isinstance(device, torch.Stream):
                return int(device.device_index)
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {dev}")
            index = dev.index
            if index is None or 0 <= index < len(self.allocators):
                self._known[device] = index
        if index is None:
            return self.current_device
        if not 0 <= index < len(self.allocators):
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (simulated: cuda:{index} does not exist; "
                f"simulated_cuda(devices={len(self.allocators)}) has cuda:0 to "
                f"cuda:{len(self.allocators) - 1})")
        return index

    def current_stream(self, device: Any) -> Any:
        return self.current_streams[self.device_index(device)]

    def report(self, message: str) -> None:
        with self.lock:
            self.problems.append(message)
        logger.warning("%s", message)

    def synchronize(self, index: int | None) -> None:
        for stream in list(self.streams):
            if index is None or stream.index == index:
                for job in stream.pending_jobs():
                    job.wait()
                stream.host_synced()
        self.prune_host_reads()

    def is_pinned_at(self, ptr: int) -> bool:
        """Whether the host storage at ``ptr`` is page-locked: pinned by torch's allocator, or
        within memory registered with ``cudaHostRegister``."""
        if ptr in self.pinned or ptr in self.registered:
            return True
        return any(start <= ptr < start + size for start, size in self.registered.items())

    def pinned_blocks(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each live storage torch's allocator pinned."""
        peeks = ((ptr, f.peek()) for ptr, f in list(self.pinned.items()))
        return [(ptr, peek[0].nbytes()) for ptr, peek in peeks if peek]

    def pinned_bytes(self) -> int:
        """Page-locked host memory in use: torch's pinned blocks at the power of two its host
        allocator rounds them up to, registered memory at its size."""
        held = sum(1 << (n - 1).bit_length() for _, n in self.pinned_blocks() if n)
        return held + sum(self.registered.values())

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        """``cudaHostRegister``: 0, or CUDA's error code (712: some of it is page-locked
        already, registered or pinned by torch; 1: a size of 0), left pending as CUDA's
        runtime leaves it (see ``last_error``)."""
        if size <= 0:
            return self.failed(1)  # cudaErrorInvalidValue
        if any(start < ptr + size and ptr < start + length
               for start, length in [*self.registered.items(), *self.pinned_blocks()]):
            return self.failed(712)  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = size
        return 0

    def failed(self, error: int) -> int:
        self.last_error = error
        return error

    def get_last_error(self) -> int:
        """``cudaGetLastError``: the last failed call's error, cleared."""
        error, self.last_error = self.last_error, 0
        return error

    def host_unregister(self, ptr: int) -> int:
        """``cudaHostUnregister``: 0, or 713 (cudaErrorHostMemoryNotRegistered). Memory that a
        copy in flight still reads or writes is reported: on a GPU that copy moves whatever
        the pages hold once they are unmapped or reused."""
        size = self.registered.pop(ptr, None)
        if size is None:
            return self.failed(713)
        for kind in ("host_reads", "host_writes"):
            for at, job in list(getattr(self, kind).items()):
                if ptr <= at < ptr + size and job.in_flight():
                    self.report(f"simulated CUDA: registered host memory at {ptr:#x} was "
                                f"unregistered while a non_blocking copy on {job.stream!r} "
                                f"still used it; synchronize before freeing it")
        return 0

    def unpin(self, ptr: int) -> None:
        """The pinned host storage at ``ptr`` died: its address may serve any host tensor
        now. (On a GPU the caching host allocator holds a pinned block until the copies
        reading it completed, and pageable memory never takes its address.)"""
        self.pinned.pop(ptr, None)
        self.host_reads.pop(ptr, None)
        self.host_writes.pop(ptr, None)

    def prune_host_reads(self) -> None:
        """Forget the copies reading or writing pinned memory that completed or that the
        host synchronised with: a write to their sources, or a use of their destinations,
        is safe now."""
        if self.host_reads:
            self.host_reads = {p: job for p, job in self.host_reads.items() if job.in_flight()}
        if self.host_writes:
            self.host_writes = {p: job for p, job in self.host_writes.items() if job.in_flight()}

    def stop(self) -> None:
        for stream in list(self.streams):
            stream.stop()
