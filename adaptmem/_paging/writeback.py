"""Buffers the forward wrote, or may have written, copied back to their host masters.

[Note: buffers written without a version bump]
Whether a forward wrote a buffer cannot be read from its version counter alone: some ops
write their arguments without moving it. Batch norm with batch statistics updates
``running_mean`` and ``running_var`` that way (``native_batch_norm``, and the
``_native_batch_norm_legit`` and ``_batch_norm_with_update`` that ``F.batch_norm`` reaches),
in eval mode too when a module calls ``F.batch_norm(..., training=True)`` (test-time
adaptation); so does the fused fake-quant op behind ``FusedMovingAvgObsFakeQuantize`` for
its scale, zero point and observer's min and max (checked on the CPU with torch 2.14.1,
under grad mode, ``no_grad`` and ``inference_mode``); so do writes through ``.data``, and
kernels outside torch that write through a pointer. Schemas do not tell either:
``native_batch_norm``'s marks no argument as written, nor do cuDNN's and MIOpen's batch
norms', and the ops whose schemas do (``_native_batch_norm_legit``,
``_batch_norm_with_update``, ``fused_moving_avg_obs_fake_quant``) leave the counter as it
was all the same; and watching ops with a dispatch mode would add a Python call to every op
of every forward. So a paged buffer of at most ``COPY_BACK_BYTES`` is copied back to its
master after every use, written or not: BatchNorm's and observers' buffers are a few KiB,
and a copy costs about what a comparison would (it reads both; measured in
benchmarks/RESULTS.md, "Copying small buffers back"). A larger buffer (a causal mask, a rotary
table: constant, and MiBs) is copied back only when its version counter moved (``add_``,
``index_copy_``, a slice assignment: a KV cache); one written otherwise loses the write
(docs/limitations.md): keep it resident. On a device with streams a copy back is queued on
the compute stream, after the module's work, and waited for once: at the end of the call,
or first when that master is to be read again (fetched within the call, given new data).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .._common.peak import fake_mode
from .._engines.hoststore import Slot
from .._engines.transfer import Transfer

__all__ = ["COPY_BACK_BYTES", "WriteBack"]

logger = logging.getLogger("adaptmem")

# Paged buffers up to this size are copied back after every use: See [Note: buffers written
# without a version bump].
COPY_BACK_BYTES = 64 * 1024


class WriteBack:
    """Copies paged buffers' device copies into their masters before the copies are dropped.

    Marks each small buffer among ``slots`` ``copy_back`` (at most ``COPY_BACK_BYTES``).
    ``keep`` copies a buffer back when its version counter moved, or when it is marked;
    ``finish`` waits until the masters hold what was copied; ``before_read`` does that
    first when some of the masters about to be read are among them.
    """

    def __init__(self, transfer: Transfer, slots: Sequence[Slot]) -> None:
        self.transfer = transfer
        self.synchronous = transfer.synchronous
        for s in slots:
            s.copy_back = s.buffer and s.nbytes <= COPY_BACK_BYTES
        self._reported: set[str] = set()  # buffers already reported as written in place
        self._pending: set[int] = set()  # slots whose copy back may still be on its way

    def keep(self, s: Slot, written: bool) -> None:
        """``s``'s device copy is about to be dropped; ``written``: its version moved."""
        if type(s.copy) is not torch.Tensor and fake_mode() is not None:
            return  # a trace's copy holds no values (See [Note: paging under a trace])
        if written:
            if s.name not in self._reported:
                self._reported.add(s.name)
                logger.info("adaptmem page: %r was written in place during a forward; its "
                            "device copy is copied back to the host after each use (keep it "
                            "resident to avoid that: raise resident_bytes)", s.name)
        elif not s.copy_back:
            return
        self.transfer.copy_back(s.master, s.copy)  # type: ignore[arg-type]
        if not self.synchronous:
            self._pending.add(id(s))

    def before_read(self, slots: Sequence[Slot]) -> None:
        """The masters of ``slots`` are to be read or written: finish copies back first."""
        if self._pending and not self._pending.isdisjoint([id(s) for s in slots]):
            self.finish()

    def finish(self) -> None:
        """Wait until every master copied back holds its values."""
        if self._pending:
            self.transfer.finish()
            self._pending.clear()
