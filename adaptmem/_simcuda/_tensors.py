"""Simulated CUDA tensors: a device-``cuda:i`` wrapper over a CPU tensor, and the two modes
that make torch compute with them.

[Note: how a simulated tensor finds its values]
A simulated tensor is made with ``_make_wrapper_subclass`` (``device=cuda:i``, no data). Its
storage object is the key of a table to the CPU tensor holding its values (the "backing")
and to its allocation ``Record``. Keying by storage rather than by tensor object means
shallow copies made inside torch (``param.data = t``, ``t.data``, ``nn.Parameter(t)``) find
their values too, and the allocation is freed when the last tensor using it dies (a
finalizer on the storage object).

The ``TorchDispatchMode`` sees every aten op: it replaces simulated tensors by their
backings, refuses what CUDA refuses (CPU and CUDA tensors mixed, two CUDA devices mixed),
runs the op on the CPU and wraps new results, counting their bytes on the device. The
``TorchFunctionMode`` handles the Python bindings that would reach the real CUDA runtime
(``Tensor.to``/``cuda``/``copy_``, factories with ``device=``), ``record_stream``, and runs
calls that involve simulated tensors under ``no_grad`` (autograd's CUDA bookkeeping would
abort the process).

[Note: the per-op cost of the simulation]
Every op on a simulated tensor costs host time a GPU does not spend: the dispatch into
Python, the table lookups, the allocation count, the wrapping of results (about 10-15 us an
op on a 2-core x86 VM, where the op itself may take 1 us). That cost lands on whatever the
op is part of, so it is kept small on the paths every op takes: ``Dispatch._run`` walks an
op's arguments once by hand (aten schemas nest at most one list deep), not with pytree; a
C binding (``torch.add``, ``Tensor.add``, a property getter), which has no Python body
whose inner calls the simulation would need to see, runs without the second pass through
``SimTensor.__torch_function__``, and so do the handlers, which call only bindings; a
factory that draws nothing and reads no simulated tensor (``empty_like(host, device=
"cuda")``, every copy a pager makes) runs without the dispatch mode, and a ``*_like`` one
is sized from its input, not on the meta device; ``copy_`` between a host and a simulated
tensor calls what the dispatch mode would (``Tensors.copy``) directly, bumping the version
counter as the in-place op does; a freed block's host memory serves the next allocation of
its size (See [Note: the host memory of cached blocks] in _memory.py); the race detector
builds its message only on a race; and an allocation's death is reported by a weak
reference, not a ``weakref.finalize``. Benchmarks built on the simulation report this cost
beside their figures (benchmarks/paging.py).

[Note: views and inference tensors]
A view of a simulated tensor must be a view to torch too: it shares its base's version
counter (``adaptive.page`` and ``adaptive.chunk`` copy a buffer back when its version moved,
and ``cache[:n] = x`` moves the cache's only through the slice) and has a ``_base``. An aten
view op reaches the dispatch mode below autograd's ``ADInplaceOrView`` kernel, which makes
the wrapper returned a view of the input (``as_view``). The indexing bindings run on the
backing instead (``Functions._on_backing``: they take the real device guard), so there a
result sharing an input's storage is remade from that input with ``aten.as_strided``, which
``ADInplaceOrView`` sees, and ``__setitem__``, whose write landed on the backing, bumps the
target's version itself. Inference mode decides what ``as_view`` may do: a view of a normal
tensor made in it is a normal tensor sharing the version counter, so the wrapper must be a
normal tensor too, where ``_make_wrapper_subclass`` in inference mode makes an inference
tensor (which refuses a version counter). Each wrapper therefore takes its backing's kind:
the backing is what the op gave on the CPU (views of a normal backing are normal, results
made in inference mode are inference tensors, in the mode or out of it), as real CUDA gives.

[Note: saving simulated tensors]
``torch.save`` pickles a simulated tensor as the CPU tensor holding its values, with its
storage's location given as the device's (``_fake_device``, what torch.save reads for a
fake tensor's storage): the file holds the bytes and says ``cuda:i``, as one written on a
GPU does. ``torch.load`` restores a ``cuda`` storage with ``storage.to(device=...)``
(``map_location`` of any kind, or the location in the file), which the simulation answers
with the storage of a simulated tensor holding a copy of the bytes (_storages.py); the
tensor torch then makes over it (``torch.empty(0, device=
"cuda").set_(storage, ...)``) finds its values by that storage (see ``_Unwrapping.leaf``).

[Note: simulated random state]
Each simulated device has a CPU ``torch.Generator`` of its own (``SimState.generators``),
which ``torch.cuda.default_generators``, ``get_rng_state``/``set_rng_state``,
``manual_seed`` and the rest answer with. A random op (an aten op tagged
``nondeterministic_seeded``) on a simulated device, and one a factory with ``device=cuda``
runs on the CPU (``SimState.drawing_for``), runs with the CPU default generator holding
that device's state for the length of the op: the draw advances the device's stream, and
the CPU's stream is left as it was. An op given an explicit ``generator=`` uses it.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import time
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from .._common.peak import count_allocation, fake_mode, register_allocations, register_fakes
from ._errors import SimulatedCudaError, no_cpu_kernel, no_cuda_kernel, refuse_layout
from ._kernels import CPU_EQUIVALENT, pack_padded_sequence
from ._mixing import INDEX_PUTS, check_index_op, check_item_access, mixed
from ._state import SimGenerator, SimState
from ._streams import SimStream, StreamRaceError, check_access

__all__ = ["SimTensor", "Tensors", "Record", "Dispatch", "Functions", "check_host_write", "check_host_use",
           "set_current"]

aten = torch.ops.aten
_CPU = torch.device("cpu")
_no_torch_function = torch._C.DisableTorchFunction


_current: Tensors | None = None  # the running simulation's tensors


def set_current(tensors: Tensors | None) -> None:
    """Make ``tensors`` the running simulation's (None when it ends)."""
    global _current
    _current = tensors
_SEEDED = torch.Tag.nondeterministic_seeded
_INPLACE_VIEW = torch.Tag.inplace_view
# Ops that may give their tensor arguments new sizes or memory (see _follow), by op;
# ``set_`` moves a tensor to other memory at the same size too.
_RESIZES: dict[Any, bool] = {}
_SETS = {getattr(aten.set_, name) for name in aten.set_.overloads()}


# The arguments an op writes (their positions, or ``out`` keywords' names), by op.
_WRITTEN: dict[Any, tuple[int | str, ...]] = {}


def _written_arguments(func: Any) -> tuple[int | str, ...]:
    """The arguments op ``func`` writes (positions, or ``out`` keywords' names), cached."""
    written = _WRITTEN.get(func)
    if written is None:
        written = _WRITTEN[func] = tuple(
            a.name if a.kwarg_only else i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return written


def _can_resize(func: Any) -> bool:
    return (func in _SETS or func in (aten.resize_.default, aten.resize_as_.default)
            or any(a.is_out for a in func._schema.arguments))


class SimTensor(torch.Tensor):
    """A tensor on a simulated CUDA device (its values live in a CPU tensor).

    Its ``__torch_function__`` does what the simulation's TorchFunctionMode does, for calls
    the mode does not see: those made inside a Python-level torch function (the body of
    ``F.multi_head_attention_forward`` runs with modes popped)."""

    def __new__(cls, data: torch.Tensor | None = None,
                requires_grad: bool = True) -> SimTensor:
        # ``nn.Parameter(t)`` of a simulated tensor is that SimTensor marked as a parameter
        # (nn.Parameter's path for tensor subclasses), so code re-making a parameter with
        # ``type(param)(data, requires_grad=...)`` (accelerate, transformers) calls this
        # class: construct what ``nn.Parameter(data, requires_grad)`` constructs on CUDA, a
        # plain nn.Parameter for host or meta data (which then stays an nn.Parameter).
        if isinstance(data, SimTensor) and not data.is_cuda:
            data = _host_view(data)  # host data under a wrapper (``param.data = host``)
        return torch.nn.Parameter(data, requires_grad)  # type: ignore[arg-type,return-value]

    def __reduce_ex__(self, proto: Any) -> Any:
        # See [Note: saving simulated tensors].
        if not self.is_cuda:
            return _host_view(self).__reduce_ex__(proto)
        if _current is None or _current.closed:
            raise _after_the_block(torch.save)
        if getattr(self, "_is_param", False):  # what nn.Parameter pickles as
            return (torch._utils._rebuild_parameter,
                    (self.detach(), self.requires_grad, collections.OrderedDict()))
        with _no_subclass_function():
            backing = _current.lookup(self)[0]
        rebuild, args = backing.__reduce_ex__(proto)
        args[0]._fake_device = self.device  # where torch.save says the storage lives
        # A plain pickle (no torch.save) pickles the storage itself, as torch.save's bytes:
        # the location must be in them too.
        args[0].__reduce_ex__ = _DeviceStorage(args[0])
        return rebuild, args

    def __copy__(self) -> torch.Tensor:
        # What copy.copy of a CUDA tensor gives (Tensor.__reduce_ex__ rebuilt over the same
        # storage): a new tensor sharing its memory, on its device.
        if not self.is_cuda:
            return copy.copy(_host_view(self))
        if _current is None or _current.closed:
            raise _after_the_block(copy.copy)
        alias = torch.empty(0, dtype=self.dtype, device=self.device).set_(
            self.untyped_storage(), self.storage_offset(), self.size(), self.stride())
        if getattr(self, "_is_param", False):  # what copy.copy of a Parameter gives
            return torch.nn.Parameter(alias, self.requires_grad)
        return alias

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if _current is not None and not _current.closed:
                return _current.function_mode.handle(func, args, kwargs)
            # After the block. Without grad where a simulated device tensor is: autograd
            # would ask the real CUDA runtime for a stream before the op (a leaf's gradient
            # accumulator), and that failure ends the process (std::terminate).
            dead = any(isinstance(x, SimTensor) and x.is_cuda for x in tree_leaves(args))
            try:
                if dead and torch.is_grad_enabled():
                    with torch.no_grad():
                        return func(*args, **kwargs)
                return func(*args, **kwargs)
            except RuntimeError as exc:  # the real device was reached for ("no driver")
                if dead:
                    raise _after_the_block(func) from exc
                raise

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        if _current is not None and not _current.closed:
            # ``device_tensor.data = host_tensor`` (a pager releasing a weight) leaves host
            # data under the simulated tensor's wrapper: it is a host tensor now, as on CUDA.
            flat, spec = tree_flatten((args, kwargs or {}))
            if any(isinstance(x, SimTensor) and not x.is_cuda for x in flat):
                cargs, ckwargs = tree_unflatten(
                    [_host_view(x) if isinstance(x, SimTensor) and not x.is_cuda else x
                     for x in flat], spec)
                return func(*cargs, **ckwargs)
            # The simulation is on, but its mode was popped (``torch._tensor_str`` prints
            # under ``_disable_current_modes``): the op runs as the mode would run it.
            return _current.dispatch_mode.__torch_dispatch__(func, types, args, kwargs)
        raise _after_the_block(func)


class _DeviceStorage:
    """A saved simulated tensor's storage pickled outside torch.save: as torch.save's bytes
    with the device's location, which torch.load puts back on the simulated device (or
    refuses without a CUDA device, as for a storage pickled on a GPU). Holds the typed
    storage's parts, not the storage whose ``__reduce_ex__`` it is (no reference cycle)."""

    __slots__ = ("untyped", "dtype", "device")

    def __init__(self, storage: Any) -> None:
        self.untyped, self.dtype = storage._untyped_storage, storage.dtype
        self.device = storage._fake_device

    def __call__(self, proto: Any) -> Any:
        storage = torch.TypedStorage(wrap_storage=self.untyped, dtype=self.dtype,
                                     _internal=True)
        storage._fake_device = self.device
        buffer = io.BytesIO()
        torch.save(storage, buffer)
        return torch.storage._load_from_bytes, (buffer.getvalue(),)


def _allocation(t: torch.Tensor) -> tuple[int, int] | None:
    """What a trace counts simulated tensor ``t`` as: its allocation, shared by its views."""
    sim = _current
    if sim is None or sim.closed:
        return None
    return sim.allocation(t)


def _made_by_trace(t: torch.Tensor) -> bool:
    """Whether simulated tensor ``t`` holds a fake backing (a trace made it): in-place ops
    on it change nothing real."""
    from torch._subclasses.fake_tensor import FakeTensor

    sim = _current
    if sim is None or sim.closed:
        return False
    entry = sim.entries.get(t.untyped_storage()._cdata)
    return entry is not None and isinstance(entry[0], FakeTensor)


register_allocations(SimTensor, _allocation)
register_fakes(SimTensor, _made_by_trace)


def _after_the_block(func: Any) -> RuntimeError:
    name = str(func) if isinstance(func, torch._ops.OpOverload) else getattr(
        func, "__qualname__", str(func))
    return RuntimeError(
        f"{name}: a tensor of the simulated CUDA device was used after its "
        f"`with adaptmem.testing.simulated_cuda():` block ended; move it to the CPU "
        f"(.cpu()) inside the block")


class Record:
    """One simulated allocation: its device and size, the stream it was allocated on, the
    streams that used it since, and the copy that still writes it."""

    __slots__ = ("index", "block", "refs", "stream", "used_on", "used_at", "recorded",
                 "pending", "host")

    def __init__(self, index: int, block: int, stream: SimStream) -> None:
        self.index = index
        self.block = block
        # The host storage a backing of all of it holds, kept for reuse when the block is
        # freed (See [Note: the host memory of cached blocks] in _memory.py); else None.
        self.host: Any = None
        self.refs = 0
        self.stream = stream
        self.used_on: dict[SimStream, int] = {}
        # stream -> its epoch at the last use there, the allocating stream's too: what a copy
        # into it on another stream must be ordered after
        self.used_at: dict[SimStream, int] = {}
        self.recorded: set[SimStream] = set()
        self.pending: Any = None


def _no_values(what: str) -> RuntimeError:
    return RuntimeError(
        f"simulated CUDA: {what} has no values in this simulation (it was made before this "
        f"`with simulated_cuda():` block began, in an earlier block, or by code the "
        f"simulation does not see, e.g. with torch functions disabled)")


def _describe(t: torch.Tensor) -> str:
    return f"a tensor of shape {list(t.shape)} ({t.dtype}) on {t.device}"


class Tensors:
    """The tensors of one simulation: the backing table and the two modes."""

    def __init__(self, state: SimState) -> None:
        self.state = state
        # storage key -> (backing, allocation, the weak reference that reports its death)
        self.entries: dict[int, tuple[torch.Tensor, Record, Any]] = {}
        self.devices = [torch.device("cuda", i) for i in range(len(state.allocators))]
        self.closed = False
        self.dispatch_mode = Dispatch(self)
        self.function_mode = Functions(self)
        # Tensors of torch's own classes given simulated device data (``param.data = ...``,
        # as ``Module.cuda()`` does): see ``let_go``.
        self.given_data: dict[int, weakref.ref[torch.Tensor]] = {}

    def let_go(self) -> None:
        """At the end of the block: a tensor of torch's own class (a ``Parameter`` that
        ``module.cuda()`` gave simulated data, keeping the object) left on the simulated
        device stops requiring grad. Its ops reach torch without any hook of the
        simulation's, and with grad autograd would ask the real CUDA runtime for a stream
        first, whose failure ends the process; without it they raise CUDA's own error."""
        for ref in self.given_data.values():
            t = ref()
            if t is not None and t.requires_grad and t.device.type == "cuda":
                t.requires_grad_(False)
        self.given_data.clear()

    # -- the table -----------------------------------------------------------------------

    def wrap(self, backing: torch.Tensor, record: Record) -> torch.Tensor:
        """A simulated tensor over ``backing``, an inference tensor when ``backing`` is one
        (See [Note: views and inference tensors])."""
        inference = backing.is_inference()
        with (contextlib.nullcontext() if inference is torch.is_inference_mode_enabled()
              else torch._C._InferenceMode(inference)):
            w = torch.Tensor._make_wrapper_subclass(
                SimTensor, backing.shape, strides=backing.stride(),
                storage_offset=backing.storage_offset(), dtype=backing.dtype,
                device=self.devices[record.index], requires_grad=False)
        with _no_subclass_function():  # a binding: no need for SimTensor.__torch_function__
            storage = w.untyped_storage()
        key = storage._cdata
        died = self._died
        self.entries[key] = (backing, record, weakref.ref(storage, lambda r: died(key, r)))
        record.refs += 1
        return w

    def adopt(self, backing: torch.Tensor, index: int) -> torch.Tensor:
        """A new allocation on ``cuda:index`` holding ``backing`` (raises CUDA's OOM), made
        outside the dispatch modes: counted by the trackers of a trace (See [Note:
        allocations a tensor subclass keeps apart from storages] in _common/peak.py)."""
        refuse_layout(backing.layout, "an op", self.devices[index])
        out = self.wrap(backing, self.allocate(backing, index))
        count_allocation(out)
        return out

    def allocation(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(key, bytes) of the allocation simulated tensor ``t`` is part of, or None for one
        this simulation does not hold: what a trace counts it as."""
        entry = self.entries.get(t.untyped_storage()._cdata)
        if entry is None:
            return None
        backing, record, _ = entry
        return id(record), backing.untyped_storage().nbytes()

    def allocate(self, backing: torch.Tensor, index: int) -> Record:
        return self.reserve(backing.untyped_storage().nbytes(), index)

    def reserve(self, nbytes: int, index: int) -> Record:
        if fake_mode() is not None:
            nbytes = 0  # a fake tensor's backing is fake too: it takes no memory
        block = self.state.allocators[index].allocate(nbytes)
        return Record(index, block, self.state.current_streams[index])

    def reserve_all(self, sizes: list[int], index: int) -> list[Record]:
        """Allocations made together: when one does not fit, none is made."""
        made: list[Record] = []
        try:
            for n in sizes:
                made.append(self.reserve(n, index))
        except BaseException:
            for record in made:
                self.state.allocators[index].free(record.block)
            raise
        return made

    def empty_backing(self, like: torch.Tensor, dtype: torch.dtype,
                      record: Record) -> torch.Tensor | None:
        """``torch.empty_like(like, dtype=dtype)`` on the host for ``record`` (a block of
        ``like.numel()`` elements): in a kept host storage of that size when there is one
        (See [Note: the host memory of cached blocks] in _memory.py), else a new tensor.
        Marks the storage as ``record``'s to keep. None when ``like`` is small (under
        ``_KEPT_SIZE``) or not a dense row-major tensor: the caller makes it as torch would."""
        nbytes = like.numel() * dtype.itemsize
        if (nbytes < _KEPT_SIZE or not like.is_contiguous()
                or like.layout is not torch.strided):
            return None
        host = self.state.allocators[record.index].reuse(nbytes)
        with _no_python_dispatch():
            if host is None:
                out = torch.empty_like(like, dtype=dtype, device=_CPU)
            else:
                out = torch.empty(0, dtype=dtype).set_(host, 0, like.shape, like.stride())
        record.host = out.untyped_storage()
        return out

    def lookup_storage(self, storage: Any) -> tuple[torch.Tensor, Record]:
        """The backing and allocation a simulated tensor's storage holds."""
        entry = self.entries.get(storage._cdata)
        if entry is None:
            raise _no_values(f"a {storage.nbytes()}-byte storage on {storage.device}")
        return entry[0], entry[1]

    def lookup(self, t: torch.Tensor) -> tuple[torch.Tensor, Record]:
        entry = self.entries.get(t.untyped_storage()._cdata)
        if entry is None:
            raise _no_values(_describe(t))
        b, record, _ = entry
        if (t.dtype == b.dtype and t.shape == b.shape and t.stride() == b.stride()
                and t.storage_offset() == b.storage_offset()):
            return b, record
        if t.dtype != b.dtype:
            b = b.view(t.dtype)
        return b.as_strided(t.shape, t.stride(), t.storage_offset()), record

    def _died(self, key: int, ref: Any) -> None:
        entry = self.entries.get(key)
        if entry is None or entry[2] is not ref:  # the key was reused since
            return
        del self.entries[key]
        if self.closed:
            return
        record = entry[1]
        del entry  # the backing: its storage's use count is read below
        record.refs -= 1
        if record.refs:
            return
        allocator = self.state.allocators[record.index]
        allocator.free(record.block)
        host, record.host = record.host, None
        if host is not None and _storage_use_count(host._cdata) == 1:  # no tensor uses it
            allocator.keep(host.nbytes(), host)
        for stream, epoch in record.used_on.items():  # See [Note: which uses a wait orders]
            if (stream not in record.recorded and stream.synced_epoch < epoch
                    and record.stream.waited_epochs.get(stream, 0) < epoch):
                self.state.report(
                    f"simulated CUDA: a {record.block}-byte block allocated on "
                    f"{record.stream!r} was freed while {stream!r} may still use it (used "
                    f"there without tensor.record_stream(that stream), neither synchronized "
                    f"since nor waited for by {record.stream!r}). On a GPU the allocator can "
                    f"hand it to the next allocation on {record.stream!r} while {stream!r} "
                    f"still reads or writes it.")

    def use(self, record: Record, stream: SimStream, t: torch.Tensor, op: Any) -> None:
        """An op on ``stream`` uses ``record``: races raise; cross-stream uses are noted."""
        job = record.pending
        if job is not None:
            if job.seq <= job.stream.synced_seq and job.finished():
                record.pending = None
            else:
                check_access(job, stream, lambda: f"{_describe(t)} (an input of {op})")
        record.used_at[stream] = stream.epoch
        if stream is not record.stream and stream not in record.recorded:
            record.used_on[stream] = stream.epoch

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        _, record = self.lookup(t)
        if isinstance(stream, SimStream) and stream is not record.stream:
            record.recorded.add(stream)
            record.used_on.pop(stream, None)

    def draw(self, index: int, run: Any, *args: Any, **kwargs: Any) -> Any:
        """``run(*args, **kwargs)`` drawing from ``cuda:index``'s generator (see [Note:
        simulated random state])."""
        cpu, device = torch.default_generator, self.state.generators[index]
        saved = cpu.get_state()
        cpu.set_state(device.get_state())
        try:
            return run(*args, **kwargs)
        finally:
            device.set_state(cpu.get_state())
            cpu.set_state(saved)

    # -- pinned host memory --------------------------------------------------------------

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return self.mark_pinned(
            t.clone(memory_format=torch.preserve_format) if t.dim() else t.clone())

    def mark_pinned(self, pinned: torch.Tensor) -> torch.Tensor:
        """Host tensor ``pinned``, new, counted as pinned memory from now on."""
        ptr = pinned.untyped_storage().data_ptr()
        if not ptr:  # an empty storage has no memory to pin (every one is at address 0)
            return pinned
        # Pinning belongs to the storage, as CUDA's does: nn.Parameter(pinned) is another
        # tensor object over it, and it stays pinned after ``pinned`` itself is gone.
        self.state.pinned[ptr] = weakref.finalize(pinned.untyped_storage(), self.state.unpin,
                                                  ptr)
        return pinned

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_cpu and self.state.is_pinned_at(t.untyped_storage().data_ptr())

    # -- copies --------------------------------------------------------------------------

    def to_copy(self, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        target = kwargs.get("device")
        if not x.is_cuda and (target is None or target.type != "cuda"):
            return aten._to_copy.default(x, **kwargs)
        kwargs = dict(kwargs)
        target = kwargs.pop("device", None)
        non_blocking = kwargs.pop("non_blocking", False)
        pin = kwargs.pop("pin_memory", None)
        kwargs.pop("layout", None)
        source = x
        if x.is_cuda:
            source, record = self.lookup(x)
            self.use(record, self.state.current_streams[record.index], x, "to()")
            if target is None:
                target = x.device
        if target is None or target.type != "cuda":
            started = time.perf_counter()
            out = aten._to_copy.default(source, device=target, **kwargs)
            return _to_host(self, x, record, out, non_blocking, pin, started)
        check_host_use(self.state, x, "to()")  # a host source a copy to the host still fills?
        index = self.state.device_index(target)
        refuse_layout(source.layout, "a copy to the device (.to, .cuda, module.to)",
                      self.devices[index])
        dtype = kwargs.get("dtype") or source.dtype
        record = self.reserve(source.numel() * dtype.itemsize, index)  # before: none if no room
        if non_blocking and x.is_cpu:
            memory_format = kwargs.get("memory_format") or torch.preserve_format
            dst = self.empty_backing(source, dtype, record) if (
                memory_format is torch.preserve_format) else None
            if dst is None:
                dst = torch.empty_like(source, dtype=dtype, memory_format=memory_format)
            out = self.wrap(dst, record)
            self._async_copy(dst, source, record)
            return out
        started = time.perf_counter()
        out = self.wrap(aten._to_copy.default(source, **kwargs), record)
        if not x.is_cuda:
            _over_the_link(self.state, source.numel() * dtype.itemsize, started)
            self.state.current_streams[index].synchronize()  # as CUDA's memcpy_and_sync
        return out

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        db, sb = dst, src
        _check_host_copy(self.state, dst, src)
        if src.is_cuda:
            sb, srec = self.lookup(src)
            self.use(srec, self.state.current_streams[srec.index], src, "copy_()")
        if not dst.is_cuda:
            started = time.perf_counter()
            db.copy_(sb)
            if src.is_cuda and non_blocking and self.is_pinned(dst):
                _landing(self.state, dst, srec)  # it lands later, as on CUDA
                return dst
            if src.is_cuda:
                _over_the_link(self.state, db.numel() * db.element_size(), started)
                if not non_blocking:
                    _host_read(self, src)
            return dst
        db, drec = self.lookup(dst)
        stream = self.state.current_streams[drec.index]
        _check_overwrite(drec, stream, dst)
        queued = non_blocking and src.is_cpu
        pending = drec.pending
        if not (queued and pending is not None and pending.stream is stream):
            self.use(drec, stream, dst, "copy_()")
        # else: a copy into a buffer its own stream is still filling queues behind that copy,
        # as on a GPU (a double buffer refilled on a side stream): the host does not wait.
        if queued:
            self._async_copy(db, sb, drec)
        else:
            started = time.perf_counter()
            db.copy_(sb)
            if not src.is_cuda:  # a blocking copy from the host syncs its stream, as CUDA's
                _over_the_link(self.state, db.numel() * db.element_size(), started)
                stream.synchronize()  # memcpy_and_sync does
        return dst

    def _async_copy(self, dst: torch.Tensor, src: torch.Tensor, record: Record) -> None:
        stream = self.state.current_streams[record.index]
        nbytes = src.numel() * src.element_size()
        def run() -> None:
            with _no_python_dispatch():  # two host tensors: nothing for the mode to do
                dst.copy_(src)

        record.pending = job = stream.enqueue(run, nbytes, "copy")
        # A pinned source must not be written until the copy is done; a pageable one was
        # staged before the call returned (cudaMemcpyAsync), and may be.
        if not src.is_cuda and nbytes and self.is_pinned(src):
            state = self.state
            state.host_reads[src.untyped_storage().data_ptr()] = job
            if job.done_at > state.host_reads_until:
                state.host_reads_until = job.done_at
        if stream is not record.stream:
            record.used_on[stream] = stream.epoch


def _to_host(sim: Tensors, x: torch.Tensor, record: Record, out: torch.Tensor,
             non_blocking: bool, pin: Any, started: float) -> torch.Tensor:
    """Device tensor ``x`` (``record``'s) copied to the host as ``out`` (made just now):
    with ``non_blocking``, into pinned memory as CUDA's, landing later; else the host held
    for the link's time (from ``started``), after the stream's queued work."""
    if non_blocking:
        out = sim.mark_pinned(out)
        _landing(sim.state, out, record)
        return out
    _over_the_link(sim.state, out.numel() * out.element_size(), started)
    _host_read(sim, x)
    return sim.mark_pinned(out) if pin else out


def _landing(state: SimState, dst: torch.Tensor, record: Record) -> None:
    """A ``non_blocking`` copy from device tensor ``record``'s into pinned host ``dst`` (its
    values are there already): queued on the current stream of the source's device, and
    ``dst`` may not be used until that copy completed on the link's time or the host
    synchronised with it (``check_host_use``)."""
    nbytes = dst.numel() * dst.element_size()
    job = state.current_streams[record.index].enqueue(lambda: None, nbytes, "copy")
    ptr = dst.untyped_storage().data_ptr()
    if nbytes and ptr:
        state.host_writes[ptr] = job
        if job.done_at > state.host_writes_until:
            state.host_writes_until = job.done_at


def _check_host_copy(state: SimState, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``copy_`` from ``src`` into ``dst``: raise where one is a host tensor that a copy in
    flight reads (a pinned source, written) or writes (a pinned destination, used)."""
    if not dst.is_cuda:
        if state.host_reads:
            check_host_write(state, dst, "copy_()")
        if state.host_writes:
            check_host_use(state, dst, "copy_()")
    if not src.is_cuda and state.host_writes:
        check_host_use(state, src, "copy_()")


def check_host_use(state: SimState, t: Any, op: Any) -> None:
    """An op reads or writes host tensor ``t`` (or the tensors of list ``t``): raise if it
    is the pinned destination of a ``non_blocking`` copy from the device that has not
    completed on the link's time, and that the host has not synchronised with."""
    _refuse_in_flight(state, "host_writes", t, lambda t, job: (
        f"simulated CUDA: {op} used {_describe(t)} while a non_blocking copy on "
        f"{job.stream!r} still writes it (it is the pinned destination of a copy from the "
        f"device, which has not completed, and the host has not synchronized with it). On "
        f"a GPU it holds its old values until the copy lands. Wait for the copy first: "
        f"stream.synchronize(), event.synchronize() on an event recorded after the copy, or "
        f"torch.cuda.synchronize()."))


def _refuse_in_flight(state: SimState, kind: str, t: Any,
                      message: Callable[[torch.Tensor, Any], str]) -> None:
    """Raise ``StreamRaceError(message(tensor, job))`` where host tensor ``t`` (or one of
    list ``t``'s) is the memory of a copy in ``state.<kind>`` (``host_reads``: pinned
    sources, ``host_writes``: pinned destinations) still in flight."""
    if time.perf_counter() >= getattr(state, f"{kind}_until"):  # every such copy completed
        getattr(state, kind).clear()
        return
    found = _in_flight(state, getattr(state, kind), t)
    if found is not None:
        raise StreamRaceError(message(*found))


def _in_flight(state: SimState, jobs: dict[int, Any], t: Any) -> tuple[torch.Tensor, Any] | None:
    """Host tensor ``t`` (or one of list ``t``'s) with the copy of ``jobs`` (pinned host
    storage data_ptr -> Job) still in flight on its memory, or None."""
    if type(t) is list or type(t) is tuple:
        for x in t:
            found = _in_flight(state, jobs, x)
            if found is not None:
                return found
        return None
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_cuda:
        return None  # a sparse tensor is no pinned copy's source or destination
    storage = t.untyped_storage()
    if storage.device.type != "cpu" or not storage.data_ptr():
        return None  # a fake tensor (a trace) has no memory to guard; an empty one none
    job = jobs.get(storage.data_ptr())
    if job is None:
        return None
    if not job.in_flight():
        state.prune_host_reads()  # the others may have completed too
        return None
    return t, job


def _over_the_link(state: SimState, nbytes: int, started: float) -> None:
    """A synchronous copy between host and device holds the host for the link's time too
    (``nbytes / bandwidth``), as an asynchronous one holds its stream."""
    if state.bandwidth:
        left = started + nbytes / (state.bandwidth * 1e9) - time.perf_counter()
        if left > 0:
            time.sleep(left)
            state.wait_seconds += left


def _host_read(sim: Tensors, t: torch.Tensor) -> None:
    """The host read device tensor ``t``'s values (``item()``, a blocking copy to the host):
    as on CUDA, it waited for everything queued on the current stream first, which is that
    stream's synchronize()."""
    if t.is_cuda:
        sim.state.current_streams[sim.lookup(t)[1].index].synchronize()


def _check_overwrite(record: Record, stream: SimStream, t: torch.Tensor) -> None:
    """A copy on ``stream`` writes device tensor ``t``: raise if another stream used it
    where ``stream`` is not ordered after that use (See [Note: which uses a wait orders] in
    _streams.py)."""
    waited = stream.waited_epochs
    for other, epoch in record.used_at.items():
        if other is not stream and other.synced_epoch < epoch and waited.get(other, 0) < epoch:
            raise StreamRaceError(
                f"simulated CUDA: a copy on {stream!r} writes {_describe(t)} that {other!r} "
                f"used before, and {stream!r} did not wait for that use. On a GPU the copy "
                f"can overwrite the values while {other!r} still reads them (a buffer "
                f"refilled on a side stream). Make the copying stream wait first: "
                f"stream.wait_stream(torch.cuda.current_stream()) before the copy, or "
                f"stream.wait_event(event_recorded_after_the_use).")


def check_host_write(state: SimState, t: Any, op: Any) -> None:
    """An op writes host tensor ``t`` (or the tensors of list ``t``, a ``_foreach_`` op's):
    raise if a ``non_blocking`` copy still reads it (it has not completed on the link's
    time, and the host has not synchronised with it)."""
    _refuse_in_flight(state, "host_reads", t, lambda t, job: (
        f"simulated CUDA: {op} wrote {_describe(t)} while a non_blocking copy on "
        f"{job.stream!r} still reads it (it is the pinned source of that copy, which has not "
        f"completed, and the host has not synchronized with it). On a GPU the copy can "
        f"carry the new values. Wait for the copy first: copy_stream.synchronize(), "
        f"event.synchronize() on an event recorded after the copy, or "
        f"torch.cuda.synchronize()."))


def _check_generator(args: Any, kwargs: dict[str, Any]) -> None:
    """Refuse ``generator=`` of another device than the op's, as torch does."""
    generator, device = kwargs["generator"], kwargs.get("device")
    if not isinstance(generator, torch.Generator):
        return
    on_device = (_is_cuda(device) if device is not None else _touches_cuda(args, kwargs))
    kind = "cuda" if isinstance(generator, SimGenerator) else generator.device.type
    wanted = "cuda" if on_device else "cpu"
    if kind != wanted:
        raise RuntimeError(
            f"Expected a '{wanted}' device type for generator but found '{kind}' (simulated "
            f"CUDA: a random op on the {'device' if on_device else 'host'} draws from a "
            f"generator of its device; pass torch.Generator({wanted!r}))")


def _has_generator(args: Any, kwargs: dict[str, Any]) -> bool:
    return (isinstance(kwargs.get("generator"), torch.Generator)
            or any(isinstance(x, torch.Generator) for x in args))


def _repr(func: Any, args: Any, kwargs: dict[str, Any]) -> str:
    """``repr`` of a simulated tensor: its host copy's, with what CUDA's adds (the device,
    autograd's marks)."""
    t = args[0]
    if not t.is_cuda:
        return repr(_host_view(t))
    text = torch._tensor_str._str(t.detach().cpu(), **kwargs)
    # CUDA's device comes first of the suffixes, before an empty tensor's size and a dtype.
    at = min((i for i in (text.rfind(", size="), text.rfind(", dtype=")) if i >= 0),
             default=len(text) - 1)
    text = f"{text[:at]}, device='{t.device}'{text[at:]}"
    if t.grad_fn is not None:
        return f"{text[:-1]}, grad_fn=<{type(t.grad_fn).__name__}>)"
    return f"{text[:-1]}, requires_grad=True)" if t.requires_grad else text


def _numpy(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``t.numpy()`` or ``np.asarray(t)`` (``Tensor.__array__``)."""
    t = args[0]
    if t.is_cuda and kwargs.get("force", args[1] if len(args) > 1 else False):
        return t.detach().cpu().resolve_conj().resolve_neg().numpy()  # as torch documents
    if t.is_cuda:  # CUDA's own words
        raise TypeError(f"can't convert {t.device} device type tensor to numpy. Use "
                        f"Tensor.cpu() to copy the tensor to host memory first.")
    return func(_host_view(t) if isinstance(t, SimTensor) else t, *args[1:], **kwargs)


def _tolist(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    t = args[0]
    return (t.cpu() if t.is_cuda else _host_view(t)).tolist()  # as CUDA: via the host


def _format(func: Any, args: Any, kwargs: dict[str, Any]) -> str:
    t, spec = args
    if t.dim() == 0:
        return format(_tolist(func, (t,), {}), spec)
    if spec:
        raise TypeError("unsupported format string passed to Tensor.__format__")  # as CUDA
    return _repr(func, (t,), {})


def _host_view(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor over the host storage a simulated tensor's wrapper was given."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(),
                                              t.size(), t.stride())


# Ops CUDA runs with non-scalar CPU tensors among CUDA ones (indices, by the rules
# ``check_index_op`` keeps), and the metadata check behind ``cpu_param.data = cuda_tensor``
# (dispatched under inference_mode).
_MIXED_OK = {aten.index.Tensor, *INDEX_PUTS, aten._has_compatible_shallow_copy_type.default}


class Dispatch(TorchDispatchMode):
    def __init__(self, sim: Tensors) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sim = self.sim
        with _no_torch_function():
            if func is aten._to_copy.default:
                return sim.to_copy(args[0], kwargs)
            if func is aten.copy_.default:
                return sim.copy(args[0], args[1], bool(args[2]) if len(args) > 2
                                else kwargs.get("non_blocking", False))
            if func is aten.is_pinned.default:
                return sim.is_pinned(args[0])
            if func is aten.pin_memory.default or func is aten._pin_memory.default:
                # pin_memory itself arrives here only under inference_mode (elsewhere it
                # decomposes first); its CPU kernel would ask the CUDA runtime.
                if func is aten.pin_memory.default and sim.is_pinned(args[0]):
                    return args[0]
                if args[0].is_cuda:  # as CUDA: only host memory is pinned
                    raise RuntimeError(
                        f"cannot pin '{args[0].type()}' only dense CPU tensors can be pinned "
                        f"(simulated CUDA): it is on the device already; pin the host tensor "
                        f"it was copied from")
                return sim.pin(args[0])
            if func is aten.record_stream.default:
                return None  # only the Python binding knows the stream; see Functions
            if func is aten._local_scalar_dense.default:  # item(), bool(), int(), float()
                out = self._run(func, args, kwargs)
                _host_read(sim, args[0])
                return out
            if func is aten._pack_padded_sequence.default and args[0].is_cuda:
                return pack_padded_sequence(sim, *args, **kwargs)
            return self._run(func, args, kwargs)

    def _run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        # See [Note: the per-op cost of the simulation]: one walk over the arguments (aten
        # schemas nest at most one list deep), no pytree.
        sim = self.sim
        u = _Unwrapping(sim)
        cargs = u.args(args)
        ckwargs = u.kwargs(kwargs)
        index = u.index
        if index is None:
            if sim.state.host_writes:  # a host tensor a copy from the device still fills?
                for a in args:
                    check_host_use(sim.state, a, func)
                for a in kwargs.values():
                    check_host_use(sim.state, a, func)
            if sim.state.host_reads:  # a host tensor written while a copy reads it?
                for w in _written_arguments(func):
                    if isinstance(w, str):
                        check_host_write(sim.state, kwargs.get(w), func)
                    elif w < len(args):
                        check_host_write(sim.state, args[w], func)
            drawing_for = sim.state.drawing_for
            if drawing_for is not None and _SEEDED in func.tags and not _has_generator(
                    args, kwargs):
                return sim.draw(drawing_for, func, *args, **kwargs)
            return func(*args, **kwargs)
        target = kwargs.get("device")
        if isinstance(target, torch.device) and target.type != "cuda":
            # ``empty_like(x, device="cpu")``, ``x.new_zeros(n, device="cpu")``: made on the
            # host from a device tensor's metadata, so a host tensor comes back.
            return func(*cargs, **ckwargs)
        on_host = False  # an index_put into a host tensor (with device indices)
        if func in _MASKED_FILLS and args[0].device != args[1].device:
            raise RuntimeError(  # CUDA's words; a 0-dim host mask is no scalar here
                f"expected self and mask to be on the same device, but got mask on "
                f"{args[1].device} and self on {args[0].device} (simulated CUDA: move the "
                f"mask with .to({str(args[0].device)!r}))")
        if u.cpu_arg is not None and "device" not in kwargs:
            if func not in _MIXED_OK:
                raise mixed(f"cuda:{index}", "cpu")
            check_index_op(func, args)
            on_host = not args[0].is_cuda
        if not on_host and _host_only(func):  # a real GPU has no kernel for it either
            raise no_cuda_kernel(func)
        stream = sim.state.current_streams[index]
        views = _VIEWS.get(func)
        if views is None:
            views = _VIEWS[func] = func.is_view
        if not views:  # a view reads nothing: a copy still writing its base is no race
            for record, x, _ in u.uses:
                sim.use(record, stream, x, func)
        if on_host:
            return func(*cargs, **ckwargs)
        resizes = _RESIZES.get(func)
        if resizes is None:
            resizes = _RESIZES[func] = _can_resize(func)
        grown: dict[int, int] = {}
        try:
            if resizes and func not in _SETS and fake_mode() is None:
                out, grown = _run_resizing(sim, index, func, args, kwargs, cargs, ckwargs,
                                           u.originals)
            elif _SEEDED in func.tags and not _has_generator(args, kwargs):
                out = sim.draw(index, CPU_EQUIVALENT.get(func, func), *cargs, **ckwargs)
            else:
                out = CPU_EQUIVALENT.get(func, func)(*cargs, **ckwargs)
        except NotImplementedError as exc:
            # torch's "Could not run ... from the 'CPU' backend" names the wrong device.
            if func in CPU_EQUIVALENT or _has_cpu_kernel(func.name(), "CPU"):
                raise
            raise no_cpu_kernel(func, index) from exc
        # New storages are allocated together: an OOM allocates nothing.
        originals, storages = u.originals, u.storages
        fresh: dict[int, torch.Tensor] = {}
        for o in _tensors_in(out):
            if id(o) not in originals:
                try:
                    ptr = _storage_key(o)
                except NotImplementedError:  # no storage: a sparse result
                    refuse_layout(o.layout, func, sim.devices[index])
                    raise
                if ptr not in storages and ptr not in fresh:
                    fresh[ptr] = o
        if fresh and fake_mode() is not None:
            _views_of_fakes(u.uses, fresh, storages)
        if fresh:
            made: list[Record] = []
            try:
                for ptr, o in fresh.items():
                    record = sim.allocate(o, index)
                    made.append(record)
                    storages[ptr] = record
            except BaseException:
                for record in made:
                    sim.state.allocators[index].free(record.block)
                raise

        def wrap(o: torch.Tensor) -> torch.Tensor:
            original = originals.get(id(o))
            if original is not None:
                if resizes and (func in _SETS or o.shape != original.shape
                                or o.stride() != original.stride()
                                or o.storage_offset() != original.storage_offset()):
                    _follow(sim, original, o, storages, grown.pop(id(o), None))
                elif _INPLACE_VIEW in func.tags and (
                        o.shape != original.shape or o.stride() != original.stride()
                        or o.storage_offset() != original.storage_offset()):
                    _restride(original, o)
                return original
            return sim.wrap(o, storages[_storage_key(o)])

        wrapped = _map_tensors(wrap, out)
        for block in grown.values():  # not needed after all
            sim.state.allocators[index].free(block)
        return wrapped


def _restride(w: torch.Tensor, o: torch.Tensor) -> None:
    """An in-place view op (``transpose_``, ``unsqueeze_``, ``as_strided_``: aten's
    ``inplace_view`` ops) gave ``w``'s backing ``o`` new sizes and strides: ``w`` takes
    them, over the same memory, as a CUDA tensor would."""
    with _no_python_dispatch(), _no_torch_function():  # metadata only: no device guard
        torch.Tensor.set_(w, w.untyped_storage(), o.storage_offset(), o.shape, o.stride())


def _follow(sim: Tensors, w: torch.Tensor, o: torch.Tensor, storages: dict[int, Record],
            grown: int | None) -> None:
    """``w``'s backing ``o`` was resized or set to other memory in place (an ``out=``
    op, ``resize_``, ``set_``): ``w`` takes ``o``'s shape and memory, as a CUDA tensor
    would. Memory an argument holds is shared (``set_(source)``). A storage the resize
    grew is reallocated, for every tensor sharing it (views, ``set_`` partners): its
    allocation takes the new block (``grown``, allocated before the op ran, or now:
    raises CUDA's OOM) and gives back the old one. Other new memory is a new
    allocation, and ``w``'s old one goes with its last user."""
    record = storages.get(_storage_key(o))
    if record is None:
        b, record = sim.lookup(w)
        allocator = sim.state.allocators[record.index]
        if o.untyped_storage()._cdata == b.untyped_storage()._cdata:
            block = grown if grown is not None else allocator.allocate(
                0 if fake_mode() is not None else o.untyped_storage().nbytes())
            allocator.free(record.block)
            record.block = block
        else:
            if grown is not None:
                allocator.free(grown)
            record = sim.allocate(o, record.index)
        storages[_storage_key(o)] = record
    moved = sim.wrap(o, record)
    with _no_python_dispatch(), _no_torch_function():  # metadata only: no device guard
        torch.Tensor.set_(w, moved.untyped_storage(), o.storage_offset(), o.shape,
                          o.stride())


# [Note: resizing writes that do not fit]
# On CUDA an op resizing its output (``out=``, ``resize_``) allocates the grown storage
# before it computes anything: when that does not fit, the output keeps its values, shape
# and memory. The simulation runs such an op on the CPU, which grows the backing's storage
# there, so it runs it first into backings whose storage cannot grow (over the same
# memory): an op that fits needs nothing more (its new shape is copied onto the backing),
# and one that would grow its output stops before computing. That one is sized on the meta
# device (slow in torch, so only then), the grown storages are allocated, and the op runs
# again on the real backings. An output sharing its storage with an input runs on the real
# backing (an alias over the same memory would hide the overlap from torch's checks), and
# so does an op with no meta kernel: those grow first and count the memory after.
_unresizable_storage: Any = getattr(torch._C, "_construct_storage_from_data_pointer", None)


def _run_resizing(sim: Tensors, index: int, func: Any, args: Any, kwargs: dict[str, Any],
                  cargs: list[Any], ckwargs: dict[str, Any],
                  originals: dict[int, torch.Tensor]) -> tuple[Any, dict[int, int]]:
    """Run resizing op ``func`` on the backings (See [Note: resizing writes that do not
    fit]): what it returned, and the blocks allocated for the storages it grew, by id of
    the backing."""
    op = CPU_EQUIVALENT.get(func, func)
    if _SEEDED in func.tags and not _has_generator(args, kwargs):
        def call(a: Any, k: dict[str, Any]) -> Any:
            return sim.draw(index, op, *a, **k)
    else:
        def call(a: Any, k: dict[str, Any]) -> Any:
            return op(*a, **k)
    written = _written_arguments(func)
    aliases: dict[int, torch.Tensor] = {}  # id(alias) -> the backing it stands for
    if _unresizable_storage is not None:
        read = {x.untyped_storage()._cdata for i, a in enumerate(cargs) if i not in written
                for x in (a if type(a) is list or type(a) is tuple else (a,))
                if isinstance(x, torch.Tensor)}
        acargs = [_alias(a, originals, read, aliases) if i in written else a
                  for i, a in enumerate(cargs)]
        ackwargs = {k: _alias(v, originals, read, aliases) if k in written else v
                    for k, v in ckwargs.items()}
        if aliases:
            try:
                out = call(acargs, ackwargs)
            except RuntimeError as exc:
                if "not resizable" not in str(exc):
                    raise
            else:
                for a in (*acargs, *ackwargs.values()):
                    for x in (a if type(a) is list or type(a) is tuple else (a,)):
                        b = aliases.get(id(x)) if isinstance(x, torch.Tensor) else None
                        if b is not None and (x.shape != b.shape or x.stride() != b.stride()
                                              or x.storage_offset() != b.storage_offset()):
                            b.set_(b.untyped_storage(), x.storage_offset(), x.shape,
                                   x.stride())
                return _map_tensors(lambda o: aliases.get(id(o), o), out), {}
    grown = _grow_first(sim, index, func, written, cargs, ckwargs, originals)
    try:
        return call(cargs, ckwargs), grown
    except BaseException:
        for block in grown.values():
            sim.state.allocators[index].free(block)
        raise


def _alias(b: Any, originals: dict[int, torch.Tensor], read: set[int],
           aliases: dict[int, torch.Tensor]) -> Any:
    """Backing ``b`` (or a list of them) over a storage that cannot grow, noted in
    ``aliases``; ``b`` itself when it is no simulated tensor's backing or its storage is
    one an input reads."""
    if type(b) is list or type(b) is tuple:
        return type(b)(_alias(x, originals, read, aliases) for x in b)
    if not isinstance(b, torch.Tensor) or id(b) not in originals:
        return b
    storage = b.untyped_storage()
    if storage._cdata in read:
        return b
    fixed = torch.empty(0, dtype=b.dtype).set_(
        _unresizable_storage(storage.data_ptr(), b.device, storage.nbytes()),
        b.storage_offset(), b.shape, b.stride())
    aliases[id(fixed)] = b
    return fixed


def _grow_first(sim: Tensors, index: int, func: Any, written: tuple[int | str, ...],
                cargs: list[Any], ckwargs: dict[str, Any],
                originals: dict[int, torch.Tensor]) -> dict[int, int]:
    """The blocks for the storages that op ``func`` will grow, by id of the backing it
    writes, allocated before it runs (raises CUDA's OOM). Sized by running the op on the
    meta device; empty when it has no meta kernel."""
    metas: dict[int, torch.Tensor] = {}

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            m = metas[id(x)] = torch.empty(0, dtype=x.dtype, device="meta").set_(
                torch.UntypedStorage(x.untyped_storage().nbytes(), device="meta"),
                x.storage_offset(), x.shape, x.stride())
            return m
        if type(x) is list or type(x) is tuple:
            return type(x)(meta(y) for y in x)
        return x

    try:
        with warnings.catch_warnings():  # torch's "output was resized" comes with the real op
            warnings.simplefilter("ignore")
            func(*[meta(a) for a in cargs], **{k: meta(v) for k, v in ckwargs.items()})
    except Exception:
        return {}
    targets: list[Any] = []
    for w in written:
        x = ckwargs.get(w) if isinstance(w, str) else cargs[w] if w < len(cargs) else None
        targets += x if type(x) is list or type(x) is tuple else [x]
    allocator = sim.state.allocators[index]
    blocks: dict[int, int] = {}
    try:
        for t in targets:
            if id(t) in originals and id(t) in metas:
                nbytes = metas[id(t)].untyped_storage().nbytes()
                if nbytes > t.untyped_storage().nbytes():
                    blocks[id(t)] = allocator.allocate(nbytes)
    except BaseException:
        for block in blocks.values():
            allocator.free(block)
        raise
    return blocks


def _views_of_fakes(uses: list[tuple[Record, torch.Tensor, torch.Tensor]],
                    fresh: dict[int, torch.Tensor], storages: dict[int, Record]) -> None:
    """Under a fake mode (a trace), an op on a real backing ran on the fake that backing
    became: an output in that fake's storage is a view of the argument (a chunk of the data,
    ``data.split(n)``), of its allocation, not a new one. Moves such outputs from ``fresh``
    to the argument's allocation in ``storages``."""
    for record, _, b in uses:
        ptr = _fake_key(b)
        if ptr in fresh:
            del fresh[ptr]
            storages[ptr] = record


def _fake_owner(o: torch.Tensor, backings: Any) -> Any:
    """The (simulated tensor, allocation, backing) whose real backing ``o`` is a view of
    under a fake mode (a trace: the op ran on the fake that backing became, as in
    ``_views_of_fakes``), or None: a slice of the data is not new memory."""
    key = _storage_key(o)
    for owner in backings:
        if _fake_key(owner[2]) == key:
            return owner
    return None


def _fake_key(b: torch.Tensor) -> int | None:
    """Under a fake mode, the storage key of the fake that real backing ``b`` became (what an
    op on ``b`` ran on); None for a backing that is fake already."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(b, FakeTensor):
        return None
    return _storage_key(fake_mode().from_tensor(b))


class _Unwrapping:
    """The arguments of one op with simulated tensors replaced by their backings, and what
    was seen on the way: the device, a CPU tensor among them, the allocations used."""

    __slots__ = ("sim", "index", "cpu_arg", "uses", "originals", "storages")

    def __init__(self, sim: Tensors) -> None:
        self.sim = sim
        self.index: int | None = None
        self.cpu_arg: torch.Tensor | None = None
        # (allocation, simulated tensor, its backing) of every simulated argument
        self.uses: list[tuple[Record, torch.Tensor, torch.Tensor]] = []
        self.originals: dict[int, torch.Tensor] = {}  # id(backing) -> simulated tensor
        self.storages: dict[int, Record] = {}  # backing data_ptr -> its allocation

    def args(self, args: Any) -> Any:
        out = list(args)
        for i, a in enumerate(args):
            if type(a) is list or type(a) is tuple:
                out[i] = type(a)(self.leaf(y) for y in a)
            else:
                out[i] = self.leaf(a)
        return out

    def kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not kwargs:
            return kwargs
        out = {}
        for k, a in kwargs.items():
            if type(a) is list or type(a) is tuple:
                out[k] = type(a)(self.leaf(y) for y in a)
            else:
                out[k] = self.leaf(a)
        return out

    def leaf(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                b, record = self.sim.lookup(x)
                if self.index is None:
                    self.index = record.index
                elif record.index != self.index:
                    raise mixed(f"cuda:{self.index}", f"cuda:{record.index}")
                self.uses.append((record, x, b))
                self.originals[id(b)] = x
                self.storages[_storage_key(b)] = record
                return b
            if self.cpu_arg is None and x.dim() and x.device.type == "cpu":
                self.cpu_arg = x
            return x
        if type(x) is torch.UntypedStorage and x.device.type == "cuda":
            # A simulated tensor's storage (``set_(storage)``): its backing's host storage.
            b, record = self.sim.lookup_storage(x)
            if self.index is None:
                self.index = record.index
            elif record.index != self.index:
                raise mixed(f"cuda:{self.index}", f"cuda:{record.index}")
            self.storages[_storage_key(b)] = record
            return b.untyped_storage()
        if isinstance(x, torch.device) and x.type == "cuda":
            wanted = self.sim.state.device_index(x)
            if self.index is not None and wanted != self.index:
                raise mixed(f"cuda:{self.index}", f"cuda:{wanted}")
            self.index = wanted
            return _CPU
        return x


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned (a tensor, or tuples and lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        found = []
        for o in out:
            found += _tensors_in(o)
        return found
    return []


def _map_tensors(fn: Any, out: Any) -> Any:
    """``out`` with every tensor in it replaced by ``fn(tensor)``, containers kept."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if type(out) is tuple or type(out) is list:
        return type(out)(_map_tensors(fn, o) for o in out)
    if isinstance(out, tuple):  # torch.return_types.* (one sequence) or a named tuple
        items = [_map_tensors(fn, o) for o in out]
        return type(out)(items) if hasattr(type(out), "n_fields") else type(out)(*items)
    if isinstance(out, list):
        return type(out)(_map_tensors(fn, o) for o in out)
    return out


_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_MASKED_FILLS = {getattr(op, name) for op in (aten.masked_fill, aten.masked_fill_)
                 for name in op.overloads()}
_DEVICE_GUARD_ERROR = getattr(torch, "AcceleratorError", RuntimeError)


def _backward(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``loss.backward()`` of a simulated device tensor: refused, saying why (autograd
    cannot run on the simulation), rather than torch's "does not require grad"."""
    if args[0].is_cuda:
        raise SimulatedCudaError(
            "backward() of a tensor on the simulated CUDA device: the simulation has no "
            "autograd (ops on its tensors run under no_grad, as a driverless CUDA tensor "
            "that requires grad would end the process). Test training steps on the CPU, or "
            "on a real GPU")
    return func(*args, **kwargs)


_VIEWS: dict[Any, bool] = {}  # op -> whether its outputs are views of its inputs


def _basic_index(index: Any) -> bool:
    """Whether ``t[index]`` is a view (ints, slices, None, ...), not a gather."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


# ``t.data = ...`` reaches a mode as ``_DATA.__set__``: a method wrapper made anew at each
# access, equal (and hashed) by what it wraps, so a handler can be keyed by one.
_DATA = torch._C.TensorBase.data


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_no_subclass_function = torch._C.DisableTorchFunctionSubclass


def _storage_key(t: torch.Tensor) -> int:
    """What tells a backing's storage apart: its data pointer, or for a fake tensor (made
    under ``FakeTensorMode``, an ``initial_batchsize="auto"`` trace through a placed model),
    which has no data, the storage object itself; views share either."""
    storage = t.untyped_storage()
    if storage.device.type == "meta":
        return int(storage._cdata)
    return int(storage.data_ptr())
_no_python_dispatch = torch._C._DisableTorchDispatch
_has_cpu_kernel = torch._C._dispatch_has_computed_kernel_for_dispatch_key
# A build of torch for the CPU only registers no CUDA kernel at all: nothing can be told.
_CUDA_KERNELS = _has_cpu_kernel("aten::add.Tensor", "CUDA")
_HOST_ONLY: dict[Any, bool] = {}


def _slices_on_backings(sim: Any, func: Any, args: Any) -> Any:
    """``args`` of ``func``, with device tensors inside the slices of an index (``x[:, :n]``,
    ``n`` a 0-dim device tensor, as transformers' beam search writes) read from their
    backings: torch reads a slice's bounds in C++, past the simulation, where a device
    tensor asks the driver."""
    if func not in _INDEXING or len(args) < 2:
        return args

    def bound(v: Any) -> Any:
        if not (isinstance(v, torch.Tensor) and v.is_cuda):
            return v
        backing, record = sim.lookup(v)
        sim.use(record, sim.state.current_streams[record.index], v, "__index__")  # as item()
        return backing

    def one(i: Any) -> Any:
        if isinstance(i, slice) and any(isinstance(v, torch.Tensor)
                                        for v in (i.start, i.stop, i.step)):
            return slice(bound(i.start), bound(i.stop), bound(i.step))
        return i

    index = args[1]
    kind = type(index)  # a list holding slices is an index too (deprecated), as a tuple
    index = kind(map(one, index)) if kind is tuple or kind is list else one(index)
    return (args[0], index, *args[2:])


def _host_only(func: Any) -> bool:
    """Whether op ``func`` has kernels for the CPU and none for CUDA (a dynamic quantized
    linear): a GPU refuses it on device tensors, so the simulation does too. Asked once
    per op (see [Note: the per-op cost of the simulation])."""
    known = _HOST_ONLY.get(func)
    if known is None:
        name = func.name()
        known = _HOST_ONLY[func] = (_CUDA_KERNELS and func not in CPU_EQUIVALENT
                                    and not _has_cpu_kernel(name, "CUDA")
                                    and _has_cpu_kernel(name, "CPU"))
    return known


# Factories that draw no random numbers and return one tensor.
_PLAIN_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_like,
                    torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_strided,
                    torch.arange, torch.eye, torch.linspace}
_LIKE_FACTORIES = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like}
_increment_version = torch._C._increment_version
_storage_use_count = torch._C._storage_Use_Count
# The keyword arguments of an ``empty_like`` that a kept host storage can serve.
_EMPTY_LIKE_PLAIN = {"device", "dtype", "memory_format"}
# Smaller blocks come from malloc's heap, cheaper than a kept storage's ``set_``.
_KEPT_SIZE = 128 * 1024
_BINDING_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType,
                  types.GetSetDescriptorType)


def _is_binding(func: Any) -> bool:
    """``func`` is a C binding of torch (``torch.add``, ``Tensor.add``, a property getter;
    not cached by identity: a getter's method-wrapper is a new object at every access)."""
    return isinstance(func, _BINDING_TYPES)


def _plain_arguments(args: Any, kwargs: dict[str, Any]) -> bool:
    """No simulated tensor among ``args``, no tensor among ``kwargs``."""
    for a in args:
        if isinstance(a, SimTensor):
            return False
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return False
    return True


def _call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return func(*args, **kwargs)


def _to_copy(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``aten._to_copy`` without grad: a host tensor that requires it (a CPU layer's output in
    grad mode) reaches the device without its graph. Recorded in autograd, a CUDA tensor
    would have autograd ask the real driver for its stream, which ends the process."""
    with torch.no_grad():
        return aten._to_copy.default(x, **kwargs)


def _touches_cuda(args: Any, kwargs: dict[str, Any]) -> bool:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                return True
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, torch.Tensor) and y.is_cuda:
                    return True
    return False


class Functions(TorchFunctionMode):
    def __init__(self, sim: Tensors) -> None:
        super().__init__()
        self.sim = sim
        self.handlers = {
            torch.Tensor.to: self._to,
            # Parses ``Module.to``'s arguments; with ``device=`` it would look like a factory.
            torch._C._nn._parse_to: _call,
            torch.Tensor.cuda: self._cuda,
            torch.Tensor.copy_: self._copy,
            torch.Tensor.record_stream: self._record_stream,
            torch.Tensor.data_ptr: self._data_ptr,
            torch.Tensor.numpy: _numpy,
            torch.Tensor.__array__: _numpy,
            # Bindings that take the tensor's device guard: run on the backing (others are
            # found when they raise, see handle()).
            torch.Tensor.__getitem__: self._on_backing,
            torch.Tensor.__setitem__: self._on_backing,
            torch.Tensor.__invert__: self._on_backing,
            # Its composite picks a fused kernel by the device type, past the dispatcher:
            # where torch has real CUDA, a CUDA-only one (memory-efficient, flash) that the
            # host cannot run. On the backings it takes the CPU's choice and values.
            torch.nn.functional.scaled_dot_product_attention: self._on_backing,
            # torch prints with every mode popped, and refuses tolist() for subclasses and
            # formats a 0-dim one by value only when its type is exactly Tensor.
            torch.Tensor.__repr__: _repr,
            torch.Tensor.tolist: _tolist,
            torch.Tensor.__format__: _format,
            torch.Tensor.backward: _backward,
            _DATA.__set__: self._set_data,  # type: ignore[attr-defined]
        }

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.handle(func, args, kwargs or {})

    def handle(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        handler = self.handlers.get(func)
        if handler is not None:
            # Handlers call C bindings only (see [Note: the per-op cost of the simulation]).
            with _no_subclass_function():
                # Without grad only where a simulated tensor is (the simulation has no
                # autograd): a host tensor's slice, copy or cast keeps its graph.
                if torch.is_grad_enabled() and _touches_cuda(args, kwargs):
                    with torch.no_grad():
                        return handler(func, args, kwargs)
                return handler(func, args, kwargs)
        device = kwargs.get("device")
        if kwargs.get("generator") is not None:
            _check_generator(args, kwargs)
        if device is not None and _is_cuda(device):
            return self._factory(func, args, kwargs)
        if kwargs.get("pin_memory"):
            out = func(*args, **{**kwargs, "pin_memory": False})
            return tree_map(lambda o: self.sim.pin(o) if isinstance(o, torch.Tensor) else o, out)
        try:
            if _is_binding(func):
                # See [Note: the per-op cost of the simulation]. A C binding has no Python
                # body whose calls the subclass hook would need to see: run it without.
                with _no_subclass_function():
                    if torch.is_grad_enabled() and _touches_cuda(args, kwargs):
                        with torch.no_grad():
                            return func(*args, **kwargs)
                    return func(*args, **kwargs)
            if torch.is_grad_enabled() and _touches_cuda(args, kwargs):
                with torch.no_grad():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        except _DEVICE_GUARD_ERROR:
            # The binding took the real CUDA device guard before any op ran.
            if not _touches_cuda(args, kwargs):
                raise
        with torch.no_grad():
            return self._on_backing(func, args, kwargs)

    def _factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        index = self.sim.state.device_index(kwargs["device"])
        kwargs = {**kwargs, "device": "cpu"}
        kwargs.pop("requires_grad", None)
        layout = kwargs.get("layout")
        if layout is None and func in _LIKE_FACTORIES and args and isinstance(
                args[0], torch.Tensor):
            layout = args[0].layout
        if layout is not None:
            refuse_layout(layout, func, self.sim.devices[index])
        if func in _PLAIN_FACTORIES and _plain_arguments(args, kwargs):
            return self._plain_factory(index, func, args, kwargs)
        # Sizes first (on the meta device): an allocation that does not fit costs nothing.
        try:
            with torch.no_grad():
                shapes = tree_flatten(func(*args, **{**kwargs, "device": "meta"}))[0]
        except Exception:
            shapes = None
        if shapes is not None:
            for o in shapes:
                if isinstance(o, torch.Tensor):
                    refuse_layout(o.layout, func, self.sim.devices[index])
            records = iter(self.sim.reserve_all(
                [o.untyped_storage().nbytes() for o in shapes if isinstance(o, torch.Tensor)],
                index))
            out = self._make_on_cpu(index, func, args, kwargs)
            wrap = self.sim.wrap

            def made(o: torch.Tensor) -> torch.Tensor:
                w = wrap(o, next(records))
                count_allocation(w)
                return w

            return tree_map(lambda o: made(o) if isinstance(o, torch.Tensor) else o, out)
        out = self._make_on_cpu(index, func, args, kwargs)
        adopt = self.sim.adopt
        return tree_map(lambda o: adopt(o, index) if isinstance(o, torch.Tensor) else o, out)

    def _plain_factory(self, index: int, func: Any, args: Any,
                       kwargs: dict[str, Any]) -> torch.Tensor:
        """A factory that draws nothing, of host arguments (``empty_like(host_tensor,
        device="cuda")``, the pager's every copy): made without the dispatch mode, which
        has nothing to do there."""
        with _no_python_dispatch():
            # Size first: an allocation that does not fit costs nothing. A ``*_like``
            # factory makes a tensor of its input's element count (dense, at offset 0),
            # so only the others need the meta device to tell.
            if func in _LIKE_FACTORIES and args[0].layout is torch.strided:
                dtype = kwargs.get("dtype") or args[0].dtype
                nbytes = args[0].numel() * dtype.itemsize
            else:
                nbytes = func(*args, **{**kwargs, "device": "meta"}).untyped_storage().nbytes()
            record = self.sim.reserve(nbytes, index)
            try:
                out = None
                if func is torch.empty_like and kwargs.keys() <= _EMPTY_LIKE_PLAIN and (
                        kwargs.get("memory_format") in (None, torch.preserve_format)):
                    out = self.sim.empty_backing(args[0], kwargs.get("dtype") or args[0].dtype,
                                                 record)
                if out is None:
                    out = func(*args, **kwargs)
            except BaseException:
                self.sim.state.allocators[index].free(record.block)
                raise
        made = self.sim.wrap(out, record)
        count_allocation(made)  # made with the modes off: a trace would not see it
        return made

    def _make_on_cpu(self, index: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func`` run on the CPU for ``cuda:index``: its random draws come from that
        device's generator (see [Note: simulated random state])."""
        state = self.sim.state
        previous, state.drawing_for = state.drawing_for, index
        try:
            with torch.no_grad():
                return func(*args, **kwargs)
        finally:
            state.drawing_for = previous

    def _to(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        x, *rest = args
        kwargs = dict(kwargs)
        copy = kwargs.pop("copy", False)
        if len(rest) >= 3 and isinstance(rest[2], bool):  # to(device, dtype, non_blocking, copy)
            copy = rest.pop(3) if len(rest) > 3 else copy
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
        if not x.is_cuda and not (device is not None and device.type == "cuda"):
            if ((device is None or device == x.device) and (dtype is None or dtype == x.dtype)
                    and not copy and memory_format in (None, torch.preserve_format)):
                return x  # as torch does; under a dispatch mode torch would copy
            return func(*args, **kwargs, **({"copy": copy} if copy else {}))
        if device is None:
            device = x.device
        elif device.type == "cuda":
            device = self.sim.devices[self.sim.state.device_index(device)]
        dtype = dtype or x.dtype
        if device == x.device and dtype == x.dtype and not copy and memory_format in (
                None, torch.preserve_format):
            return x
        return _to_copy(x, dtype=dtype, device=device, non_blocking=non_blocking,
                        memory_format=memory_format or torch.preserve_format)

    def _set_data(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        target, data = args  # ``target.data = data``: see Tensors.let_go
        if type(target) is not SimTensor and isinstance(data, SimTensor) and data.is_cuda:
            self.sim.given_data[id(target)] = weakref.ref(target)
        return func(*args, **kwargs)

    def _cuda(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        # ``Tensor.cuda(device=None, non_blocking=False, memory_format=preserve_format)``,
        # each by position or by name.
        x = args[0]
        device = args[1] if len(args) > 1 else kwargs.get("device")
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        memory_format = (args[3] if len(args) > 3
                         else kwargs.get("memory_format", torch.preserve_format))
        index = self.sim.state.device_index(device)
        if x.is_cuda and x.device.index == index:
            if memory_format is torch.preserve_format or x.is_contiguous(
                    memory_format=memory_format):
                return x
            return aten.clone.default(x, memory_format=memory_format)  # as .contiguous
        return _to_copy(x, device=self.sim.devices[index], non_blocking=bool(non_blocking),
                        memory_format=memory_format)

    def _copy(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not (dst.is_cuda or (isinstance(src, torch.Tensor) and src.is_cuda)):
            return func(*args, **kwargs)
        if dst.is_cuda and (type(src) is torch.Tensor or (
                isinstance(src, torch.Tensor) and src.is_cuda and fake_mode() is None)):
            # See [Note: the per-op cost of the simulation]: what aten.copy_ would reach
            # through the dispatch mode, called directly (into a simulated tensor, whose
            # backing is written); the version counter is bumped as the in-place op would.
            # Under a trace, device backings may be fakes: only the fake mode copies those.
            with _no_python_dispatch():
                self.sim.copy(dst, src, bool(non_blocking))
            _increment_version((dst,))
            return dst
        return aten.copy_.default(dst, src, non_blocking)

    def _record_stream(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        t, stream = args[0], args[1] if len(args) > 1 else kwargs["stream"]
        if not t.is_cuda:  # record_stream has only a CUDA kernel
            raise NotImplementedError(
                f"Could not run 'aten::record_stream' with arguments from the "
                f"'{t.device.type.upper()}' backend (simulated CUDA: record_stream is for "
                f"device tensors; a host tensor needs no record of the streams using it)")
        self.sim.record_stream(t, stream)
        return None

    def _on_backing(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run ``func`` on the backings of its simulated tensors (a binding that would take
        the real CUDA device guard), and wrap what it returns."""
        sim = self.sim
        out_arg = kwargs.get("out")
        if isinstance(out_arg, torch.Tensor) and out_arg.is_cuda:
            # ``torch.nonzero(x, out=o)``: the result made on its own, then written into
            # ``out`` by the ops the simulation follows (its resize, its memory).
            made = self._on_backing(func, args, {k: v for k, v in kwargs.items() if k != "out"})
            return out_arg.resize_(made.shape).copy_(made)
        args = _slices_on_backings(sim, func, args)
        flat, spec = tree_flatten((args, kwargs))
        index: int | None = None
        cpu_arg = False
        backings: dict[int, tuple[torch.Tensor, Record, torch.Tensor]] = {}
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                if x.is_cuda:
                    b, record = sim.lookup(x)
                    if index is not None and record.index != index:
                        raise mixed(f"cuda:{index}", f"cuda:{record.index}")
                    index = record.index
                    if not (i == 0 and func is torch.Tensor.__getitem__
                            and _basic_index(args[1])):  # a view reads nothing
                        sim.use(record, sim.state.current_streams[index], x, func.__name__)
                    backings.setdefault(_storage_key(b), (x, record, b))
                    flat[i] = b
                elif x.dim():
                    cpu_arg = True
        if index is None:
            return func(*args, **kwargs)
        on_host = func in _INDEXING and not args[0].is_cuda  # ``host[device_index]``
        if cpu_arg or on_host:
            if func not in _INDEXING:
                raise mixed(f"cuda:{index}", "cpu")
            check_item_access(func, args)
        cargs, ckwargs = tree_unflatten(flat, spec)
        state = sim.state
        previous, state.drawing_for = state.drawing_for, index
        try:
            with _no_torch_function():
                out = func(*cargs, **ckwargs)
        finally:
            state.drawing_for = previous
        if on_host:
            return out  # a host tensor's item or view, or None (a write into it)
        if func is torch.Tensor.__setitem__:
            # Its backing was written: See [Note: views and inference tensors].
            _increment_version((args[0],))
        first = cargs[0] if cargs else None

        def wrap(o: Any) -> Any:
            if not isinstance(o, torch.Tensor):
                return o
            if o is first and isinstance(args[0], torch.Tensor):
                return args[0]  # in place
            owner = backings.get(_storage_key(o))
            if owner is None and fake_mode() is not None:
                owner = _fake_owner(o, backings.values())
            if owner is None:
                return sim.adopt(o, index)
            base = owner[0]
            if o.dtype != base.dtype:
                return sim.wrap(o, owner[1])
            # A view of ``base``, made by a view op so that torch records it as one (See
            # [Note: views and inference tensors]); a view as another dtype stays apart.
            with _no_torch_function():
                return aten.as_strided.default(base, o.shape, o.stride(), o.storage_offset())

        return tree_map(wrap, out)

    def _data_ptr(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        return self.sim.lookup(t)[0].data_ptr() if t.is_cuda else func(*args, **kwargs)
