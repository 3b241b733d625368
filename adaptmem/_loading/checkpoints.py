"""Checkpoint readers: where each tensor lies in which file, and reading it into memory.

Opening a checkpoint reads headers only: a safetensors header, the pickle of a ``torch.save``
archive (loaded onto the meta device, which records each storage's byte offset and reads no
data), or a Hugging Face ``*.index.json``. Every file is checked (present, complete, readable)
before any tensor is read, so a load can refuse a bad checkpoint before it changes a model.

Reading puts a tensor's bytes straight into the memory that keeps them (``Reader.read_into``,
on a few reader threads), or through two staging chunks when a conversion or a device copy
follows (``Reader.copy_into``). Files are read with ``preadv`` in 16 MiB pieces, not mapped,
so the page cache never counts toward this process's memory: what the cache holds is copied
from it, and a large tensor's pieces that it does not hold are read past it with O_DIRECT
(see [Note: reading past the page cache]); other uncached pieces ask for the next 64 MiB to
be read ahead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import math
import mmap
import os
import re
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .._common.errors import LoadError
from .._common.threads import SmallStackPool
from ..cpu_memory import control_group_folders, map_file
from .direct import DIRECT_PIECE, DirectReads, soft_limit
from .entries import Entry, contiguous_stride
from .new_memory import NewMemory, populate
from .open_files import FileId, OpenFiles, file_id, replaced_message
from .staging import Staging, copy_to

__all__ = ["Entry", "Checkpoint", "Reader", "open_checkpoint", "TORCH_SUFFIXES", "copy_to",
           "is_extra_state_key"]

logger = logging.getLogger("adaptmem")

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}
# Dtypes whose element holds two of the file's values: the header's last dimension counts
# values (an F4 tensor of torch shape [4, 4] is stored as [4, 8]).
_PACKED_PAIRS = frozenset({"F4"})
# A safetensors header above this is a corrupt length field, not a real header.
_MAX_HEADER = 100 * 1024 * 1024


@dataclass
class Checkpoint:
    """Every tensor of a checkpoint by key, the files that hold them, and the format; and
    the modules' extra state that is not a tensor (``get_extra_state``'s dict, say), by key
    (see [Note: extra state])."""

    entries: dict[str, Entry]
    files: list[str]
    format: str
    extra_states: dict[str, object] = field(default_factory=dict)
    # file -> (st_dev, st_ino) of the file its header was read from (see [Note: a file
    # replaced during a load]).
    identities: dict[str, FileId] = field(default_factory=dict)


def is_extra_state_key(key: object) -> bool:
    """Whether ``key`` is where ``state_dict()`` puts a module's ``get_extra_state()``."""
    return isinstance(key, str) and (key == "_extra_state" or key.endswith("._extra_state"))


def open_checkpoint(checkpoint: str | os.PathLike[str], key: str | None = None) -> Checkpoint:
    """Read the headers of ``checkpoint`` (a file, an ``*.index.json``, or a directory);
    ``key``: the entry of a ``torch.save``d dict that holds the state dict.

    Raises:
        LoadError: the path does not exist, a file is truncated, not a checkpoint or has
            a corrupt header or layout (tensor data holds no checksum to check), or an
            index names a shard that is missing.
    """
    path = Path(os.fspath(checkpoint))
    if not path.exists():
        raise LoadError(f"checkpoint {str(path)!r} does not exist")
    if key is not None:
        return _open_keyed(path, key)
    if path.is_dir():
        indexes = sorted(path.glob("*.index.json"))
        if indexes:
            # Both formats side by side (as on the Hugging Face hub): prefer safetensors.
            indexes.sort(key=lambda p: ".safetensors." not in p.name)
            return _open_index(indexes[0])
        files = sorted(p for p in path.iterdir() if p.is_file() and _is_checkpoint_file(p))
        weights = [p for p in files if p.name in _WEIGHTS_NAMES]
        if weights:
            # A Hugging Face model or Trainer directory: its weights file, not the optimizer,
            # scheduler, RNG and argument files saved beside it.
            weights.sort(key=lambda p: _WEIGHTS_NAMES.index(p.name))
            return _open_file(weights[0])
        if any(p.suffix.lower() == ".safetensors" for p in files):
            # A model directory with both formats (model.safetensors beside
            # pytorch_model.bin) holds the same tensors twice: read the safetensors.
            files = [p for p in files if p.suffix.lower() == ".safetensors"]
        if not files:
            raise LoadError(
                f"directory {str(path)!r} holds no checkpoint: expected an *.index.json, "
                f"*.safetensors files or torch.save files ({', '.join(TORCH_SUFFIXES)})"
            )
        return _merge([_open_file(p, single_key=p.stem) for p in files], "directory")
    if path.name.endswith(".index.json"):
        return _open_index(path)
    return _open_file(path)


# The single-file weights of a Hugging Face model directory, the first one preferred.
_WEIGHTS_NAMES = ["model.safetensors", "pytorch_model.bin"]


def _is_checkpoint_file(p: Path) -> bool:
    return p.suffix.lower() == ".safetensors" or p.suffix.lower() in TORCH_SUFFIXES


def _merge(parts: list[Checkpoint], fmt: str) -> Checkpoint:
    entries: dict[str, Entry] = {}
    files: list[str] = []
    extra: dict[str, object] = {}
    identities: dict[str, FileId] = {}
    for part in parts:
        extra.update(part.extra_states)
        identities.update(part.identities)
        for key, entry in part.entries.items():
            if key in entries:
                raise LoadError(
                    f"tensor {key!r} is stored twice: in {entries[key].file!r} and "
                    f"{entry.file!r}; remove one of the files"
                )
            entries[key] = entry
        files.extend(part.files)
    kinds = sorted({p.format for p in parts})
    return Checkpoint(entries, files, f"{fmt} ({', '.join(kinds)})", extra, identities)


def _open_index(index: Path) -> Checkpoint:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, Mapping):
            raise TypeError("weight_map is not a mapping")
        odd = [f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)]
        if odd:
            raise TypeError(f"weight_map maps tensors to things that are not shard file "
                            f"names: {', '.join(odd[:3])}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(
            f"index {str(index)!r} is not a sharded-checkpoint index (a JSON object with a "
            f"'weight_map' of tensor name -> shard file): {exc}"
        ) from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise LoadError(
            f"index {str(index)!r} names {len(missing)} shard(s) that do not exist: "
            + ", ".join(repr(str(index.parent / s)) for s in missing)
        )
    parts = [_open_file(index.parent / s) for s in shards]
    merged = _merge(parts, "sharded")
    for key, shard in weight_map.items():
        entry = merged.entries.get(key)
        if entry is None or Path(entry.file).name != Path(shard).name:
            raise LoadError(
                f"index {str(index)!r} puts {key!r} in {shard!r}, but that shard does not "
                f"hold it; the index and the shards do not match"
            )
    return merged


def _open_keyed(path: Path, key: str) -> Checkpoint:
    """The state dict under ``key`` of the ``torch.save`` file ``path``."""
    what = "a directory" if path.is_dir() else None
    if what is None:
        with open(path, "rb") as f:
            if not _looks_like_safetensors(f.read(32)):
                return _open_torch(path, f, None, key)
            what = "a .safetensors file, whose keys are flat"
    raise LoadError(f"key={key!r} picks the entry of a torch.save file's dict that holds "
                    f"the state dict; {str(path)!r} is {what}. Leave key= out")


def _open_file(path: Path, single_key: str | None = None) -> Checkpoint:
    if not path.is_file():
        raise LoadError(f"checkpoint file {str(path)!r} does not exist")
    if path.stat().st_size == 0:
        raise LoadError(f"checkpoint file {str(path)!r} is empty (0 bytes): was it written "
                        f"completely?")
    # One open for the whole header: see [Note: a file replaced during a load].
    with open(path, "rb") as f:
        head = f.read(32)
        # The bytes decide where they are clear, the suffix where they are not: a file named
        # for one format holding the other (renamed, or a suffix in capitals) is read as what
        # it is, and a Git LFS pointer left where a checkpoint should be is named as one.
        if head.startswith(b"PK\x03\x04"):  # a zip archive: torch.save's format since 1.6
            return _open_torch(path, f, single_key)
        if head.startswith(b"version https://git-lfs"):  # model.safetensors, as often as not
            raise LoadError(f"{str(path)!r} is a Git LFS pointer, not the checkpoint it stands "
                            f"for: fetch the file itself (git lfs pull, or download it again)")
        if _looks_like_safetensors(head):
            return _open_safetensors(path, f)
        if head.startswith(_LEGACY_MAGIC) or path.suffix.lower() != ".safetensors":
            return _open_torch(path, f, single_key)
        return _open_safetensors(path, f)  # named so, and nothing else: its own error says why


# torch.save before 1.6: a pickle (protocol 2) whose first object is torch's magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a"


def _looks_like_safetensors(head: bytes) -> bool:
    """A little-endian 8-byte header length, then the JSON header's opening brace."""
    return len(head) > 8 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little")


def _open_safetensors(path: Path, f: BinaryIO) -> Checkpoint:
    """The header of ``path``, read through ``f`` (open on it)."""
    # The header is parsed here rather than through safetensors.safe_open: safe_open maps the
    # whole file privately, which counts toward RLIMIT_DATA (set_cpu_memory_limit) and puts
    # every page it touches into this process's RSS. The checks mirror safetensors' own.
    name = str(path)
    stat = os.fstat(f.fileno())
    size = stat.st_size
    f.seek(0)
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        raise LoadError(f"{name!r} is truncated or not a safetensors file: its header "
                        f"length field reads {length} for a file of {size} bytes (it "
                        f"begins with {head!r})")
    try:
        header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as exc:
        raise LoadError(f"{name!r} is corrupt: its safetensors header is not valid JSON "
                        f"({exc})") from None
    data_start = 8 + length
    entries: dict[str, Entry] = {}
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = getattr(torch, _SAFETENSORS_DTYPES.get(info["dtype"], ""), None)
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise LoadError(f"{name!r} is corrupt: the header entry for {key!r} is "
                            f"malformed: {info!r}") from None
        if not isinstance(dtype, torch.dtype):
            known = info["dtype"] in _SAFETENSORS_DTYPES
            raise LoadError(
                f"{name!r}: tensor {key!r} has dtype {info['dtype']!r}, which "
                + (f"this torch ({torch.__version__}) cannot hold; a newer torch can" if known
                   else f"adaptive.load does not know (it reads "
                        f"{', '.join(_SAFETENSORS_DTYPES)})"))
        if info["dtype"] in _PACKED_PAIRS:
            if not shape or shape[-1] % 2:
                raise LoadError(f"{name!r} is corrupt: tensor {key!r} of {info['dtype']} has "
                                f"shape {list(shape)}, whose last dimension must be even (two "
                                f"values a byte)")
            shape = (*shape[:-1], shape[-1] // 2)
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise LoadError(f"{name!r} is corrupt: tensor {key!r} spans {end - begin} bytes "
                            f"but shape {list(shape)} of {info['dtype']} needs "
                            f"{math.prod(shape) * dtype.itemsize}")
        spans.append((begin, end, key))
        entries[key] = Entry(key, name, shape, dtype, data_start + begin, 0,
                             contiguous_stride(shape))
    covered = 0
    for begin, end, key in sorted(spans):
        if begin != covered:
            raise LoadError(f"{name!r} is corrupt: tensor {key!r} starts at byte {begin} of "
                            f"the data, expected {covered} (overlap or gap)")
        covered = end
    if data_start + covered != size:
        state = "truncated" if data_start + covered > size else "corrupt"
        raise LoadError(f"{name!r} is {state}: its header describes {data_start + covered} "
                        f"bytes, the file has {size}")
    return Checkpoint(entries, [name], "safetensors", identities={name: file_id(stat)})


def _open_torch(path: Path, f: BinaryIO, single_key: str | None,
                state_key: str | None = None) -> Checkpoint:
    """The pickle and archive layout of the ``torch.save`` file ``path``, read through ``f``
    (open on it)."""
    name = str(path)
    stat = os.fstat(f.fileno())
    f.seek(0)
    head = f.read(16)
    f.seek(0)
    legacy = not head.startswith(b"PK\x03\x04")  # a zip archive, the format since torch 1.6
    archive = None
    try:
        if legacy:
            # The pre-1.6 format stores no offsets; it can only be read whole.
            # A pickle torch.save did not write (protocol 4, pickle.dump's) is refused below
            # as no checkpoint: torch's warning that it may not parse it says less.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
                warnings.filterwarnings("ignore", _SPARSE_CHECK, UserWarning)
                obj = torch.load(f, map_location="cpu", weights_only=True)
            logger.info("adaptmem.load: %s is a legacy torch.save file; read it whole", name)
        else:
            archive = _check_archive(path, f)
            f.seek(0)
            # On the meta device torch reads the pickle only and records where each storage
            # lies in the archive (`_checkpoint_offset`); no data is read or mapped. A file,
            # not a name: torch.load reads a *.safetensors name as safetensors.
            with warnings.catch_warnings(), _meta_sparse_unchecked():
                warnings.filterwarnings("ignore", _SPARSE_CHECK, UserWarning)
                obj = torch.load(f, map_location="meta", weights_only=True)
    except LoadError:
        raise
    except Exception as exc:
        why = str(exc) or type(exc).__name__
        if "'QuantizedMeta' backend" in why:  # torch cannot make a quantized tensor on meta
            raise LoadError(_quantized(name, path)) from None
        if "meta tensor" in why.lower():  # torch rebuilds such a tensor eagerly
            why += (" (it holds a tensor torch rebuilds when loading, such as a nested one: "
                    "adaptive.load reads dense tensors; load this file with torch.load)")
        if legacy and not head.startswith(b"\x80"):  # not a pickle either
            raise LoadError(_not_a_checkpoint(name, head)) from None
        elif isinstance(exc, zipfile.BadZipFile):
            raise LoadError(
                f"{name!r} is truncated or corrupt: it begins as a torch.save archive (a zip "
                f"file), but its archive cannot be read ({why}); was it written or downloaded "
                f"completely?") from None
        elif "Weights only load failed" in why:
            raise LoadError(_not_weights_only(name, why)) from None
        else:
            raise LoadError(f"{name!r} is not a readable torch.save checkpoint: {why}") from None
    if isinstance(obj, torch.Tensor) and single_key is not None:
        obj = {single_key: obj}
    state, extra = _state_dict_of(obj, name, state_key)
    _refuse_not_dense(state, name)
    entries: dict[str, Entry] = {}
    size = stat.st_size
    where = None if archive is None else archive.where(obj, name)
    for key, t in state.items():
        shape, stride = tuple(t.shape), tuple(t.stride())
        if legacy or where is None:
            entries[key] = Entry(key, name, shape, t.dtype, None, 0, stride, tensor=t)
            continue
        offset = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if offset is None:  # torch older than ~2.5 records no offsets on meta
            return _open_torch_mapped(path, file_id(stat), single_key, state_key,
                                      "this torch gives no storage offsets")
        entry = Entry(key, name, shape, t.dtype, where[int(offset)], int(t.storage_offset()),
                      stride)
        if entry.numel and entry.start + entry.span * t.dtype.itemsize > size:
            raise LoadError(f"{name!r} is truncated or corrupt: tensor {key!r} lies past the "
                            f"end of the file")
        entries[key] = entry
    return Checkpoint(entries, [name], "torch", extra, {name: file_id(stat)})


# The reasons torch's weights-only unpickler gives: "Unsupported class argparse.Namespace"
# (torch 2.1-2.3), "Unsupported global: GLOBAL argparse.Namespace was not an allowed global
# by default" (2.4 on), "Trying to load unsupported GLOBAL posix.system whose module posix
# is blocked", "Unsupported operand 118". torch.load wraps them in advice whose layout
# changed from version to version (after "WeightsUnpickler error:" on the same line, on a
# line of its own after numbered options, ...), so a reason is looked for anywhere in it.
_REFUSAL = re.compile(r"(Unsupported global: GLOBAL|Unsupported class|Unsupported operand"
                      r"|Trying to load unsupported GLOBAL) [^\n]*")


def _not_weights_only(name: str, why: str) -> str:
    """What to do about a file ``torch.load(weights_only=True)`` refused (``why``)."""
    found = _REFUSAL.search(why)
    if found is not None:
        reason = found.group(0).split(". ", 1)[0].rstrip(". ")
    else:  # a reason not known here: what lies between torch's advice and its pointer
        body = why.split("Check the documentation", 1)[0]
        marker = "WeightsUnpickler error:"
        body = (body.split(marker, 1)[1] if marker in body
                else body.split("trusted source.", 1)[-1])
        reason = " ".join(line.strip() for line in body.splitlines() if line.strip())
        reason = reason.split(". Please use")[0]
    if reason.startswith("Unsupported operand"):  # not what torch.save writes
        return (f"{name!r} is not a checkpoint that torch.load(weights_only=True) can read: "
                f"its pickle uses an instruction that loader refuses ({reason}), as a file "
                f"written with pickle.dump rather than torch.save would. Save the state dict "
                f"with torch.save(model.state_dict(), path)")
    if reason.startswith("Trying to load unsupported GLOBAL") and "is blocked" in reason:
        return (f"{name!r} holds objects other than tensors and plain containers ({reason}): "
                f"torch.load(weights_only=True), which adaptive.load reads checkpoints as, "
                f"refuses that module whatever torch.serialization.safe_globals allows, since "
                f"loading it can run code. Save the state dict alone, from a process that "
                f"trusts the file: torch.save(model.state_dict(), path)")
    serialization = torch.serialization
    if hasattr(serialization, "safe_globals"):  # torch 2.5 on
        allow = ("allow those types around the load: with torch.serialization.safe_globals("
                 "[...]): adaptive.load(...)")
    elif hasattr(serialization, "add_safe_globals"):  # torch 2.4
        allow = ("allow those types before the load: torch.serialization.add_safe_globals("
                 "[...]); adaptive.load(...)")
    else:
        allow = (f"update torch: this one ({torch.__version__}) cannot allow them (torch 2.5 "
                 f"can, with torch.serialization.safe_globals)")
    return (f"{name!r} holds objects other than tensors and plain containers"
            f"{f' ({reason})' if reason else ''}, and adaptive.load reads checkpoints as "
            f"torch.load(weights_only=True) does, which refuses them. If you trust the file, "
            f"{allow}; or save model.state_dict() alone")


def _quantized(name: str, path: Path) -> str:
    """Why ``name`` (at ``path``), which holds quantized tensors, is refused, naming the first
    key that holds one when the file can be mapped to find it."""
    where = ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        key = _first_quantized(obj, "")
        if key is not None:
            where = f" (first: {key[0]!r}, {key[1]})"
    except Exception:  # the key is a courtesy: the refusal stands without it
        pass
    return (f"{name!r} holds quantized tensors{where}, which adaptive.load does not read: it "
            f"reads dense tensors. Load it with model.load_state_dict(torch.load(path)) into "
            f"the quantized model")


def _first_quantized(obj: Any, prefix: str) -> tuple[str, torch.dtype] | None:
    """The key path and dtype of the first quantized tensor in ``obj`` (nested dicts, lists
    and tuples, as a quantized module's state dict holds its packed weights)."""
    if isinstance(obj, torch.Tensor):
        return (prefix, obj.dtype) if obj.is_quantized else None
    items = (obj.items() if isinstance(obj, dict) else
             enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    for k, v in items:
        found = _first_quantized(v, f"{prefix}[{k}]" if isinstance(k, int) else
                                 f"{prefix}.{k}" if prefix else str(k))
        if found is not None:
            return found
    return None


# [Note: tensors that are not dense]
# adaptive.load reads a tensor as bytes at an offset in the file, which only a dense
# (strided) tensor is: a sparse tensor (COO, CSR, CSC, BSR, BSC) is several tensors that
# torch rebuilds into one, and a nested one has no single shape. How torch.load on meta
# treats them depends on the version: torch 2.14 checks a sparse tensor's invariants
# whenever weights_only=True and fails there ("Cannot copy out of meta tensor"), torch 2.11
# checks only where asked to and hands the tensor back, whose storage then cannot be read.
# So a load on meta skips torch's check where every tensor it would check is on meta (it
# has no data to check; `_meta_sparse_unchecked`), and the tensors of the state dict are
# checked once loaded, whatever the path (meta, a legacy file, torch.load(mmap=True)): the
# refusal names the key. A sparse tensor outside the state dict (beside it in a training
# checkpoint) is no concern of the load: it is passed over, its storages counted among the
# archive's. Reading the file again through torch.load(mmap=True) instead would name the
# key too, but map the whole file, which a CPU memory cap counts and the load's peak does.
# torch 2.14 warns so at each weights_only load of a sparse tensor; the load refuses it, or
# passes over it outside the state dict.
_SPARSE_CHECK = "Validating sparse tensor invariants"
_unchecked_lock = threading.Lock()
_unchecked: list[Any] = [0, None]  # loads on meta under way; torch's check they replaced


def _check_unless_meta(*args: Any, **kwargs: Any) -> Any:
    """torch's check of loaded sparse tensors, passing over a batch all on meta."""
    pending = getattr(torch._utils, "_sparse_tensors_to_validate", None)
    if pending and all(t.is_meta for t in pending):
        pending.clear()  # what torch's check does once done
        return None
    return _unchecked[1](*args, **kwargs)


@contextlib.contextmanager
def _meta_sparse_unchecked() -> Any:
    """Around a ``torch.load`` on meta: torch's check of loaded sparse tensors passes over a
    batch of tensors that are all on meta (and so hold nothing to check); any other batch,
    of any thread's load, goes through torch's own check as before. Loads that overlap
    (threads) share one replacement, put back when the last of them ends."""
    if getattr(torch._utils, "_validate_loaded_sparse_tensors", None) is None:
        yield  # an older torch
        return
    with _unchecked_lock:
        if _unchecked[0] == 0:
            _unchecked[1] = torch._utils._validate_loaded_sparse_tensors
            torch._utils._validate_loaded_sparse_tensors = _check_unless_meta
        _unchecked[0] += 1
    try:
        yield
    finally:
        with _unchecked_lock:
            _unchecked[0] -= 1
            if _unchecked[0] == 0:
                torch._utils._validate_loaded_sparse_tensors = _unchecked[1]
                _unchecked[1] = None


def _refuse_not_dense(state: Mapping[str, torch.Tensor], name: str) -> None:
    """Refuse a tensor of ``state`` (of the file ``name``) that is not a dense one."""
    for key, t in state.items():
        if t.layout is not torch.strided or t.is_nested:
            kind = "is a nested tensor" if t.is_nested else f"has layout {t.layout}"
            fix = ("save it again with that tensor dense: {k: v.to_dense() if v.is_sparse "
                   "else v for k, v in torch.load(path).items()}" if not t.is_nested else
                   "load it with torch.load and give the model dense tensors")
            raise LoadError(
                f"{name!r} is not a readable checkpoint for adaptive.load: its tensor {key!r} "
                f"{kind}, and adaptive.load reads dense tensors only, not one torch "
                f"rebuilds when loading, such as a sparse one or a nested one; {fix}")


def _not_a_checkpoint(name: str, head: bytes) -> str:
    """What was expected of ``name``, which begins with ``head`` and is no torch.save file."""
    return (f"{name!r} is not a checkpoint: expected a torch.save file (a zip archive, or a "
            f"pickle as torch.save wrote before torch 1.6) or a .safetensors file, but it "
            f"begins with {head!r}")


def _open_torch_mapped(path: Path, identity: FileId, single_key: str | None,
                       state_key: str | None, because: str) -> Checkpoint:
    """Fallback without offsets (``because``, for the log): tensors from
    ``torch.load(mmap=True)``, copied from there (pages of the mapping count toward RSS until
    the load ends). ``identity``: the file's whose archive was checked."""
    name = str(path)
    logger.info("adaptmem.load: %s; reading %s through torch.load(mmap=True)", because, name)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _SPARSE_CHECK, UserWarning)
            obj = torch.load(name, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise LoadError(f"{name!r} is not a readable torch.save checkpoint: {exc}") from None
    # torch.load takes a name here: the file it mapped is the one the name reaches after it
    # (or a save that lands in between fails the check: a LoadError, not garbage).
    with contextlib.suppress(OSError):
        if file_id(os.stat(name)) != identity:
            raise LoadError(replaced_message(name))
    if isinstance(obj, torch.Tensor) and single_key is not None:
        obj = {single_key: obj}
    state, extra = _state_dict_of(obj, name, state_key)
    _refuse_not_dense(state, name)
    entries = {k: Entry(k, name, tuple(t.shape), t.dtype, None, 0, tuple(t.stride()), tensor=t)
               for k, t in state.items()}
    return Checkpoint(entries, [name], "torch (mmap)", extra, {name: identity})


def _check_archive(path: Path, f: BinaryIO) -> _Archive:
    """Refuse what cannot be read in place (another byte order, compressed tensors); return
    where each tensor record's bytes lie (see [Note: where a record's bytes lie]). ``f``:
    ``path`` open."""
    records: dict[str, tuple[int, int]] = {}
    computed = False
    with zipfile.ZipFile(f) as z:
        if _fadvise is not None:
            # 30 bytes per tensor record, spread over the file: asked for all at once (one
            # page each, no read-ahead), a cold file's are read together, not one by one.
            with contextlib.suppress(OSError):
                _fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                for info in z.infolist():
                    if "/data/" in info.filename:
                        _fadvise(f.fileno(), info.header_offset, 30, os.POSIX_FADV_WILLNEED)
        for info in z.infolist():
            if info.filename.endswith("/byteorder"):
                order = z.read(info).decode().strip()
                if order != sys.byteorder:
                    raise LoadError(f"{str(path)!r} was saved {order}-endian; this machine is "
                                    f"{sys.byteorder}-endian. Convert it with torch.load/save")
            elif info.filename.endswith("/.format_version"):
                computed = z.read(info) >= b"1"  # as torch.load decides
            elif "/data/" in info.filename:
                if info.compress_type != zipfile.ZIP_STORED:
                    raise LoadError(f"{str(path)!r} stores compressed tensors; save it again "
                                    f"with torch.save")
                f.seek(info.header_offset)
                head = f.read(30)
                if len(head) < 30 or head[:4] != b"PK\x03\x04":
                    raise LoadError(f"{str(path)!r} is corrupt: the zip record "
                                    f"{info.filename!r} has no local header where the "
                                    f"archive's directory puts it")
                start = (info.header_offset + 30 + int.from_bytes(head[26:28], "little")
                         + int.from_bytes(head[28:30], "little"))
                records[info.filename.rpartition("/data/")[2]] = (start, info.file_size)
    if _fadvise is not None:  # torch.load reads the pickle through ``f`` next
        with contextlib.suppress(OSError):
            _fadvise(f.fileno(), 0, 0, os.POSIX_FADV_NORMAL)
    return _Archive(records, computed)


# [Note: where a record's bytes lie]
# torch.load on the meta device records where each storage lies in the archive
# (`_checkpoint_offset`), but since format version 1 it computes those offsets rather than
# reading them: it assumes torch's own writer, which puts the records in key order, each
# one's bytes aligned to 64 after a local header padded to reach that. An archive written
# otherwise (copied record by record with Python's zipfile, say) is a valid checkpoint that
# torch.load reads right, yet those offsets point into headers and padding: garbage loaded
# silently. So each record's real offset is read from its local header (30 bytes, its name
# and extra field lengths; the central directory's extra field may differ), and torch's
# offsets are checked against them. Storages are loaded, and torch's offsets computed, in
# key order ("0", "1", ...: torch.save numbers storages as it first meets them), so the
# i-th smallest offset torch gives is record i's; where they differ, record i's real offset
# is used, its size checked against the storage's. An archive whose storages cannot all be
# found in what it holds, and whose offsets are not all real ones, is refused.
@dataclass
class _Archive:
    """The tensor records of a zip ``torch.save`` archive: storage key -> (offset of its
    bytes, size); ``computed``: torch computes offsets instead of reading them."""

    records: dict[str, tuple[int, int]]
    computed: bool

    def where(self, obj: object, name: str) -> dict[int, int]:
        """torch's offset of every storage in ``obj`` (loaded on meta) -> where its bytes
        lie (see [Note: where a record's bytes lie])."""
        storages = _storage_sizes(obj)
        keys = [str(i) for i in range(len(storages))]
        if self.computed and len(storages) == len(self.records) and all(
                k in self.records for k in keys):
            order = list(zip(sorted(storages), keys, strict=True))
            if all(self.records[k][1] == storages[at] for at, k in order):
                out = {at: self.records[k][0] for at, k in order}
                if any(at != start for at, start in out.items()):
                    logger.info("adaptmem.load: %s was not written by torch.save's writer; "
                                "its tensors' offsets are read from the archive", name)
                return out
        else:  # torch read the offsets (format version 0), or not every storage was found
            real = dict(self.records.values())
            if all(real.get(at) == n for at, n in storages.items()):
                return {at: at for at in storages}
        raise LoadError(f"{name!r}: cannot tell where its tensors lie in the archive (it was "
                        f"not written by torch.save, and its records do not match its "
                        f"storages); load it with torch.load and save it again with torch.save")


def _storage_sizes(obj: object) -> dict[int, int]:
    """torch's offset -> size of every storage in ``obj``, a checkpoint loaded on meta."""
    out: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.layout is not torch.strided or item.is_nested:
                stack.extend(_parts(item))  # see [Note: tensors that are not dense]
                continue
            item = item.untyped_storage()
        elif isinstance(item, torch.TypedStorage):  # torch.save of a storage itself
            item = item._untyped_storage
        if isinstance(item, torch.UntypedStorage):
            at = getattr(item, "_checkpoint_offset", None)
            if at is not None:
                out[int(at)] = item.nbytes()
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return out


def _parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors a sparse tensor ``t`` is made of (whose storages the archive holds);
    none for a nested one."""
    if t.layout is torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return t.ccol_indices(), t.row_indices(), t.values()
    return ()


# Where training code keeps the model's state dict inside a checkpoint of more things
# (Lightning, the PyTorch tutorials, many research repositories, DeepSpeed).
_NESTED_KEYS = ("state_dict", "model_state_dict", "model", "module")


def _not_state(key: object, value: object) -> bool:
    """Whether an item cannot be in a state dict: not a named tensor, nor extra state."""
    return not (isinstance(key, str) and isinstance(value, torch.Tensor)) and not (
        is_extra_state_key(key))


def _state_dict_of(obj: object, name: str, key: str | None = None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The tensors of the state dict ``obj`` is (or holds under ``key``, or else under one of
    ``_NESTED_KEYS``), and its extra state that is not a tensor."""
    nested_in = None
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            held = (f"its keys are {', '.join(map(repr, list(obj)[:8]))}"
                    f"{' ...' if len(obj) > 8 else ''}" if isinstance(obj, Mapping)
                    else f"it holds a {type(obj).__name__}")
            raise LoadError(f"{name!r} has no entry {key!r} (key=): {held}")
        obj, nested_in = obj[key], key
    elif isinstance(obj, Mapping) and any(_not_state(k, v) for k, v in obj.items()):
        for key in _NESTED_KEYS:
            nested = obj.get(key)
            if isinstance(nested, Mapping) and nested and any(
                    isinstance(v, torch.Tensor) for v in nested.values()):
                logger.info("adaptmem.load: reading the state dict under %r of %s", key, name)
                obj, nested_in = nested, key
                break
    if isinstance(obj, Mapping):
        others = [k for k, v in obj.items() if _not_state(k, v)]
        if others:
            shown = ", ".join(repr(k) for k in others[:5]) + (" ..." if len(others) > 5 else "")
            where = (f"its state dict under {nested_in!r} holds {len(others)} "
                     if nested_in is not None else f"it holds a mapping with {len(others)} ")
            looked = (f"; a state dict is looked for at the top level and under "
                      f"{', '.join(map(repr, _NESTED_KEYS))}, or under the entry key= names"
                      if nested_in is None else "")
            raise LoadError(
                f"{name!r} is not a state dict adaptive.load can read: {where}"
                f"{'entry that is' if len(others) == 1 else 'entries that are'} neither a "
                f"named tensor nor a module's extra state ({shown}){looked}. Save "
                f"model.state_dict(), or load this file with torch.load and "
                f"model.load_state_dict")
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        return tensors, {k: v for k, v in obj.items() if not isinstance(v, torch.Tensor)}
    kind = type(obj).__name__
    raise LoadError(
        f"{name!r} holds {'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}, not a state "
        f"dict (a mapping of names to tensors); save model.state_dict()")


# [Note: reading speed]
# Copying from the page cache into memory that exists runs at memcpy speed (3-15 GB/s on a
# shared 2-core VM); a load into new tensors is bound by the kernel handing out fresh pages
# (zeroed, faulted in; 0.4-1.3 GB/s there in a fresh process). Transparent huge pages
# (madvise(MADV_HUGEPAGE) on an anonymous mapping) were measured twice and dropped: on that
# VM, new memory in huge pages filled 5-9x slower in a fresh process than in 4 KiB pages,
# and pre-faulting (MADV_POPULATE_WRITE) on the reading thread moves the same work earlier
# without making it cheaper (`benchmarks/loading.py --page-probe`). So new tensors are
# ordinary memory: a large one the page cache holds is filled from it without being zeroed
# first (see [Note: filling new memory from the page cache]), the others are faulted in by
# other threads while this one reads (see [Note: faulting new memory ahead]).
# Files are read in _CHUNK pieces; before each, the kernel is asked (POSIX_FADV_WILLNEED) to
# start reading the next _AHEAD bytes, so a cold disk keeps working while this thread waits
# on page faults, beyond the kernel's own read-ahead window (which grows only as reads reach
# it). The hint is not free when the file is cached (0.45 s of 2.2 for a 2.9 GiB warm load
# on that VM: it walks the cache for every page), so each piece is first read without
# waiting for the disk (`preadv` with RWF_NOWAIT, Linux 4.14+): what the cache holds is read
# at once, and only a piece that must come from the disk asks for read-ahead. Both are
# skipped where the system lacks them.
# Tried and rejected (2026-11-27): a private (copy-on-write) mapping of a cached tensor's
# bytes of the file, faulted in for writing, copies each page without zeroing it first, and
# loaded GPT-2 small warm in 0.138-0.179 s against 0.178-0.206 s (eight interleaved pairs;
# GPT-2 large 0.68-0.71 against 0.83-0.85 s). But truncating a file discards even the
# private pages of its mappings past the new end (POSIX wants SIGBUS there): a model loaded
# so crashed with SIGBUS once its checkpoint was saved again over the same path (torch.save
# truncates first), though every page was the process's own. A copying load must not depend
# on the file afterwards.
# Also tried then, for conversions (dtype, device), and dropped on that VM: O_DIRECT reads
# into the staging chunks (placed so that address and file offset agree modulo 4 KiB), and
# filling the next entry's chunk while the caller converts the current one. Loading GPT-2
# small `.safetensors` as float16 took 0.44-0.64 s cold and 0.25-0.29 s warm against
# 0.44-0.59 and 0.23-0.27 s before: a chunk filled by a few 4 MiB direct requests keeps the
# disk less busy than buffered reads with read-ahead, and with two cores, copying from the
# cache, converting and faulting in the new tensors already use both. Worth measuring again
# on a machine with more cores and a faster disk (a GPU host).
#
# [Note: the first page of a mapped tensor]
# A tensor of a copy=False load is read when it is first touched, through page faults on the
# file's mapping. Where the kernel caches files in large folios and maps them whole (ext4 and
# transparent huge pages set to "always", as on the development VM), a fault in a cold file
# reads a 2 MiB folio synchronously, and touching GPT-2 small's 0.46 GiB took 0.26-1.2 s
# from run to run (564 faults), where meta + torch.load(mmap=True) took 0.27-0.35 s (5,000
# faults): torch reads each record's header on loading, which leaves a small page at every
# tensor's start in the cache, and faults then read around it in small pieces with the
# kernel's read-ahead running ahead. Asking for each mapped tensor's first page
# (POSIX_FADV_WILLNEED, 4 KiB, not waited for) does the same: 0.29-0.32 s over five runs
# against 0.81-0.99 s without, in the same minutes. It costs a system call per tensor.
# A conversion (dtype, device) goes through two staging chunks of _CHUNK bytes (`Staging`).
_CHUNK = 16 * 2**20
_AHEAD = 64 * 2**20
_preadv = getattr(os, "preadv", None)
_fadvise = getattr(os, "posix_fadvise", None)


# [Note: a container's CPU quota]
# A container held to N CPUs (``docker run --cpus``, a Kubernetes pod's ``limits.cpu``, a
# systemd unit's ``CPUQuota``) sees every core of the host in its affinity mask; the quota
# belongs to its control group: cgroup v2's ``cpu.max`` ("quota period", or "max"), cgroup
# v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1: none). A pool of a thread per
# host core there only waits its turn, throttled. So the usable cores are the affinity
# mask's, within ceil(quota / period) of each group of the process, its own and those above
# it (found as for memory, see [Note: a container's memory limit] in cpu_memory.py). The
# quota files are found once per process; they and the affinity mask are read at each load
# (when its pool starts: a few small files), so ``docker update --cpus`` and a mask set after
# import count. No files, odd contents: no quota.
_quota_files: list[tuple[str, str | None]] | None = None  # (quota, period or None for v2)


def _cpu_quota_files() -> list[tuple[str, str | None]]:
    """The files of this process's control groups that can hold a CPU quota, found once."""
    global _quota_files
    if _quota_files is None:
        _quota_files = [
            (folder + "cpu.cfs_quota_us", folder + "cpu.cfs_period_us") if v1
            else (folder + "cpu.max", None)
            for folder, v1 in control_group_folders("cpu")
            if os.path.exists(folder + ("cpu.cfs_quota_us" if v1 else "cpu.max"))]
    return _quota_files


def _quota_cores(quota_file: str, period_file: str | None) -> int | None:
    """The cores a group's CPU quota allows (at least 1); None for no quota or no reading."""
    try:
        with open(quota_file) as f:
            text = f.read().split()
        if period_file is None:  # v2: "quota period"
            quota, period = text[0], text[1]
        else:
            with open(period_file) as f:
                quota, period = text[0], f.read().strip()
        if quota == "max" or int(quota) <= 0 or int(period) <= 0:  # v1 writes -1 for none
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, IndexError):
        return None


def _usable_cores() -> int:
    """The cores this process may run on: its affinity mask (where the system has one),
    within its control groups' CPU quota (see [Note: a container's CPU quota])."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    for quota_file, period_file in _cpu_quota_files():
        quota = _quota_cores(quota_file, period_file)
        if quota is not None:
            cores = min(cores, quota)
    return cores


def _pool_size(capped: bool) -> int:
    """Reader threads for a load (see [Note: the loader's pool]); ``capped``: under a cap on
    the data segment, where each thread's stack and malloc arena count for good."""
    if _WORKERS is not None and not capped:
        return _WORKERS
    cores = _usable_cores()
    return min(4, cores) if capped else max(4, min(16, cores))


# [Note: the loader's pool]
# The reader threads both read past the page cache (four keep the disk busy enough on the
# 2-core VM, see [Note: reading past the page cache]) and fill new memory from it, which
# scales with cores: on a 16-core GPU host (2026-11-27, GPT-2 small, warm, fresh processes)
# 16 threads made a ready model in 0.11-0.15 s against 0.16-0.17 s with 4 (1.18-1.68x the
# recipe against 1.66-1.87x, three rounds), and GPT-2 large in 0.55 s against 0.71-0.78 s
# (one and two samples); an earlier visit had 16 beat 4 in two of three pairs (8 threads,
# tried once, beat both). So one thread per usable core, at least four, at most 16 (counts
# between 5 and 15 and beyond 16 not measured). Each thread maps at most new_memory._STEP
# (4 MiB) of the file at once while it fills: 64 MiB at 16 threads, inside the guarantee
# of the model + its largest tensor + 64 MiB (a warm copying load stages no tensor).
_WORKERS: int | None = None  # a fixed pool size (benchmarks/loading.py --threads)
_THREAD_STACK = 256 * 2**10  # faulting and reading threads only call madvise and preadv
_PAGE = mmap.PAGESIZE


_nowait = getattr(os, "RWF_NOWAIT", None)


def _read_cached(fd: int, view: memoryview, offset: int) -> int:
    """Read what of ``view``'s bytes at ``offset`` the page cache holds, without waiting for
    the disk; 0 when none (see [Note: reading speed])."""
    global _nowait
    if _nowait is None or _preadv is None:
        return 0
    try:
        return int(_preadv(fd, [view], offset, _nowait))
    except BlockingIOError:  # not cached
        return 0
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
            _nowait = None
            return 0
        raise


def _ask_for_first_page(fd: int, offset: int) -> None:
    """Start reading the page of ``fd`` that holds ``offset``, without waiting ([Note: the
    first page of a mapped tensor])."""
    if _fadvise is not None:
        with contextlib.suppress(OSError):
            _fadvise(fd, offset - offset % _PAGE, _PAGE, os.POSIX_FADV_WILLNEED)


class Reader:
    """Reads checkpoint tensors: one open file per checkpoint file, worker threads that fault
    new memory in and read pieces, direct reads for cold files, and a reader thread with two
    staging chunks for conversions (see [Note: reading speed])."""

    def __init__(self, files: int = 1, identities: Mapping[str, FileId] | None = None) -> None:
        # See [Note: a directory of many files] and [Note: a file replaced during a load].
        self._files = OpenFiles(self.wait, self._advice, identities)
        self._maps: dict[str, mmap.mmap] = {}
        self._unmappable: set[str] = set()  # files mapping failed for: read instead
        self._advised: dict[str, int] = {}  # file -> end of the range asked to be read ahead
        self._staging = Staging(self._fill, _CHUNK)
        # Threads that fault new memory in and read pieces (see [Note: the loader's pool]).
        self._workers: ThreadPoolExecutor | None = None
        self._new = NewMemory()
        self._reads: list[Future[None]] = []
        self._threadless = False  # no worker thread could start: the caller reads
        self._direct = DirectReads(files)
        self._lock = threading.Lock()

    @property
    def bytes_direct(self) -> int:
        """Bytes read past the page cache (see [Note: reading past the page cache])."""
        return self._direct.bytes

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(failed=kind is not None)

    def close(self, failed: bool = False) -> None:
        """Wait for the threads; after a failure, reads and faults not yet started are
        dropped."""
        if self._workers is not None:
            self._workers.shutdown(wait=True, cancel_futures=failed)
            self._workers = None
        self._reads = []
        self._new.close()
        self._staging.close()
        self._files.close()
        self._direct.close()
        self._advised.clear()
        # Tensors made by `mapped` keep their own reference to the mapping.
        self._maps.clear()

    def _file(self, name: str) -> BinaryIO:
        return self._files.get(name)

    def _advice(self, name: str) -> int | None:
        """A larger read-ahead window for cold files, none for those read past the cache
        (small tensors read through it must not read ahead into large ones)."""
        if _fadvise is None:
            return None
        return os.POSIX_FADV_RANDOM if self._direct.active(name) else os.POSIX_FADV_SEQUENTIAL

    def check_files(self, names: list[str]) -> None:
        """Open each file once before anything is written: one that cannot be opened fails
        the load there (see [Note: a directory of many files])."""
        self._files.check(names)

    def _fill(self, name: str, offset: int, dest: torch.Tensor) -> None:
        """Read ``dest.nbytes`` bytes at ``offset`` of ``name`` into contiguous CPU ``dest``."""
        n = dest.numel() * dest.element_size()
        f = self._file(name)
        region = self._direct.region(dest.data_ptr())
        fill = self._new.fills(dest.data_ptr())
        for done in range(0, n, _CHUNK):
            end = min(n, done + _CHUNK)
            self._new.faulted(dest, done, end, _CHUNK)
            self._read_piece(name, f.fileno(), region, dest.data_ptr() + done, offset + done,
                             end - done, fill)

    def _read_piece(self, name: str, fd: int, region: tuple[int, int] | None, address: int,
                    offset: int, n: int, fill: bool = False) -> None:
        """Read ``n`` bytes at ``offset`` of ``name`` to ``address``: what the page cache holds
        from there (copied into new memory without zeroing it first when ``fill``: see [Note:
        filling new memory from the page cache]), the rest past it when ``address`` lies in a
        region made by ``empty_for``, else through it."""
        if fill and (region is None or self._direct.cached(name, offset, n)):
            source = self._direct.source(name, offset, n)
            for a, b in self._new.fill(address, source, n):
                self._read_piece(name, fd, None, address + a, offset + a, b - a)
            return
        view = memoryview((ctypes.c_char * n).from_address(address)).cast("B")
        done = 0
        try:
            while done < n:
                got = 0
                if region is not None:
                    if not self._direct.cached(name, offset + done, n - done):
                        got = self._direct.read(name, fd, region, address + done,
                                                offset + done, n - done)
                    if not got:  # fault the new pages in at once, not one trap per page
                        populate(address + done, n - done)
                if not got:
                    got = _read_cached(fd, view[done:], offset + done)
                if not got:
                    if not self._direct.active(name):  # read-ahead would undo direct reads
                        self._read_ahead(name, fd, offset + n)
                    if _preadv is not None:  # no shared file position: safe from threads
                        got = _preadv(fd, [view[done:]], offset + done)
                    else:
                        with self._lock:
                            f = self._files.opened(name)
                            f.seek(offset + done)
                            got = f.readinto(view[done:])  # type: ignore[attr-defined]
                    if not got:
                        raise LoadError(f"{name!r} is truncated: it ended {n - done} bytes "
                                        f"short while reading at offset {offset + done}, "
                                        f"though its header was whole when the load began: "
                                        f"was it written during the load?")
                done += got
        except OSError as exc:
            raise LoadError(f"cannot read checkpoint file {name!r}: {exc}") from None

    def _read_ahead(self, name: str, fd: int, end: int) -> None:
        """Ask the kernel to start reading up to _AHEAD bytes past ``end`` (see [Note: reading
        speed]), one _CHUNK at a time."""
        if _fadvise is None:
            return
        advised = self._advised.get(name, 0)
        if advised >= end + _AHEAD:
            return
        start = max(advised, end)
        with contextlib.suppress(OSError):
            _fadvise(fd, start, end + _AHEAD - start, os.POSIX_FADV_WILLNEED)
        self._advised[name] = end + _AHEAD

    def fault_ahead(self, tensors: list[torch.Tensor]) -> None:
        """Start faulting in the pages of ``tensors`` (ordinary CPU memory; others are
        skipped) on background threads, in order (see [Note: faulting new memory ahead])."""
        # Tensors laid out for O_DIRECT are faulted in by the reads themselves.
        self._new.fault_ahead([t for t in tensors if self._direct.region(t.data_ptr()) is None],
                              self._submit, _CHUNK)

    def read_into(self, entry: Entry, dest: torch.Tensor, wait: bool = True) -> None:
        """Read ``entry`` straight into ``dest`` (``can_read_into``), through its pointer:
        no autograd, no version-counter bump. With ``wait=False`` the pieces are read on
        the reader threads and ``dest`` is complete once ``wait()`` returns; a tensor made
        by ``empty_for`` is read past the page cache where the cache does not hold it."""
        if wait or self._threadless:
            self._fill(entry.file, entry.start, dest)
            return
        fd = self._file(entry.file).fileno()
        region = self._direct.region(dest.data_ptr())
        fill = self._new.fills(dest.data_ptr())
        n = entry.nbytes
        start = entry.start
        # Pieces end on piece boundaries of the file, so that only a tensor's first and last
        # piece are unaligned (see [Note: reading past the page cache]).
        piece = _CHUNK if region is None else DIRECT_PIECE
        cuts = [0, *range(piece - start % piece, n, piece), n]
        for a, b in zip(cuts, cuts[1:], strict=False):
            if b > a:
                args = (dest, entry.file, fd, region, a, start + a, b - a, fill)
                read = self._submit(self._read_piece_of, *args)
                if read is None:
                    self._read_piece_of(*args)
                else:
                    self._reads.append(read)

    def _read_piece_of(self, dest: torch.Tensor, name: str, fd: int,
                       region: tuple[int, int] | None, at: int, offset: int, n: int,
                       fill: bool) -> None:
        # ``dest`` is passed to keep its memory alive while a thread writes into it.
        self._read_piece(name, fd, region, dest.data_ptr() + at, offset, n, fill)

    def _submit(self, fn: Callable[..., None], *args: Any) -> Future[None] | None:
        """``fn(*args)`` started on a worker thread; None, not run, where no thread can
        start (a process at its limit on threads): the caller runs it."""
        if self._threadless:
            return None
        pool = self._pool_of_workers()
        try:
            return pool.submit(fn, *args)
        except RuntimeError as exc:  # no thread at all: SmallStackPool uses those there are
            logger.info("adaptmem.load: no reader thread can start (%s); reading on the "
                        "calling thread", exc)
            self._threadless = True
            self._workers = None
            pool.shutdown(wait=False, cancel_futures=True)  # drops the work just queued
            return None

    def _pool_of_workers(self) -> ThreadPoolExecutor:
        if self._workers is None:
            # Under a cap on the data segment (set_cpu_memory_limit, ulimit -d): fewer.
            n = _pool_size(capped=soft_limit("RLIMIT_DATA") is not None)
            self._workers = SmallStackPool(n, _THREAD_STACK, thread_name_prefix="adaptmem-load-io")
        return self._workers

    def wait(self) -> None:
        """Wait for the reads ``read_into(..., wait=False)`` started; raise the first error."""
        reads, self._reads = self._reads, []
        for future in reads:
            future.result()

    def empty_for(self, entry: Entry) -> torch.Tensor:
        """A new CPU tensor to read ``entry`` into as it is stored (shape, dtype): when it is
        large, laid out for O_DIRECT where the page cache lacks some of it (see [Note: reading
        past the page cache]) and filled from the cache where it holds it (see [Note: filling
        new memory from the page cache]); else ordinary memory, faulted in ahead."""
        new = None
        if self.can_map(entry):
            new = self._direct.empty(entry.file, self._file(entry.file).fileno(), entry.start,
                                     entry.shape, entry.dtype)
        if new is None:
            return torch.empty(entry.shape, dtype=entry.dtype)
        self._new.fill_later(new)
        return new

    def can_read_into(self, entry: Entry, dest: torch.Tensor) -> bool:
        # Entries held in memory (``entry.tensor``) are handed out by ``read`` instead.
        return (entry.tensor is None and dest.device.type == "cpu" and dest.dtype == entry.dtype
                and dest.is_contiguous() and entry.contiguous and dest.numel() == entry.numel)

    def copy_into(self, entry: Entry, targets: list[torch.Tensor]) -> None:
        """Read ``entry`` once and copy it into every target (any dtype, device and shape
        with its number of elements), converting on the way (see ``Staging``)."""
        self._staging.copy_into(entry, targets)

    def can_map(self, entry: Entry) -> bool:
        return (entry.tensor is None and entry.contiguous and entry.numel > 0
                and entry.start % entry.dtype.itemsize == 0)

    def may_map(self, entry: Entry) -> bool:
        """Whether ``mapped`` may back ``entry`` (``can_map``): a mapping keeps a descriptor
        of its file open while its tensors live (Python's mmap holds one), so a load maps
        files up to a quarter of the limit on open files and reads the rest."""
        return self.can_map(entry) and (
            entry.file in self._maps
            or len(self._maps) < (soft_limit("RLIMIT_NOFILE") or sys.maxsize) // 4)

    def mapped(self, entry: Entry) -> torch.Tensor | None:
        """``entry`` as a tensor backed by a private (copy-on-write) mapping of its file;
        None where the file cannot be mapped (a file system without mmap): read it."""
        if entry.file in self._unmappable:
            return None
        f = self._file(entry.file)
        mm = self._maps.get(entry.file)
        if mm is None:
            try:
                mm = map_file(f.fileno())  # See [Note: file mappings and the cap]
            except (OSError, ValueError) as exc:
                logger.info("adaptmem.load: cannot map %s (%s); reading its tensors instead "
                            "(copy=False falls back to copy=True)", entry.file, exc)
                self._unmappable.add(entry.file)
                return None
            self._maps[entry.file] = mm
        if entry.start + entry.nbytes > len(mm):  # it shrank since its header was read
            raise LoadError(f"{entry.file!r} is truncated: it has {len(mm)} bytes now, and "
                            f"tensor {entry.key!r} ends at byte {entry.start + entry.nbytes}; "
                            f"was it written during the load?")
        _ask_for_first_page(f.fileno(), entry.start)
        with warnings.catch_warnings():
            # The mapping is writable (copy-on-write); torch warns for read-only buffers only,
            # but older versions warn for any mmap.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=entry.dtype, count=entry.numel, offset=entry.start)
        return flat.view(entry.shape)
