"""One tensor of a checkpoint: its file and where its bytes lie there."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Entry", "contiguous_stride"]


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its file and where its bytes lie there.

    ``offset`` is the byte offset of the tensor's storage in ``file``; the tensor starts
    ``storage_offset`` elements into it with ``stride``. ``tensor`` is set instead for
    checkpoints that can only be read whole (the legacy non-zip ``torch.save`` format).
    """

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None
    storage_offset: int = 0
    stride: tuple[int, ...] = ()
    tensor: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        return self.stride == contiguous_stride(self.shape)

    @property
    def span(self) -> int:
        """Elements from the storage offset to the last element, inclusive."""
        if self.numel == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))

    @property
    def start(self) -> int:
        """Byte offset of the tensor's first element in ``file``."""
        assert self.offset is not None
        return self.offset + self.storage_offset * self.dtype.itemsize


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
