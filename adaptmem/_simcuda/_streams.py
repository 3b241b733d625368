"""Simulated streams and events, and the race detector.

Compute runs on the host thread, in order, so a compute stream is always "caught up". What
runs later is a copy to the device issued with ``non_blocking=True`` (from pinned or
pageable memory: PyTorch issues both with ``cudaMemcpyAsync``): it becomes a job on its
stream. See [Note: a simulated copy's timeline]. A stream that waits for an event
(``wait_event``, ``wait_stream``) learns which jobs of which streams it may now rely on; an
op that reads a tensor a job still writes, on a stream that did not wait for that job, is a
race and raises ``StreamRaceError``. An op on a stream that did wait blocks until the job is
done, which is what the GPU's compute stream would do.

[Note: a simulated copy's timeline]
A job moves its bytes when it is issued (a memcpy on the host thread), and is *done* at a
time computed then: ``nbytes / bandwidth`` after the later of the call's return, the
stream's earlier jobs and the jobs the stream waited for. Until that time, whoever must wait for it
(an op on a stream that waited, ``synchronize``, ``Event.synchronize``) sleeps, and
``query()`` answers False. So copies overlap with compute exactly as far as the link allows,
and nothing else runs beside the host thread: a worker thread would fight the host thread
for the GIL (a Python-heavy forward holds it, and the copy's own bookkeeping needs it), and
its hand-offs cost the host thread time a GPU's copy engine does not.

[Note: which uses a wait orders]
Compute runs at once, so what a stream must know of another's compute is only its order:
each stream counts *epochs*, and an op using a tensor on it is noted with the stream's
current epoch. Recording an event starts a new epoch, so the uses an event comes after are
those of earlier epochs: an event carries its stream's epoch at recording (and the epochs
its stream had waited for), and a stream waiting for it learns them (``waited_epochs``). A
host synchronisation starts a new epoch too and marks the earlier ones done
(``synced_epoch``). A use of stream ``u`` at epoch ``e`` is then ordered before what stream
``s`` does next when ``s.waited_epochs[u] >= e`` or ``u.synced_epoch >= e``: a block freed
on ``s`` may be handed out again, and a copy on ``s`` may overwrite the tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .._common.peak import fake_mode
from . import _active

__all__ = ["Job", "SimStream", "SimEvent", "StreamRaceError", "check_access"]


class StreamRaceError(RuntimeError):
    """A tensor was used on a stream that did not wait for the copy writing it."""


class Job:
    """One asynchronous copy on a stream: when it is done (see [Note: a simulated copy's
    timeline])."""

    __slots__ = ("stream", "seq", "done_at", "what")

    def __init__(self, stream: SimStream, seq: int, done_at: float, what: str) -> None:
        self.stream = stream
        self.seq = seq
        self.done_at = done_at
        self.what = what

    def finished(self) -> bool:
        return time.perf_counter() >= self.done_at

    def in_flight(self) -> bool:
        """Not completed, and the host has not synchronised with it: its pinned host
        memory (source or destination) is not the host's to use yet."""
        return self.seq > self.stream.synced_seq and not self.finished()

    def wait(self) -> None:
        """Block the host until the job is done (sleeping: other threads run meanwhile)."""
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.stream._state.wait_seconds += left


class SimStream(torch.Stream):
    """A simulated ``torch.cuda.Stream`` (a ``torch.Stream``, so ``record_stream`` takes it)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> SimStream:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        state = kwargs.get("_sim_state") or _active.active()
        self._state = state
        self.index = state.device_index(device)
        self._priority = priority
        self.seq = 0  # jobs enqueued so far
        self.epoch = 1  # uses by compute since the last host synchronisation are this epoch
        self.synced_seq = 0  # the host saw jobs up to here complete
        self.synced_epoch = 0
        self.waited: dict[SimStream, int] = {}  # stream -> job seq this stream waited for
        # stream -> the epoch of its uses this stream waited for (See [Note: which uses a
        # wait orders])
        self.waited_epochs: dict[SimStream, int] = {}
        self._last: Job | None = None
        self._pending_deps: list[Job] = []
        self._link_free_at = 0.0  # when the stream's last job is done
        # The default stream is 0, as on CUDA (its ``cuda_stream`` and ``stream_id``).
        self._id = 0 if kwargs.get("_default") else state.next_stream_id()
        self._outer: list[tuple[int, SimStream]] = []  # what ``with self:`` replaced
        state.streams.add(self)

    # -- what torch.cuda.Stream offers ---------------------------------------------------

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)

    @property
    def device_index(self) -> int:  # type: ignore[override]
        return self.index

    @property
    def device_type(self) -> int:  # type: ignore[override]
        return 1  # c10::DeviceType::CUDA

    @property
    def stream_id(self) -> int:  # type: ignore[override]
        return self._id

    @property
    def cuda_stream(self) -> int:
        return self._id

    @property
    def priority(self) -> int:  # type: ignore[override]
        return self._priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest): torch's range on CUDA, whose greatest it caps at -3."""
        return 0, -3

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<simulated torch.cuda.Stream device=cuda:{self.index} id={self._id}>"

    def __enter__(self) -> SimStream:
        # torch.Stream's own __enter__ would switch the CPU's stream: do what it does for a
        # CUDA stream, which is what ``torch.cuda.stream(self)`` does.
        state = self._state
        self._outer.append((state.current_device, state.current_streams[self.index]))
        state.current_streams[self.index] = self
        state.current_device = self.index
        return self

    def __exit__(self, *exc: object) -> None:
        device, stream = self._outer.pop()
        self._state.current_streams[self.index] = stream
        self._state.current_device = device

    def wait_event(self, event: Any) -> None:  # type: ignore[override]
        if not isinstance(event, SimEvent) or event.stream is None:
            return  # an unrecorded event: nothing to wait for, as on CUDA
        for stream, seq in event.covers.items():
            if stream is self:
                continue
            if self.waited.get(stream, 0) < seq:
                self.waited[stream] = seq
        for stream, epoch in event.epochs.items():
            if stream is not self and self.waited_epochs.get(stream, 0) < epoch:
                self.waited_epochs[stream] = epoch
        self._pending_deps.extend(j for j in event.jobs if not j.finished())

    def wait_stream(self, stream: Any) -> None:  # type: ignore[override]
        self.wait_event(_recorded(stream))

    def record_event(self, event: Any = None, stream: Any = None) -> SimEvent:  # type: ignore[override]
        event = event if event is not None else SimEvent()
        event.record(self)
        return event

    def query(self) -> bool:  # type: ignore[override]
        if not all(j.finished() for j in self.pending_jobs()):
            return False
        # The host saw the stream's work complete: as much a synchronisation as
        # synchronize() (code polling query() until True relies on it).
        self.synchronize()
        return True

    def synchronize(self) -> None:  # type: ignore[override]
        for job in (self._last, *self._pending_deps):
            if job is not None:
                job.wait()
        self.host_synced()
        self._state.prune_host_reads()

    # -- the simulation ------------------------------------------------------------------

    def host_synced(self) -> None:
        """The host knows everything issued on this stream so far has completed."""
        self.synced_seq = self.seq
        self.synced_epoch = self.epoch
        self.epoch += 1
        for stream, seq in self.waited.items():
            if stream.synced_seq < seq:
                stream.synced_seq = seq
        for stream, epoch in self.waited_epochs.items():
            if stream.synced_epoch < epoch:
                stream.synced_epoch = epoch
        # Every stream waited for is now synced past what was waited for, which is all
        # check_access and a free ask: the entries say nothing more, and kept they would
        # keep every stream ever waited for (a pager's side stream per page()) alive.
        self.waited.clear()
        self.waited_epochs.clear()
        self._pending_deps = [j for j in self._pending_deps if not j.finished()]

    def enqueue(self, fn: Callable[[], None], nbytes: int, what: str) -> Job:
        """Move the bytes now (``fn``) and return the job, done when the link would have
        carried them: after the stream's earlier jobs and what it waited for."""
        bandwidth = self._state.bandwidth
        deps, self._pending_deps = self._pending_deps, []
        moving = time.thread_time()
        fn()
        state = self._state
        state.copies += 1
        state.copy_seconds += time.thread_time() - moving
        # The link starts once the call has returned: the memcpy's host time is the
        # simulation's own cost, not the link's.
        start = max(time.perf_counter(), self._link_free_at)
        for d in deps:
            if d.done_at > start:
                start = d.done_at
        # A copy made under FakeTensorMode (a trace predicting memory through a paged model)
        # moves nothing on a real device: it takes no time on the link either.
        faking = fake_mode() is not None
        done_at = start + nbytes / (bandwidth * 1e9) if bandwidth and not faking else start
        self._link_free_at = done_at
        self.seq += 1
        job = Job(self, self.seq, done_at, what)
        self._last = job
        return job

    def pending_jobs(self) -> list[Job]:
        return [j for j in (self._last, *self._pending_deps) if j is not None]

    def stop(self) -> None:
        """Nothing runs beside the host thread (see [Note: a simulated copy's timeline])."""


def _recorded(stream: SimStream) -> SimEvent:
    event = SimEvent()
    event.record(stream)
    return event


class SimEvent:
    """A simulated ``torch.cuda.Event``: done when the jobs before it on its stream are."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.stream: SimStream | None = None
        self.jobs: tuple[Job, ...] = ()
        self.covers: dict[SimStream, int] = {}
        self.epochs: dict[SimStream, int] = {}  # See [Note: which uses a wait orders]
        self._recorded_at = 0.0

    def record(self, stream: Any = None) -> None:
        stream = stream if stream is not None else _active.active().current_stream(None)
        self.stream = stream
        self.jobs = tuple(j for j in stream.pending_jobs() if not j.finished())
        self.covers = {**stream.waited, stream: stream.seq}
        self.epochs = {**stream.waited_epochs, stream: stream.epoch}
        stream.epoch += 1  # uses from now on come after the event
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        stream = stream if stream is not None else _active.active().current_stream(None)
        stream.wait_event(self)

    def query(self) -> bool:
        if not all(j.finished() for j in self.jobs):
            return False
        self.synchronize()  # the host saw the event complete, as synchronize() does
        return True

    def synchronize(self) -> None:
        for j in self.jobs:
            j.wait()
        for stream, seq in self.covers.items():
            if stream.synced_seq < seq:
                stream.synced_seq = seq
        for stream, epoch in self.epochs.items():
            if stream.synced_epoch < epoch:
                stream.synced_epoch = epoch
        if self.stream is not None:
            self.stream._state.prune_host_reads()

    @property
    def time(self) -> float:
        return max((self._recorded_at, *(j.done_at for j in self.jobs)))

    def elapsed_time(self, end_event: SimEvent) -> float:
        """Milliseconds from this event to ``end_event`` (negative if it completed first)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.stream is None or end_event.stream is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end_event.time - self.time) * 1000.0

    def __repr__(self) -> str:
        return "<simulated torch.cuda.Event>"


def check_access(job: Job, stream: SimStream, what: Callable[[], str]) -> None:
    """An op on ``stream`` uses a tensor ``job`` writes: raise on a race, else wait for it.
    ``what()`` names the tensor (called only to say what raced: a pager's every weight
    comes here until the host next synchronises)."""
    writer = job.stream
    if not (writer is stream or job.seq <= writer.synced_seq
            or stream.waited.get(writer, 0) >= job.seq):
        raise StreamRaceError(
            f"simulated CUDA: {what()} was read before its copy completed: the copy was issued "
            f"with non_blocking=True on {writer!r}, and {stream!r} did not wait for it. On a "
            f"GPU this reads whatever the memory held (silent garbage). Make the reading "
            f"stream wait first: stream.wait_stream(copy_stream) or "
            f"stream.wait_event(event_recorded_after_the_copy)."
        )
    job.wait()
