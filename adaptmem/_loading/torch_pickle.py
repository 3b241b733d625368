"""The pickle of a ``torch.save`` zip archive, read without ``torch.load``.

See [Note: reading a state dict's pickle]. ``read_state`` gives the archive's object with
every tensor on the meta device, its storage's ``_checkpoint_offset`` where the storage's
bytes lie in the file, or None where the pickle holds anything but what a state dict (or a
training checkpoint around one) is made of: ``torch.load`` reads such archives instead.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

__all__ = ["read_state"]

# [Note: reading a state dict's pickle]
# Opening a checkpoint is the first part of every load, and for a torch.save archive most
# of it was torch.load's weights-only unpickler, written in Python: 11 ms for GPT-2
# small's 149 tensors on the 2-core VM (the recipe's torch.load(mmap=True) costs the same),
# of a 0.2 s warm load. Python's own unpickler, in C, with the same kind of restriction
# takes 1 ms, and making the 149 meta tensors 1 ms more. The restriction is the one the
# pickle module's documentation gives ("Restricting Globals"): the only names the pickle
# may use are OrderedDict, the two functions torch.save uses to rebuild a dense tensor or
# a parameter (replaced here by functions that make meta tensors and call nothing else),
# and the storage types of the usual dtypes. Anything else (another class, a quantized or
# sparse tensor, a dtype without a storage type, a storage the archive lacks or whose
# record's size is not the one the pickle says, a view reaching past its storage) stops the
# reading, and torch.load reads the archive as before, with its own checks and errors. The
# offsets are the records' own (read from their local headers, see [Note: where a record's
# bytes lie]), so they need no checking.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


class _NotAStateDict(Exception):
    """The pickle holds something ``read_state`` does not read."""


def _tensor(storage: Any, storage_offset: int, size: Any, stride: Any, *_: Any) -> torch.Tensor:
    """A meta tensor on ``storage`` (what ``_Unpickler.persistent_load`` gave), as
    ``torch._utils._rebuild_tensor_v2`` makes it; requires_grad, hooks and metadata are not
    needed to read the bytes."""
    if not (isinstance(storage, tuple) and len(storage) == 2
            and isinstance(storage[0], torch.UntypedStorage)):
        raise _NotAStateDict("a tensor without a storage of this archive")
    untyped, dtype = storage
    size, stride, storage_offset = tuple(size), tuple(stride), int(storage_offset)
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else 0
    if storage_offset < 0 or min(stride, default=0) < 0 or (
            span and (storage_offset + span) * dtype.itemsize > untyped.nbytes()):
        raise _NotAStateDict("a tensor that reaches past its storage")
    t = torch.empty((0,), dtype=dtype, device="meta")
    return t.set_(untyped, storage_offset, size, stride)


def _parameter(data: Any, *_: Any) -> torch.Tensor:
    """``torch._utils._rebuild_parameter``: its data is all a load needs."""
    if not isinstance(data, torch.Tensor):
        raise _NotAStateDict("a parameter that holds no tensor")
    return data


_NAMES: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _tensor,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    **{("torch", name): dtype for name, dtype in _STORAGE_DTYPES.items()},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, records: dict[str, tuple[int, int]]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._records = records
        self._storages: dict[str, tuple[torch.UntypedStorage, torch.dtype]] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = _NAMES.get((module, name))
        if found is None:
            raise _NotAStateDict(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], torch.dtype)):
            raise _NotAStateDict(f"a persistent id {pid!r:.80}")
        _, dtype, key, _location, numel = pid
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key not in self._storages:
            record = self._records.get(key)
            nbytes = int(numel) * dtype.itemsize
            if record is None or record[1] != nbytes:
                raise _NotAStateDict(f"storage {key} is not in the archive as it says")
            untyped = torch.UntypedStorage(nbytes, device="meta")
            untyped._checkpoint_offset = record[0]  # type: ignore[attr-defined]
            self._storages[key] = (untyped, dtype)
        return self._storages[key]


def read_state(data: bytes, records: dict[str, tuple[int, int]]) -> Any | None:
    """The object pickled in ``data`` (a ``torch.save`` archive's ``data.pkl``), its tensors
    on meta with their storages' ``_checkpoint_offset`` taken from ``records`` (storage key
    -> offset of its bytes in the file, size); None where it holds more than plain
    containers, numbers, strings and dense tensors (see [Note: reading a state dict's
    pickle])."""
    try:
        return _Unpickler(data, records).load()
    except Exception:  # torch.load reads it, and says what is wrong with it
        return None
