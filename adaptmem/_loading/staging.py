"""Reading checkpoint tensors that are converted on the way (dtype, device, layout) through
staging memory of bounded size.

A conversion goes through two staging chunks: a reader thread fills one while the caller
converts the other, so reading overlaps converting and staging costs two chunks instead of
a whole tensor. A tensor that is not read in chunks (small, strided, or going to
non-contiguous targets) is read whole into one staging buffer.

[Note: a small view of a large storage]
A checkpoint entry that is a view (`torch.save` of `t[::1000]` stores the whole storage)
was read whole into staging memory: its span, from its first element to its last, 196 MiB
above the load's start for a 0.2 MiB tensor, against the bound of the model, its largest
tensor and 64 MiB. So an entry whose span exceeds its own size by more than a chunk is
gathered instead: the staging buffer holds its elements only, contiguous, and its span is
read a chunk at a time, in blocks along its dimensions from the largest stride down (as
many blocks of the outermost dimension as fit in a chunk; one that does not fit is split
along the next), each copied out of the chunk before the next is read. The disk reads as
much as before; memory is the tensor and one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .entries import Entry

__all__ = ["Staging", "copy_to"]


def copy_to(target: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``target.copy_(src)``; an inference tensor (a model built under ``inference_mode``)
    can only be written in inference mode."""
    if target.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            target.copy_(src, non_blocking=non_blocking)
    else:
        target.copy_(src, non_blocking=non_blocking)


class Staging:
    """Staging memory for one load: ``fill(file, offset, dest)`` reads ``dest``'s bytes at
    ``offset`` of ``file`` into contiguous CPU ``dest``; chunks hold ``chunk`` bytes."""

    def __init__(self, fill: Callable[[str, int, torch.Tensor], None], chunk: int) -> None:
        self._fill = fill
        self._chunk = chunk
        self._staging: torch.Tensor | None = None
        self._chunks: list[torch.Tensor] = []
        # chunk index -> events of the device copies still reading it, one per device: a
        # copy is queued on its destination device's stream, which need not be the current
        # device's (a load onto cuda:1, or a split over two GPUs).
        self._pending: dict[int, list[Any]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._threadless = False  # no reader thread could start: the caller reads

    def close(self) -> None:
        """Wait for the reader thread and the device copies; free the staging memory."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for events in self._pending.values():
            for event in events:
                event.synchronize()  # device copies still reading a pinned chunk
        self._pending.clear()
        self._staging = None
        self._chunks = []

    def copy_into(self, entry: Entry, targets: list[torch.Tensor]) -> None:
        """Read ``entry`` once and copy it into every target (any dtype, device and shape
        with its number of elements), converting on the way."""
        device = any(t.device.type != "cpu" for t in targets)
        if (entry.tensor is not None or not entry.contiguous or entry.nbytes <= self._chunk
                or not all(t.is_contiguous() for t in targets)):
            src = self.read(entry, pinned=device and torch.cuda.is_available())
            for t in targets:
                copy_to(t, src.reshape(t.shape) if src.shape != t.shape else src)
            return
        item = entry.dtype.itemsize
        step = self._chunk // item
        pieces = [(a, min(a + step, entry.numel)) for a in range(0, entry.numel, step)]
        chunks = self._chunk_buffers(pinned=device and torch.cuda.is_available())
        flats = [t.view(-1) for t in targets]
        start = entry.start

        def fetch(i: int) -> None:
            a, b = pieces[i]
            for event in self._pending.pop(i % 2, ()):  # device copies still reading it
                event.synchronize()
            self._fill(entry.file, start + a * item, chunks[i % 2][: (b - a) * item])

        future = self._start(fetch, 0)
        for i, (a, b) in enumerate(pieces):
            future.result()
            if i + 1 < len(pieces):
                future = self._start(fetch, i + 1)
            piece = chunks[i % 2][: (b - a) * item].view(entry.dtype)
            events: dict[torch.device, Any] = {}
            for flat in flats:
                copy_to(flat[a:b], piece, non_blocking=flat.device.type == "cuda")
                if flat.device.type == "cuda":  # recorded after its last copy from the chunk
                    events[flat.device] = torch.cuda.current_stream(flat.device)
            for stream in events.values():
                event = torch.cuda.Event()
                event.record(stream)
                self._pending.setdefault(i % 2, []).append(event)
        future.result()

    def _start(self, fetch: Callable[[int], None], i: int) -> Future[None]:
        """``fetch(i)`` on the reader thread; done on this one where no thread can start (a
        process at its limit on threads)."""
        if not self._threadless:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="adaptmem-load")
            try:
                return self._pool.submit(fetch, i)
            except RuntimeError:  # the work is queued with no thread to run it: drop it
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
                self._threadless = True
        done: Future[None] = Future()
        fetch(i)
        done.set_result(None)
        return done

    def _chunk_buffers(self, pinned: bool) -> list[torch.Tensor]:
        if len(self._chunks) != 2 or (pinned and not self._chunks[0].is_pinned()):
            self._chunks = []
            self._chunks = [torch.empty(self._chunk, dtype=torch.uint8, pin_memory=pinned)
                            for _ in range(2)]
        return self._chunks

    def read(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        """``entry`` as a CPU tensor in the staging buffer, valid until the next ``read``: as
        stored, or, for a view whose bytes are spread over more than a chunk beyond its own
        size, gathered into a contiguous tensor (See [Note: a small view of a large
        storage])."""
        if entry.tensor is not None:
            return entry.tensor
        size = entry.span * entry.dtype.itemsize
        if size > entry.nbytes + self._chunk:
            return self._gather(entry, pinned)
        raw = self._buffer(size, pinned)
        self._fill(entry.file, entry.start, raw)
        flat = raw.view(entry.dtype) if size else torch.empty(0, dtype=entry.dtype)
        return flat.as_strided(entry.shape, entry.stride) if entry.numel else flat.view(entry.shape)

    def _buffer(self, size: int, pinned: bool) -> torch.Tensor:
        """The first ``size`` bytes of the staging buffer, grown to hold them."""
        staging = self._staging
        if staging is None or staging.numel() < size or (pinned and not staging.is_pinned()):
            self._staging = None
            staging = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pinned)
            self._staging = staging
        return staging[:size]

    def _gather(self, entry: Entry, pinned: bool) -> torch.Tensor:
        """``entry``'s elements, contiguous in the staging buffer, read a chunk of the span at
        a time (See [Note: a small view of a large storage])."""
        assert entry.offset is not None
        base = entry.offset
        out = self._buffer(entry.nbytes, pinned).view(entry.dtype).view(entry.shape)
        # Dimensions by decreasing stride: blocks of the outermost lie apart in the file.
        order = sorted(range(len(entry.shape)), key=lambda d: -entry.stride[d])
        chunk = self._chunk_buffers(pinned=False)[0]
        for event in self._pending.pop(0, ()):  # device copies still reading this chunk
            event.synchronize()
        item = entry.dtype.itemsize

        def block(dest: torch.Tensor, first: int, shape: tuple[int, ...],
                  stride: tuple[int, ...]) -> None:
            span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
            if span * item <= chunk.numel():
                raw = chunk[: span * item]
                self._fill(entry.file, base + first * item, raw)
                dest.copy_(raw.view(entry.dtype).as_strided(shape, stride))
                return
            inner = span - (shape[0] - 1) * stride[0]  # the span of one block of dim 0
            per = (chunk.numel() // item - inner) // stride[0] + 1 if inner * item <= (
                chunk.numel()) else 0
            for i in range(0, shape[0], max(per, 1)):
                if per:  # ``per`` blocks of dim 0 fit in a chunk
                    k = min(per, shape[0] - i)
                    block(dest[i: i + k], first + i * stride[0], (k, *shape[1:]), stride)
                else:  # one block does not: split it along the next dimension
                    block(dest[i], first + i * stride[0], shape[1:], stride[1:])

        if entry.numel:
            block(out.permute(order), entry.storage_offset,
                  tuple(entry.shape[d] for d in order), tuple(entry.stride[d] for d in order))
        return out
